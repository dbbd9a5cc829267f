//! Validation of a ClusterNetworkPolicy as its CRD's schema and CEL rules do (v0.2.0,
//! standard channel, plus the experimental `nodes` peer), producing the
//! [`ClusterPolicySpec`] the compiler uses. Every error names the policy and the field.
//!
//! Beyond the schema:
//! - `domainNames` peers are refused: weir does not resolve names.
//! - A peer or protocol with no field weir knows is kept and fails closed
//!   ([`TierRuleSpec::unknown`]), as the API asks of an implementation that sees one.
//! - A `destinationNamedPort` resolves on the destination pods, also beside a `networks`
//!   peer (the pods inside the blocks), which only the experimental CRD refuses; beside
//!   a `nodes` peer it matches nothing, since a Node has no named ports.

use std::collections::BTreeSet;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::spec::{Action, ClusterPolicySpec, Subject, Tier, TierRuleSpec};
use crate::crd::{self as api, ClusterNetworkPolicy};
use crate::desired::{PortRange, Protocol};
use crate::error::PolicyError;
use crate::model::{FieldError, Kind, ObjectRef};
use crate::names::parse_cidr;
use crate::selector::Selector;
use crate::spec::{NamespaceScope, PeerSpec, PortMatch, PortSpec};

/// Egress peers, which the API server prunes from an ingress peer (leaving it empty).
const EGRESS_ONLY_PEERS: [&str; 3] = ["networks", "nodes", "domainNames"];

/// Rules per direction, peers per rule, networks per peer and protocols per rule.
const MAX_ITEMS: usize = 25;
const MAX_PRIORITY: i64 = 1000;
const MAX_RULE_NAME: usize = 100;
const MAX_CIDR_LENGTH: usize = 43;

/// Validates `policy` and returns its compiled form.
pub fn parse_cluster_policy(
    policy: &ClusterNetworkPolicy,
) -> Result<ClusterPolicySpec, PolicyError> {
    let name = policy.metadata.name.clone().unwrap_or_default();
    let object = ObjectRef::new(Kind::ClusterNetworkPolicy, None, &name);
    parse(&name, policy).map_err(|e| PolicyError::invalid(&object, e))
}

fn parse(name: &str, policy: &ClusterNetworkPolicy) -> Result<ClusterPolicySpec, FieldError> {
    if name.is_empty() {
        return Err(FieldError::new("metadata.name", "required"));
    }
    let spec = policy
        .spec
        .as_ref()
        .ok_or_else(|| FieldError::new("spec", "required"))?;
    let tier = match spec.tier.as_deref() {
        None => return Err(FieldError::new("spec.tier", "required")),
        Some("Admin") => Tier::Admin,
        Some("Baseline") => Tier::Baseline,
        Some(other) => return Err(unsupported("spec.tier", other, &["Admin", "Baseline"])),
    };
    let priority = match spec.priority {
        None => return Err(FieldError::new("spec.priority", "required")),
        Some(p @ 0..=MAX_PRIORITY) => p as u16,
        Some(p) => {
            return Err(FieldError::new(
                "spec.priority",
                format!("must be between 0 and {MAX_PRIORITY}, inclusive (got {p})"),
            ))
        }
    };
    let subject = parse_subject(spec.subject.as_ref())?;
    let ingress = parse_rules(
        "spec.ingress",
        "from",
        spec.ingress.as_deref(),
        |r| {
            (
                r.name.as_deref(),
                r.action.as_deref(),
                r.from.as_deref(),
                r.protocols.as_deref(),
            )
        },
        parse_ingress_peer,
    )?;
    let egress = parse_rules(
        "spec.egress",
        "to",
        spec.egress.as_deref(),
        |r| {
            (
                r.name.as_deref(),
                r.action.as_deref(),
                r.to.as_deref(),
                r.protocols.as_deref(),
            )
        },
        parse_peer,
    )?;
    Ok(ClusterPolicySpec {
        name: name.to_owned(),
        tier,
        priority,
        subject,
        ingress,
        egress,
    })
}

