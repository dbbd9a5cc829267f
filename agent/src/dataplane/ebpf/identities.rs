//! Peer identities: every distinct prefix of every address set goes into the IDENTITY
//! trie, mapped to the identity of its *membership signature* (the sets that contain the
//! addresses that prefix is the longest match for). Pods with the same signature share
//! one identity, so per-packet cost is one trie lookup and the POLICY map grows with
//! distinct signatures, not with pods. An `except` member is just a longer prefix whose
//! signature lacks the set.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use weir_common::{
    IdentityKey, IDENTITY_FIRST_DYNAMIC, IDENTITY_HOST, IDENTITY_HOST_BIT, IDENTITY_WORLD,
};

use weir_policy::desired::{programmed_members, AddressSet, SetId};

/// A prefix in the 128-bit (IPv4-mapped) address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Prefix {
    pub addr: u128,
    /// 0..=128; an IPv4 /n is 96 + n.
    pub len: u8,
}

impl Prefix {
    pub fn from_net(net: &IpNet) -> Prefix {
        let (addr, len) = match net.trunc() {
            IpNet::V4(n) => (
                (0xffffu128 << 32) | u128::from(u32::from(n.network())),
                96 + n.prefix_len(),
            ),
            IpNet::V6(n) => (u128::from(n.network()), n.prefix_len()),
        };
        Prefix { addr, len }
    }

    pub fn last(&self) -> u128 {
        self.addr | u128::MAX.checked_shr(u32::from(self.len)).unwrap_or(0)
    }

    /// The IDENTITY trie key and prefix length.
    pub fn trie_key(&self) -> (IdentityKey, u32) {
        (
            IdentityKey {
                addr: self.addr.to_be_bytes(),
            },
            u32::from(self.len),
        )
    }

    pub fn from_trie_key(key: &IdentityKey, len: u32) -> Prefix {
        Prefix {
            addr: u128::from_be_bytes(key.addr),
            len: len.min(128) as u8,
        }
    }
}

/// A membership signature: the ids of the sets an address belongs to, ascending.
pub type Signature = Vec<SetId>;

/// Signature → identity id, stable across changes and restarts (persisted in records).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityTable {
    pub by_id: BTreeMap<u32, Signature>,
}

/// What the kernel maps need: the trie, and for each set the identities containing it.
#[derive(Clone, Debug, Default)]
pub struct IdentityPlan {
    pub trie: BTreeMap<Prefix, u32>,
    pub identities_of_set: BTreeMap<SetId, Vec<u32>>,
}

/// The IDENTITY value of the node address `host` where tiers judge pods' egress to the
/// node: [`IDENTITY_HOST_BIT`] with the identity `trie` (the plan's) gives its longest
/// match, whose sets a `networks` or `nodes` peer names; [`IDENTITY_HOST`] when no set
/// holds it.
pub fn host_identity(trie: &BTreeMap<Prefix, u32>, host: &Prefix) -> u32 {
    (0..=host.len)
        .rev()
        .find_map(|len| {
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            trie.get(&Prefix {
                addr: host.addr & mask,
                len,
            })
        })
        .map_or(IDENTITY_HOST, |id| IDENTITY_HOST_BIT | id)
}

/// IPv4 lives in the trie as IPv4-mapped IPv6, ::ffff:0:0/96.
const IPV4_MAPPED: Prefix = Prefix {
    addr: 0xffff << 32,
    len: 96,
};

/// A set's members as trie prefixes, each with whether it is an except, as the dataplanes
/// program them ([`programmed_members`]: no IPv6 block holds an IPv4-mapped address,
/// which is where the trie keeps IPv4). The range's except then shares its prefix with
/// IPv4's 0.0.0.0/0, and a tie goes to the except: a set holding all of IPv4 keeps it.
pub(super) fn trie_members(set: &AddressSet) -> Vec<(Prefix, bool)> {
    let all_of_ipv4 = set
        .members
        .iter()
        .any(|m| !m.except && matches!(m.net, IpNet::V4(n) if n.prefix_len() == 0));
    programmed_members(&set.members)
        .iter()
        .map(|m| (Prefix::from_net(&m.net), m.except))
        .filter(|(p, except)| !(all_of_ipv4 && *except && *p == IPV4_MAPPED))
        .collect()
}

