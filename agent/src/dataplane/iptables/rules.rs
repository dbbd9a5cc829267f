//! The iptables rules that enforce one endpoint: a chain per isolated direction whose
//! rules RETURN what a policy allows and DROP the rest, and the dispatch rules that send
//! the pod's traffic there. weir never ACCEPTs: a RETURN only means "weir has no
//! objection", so the node's own firewall still applies.

use std::net::IpAddr;

use weir_policy::desired::{Direction, Endpoint, Peer, Ports, Protocol, Rule, RuleOrigin};

use super::names::{endpoint_chain, set_name};
use crate::netfilter::backend::Family;

/// Longest comment kept on a rule (the kernel allows 256 bytes).
const MAX_COMMENT: usize = 200;

fn address(ep: &Endpoint, family: Family) -> Option<IpAddr> {
    match family {
        Family::V4 => ep.ipv4.map(IpAddr::V4),
        Family::V6 => ep.ipv6.map(IpAddr::V6),
    }
}

fn host_prefix(family: Family) -> u8 {
    match family {
        Family::V4 => 32,
        Family::V6 => 128,
    }
}

/// Rule specs (everything after `-A <chain> `) of the endpoint's chain for `direction`
/// in `family`; `None` when the direction is not isolated or the pod has no address in
/// that family (then no chain exists and nothing is dispatched).
pub fn endpoint_rules(ep: &Endpoint, direction: Direction, family: Family) -> Option<Vec<String>> {
    let policy = ep.direction(direction);
    if !policy.isolated || address(ep, family).is_none() {
        return None;
    }
    // The audit rule allows everything: it must come after every rule it would shadow.
    let (audit, enforced): (Vec<&Rule>, Vec<&Rule>) =
        policy.rules.iter().partition(|r| r.origin.is_audit());
    let mut rules: Vec<String> = enforced
        .into_iter()
        .chain(audit)
        .map(|r| rule_spec(r, direction, family))
        .collect();
    rules.push(format!(
        "-m comment --comment {} -j DROP",
        quote(&format!("{} {direction:?} default deny", ep.pod))
    ));
    Some(rules)
}

/// Dispatch specs (in the dispatch chain) for the endpoint's isolated directions.
pub fn dispatch_rules(ep: &Endpoint, hash: u64, family: Family) -> Vec<String> {
    let Some(addr) = address(ep, family) else {
        return Vec::new();
    };
    let host = format!("{addr}/{}", host_prefix(family));
    let mut out = Vec::new();
    if endpoint_rules(ep, Direction::Egress, family).is_some() {
        out.push(format!(
            "-s {host} -j {}",
            endpoint_chain(hash, Direction::Egress)
        ));
    }
    if endpoint_rules(ep, Direction::Ingress, family).is_some() {
        out.push(format!(
            "-d {host} -j {}",
            endpoint_chain(hash, Direction::Ingress)
        ));
    }
    out
}

fn protocol_name(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    }
}

/// One allow rule: protocol and destination ports, then the peer set (the source for
/// ingress, the destination for egress), then where it came from.
fn rule_spec(rule: &Rule, direction: Direction, family: Family) -> String {
    let mut spec = String::new();
    if let Ports::Protocol { protocol, range } = rule.ports {
        spec.push_str(&format!("-p {} ", protocol_name(protocol)));
        if let Some(r) = range {
            if r.first == r.last {
                spec.push_str(&format!("--dport {} ", r.first));
            } else {
                spec.push_str(&format!("--dport {}:{} ", r.first, r.last));
            }
        }
    }
    if let Peer::Set(id) = rule.peer {
        let side = match direction {
            Direction::Ingress => "src",
            Direction::Egress => "dst",
        };
        spec.push_str(&format!(
            "-m set --match-set {} {side} ",
            set_name(id, family)
        ));
    }
    spec.push_str(&format!(
        "-m comment --comment {} -j RETURN",
        quote(&origin_comment(&rule.origin))
    ));
    spec
}

