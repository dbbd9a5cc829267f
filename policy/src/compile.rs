//! Compiles one local pod into its [`Endpoint`]: isolation per direction and the allow
//! rules of every policy that selects it, and the tier rules of every
//! ClusterNetworkPolicy whose subject it is, with peers as address sets.

use super::registry::SetRegistry;
use super::sets::NamedPortGroup;
use super::spec::{PeerSpec, PolicySpec, PortMatch, PortSpec, RuleSpec};
use crate::cluster_policy::{Action, ClusterPolicySpec, Tier};
use crate::desired::{
    Direction, DirectionPolicy, Endpoint, Peer, PortRange, Ports, Rule, RuleOrigin, TierOrigin,
    TierRule,
};
use crate::model::PodInfo;

/// `policies` are the policies that select `pod`; `cluster` the ClusterNetworkPolicies
/// whose subject it is, in evaluation order ([`ClusterPolicySpec::precedence`]).
pub fn compile_endpoint(
    registry: &mut SetRegistry,
    pod: &PodInfo,
    policies: &[&PolicySpec],
    cluster: &[&ClusterPolicySpec],
) -> Endpoint {
    let mut endpoint = Endpoint {
        pod: pod.key(),
        ipv4: pod.ipv4,
        ipv6: pod.ipv6,
        ingress: DirectionPolicy::default(),
        egress: DirectionPolicy::default(),
    };
    for direction in [Direction::Ingress, Direction::Egress] {
        let target = match direction {
            Direction::Ingress => &mut endpoint.ingress,
            Direction::Egress => &mut endpoint.egress,
        };
        let of_direction = |audit: bool| {
            policies
                .iter()
                .filter(move |p| p.audit == audit && p.rules(direction).is_some())
        };
        // Audit-mode policies count only where no enforced policy isolates the pod: there
        // they could only drop more. Their rules never apply beside enforced ones, where
        // they would allow what enforcement drops.
        let audit = of_direction(false).next().is_none();
        let mut audited = Vec::new();
        for policy in of_direction(audit) {
            let Some(rules) = policy.rules(direction) else {
                continue;
            };
            // Selected by a policy of this direction: isolated, even with no rules.
            target.isolated = true;
            let key = policy.key();
            for (index, rule) in rules.iter().enumerate() {
                let origin = RuleOrigin {
                    policy: key.clone(),
                    rule_index: index as u32,
                };
                expand_rule(registry, pod, direction, rule, &origin, &mut |r| {
                    target.rules.insert(r);
                });
            }
            if audit {
                audited.push(key);
            }
        }
        if !audited.is_empty() {
            audited.sort();
            target.rules.insert(Rule {
                peer: Peer::Any,
                ports: Ports::All,
                origin: RuleOrigin::audit(&audited),
            });
        }
        for policy in cluster {
            let tier = match policy.tier {
                Tier::Admin => &mut target.admin,
                Tier::Baseline => &mut target.baseline,
            };
            compile_tier_rules(registry, pod, direction, policy, tier);
        }
    }
    endpoint
}

/// Appends `policy`'s rules of `direction` to `out`, in order.
fn compile_tier_rules(
    registry: &mut SetRegistry,
    pod: &PodInfo,
    direction: Direction,
    policy: &ClusterPolicySpec,
    out: &mut Vec<TierRule>,
) {
    for (index, rule) in policy.rules(direction).iter().enumerate() {
        let origin = TierOrigin {
            policy: policy.name.clone(),
            priority: policy.priority,
            rule_index: index as u32,
            rule_name: rule.name.clone(),
        };
        if rule.unknown.is_some() {
            // Fail closed: an Accept matches nothing, a Deny or Pass denies everything.
            if rule.action != Action::Accept {
                out.push(TierRule {
                    peer: Peer::Any,
                    ports: Ports::All,
                    action: Action::Deny,
                    origin,
                });
            }
            continue;
        }
        let spec = RuleSpec {
            peers: rule.peers.clone(),
            ports: rule.ports.clone(),
        };
        let action = rule.action;
        let rule_origin = RuleOrigin {
            policy: policy.name.clone(),
            rule_index: index as u32,
        };
        let mut expanded = Vec::new();
        expand_rule(registry, pod, direction, &spec, &rule_origin, &mut |r| {
            expanded.push((r.peer, r.ports))
        });
        // One rule's (peer, ports) pairs share its action: their order does not matter,
        // duplicates do not either.
        expanded.sort();
        expanded.dedup();
        out.extend(expanded.into_iter().map(|(peer, ports)| TierRule {
            peer,
            ports,
            action,
            origin: origin.clone(),
        }));
    }
}