fn unsupported(field: &str, value: &str, supported: &[&str]) -> FieldError {
    let supported: Vec<String> = supported.iter().map(|s| format!("{s:?}")).collect();
    FieldError::new(
        field,
        format!(
            "unsupported value {value:?}: supported values {}",
            supported.join(", ")
        ),
    )
}

fn at_most<'a, T>(items: Option<&'a [T]>, field: &str) -> Result<&'a [T], FieldError> {
    let items = items.unwrap_or_default();
    if items.len() > MAX_ITEMS {
        return Err(FieldError::new(
            field,
            format!("must have at most {MAX_ITEMS} items (has {})", items.len()),
        ));
    }
    Ok(items)
}

/// A list the schema requires, with 1 to 25 items.
fn required_items<'a, T>(items: Option<&'a [T]>, field: &str) -> Result<&'a [T], FieldError> {
    match items {
        None => Err(FieldError::new(field, "required")),
        Some([]) => Err(FieldError::new(field, "must have at least 1 item")),
        Some(items) => at_most(Some(items), field),
    }
}

fn selector(s: &LabelSelector, field: &str) -> Result<Selector, FieldError> {
    Selector::parse(s, field)
}

/// Complains unless exactly one of `set` (field names with whether each is set) is, or
/// none is and `unknown` holds fields weir does not know (a newer API's: the caller fails
/// closed). A one-of with no field at all is refused, as the API server refuses it.
fn exactly_one(
    field: &str,
    set: &[(&str, bool)],
    unknown: &api::UnknownFields,
) -> Result<(), FieldError> {
    let count = set.iter().filter(|(_, s)| *s).count();
    if count > 1 || (count == 0 && unknown.is_empty()) {
        let names: Vec<&str> = set.iter().map(|(n, _)| *n).collect();
        return Err(FieldError::new(
            field,
            format!("must set exactly one of {} (has {count})", names.join(", ")),
        ));
    }
    Ok(())
}

fn parse_subject(subject: Option<&api::Subject>) -> Result<Subject, FieldError> {
    let field = "spec.subject";
    let subject = subject.ok_or_else(|| FieldError::new(field, "required"))?;
    exactly_one(
        field,
        &[
            ("namespaces", subject.namespaces.is_some()),
            ("pods", subject.pods.is_some()),
        ],
        &api::UnknownFields::new(),
    )?;
    match (&subject.namespaces, &subject.pods) {
        (Some(ns), _) => Ok(Subject::Namespaces(selector(
            ns,
            "spec.subject.namespaces",
        )?)),
        (None, Some(pods)) => {
            let (namespaces, pods) = parse_namespaced_pod(pods, "spec.subject.pods")?;
            Ok(Subject::Pods { namespaces, pods })
        }
        (None, None) => Err(FieldError::new(
            field,
            "must set exactly one of namespaces, pods",
        )),
    }
}

fn parse_namespaced_pod(
    pods: &api::NamespacedPod,
    field: &str,
) -> Result<(Selector, Selector), FieldError> {
    let namespaces = match &pods.namespace_selector {
        Some(s) => selector(s, &format!("{field}.namespaceSelector"))?,
        None => Selector::default(),
    };
    let pod_field = format!("{field}.podSelector");
    let pods = pods
        .pod_selector
        .as_ref()
        .ok_or_else(|| FieldError::new(&pod_field, "required"))?;
    Ok((namespaces, selector(pods, &pod_field)?))
}

/// A rule's name, action, peers and protocols, as written.
type RuleParts<'a, P> = (
    Option<&'a str>,
    Option<&'a str>,
    Option<&'a [P]>,
    Option<&'a [api::ProtocolEntry]>,
);

/// The rules of one direction (`field`, whose peers are under `peers_key`).
fn parse_rules<'a, R, P: 'a>(
    field: &str,
    peers_key: &str,
    rules: Option<&'a [R]>,
    parts: impl Fn(&'a R) -> RuleParts<'a, P>,
    peer: impl Fn(&str, &P) -> Result<Peers, FieldError>,
) -> Result<Vec<TierRuleSpec>, FieldError> {
    at_most(rules, field)?
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let (name, action, peers, protocols) = parts(r);
            let field = format!("{field}[{i}]");
            let peers_field = format!("{field}.{peers_key}");
            let peers = required_items(peers, &peers_field)?
                .iter()
                .enumerate()
                .map(|(j, p)| peer(&format!("{peers_field}[{j}]"), p));
            parse_rule(&field, &peers_field, name, action, peers, protocols)
        })
        .collect()
}

