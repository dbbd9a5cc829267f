//! The identity plan kept up to date between convergences. A pod's label change moves one
//! address between sets; a full [`IdentityTable::plan`] walks every member of every set to
//! find that out (tens of milliseconds at 20,000 pods). The index keeps which sets hold
//! each member prefix, so a change of host members (/32, /128: pods) re-signs only those
//! prefixes. Any other change (a CIDR block came or went) plans in full: a block can
//! change the signature of every prefix inside it.
//!
//! The result is exactly the full plan's, ids included (a property test holds the two
//! together): new signatures take the lowest free ids in ascending prefix order, after
//! the ids of signatures no longer used are released; an id the kernel's maps still hold
//! (`reserved`: one released by this very change, until its convergence has removed it)
//! is not free.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use weir_common::IDENTITY_WORLD;
use weir_policy::desired::{AddressSet, SetId};

use super::identities::{trie_members, IdentityPlan, IdentityTable, Prefix, Signature};

/// A host prefix: one address (IPv4 lives in the trie as IPv4-mapped IPv6, so a /32 is
/// 128 long too).
const HOST_LEN: u8 = 128;

/// A change re-signing more than this many prefixes, and more than a quarter of all, is
/// planned in full: re-signing costs a lookup per member length and prefix, a full plan one
/// pass over every member. (At 20,000 pods, release build: a full plan 19–22 ms, one
/// pod re-signed 0.4–1.2 ms.)
const FULL_PAST: usize = 1024;

/// A set that changed: its id, its new value (none when it went) and its trie members.
type SetChange<'a> = (SetId, Option<&'a AddressSet>, BTreeSet<(Prefix, bool)>);

#[derive(Debug, Default)]
pub struct IdentityIndex {
    /// Each set as last planned, with its trie members.
    sets: BTreeMap<SetId, (AddressSet, BTreeSet<(Prefix, bool)>)>,
    /// Member prefix → the sets holding it (with whether as an except).
    holders: BTreeMap<Prefix, Vec<(SetId, bool)>>,
    /// How many member prefixes there are of each length: the lengths a covering member
    /// can have.
    lengths: BTreeMap<u8, usize>,
    /// Trie prefixes per dynamic identity.
    uses: HashMap<u32, usize>,
    plan: IdentityPlan,
    /// Whether a full plan was made (the first update makes one).
    built: bool,
}

/// How [`IdentityIndex::update`] brought the plan up to date.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Planned {
    /// No set changed.
    Unchanged,
    /// Only these many host prefixes were re-signed.
    Incremental(usize),
    /// Every set was planned again.
    Full,
}

impl IdentityIndex {
    pub fn plan(&self) -> &IdentityPlan {
        &self.plan
    }

    /// Brings the plan up to date with `sets`, keeping `table` (the persisted ids) in step.
    /// The first call plans in full. A new signature is never given an id of `reserved`
    /// (the ids the kernel's maps still hold, see [`IdentityTable::plan_reserving`]);
    /// `reserved` is called only when something is planned (it walks every map).
    pub fn update(
        &mut self,
        table: &mut IdentityTable,
        sets: &BTreeMap<SetId, AddressSet>,
        reserved: impl FnOnce() -> BTreeSet<u32>,
    ) -> Planned {
        if !self.built {
            return self.full(table, sets, &reserved());
        }
        // What changed, set by set, before anything is touched: a change that is not
        // host members only is planned in full.
        let mut changes: Vec<SetChange> = Vec::new();
        let mut touched: BTreeSet<Prefix> = BTreeSet::new();
        let gone = self.sets.keys().filter(|id| !sets.contains_key(id));
        for id in gone {
            changes.push((*id, None, BTreeSet::new()));
        }
        for (id, set) in sets {
            if self.sets.get(id).is_some_and(|(old, _)| old == set) {
                continue;
            }
            changes.push((*id, Some(set), trie_members(set).into_iter().collect()));
        }
        if changes.is_empty() {
            return Planned::Unchanged;
        }
        let reserved = &reserved();
        let empty = BTreeSet::new();
        for (id, _, new) in &changes {
            let old = self.sets.get(id).map_or(&empty, |(_, m)| m);
            for (p, _) in old.symmetric_difference(new) {
                if p.len != HOST_LEN {
                    return self.full(table, sets, reserved);
                }
                touched.insert(*p);
            }
        }
        if touched.len() > FULL_PAST && touched.len() * 4 > self.holders.len() {
            return self.full(table, sets, reserved);
        }
        for (id, set, new) in changes {
            let old = match set {
                Some(set) => self.sets.insert(id, (set.clone(), new.clone())),
                None => self.sets.remove(&id),
            }
            .map(|(_, m)| m)
            .unwrap_or_default();
            for member in old.difference(&new) {
                self.forget(id, *member);
            }
            for member in new.difference(&old) {
                self.hold(id, *member);
            }
        }
        let n = touched.len();
        self.resign(table, touched, reserved);
        Planned::Incremental(n)
    }

