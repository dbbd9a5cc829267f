//! Why a connection is allowed or denied: the verdict of both sides (the source's egress,
//! the destination's ingress) with every policy that isolates the pod and every rule
//! that admits the connection. Evaluated on the compiled model, as the dataplanes are.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use serde::Serialize;

use super::engine::Engine;
use super::sets::SetDef;
use super::verdict::{admits, verdict_between, DirectionVerdict, TierDecision};
use crate::desired::{Action, Direction, Peer, Ports, Protocol, Rule, Tier};
use crate::model::PodInfo;

/// The destination: a pod (`namespace/name`) or an address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Pod(String),
    Address(IpAddr),
}

impl FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Ok(addr) = s.parse() {
            return Ok(Target::Address(addr));
        }
        match s.split_once('/') {
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok(Target::Pod(s.to_owned()))
            }
            _ => Err(format!("{s:?} is neither NAMESPACE/POD nor an IP address")),
        }
    }
}

/// `PORT[/PROTOCOL]`, protocol TCP by default, case-insensitive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortProtocol {
    pub port: u16,
    pub protocol: Protocol,
}

impl FromStr for PortProtocol {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (port, protocol) = s.split_once('/').unwrap_or((s, "TCP"));
        let port = port
            .parse()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| format!("{port:?} is not a port number (1-65535)"))?;
        let protocol = match protocol.to_ascii_uppercase().as_str() {
            "TCP" => Protocol::Tcp,
            "UDP" => Protocol::Udp,
            "SCTP" => Protocol::Sctp,
            other => return Err(format!("unsupported protocol {other:?}: TCP, UDP or SCTP")),
        };
        Ok(PortProtocol { port, protocol })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExplainError {
    #[error("pod {0} is not in the manifests")]
    UnknownPod(String),
    #[error("pod {0} has no address")]
    NoAddress(String),
    #[error("{from} and {to} have no address family in common")]
    NoCommonFamily { from: String, to: String },
}

/// A rule that admits the connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RuleExplanation {
    /// `namespace/name` of the policy.
    pub policy: String,
    /// `ingress[i]` or `egress[i]`.
    pub rule: String,
    /// What the peer selects (`any` for a rule without from/to).
    pub peer: String,
    /// `all`, `TCP`, `TCP/80` or `TCP/80-90`.
    pub ports: String,
}

/// One side of the connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SideExplanation {
    pub direction: Direction,
    /// The pod whose policy this is; `None` when the side is not a pod.
    pub pod: Option<String>,
    /// Whether weir enforces anything for this side (a pod with an address, not on the
    /// host network).
    pub enforced: bool,
    pub isolated: bool,
    pub allowed: bool,
    /// Enforced policies that select the pod for this direction.
    pub isolated_by: Vec<String>,
    pub allowed_by: Vec<RuleExplanation>,
    /// Audit-mode policies (`policy.weir.io/mode: audit`) that select the pod for this
    /// direction. They count only where no enforced policy does.
    pub audit_by: Vec<String>,
    /// Those audit policies would drop this connection; it passes, counted as an audit
    /// verdict.
    pub audit_would_deny: bool,
    /// The ClusterNetworkPolicy rule that decided (Accept or Deny), if a tier did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<TierExplanation>,
    /// Pass rules that handed the decision down a tier, in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub passed_by: Vec<TierExplanation>,
}

/// A ClusterNetworkPolicy rule that matched: the first of its tier.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TierExplanation {
    pub tier: Tier,
    /// The ClusterNetworkPolicy's name.
    pub policy: String,
    pub priority: u16,
    /// `ingress[i]` or `egress[i]`.
    pub rule: String,
    /// The rule's `name`, if it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub action: Action,
    pub peer: String,
    pub ports: String,
}

impl fmt::Display for TierExplanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} tier: clusternetworkpolicy {} (priority {}) {}",
            self.tier, self.policy, self.priority, self.rule
        )?;
        if let Some(name) = &self.name {
            write!(f, " {name:?}")?;
        }
        write!(f, ": {} peer {} on {}", self.action, self.peer, self.ports)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Explanation {
    pub from: String,
    pub from_address: IpAddr,
    pub to: String,
    pub to_address: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    pub allowed: bool,
    /// A pod talking to itself is always allowed.
    pub to_self: bool,
    pub egress: SideExplanation,
    pub ingress: SideExplanation,
}

