//! The iptables rules that enforce one endpoint: a chain per isolated direction whose
//! rules RETURN what a policy allows and DROP the rest, and the dispatch rules that send
//! the pod's traffic there. weir never ACCEPTs: a RETURN only means "weir has no
//! objection", so the node's own firewall still applies.
//!
//! A direction that ClusterNetworkPolicy tiers judge has a chain too, isolated or not:
//! the Admin rules in order (Accept RETURNs, Deny DROPs), then the NetworkPolicies' rules
//! as above when they isolate, else the Baseline rules (Accept and Pass RETURN, Deny
//! DROPs). An Admin Pass jumps past the rest of the Admin rules with `-g` to the
//! [`passed_chain`], which holds what follows them: there a RETURN goes back to the
//! dispatch chain, as from the endpoint chain.
//!
//! A tier of many rules is indexed by protocol and destination port
//! ([`super::tier_index`]): its rules move into a tree of chains
//! ([`tier_index_chain`]) whose leaves hold the rules that can match one port interval,
//! so that a new connection's cost grows with the tree's depth, not the tier's length.
//!
//! Before each drop (and before the audit rule, which passes what an audit-mode policy
//! would drop) an NFLOG rule sends the packet's headers to the agent's verdict stream. Its
//! prefix carries the rule's identity ([`LogPrefix`]), and a kernel-side limit bounds what
//! a flood costs the agent.

use std::net::IpAddr;

use weir_policy::desired::{
    Action, Direction, DirectionPolicy, Endpoint, Peer, Ports, Protocol, Rule, RuleOrigin, Tier,
    TierRule,
};

use super::names::SPOOF_CHAIN;
#[cfg(doc)]
use super::names::TO_NODE_CHAIN;
use super::names::{endpoint_chain, node_set_name, passed_chain, set_name, tier_index_chain};
use super::tier_index::{self, Step, Target};
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

/// The NFLOG group weir's log rules send to (per network namespace; the agent reads it).
pub const NFLOG_GROUP: u16 = 9402;

/// The kernel-side bound on each log rule: per rule, so per endpoint and direction.
const LOG_LIMIT: &str = "-m limit --limit 20/sec --limit-burst 40";

/// What a log rule logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogKind {
    /// The endpoint's default deny drops it.
    Deny,
    /// Only audit-mode policies isolate the direction, and they would drop it.
    Audit,
    /// Anti-spoofing drops it (its source is not the pod's).
    Spoof,
}

/// An NFLOG prefix: `weir <deny|audit|spoof> <I|E> <endpoint hash>`, under the kernel's 64
/// bytes. The hash is the endpoint chains' ([`super::names::ChainNames`]), so the reader
/// names the pod from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogPrefix {
    pub kind: LogKind,
    pub direction: Direction,
    pub hash: u64,
}

impl std::fmt::Display for LogPrefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            LogKind::Deny => "deny",
            LogKind::Audit => "audit",
            LogKind::Spoof => "spoof",
        };
        let d = match self.direction {
            Direction::Ingress => 'I',
            Direction::Egress => 'E',
        };
        write!(f, "weir {kind} {d} {:016x}", self.hash)
    }
}

impl std::str::FromStr for LogPrefix {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        let mut words = s.split(' ');
        if words.next() != Some("weir") {
            return Err(());
        }
        let kind = match words.next() {
            Some("deny") => LogKind::Deny,
            Some("audit") => LogKind::Audit,
            Some("spoof") => LogKind::Spoof,
            _ => return Err(()),
        };
        let direction = match words.next() {
            Some("I") => Direction::Ingress,
            Some("E") => Direction::Egress,
            _ => return Err(()),
        };
        let hash = words
            .next()
            .filter(|h| h.len() == 16)
            .and_then(|h| u64::from_str_radix(h, 16).ok())
            .ok_or(())?;
        if words.next().is_some() {
            return Err(());
        }
        Ok(LogPrefix {
            kind,
            direction,
            hash,
        })
    }
}

