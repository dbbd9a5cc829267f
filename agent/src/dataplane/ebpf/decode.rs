//! The kernel programs' policy decision in Rust, over the map contents the agent plans
//! ([`KernelState`]), to check the eBPF encoding (identities, LPM prefixes, rule ids)
//! against weir's own verdict: agent/tests/ebpf_encoding.rs on generated cases, and the
//! `ebpf_encoding` fuzz target. It mirrors `judge` in ebpf/weir-ebpf/src/main.rs for a
//! packet with no conntrack entry, no Service and not from the node. It is no stand-in for
//! the programs: those run on the real kernel in the lab tests.

use std::collections::BTreeMap;
use std::net::IpAddr;

use weir_common::{
    IDENTITY_ANY, IDENTITY_WORLD, POLICY_PREFIX_ANY_PORT, POLICY_PREFIX_ANY_PROTOCOL,
    POLICY_PREFIX_FULL,
};
use weir_policy::desired::{Desired, Direction, PodKey, Protocol};

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
    let plan = IdentityTable::default().plan(desired.sets.values());
    let rule_ids = RuleTable::default().plan(desired.endpoints.values());
    let placed: BTreeMap<PodKey, (u32, String, u32)> = desired
        .endpoints
        .keys()
        .zip(1..)
        .map(|(pod, id)| (pod.clone(), (id, format!("lxc{id}"), id)))
        .collect();
    let (state, _) = planned_state(desired, &placed, plan, &rule_ids, &[]);
    let ids = placed
        .into_iter()
        .map(|(pod, (id, _, _))| (pod, id))
        .collect();
    Encoded { state, ids }
}

impl Encoded {
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
        let mut rule = 0;
        if identity != IDENTITY_WORLD {
            rule = self.policy_lookup(id, identity, direction, port, protocol);
        }
        if rule == 0 {
            rule = self.policy_lookup(id, IDENTITY_ANY, direction, port, protocol);
        }
        rule != 0
    }

    /// The IDENTITY trie's longest match for `peer` (IPv4 as IPv4-mapped), or the world.
    fn identity_of(&self, peer: IpAddr) -> u32 {
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

    /// The POLICY trie's longest match for the full key, or 0: the bits past the
    /// direction are the protocol, then the port, most significant first.
    fn policy_lookup(
        &self,
        endpoint_id: u32,
        identity: u32,
        direction: Direction,
        port: u16,
        protocol: Protocol,
    ) -> u32 {
        self.state
            .policy
            .iter()
            .filter(|((prefix, key), _)| {
                let port_bits = prefix.saturating_sub(POLICY_PREFIX_ANY_PORT);
                let port_mask = match port_bits {
                    0 => 0,
                    bits => u16::MAX << (16 - bits.min(16)),
                };
                *prefix >= POLICY_PREFIX_ANY_PROTOCOL
                    && *prefix <= POLICY_PREFIX_FULL
                    && key.endpoint_id == endpoint_id
                    && key.identity == identity
                    && key.direction == direction_code(direction)
                    && (*prefix < POLICY_PREFIX_ANY_PORT || key.protocol == protocol.number())
                    && u16::from_be_bytes(key.port) & port_mask == port & port_mask
            })
            .max_by_key(|((prefix, _), _)| *prefix)
            .map_or(0, |(_, rule)| *rule)
    }
}
