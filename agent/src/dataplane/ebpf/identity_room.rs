//! When the IDENTITY trie has no room for every new prefix of a convergence.
//!
//! An address whose own prefix is not written is matched by the longest prefix that is
//! (or is the world's), and so judged by another signature's POLICY entries: a pod that
//! an Admin Deny names by its labels, inside an ipBlock some policy allows, would pass.
//! So the new prefixes are planned against the trie's room, like POLICY's groups: those
//! that fit are written; for each one left out, every pod direction whose entries for
//! the identity it should have differ from its entries for the identity its addresses
//! keep is *held closed* (its allowing entries removed, so it denies every peer) until
//! the prefix is written. A held direction opens again only after its prefix is written,
//! so no instant judges those addresses by the wrong entries with the allows in place.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use weir_common::{PolicyKey, IDENTITY_UNLISTED_FRONTEND, IDENTITY_WORLD};

use super::identities::Prefix;
use super::kernel_state::{allows, KernelState, PolicyGroup};

/// How a convergence fits its new IDENTITY prefixes in the trie's room.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct IdentityRoom {
    /// New prefixes not written, with the id each should have.
    pub unwritten: BTreeMap<Prefix, u32>,
    /// The id each unwritten prefix's addresses keep: the longest written prefix's
    /// around it, or the world's.
    pub kept: BTreeMap<Prefix, u32>,
    /// Pod directions that judge some unwritten prefix's addresses differently under
    /// the id they keep, each with the first such prefix: held closed until it fits.
    pub held: BTreeMap<PolicyGroup, Prefix>,
    /// The new prefixes and the room there was, for the report.
    pub new: usize,
    pub free: usize,
}

impl IdentityRoom {
    /// `want` as it can be written now: the unwritten prefixes left out, and no
    /// allowing entry in the held directions nor in `also_held` (directions held before,
    /// which open only once their prefixes are written).
    /// Borrowed when nothing is left out or held: the common case, at no copy of maps
    /// that may hold a million prefixes.
    pub fn staged<'a>(
        &self,
        want: &'a KernelState,
        also_held: &BTreeSet<PolicyGroup>,
    ) -> Cow<'a, KernelState> {
        if self.unwritten.is_empty() && self.held.is_empty() && also_held.is_empty() {
            return Cow::Borrowed(want);
        }
        let mut staged = want.clone();
        staged
            .identity
            .retain(|prefix, _| !self.unwritten.contains_key(prefix));
        staged.policy.retain(|(_, key), value| {
            let group = (key.endpoint_id, key.direction);
            !allows(*value) || !(self.held.contains_key(&group) || also_held.contains(&group))
        });
        Cow::Owned(staged)
    }
}

/// Plans `want`'s new IDENTITY prefixes against `free` entries of room (`None`:
/// unknown, every prefix is written and the kernel's refusals decide): the first
/// `free` in order are written, the rest are unwritten, and the directions of `want`'s
/// POLICY entries that would judge their addresses differently are held.
pub fn plan_identity_room(
    have: &KernelState,
    want: &KernelState,
    free: Option<usize>,
) -> IdentityRoom {
    let Some(free) = free else {
        return IdentityRoom::default();
    };
    let new: Vec<(Prefix, u32)> = super::kernel_state::added(&have.identity, &want.identity)
        .map(|(p, id)| (*p, *id))
        .collect();
    if new.len() <= free {
        return IdentityRoom::default();
    }
    let unwritten: BTreeMap<Prefix, u32> = new[free..].iter().copied().collect();
    let written: BTreeMap<Prefix, u32> = want
        .identity
        .iter()
        .filter(|(p, _)| !unwritten.contains_key(*p))
        .map(|(p, id)| (*p, *id))
        .collect();
    IdentityRoom {
        new: new.len(),
        free,
        ..holding(want, unwritten, &written)
    }
}

/// The room report for prefixes the kernel refused (`refused`, with the id each should
/// have), `trie` being what IDENTITY holds after the writes: their addresses keep what
/// they had, and the directions that judge that differently are held.
pub fn refused(
    want: &KernelState,
    refused: BTreeMap<Prefix, u32>,
    trie: &BTreeMap<Prefix, u32>,
) -> IdentityRoom {
    IdentityRoom {
        new: refused.len(),
        ..holding(want, refused, trie)
    }
}