/// An ingress peer: an egress-only peer there is refused, as the API server's pruning
/// and schema refuse it; the rest is parsed as an egress peer with those fields unset.
fn parse_ingress_peer(field: &str, p: &api::IngressPeer) -> Result<Peers, FieldError> {
    if let Some(egress_only) = EGRESS_ONLY_PEERS
        .iter()
        .find(|name| p.unknown.contains_key(**name))
    {
        return Err(FieldError::new(
            &format!("{field}.{egress_only}"),
            "not allowed in an ingress peer: only namespaces and pods select sources",
        ));
    }
    let egress = api::EgressPeer {
        namespaces: p.namespaces.clone(),
        pods: p.pods.clone(),
        unknown: p.unknown.clone(),
        ..Default::default()
    };
    parse_peer(field, &egress)
}

/// A parsed peer: its address sets, or `None` for a peer with no field weir knows.
type Peers = Option<Vec<PeerSpec>>;

fn parse_peer(field: &str, peer: &api::EgressPeer) -> Result<Peers, FieldError> {
    exactly_one(
        field,
        &[
            ("namespaces", peer.namespaces.is_some()),
            ("pods", peer.pods.is_some()),
            ("nodes", peer.nodes.is_some()),
            ("networks", peer.networks.is_some()),
            ("domainNames", peer.domain_names.is_some()),
        ],
        &peer.unknown,
    )?;
    if peer.domain_names.is_some() {
        return Err(FieldError::new(
            &format!("{field}.domainNames"),
            "not supported: weir does not resolve domain names (an experimental field of \
             the API); use networks",
        ));
    }
    if let Some(ns) = &peer.namespaces {
        return Ok(Some(vec![PeerSpec::Pods {
            namespaces: NamespaceScope::Selected(selector(ns, &format!("{field}.namespaces"))?),
            pods: Selector::default(),
        }]));
    }
    if let Some(pods) = &peer.pods {
        let (namespaces, pods) = parse_namespaced_pod(pods, &format!("{field}.pods"))?;
        return Ok(Some(vec![PeerSpec::Pods {
            namespaces: NamespaceScope::Selected(namespaces),
            pods,
        }]));
    }
    if let Some(nodes) = &peer.nodes {
        return Ok(Some(vec![PeerSpec::Nodes(selector(
            nodes,
            &format!("{field}.nodes"),
        )?)]));
    }
    if let Some(networks) = &peer.networks {
        let networks = required_items(Some(networks), &format!("{field}.networks"))?;
        let mut blocks = Vec::new();
        let mut seen = BTreeSet::new();
        for (k, text) in networks.iter().enumerate() {
            let f = format!("{field}.networks[{k}]");
            if text.len() > MAX_CIDR_LENGTH {
                return Err(FieldError::new(
                    &f,
                    format!("may not be longer than {MAX_CIDR_LENGTH} characters"),
                ));
            }
            let cidr = parse_cidr(text).map_err(|e| FieldError::new(&f, e.to_string()))?;
            if !seen.insert(text.as_str()) {
                return Err(FieldError::new(&f, format!("duplicate value {text:?}")));
            }
            blocks.push(PeerSpec::Block {
                cidr,
                except: BTreeSet::new(),
            });
        }
        return Ok(Some(blocks));
    }
    Ok(None)
}