/// An allow rule's comment: `POLICY rule N`, or `POLICIES audit` for an audit rule. The
/// rule counters are attributed by it ([`comment_origin`]).
fn origin_comment(origin: &RuleOrigin) -> String {
    if origin.is_audit() {
        format!("{}{AUDIT_SUFFIX}", origin.policy)
    } else {
        format!("{}{RULE_INFIX}{}", origin.policy, origin.rule_index)
    }
}

const AUDIT_SUFFIX: &str = " audit";
const RULE_INFIX: &str = " rule ";

/// The policy (or, for an audit rule, the audit policies) an allow rule's comment names,
/// and whether it is an audit rule.
pub fn comment_origin(comment: &str) -> Option<(&str, bool)> {
    if let Some(policies) = comment.strip_suffix(AUDIT_SUFFIX) {
        return Some((policies, true));
    }
    comment
        .rsplit_once(RULE_INFIX)
        .map(|(policy, _index)| (policy, false))
}

/// A double-quoted iptables-restore word; quotes and backslashes cannot appear in
/// Kubernetes names but are dropped anyway so no input can break the script.
fn quote(text: &str) -> String {
    let clean: String = text
        .chars()
        .filter(|c| !matches!(c, '"' | '\\') && !c.is_control())
        .take(MAX_COMMENT)
        .collect();
    format!("\"{clean}\"")
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_policy::desired::{DirectionPolicy, PortRange, SetId};

    fn endpoint(rules: Vec<Rule>) -> Endpoint {
        Endpoint {
            pod: "x/a".into(),
            ipv4: Some("10.0.0.5".parse().unwrap()),
            ipv6: None,
            ingress: DirectionPolicy {
                isolated: true,
                rules: rules.into_iter().collect(),
            },
            egress: DirectionPolicy::default(),
        }
    }

    fn rule(peer: Peer, ports: Ports) -> Rule {
        Rule {
            peer,
            ports,
            origin: RuleOrigin {
                policy: "x/allow".into(),
                rule_index: 0,
            },
        }
    }

    #[test]
    fn renders_ports_ranges_sctp_and_sets() {
        let ep = endpoint(vec![
            rule(
                Peer::Set(SetId(1)),
                Ports::Protocol {
                    protocol: Protocol::Tcp,
                    range: Some(PortRange {
                        first: 80,
                        last: 80,
                    }),
                },
            ),
            rule(
                Peer::Any,
                Ports::Protocol {
                    protocol: Protocol::Sctp,
                    range: Some(PortRange {
                        first: 80,
                        last: 81,
                    }),
                },
            ),
        ]);
        let rules = endpoint_rules(&ep, Direction::Ingress, Family::V4).unwrap();
        assert_eq!(
            rules,
            [
                // Rules come in the desired state's order (any peer first).
                "-p sctp --dport 80:81 -m comment --comment \"x/allow rule 0\" -j RETURN",
                "-p tcp --dport 80 -m set --match-set weir-0000000000000001-4 src \
                 -m comment --comment \"x/allow rule 0\" -j RETURN",
                "-m comment --comment \"x/a Ingress default deny\" -j DROP",
            ]
        );
        assert_eq!(
            dispatch_rules(&ep, 0xab, Family::V4),
            ["-d 10.0.0.5/32 -j WEIR-I-00000000000000ab"]
        );
    }

    #[test]
    fn nothing_for_open_directions_or_missing_families() {
        let ep = endpoint(vec![]);
        assert!(endpoint_rules(&ep, Direction::Egress, Family::V4).is_none());
        assert!(endpoint_rules(&ep, Direction::Ingress, Family::V6).is_none());
        assert!(dispatch_rules(&ep, 1, Family::V6).is_empty());
        assert_eq!(quote("a\"b\\c\n"), "\"abc\"");
    }
}
