//! POLICY trie entries of one endpoint: {endpoint, identity, direction, protocol, port}
//! → rule id. "Any peer" is identity [`IDENTITY_ANY`] (the program looks it up second);
//! "all protocols" and "all ports" are shorter prefixes; a port range becomes at most 30
//! aligned prefixes (1–65535 is 16), never one entry per port.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use weir_common::{
    PolicyKey, AUDIT_RULE_BIT, IDENTITY_ANY, POLICY_PREFIX_ANY_PORT, POLICY_PREFIX_ANY_PROTOCOL,
    RULE_ID_FIRST,
};

use weir_policy::desired::{Direction, Endpoint, Peer, Ports, Rule, RuleOrigin, SetId};

/// A POLICY trie key with its prefix length (bits).
pub type PolicyEntry = (u32, PolicyKey);

/// What a rule id stands for; also the name `weir monitor` prints.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RuleName {
    pub policy: String,
    pub direction: Direction,
    pub rule_index: u32,
}

impl RuleName {
    pub fn is_audit(&self) -> bool {
        self.rule_index == RuleOrigin::AUDIT
    }
}

impl std::fmt::Display for RuleName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dir = self.direction.name();
        if self.is_audit() {
            return write!(f, "{} {dir} audit: would be dropped", self.policy);
        }
        write!(f, "{} {dir} rule {}", self.policy, self.rule_index)
    }
}

/// Rule id allocation, stable across changes and restarts (persisted in records).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleTable {
    pub by_id: BTreeMap<u32, RuleName>,
}

impl RuleTable {
    /// Ids for every rule of `endpoints`; names no longer used are released.
    pub fn plan<'a>(
        &mut self,
        endpoints: impl IntoIterator<Item = &'a Endpoint>,
    ) -> BTreeMap<RuleName, u32> {
        let wanted: BTreeSet<RuleName> = endpoints
            .into_iter()
            .flat_map(|ep| {
                [Direction::Ingress, Direction::Egress]
                    .into_iter()
                    .flat_map(move |d| ep.direction(d).rules.iter().map(move |r| name(d, r)))
            })
            .collect();
        let mut by_name: BTreeMap<RuleName, u32> = self
            .by_id
            .iter()
            .filter(|(_, n)| wanted.contains(*n))
            .map(|(id, n)| (n.clone(), *id))
            .collect();
        let mut used: BTreeSet<u32> = by_name.values().copied().collect();
        let mut next = RULE_ID_FIRST;
        for n in wanted {
            if by_name.contains_key(&n) {
                continue;
            }
            while used.contains(&next) {
                next += 1;
            }
            used.insert(next);
            by_name.insert(n, next);
        }
        self.by_id = by_name.iter().map(|(n, id)| (*id, n.clone())).collect();
        by_name
    }
}

pub fn name(direction: Direction, rule: &Rule) -> RuleName {
    RuleName {
        policy: rule.origin.policy.clone(),
        direction,
        rule_index: rule.origin.rule_index,
    }
}

pub fn kernel_direction(d: Direction) -> weir_common::Direction {
    match d {
        Direction::Ingress => weir_common::Direction::Ingress,
        Direction::Egress => weir_common::Direction::Egress,
    }
}

pub fn direction_code(d: Direction) -> u8 {
    kernel_direction(d) as u8
}

/// Splits `first..=last` into aligned (value, prefix bits) blocks, largest first.
pub fn port_prefixes(first: u16, last: u16) -> Vec<(u16, u32)> {
    let mut out = Vec::new();
    let (mut lo, hi) = (u32::from(first), u32::from(last));
    while lo <= hi {
        // Largest block that starts at lo (alignment) and stays within hi.
        let mut size = if lo == 0 {
            1 << 16
        } else {
            1u32 << lo.trailing_zeros()
        };
        while lo + size - 1 > hi {
            size >>= 1;
        }
        out.push((lo as u16, 16 - size.trailing_zeros()));
        lo += size;
    }
    out
}

/// Adds the entries of `ep` (endpoint id `endpoint_id`) to `out`. A key produced by two
/// rules keeps the lower rule id, so the result does not depend on iteration order.
pub fn endpoint_entries(
    endpoint_id: u32,
    ep: &Endpoint,
    identities_of_set: &BTreeMap<SetId, Vec<u32>>,
    rule_ids: &BTreeMap<RuleName, u32>,
    out: &mut BTreeMap<PolicyEntry, u32>,
) {
    for d in [Direction::Ingress, Direction::Egress] {
        let policy = ep.direction(d);
        if !policy.isolated {
            continue;
        }
        for rule in &policy.rules {
            let rule_id = match rule_ids[&name(d, rule)] {
                // Higher than any rule id: a real rule with the same key wins the tie.
                id if rule.origin.is_audit() => id | AUDIT_RULE_BIT,
                id => id,
            };
            let identities: &[u32] = match rule.peer {
                Peer::Any => &[IDENTITY_ANY],
                Peer::Set(id) => identities_of_set.get(&id).map_or(&[], Vec::as_slice),
            };
            for &identity in identities {
                let base = PolicyKey {
                    endpoint_id,
                    identity,
                    direction: direction_code(d),
                    protocol: 0,
                    port: [0; 2],
                };
                let mut put = |prefix: u32, key: PolicyKey| {
                    let v = out.entry((prefix, key)).or_insert(rule_id);
                    *v = (*v).min(rule_id);
                };
                match rule.ports {
                    Ports::All => put(POLICY_PREFIX_ANY_PROTOCOL, base),
                    Ports::Protocol { protocol, range } => {
                        let key = PolicyKey {
                            protocol: protocol.number(),
                            ..base
                        };
                        match range {
                            None => put(POLICY_PREFIX_ANY_PORT, key),
                            Some(r) => {
                                for (port, bits) in port_prefixes(r.first, r.last) {
                                    let port = PolicyKey {
                                        port: port.to_be_bytes(),
                                        ..key
                                    };
                                    put(POLICY_PREFIX_ANY_PORT + bits, port);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn covers(prefixes: &[(u16, u32)], port: u16) -> bool {
        prefixes.iter().any(|&(v, bits)| {
            let mask: u16 = if bits == 0 {
                0
            } else {
                u16::MAX << (16 - bits)
            };
            port & mask == v
        })
    }

    #[test]
    fn whole_port_space_is_cheap() {
        assert_eq!(port_prefixes(1, 65535).len(), 16);
        assert_eq!(port_prefixes(0, 65535), vec![(0, 0)]);
        assert_eq!(port_prefixes(80, 80), vec![(80, 16)]);
    }

    proptest! {
        #[test]
        fn port_prefixes_cover_exactly_the_range(a: u16, b: u16) {
            let (first, last) = (a.min(b), a.max(b));
            let p = port_prefixes(first, last);
            prop_assert!(p.len() <= 30);
            for port in [first, last, first.saturating_sub(1), last.saturating_add(1), first / 2 + last / 2] {
                prop_assert_eq!(covers(&p, port), (first..=last).contains(&port), "port {}", port);
            }
        }
    }
}
