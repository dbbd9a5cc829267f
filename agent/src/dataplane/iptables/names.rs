//! Kernel names of weir's ipsets and chains, within the kernel's limits (31 characters
//! for a set, 28 for a chain). Sets are named by their [`SetId`] (already unique);
//! per-endpoint chains by a content hash of the pod key, with a collision check that
//! salts the hash until the name is free.

use std::collections::BTreeMap;

use crate::netfilter::{WEIR_CHAIN_PREFIX, WEIR_SET_PREFIX};
use weir_policy::desired::{Direction, PodKey, SetId, Tier};

use crate::netfilter::backend::Family;

pub const MAX_SET_NAME: usize = 31;
pub const MAX_CHAIN_NAME: usize = 28;

/// The chain the hooks jump to; it dispatches to endpoint chains.
pub const DISPATCH_CHAIN: &str = "WEIR-FILTER";

/// A built-in chain's jump to one of weir's chains, always its first rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hook {
    pub chain: &'static str,
    /// Matches before `-j`, as `iptables-save` prints them.
    pub matches: &'static str,
    pub target: &'static str,
}

impl Hook {
    /// The rule spec, after `-A <chain> `.
    pub fn spec(&self) -> String {
        match self.matches {
            "" => format!("-j {}", self.target),
            m => format!("{m} -j {}", self.target),
        }
    }
}

/// Everything routed or bridged (br_netfilter) to or from a pod. Traffic between a pod
/// and its own node's addresses (INPUT, OUTPUT) is allowed by NetworkPolicies, as they
/// specify and as the eBPF dataplane does; ClusterNetworkPolicy tiers judge a pod's
/// egress to its node through [`INPUT_HOOK`].
pub const FORWARD_HOOK: Hook = Hook {
    chain: "FORWARD",
    matches: "",
    target: DISPATCH_CHAIN,
};
/// What IPVS forwards. kube-proxy's ipvs mode puts every Service address on the node
/// (`kube-ipvs0`), so a pod's packet to one goes to INPUT, where IPVS (LOCAL_IN) picks
/// the backend and sends it on through OUTPUT: it never crosses FORWARD. `-m ipvs
/// --ipvs` tells it from the node's own traffic, which is not policed. Only where the
/// kernel has IPVS (`xt_ipvs` needs it), checked at each write.
pub const IPVS_HOOK: Hook = Hook {
    chain: "OUTPUT",
    matches: "-m ipvs --ipvs",
    target: DISPATCH_CHAIN,
};
/// A pod's packets to its own node, which tiers judge (see [`TO_NODE_CHAIN`]).
pub const INPUT_HOOK: Hook = Hook {
    chain: "INPUT",
    matches: "",
    target: TO_NODE_CHAIN,
};
pub const HOOKS: [Hook; 3] = [FORWARD_HOOK, IPVS_HOOK, INPUT_HOOK];
/// Drops a pod's forged packets to its own node (anti-spoofing), and sends its other
/// packets to the node's addresses to the pod's egress chain, where ClusterNetworkPolicy
/// tiers judge that direction (no jumps while none does). The chain RETURNs such a packet
/// before the NetworkPolicies' rules, which never stop it.
pub const TO_NODE_CHAIN: &str = "WEIR-TO-NODE";

/// The chain of anti-spoofing rules, entered first from `WEIR-FILTER` and `WEIR-TO-NODE`.
pub const SPOOF_CHAIN: &str = "WEIR-SPOOF";
/// The table weir's chains live in: mangle's FORWARD runs before filter's, after
/// kube-proxy's DNAT, so an ACCEPT in filter FORWARD cannot let a packet past a policy
/// (kube-proxy's iptables mode prepends `KUBE-FORWARD`, which ACCEPTs every packet it
/// marked for masquerading: NodePort and hairpin traffic), and hardly anything else
/// hooks mangle FORWARD.
pub const TABLE: &str = "mangle";
/// Where releases before the Services release put the chains; a full
/// reconcile removes what is left there.
pub const FORMER_TABLE: &str = "filter";