/// Emits one [`Rule`] per (peer, port) of `rule`: peers and ports are each OR-ed.
fn expand_rule(
    registry: &mut SetRegistry,
    pod: &PodInfo,
    direction: Direction,
    rule: &RuleSpec,
    origin: &RuleOrigin,
    emit: &mut dyn FnMut(Rule),
) {
    let peers: Vec<Option<&PeerSpec>> = if rule.peers.is_empty() {
        vec![None]
    } else {
        rule.peers.iter().map(Some).collect()
    };
    let mut rule_for = |peer: Peer, ports: Ports| {
        emit(Rule {
            peer,
            ports,
            origin: origin.clone(),
        })
    };
    for peer in peers {
        let peer_id = |registry: &mut SetRegistry| match peer {
            None => Peer::Any,
            Some(p) => Peer::Set(registry.peer_id(p)),
        };
        if rule.ports.is_empty() {
            rule_for(peer_id(registry), Ports::All);
        }
        for port in &rule.ports {
            let protocol = port.protocol;
            match &port.port {
                PortMatch::Any => rule_for(
                    peer_id(registry),
                    Ports::Protocol {
                        protocol,
                        range: None,
                    },
                ),
                PortMatch::Range(range) => rule_for(
                    peer_id(registry),
                    Ports::Protocol {
                        protocol,
                        range: Some(*range),
                    },
                ),
                // Ingress: the name is this pod's own port; unresolved, it admits nothing.
                PortMatch::Named(name) if direction == Direction::Ingress => {
                    if let Some(number) = pod.named_port(name, protocol) {
                        rule_for(peer_id(registry), single_port(protocol, number));
                    }
                }
                // Egress: the name is the destination's port, so the peer is split by
                // the number each destination pod gives it.
                PortMatch::Named(name) => {
                    let group = NamedPortGroup {
                        base: peer.cloned().unwrap_or_else(PeerSpec::every_pod),
                        name: name.clone(),
                        protocol,
                    };
                    for number in registry.group_numbers(&group) {
                        let id = registry.named_port_id(&group, number);
                        rule_for(Peer::Set(id), single_port(protocol, number));
                    }
                }
            }
        }
    }
}

fn single_port(protocol: crate::desired::Protocol, number: u16) -> Ports {
    Ports::Protocol {
        protocol,
        range: Some(PortRange {
            first: number,
            last: number,
        }),
    }
}

/// The egress named-port groups `policy` uses.
pub fn named_port_groups(policy: &PolicySpec) -> Vec<NamedPortGroup> {
    egress_named_port_groups(
        policy
            .egress
            .iter()
            .flatten()
            .map(|r| (r.peers.as_slice(), r.ports.as_slice())),
    )
}

/// The egress named-port groups a ClusterNetworkPolicy uses.
pub fn cluster_named_port_groups(policy: &ClusterPolicySpec) -> Vec<NamedPortGroup> {
    egress_named_port_groups(
        policy
            .egress
            .iter()
            .filter(|r| r.unknown.is_none())
            .map(|r| (r.peers.as_slice(), r.ports.as_slice())),
    )
}

/// The named-port groups of egress rules given as (peers, ports).
fn egress_named_port_groups<'r>(
    rules: impl Iterator<Item = (&'r [PeerSpec], &'r [PortSpec])>,
) -> Vec<NamedPortGroup> {
    let mut groups = Vec::new();
    for (peers, ports) in rules {
        for port in ports {
            let PortMatch::Named(name) = &port.port else {
                continue;
            };
            let bases: Vec<PeerSpec> = if peers.is_empty() {
                vec![PeerSpec::every_pod()]
            } else {
                peers.to_vec()
            };
            groups.extend(bases.into_iter().map(|base| NamedPortGroup {
                base,
                name: name.clone(),
                protocol: port.protocol,
            }));
        }
    }
    groups
}