/// Explains `from` (a pod, `namespace/name`) connecting to `to` on `port`.
pub fn explain(
    engine: &Engine,
    from: &str,
    to: &Target,
    port: PortProtocol,
) -> Result<Explanation, ExplainError> {
    let model = engine.model();
    let pod = |key: &str| {
        model
            .pod(key)
            .ok_or_else(|| ExplainError::UnknownPod(key.to_owned()))
    };
    let source = pod(from)?;
    let (from_address, to_address, to_pod) = match to {
        Target::Address(addr) => {
            let from_address = source
                .addresses()
                .find(|a| a.is_ipv4() == addr.is_ipv4())
                .ok_or_else(|| ExplainError::NoCommonFamily {
                    from: from.to_owned(),
                    to: addr.to_string(),
                })?;
            let to_pod = model.pods_with_address(*addr).find(|p| p.selectable());
            (from_address, *addr, to_pod)
        }
        Target::Pod(key) => {
            let destination = pod(key)?;
            if source.addresses().next().is_none() {
                return Err(ExplainError::NoAddress(from.to_owned()));
            }
            if destination.addresses().next().is_none() {
                return Err(ExplainError::NoAddress(key.clone()));
            }
            let pair = source
                .addresses()
                .find_map(|f| {
                    destination
                        .addresses()
                        .find(|t| t.is_ipv4() == f.is_ipv4())
                        .map(|t| (f, t))
                })
                .ok_or_else(|| ExplainError::NoCommonFamily {
                    from: from.to_owned(),
                    to: key.clone(),
                })?;
            (pair.0, pair.1, Some(destination))
        }
    };
    let v = verdict_between(
        engine.desired(),
        from_address,
        to_address,
        port.port,
        port.protocol,
    );
    let side = |direction, pod: Option<&PodInfo>, peer: IpAddr, verdict: &DirectionVerdict| {
        side_explanation(engine, direction, pod, peer, port, verdict)
    };
    Ok(Explanation {
        from: from.to_owned(),
        from_address,
        to: match to {
            Target::Pod(key) => key.clone(),
            Target::Address(addr) => to_pod.map(PodInfo::key).unwrap_or_else(|| addr.to_string()),
        },
        to_address,
        port: port.port,
        protocol: port.protocol,
        allowed: v.allowed,
        to_self: v.to_self,
        egress: side(Direction::Egress, Some(source), to_address, &v.egress),
        ingress: side(Direction::Ingress, to_pod, from_address, &v.ingress),
    })
}

fn side_explanation(
    engine: &Engine,
    direction: Direction,
    pod: Option<&PodInfo>,
    peer: IpAddr,
    port: PortProtocol,
    verdict: &DirectionVerdict,
) -> SideExplanation {
    let endpoint = pod.and_then(|p| engine.desired().endpoints.get(&p.key()));
    let selecting = |audit: bool| -> Vec<String> {
        match (pod, endpoint) {
            (Some(pod), Some(_)) => engine
                .policies_selecting(pod)
                .into_iter()
                .filter(|p| p.rules(direction).is_some() && p.audit == audit)
                .map(|p| p.key())
                .collect(),
            _ => Vec::new(),
        }
    };
    let (isolated_by, audit_by) = (selecting(false), selecting(true));
    let admitting: Vec<&Rule> = endpoint
        .into_iter()
        .flat_map(|e| &e.direction(direction).rules)
        .filter(|r| {
            admits(
                engine.desired(),
                r.peer,
                r.ports,
                peer,
                port.port,
                port.protocol,
            )
        })
        .collect();
    // Only the audit rule admits it: the audit policies alone would drop it.
    let audit_would_deny = !admitting.is_empty() && admitting.iter().all(|r| r.origin.is_audit());
    let allowed_by = admitting
        .into_iter()
        .filter(|r| !r.origin.is_audit())
        .map(|r| rule_explanation(engine, direction, r))
        .collect();
    SideExplanation {
        direction,
        pod: pod.map(PodInfo::key),
        enforced: endpoint.is_some(),
        // Isolated by audit-mode policies alone is not isolated: nothing is dropped.
        isolated: verdict.isolated && !isolated_by.is_empty(),
        allowed: verdict.allowed,
        isolated_by,
        allowed_by,
        audit_by,
        audit_would_deny,
        decided_by: verdict
            .decided_by
            .as_ref()
            .map(|d| tier_explanation(engine, direction, d)),
        passed_by: verdict
            .passed_by
            .iter()
            .map(|d| tier_explanation(engine, direction, d))
            .collect(),
    }
}