/// For each prefix that appears in any set, the sets that contain it (per the longest
/// member of each set that covers it; `except` wins a tie, as in [`AddressSet::contains`]).
/// Sets must come in ascending id order (a `BTreeMap`'s values do).
pub fn signatures<'a>(sets: impl IntoIterator<Item = &'a AddressSet>) -> Vec<(Prefix, Signature)> {
    let sets: Vec<(SetId, Vec<(Prefix, bool)>)> =
        sets.into_iter().map(|s| (s.id, trie_members(s))).collect();
    let prefixes: Vec<Prefix> = sets
        .iter()
        .flat_map(|(_, members)| members.iter().map(|(p, _)| *p))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let mut sigs: Vec<Signature> = vec![Vec::new(); prefixes.len()];
    // Per set: prefix index → (length, except) of the longest covering member.
    let mut best: HashMap<usize, (u8, bool)> = HashMap::new();
    for (id, members) in &sets {
        best.clear();
        for &(mp, except) in members {
            let last = mp.last();
            let start = prefixes.partition_point(|p| p.addr < mp.addr);
            for (i, p) in prefixes.iter().enumerate().skip(start) {
                if p.addr > last {
                    break;
                }
                if p.len < mp.len {
                    continue;
                }
                let cand = (mp.len, except);
                let e = best.entry(i).or_insert(cand);
                if cand > *e {
                    *e = cand;
                }
            }
        }
        for (i, (_, except)) in &best {
            if !except {
                sigs[*i].push(*id);
            }
        }
    }
    prefixes.into_iter().zip(sigs).collect()
}

