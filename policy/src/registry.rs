//! The address sets in use: each set's definition, how many rules reference it, and
//! its id. A set exists in the desired state exactly while some rule references it.
//! Also tracks the egress named-port groups and the numbers their names resolve to.

use std::collections::{BTreeSet, HashMap};

use super::change::Change;
use super::interner::SetInterner;
use super::sets::{NamedPortGroup, SetDef};
use super::spec::PeerSpec;
use crate::desired::{AddressSet, Desired, Peer, SetId};
use crate::model::ClusterModel;

#[derive(Debug)]
struct Entry {
    def: SetDef,
    refs: usize,
}

#[derive(Debug, Default)]
struct Group {
    numbers: BTreeSet<u16>,
    /// Policies (`namespace/name`) with an egress rule using this group.
    policies: BTreeSet<String>,
}

#[derive(Debug, Default)]
pub struct SetRegistry {
    interner: SetInterner,
    /// Ids by definition; peers separately so that the hot lookup needs no clone.
    peer_ids: HashMap<PeerSpec, SetId>,
    named_port_ids: HashMap<(NamedPortGroup, u16), SetId>,
    entries: HashMap<SetId, Entry>,
    groups: HashMap<NamedPortGroup, Group>,
    /// Sets whose reference count changed since the last [`SetRegistry::settle`].
    dirty: BTreeSet<SetId>,
}

impl SetRegistry {
    pub fn peer_id(&mut self, peer: &PeerSpec) -> SetId {
        match self.peer_ids.get(peer) {
            Some(id) => *id,
            None => self.register(SetDef::Peer(peer.clone())),
        }
    }

    pub fn named_port_id(&mut self, group: &NamedPortGroup, number: u16) -> SetId {
        let key = (group.clone(), number);
        match self.named_port_ids.get(&key) {
            Some(id) => *id,
            None => self.register(SetDef::NamedPort(key.0, key.1)),
        }
    }

    fn register(&mut self, def: SetDef) -> SetId {
        let id = self.interner.intern(&def.definition());
        // Definitions are canonical: two different set definitions never render the same.
        debug_assert!(
            !self.entries.contains_key(&id),
            "two set definitions render as {:?}",
            def.definition()
        );
        self.dirty.insert(id);
        match &def {
            SetDef::Peer(peer) => self.peer_ids.insert(peer.clone(), id),
            SetDef::NamedPort(group, number) => {
                self.named_port_ids.insert((group.clone(), *number), id)
            }
        };
        self.entries.insert(id, Entry { def, refs: 0 });
        id
    }

    pub fn definition(&self, id: SetId) -> Option<&SetDef> {
        self.entries.get(&id).map(|e| &e.def)
    }

    /// Counts a reference from each peer.
    pub fn add_refs(&mut self, peers: impl Iterator<Item = Peer>) {
        for id in peers.filter_map(peer_set) {
            if let Some(e) = self.entries.get_mut(&id) {
                e.refs += 1;
                self.dirty.insert(id);
            }
        }
    }

    pub fn remove_refs(&mut self, peers: impl Iterator<Item = Peer>) {
        for id in peers.filter_map(peer_set) {
            if let Some(e) = self.entries.get_mut(&id) {
                e.refs -= 1;
                self.dirty.insert(id);
            }
        }
    }

    /// Brings the desired state's sets in line with the reference counts: creates newly
    /// referenced sets (members from the model) and removes unreferenced ones.
    pub fn settle(&mut self, model: &ClusterModel, desired: &mut Desired, change: &mut Change) {
        for id in std::mem::take(&mut self.dirty) {
            let Some(entry) = self.entries.get(&id) else {
                continue;
            };
            if entry.refs == 0 {
                change.touch_set(desired, id);
                desired.sets.remove(&id);
                match self.entries.remove(&id).map(|e| e.def) {
                    Some(SetDef::Peer(peer)) => self.peer_ids.remove(&peer),
                    Some(SetDef::NamedPort(group, number)) => {
                        self.named_port_ids.remove(&(group, number))
                    }
                    None => None,
                };
                self.interner.release(id);
            } else if !desired.sets.contains_key(&id) {
                change.touch_set(desired, id);
                let set = AddressSet {
                    id,
                    definition: entry.def.definition(),
                    members: entry.def.members(model),
                };
                desired.sets.insert(id, set);
            }
        }
    }

    /// Live sets (referenced, so present in the desired state) and their definitions.
    pub fn live(&self) -> impl Iterator<Item = (SetId, &SetDef)> {
        self.entries
            .iter()
            .filter(|(_, e)| e.refs > 0)
            .map(|(id, e)| (*id, &e.def))
    }

    pub fn add_group_user(&mut self, model: &ClusterModel, group: &NamedPortGroup, policy: &str) {
        let g = self.groups.entry(group.clone()).or_insert_with(|| Group {
            numbers: group.numbers(model),
            policies: BTreeSet::new(),
        });
        g.policies.insert(policy.to_owned());
    }

    pub fn remove_group_user(&mut self, group: &NamedPortGroup, policy: &str) {
        if let Some(g) = self.groups.get_mut(group) {
            g.policies.remove(policy);
            if g.policies.is_empty() {
                self.groups.remove(group);
            }
        }
    }

    /// The numbers `group`'s name resolves to (empty for an unknown group).
    pub fn group_numbers(&self, group: &NamedPortGroup) -> BTreeSet<u16> {
        self.groups
            .get(group)
            .map(|g| g.numbers.clone())
            .unwrap_or_default()
    }

    /// Recomputes the numbers of the groups `affected` says may have changed; returns the
    /// policies using a group whose numbers did change.
    pub fn refresh_groups(
        &mut self,
        model: &ClusterModel,
        affected: impl Fn(&NamedPortGroup) -> bool,
    ) -> BTreeSet<String> {
        let mut policies = BTreeSet::new();
        for (group, g) in self.groups.iter_mut().filter(|(k, _)| affected(k)) {
            let numbers = group.numbers(model);
            if numbers != g.numbers {
                g.numbers = numbers;
                policies.extend(g.policies.iter().cloned());
            }
        }
        policies
    }

    pub fn clear(&mut self) {
        *self = SetRegistry::default();
    }
}

fn peer_set(peer: Peer) -> Option<SetId> {
    match peer {
        Peer::Set(id) => Some(id),
        Peer::Any => None,
    }
}