    /// Gives the signatures of `ids` fresh ids: plans every set again with them
    /// forgotten, and none of `reserved` (which must hold `ids`) given out.
    pub fn renumber(
        &mut self,
        table: &mut IdentityTable,
        sets: &BTreeMap<SetId, AddressSet>,
        reserved: &BTreeSet<u32>,
        ids: &BTreeSet<u32>,
    ) -> Planned {
        table.by_id.retain(|id, _| !ids.contains(id));
        self.full(table, sets, reserved)
    }

    /// Plans every set again and rebuilds the index from it.
    fn full(
        &mut self,
        table: &mut IdentityTable,
        sets: &BTreeMap<SetId, AddressSet>,
        reserved: &BTreeSet<u32>,
    ) -> Planned {
        *self = IdentityIndex {
            plan: table.plan_reserving(sets.values(), reserved),
            built: true,
            ..Default::default()
        };
        for (id, set) in sets {
            let members: BTreeSet<(Prefix, bool)> = trie_members(set).into_iter().collect();
            for member in &members {
                self.hold(*id, *member);
            }
            self.sets.insert(*id, (set.clone(), members));
        }
        for id in self.plan.trie.values() {
            if *id != IDENTITY_WORLD {
                *self.uses.entry(*id).or_default() += 1;
            }
        }
        Planned::Full
    }

    fn hold(&mut self, set: SetId, (prefix, except): (Prefix, bool)) {
        let holders = self.holders.entry(prefix).or_default();
        if holders.is_empty() {
            *self.lengths.entry(prefix.len).or_default() += 1;
        }
        holders.push((set, except));
    }

    fn forget(&mut self, set: SetId, (prefix, except): (Prefix, bool)) {
        let Some(holders) = self.holders.get_mut(&prefix) else {
            return;
        };
        holders.retain(|h| *h != (set, except));
        if holders.is_empty() {
            self.holders.remove(&prefix);
            if let Some(n) = self.lengths.get_mut(&prefix.len) {
                *n -= 1;
                if *n == 0 {
                    self.lengths.remove(&prefix.len);
                }
            }
        }
    }

    /// The signature of `prefix` from the index: per set, the longest member covering it
    /// decides, an except winning a tie (as [`super::identities::signatures`] does).
    fn signature(&self, prefix: Prefix) -> Signature {
        let mut decided: BTreeMap<SetId, bool> = BTreeMap::new();
        for &len in self.lengths.keys().rev().filter(|l| **l <= prefix.len) {
            let mask = u128::MAX
                .checked_shl(u32::from(HOST_LEN - len))
                .unwrap_or(0);
            let cover = Prefix {
                addr: prefix.addr & mask,
                len,
            };
            let Some(holders) = self.holders.get(&cover) else {
                continue;
            };
            let mut here: BTreeMap<SetId, bool> = BTreeMap::new();
            for (set, except) in holders {
                if !decided.contains_key(set) {
                    *here.entry(*set).or_default() |= *except;
                }
            }
            decided.extend(here);
        }
        decided
            .into_iter()
            .filter(|(_, except)| !except)
            .map(|(set, _)| set)
            .collect()
    }

