//! Records what one engine operation changed in the desired state, cheaply (no copies of
//! large sets), and turns it into the [`Delta`] the engine returns, or only says whether
//! anything changed (the agent's question) without building one.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::desired::{Delta, Desired, Endpoint, Member, PodKey, SetId};

#[derive(Debug, Default)]
pub struct Change {
    /// Whether each touched set existed before the operation.
    sets_existed: HashMap<SetId, bool>,
    members_added: BTreeSet<(SetId, Member)>,
    members_removed: BTreeSet<(SetId, Member)>,
    endpoints_before: BTreeMap<PodKey, Option<Endpoint>>,
}

impl Change {
    pub fn touch_set(&mut self, desired: &Desired, id: SetId) {
        self.sets_existed
            .entry(id)
            .or_insert_with(|| desired.sets.contains_key(&id));
    }

    pub fn touch_endpoint(&mut self, desired: &Desired, pod: &str) {
        if !self.endpoints_before.contains_key(pod) {
            let before = desired.endpoints.get(pod).cloned();
            self.endpoints_before.insert(pod.to_owned(), before);
        }
    }

    /// Adds `member` to set `id` in `desired`, recording it.
    pub fn add_member(&mut self, desired: &mut Desired, id: SetId, member: Member) {
        self.touch_set(desired, id);
        let Some(set) = desired.sets.get_mut(&id) else {
            return;
        };
        if set.members.insert(member) && !self.members_removed.remove(&(id, member)) {
            self.members_added.insert((id, member));
        }
    }

    pub fn remove_member(&mut self, desired: &mut Desired, id: SetId, member: Member) {
        self.touch_set(desired, id);
        let Some(set) = desired.sets.get_mut(&id) else {
            return;
        };
        if set.members.remove(&member) && !self.members_added.remove(&(id, member)) {
            self.members_removed.insert((id, member));
        }
    }

    /// Whether the operation changed the desired state: exactly `!into_delta(..).is_empty()`
    /// (a property test holds them together), without copying what changed.
    pub fn changed(&self, desired: &Desired) -> bool {
        let mut survivors = std::collections::HashSet::new();
        for (id, before) in &self.sets_existed {
            match (*before, desired.sets.contains_key(id)) {
                (true, true) => {
                    survivors.insert(*id);
                }
                (false, true) | (true, false) => return true,
                (false, false) => {}
            }
        }
        let member_changed = self
            .members_added
            .iter()
            .chain(&self.members_removed)
            .any(|(id, _)| survivors.contains(id));
        member_changed
            || self
                .endpoints_before
                .iter()
                .any(|(pod, old)| old.as_ref() != desired.endpoints.get(pod))
    }

    pub fn into_delta(self, desired: &Desired) -> Delta {
        let mut delta = Delta::default();
        let mut existed: Vec<_> = self.sets_existed.into_iter().collect();
        existed.sort();
        let mut survivors = BTreeSet::new();
        for (id, before) in existed {
            match (before, desired.sets.get(&id)) {
                (false, Some(set)) => delta.sets_added.push(set.clone()),
                (true, None) => delta.sets_removed.push(id),
                (true, Some(_)) => {
                    survivors.insert(id);
                }
                (false, None) => {}
            }
        }
        let surviving = |(id, _): &&(SetId, Member)| survivors.contains(id);
        delta.members_added = self
            .members_added
            .iter()
            .filter(surviving)
            .copied()
            .collect();
        delta.members_removed = self
            .members_removed
            .iter()
            .filter(surviving)
            .copied()
            .collect();

        let mut before = Desired::default();
        let mut after = Desired::default();
        for (pod, old) in self.endpoints_before {
            if let Some(new) = desired.endpoints.get(&pod) {
                after.endpoints.insert(pod.clone(), new.clone());
            }
            if let Some(old) = old {
                before.endpoints.insert(pod, old);
            }
        }
        let endpoints = before.diff(&after);
        delta.endpoints_added = endpoints.endpoints_added;
        delta.endpoints_changed = endpoints.endpoints_changed;
        delta.endpoints_removed = endpoints.endpoints_removed;
        delta
    }
}
