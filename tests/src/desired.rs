//! Desired states built by hand (the tests do not depend on the policy engine).

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
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
        frontends: Default::default(),
    }
}