    /// Re-signs `touched` (ascending) and hands out ids as a full plan would.
    fn resign(
        &mut self,
        table: &mut IdentityTable,
        touched: BTreeSet<Prefix>,
        reserved: &BTreeSet<u32>,
    ) {
        let by_sig: HashMap<&Signature, u32> =
            table.by_id.iter().map(|(id, sig)| (sig, *id)).collect();
        let mut assigned: Vec<(Prefix, Signature)> = Vec::new();
        // First every count: an id is released only once nothing uses it.
        for prefix in touched {
            if let Some(n) = self
                .plan
                .trie
                .remove(&prefix)
                .and_then(|old| self.uses.get_mut(&old))
            {
                *n = n.saturating_sub(1);
            }
            if !self.holders.contains_key(&prefix) {
                continue;
            }
            let sig = self.signature(prefix);
            if sig.is_empty() {
                self.plan.trie.insert(prefix, IDENTITY_WORLD);
            } else if let Some(id) = by_sig.get(&sig) {
                *self.uses.entry(*id).or_default() += 1;
                self.plan.trie.insert(prefix, *id);
            } else {
                assigned.push((prefix, sig));
            }
        }
        let released: Vec<u32> = self
            .uses
            .iter()
            .filter(|(_, n)| **n == 0)
            .map(|(id, _)| *id)
            .collect();
        for id in &released {
            self.uses.remove(id);
            table.by_id.remove(id);
        }
        // Signatures new in this round; each is given an id at its first prefix.
        let mut fresh: HashMap<Signature, u32> = HashMap::new();
        let mut next = weir_common::IDENTITY_FIRST_DYNAMIC;
        for (prefix, sig) in assigned {
            let id = match fresh.get(&sig) {
                Some(id) => *id,
                None => {
                    while table.by_id.contains_key(&next) || reserved.contains(&next) {
                        next += 1;
                    }
                    table.by_id.insert(next, sig.clone());
                    fresh.insert(sig, next);
                    next
                }
            };
            *self.uses.entry(id).or_default() += 1;
            self.plan.trie.insert(prefix, id);
        }
        if !released.is_empty() || !fresh.is_empty() {
            self.plan.identities_of_set = table.identities_of_set();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Sets over 16 hosts (even: 10.0.0.x, odd: fd00::x), some of them excepts; set 5
    /// also holds 10.0.0.0/29 and set 6 everything, so hosts inside blocks and holes in
    /// them are covered.
    fn sets(step: &BTreeMap<u64, Vec<(u8, bool)>>) -> BTreeMap<SetId, AddressSet> {
        step.iter()
            .map(|(id, hosts)| {
                let mut nets: Vec<String> = hosts
                    .iter()
                    .map(|(h, except)| {
                        let net = if h % 2 == 0 {
                            format!("10.0.0.{}/32", h / 2)
                        } else {
                            format!("fd00::{:x}/128", h / 2)
                        };
                        if *except {
                            format!("!{net}")
                        } else {
                            net
                        }
                    })
                    .collect();
                match id {
                    5 => nets.push("10.0.0.0/29".into()),
                    6 => nets.extend(["0.0.0.0/0".into(), "::/0".into()]),
                    _ => {}
                }
                let nets: Vec<&str> = nets.iter().map(String::as_str).collect();
                let set = AddressSet::from_cidrs(*id, &nets).unwrap();
                (set.id, set)
            })
            .collect()
    }

    /// The index's plan and ids against a full plan of the same sets, after the same
    /// history.
    fn same_as_full(
        index: &IdentityIndex,
        table: &IdentityTable,
        full: &IdentityTable,
        sets: &BTreeMap<SetId, AddressSet>,
        reserved: &BTreeSet<u32>,
    ) {
        let mut fresh = full.clone();
        let plan = fresh.plan_reserving(sets.values(), reserved);
        assert_eq!(index.plan().trie, plan.trie);
        assert_eq!(index.plan().identities_of_set, plan.identities_of_set);
        assert_eq!(table.by_id, fresh.by_id);
    }

    #[test]
    fn a_host_moving_between_sets_is_resigned_alone() {
        let mut index = IdentityIndex::default();
        let mut table = IdentityTable::default();
        let mut full = IdentityTable::default();
        let none = BTreeSet::new();
        let before = sets(&BTreeMap::from([
            (1, vec![(0, false), (2, false)]),
            (2, vec![(4, false)]),
            (5, vec![(6, true)]),
        ]));
        assert_eq!(
            index.update(&mut table, &before, || none.clone()),
            Planned::Full
        );
        same_as_full(&index, &table, &full, &before, &none);
        full.plan(before.values());
        assert_eq!(
            index.update(&mut table, &before, || none.clone()),
            Planned::Unchanged
        );
        // 10.0.0.1 leaves set 1 for set 2; 10.0.0.3 leaves the hole in set 5.
        let after = sets(&BTreeMap::from([
            (1, vec![(0, false)]),
            (2, vec![(2, false), (4, false)]),
            (5, vec![]),
        ]));
        assert_eq!(
            index.update(&mut table, &after, || none.clone()),
            Planned::Incremental(2)
        );
        same_as_full(&index, &table, &full, &after, &none);
        full.plan(after.values());
        // A block going is planned in full.
        let no_block = sets(&BTreeMap::from([(1, vec![(0, false)])]));
        assert_eq!(
            index.update(&mut table, &no_block, || none.clone()),
            Planned::Full
        );
        same_as_full(&index, &table, &full, &no_block, &none);
    }

    proptest! {
        #[test]
        fn the_index_plans_what_a_full_plan_does(
            steps in prop::collection::vec(
                prop::collection::btree_map(
                    1u64..=6,
                    prop::collection::vec((0u8..16, prop::bool::weighted(0.2)), 0..6),
                    0..6,
                ),
                1..8,
            )
        ) {
            let mut index = IdentityIndex::default();
            let mut table = IdentityTable::default();
            let mut full = IdentityTable::default();
            for step in &steps {
                let sets = sets(step);
                // The ids the last step used stand for those the kernel still holds.
                let previous = table.by_id.clone();
                let reserved: BTreeSet<u32> = previous.keys().copied().collect();
                index.update(&mut table, &sets, || reserved.clone());
                same_as_full(&index, &table, &full, &sets, &reserved);
                full.plan_reserving(sets.values(), &reserved);
                // No id released by this step went to a new signature in it.
                for (id, sig) in &table.by_id {
                    prop_assert!(
                        !reserved.contains(id) || previous.get(id) == Some(sig),
                        "id {} reused in the step that released it",
                        id
                    );
                }
            }
        }
    }
}