/// The log rule for packets matching `matches` (match options, each followed by a space).
pub fn log_rule(matches: &str, prefix: LogPrefix) -> String {
    format!("{matches}{LOG_LIMIT} -j NFLOG --nflog-prefix \"{prefix}\" --nflog-group {NFLOG_GROUP}")
}

/// The rule specs (everything after `-A <chain> `) of an endpoint's direction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointChains {
    /// The [`endpoint_chain`]'s.
    pub main: Vec<String>,
    /// The [`passed_chain`]'s, when an Admin Pass goes there (or the Admin tier is
    /// indexed: its leaves go there too).
    pub passed: Option<Vec<String>>,
    /// The tiers' index chains ([`tier_index_chain`]), each after every chain it names.
    pub index: Vec<(String, Vec<String>)>,
}

/// Whether the endpoint's `direction` in `family` has a chain: a NetworkPolicy isolates
/// it or tiers judge it, and the pod has an address in that family.
fn enforced(ep: &Endpoint, direction: Direction, family: Family) -> bool {
    let policy = ep.direction(direction);
    (policy.isolated || policy.is_tiered()) && address(ep, family).is_some()
}

/// The chains of the endpoint (chain hash `hash`) for `direction` in `family`; `None`
/// when it has none (see [`enforced`]; then nothing is dispatched). `log`: whether its
/// drops (and audit verdicts) are logged.
pub fn endpoint_rules(
    ep: &Endpoint,
    direction: Direction,
    family: Family,
    hash: u64,
    log: bool,
) -> Option<EndpointChains> {
    if !enforced(ep, direction, family) {
        return None;
    }
    let policy = ep.direction(direction);
    let log = log.then_some(hash);
    let mut index = Vec::new();
    let tiers = TierChains {
        direction,
        family,
        log,
        hash,
    };
    let rest = rest_rules(ep, policy, &tiers, &mut index);
    if policy.admin.is_empty() {
        return Some(EndpointChains {
            main: rest,
            passed: None,
            index,
        });
    }
    let passed = passed_chain(hash, direction);
    if let Some(head) = tiers.indexed(&policy.admin, Tier::Admin, &passed, &mut index) {
        // The leaves end in the passed chain: what follows the Admin tier is there.
        let mut main = head;
        main.push(format!("-g {passed}"));
        return Some(EndpointChains {
            main,
            passed: Some(rest),
            index,
        });
    }
    let mut main = Vec::new();
    for rule in &policy.admin {
        main.extend(tier_rule_specs(
            rule,
            Tier::Admin,
            direction,
            family,
            log,
            &passed,
        ));
    }
    if policy.admin.iter().any(|r| r.action == Action::Pass) {
        main.push(format!("-g {passed}"));
        return Some(EndpointChains {
            main,
            passed: Some(rest),
            index,
        });
    }
    main.extend(rest);
    Some(EndpointChains {
        main,
        passed: None,
        index,
    })
}

/// What a tier's chains are rendered for: one endpoint's direction in one family.
struct TierChains {
    direction: Direction,
    family: Family,
    log: Option<u64>,
    hash: u64,
}

impl TierChains {
    /// The head of `rules` (`tier`'s, whose Pass and leaves' end go to `passed`; an empty
    /// `passed`: nothing follows, a leaf's end falls through) when the tier is indexed,
    /// its index chains added to `index`; `None`: it stays linear.
    fn indexed(
        &self,
        rules: &[TierRule],
        tier: Tier,
        passed: &str,
        index: &mut Vec<(String, Vec<String>)>,
    ) -> Option<Vec<String>> {
        let ports: Vec<Ports> = rules.iter().map(|r| r.ports).collect();
        let tree = tier_index::index(&ports)?;
        let name = |n: usize| tier_index_chain(self.hash, self.direction, tier, n);
        // What follows the tier: its continuation chain, or (nothing follows) a RETURN,
        // which leaves the endpoint chain as its fall-through would.
        let jump = |t: Target| match (t, passed) {
            (Target::Chain(n), _) => format!("-g {}", name(n)),
            (Target::Continue, "") => "-j RETURN".to_string(),
            (Target::Continue, passed) => format!("-g {passed}"),
        };
        let render = |steps: &[Step]| -> Vec<String> {
            let mut specs = Vec::new();
            for step in steps {
                match *step {
                    Step::Rule(i) => specs.extend(tier_rule_specs(
                        &rules[i],
                        tier,
                        self.direction,
                        self.family,
                        self.log,
                        passed,
                    )),
                    Step::Protocol(p, t) => {
                        specs.push(format!("-p {} {}", protocol_name(p), jump(t)))
                    }
                    Step::Ports(p, first, last, t) => specs.push(format!(
                        "{}{}",
                        match_spec(
                            Peer::Any,
                            Ports::Protocol {
                                protocol: p,
                                range: Some(weir_policy::desired::PortRange { first, last }),
                            },
                            self.direction,
                            self.family,
                        ),
                        jump(t)
                    )),
                    Step::Goto(t) => specs.push(jump(t)),
                }
            }
            specs
        };
        for n in tree.children_first() {
            index.push((name(n), render(&tree.chains[n])));
        }
        Some(render(&tree.head))
    }
}

