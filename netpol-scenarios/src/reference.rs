//! The reference evaluator: NetworkPolicy semantics written naively, straight from the API
//! documentation, over the objects themselves (no sets, no compilation, no weir code), and
//! the same objects rendered as Kubernetes JSON (which is also YAML). Weir's engine and both
//! dataplanes are checked against it: the property test (policy/tests/proptest_model.rs)
//! on random worlds, and the generated cases ([`crate::generated`]) on the lab's world.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{json, Value};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    pub const ALL: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];

    /// As the API spells it.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }

    pub fn parse(name: &str) -> Option<Protocol> {
        Protocol::ALL.into_iter().find(|p| p.name() == name)
    }
}

pub type Labels = BTreeMap<String, String>;

#[derive(Clone, Debug)]
pub struct Ns {
    pub name: String,
    pub labels: Labels,
}

#[derive(Clone, Debug)]
pub struct Pod {
    pub ns: String,
    pub name: String,
    pub labels: Labels,
    pub v4: Option<IpAddr>,
    pub v6: Option<IpAddr>,
    pub host: bool,
    /// (name, number, protocol)
    pub ports: Vec<(String, u16, Protocol)>,
}

#[derive(Clone, Debug)]
pub struct Sel {
    pub labels: Labels,
    /// (key, operator, values)
    pub exprs: Vec<(String, &'static str, Vec<String>)>,
}

#[derive(Clone, Debug)]
pub enum Peer {
    Pods { ns: Option<Sel>, pod: Option<Sel> },
    Block { cidr: IpNet, except: Vec<IpNet> },
}

#[derive(Clone, Debug)]
pub enum PortValue {
    Number(u16),
    Name(String),
}

#[derive(Clone, Debug)]
pub struct Port {
    pub protocol: Option<Protocol>,
    pub port: Option<PortValue>,
    pub end: Option<u16>,
}

#[derive(Clone, Debug)]
pub struct Rule {
    pub peers: Vec<Peer>,
    pub ports: Vec<Port>,
}

#[derive(Clone, Debug)]
pub struct Policy {
    pub ns: String,
    pub name: String,
    pub selector: Sel,
    pub types: Option<Vec<&'static str>>,
    pub ingress: Vec<Rule>,
    pub egress: Vec<Rule>,
}

#[derive(Clone, Debug)]
pub struct World {
    pub namespaces: Vec<Ns>,
    pub pods: Vec<Pod>,
    pub policies: Vec<Policy>,
}

/// A namespace's labels as selectors see them: its own and its name label.
fn ns_labels(w: &World, ns: &str) -> Labels {
    let mut labels = w
        .namespaces
        .iter()
        .find(|n| n.name == ns)
        .map(|n| n.labels.clone())
        .unwrap_or_default();
    labels.insert("kubernetes.io/metadata.name".into(), ns.into());
    labels
}

fn sel_matches(sel: &Sel, labels: &Labels) -> bool {
    sel.labels.iter().all(|(k, v)| labels.get(k) == Some(v))
        && sel.exprs.iter().all(|(k, op, values)| {
            let v = labels.get(k);
            match *op {
                "In" => v.is_some_and(|v| values.contains(v)),
                "NotIn" => v.is_none_or(|v| !values.contains(v)),
                "Exists" => v.is_some(),
                _ => v.is_none(),
            }
        })
}

fn applies(p: &Policy, ingress: bool) -> bool {
    match &p.types {
        Some(t) => t.contains(&if ingress { "Ingress" } else { "Egress" }),
        None => ingress || !p.egress.is_empty(),
    }
}

/// Whether `peer` (from the policy in `policy_ns`) covers the other side, which is
/// `addr` and, if a pod owns it, `pod`.
fn peer_matches(w: &World, policy_ns: &str, peer: &Peer, addr: IpAddr, pod: Option<&Pod>) -> bool {
    match peer {
        Peer::Block { cidr, except } => {
            cidr.contains(&addr) && !except.iter().any(|e| e.contains(&addr))
        }
        Peer::Pods { ns, pod: pod_sel } => {
            let Some(pod) = pod.filter(|p| !p.host) else {
                return false;
            };
            let ns_ok = match ns {
                None => pod.ns == policy_ns,
                Some(sel) => sel_matches(sel, &ns_labels(w, &pod.ns)),
            };
            ns_ok && pod_sel.as_ref().is_none_or(|s| sel_matches(s, &pod.labels))
        }
    }
}

/// Host-network pods are never selected, so their ports never resolve a name (their
/// address is the node's: a named port there would open the node).
fn named(pod: Option<&Pod>, name: &str, protocol: Protocol) -> Option<u16> {
    pod.filter(|p| !p.host)?
        .ports
        .iter()
        .find(|(n, _, p)| n == name && *p == protocol)
        .map(|(_, number, _)| *number)
}

/// `server` is the pod that serves the port (the destination), for named ports.
fn port_matches(ports: &[Port], port: u16, protocol: Protocol, server: Option<&Pod>) -> bool {
    ports.is_empty()
        || ports.iter().any(|p| {
            p.protocol.unwrap_or(Protocol::Tcp) == protocol
                && match &p.port {
                    None => true,
                    Some(PortValue::Number(n)) => *n <= port && port <= p.end.unwrap_or(*n),
                    Some(PortValue::Name(name)) => named(server, name, protocol) == Some(port),
                }
        })
}

/// Whether `local`'s policies for the direction admit the connection with the peer.
fn side_allows(
    w: &World,
    local: &Pod,
    ingress: bool,
    peer_addr: IpAddr,
    peer: Option<&Pod>,
    port: u16,
    protocol: Protocol,
) -> bool {
    if local.host {
        return true;
    }
    let policies: Vec<&Policy> = w
        .policies
        .iter()
        .filter(|p| {
            p.ns == local.ns && sel_matches(&p.selector, &local.labels) && applies(p, ingress)
        })
        .collect();
    if policies.is_empty() {
        return true;
    }
    let server = if ingress { Some(local) } else { peer };
    policies.iter().any(|p| {
        let rules = if ingress { &p.ingress } else { &p.egress };
        rules.iter().any(|r| {
            (r.peers.is_empty()
                || r.peers
                    .iter()
                    .any(|peer_t| peer_matches(w, &p.ns, peer_t, peer_addr, peer)))
                && port_matches(&r.ports, port, protocol, server)
        })
    })
}

/// Whether a connection from `from` (at `from_addr`) to `to`'s `to_addr`, `port`/`protocol`
/// is allowed: egress on the client's side and ingress on the server's. Self traffic always is.
pub fn allowed(
    w: &World,
    from: &Pod,
    from_addr: IpAddr,
    to: &Pod,
    to_addr: IpAddr,
    port: u16,
    protocol: Protocol,
) -> bool {
    from_addr == to_addr
        || (side_allows(w, from, false, to_addr, Some(to), port, protocol)
            && side_allows(w, to, true, from_addr, Some(from), port, protocol))
}

fn sel_json(sel: &Sel) -> Value {
    let exprs: Vec<Value> = sel
        .exprs
        .iter()
        .map(|(k, op, values)| {
            if values.is_empty() {
                json!({"key": k, "operator": op})
            } else {
                json!({"key": k, "operator": op, "values": values})
            }
        })
        .collect();
    json!({"matchLabels": sel.labels, "matchExpressions": exprs})
}

fn rule_json(r: &Rule, peers_key: &str) -> Value {
    let peers: Vec<Value> = r
        .peers
        .iter()
        .map(|p| match p {
            Peer::Block { cidr, except } => {
                let except: Vec<String> = except.iter().map(|e| e.to_string()).collect();
                json!({"ipBlock": {"cidr": cidr.to_string(), "except": except}})
            }
            Peer::Pods { ns, pod } => {
                let mut v = json!({});
                if let Some(ns) = ns {
                    v["namespaceSelector"] = sel_json(ns);
                }
                if let Some(pod) = pod {
                    v["podSelector"] = sel_json(pod);
                }
                v
            }
        })
        .collect();
    let ports: Vec<Value> = r
        .ports
        .iter()
        .map(|p| {
            let mut v = json!({});
            if let Some(proto) = p.protocol {
                v["protocol"] = json!(proto.name());
            }
            match &p.port {
                Some(PortValue::Number(n)) => v["port"] = json!(n),
                Some(PortValue::Name(s)) => v["port"] = json!(s),
                None => {}
            }
            if let Some(e) = p.end {
                v["endPort"] = json!(e);
            }
            v
        })
        .collect();
    json!({peers_key: peers, "ports": ports})
}

/// The world as Kubernetes objects: namespaces, pods (with `status.podIPs`), policies.
pub fn manifests(w: &World) -> Vec<Value> {
    let mut out = Vec::new();
    for ns in &w.namespaces {
        let v = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns.name, "labels": ns.labels}});
        out.push(v);
    }
    for p in &w.pods {
        let ips: Vec<Value> =
            p.v4.iter()
                .chain(&p.v6)
                .map(|ip| json!({"ip": ip.to_string()}))
                .collect();
        let ports: Vec<Value> = p.ports.iter().map(|(n, num, proto)| json!({"name": n, "containerPort": num, "protocol": proto.name()})).collect();
        let v = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": p.name, "namespace": p.ns, "labels": p.labels},
            "spec": {"hostNetwork": p.host, "containers": [{"name": "c", "ports": ports}]},
            "status": {"podIPs": ips},
        });
        out.push(v);
    }
    for p in &w.policies {
        let mut spec = json!({
            "podSelector": sel_json(&p.selector),
            "ingress": p.ingress.iter().map(|r| rule_json(r, "from")).collect::<Vec<_>>(),
            "egress": p.egress.iter().map(|r| rule_json(r, "to")).collect::<Vec<_>>(),
        });
        if let Some(types) = &p.types {
            spec["policyTypes"] = json!(types);
        }
        let v = json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": p.name, "namespace": p.ns}, "spec": spec});
        out.push(v);
    }
    out
}