/// `unwritten`'s addresses keep their longest match in `trie`: the directions of
/// `want` that judge them differently under it are held.
fn holding(
    want: &KernelState,
    unwritten: BTreeMap<Prefix, u32>,
    trie: &BTreeMap<Prefix, u32>,
) -> IdentityRoom {
    let kept: BTreeMap<Prefix, u32> = unwritten
        .keys()
        .map(|p| (*p, longest_match(trie, p)))
        .collect();
    let entries = entries_by_identity(want);
    let mut held = BTreeMap::new();
    for (prefix, id) in &unwritten {
        for group in misjudging(&entries, *id, kept[prefix]) {
            held.entry(group).or_insert(*prefix);
        }
    }
    IdentityRoom {
        unwritten,
        kept,
        held,
        ..Default::default()
    }
}

/// The id of the longest prefix in `trie` that holds all of `p`, `p` itself included
/// (as the kernel's longest match gives for its addresses), or the world's.
fn longest_match(trie: &BTreeMap<Prefix, u32>, p: &Prefix) -> u32 {
    (0..=p.len)
        .rev()
        .find_map(|len| {
            let mask = !u128::MAX.checked_shr(u32::from(len)).unwrap_or(0);
            trie.get(&Prefix {
                addr: p.addr & mask,
                len,
            })
        })
        .copied()
        .unwrap_or(IDENTITY_WORLD)
}

/// One POLICY entry without its identity: (prefix length, key with identity 0, value).
type Judgement = (u32, PolicyKey, u32);

/// `want`'s POLICY entries by identity, then by pod direction.
fn entries_by_identity(
    want: &KernelState,
) -> BTreeMap<u32, BTreeMap<PolicyGroup, BTreeSet<Judgement>>> {
    let mut out: BTreeMap<u32, BTreeMap<PolicyGroup, BTreeSet<Judgement>>> = BTreeMap::new();
    for ((len, key), value) in &want.policy {
        let group = (key.endpoint_id, key.direction);
        let bare = PolicyKey {
            identity: 0,
            ..*key
        };
        out.entry(key.identity)
            .or_default()
            .entry(group)
            .or_default()
            .insert((*len, bare, *value));
    }
    out
}