/// What follows the Admin rules: the NetworkPolicies' rules and default deny when they
/// isolate, else the Baseline rules (then what none decides returns: allowed).
fn rest_rules(
    ep: &Endpoint,
    policy: &DirectionPolicy,
    tiers: &TierChains,
    index: &mut Vec<(String, Vec<String>)>,
) -> Vec<String> {
    let (direction, family, log) = (tiers.direction, tiers.family, tiers.log);
    if !policy.isolated {
        // Nothing follows the Baseline tier: a leaf's end falls through, allowed.
        if let Some(head) = tiers.indexed(&policy.baseline, Tier::Baseline, "", index) {
            return head;
        }
        return policy
            .baseline
            .iter()
            .flat_map(|r| tier_rule_specs(r, Tier::Baseline, direction, family, log, ""))
            .collect();
    }
    let mut rules = Vec::new();
    if direction == Direction::Egress && policy.is_tiered() {
        // The chain also judges the pod's packets to its node (TO_NODE_CHAIN), which no
        // NetworkPolicy stops.
        rules.push(NODE_RETURN.to_string());
    }
    // The audit rule allows everything: it must come after every rule it would shadow.
    let (audit, enforced): (Vec<&Rule>, Vec<&Rule>) =
        policy.rules.iter().partition(|r| r.origin.is_audit());
    rules.extend(
        enforced
            .into_iter()
            .map(|r| rule_spec(r, direction, family)),
    );
    let log_as = |kind| {
        log.map(|hash| {
            log_rule(
                "",
                LogPrefix {
                    kind,
                    direction,
                    hash,
                },
            )
        })
    };
    if !audit.is_empty() {
        rules.extend(log_as(LogKind::Audit));
    }
    rules.extend(audit.into_iter().map(|r| rule_spec(r, direction, family)));
    rules.extend(log_as(LogKind::Deny));
    rules.push(format!(
        "-m comment --comment {} -j DROP",
        quote(&format!("{} {direction:?} default deny", ep.pod))
    ));
    rules
}

/// The specs of one tier rule: Accept RETURNs; Deny DROPs, logged first when `log`
/// (the endpoint's hash) is given; Pass goes to `passed` in the Admin tier and RETURNs
/// (nothing later decides) in the Baseline tier.
fn tier_rule_specs(
    rule: &TierRule,
    tier: Tier,
    direction: Direction,
    family: Family,
    log: Option<u64>,
    passed: &str,
) -> Vec<String> {
    let matches = match_spec(rule.peer, rule.ports, direction, family);
    let comment = quote(&format!(
        "{TIER_COMMENT_PREFIX}{tier} {} rule {} {}",
        rule.origin.policy, rule.origin.rule_index, rule.action
    ));
    let target = match (rule.action, tier) {
        (Action::Accept, _) | (Action::Pass, Tier::Baseline) => "-j RETURN".to_owned(),
        (Action::Deny, _) => "-j DROP".to_owned(),
        (Action::Pass, Tier::Admin) => format!("-g {passed}"),
    };
    let mut specs = Vec::new();
    if let (Action::Deny, Some(hash)) = (rule.action, log) {
        let prefix = LogPrefix {
            kind: LogKind::Deny,
            direction,
            hash,
        };
        specs.push(log_rule(&matches, prefix));
    }
    specs.push(format!("{matches}-m comment --comment {comment} {target}"));
    specs
}