/// Where traffic from and to pod interfaces not programmed yet goes (see
/// [`crate::dataplane::new_pods`]).
pub const NEW_FROM_POD_CHAIN: &str = "WEIR-NEW-FROM-POD";
pub const NEW_TO_POD_CHAIN: &str = "WEIR-NEW-TO-POD";
/// The set of the programmed endpoints' addresses (a reserved id: set ids are hashes).
pub const KNOWN_ENDPOINTS_SET: SetId = SetId(0);

/// `weir-node-4` / `-6`: the node's own addresses, which [`TO_NODE_CHAIN`] sends to tiers
/// (see [`crate::dataplane::node_addresses`]). Not a [`SetId`]'s form, so no address set
/// can take the name.
pub fn node_set_name(family: Family) -> String {
    format!("{WEIR_SET_PREFIX}node-{}", family_digit(family))
}

/// The staging set [`node_set_name`]'s contents are replaced through.
pub fn node_staging_set_name(family: Family) -> String {
    format!("{}t", node_set_name(family))
}

/// `weir-<16 hex>-4` / `-6`: one kernel set per family for each address set.
pub fn set_name(id: SetId, family: Family) -> String {
    format!("{WEIR_SET_PREFIX}{id}-{}", family_digit(family))
}

/// The staging set used to replace a set's contents atomically (`ipset swap`).
pub fn staging_set_name(id: SetId, family: Family) -> String {
    format!("{WEIR_SET_PREFIX}{id}-{}t", family_digit(family))
}

fn family_digit(family: Family) -> char {
    match family {
        Family::V4 => '4',
        Family::V6 => '6',
    }
}

/// FNV-1a, 64 bits: stable across builds and Rust versions, unlike std's hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Which pod a hash stands for, shared with the verdict reader (which names the pods of
/// logged packets by the hash in their NFLOG prefix).
pub type PodsByHash = std::sync::Arc<std::sync::RwLock<BTreeMap<u64, PodKey>>>;

/// Assigns each pod a chain hash, unique among the pods it has seen.
#[derive(Debug, Default)]
pub struct ChainNames {
    by_pod: BTreeMap<PodKey, u64>,
    by_hash: PodsByHash,
}

impl ChainNames {
    /// The pod's hash; assigned on first use, salted past any collision.
    pub fn hash_for(&mut self, pod: &str) -> u64 {
        if let Some(h) = self.by_pod.get(pod) {
            return *h;
        }
        let mut by_hash = self.by_hash.write().unwrap_or_else(|e| e.into_inner());
        let mut salt = 0u32;
        let hash = loop {
            let candidate = if salt == 0 {
                fnv1a(pod.as_bytes())
            } else {
                fnv1a(format!("{pod}#{salt}").as_bytes())
            };
            if !by_hash.contains_key(&candidate) {
                break candidate;
            }
            salt += 1;
        };
        by_hash.insert(hash, pod.to_string());
        self.by_pod.insert(pod.to_string(), hash);
        hash
    }

    pub fn forget(&mut self, pod: &str) {
        if let Some(h) = self.by_pod.remove(pod) {
            self.by_hash
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&h);
        }
    }

    /// The hash → pod table, as it changes.
    pub fn pods_by_hash(&self) -> PodsByHash {
        self.by_hash.clone()
    }
}

/// `WEIR-I-<16 hex>` (traffic to the pod) or `WEIR-E-<16 hex>` (from it).
pub fn endpoint_chain(hash: u64, direction: Direction) -> String {
    let d = match direction {
        Direction::Ingress => 'I',
        Direction::Egress => 'E',
    };
    format!("{WEIR_CHAIN_PREFIX}{d}-{hash:016x}")
}