/// The pod directions whose own entries for `should` and for `kept` differ: those judge
/// an address of `should`'s signature that is matched as `kept` by other rules. The
/// world has no own entries (the programs look only at the any-peer ones for it). An
/// unlisted frontend's address is dropped by every judged direction: each that allows
/// anything could admit it under another identity.
fn misjudging(
    entries: &BTreeMap<u32, BTreeMap<PolicyGroup, BTreeSet<Judgement>>>,
    should: u32,
    kept: u32,
) -> Vec<PolicyGroup> {
    if should == kept {
        return Vec::new();
    }
    if should == IDENTITY_UNLISTED_FRONTEND {
        return entries
            .values()
            .flatten()
            .filter(|(_, judged)| judged.iter().any(|(_, _, value)| allows(*value)))
            .map(|(group, _)| *group)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
    }
    let empty = BTreeMap::new();
    let own = |id: u32| match id {
        IDENTITY_WORLD => &empty,
        id => entries.get(&id).unwrap_or(&empty),
    };
    let (a, b) = (own(should), own(kept));
    let none = BTreeSet::new();
    a.keys()
        .chain(b.keys())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .filter(|g| a.get(*g).unwrap_or(&none) != b.get(*g).unwrap_or(&none))
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_common::{Direction, IDENTITY_ANY, POLICY_PREFIX_ANY_PORT, TIER_DENY_BIT};

    fn prefix(net: &str) -> Prefix {
        Prefix::from_net(&net.parse().unwrap())
    }

    fn entry(endpoint_id: u32, identity: u32) -> (u32, PolicyKey) {
        (
            POLICY_PREFIX_ANY_PORT,
            PolicyKey {
                endpoint_id,
                identity,
                direction: Direction::Ingress as u8,
                ..Default::default()
            },
        )
    }

    /// Pod 1's ingress: an Admin Deny of identity 20 (the intruder's labels), an allow
    /// of identity 21 (10.9.0.0/16, an ipBlock). Pod 2's ingress allows anyone.
    fn want() -> KernelState {
        let mut want = KernelState::default();
        want.identity.insert(prefix("10.9.0.0/16"), 21);
        want.identity.insert(prefix("10.9.0.7/32"), 20);
        want.policy.insert(entry(1, 20), TIER_DENY_BIT | 3);
        want.policy.insert(entry(1, 21), 4);
        want.policy.insert(entry(2, IDENTITY_ANY), 5);
        want
    }

    #[test]
    fn prefixes_that_fit_are_all_written() {
        let mut have = KernelState::default();
        have.identity.insert(prefix("10.9.0.0/16"), 21);
        assert!(plan_identity_room(&have, &want(), Some(1))
            .unwritten
            .is_empty());
        assert!(plan_identity_room(&have, &want(), None)
            .unwritten
            .is_empty());
    }

    #[test]
    fn a_prefix_without_room_holds_the_directions_it_would_pass() {
        let mut have = KernelState::default();
        have.identity.insert(prefix("10.9.0.0/16"), 21);
        let room = plan_identity_room(&have, &want(), Some(0));
        assert_eq!(room.unwritten, [(prefix("10.9.0.7/32"), 20)].into());
        // Its address keeps the /16's identity, which pod 1 allows where it denies the
        // intruder's: pod 1's ingress is held; pod 2's judges both alike.
        assert_eq!(room.kept[&prefix("10.9.0.7/32")], 21);
        let group = (1, Direction::Ingress as u8);
        assert_eq!(room.held, [(group, prefix("10.9.0.7/32"))].into());
        let want = want();
        let staged = room.staged(&want, &BTreeSet::new());
        assert!(!staged.identity.contains_key(&prefix("10.9.0.7/32")));
        // The deny stays; pod 1's allow goes; pod 2's stays.
        assert_eq!(staged.policy.len(), 2);
        assert!(staged.policy.contains_key(&entry(1, 20)));
        assert!(staged.policy.contains_key(&entry(2, IDENTITY_ANY)));
    }

    #[test]
    fn a_prefix_that_falls_to_the_world_holds_the_directions_that_name_it() {
        let mut want = want();
        want.identity.remove(&prefix("10.9.0.0/16"));
        let room = plan_identity_room(&KernelState::default(), &want, Some(0));
        assert_eq!(room.kept[&prefix("10.9.0.7/32")], IDENTITY_WORLD);
        let groups: Vec<PolicyGroup> = room.held.keys().copied().collect();
        assert_eq!(groups, [(1, Direction::Ingress as u8)]);
    }

    #[test]
    fn an_unlisted_frontend_left_out_holds_every_direction_that_allows_anything() {
        // Pod 2 allows any peer: under the world's identity the frontend's address would
        // pass it, where the unlisted mark drops it. Pod 1 allows the /16 (where the
        // address falls) and denies 20.
        let mut want = want();
        want.identity
            .insert(prefix("10.9.0.9/32"), IDENTITY_UNLISTED_FRONTEND);
        let mut have = want.clone();
        have.identity.remove(&prefix("10.9.0.9/32"));
        let room = plan_identity_room(&have, &want, Some(0));
        let groups: Vec<PolicyGroup> = room.held.keys().copied().collect();
        let ingress = Direction::Ingress as u8;
        assert_eq!(groups, [(1, ingress), (2, ingress)]);
    }

    #[test]
    fn an_address_keeps_its_longest_match() {
        let mut trie = BTreeMap::new();
        trie.insert(prefix("10.0.0.0/8"), 30);
        trie.insert(prefix("10.9.0.0/16"), 31);
        trie.insert(prefix("10.9.0.7/32"), 32);
        assert_eq!(longest_match(&trie, &prefix("10.9.0.7/32")), 32);
        assert_eq!(longest_match(&trie, &prefix("10.9.0.8/32")), 31);
        assert_eq!(longest_match(&trie, &prefix("10.8.0.0/16")), 30);
        assert_eq!(longest_match(&trie, &prefix("11.0.0.0/8")), IDENTITY_WORLD);
        assert_eq!(longest_match(&trie, &prefix("fd00::1/128")), IDENTITY_WORLD);
    }
}
