//! Property tests: on random worlds and random policies, the compiled model (evaluated
//! with weir's verdict) agrees with a deliberately naive evaluator written here straight
//! from the NetworkPolicy API documentation, over the objects themselves; and building
//! the world event by event gives exact deltas and the same state as a cold compile.

mod support;

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use proptest::prelude::*;
use serde_json::{json, Value};
use support::Harness;
use weir_policy::desired::Protocol;
use weir_policy::model::{Kind, Object, ObjectRef};
use weir_policy::verdict;

type Labels = BTreeMap<String, String>;

#[derive(Clone, Debug)]
struct Ns {
    name: String,
    labels: Labels,
}

#[derive(Clone, Debug)]
struct Pod {
    ns: String,
    name: String,
    labels: Labels,
    v4: Option<IpAddr>,
    v6: Option<IpAddr>,
    host: bool,
    /// (name, number, protocol)
    ports: Vec<(String, u16, Protocol)>,
}

#[derive(Clone, Debug)]
struct Sel {
    labels: Labels,
    /// (key, operator, values)
    exprs: Vec<(String, &'static str, Vec<String>)>,
}

#[derive(Clone, Debug)]
enum PeerT {
    Pods { ns: Option<Sel>, pod: Option<Sel> },
    Block { cidr: IpNet, except: Vec<IpNet> },
}

#[derive(Clone, Debug)]
enum PortValue {
    Number(u16),
    Name(String),
}

#[derive(Clone, Debug)]
struct PortT {
    protocol: Option<Protocol>,
    port: Option<PortValue>,
    end: Option<u16>,
}

#[derive(Clone, Debug)]
struct RuleT {
    peers: Vec<PeerT>,
    ports: Vec<PortT>,
}

#[derive(Clone, Debug)]
struct PolicyT {
    ns: String,
    name: String,
    selector: Sel,
    types: Option<Vec<&'static str>>,
    ingress: Vec<RuleT>,
    egress: Vec<RuleT>,
}

#[derive(Clone, Debug)]
struct World {
    namespaces: Vec<Ns>,
    pods: Vec<Pod>,
    policies: Vec<PolicyT>,
}

// ---------- the naive evaluator ----------

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

fn applies(p: &PolicyT, ingress: bool) -> bool {
    match &p.types {
        Some(t) => t.contains(&if ingress { "Ingress" } else { "Egress" }),
        None => ingress || !p.egress.is_empty(),
    }
}

/// Whether `peer` (from the policy in `policy_ns`) covers the other side, which is
/// `addr` and, if a pod owns it, `pod`.
fn peer_matches(w: &World, policy_ns: &str, peer: &PeerT, addr: IpAddr, pod: Option<&Pod>) -> bool {
    match peer {
        PeerT::Block { cidr, except } => {
            cidr.contains(&addr) && !except.iter().any(|e| e.contains(&addr))
        }
        PeerT::Pods { ns, pod: pod_sel } => {
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
fn port_matches(ports: &[PortT], port: u16, protocol: Protocol, server: Option<&Pod>) -> bool {
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
    let policies: Vec<&PolicyT> = w
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

fn naive_allowed(
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

// ---------- rendering to Kubernetes objects ----------

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

fn rule_json(r: &RuleT, peers_key: &str) -> Value {
    let peers: Vec<Value> = r
        .peers
        .iter()
        .map(|p| match p {
            PeerT::Block { cidr, except } => {
                let except: Vec<String> = except.iter().map(|e| e.to_string()).collect();
                json!({"ipBlock": {"cidr": cidr.to_string(), "except": except}})
            }
            PeerT::Pods { ns, pod } => {
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

fn objects(w: &World) -> Vec<Object> {
    let mut out = Vec::new();
    for ns in &w.namespaces {
        let v = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns.name, "labels": ns.labels}});
        out.push(Object::Namespace(serde_json::from_value(v).unwrap()));
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
        out.push(Object::Pod(serde_json::from_value(v).unwrap()));
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
        out.push(Object::NetworkPolicy(serde_json::from_value(v).unwrap()));
    }
    out
}

// ---------- strategies ----------

const NAMESPACES: [&str; 3] = ["n0", "n1", "n2"];
const PORT_NUMBERS: [u16; 4] = [53, 80, 81, 8080];
const PROTOCOLS: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];

fn labels(
    keys: &'static [&'static str],
    values: &'static [&'static str],
) -> impl Strategy<Value = Labels> {
    prop::collection::btree_map(
        prop::sample::select(keys).prop_map(str::to_owned),
        prop::sample::select(values).prop_map(str::to_owned),
        0..=keys.len(),
    )
}

fn selector(
    keys: &'static [&'static str],
    values: &'static [&'static str],
) -> impl Strategy<Value = Sel> {
    let op = prop::sample::select(vec!["In", "NotIn", "Exists", "DoesNotExist"]);
    let expr = (
        prop::sample::select(keys),
        op,
        prop::collection::vec(prop::sample::select(values).prop_map(str::to_owned), 1..3),
    )
        .prop_map(|(k, op, values)| {
            let values = if matches!(op, "In" | "NotIn") {
                values
            } else {
                Vec::new()
            };
            (k.to_owned(), op, values)
        });
    (
        prop::collection::btree_map(
            prop::sample::select(keys).prop_map(str::to_owned),
            prop::sample::select(values).prop_map(str::to_owned),
            0..2,
        ),
        prop::collection::vec(expr, 0..2),
    )
        .prop_map(|(labels, exprs)| Sel { labels, exprs })
}

const POD_KEYS: &[&str] = &["app", "tier"];
const POD_VALUES: &[&str] = &["w", "x", "y"];
const NS_KEYS: &[&str] = &["env", "kubernetes.io/metadata.name"];
const NS_VALUES: &[&str] = &["a", "b", "n0", "n1"];

fn peer() -> impl Strategy<Value = PeerT> {
    let cidrs = vec![
        "10.0.0.0/8",
        "10.0.1.0/24",
        "10.0.1.0/30",
        "0.0.0.0/0",
        "fd00::/64",
        "fd00::1:0/112",
    ];
    let excepts = vec![
        "10.0.1.2/32",
        "10.0.0.0/16",
        "10.0.1.0/25",
        "10.0.2.0/24",
        "fd00::1:1/128",
        "fd00::2:0/112",
    ];
    let block = (
        prop::sample::select(cidrs),
        prop::collection::vec(prop::sample::select(excepts), 0..3),
    )
        .prop_map(|(cidr, except)| {
            let cidr: IpNet = cidr.parse().unwrap();
            let except = except
                .into_iter()
                .map(|e| e.parse::<IpNet>().unwrap())
                .filter(|e| cidr.contains(e) && e.prefix_len() > cidr.prefix_len())
                .collect();
            PeerT::Block { cidr, except }
        });
    let pods = (
        prop::option::of(selector(NS_KEYS, NS_VALUES)),
        prop::option::of(selector(POD_KEYS, POD_VALUES)),
    )
        .prop_map(|(ns, pod)| {
            let pod = if ns.is_none() && pod.is_none() {
                Some(Sel {
                    labels: Labels::new(),
                    exprs: Vec::new(),
                })
            } else {
                pod
            };
            PeerT::Pods { ns, pod }
        });
    prop_oneof![1 => block, 3 => pods]
}

fn port() -> impl Strategy<Value = PortT> {
    let value = prop_oneof![
        1 => Just(None),
        2 => prop::sample::select(PORT_NUMBERS.to_vec()).prop_map(|n| Some(PortValue::Number(n))),
        2 => prop::sample::select(vec!["http", "dns", "none"]).prop_map(|s| Some(PortValue::Name(s.to_owned()))),
    ];
    (
        prop::option::of(prop::sample::select(PROTOCOLS.to_vec())),
        value,
        prop::option::of(0u16..2000),
    )
        .prop_map(|(protocol, port, end)| {
            let end = match &port {
                Some(PortValue::Number(n)) => end.map(|e| n + e),
                _ => None,
            };
            PortT {
                protocol,
                port,
                end,
            }
        })
}

fn rule() -> impl Strategy<Value = RuleT> {
    (
        prop::collection::vec(peer(), 0..3),
        prop::collection::vec(port(), 0..3),
    )
        .prop_map(|(peers, ports)| RuleT { peers, ports })
}

fn world() -> impl Strategy<Value = World> {
    let ns = labels(&["env"], &["a", "b"]);
    let pod = (
        prop::sample::select(NAMESPACES.to_vec()),
        labels(POD_KEYS, POD_VALUES),
        any::<bool>(),
        prop::bool::weighted(0.1),
        prop::sample::select(vec![80u16, 81, 8080]),
        prop::sample::select(PROTOCOLS.to_vec()),
    );
    let types = prop_oneof![
        2 => Just(None),
        1 => Just(Some(vec!["Ingress"])),
        1 => Just(Some(vec!["Egress"])),
        1 => Just(Some(vec!["Ingress", "Egress"])),
    ];
    let policy = (
        prop::sample::select(NAMESPACES.to_vec()),
        selector(POD_KEYS, POD_VALUES),
        types,
        prop::collection::vec(rule(), 0..3),
        prop::collection::vec(rule(), 0..3),
    );
    (
        prop::collection::vec(ns, 3),
        prop::collection::vec(pod, 1..9),
        prop::collection::vec(policy, 0..5),
    )
        .prop_map(|(ns_labels, pods, policies)| {
            let namespaces = NAMESPACES
                .iter()
                .zip(ns_labels)
                .map(|(n, labels)| Ns {
                    name: n.to_string(),
                    labels,
                })
                .collect();
            let pods = pods
                .into_iter()
                .enumerate()
                .map(|(i, (ns, labels, v6, host, http, http_proto))| {
                    let n = NAMESPACES.iter().position(|x| *x == ns).unwrap();
                    Pod {
                        ns: ns.to_owned(),
                        name: format!("p{i}"),
                        labels,
                        v4: Some(format!("10.0.{n}.{}", i + 1).parse().unwrap()),
                        v6: v6.then(|| format!("fd00::{n}:{}", i + 1).parse().unwrap()),
                        host,
                        ports: vec![
                            ("http".into(), http, http_proto),
                            ("dns".into(), 53, Protocol::Udp),
                        ],
                    }
                })
                .collect();
            let policies = policies
                .into_iter()
                .enumerate()
                .map(|(i, (ns, selector, types, ingress, egress))| PolicyT {
                    ns: ns.to_owned(),
                    name: format!("pol{i}"),
                    selector,
                    types,
                    ingress,
                    egress,
                })
                .collect();
            World {
                namespaces,
                pods,
                policies,
            }
        })
}

/// A change to the world after it is built.
#[derive(Clone, Debug)]
enum Mutation {
    RelabelPod(usize, Labels),
    RelabelNamespace(usize, Labels),
    RenumberHttp(usize, u16),
    DeletePod(usize),
    DeletePolicy(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (0usize..8, labels(POD_KEYS, POD_VALUES)).prop_map(|(i, l)| Mutation::RelabelPod(i, l)),
        2 => (0usize..3, labels(&["env"], &["a", "b"])).prop_map(|(i, l)| Mutation::RelabelNamespace(i, l)),
        2 => (0usize..8, prop::sample::select(vec![80u16, 81, 8080])).prop_map(|(i, n)| Mutation::RenumberHttp(i, n)),
        1 => (0usize..8).prop_map(Mutation::DeletePod),
        1 => (0usize..5).prop_map(Mutation::DeletePolicy),
    ]
}

/// Applies `m` to the world and the engine (through the harness, which checks it).
fn mutate(h: &mut Harness, w: &mut World, m: &Mutation) {
    let changed = match m {
        Mutation::RelabelPod(i, labels) => w.pods.get_mut(*i).map(|p| {
            p.labels = labels.clone();
            format!("pod {}/{}", p.ns, p.name)
        }),
        Mutation::RelabelNamespace(i, labels) => w.namespaces.get_mut(*i).map(|n| {
            n.labels = labels.clone();
            format!("namespace {}", n.name)
        }),
        Mutation::RenumberHttp(i, number) => w.pods.get_mut(*i).map(|p| {
            p.ports[0].1 = *number;
            format!("pod {}/{}", p.ns, p.name)
        }),
        Mutation::DeletePod(i) if *i < w.pods.len() => {
            let p = w.pods.remove(*i);
            h.delete(&ObjectRef::new(Kind::Pod, Some(&p.ns), &p.name));
            None
        }
        Mutation::DeletePolicy(i) if *i < w.policies.len() => {
            let p = w.policies.remove(*i);
            h.delete(&ObjectRef::new(Kind::NetworkPolicy, Some(&p.ns), &p.name));
            None
        }
        Mutation::DeletePod(_) | Mutation::DeletePolicy(_) => None,
    };
    if let Some(key) = changed {
        let object = objects(w)
            .into_iter()
            .find(|o| o.key().to_string() == key)
            .expect("rendered");
        h.upsert_object(object).expect("valid object");
    }
}

fn assert_agrees(h: &Harness, w: &World) -> Result<(), TestCaseError> {
    let desired = h.engine.desired();
    for from in w.pods.iter().filter(|p| !p.host) {
        for to in &w.pods {
            for (from_addr, to_addr) in [(from.v4, to.v4), (from.v6, to.v6)] {
                let (Some(from_addr), Some(to_addr)) = (from_addr, to_addr) else {
                    continue;
                };
                for port in PORT_NUMBERS {
                    for protocol in PROTOCOLS {
                        let key = format!("{}/{}", from.ns, from.name);
                        let compiled = verdict(desired, &key, to_addr, port, protocol)
                            .unwrap()
                            .allowed;
                        let naive = naive_allowed(w, from, from_addr, to, to_addr, port, protocol);
                        prop_assert_eq!(
                            compiled,
                            naive,
                            "{} -> {}/{} ({}) {}/{}",
                            key,
                            to.ns,
                            to.name,
                            to_addr,
                            port,
                            protocol
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn compiled_model_agrees_with_the_naive_evaluator(mut w in world(), mutations in prop::collection::vec(mutation(), 0..6)) {
        let mut h = Harness::new(None);
        for object in objects(&w) {
            h.upsert_object(object).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        assert_agrees(&h, &w)?;
        for m in &mutations {
            mutate(&mut h, &mut w, m);
        }
        assert_agrees(&h, &w)?;
        // Tearing the world down object by object leaves nothing behind.
        for key in h.object_keys() {
            h.delete(&key);
        }
        prop_assert!(h.engine.desired().sets.is_empty() && h.engine.desired().endpoints.is_empty());
    }
}