impl IdentityTable {
    /// Plans the trie for `sets`, reusing the ids of known signatures and handing out
    /// the lowest free ids for new ones. Ids of signatures no longer used are released.
    pub fn plan<'a>(&mut self, sets: impl IntoIterator<Item = &'a AddressSet>) -> IdentityPlan {
        self.plan_reserving(sets, &BTreeSet::new())
    }

    /// [`IdentityTable::plan`], never handing a new signature an id of `reserved`: the ids
    /// the kernel's maps still hold (an address mapped to one, or POLICY entries for it).
    /// An id released by this plan is in the maps until the convergence that released it
    /// has moved every address off it and removed its entries; given to a new signature
    /// before that, its old addresses would get the new signature's entries, or the new
    /// signature's addresses the old one's.
    pub fn plan_reserving<'a>(
        &mut self,
        sets: impl IntoIterator<Item = &'a AddressSet>,
        reserved: &BTreeSet<u32>,
    ) -> IdentityPlan {
        let sigs = signatures(sets);
        let wanted: HashSet<&Signature> = sigs.iter().map(|(_, s)| s).collect();
        let mut by_sig: HashMap<Signature, u32> = std::mem::take(&mut self.by_id)
            .into_iter()
            .filter(|(_, sig)| wanted.contains(sig))
            .map(|(id, sig)| (sig, id))
            .collect();
        let mut used: BTreeSet<u32> = by_sig.values().copied().collect();
        let mut next = IDENTITY_FIRST_DYNAMIC;
        let mut plan = IdentityPlan::default();
        for (prefix, sig) in &sigs {
            let id = if sig.is_empty() {
                IDENTITY_WORLD
            } else if let Some(id) = by_sig.get(sig) {
                *id
            } else {
                while used.contains(&next) || reserved.contains(&next) {
                    next += 1;
                }
                used.insert(next);
                by_sig.insert(sig.clone(), next);
                next
            };
            plan.trie.insert(*prefix, id);
        }
        self.by_id = by_sig
            .into_iter()
            .filter(|(sig, _)| !sig.is_empty())
            .map(|(sig, id)| (id, sig))
            .collect();
        plan.identities_of_set = self.identities_of_set();
        plan
    }

    /// For each set, the identities whose signature holds it (ascending).
    pub fn identities_of_set(&self) -> BTreeMap<SetId, Vec<u32>> {
        let mut of_set: BTreeMap<SetId, Vec<u32>> = BTreeMap::new();
        for (id, sig) in &self.by_id {
            for set in sig {
                of_set.entry(*set).or_default().push(*id);
            }
        }
        of_set
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_policy::desired::AddressSet;

    fn set(id: u64, nets: &[&str]) -> AddressSet {
        AddressSet::from_cidrs(id, nets).unwrap()
    }

    fn prefix(s: &str) -> Prefix {
        Prefix::from_net(&s.parse().unwrap())
    }

    #[test]
    fn pods_with_the_same_sets_share_an_identity_and_excepts_are_holes() {
        let pods = set(1, &["10.0.0.1/32", "10.0.0.2/32", "10.1.0.5/32"]);
        let block = set(2, &["10.0.0.0/8", "!10.1.0.0/16"]);
        let mut table = IdentityTable::default();
        let plan = table.plan([&pods, &block]);
        let a = plan.trie[&prefix("10.0.0.1/32")];
        assert_eq!(a, plan.trie[&prefix("10.0.0.2/32")]);
        // 10.1.0.5 is in the except hole: only in set 1.
        let c = plan.trie[&prefix("10.1.0.5/32")];
        assert_ne!(a, c);
        assert_eq!(plan.trie[&prefix("10.1.0.0/16")], IDENTITY_WORLD);
        assert_eq!(table.by_id[&a], vec![SetId(1), SetId(2)]);
        assert_eq!(table.by_id[&c], vec![SetId(1)]);
        assert_eq!(plan.identities_of_set[&SetId(2)].len(), 2);
    }

    #[test]
    fn a_node_address_carries_the_sets_of_its_longest_match() {
        let block = set(1, &["10.0.0.0/8", "!10.1.0.0/16"]);
        let node = set(2, &["10.0.0.9/32"]);
        let plan = IdentityTable::default().plan([&block, &node]);
        let node_id = plan.trie[&prefix("10.0.0.9/32")];
        let host = |a: &str| host_identity(&plan.trie, &prefix(a));
        assert_eq!(host("10.0.0.9/32"), IDENTITY_HOST_BIT | node_id);
        assert_eq!(
            host("10.2.0.1/32"),
            IDENTITY_HOST_BIT | plan.trie[&prefix("10.0.0.0/8")]
        );
        // The except hole is the world's: no set.
        assert_eq!(host("10.1.0.1/32"), IDENTITY_HOST_BIT | IDENTITY_WORLD);
        assert_eq!(host("192.0.2.1/32"), IDENTITY_HOST);
        assert_eq!(host("fd00::1/128"), IDENTITY_HOST);
        assert!([node_id, IDENTITY_WORLD]
            .iter()
            .all(|id| weir_common::is_host(id | IDENTITY_HOST_BIT)));
    }

    #[test]
    fn an_ipv6_block_holds_no_ipv4_peer() {
        let v6_everything = set(1, &["::/0", "!fd00::8/128"]);
        let v4_pods = set(2, &["10.0.0.1/32"]);
        let mapped = set(3, &["::ffff:10.0.0.2/128", "fd00::/64"]);
        let both = set(4, &["0.0.0.0/0", "::/0"]);
        let mut table = IdentityTable::default();
        let plan = table.plan([&v6_everything, &v4_pods, &mapped, &both]);
        let sets_of = |p: &str| {
            let id = plan.trie[&prefix(p)];
            table.by_id.get(&id).cloned().unwrap_or_default()
        };
        // The IPv4 range: in set 4 only (which holds 0.0.0.0/0); the pod also in set 2.
        assert_eq!(sets_of("0.0.0.0/0"), vec![SetId(4)]);
        assert_eq!(sets_of("10.0.0.1/32"), vec![SetId(2), SetId(4)]);
        // IPv6 outside it: in the IPv6 blocks.
        assert_eq!(sets_of("::/0"), vec![SetId(1), SetId(4)]);
        assert_eq!(sets_of("fd00::/64"), vec![SetId(1), SetId(3), SetId(4)]);
        assert_eq!(sets_of("fd00::8/128"), vec![SetId(3), SetId(4)]);
        // The mapped address stood for 10.0.0.2: left out.
        assert!(!plan.trie.contains_key(&prefix("::ffff:10.0.0.2/128")));
    }

    #[test]
    fn identities_are_stable_and_released() {
        let s1 = set(1, &["10.0.0.1/32"]);
        let s2 = set(2, &["10.0.0.2/32"]);
        let mut table = IdentityTable::default();
        let first = table.plan([&s1, &s2]);
        let id2 = first.trie[&prefix("10.0.0.2/32")];
        let second = table.plan([&s2]);
        assert_eq!(second.trie[&prefix("10.0.0.2/32")], id2);
        assert_eq!(table.by_id.len(), 1);
    }

    #[test]
    fn ipv4_is_mapped_into_128_bits() {
        let p = prefix("192.168.1.0/24");
        assert_eq!(p.len, 120);
        let (key, len) = p.trie_key();
        assert_eq!(len, 120);
        assert_eq!(&key.addr[10..14], &[0xff, 0xff, 192, 168]);
        assert_eq!(Prefix::from_trie_key(&key, len), p);
    }
}
