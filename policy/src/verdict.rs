//! Evaluates the compiled [`Desired`] state for one connection, as a dataplane would:
//! the source's egress policy, then the destination's ingress policy. Used by
//! `weir explain`, the lab's expected matrices and the tests.

use std::net::IpAddr;

use serde::Serialize;

use crate::desired::{
    Action, Desired, Direction, Endpoint, Peer, Ports, Protocol, RuleOrigin, Tier, TierRule,
};

/// The decision of one side of a connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DirectionVerdict {
    /// The pod on this side, if it is an endpoint here (`None`: nothing enforced).
    pub endpoint: Option<String>,
    pub isolated: bool,
    pub allowed: bool,
    /// Every NetworkPolicy rule that admits the connection (consulted or not).
    pub matched: Vec<RuleOrigin>,
    /// The ClusterNetworkPolicy rule that decided (Accept or Deny), if a tier did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<TierDecision>,
    /// Pass rules that handed the decision on to the next tier, in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub passed_by: Vec<TierDecision>,
}

/// A ClusterNetworkPolicy rule that matched a connection: the first of its tier.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TierDecision {
    pub tier: Tier,
    pub rule: TierRule,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Verdict {
    pub allowed: bool,
    /// A pod talking to itself: always allowed, never enforced.
    pub to_self: bool,
    /// The source's egress policy.
    pub egress: DirectionVerdict,
    /// The destination's ingress policy.
    pub ingress: DirectionVerdict,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VerdictError {
    #[error("pod {0} is not an endpoint (unknown, host-network, not local or without an address)")]
    NotAnEndpoint(String),
    #[error("pod {pod} has no {family} address to reach {to}")]
    NoAddressFamily {
        pod: String,
        family: &'static str,
        to: IpAddr,
    },
}

fn endpoint_of<'a>(desired: &'a Desired, pod: &str) -> Result<&'a Endpoint, VerdictError> {
    desired
        .endpoints
        .get(pod)
        .ok_or_else(|| VerdictError::NotAnEndpoint(pod.to_owned()))
}

/// The verdict for pod `from_pod` (`namespace/name`) connecting to `to` on
/// `port`/`protocol`.
pub fn verdict(
    desired: &Desired,
    from_pod: &str,
    to: IpAddr,
    port: u16,
    protocol: Protocol,
) -> Result<Verdict, VerdictError> {
    let source = endpoint_of(desired, from_pod)?;
    let from = match to {
        IpAddr::V4(_) => source.ipv4.map(IpAddr::V4),
        IpAddr::V6(_) => source.ipv6.map(IpAddr::V6),
    };
    let from = from.ok_or(VerdictError::NoAddressFamily {
        pod: from_pod.to_owned(),
        family: if to.is_ipv4() { "IPv4" } else { "IPv6" },
        to,
    })?;
    Ok(verdict_between(desired, from, to, port, protocol))
}

/// The verdict for a connection between two addresses; either side is enforced only
/// if it is an endpoint.
pub fn verdict_between(
    desired: &Desired,
    from: IpAddr,
    to: IpAddr,
    port: u16,
    protocol: Protocol,
) -> Verdict {
    let by_address = |addr: IpAddr| {
        desired
            .endpoints
            .values()
            .find(|e| e.ipv4.map(IpAddr::V4) == Some(addr) || e.ipv6.map(IpAddr::V6) == Some(addr))
    };
    let egress = direction_verdict(
        desired,
        by_address(from),
        Direction::Egress,
        to,
        port,
        protocol,
    );
    let ingress = direction_verdict(
        desired,
        by_address(to),
        Direction::Ingress,
        from,
        port,
        protocol,
    );
    let to_self = from == to;
    Verdict {
        allowed: to_self || (egress.allowed && ingress.allowed),
        to_self,
        egress,
        ingress,
    }
}

/// One side: `endpoint`'s `direction` policy applied to traffic with `peer`.
pub fn direction_verdict(
    desired: &Desired,
    endpoint: Option<&Endpoint>,
    direction: Direction,
    peer: IpAddr,
    port: u16,
    protocol: Protocol,
) -> DirectionVerdict {
    judge(desired, endpoint, direction, peer, port, protocol, false)
}

