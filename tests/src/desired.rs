//! Desired states built by hand (the tests do not depend on the policy engine).

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use weir_policy::desired::{
    AddressSet, Desired, DirectionPolicy, Endpoint, Member, Peer, PortRange, Ports, Protocol, Rule,
    RuleOrigin, SetId,
};

pub fn pod_set(id: u64, ips: &[Ipv4Addr]) -> AddressSet {
    addr_set(id, ips.iter().map(|ip| IpAddr::V4(*ip)))
}

pub fn addr_set(id: u64, ips: impl IntoIterator<Item = IpAddr>) -> AddressSet {
    AddressSet {
        id: SetId(id),
        definition: format!("test set {id}"),
        members: ips
            .into_iter()
            .map(|ip| Member {
                net: ipnet::IpNet::from(ip),
                except: false,
            })
            .collect(),
    }
}

pub fn tcp_rule(peer: Peer, first: u16, last: u16, policy: &str, index: u32) -> Rule {
    port_rule(Protocol::Tcp, peer, first, last, policy, index)
}

pub fn port_rule(
    protocol: Protocol,
    peer: Peer,
    first: u16,
    last: u16,
    policy: &str,
    index: u32,
) -> Rule {
    Rule {
        peer,
        ports: Ports::Protocol {
            protocol,
            range: Some(PortRange { first, last }),
        },
        origin: RuleOrigin {
            policy: policy.into(),
            rule_index: index,
        },
    }
}

pub fn endpoint(
    pod: &str,
    ip: Ipv4Addr,
    ingress: Option<Vec<Rule>>,
    egress: Option<Vec<Rule>>,
) -> Endpoint {
    let dir = |rules: Option<Vec<Rule>>| DirectionPolicy {
        isolated: rules.is_some(),
        rules: rules
            .unwrap_or_default()
            .into_iter()
            .collect::<BTreeSet<_>>(),
        ..DirectionPolicy::default()
    };
    Endpoint {
        pod: pod.into(),
        ipv4: Some(ip),
        ipv6: None,
        ingress: dir(ingress),
        egress: dir(egress),
    }
}

pub fn desired(sets: Vec<AddressSet>, endpoints: Vec<Endpoint>) -> Desired {
    Desired {
        sets: sets.into_iter().map(|s| (s.id, s)).collect(),
        endpoints: endpoints.into_iter().map(|e| (e.pod.clone(), e)).collect(),
        ..Default::default()
    }
}

/// Pods `x/a`, `x/b` and `x/c`, where b (at `b` and `b6`) admits every port and protocol from ipBlock `0.0.0.0/0` and
/// `::/0`, except `except` and `except6`: the whole address space with holes (hash:net
/// cannot hold a /0; the eBPF trie holds IPv4's as the 96-bit IPv4-mapped prefix). Both
/// dataplanes' tests run this same state.
pub fn whole_space_except(
    a: (Ipv4Addr, Ipv6Addr),
    (b, b6): (Ipv4Addr, Ipv6Addr),
    (except, except6): (Ipv4Addr, Ipv6Addr),
) -> Desired {
    let block = AddressSet {
        id: SetId(7),
        definition: "ipBlock 0.0.0.0/0 and ::/0 except c".into(),
        members: [
            ("0.0.0.0/0".to_string(), false),
            ("::/0".to_string(), false),
            (format!("{except}/32"), true),
            (format!("{except6}/128"), true),
        ]
        .into_iter()
        .map(|(net, except)| Member {
            net: net.parse().expect("a CIDR"),
            except,
        })
        .collect(),
    };
    let any_port = Rule {
        ports: Ports::All,
        ..tcp_rule(Peer::Set(SetId(7)), 0, 0, "x/block", 0)
    };
    let mut target = endpoint("x/b", b, Some(vec![any_port]), None);
    target.ipv6 = Some(b6);
    // a and c are local pods too, isolated in neither direction (a pod interface that is
    // no endpoint's stays isolated as a new pod).
    let peers = [("x/a", a), ("x/c", (except, except6))].map(|(pod, (ip, ip6))| Endpoint {
        ipv6: Some(ip6),
        ..endpoint(pod, ip, None, None)
    });
    desired(vec![block], [target].into_iter().chain(peers).collect())
}
