//! The kernel programs' policy decision in Rust, over the map contents the agent plans
//! ([`KernelState`]), to check the eBPF encoding (identities, LPM prefixes, rule ids)
//! against weir's own verdict: agent/tests/ebpf_encoding.rs on generated cases, and the
//! `ebpf_encoding` fuzz target. It mirrors `judge` in ebpf/weir-ebpf/src/main.rs for a
//! packet with no conntrack entry, no Service and not from the node (to it, yes). It is no stand-in for
//! the programs: those run on the real kernel in the lab tests.

use std::collections::BTreeMap;
use std::net::IpAddr;

use weir_common::{
    is_host, PolicyKey, IDENTITY_ANY, IDENTITY_UNLISTED_FRONTEND, IDENTITY_WORLD,
    POLICY_PREFIX_FULL, TIER_DENY_BIT,
};
use weir_policy::desired::{is_ipv4_mapped, Desired, Direction, PodKey, Protocol};

use super::identities::{IdentityTable, Prefix};
use super::kernel_state::KernelState;
use super::policy_map::{direction_code, RuleTable};
use super::{planned_state, EP_EGRESS_ISOLATED, EP_INGRESS_ISOLATED};

/// The maps a fresh agent would write for `desired`, every endpoint placed.
pub struct Encoded {
    state: KernelState,
    ids: BTreeMap<PodKey, u32>,
}

/// Plans the maps for `desired` as a fresh agent does (no earlier ids), with every
/// endpoint placed on an interface of its own.
pub fn encode(desired: &Desired) -> Encoded {
    encode_on_node(desired, &[])
}

/// [`encode`] on a node whose own addresses are `node`.
pub fn encode_on_node(desired: &Desired, node: &[IpAddr]) -> Encoded {
    let node: Vec<Prefix> = node
        .iter()
        .map(|a| Prefix::from_net(&ipnet::IpNet::from(*a)))
        .collect();
    let plan = IdentityTable::default().plan(desired.sets.values());
    let rule_ids = RuleTable::default().plan(desired.endpoints.values());
    let placed: BTreeMap<PodKey, (u32, String, u32)> = desired
        .endpoints
        .keys()
        .zip(1..)
        .map(|(pod, id)| (pod.clone(), (id, format!("lxc{id}"), id)))
        .collect();
    let (state, _) = planned_state(desired, &placed, plan, &rule_ids, &node);
    let ids = placed
        .into_iter()
        .map(|(pod, (id, _, _))| (pod, id))
        .collect();
    Encoded { state, ids }
}

impl Encoded {
    /// The maps `state`, with each pod's endpoint id in `ids`.
    #[cfg(test)]
    pub(super) fn of_state(state: KernelState, ids: BTreeMap<PodKey, u32>) -> Encoded {
        Encoded { state, ids }
    }

    /// Whether the maps admit a connection from `from` (at `from_addr`) to `to` (at
    /// `to_addr`): the egress hook of the client's endpoint, then the ingress hook of the
    /// server's. A pod that is no endpoint here is not enforced.
    pub fn connection_allowed(
        &self,
        from: &str,
        from_addr: IpAddr,
        to: &str,
        to_addr: IpAddr,
        port: u16,
        protocol: Protocol,
    ) -> bool {
        self.admits(from, Direction::Egress, to_addr, port, protocol)
            && self.admits(to, Direction::Ingress, from_addr, port, protocol)
    }