/// Starts a tier rule's comment: `cnp <tier> <policy> rule <index> <action>`.
const TIER_COMMENT_PREFIX: &str = "cnp ";

/// The ClusterNetworkPolicy and action a tier rule's comment names.
pub fn tier_comment_origin(comment: &str) -> Option<(&str, Action)> {
    let rest = comment.strip_prefix(TIER_COMMENT_PREFIX)?;
    let mut words = rest.split(' ');
    let _tier = words.next()?;
    let policy = words.next()?;
    let action = match (words.next()?, words.next()?, words.next()?) {
        ("rule", _, "Accept") => Action::Accept,
        ("rule", _, "Deny") => Action::Deny,
        ("rule", _, "Pass") => Action::Pass,
        _ => return None,
    };
    Some((policy, action))
}

/// In a tiered egress chain, before the NetworkPolicies' rules: the node's own addresses.
const NODE_RETURN: &str =
    "-m addrtype --dst-type LOCAL -m comment --comment \"its node: no NetworkPolicy stops it\" -j RETURN";

/// The [`TO_NODE_CHAIN`] jump of the endpoint (chain hash `hash`): its packets to the node
/// go to its egress chain, where tiers judge that direction; `None` where they do not.
pub fn to_node_rule(ep: &Endpoint, hash: u64, family: Family) -> Option<String> {
    let addr = address(ep, family)?;
    ep.egress.is_tiered().then(|| {
        format!(
            "-s {addr}/{} -j {}",
            host_prefix(family),
            endpoint_chain(hash, Direction::Egress)
        )
    })
}

/// [`TO_NODE_CHAIN`]'s rules, given the endpoints' [`to_node_rule`]s. Anti-spoofing
/// (`spoof_chain`; not for IPv6 link-local and unspecified sources, which neighbour
/// discovery uses) always: a pod's forged packets to its own node are dropped, as eBPF's
/// classifier drops them, whether or not a tier judges the node. Then, only when there are
/// jumps: replies of the node's own connections and IPv6 neighbour discovery, as the eBPF
/// programs pass them first; packets to local addresses that are not the node's (under
/// kube-proxy's ipvs mode, Services' on `kube-ipvs0`: judged after IPVS, in OUTPUT, by
/// their backend), as eBPF does not count them the node's; and the jumps.
pub fn to_node_chain(jumps: Vec<String>, family: Family) -> Vec<String> {
    let mut rules = Vec::new();
    if family == Family::V6 {
        rules.push("-s fe80::/10 -j RETURN".to_string());
        rules.push("-s ::/128 -j RETURN".to_string());
    }
    rules.push(format!("-j {SPOOF_CHAIN}"));
    if jumps.is_empty() {
        return rules;
    }
    rules.extend(conntrack_rules(family));
    if family == Family::V6 {
        // Neighbour discovery (ICMPv6 133-137, unrouted) towards link scope.
        for dst in ["ff02::/16", "fe80::/10"] {
            for ty in 133..=137 {
                rules.push(format!(
                    "-d {dst} -p ipv6-icmp -m icmp6 --icmpv6-type {ty} -m hl --hl-eq 255 -j RETURN"
                ));
            }
        }
    }
    rules.push(format!(
        "-m set ! --match-set {} dst -m comment --comment {} -j RETURN",
        node_set_name(family),
        quote("not a node address: a Service address is judged after IPVS")
    ));
    rules.extend(jumps);
    rules
}

