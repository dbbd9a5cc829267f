//! Property tests: on random worlds and random policies, the compiled model (evaluated
//! with weir's verdict) agrees with the reference evaluator (netpol-scenarios' `reference`,
//! written naively from the NetworkPolicy API documentation, over the objects themselves); and building
//! the world event by event gives exact deltas and the same state as a cold compile.

mod support;

use ipnet::IpNet;
use netpol_scenarios::reference::{
    self, Labels, Ns, Peer, Pod, Policy, Port, PortValue, Protocol, Rule, Sel, World,
};
use proptest::prelude::*;
use support::Harness;
use weir_policy::model::{Kind, Object, ObjectRef};
use weir_policy::verdict;

/// The reference model's objects as weir's.
fn objects(w: &World) -> Vec<Object> {
    reference::manifests(w)
        .into_iter()
        .map(|v| match v["kind"].as_str() {
            Some("Namespace") => Object::Namespace(serde_json::from_value(v).unwrap()),
            Some("Pod") => Object::Pod(serde_json::from_value(v).unwrap()),
            _ => Object::NetworkPolicy(serde_json::from_value(v).unwrap()),
        })
        .collect()
}

/// The reference model's protocol as weir's.
fn weir_protocol(p: Protocol) -> weir_policy::desired::Protocol {
    match p {
        Protocol::Tcp => weir_policy::desired::Protocol::Tcp,
        Protocol::Udp => weir_policy::desired::Protocol::Udp,
        Protocol::Sctp => weir_policy::desired::Protocol::Sctp,
    }
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

fn peer() -> impl Strategy<Value = Peer> {
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
            Peer::Block { cidr, except }
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
            Peer::Pods { ns, pod }
        });
    prop_oneof![1 => block, 3 => pods]
}

fn port() -> impl Strategy<Value = Port> {
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
            Port {
                protocol,
                port,
                end,
            }
        })
}

fn rule() -> impl Strategy<Value = Rule> {
    (
        prop::collection::vec(peer(), 0..3),
        prop::collection::vec(port(), 0..3),
    )
        .prop_map(|(peers, ports)| Rule { peers, ports })
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
                .map(|(i, (ns, selector, types, ingress, egress))| Policy {
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
                        let compiled =
                            verdict(desired, &key, to_addr, port, weir_protocol(protocol))
                                .unwrap()
                                .allowed;
                        let naive =
                            reference::allowed(w, from, from_addr, to, to_addr, port, protocol);
                        prop_assert_eq!(
                            compiled,
                            naive,
                            "{} -> {}/{} ({}) {}/{}",
                            key,
                            to.ns,
                            to.name,
                            to_addr,
                            port,
                            protocol.name()
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