fn tier_explanation(
    engine: &Engine,
    direction: Direction,
    decision: &TierDecision,
) -> TierExplanation {
    let rule = &decision.rule;
    TierExplanation {
        tier: decision.tier,
        policy: rule.origin.policy.clone(),
        priority: rule.origin.priority,
        rule: format!("{}[{}]", direction.name(), rule.origin.rule_index),
        name: rule.origin.rule_name.clone(),
        action: rule.action,
        peer: peer_text(engine, rule.peer),
        ports: ports_text(rule.ports),
    }
}

fn peer_text(engine: &Engine, peer: Peer) -> String {
    match peer {
        Peer::Any => "any".to_owned(),
        Peer::Set(id) => engine
            .set_definition(id)
            .map(SetDef::definition)
            .unwrap_or_else(|| id.to_string()),
    }
}

fn ports_text(ports: Ports) -> String {
    match ports {
        Ports::All => "all".to_owned(),
        Ports::Protocol {
            protocol,
            range: None,
        } => protocol.to_string(),
        Ports::Protocol {
            protocol,
            range: Some(r),
        } if r.first == r.last => format!("{protocol}/{}", r.first),
        Ports::Protocol {
            protocol,
            range: Some(r),
        } => format!("{protocol}/{}-{}", r.first, r.last),
    }
}

fn rule_explanation(engine: &Engine, direction: Direction, rule: &Rule) -> RuleExplanation {
    let side = direction.name();
    RuleExplanation {
        policy: rule.origin.policy.clone(),
        rule: format!("{side}[{}]", rule.origin.rule_index),
        peer: peer_text(engine, rule.peer),
        ports: ports_text(rule.ports),
    }
}

impl fmt::Display for SideExplanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.direction {
            Direction::Ingress => "ingress of",
            Direction::Egress => "egress of",
        };
        let who = self.pod.as_deref().unwrap_or("(not a pod)");
        if !self.enforced {
            return write!(f, "{what} {who}: not enforced (not a pod endpoint: host network, no address or unknown)");
        }
        let verdict = if self.allowed { "allowed" } else { "DENIED" };
        if let Some(decided) = &self.decided_by {
            write!(f, "{what} {who}: {verdict}")?;
            self.write_passed(f)?;
            return write!(f, "\n    decided by: {decided}");
        }
        self.write_rest(f, what, who)?;
        self.write_passed(f)
    }
}

impl SideExplanation {
    fn write_passed(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for p in &self.passed_by {
            write!(f, "\n    passed on by: {p}")?;
        }
        Ok(())
    }

    /// The NetworkPolicy part, where no tier decided.
    fn write_rest(&self, f: &mut fmt::Formatter<'_>, what: &str, who: &str) -> fmt::Result {
        if !self.isolated {
            write!(f, "{what} {who}: allowed, not isolated")?;
            if !self.audit_by.is_empty() {
                let would = if self.audit_would_deny {
                    "would DENY it (counted as an audit verdict)"
                } else {
                    "would allow it"
                };
                write!(f, "\n    audit mode: {} {would}", self.audit_by.join(", "))?;
                for r in &self.allowed_by {
                    write!(
                        f,
                        "\n    audit allowed by: {} {}: peer {} on {}",
                        r.policy, r.rule, r.peer, r.ports
                    )?;
                }
            }
            return Ok(());
        }
        let verdict = if self.allowed { "allowed" } else { "DENIED" };
        write!(
            f,
            "{what} {who}: {verdict}\n    isolated by: {}",
            self.isolated_by.join(", ")
        )?;
        if self.allowed_by.is_empty() {
            write!(f, "\n    no rule allows it")?;
        }
        for r in &self.allowed_by {
            write!(
                f,
                "\n    allowed by: {} {}: peer {} on {}",
                r.policy, r.rule, r.peer, r.ports
            )?;
        }
        if !self.audit_by.is_empty() {
            write!(
                f,
                "\n    audit mode, not counted here (an enforced policy isolates the pod): {}",
                self.audit_by.join(", ")
            )?;
        }
        Ok(())
    }
}

impl fmt::Display for Explanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = if self.allowed { "ALLOWED" } else { "DENIED" };
        writeln!(
            f,
            "{} ({}) -> {} ({}) port {}/{}: {verdict}",
            self.from, self.from_address, self.to, self.to_address, self.port, self.protocol
        )?;
        if self.to_self {
            return writeln!(
                f,
                "  a pod's traffic to itself is always allowed, whatever its policies"
            );
        }
        writeln!(f, "  {}", self.egress)?;
        writeln!(f, "  {}", self.ingress)
    }
}