/// The first rules of [`TO_NODE_CHAIN`]: a pod's encapsulated packets to its node
/// (IPv4-in-IP, IPv6-in-IP, GRE; UDP to VXLAN's and Geneve's ports) are dropped, before
/// anything returns. A node with such a tunnel device would take them apart and forward
/// the inner packet from the tunnel device, where no anti-spoofing rule of the pod's
/// applies; a pod does not tunnel to its own node. Pod interfaces by their name prefixes
/// (new-pod isolation's; none when it is off), and on a bridge their ports.
pub fn pod_tunnel_rules(prefixes: &[String], bridged: bool) -> Vec<String> {
    let comment = quote("encapsulated traffic from a pod to its node");
    let mut rules = Vec::new();
    for prefix in prefixes {
        let mut from = vec![format!("-i {prefix}+")];
        if bridged {
            from.push(format!("-m physdev --physdev-in {prefix}+"));
        }
        for pod in &from {
            // Names as iptables-save prints them (from /etc/protocols, which the image has).
            for (protocol, ports) in [
                ("ipencap", ""),
                ("ipv6", ""),
                ("gre", ""),
                ("udp", " -m multiport --dports 4789,8472,6081"),
            ] {
                rules.push(format!(
                    "{}{ports} -m comment --comment {comment} -j DROP",
                    protocol_from(pod, protocol)
                ));
            }
        }
    }
    rules
}

/// `-i X -p P`, or `-p P -m physdev ...`: iptables-save prints the protocol after the
/// interface and before any match module.
fn protocol_from(pod: &str, protocol: &str) -> String {
    if pod.starts_with("-m ") {
        format!("-p {protocol} {pod}")
    } else {
        format!("{pod} -p {protocol}")
    }
}

/// Replies of connections weir already let through, and the ICMP errors conntrack
/// relates to them (it checks they travel the connection's path) when no longer than an
/// error may be: RFC 1812's 576 bytes for IPv4, IPv6's minimum MTU for ICMPv6, as the eBPF
/// programs check. A longer one is judged by policy as a packet of its own: a pod cannot
/// use its own flow to carry more than an error's bytes. Nothing else is RELATED without
/// conntrack helpers, which weir does not let past policy (eBPF has none).
/// Written as `iptables-save` prints them back.
pub fn conntrack_rules(family: Family) -> [String; 2] {
    let (protocol, max) = match family {
        Family::V4 => ("icmp", 576),
        Family::V6 => ("ipv6-icmp", 1280),
    };
    [
        "-m conntrack --ctstate ESTABLISHED -j RETURN".to_string(),
        format!(
            "-p {protocol} -m conntrack --ctstate RELATED -m length --length 0:{max} -j RETURN"
        ),
    ]
}