    /// One hook's decision at `pod`'s endpoint for a packet with `peer` on the other side.
    pub fn admits(
        &self,
        pod: &str,
        direction: Direction,
        peer: IpAddr,
        port: u16,
        protocol: Protocol,
    ) -> bool {
        let Some(id) = self.ids.get(pod).copied() else {
            return true;
        };
        let flag = match direction {
            Direction::Ingress => EP_INGRESS_ISOLATED,
            Direction::Egress => EP_EGRESS_ISOLATED,
        };
        if self.state.endpoint_by_id[&id].flags & flag == 0 {
            return true;
        }
        let identity = self.identity_of(peer);
        if identity == IDENTITY_UNLISTED_FRONTEND {
            return false;
        }
        if is_host(identity) {
            // The node: its own entries, only where tiers judge the pod's egress to it.
            let rule = match direction {
                Direction::Egress => self.policy_lookup(id, identity, direction, port, protocol),
                Direction::Ingress => 0,
            };
            return rule == 0 || rule & TIER_DENY_BIT == 0;
        }
        let mut rule = 0;
        if identity != IDENTITY_WORLD {
            rule = self.policy_lookup(id, identity, direction, port, protocol);
        }
        if rule == 0 {
            rule = self.policy_lookup(id, IDENTITY_ANY, direction, port, protocol);
        }
        rule != 0 && rule & TIER_DENY_BIT == 0
    }

    /// The IDENTITY trie's longest match for `peer` (IPv4 as IPv4-mapped), or the world;
    /// an IPv4-mapped IPv6 peer is the world's, as in the programs' `identity_of`.
    fn identity_of(&self, peer: IpAddr) -> u32 {
        if is_ipv4_mapped(peer) {
            return IDENTITY_WORLD;
        }
        let addr = match peer {
            IpAddr::V4(v4) => u128::from(v4.to_ipv6_mapped()),
            IpAddr::V6(v6) => u128::from(v6),
        };
        self.state
            .identity
            .iter()
            .filter(|(p, _)| p.addr <= addr && addr <= p.last())
            .max_by_key(|(p, _): &(&Prefix, _)| p.len)
            .map_or(IDENTITY_WORLD, |(_, id)| *id)
    }

    /// The POLICY trie's longest match for the full key, or 0, over the key's bytes in
    /// memory order as the kernel's LPM trie compares them.
    fn policy_lookup(
        &self,
        endpoint_id: u32,
        identity: u32,
        direction: Direction,
        port: u16,
        protocol: Protocol,
    ) -> u32 {
        let wanted = key_bytes(&PolicyKey {
            endpoint_id,
            identity,
            direction: direction_code(direction),
            protocol: protocol.number(),
            port: port.to_be_bytes(),
        });
        self.state
            .policy
            .iter()
            .filter(|((prefix, key), _)| {
                assert!(
                    *prefix <= POLICY_PREFIX_FULL,
                    "a POLICY entry of {prefix} bits, longer than its key"
                );
                same_leading_bits(&key_bytes(key), &wanted, *prefix)
            })
            .max_by_key(|((prefix, _), _)| *prefix)
            .map_or(0, |(_, rule)| *rule)
    }
}

/// A POLICY key as the map stores it: its fields in declaration order, native-endian, no
/// padding (weir-common's layout checks).
fn key_bytes(key: &PolicyKey) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(POLICY_PREFIX_FULL as usize / 8);
    bytes.extend(key.endpoint_id.to_ne_bytes());
    bytes.extend(key.identity.to_ne_bytes());
    bytes.push(key.direction);
    bytes.push(key.protocol);
    bytes.extend(key.port);
    debug_assert_eq!(bytes.len(), std::mem::size_of::<PolicyKey>());
    bytes
}

/// Whether the first `bits` bits of `a` and `b` are equal, most significant bit first.
fn same_leading_bits(a: &[u8], b: &[u8], bits: u32) -> bool {
    let (whole, rest) = ((bits / 8) as usize, bits % 8);
    a[..whole] == b[..whole] && (rest == 0 || (a[whole] ^ b[whole]) & (0xff_u8 << (8 - rest)) == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leading_bits_compare_most_significant_first() {
        assert!(same_leading_bits(&[0xab, 0xf0], &[0xab, 0xff], 12));
        assert!(!same_leading_bits(&[0xab, 0xf0], &[0xab, 0xff], 13));
        assert!(same_leading_bits(&[0x00], &[0xff], 0));
        assert!(!same_leading_bits(&[0x80], &[0x00], 1));
    }
}