/// One rule (`field`), its peers under `peers_field`.
fn parse_rule(
    field: &str,
    peers_field: &str,
    name: Option<&str>,
    action: Option<&str>,
    peers: impl Iterator<Item = Result<Peers, FieldError>>,
    protocols: Option<&[api::ProtocolEntry]>,
) -> Result<TierRuleSpec, FieldError> {
    if let Some(name) = name.filter(|n| n.chars().count() > MAX_RULE_NAME) {
        return Err(FieldError::new(
            &format!("{field}.name"),
            format!(
                "may not be longer than {MAX_RULE_NAME} characters (has {})",
                name.chars().count()
            ),
        ));
    }
    let action_field = format!("{field}.action");
    let action = match action {
        None => return Err(FieldError::new(&action_field, "required")),
        Some("Accept") => Action::Accept,
        Some("Deny") => Action::Deny,
        Some("Pass") => Action::Pass,
        Some(other) => {
            return Err(unsupported(
                &action_field,
                other,
                &["Accept", "Deny", "Pass"],
            ))
        }
    };
    let mut unknown = None;
    let mut specs = Vec::new();
    for (j, peer) in peers.enumerate() {
        match peer? {
            Some(p) => specs.extend(p),
            None => {
                unknown.get_or_insert_with(|| format!("{peers_field}[{j}]"));
            }
        }
    }
    let mut ports = Vec::new();
    if let Some(protocols) = protocols {
        let protocols = required_items(Some(protocols), &format!("{field}.protocols"))?;
        for (k, entry) in protocols.iter().enumerate() {
            let f = format!("{field}.protocols[{k}]");
            match parse_protocol(&f, entry)? {
                Some(p) => ports.extend(p),
                None => {
                    unknown.get_or_insert(f);
                }
            }
        }
    }
    Ok(TierRuleSpec {
        name: name.map(str::to_owned),
        action,
        peers: specs,
        ports,
        unknown,
    })
}

/// The ports of one `protocols` entry; `None` for an entry with no field weir knows.
fn parse_protocol(
    field: &str,
    entry: &api::ProtocolEntry,
) -> Result<Option<Vec<PortSpec>>, FieldError> {
    let named = entry
        .destination_named_port
        .as_deref()
        .filter(|n| !n.is_empty());
    exactly_one(
        field,
        &[
            ("tcp", entry.tcp.is_some()),
            ("udp", entry.udp.is_some()),
            ("sctp", entry.sctp.is_some()),
            ("destinationNamedPort", named.is_some()),
        ],
        &entry.unknown,
    )?;
    if let Some(name) = named {
        // The name carries no protocol: it resolves to whichever the pod's containerPort
        // of that name has.
        return Ok(Some(
            [Protocol::Tcp, Protocol::Udp, Protocol::Sctp]
                .into_iter()
                .map(|protocol| PortSpec {
                    protocol,
                    port: PortMatch::Named(name.to_owned()),
                })
                .collect(),
        ));
    }
    let (protocol, port, key) = match (&entry.tcp, &entry.udp, &entry.sctp) {
        (Some(p), _, _) => (Protocol::Tcp, p, "tcp"),
        (_, Some(p), _) => (Protocol::Udp, p, "udp"),
        (_, _, Some(p)) => (Protocol::Sctp, p, "sctp"),
        _ => return Ok(None),
    };
    let field = format!("{field}.{key}");
    let port = port.destination_port.as_ref().ok_or_else(|| {
        FieldError::new(&field, "must have at least 1 property (destinationPort)")
    })?;
    let field = format!("{field}.destinationPort");
    exactly_one(
        &field,
        &[
            ("number", port.number.is_some()),
            ("range", port.range.is_some()),
        ],
        &api::UnknownFields::new(),
    )?;
    let number = |n: Option<i64>, f: &str| match n {
        None => Err(FieldError::new(f, "required")),
        Some(n) => u16::try_from(n).ok().filter(|n| *n != 0).ok_or_else(|| {
            FieldError::new(
                f,
                format!("must be between 1 and 65535, inclusive (got {n})"),
            )
        }),
    };
    let range = match (port.number, &port.range) {
        (Some(n), _) => {
            let n = number(Some(n), &format!("{field}.number"))?;
            PortRange { first: n, last: n }
        }
        (None, Some(r)) => {
            let first = number(r.start, &format!("{field}.range.start"))?;
            let last = number(r.end, &format!("{field}.range.end"))?;
            if first >= last {
                return Err(FieldError::new(
                    &format!("{field}.range"),
                    format!("Start port must be less than End port (start {first}, end {last})"),
                ));
            }
            PortRange { first, last }
        }
        (None, None) => {
            return Err(FieldError::new(
                &field,
                "must have at least 1 property (number or range)",
            ))
        }
    };
    Ok(Some(vec![PortSpec {
        protocol,
        port: PortMatch::Range(range),
    }]))
}