/// Where an Admin-tier Pass goes (`-g`): the NetworkPolicies and the Baseline tier of an
/// endpoint's direction, when its [`endpoint_chain`] starts with Admin rules and has a
/// Pass among them.
pub fn passed_chain(hash: u64, direction: Direction) -> String {
    let d = match direction {
        Direction::Ingress => "IP",
        Direction::Egress => "EP",
    };
    format!("{WEIR_CHAIN_PREFIX}{d}-{hash:016x}")
}

/// `WEIR-<I|E><A|B><4 hex>-<16 hex>`: chain `n` of an endpoint direction's Admin (`A`)
/// or Baseline (`B`) tier index (see [`super::tier_index`]).
pub fn tier_index_chain(hash: u64, direction: Direction, tier: Tier, n: usize) -> String {
    let d = match direction {
        Direction::Ingress => 'I',
        Direction::Egress => 'E',
    };
    let t = match tier {
        Tier::Admin => 'A',
        Tier::Baseline => 'B',
    };
    format!("{WEIR_CHAIN_PREFIX}{d}{t}{n:04x}-{hash:016x}")
}

/// The direction of an [`endpoint_chain`], a [`passed_chain`] or a
/// [`tier_index_chain`]; `None` for any other chain.
pub fn chain_direction(chain: &str) -> Option<Direction> {
    let rest = chain.strip_prefix(WEIR_CHAIN_PREFIX)?;
    let (d, hash) = rest.split_once('-')?;
    if hash.len() != 16 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let index = |t: &str| {
        t.len() == 5
            && matches!(t.as_bytes()[0], b'A' | b'B')
            && t[1..].bytes().all(|b| b.is_ascii_hexdigit())
    };
    match d {
        "I" | "IP" => Some(Direction::Ingress),
        "E" | "EP" => Some(Direction::Egress),
        _ => match d.split_at_checked(1)? {
            ("I", t) if index(t) => Some(Direction::Ingress),
            ("E", t) if index(t) => Some(Direction::Egress),
            _ => None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_the_kernel_limits() {
        let id = SetId(u64::MAX);
        for f in Family::ALL {
            assert!(set_name(id, f).len() <= MAX_SET_NAME);
            assert!(staging_set_name(id, f).len() <= MAX_SET_NAME);
        }
        assert!(endpoint_chain(u64::MAX, Direction::Ingress).len() <= MAX_CHAIN_NAME);
        let index = tier_index_chain(u64::MAX, Direction::Egress, Tier::Baseline, 0xfff);
        assert!(index.len() <= MAX_CHAIN_NAME, "{index}");
        assert_eq!(chain_direction(&index), Some(Direction::Egress));
        let index = tier_index_chain(7, Direction::Ingress, Tier::Admin, 3);
        assert_eq!(index, "WEIR-IA0003-0000000000000007");
        assert_eq!(chain_direction(&index), Some(Direction::Ingress));
        assert_eq!(chain_direction("WEIR-IX0003-0000000000000007"), None);
        assert!(DISPATCH_CHAIN.len() <= MAX_CHAIN_NAME);
        assert!(TO_NODE_CHAIN.len() <= MAX_CHAIN_NAME);
        assert_eq!(set_name(SetId(0xab), Family::V6), "weir-00000000000000ab-6");
    }

    #[test]
    fn colliding_hashes_are_salted_apart() {
        let mut names = ChainNames::default();
        let a = names.hash_for("ns/a");
        // Pretend another pod already holds the hash "ns/b" would get.
        let b_plain = fnv1a(b"ns/b");
        names
            .by_hash
            .write()
            .unwrap()
            .insert(b_plain, "ns/other".into());
        let b = names.hash_for("ns/b");
        assert_ne!(b, b_plain);
        assert_ne!(a, b);
        assert_eq!(names.hash_for("ns/a"), a, "stable for a known pod");
        names.forget("ns/a");
        assert!(!names.by_hash.read().unwrap().contains_key(&a));
    }
}