/// Pod `from_pod`'s egress to `node_addr`, one of its own node's addresses. A
/// NetworkPolicy never stops a pod reaching its node (Kubernetes semantics: both
/// dataplanes allow it whatever the NetworkPolicies say), but the ClusterNetworkPolicy
/// tiers around them judge it like any destination: an Admin rule decides first; where
/// no NetworkPolicy isolates the direction, a Baseline rule may. The node's side (its
/// INPUT) is no endpoint, so this is the whole verdict.
pub fn egress_to_node(
    desired: &Desired,
    from_pod: &str,
    node_addr: IpAddr,
    port: u16,
    protocol: Protocol,
) -> Result<DirectionVerdict, VerdictError> {
    let source = endpoint_of(desired, from_pod)?;
    Ok(judge(
        desired,
        Some(source),
        Direction::Egress,
        node_addr,
        port,
        protocol,
        true,
    ))
}

/// [`direction_verdict`]; `peer_is_node`: the peer is the endpoint's own node, which
/// the NetworkPolicies always admit.
fn judge(
    desired: &Desired,
    endpoint: Option<&Endpoint>,
    direction: Direction,
    peer: IpAddr,
    port: u16,
    protocol: Protocol,
    peer_is_node: bool,
) -> DirectionVerdict {
    let Some(endpoint) = endpoint else {
        return DirectionVerdict {
            endpoint: None,
            isolated: false,
            allowed: true,
            matched: Vec::new(),
            decided_by: None,
            passed_by: Vec::new(),
        };
    };
    let policy = endpoint.direction(direction);
    let matched: Vec<RuleOrigin> = policy
        .rules
        .iter()
        .filter(|r| admits(desired, r.peer, r.ports, peer, port, protocol))
        .map(|r| r.origin.clone())
        .collect();
    let mut verdict = DirectionVerdict {
        endpoint: Some(endpoint.pod.clone()),
        isolated: policy.isolated,
        allowed: !policy.isolated || !matched.is_empty() || peer_is_node,
        matched,
        decided_by: None,
        passed_by: Vec::new(),
    };
    // The Admin tier, the NetworkPolicies (when they isolate), the Baseline tier: the
    // first to decide does.
    let tier_match = |tier: Tier| {
        let first = policy
            .tier(tier)
            .iter()
            .find(|r| tier_rule_matches(desired, r, peer, port, protocol))?;
        Some(TierDecision {
            tier,
            rule: first.clone(),
        })
    };
    for tier in [Tier::Admin, Tier::Baseline] {
        if tier == Tier::Baseline && policy.isolated {
            break;
        }
        let Some(decision) = tier_match(tier) else {
            continue;
        };
        match decision.rule.action {
            Action::Pass => verdict.passed_by.push(decision),
            Action::Accept | Action::Deny => {
                verdict.allowed = decision.rule.action == Action::Accept;
                verdict.decided_by = Some(decision);
                break;
            }
        }
    }
    verdict
}

/// Whether a ClusterNetworkPolicy rule matches traffic with `peer` on `port`/`protocol`.
pub fn tier_rule_matches(
    desired: &Desired,
    rule: &TierRule,
    peer: IpAddr,
    port: u16,
    protocol: Protocol,
) -> bool {
    admits(desired, rule.peer, rule.ports, peer, port, protocol)
}

/// Whether a rule with `rule_peer` and `rule_ports` admits traffic with `peer` on
/// `port`/`protocol`.
pub fn admits(
    desired: &Desired,
    rule_peer: Peer,
    rule_ports: Ports,
    peer: IpAddr,
    port: u16,
    protocol: Protocol,
) -> bool {
    let peer_ok = match rule_peer {
        Peer::Any => true,
        Peer::Set(id) => desired.sets.get(&id).is_some_and(|s| s.contains(peer)),
    };
    let ports_ok = match rule_ports {
        Ports::All => true,
        Ports::Protocol { protocol: p, range } => {
            p == protocol && range.is_none_or(|r| r.first <= port && port <= r.last)
        }
    };
    peer_ok && ports_ok
}