/// Dispatch specs (in the dispatch chain) for the endpoint's isolated directions, by the
/// direction they send to. A packet leaves its source before it reaches its destination:
/// the dispatch chain holds every egress jump before every ingress one, so a packet both
/// ends would drop is dropped, and logged and counted, by its source's egress, as on eBPF.
pub fn dispatch_rules(ep: &Endpoint, hash: u64, family: Family) -> Vec<(Direction, String)> {
    let Some(addr) = address(ep, family) else {
        return Vec::new();
    };
    let host = format!("{addr}/{}", host_prefix(family));
    let mut out = Vec::new();
    if enforced(ep, Direction::Egress, family) {
        out.push((
            Direction::Egress,
            format!("-s {host} -j {}", endpoint_chain(hash, Direction::Egress)),
        ));
    }
    if enforced(ep, Direction::Ingress, family) {
        out.push((
            Direction::Ingress,
            format!("-d {host} -j {}", endpoint_chain(hash, Direction::Ingress)),
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

/// One allow rule: what it matches ([`match_spec`]), then where it came from.
fn rule_spec(rule: &Rule, direction: Direction, family: Family) -> String {
    format!(
        "{}-m comment --comment {} -j RETURN",
        match_spec(rule.peer, rule.ports, direction, family),
        quote(&origin_comment(&rule.origin))
    )
}

/// Protocol and destination ports, then the peer set (the source for ingress, the
/// destination for egress); each option followed by a space.
fn match_spec(peer: Peer, ports: Ports, direction: Direction, family: Family) -> String {
    let mut spec = String::new();
    if let Ports::Protocol { protocol, range } = ports {
        let name = protocol_name(protocol);
        spec.push_str(&format!("-p {name} "));
        if let Some(r) = range {
            // The port match named, as `iptables-save` prints it back (so a repair finds
            // the chain unchanged).
            spec.push_str(&format!("-m {name} "));
            if r.first == r.last {
                spec.push_str(&format!("--dport {} ", r.first));
            } else {
                spec.push_str(&format!("--dport {}:{} ", r.first, r.last));
            }
        }
    }
    if let Peer::Set(id) = peer {
        let side = match direction {
            Direction::Ingress => "src",
            Direction::Egress => "dst",
        };
        spec.push_str(&format!(
            "-m set --match-set {} {side} ",
            set_name(id, family)
        ));
    }
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
    use super::super::names::chain_direction;
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
                ..DirectionPolicy::default()
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
        let rules = endpoint_rules(&ep, Direction::Ingress, Family::V4, 0xab, false)
            .unwrap()
            .main;
        assert_eq!(
            rules,
            [
                // Rules come in the desired state's order (any peer first).
                "-p sctp -m sctp --dport 80:81 -m comment --comment \"x/allow rule 0\" -j RETURN",
                "-p tcp -m tcp --dport 80 -m set --match-set weir-0000000000000001-4 src \
                 -m comment --comment \"x/allow rule 0\" -j RETURN",
                "-m comment --comment \"x/a Ingress default deny\" -j DROP",
            ]
        );
        assert_eq!(
            dispatch_rules(&ep, 0xab, Family::V4),
            [(
                Direction::Ingress,
                "-d 10.0.0.5/32 -j WEIR-I-00000000000000ab".to_string()
            )]
        );
    }

    #[test]
    fn drops_and_audit_verdicts_are_logged_with_the_rule_identity() {
        let mut audit = rule(Peer::Any, Ports::All);
        audit.origin = RuleOrigin::audit(&["x/try".to_string()]);
        let ep = endpoint(vec![audit]);
        let rules = endpoint_rules(&ep, Direction::Ingress, Family::V4, 0xab, true)
            .unwrap()
            .main;
        let log = |kind: &str| {
            format!(
                "-m limit --limit 20/sec --limit-burst 40 -j NFLOG \
                 --nflog-prefix \"weir {kind} I 00000000000000ab\" --nflog-group 9402"
            )
        };
        assert_eq!(
            rules,
            [
                log("audit"),
                "-m comment --comment \"x/try audit\" -j RETURN".to_string(),
                log("deny"),
                "-m comment --comment \"x/a Ingress default deny\" -j DROP".to_string(),
            ]
        );
        let prefix: LogPrefix = "weir audit I 00000000000000ab".parse().unwrap();
        assert_eq!(
            prefix,
            LogPrefix {
                kind: LogKind::Audit,
                direction: Direction::Ingress,
                hash: 0xab
            }
        );
        assert_eq!(prefix.to_string(), "weir audit I 00000000000000ab");
        for bad in [
            "weir deny I ab",
            "kube deny I 00000000000000ab",
            "weir deny X 00000000000000ab",
        ] {
            assert!(bad.parse::<LogPrefix>().is_err(), "{bad}");
        }
    }

    #[test]
    fn nothing_for_open_directions_or_missing_families() {
        let ep = endpoint(vec![]);
        assert!(endpoint_rules(&ep, Direction::Egress, Family::V4, 0xab, false).is_none());
        assert!(endpoint_rules(&ep, Direction::Ingress, Family::V6, 1, true).is_none());
        assert!(dispatch_rules(&ep, 1, Family::V6).is_empty());
        assert_eq!(quote("a\"b\\c\n"), "\"abc\"");
    }

    fn tier_rule(peer: Peer, ports: Ports, action: Action, index: u32) -> TierRule {
        TierRule {
            peer,
            ports,
            action,
            origin: weir_policy::desired::TierOrigin {
                policy: "guard".into(),
                priority: 3,
                rule_index: index,
                rule_name: None,
            },
        }
    }

    #[test]
    fn a_long_admin_tier_is_indexed_by_port_and_its_leaves_continue_in_the_passed_chain() {
        let tcp = |port| Ports::Protocol {
            protocol: Protocol::Tcp,
            range: Some(PortRange {
                first: port,
                last: port,
            }),
        };
        let mut ep = endpoint(vec![rule(Peer::Set(SetId(1)), Ports::All)]);
        ep.ingress.admin = (0..20)
            .map(|i| tier_rule(Peer::Set(SetId(2)), tcp(1000 + i as u16), Action::Deny, i))
            .collect();
        ep.ingress
            .admin
            .push(tier_rule(Peer::Any, Ports::All, Action::Accept, 20));
        let chains = endpoint_rules(&ep, Direction::Ingress, Family::V4, 0xab, false).unwrap();
        let passed = "WEIR-IP-00000000000000ab";
        assert_eq!(
            chains.main,
            [
                "-p tcp -g WEIR-IA0000-00000000000000ab".to_string(),
                "-m comment --comment \"cnp Admin guard rule 20 Accept\" -j RETURN".to_string(),
                format!("-g {passed}"),
            ]
        );
        assert_eq!(chains.passed.as_ref().map(Vec::len), Some(2));
        // Each chain is listed after every chain it names, and names fit the kernel.
        let mut defined = std::collections::BTreeSet::from([passed.to_string()]);
        for (name, rules) in &chains.index {
            assert!(name.len() <= super::super::names::MAX_CHAIN_NAME, "{name}");
            for rule in rules {
                if let Some(target) = rule.split("-g ").nth(1) {
                    assert!(defined.contains(target), "{name}: {rule} before {target}");
                }
            }
            defined.insert(name.clone());
        }
        // A leaf: port 1005's Deny, then the any-port Accept, then what follows the tier.
        let leaf = chains
            .index
            .iter()
            .find(|(_, rules)| rules.iter().any(|r| r.contains("--dport 1005 ")))
            .expect("port 1005's leaf");
        assert_eq!(leaf.1.len(), 3, "{leaf:#?}");
        assert!(leaf.1[1].contains("rule 20 Accept"), "{leaf:#?}");
        assert_eq!(leaf.1[2], format!("-g {passed}"));
    }

    #[test]
    fn an_admin_pass_goes_to_the_passed_chain_and_the_baseline_stands_alone() {
        let tcp80 = Ports::Protocol {
            protocol: Protocol::Tcp,
            range: Some(PortRange {
                first: 80,
                last: 80,
            }),
        };
        let mut ep = endpoint(vec![rule(Peer::Set(SetId(1)), Ports::All)]);
        ep.ingress.admin = vec![
            tier_rule(Peer::Set(SetId(2)), tcp80, Action::Deny, 0),
            tier_rule(Peer::Set(SetId(2)), Ports::All, Action::Pass, 1),
            tier_rule(Peer::Any, Ports::All, Action::Accept, 2),
        ];
        ep.egress.baseline = vec![
            tier_rule(Peer::Any, tcp80, Action::Pass, 0),
            tier_rule(Peer::Set(SetId(3)), Ports::All, Action::Deny, 1),
        ];
        let set = |id| set_name(SetId(id), Family::V4);
        let chains = endpoint_rules(&ep, Direction::Ingress, Family::V4, 0xab, false).unwrap();
        assert_eq!(
            chains.main,
            [
                format!("-p tcp -m tcp --dport 80 -m set --match-set {} src -m comment --comment \"cnp Admin guard rule 0 Deny\" -j DROP", set(2)),
                format!("-m set --match-set {} src -m comment --comment \"cnp Admin guard rule 1 Pass\" -g WEIR-IP-00000000000000ab", set(2)),
                "-m comment --comment \"cnp Admin guard rule 2 Accept\" -j RETURN".to_string(),
                "-g WEIR-IP-00000000000000ab".to_string(),
            ]
        );
        assert_eq!(
            chains.passed.unwrap(),
            [
                format!(
                    "-m set --match-set {} src -m comment --comment \"x/allow rule 0\" -j RETURN",
                    set(1)
                ),
                "-m comment --comment \"x/a Ingress default deny\" -j DROP".to_string(),
            ]
        );
        // Not isolated: the Baseline alone, logged drops included; a Pass returns.
        let egress = endpoint_rules(&ep, Direction::Egress, Family::V4, 0xab, true).unwrap();
        assert_eq!(egress.passed, None);
        assert_eq!(
            egress.main,
            [
                "-p tcp -m tcp --dport 80 -m comment --comment \"cnp Baseline guard rule 0 Pass\" -j RETURN".to_string(),
                log_rule(&format!("-m set --match-set {} dst ", set(3)), LogPrefix { kind: LogKind::Deny, direction: Direction::Egress, hash: 0xab }),
                format!("-m set --match-set {} dst -m comment --comment \"cnp Baseline guard rule 1 Deny\" -j DROP", set(3)),
            ]
        );
        assert_eq!(dispatch_rules(&ep, 0xab, Family::V4).len(), 2);
        assert_eq!(
            tier_comment_origin("cnp Admin guard rule 1 Pass"),
            Some(("guard", Action::Pass))
        );
        assert_eq!(tier_comment_origin("x/allow rule 0"), None);
        assert_eq!(
            chain_direction("WEIR-EP-00000000000000ab"),
            Some(Direction::Egress)
        );
    }

    #[test]
    fn tiers_judge_a_pods_egress_to_its_node_and_network_policies_never_stop_it() {
        let np = rule(Peer::Set(SetId(1)), Ports::All);
        let mut ep = endpoint(vec![np.clone()]);
        // Only NetworkPolicies: the node is not the chain's business.
        ep.egress.isolated = true;
        ep.egress.rules = [np].into();
        assert_eq!(to_node_rule(&ep, 0xab, Family::V4), None);
        let plain = endpoint_rules(&ep, Direction::Egress, Family::V4, 0xab, false).unwrap();
        assert!(!plain.main.contains(&NODE_RETURN.to_string()));
        // Anti-spoofing only: a pod's forged packets to its node are dropped all the same.
        assert_eq!(to_node_chain(Vec::new(), Family::V4), ["-j WEIR-SPOOF"]);
        // An Admin rule: the node's packets come to the chain, and after the Admin rules
        // return before the NetworkPolicies'.
        ep.egress.admin = vec![tier_rule(Peer::Set(SetId(2)), Ports::All, Action::Deny, 0)];
        let jump = to_node_rule(&ep, 0xab, Family::V4).unwrap();
        assert_eq!(jump, "-s 10.0.0.5/32 -j WEIR-E-00000000000000ab");
        assert_eq!(to_node_rule(&ep, 0xab, Family::V6), None);
        let tiered = endpoint_rules(&ep, Direction::Egress, Family::V4, 0xab, false).unwrap();
        assert_eq!(tiered.main[1], NODE_RETURN);
        let chain = to_node_chain(vec![jump.clone()], Family::V4);
        assert_eq!(chain.first().map(String::as_str), Some("-j WEIR-SPOOF"));
        assert_eq!(chain.last(), Some(&jump));
        // Only the node's own addresses go to the jumps: not kube-ipvs0's Service
        // addresses, which are local too (see node_addresses).
        assert_eq!(
            chain[chain.len() - 2],
            "-m set ! --match-set weir-node-4 dst -m comment --comment \
             \"not a node address: a Service address is judged after IPVS\" -j RETURN"
        );
        // Not isolated: the Baseline judges the node as any destination.
        ep.egress.isolated = false;
        ep.egress.rules.clear();
        ep.egress.admin.clear();
        ep.egress.baseline = vec![tier_rule(Peer::Any, Ports::All, Action::Deny, 0)];
        let baseline = endpoint_rules(&ep, Direction::Egress, Family::V4, 0xab, false).unwrap();
        assert!(!baseline.main.contains(&NODE_RETURN.to_string()));
        assert!(to_node_rule(&ep, 0xab, Family::V4).is_some());
        // IPv6: link-local and unspecified sources, and neighbour discovery, pass first.
        let v6 = to_node_chain(vec![jump], Family::V6);
        assert_eq!(v6[0], "-s fe80::/10 -j RETURN");
        assert!(v6.iter().any(|r| r.contains("--icmpv6-type 135")));
    }
}
