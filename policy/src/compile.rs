//! Compiles one local pod into its [`Endpoint`]: isolation per direction and the allow
//! rules of every policy that selects it, with peers as address sets.

use super::registry::SetRegistry;
use super::sets::NamedPortGroup;
use super::spec::{PeerSpec, PolicySpec, PortMatch, RuleSpec};
use crate::desired::{
    Direction, DirectionPolicy, Endpoint, Peer, PortRange, Ports, Rule, RuleOrigin,
};
use crate::model::PodInfo;

/// `policies` are the policies that select `pod`.
pub fn compile_endpoint(
    registry: &mut SetRegistry,
    pod: &PodInfo,
    policies: &[&PolicySpec],
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
    }
    endpoint
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
    let mut groups = Vec::new();
    for rule in policy.egress.iter().flatten() {
        for port in &rule.ports {
            let PortMatch::Named(name) = &port.port else {
                continue;
            };
            let bases: Vec<PeerSpec> = if rule.peers.is_empty() {
                vec![PeerSpec::every_pod()]
            } else {
                rule.peers.clone()
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
