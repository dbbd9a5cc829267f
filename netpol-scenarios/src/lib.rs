//! The upstream Kubernetes e2e netpol scenarios (test/e2e/network/netpol/network_policy.go)
//! on the x/y/z × a/b/c world, as plain data: manifests (YAML strings), steps (apply/delete
//! changes) and truth tables written by hand from the upstream semantics. Every case starts
//! from "all allowed" and states its exceptions, over ports 80/81 and TCP/UDP/SCTP (upstream
//! probes one port/protocol per case; here every step is checked on all six, so the
//! expectations also say what must stay untouched).
//!
//! The one table both harnesses run: the engine harness (policy/tests/netpol_e2e.rs, the
//! compiled model through weir's verdict evaluator) and the lab harness
//! (tests/tests/netpol_conformance.rs, real packets through `weir-lab` on both dataplanes).
//! Both compare the full matrix of [`probes`] per step with [`compare`]. No I/O here: pod
//! addresses (for the ipBlock cases) come from whoever built the world.
//!
//! Beside the table: [`reference`], the naive evaluator the engine's property test and the
//! generated cases are checked against, and [`generated`], random cases over the same world.
//!
//! **Dependencies:** ipnet and serde_json only (no weir crate), so both harnesses can use
//! it and it can use neither: the reference stays independent of what it checks.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;
use std::net::IpAddr;

pub mod generated;
pub mod reference;

pub const NAMESPACES: [&str; 3] = ["x", "y", "z"];
pub const PODS: [&str; 3] = ["a", "b", "c"];
pub const PORTS: [u16; 2] = [80, 81];
pub const PROTOCOLS: [&str; 3] = ["TCP", "UDP", "SCTP"];

/// The world's manifests (deploy/examples/netpol-world.yaml, which `weir-lab up` takes):
/// namespaces x, y, z labelled `ns: <name>`, each with pods a, b, c labelled `pod: <name>`,
/// serving 80 and 81 over TCP, UDP and SCTP as `serve-<port>-<proto>`. No addresses: the lab
/// allocates them, the engine harness assigns its own.
pub const WORLD: &str = include_str!("../../deploy/examples/netpol-world.yaml");

/// Every pod of the world as `ns/name`, in order.
pub fn world_pods() -> Vec<String> {
    NAMESPACES
        .iter()
        .flat_map(|ns| PODS.iter().map(move |p| format!("{ns}/{p}")))
        .collect()
}

/// (from, to, port, protocol) → connected, pods as `ns/name`.
pub type Matrix = BTreeMap<(String, String, u16, String), bool>;

/// Every probe of a step, as `weir-lab probe` makes them: each ordered pair of distinct
/// pods (self traffic is never judged, as upstream's ignoreLoopback) × 80/81 × TCP/UDP/SCTP.
pub fn probes() -> Vec<(String, String, u16, &'static str)> {
    let pods = world_pods();
    let mut all = Vec::new();
    for from in &pods {
        for to in pods.iter().filter(|to| *to != from) {
            for port in PORTS {
                for protocol in PROTOCOLS {
                    all.push((from.clone(), to.clone(), port, protocol));
                }
            }
        }
    }
    all
}

/// One probe of the matrix, as the expectations see it.
pub struct Pair<'a> {
    pub from_ns: &'a str,
    pub from_pod: &'a str,
    pub to_ns: &'a str,
    pub to_pod: &'a str,
    pub port: u16,
    pub protocol: &'a str,
}

impl Pair<'_> {
    pub fn from(&self, ns: &str, pod: &str) -> bool {
        self.from_ns == ns && self.from_pod == pod
    }
    pub fn to(&self, ns: &str, pod: &str) -> bool {
        self.to_ns == ns && self.to_pod == pod
    }
    pub fn on(&self, port: u16, protocol: &str) -> bool {
        self.port == port && self.protocol == protocol
    }
}

pub type Truth = fn(&Pair) -> bool;

/// What to change before probing.
pub enum Change {
    /// Manifests to `weir-lab apply`.
    Apply(String),
    /// Manifests naming objects to `weir-lab delete`.
    Delete(String),
}

pub struct Step {
    pub changes: Vec<Change>,
    pub expect: Truth,
}

pub struct Scenario {
    pub name: &'static str,
    pub steps: Vec<Step>,
}

/// The pods' IPv4 addresses, for ipBlock cases: `NS/NAME` → address.
pub type Addresses = BTreeMap<String, String>;

/// Compares a probed matrix with the expectation; the error lists every difference, and
/// every probe of [`probes`] the matrix lacks or has beyond them.
pub fn compare(matrix: &Matrix, expect: impl Fn(&Pair) -> bool) -> Result<(), String> {
    let mut diffs = String::new();
    let mut count = 0;
    for ((from, to, port, protocol), connected) in matrix {
        let (from_ns, from_pod) = from.split_once('/').unwrap_or((from, ""));
        let (to_ns, to_pod) = to.split_once('/').unwrap_or((to, ""));
        let pair = Pair {
            from_ns,
            from_pod,
            to_ns,
            to_pod,
            port: *port,
            protocol,
        };
        let expected = expect(&pair);
        if expected != *connected {
            count += 1;
            let _ = writeln!(
                diffs,
                "  {from} -> {to} {port}/{protocol}: expected {}, got {}",
                verdict(expected),
                verdict(*connected)
            );
        }
    }
    let wanted: BTreeSet<(String, String, u16, String)> = probes()
        .into_iter()
        .map(|(f, t, port, proto)| (f, t, port, proto.to_string()))
        .collect();
    let missing: Vec<_> = wanted.iter().filter(|k| !matrix.contains_key(*k)).collect();
    let extra: Vec<_> = matrix.keys().filter(|k| !wanted.contains(*k)).collect();
    for (from, to, port, protocol) in &missing {
        count += 1;
        let _ = writeln!(diffs, "  {from} -> {to} {port}/{protocol}: not probed");
    }
    for (from, to, port, protocol) in &extra {
        count += 1;
        let _ = writeln!(
            diffs,
            "  {from} -> {to} {port}/{protocol}: not a probe of the world"
        );
    }
    if count == 0 {
        Ok(())
    } else {
        Err(format!(
            "{count} of {} probes differ:\n{diffs}",
            wanted.len()
        ))
    }
}

fn verdict(connected: bool) -> &'static str {
    if connected {
        "connected"
    } else {
        "blocked"
    }
}

/// A NetworkPolicy manifest in `ns` with the given spec (YAML, indented by 2).
pub fn policy(ns: &str, name: &str, spec: &str) -> String {
    let spec: String = spec.lines().map(|l| format!("  {l}\n")).collect();
    format!(
        "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: {name}\n  namespace: {ns}\nspec:\n{spec}"
    )
}

/// `manifest` (one NetworkPolicy from [`policy`]) in weir's audit mode: it drops nothing.
pub fn audit_mode(manifest: &str) -> String {
    manifest.replacen(
        "metadata:\n",
        "metadata:\n  annotations: {policy.weir.io/mode: audit}\n",
        1,
    )
}

/// A Pod of the world with extra labels (a relabel, applied in place).
pub fn relabelled_pod(ns: &str, name: &str, extra_labels: &str) -> String {
    let ports: String = [80, 81]
        .iter()
        .flat_map(|port| {
            ["TCP", "UDP", "SCTP"].iter().map(move |proto| {
                format!(
                    "    - {{containerPort: {port}, protocol: {proto}, name: serve-{port}-{}}}\n",
                    proto.to_lowercase()
                )
            })
        })
        .collect();
    format!(
        "---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels: {{pod: {name}, {extra_labels}}}\nspec:\n  containers:\n  - name: cont-{name}\n    image: registry.k8s.io/e2e-test-images/agnhost\n    ports:\n{ports}"
    )
}

/// A Namespace of the world with extra labels.
pub fn relabelled_namespace(ns: &str, extra_labels: &str) -> String {
    format!("---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: {ns}\n  labels: {{ns: {ns}, {extra_labels}}}\n")
}

/// `ip/32` (or `/128`): the one address, as upstream's podServerCIDR.
pub fn host_cidr(ip: &str) -> String {
    match ip.parse::<IpAddr>() {
        Ok(IpAddr::V6(_)) => format!("{ip}/128"),
        _ => format!("{ip}/32"),
    }
}

/// The /4 that holds `ip`, as upstream's makeLargeCIDRForIP (a block around the pod that
/// its except clause then carves the pod out of).
pub fn large_cidr(ip: &str) -> String {
    match ip.parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) => {
            let base = std::net::Ipv4Addr::from(u32::from(v4) & 0xf000_0000);
            format!("{base}/4")
        }
        Ok(IpAddr::V6(v6)) => {
            let base = std::net::Ipv6Addr::from(u128::from(v6) & (0xf_u128 << 124));
            format!("{base}/4")
        }
        Err(e) => panic!("pod address {ip:?}: {e}"),
    }
}

fn one(changes: Vec<Change>, expect: Truth) -> Vec<Step> {
    vec![Step { changes, expect }]
}

fn apply(yaml: String) -> Change {
    Change::Apply(yaml)
}

/// Every scenario, in upstream order. `ips` gives pod addresses for the ipBlock cases.
pub fn scenarios(ips: &Addresses) -> Vec<Scenario> {
    let deny_ingress_x = policy(
        "x",
        "deny-ingress",
        "podSelector: {}\npolicyTypes: [Ingress]",
    );
    let deny_all_x = policy(
        "x",
        "deny-all",
        "podSelector: {}\npolicyTypes: [Ingress, Egress]",
    );
    let to_a = |name: &str, ingress: &str| {
        policy(
            "x",
            name,
            &format!("podSelector: {{matchLabels: {{pod: a}}}}\npolicyTypes: [Ingress]\ningress:\n{ingress}"),
        )
    };
    let from_a = |name: &str, egress: &str| {
        policy(
            "x",
            name,
            &format!("podSelector: {{matchLabels: {{pod: a}}}}\npolicyTypes: [Egress]\negress:\n{egress}"),
        )
    };
    // Upstream names the TCP case's policy apart from the UDP and SCTP ones'.
    let ports_from_y = |protocol: &str| {
        let name = match protocol {
            "TCP" => "allow-client-a-via-ns-selector",
            _ => "allow-ingress-on-port-81-ns-x",
        };
        to_a(
            name,
            &format!("- from: [{{namespaceSelector: {{matchLabels: {{kubernetes.io/metadata.name: y}}}}}}]\n  ports: [{{port: 81, protocol: {protocol}}}]"),
        )
    };
    let x_b = &ips["x/b"];
    let x_c = &ips["x/c"];
    let y_b = &ips["y/b"];
    let except_x_b = from_a(
        "allow-client-a-via-cidr-egress-rule",
        &format!(
            "- to: [{{ipBlock: {{cidr: \"{}\", except: [\"{}\"]}}}}]",
            large_cidr(x_b),
            host_cidr(x_b)
        ),
    );
    let except_b_c = format!(
        "- to: [{{ipBlock: {{cidr: \"{}\", except: [\"{}\", \"{}\"]}}}}]",
        large_cidr(x_b),
        host_cidr(x_b),
        host_cidr(x_c)
    );
    let other_family_everything = match x_b.parse::<IpAddr>() {
        Ok(IpAddr::V6(_)) => "0.0.0.0/0",
        _ => "::/0",
    };
    let allow_b = format!("- to: [{{ipBlock: {{cidr: \"{}\"}}}}]", host_cidr(x_b));
    vec![
        Scenario {
            name: "default-deny-ingress",
            steps: one(vec![apply(deny_ingress_x.clone())], |p| p.to_ns != "x"),
        },
        Scenario {
            name: "default-deny-all",
            steps: one(vec![apply(deny_all_x.clone())], |p| p.to_ns != "x" && p.from_ns != "x"),
        },
        Scenario {
            name: "allow from pods within the server namespace by podSelector",
            steps: one(
                vec![apply(to_a("x-a-allows-x-b", "- from: [{podSelector: {matchLabels: {pod: b}}}]"))],
                |p| !p.to("x", "a") || p.from("x", "b"),
            ),
        },
        Scenario {
            name: "allow ingress to a target in a default-deny namespace",
            steps: one(
                vec![
                    apply(deny_ingress_x.clone()),
                    apply(to_a("allow-all-to-a", "- from: [{podSelector: {}, namespaceSelector: {}}]")),
                ],
                |p| p.to_ns != "x" || p.to_pod == "a",
            ),
        },
        Scenario {
            name: "allow ingress from pods in all namespaces",
            steps: one(
                vec![apply(to_a("allow-from-another-ns", "- from: [{namespaceSelector: {matchLabels: {}}}]"))],
                |_| true,
            ),
        },
        Scenario {
            name: "allow only from a different namespace by namespaceSelector",
            steps: one(
                vec![apply(to_a(
                    "allow-client-a-via-ns-selector",
                    "- from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}}]",
                ))],
                |p| !p.to("x", "a") || p.from_ns == "y",
            ),
        },
        Scenario {
            name: "podSelector with matchExpressions",
            steps: one(
                vec![apply(to_a(
                    "x-a-allows-x-b",
                    "- from: [{podSelector: {matchExpressions: [{key: pod, operator: In, values: [b]}]}}]",
                ))],
                |p| !p.to("x", "a") || p.from("x", "b"),
            ),
        },
        Scenario {
            name: "namespaceSelector with matchExpressions",
            steps: one(
                vec![apply(to_a(
                    "allow-ns-y-match-selector",
                    "- from: [{namespaceSelector: {matchExpressions: [{key: kubernetes.io/metadata.name, operator: In, values: [y]}]}}]",
                ))],
                |p| !p.to("x", "a") || p.from_ns == "y",
            ),
        },
        Scenario {
            name: "podSelector or namespaceSelector",
            steps: one(
                vec![apply(to_a(
                    "allow-ns-y-match-selector",
                    "- from:\n  - namespaceSelector: {matchExpressions: [{key: kubernetes.io/metadata.name, operator: NotIn, values: [x]}]}\n  - podSelector: {matchLabels: {pod: b}}",
                ))],
                |p| !p.to("x", "a") || p.from_ns != "x" || p.from_pod == "b",
            ),
        },
        Scenario {
            name: "podSelector and namespaceSelector",
            steps: one(
                vec![apply(to_a(
                    "allow-ns-y-podselector-and-nsselector",
                    "- from:\n  - namespaceSelector: {matchExpressions: [{key: kubernetes.io/metadata.name, operator: NotIn, values: [x]}]}\n    podSelector: {matchLabels: {pod: b}}",
                ))],
                |p| !p.to("x", "a") || (p.from_ns != "x" && p.from_pod == "b"),
            ),
        },
        Scenario {
            name: "multiple podSelectors and namespaceSelectors",
            steps: one(
                vec![apply(to_a(
                    "allow-ns-y-z-pod-b-c",
                    "- from:\n  - namespaceSelector: {matchExpressions: [{key: kubernetes.io/metadata.name, operator: NotIn, values: [x]}]}\n    podSelector: {matchExpressions: [{key: pod, operator: In, values: [b, c]}]}",
                ))],
                |p| !p.to("x", "a") || (p.from_ns != "x" && p.from_pod != "a"),
            ),
        },
        Scenario {
            name: "any podSelectors",
            steps: one(
                vec![apply(to_a(
                    "allow-ns-x-pod-b-c",
                    "- from: [{podSelector: {matchLabels: {pod: b}}}, {podSelector: {matchLabels: {pod: c}}}]",
                ))],
                |p| !p.to("x", "a") || p.from("x", "b") || p.from("x", "c"),
            ),
        },
        Scenario {
            name: "only from a pod in a different namespace by podSelector and namespaceSelector",
            steps: one(
                vec![apply(to_a(
                    "allow-ns-y-pod-a-via-namespace-pod-selector",
                    "- from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}, podSelector: {matchLabels: {pod: a}}}]",
                ))],
                |p| !p.to("x", "a") || p.from("y", "a"),
            ),
        },
        Scenario {
            name: "ports (TCP)",
            steps: one(vec![apply(ports_from_y("TCP"))], |p| {
                !p.to("x", "a") || (p.from_ns == "y" && p.on(81, "TCP"))
            }),
        },
        Scenario {
            name: "ports (UDP)",
            steps: one(vec![apply(ports_from_y("UDP"))], |p| {
                !p.to("x", "a") || (p.from_ns == "y" && p.on(81, "UDP"))
            }),
        },
        Scenario {
            name: "ports (SCTP)",
            steps: one(vec![apply(ports_from_y("SCTP"))], |p| {
                !p.to("x", "a") || (p.from_ns == "y" && p.on(81, "SCTP"))
            }),
        },
        Scenario {
            name: "multiple stacked policies with overlapping podSelectors",
            steps: vec![
                Step {
                    changes: vec![apply(ports_from_y("TCP"))],
                    expect: |p| !p.to("x", "a") || (p.from_ns == "y" && p.on(81, "TCP")),
                },
                Step {
                    changes: vec![apply(to_a(
                        "allow-client-a-via-ns-selector-80",
                        "- from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}}]\n  ports: [{port: 80, protocol: TCP}]",
                    ))],
                    expect: |p| {
                        !p.to("x", "a")
                            || (p.from_ns == "y" && p.protocol == "TCP")
                    },
                },
            ],
        },
        Scenario {
            name: "allow-all policy",
            steps: one(
                vec![apply(policy("x", "allow-all", "podSelector: {}\npolicyTypes: [Ingress]\ningress: [{}]"))],
                |_| true,
            ),
        },
        Scenario {
            name: "ingress on one named port",
            steps: one(
                vec![apply(policy(
                    "x",
                    "allow-all",
                    "podSelector: {}\npolicyTypes: [Ingress]\ningress: [{ports: [{port: serve-81-tcp}]}]",
                ))],
                |p| p.to_ns != "x" || p.on(81, "TCP"),
            ),
        },
        Scenario {
            name: "ingress from a namespace on one named port",
            steps: one(
                vec![apply(to_a(
                    "allow-client-a-via-ns-selector-80",
                    "- from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}}]\n  ports: [{port: serve-80-tcp, protocol: TCP}]",
                ))],
                |p| !p.to("x", "a") || (p.from_ns == "y" && p.on(80, "TCP")),
            ),
        },
        Scenario {
            name: "egress on one named port",
            steps: one(
                vec![apply(policy(
                    "x",
                    "allow-egress",
                    "podSelector: {}\npolicyTypes: [Egress]\negress: [{ports: [{port: serve-80-tcp}]}]",
                ))],
                |p| p.from_ns != "x" || p.on(80, "TCP"),
            ),
        },
        Scenario {
            name: "updated policy (allow-all mutated to deny-all)",
            steps: vec![
                Step {
                    changes: vec![apply(policy(
                        "x",
                        "allow-all-mutate-to-deny-all",
                        "podSelector: {}\npolicyTypes: [Ingress]\ningress: [{}]",
                    ))],
                    expect: |_| true,
                },
                Step {
                    changes: vec![apply(policy(
                        "x",
                        "allow-all-mutate-to-deny-all",
                        "podSelector: {}\npolicyTypes: [Ingress]\ningress: []",
                    ))],
                    expect: |p| p.to_ns != "x",
                },
            ],
        },
        Scenario {
            name: "ingress from an updated namespace (relabel)",
            steps: vec![
                Step {
                    changes: vec![apply(to_a(
                        "allow-client-a-via-ns-selector",
                        "- from: [{namespaceSelector: {matchLabels: {ns2: updated}}}]",
                    ))],
                    expect: |p| !p.to("x", "a"),
                },
                Step {
                    changes: vec![apply(relabelled_namespace("y", "ns2: updated"))],
                    expect: |p| !p.to("x", "a") || p.from_ns == "y",
                },
            ],
        },
        Scenario {
            name: "ingress from an updated pod (relabel)",
            steps: vec![
                Step {
                    changes: vec![apply(to_a(
                        "allow-client-a-via-pod-selector",
                        "- from: [{podSelector: {matchLabels: {pod: b, pod2: updated}}}]",
                    ))],
                    expect: |p| !p.to("x", "a"),
                },
                Step {
                    changes: vec![apply(relabelled_pod("x", "b", "pod2: updated"))],
                    expect: |p| !p.to("x", "a") || p.from("x", "b"),
                },
            ],
        },
        Scenario {
            name: "deny ingress from pods in other namespaces",
            steps: one(
                vec![apply(policy(
                    "x",
                    "deny-empty-policy",
                    "podSelector: {}\npolicyTypes: [Ingress]\ningress: [{from: [{podSelector: {matchLabels: {}}}]}]",
                ))],
                |p| p.to_ns != "x" || p.from_ns == "x",
            ),
        },
        Scenario {
            name: "deny ingress to an updated pod (relabel)",
            steps: vec![
                Step {
                    changes: vec![apply(policy(
                        "x",
                        "deny-ingress-via-label-selector",
                        "podSelector: {matchLabels: {target: isolated}}\npolicyTypes: [Ingress]",
                    ))],
                    expect: |_| true,
                },
                Step {
                    changes: vec![apply(relabelled_pod("x", "a", "target: isolated"))],
                    expect: |p| !p.to("x", "a"),
                },
            ],
        },
        Scenario {
            name: "deny egress from a pod by podSelector",
            steps: one(
                vec![apply(policy(
                    "x",
                    "deny-egress-pod-a",
                    "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Egress]",
                ))],
                |p| !p.from("x", "a"),
            ),
        },
        Scenario {
            name: "deny egress from all pods of a namespace",
            steps: one(
                vec![apply(policy("x", "deny-egress-ns-x", "podSelector: {}\npolicyTypes: [Egress]"))],
                |p| p.from_ns != "x",
            ),
        },
        Scenario {
            name: "ingress and egress specified together",
            steps: one(
                vec![apply(policy(
                    "x",
                    "allow-client-a-via-pod-selector",
                    "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Egress, Ingress]\ningress: [{from: [{podSelector: {matchLabels: {pod: b}}}]}]\negress: [{ports: [{port: 80}]}]",
                ))],
                |p| (!p.to("x", "a") || p.from("x", "b")) && (!p.from("x", "a") || p.on(80, "TCP")),
            ),
        },
        Scenario {
            name: "egress denied on the client even when the server allows",
            steps: one(
                vec![
                    apply(from_a(
                        "allow-to-ns-y-pod-a",
                        "- to: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}, podSelector: {matchLabels: {pod: a}}}]",
                    )),
                    apply(policy(
                        "y",
                        "allow-from-xa-on-ya-match-selector",
                        "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Ingress]\ningress: [{from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: x}}, podSelector: {matchLabels: {pod: a}}}]}]",
                    )),
                    apply(policy(
                        "y",
                        "allow-from-xa-on-yb-match-selector",
                        "podSelector: {matchLabels: {pod: b}}\npolicyTypes: [Ingress]\ningress: [{from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: x}}, podSelector: {matchLabels: {pod: a}}}]}]",
                    )),
                ],
                |p| {
                    let egress = !p.from("x", "a") || p.to("y", "a");
                    let ingress = !(p.to("y", "a") || p.to("y", "b")) || p.from("x", "a");
                    egress && ingress
                },
            ),
        },
        Scenario {
            name: "egress to a server in another namespace by podSelector and namespaceSelector",
            steps: one(
                vec![apply(from_a(
                    "allow-to-ns-y-pod-a",
                    "- to: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}, podSelector: {matchLabels: {pod: a}}}]",
                ))],
                |p| !p.from("x", "a") || p.to("y", "a"),
            ),
        },
        Scenario {
            name: "ingress on any port of one protocol",
            steps: one(
                vec![apply(to_a("allow-ingress-by-proto", "- ports: [{protocol: TCP}]"))],
                |p| !p.to("x", "a") || p.protocol == "TCP",
            ),
        },
        Scenario {
            name: "multiple ingress policies, allow-all takes precedence",
            steps: vec![
                Step {
                    changes: vec![apply(policy(
                        "x",
                        "allow-ingress-port-80",
                        "podSelector: {}\npolicyTypes: [Ingress]\ningress: [{ports: [{port: 80}]}]",
                    ))],
                    expect: |p| p.to_ns != "x" || p.on(80, "TCP"),
                },
                Step {
                    changes: vec![apply(policy(
                        "x",
                        "allow-ingress",
                        "podSelector: {}\npolicyTypes: [Ingress]\ningress: [{}]",
                    ))],
                    expect: |_| true,
                },
            ],
        },
        Scenario {
            name: "multiple egress policies, allow-all takes precedence",
            steps: vec![
                Step {
                    changes: vec![apply(policy(
                        "x",
                        "allow-egress-port-80",
                        "podSelector: {}\npolicyTypes: [Egress]\negress: [{ports: [{port: 80}]}]",
                    ))],
                    expect: |p| p.from_ns != "x" || p.on(80, "TCP"),
                },
                Step {
                    changes: vec![apply(policy(
                        "x",
                        "allow-egress",
                        "podSelector: {}\npolicyTypes: [Egress]\negress: [{}]",
                    ))],
                    expect: |_| true,
                },
            ],
        },
        Scenario {
            name: "stop enforcing a policy after it is deleted",
            steps: vec![
                Step {
                    changes: vec![apply(deny_all_x.clone())],
                    expect: |p| p.to_ns != "x" && p.from_ns != "x",
                },
                Step {
                    changes: vec![Change::Delete(deny_all_x.clone())],
                    expect: |_| true,
                },
            ],
        },
        Scenario {
            name: "egress to a server in a CIDR block",
            steps: one(
                vec![apply(from_a(
                    "allow-client-a-via-cidr-egress-rule",
                    &format!("- to: [{{ipBlock: {{cidr: \"{}\"}}}}]", host_cidr(y_b)),
                ))],
                |p| !p.from("x", "a") || p.to("y", "b"),
            ),
        },
        Scenario {
            name: "except clause of a CIDR block",
            steps: one(vec![apply(except_x_b.clone())], |p| {
                !p.from("x", "a") || !p.to("x", "b")
            }),
        },
        Scenario {
            name: "an IP in both CIDR and except is allowed by another rule",
            steps: vec![
                Step {
                    changes: vec![apply(except_x_b)],
                    expect: |p| !p.from("x", "a") || !p.to("x", "b"),
                },
                Step {
                    changes: vec![apply(from_a(
                        "allow-client-a-via-cidr-egress-rule",
                        &format!("- to: [{{ipBlock: {{cidr: \"{}\"}}}}]", host_cidr(x_b)),
                    ))],
                    expect: |p| !p.from("x", "a") || p.to("x", "b"),
                },
            ],
        },
        Scenario {
            name: "ingress and egress controlled independently",
            steps: vec![
                Step {
                    changes: vec![apply(from_a("allow-egress-for-target", "- {}"))],
                    expect: |_| true,
                },
                Step {
                    changes: vec![apply(policy(
                        "x",
                        "deny-ingress-via-label-selector",
                        "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Ingress]",
                    ))],
                    expect: |p| !p.to("x", "a"),
                },
            ],
        },
        Scenario {
            name: "SCTP is not treated as TCP",
            steps: one(
                vec![
                    apply(deny_ingress_x.clone()),
                    apply(to_a("allow-only-sctp-ingress-on-port-81", "- ports: [{port: 81, protocol: SCTP}]")),
                ],
                |p| p.to_ns != "x" || (p.to_pod == "a" && p.on(81, "SCTP")),
            ),
        },
        Scenario {
            name: "a policy allowing only SCTP isolates the pod",
            steps: one(
                vec![apply(to_a("allow-only-sctp-ingress-on-port-80", "- ports: [{port: 80, protocol: SCTP}]"))],
                |p| !p.to("x", "a") || p.on(80, "SCTP"),
            ),
        },
        Scenario {
            name: "no TCP when a policy allows only UDP",
            steps: one(
                vec![apply(to_a("allow-only-udp-ingress-on-port-81", "- ports: [{port: 81, protocol: UDP}]"))],
                |p| !p.to("x", "a") || p.on(81, "UDP"),
            ),
        },
        // Upstream's own case for the default label; the same spec as "allow only from a
        // different namespace by namespaceSelector" now that upstream selects namespaces by
        // that label everywhere, but a separate upstream test (and policy name).
        Scenario {
            name: "namespaceSelector matchLabels on the default namespace label",
            steps: one(
                vec![apply(to_a(
                    "allow-client-a-via-ns-selector-for-immutable-ns-label",
                    "- from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}}]",
                ))],
                |p| !p.to("x", "a") || p.from_ns == "y",
            ),
        },
        Scenario {
            name: "egress by namespaceSelector matchExpressions on the default namespace label",
            steps: one(
                vec![apply(from_a(
                    "allow-ns-y-match-selector-for-immutable-ns-label",
                    "- to: [{namespaceSelector: {matchExpressions: [{key: kubernetes.io/metadata.name, operator: NotIn, values: [y]}]}}]",
                ))],
                |p| !p.from("x", "a") || p.to_ns != "y",
            ),
        },
        // Not upstream (its netpol suite has no endPort case): weir's own, one range
        // ending on a probed port and a one-port range, so both bounds are tested.
        Scenario {
            name: "port range with endPort",
            steps: one(
                vec![apply(to_a(
                    "allow-port-ranges-from-y",
                    "- from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}}]\n  ports: [{port: 70, endPort: 80, protocol: TCP}, {port: 81, endPort: 81, protocol: UDP}]",
                ))],
                |p| !p.to("x", "a") || (p.from_ns == "y" && (p.on(80, "TCP") || p.on(81, "UDP"))),
            ),
        },
        // Not upstream: an IPv6 block never holds an IPv4 peer, nor an IPv4 block an IPv6
        // one, even when it is the whole space (eBPF once let ::/0 admit every IPv4 peer).
        Scenario {
            name: "an ipBlock of the other family admits nobody",
            steps: one(
                vec![apply(to_a(
                    "allow-the-other-family",
                    &format!("- from: [{{ipBlock: {{cidr: \"{other_family_everything}\"}}}}]"),
                ))],
                |p| !p.to("x", "a"),
            ),
        },
        // Not upstream: weir's audit mode (`policy.weir.io/mode: audit`). An audit-mode
        // policy drops nothing, alone or beside an enforced one; the same policy without
        // the annotation is enforced.
        Scenario {
            name: "an audit-mode policy drops nothing until it is enforced",
            steps: vec![
                Step {
                    changes: vec![apply(audit_mode(&deny_all_x))],
                    expect: |_| true,
                },
                Step {
                    changes: vec![apply(deny_ingress_x.clone())],
                    expect: |p| p.to_ns != "x",
                },
                Step {
                    changes: vec![
                        Change::Delete(deny_ingress_x.clone()),
                        apply(deny_all_x.clone()),
                    ],
                    expect: |p| p.to_ns != "x" && p.from_ns != "x",
                },
                Step {
                    changes: vec![Change::Delete(deny_all_x.clone())],
                    expect: |_| true,
                },
            ],
        },
        // Not upstream: upstream's "IP in both CIDR and except" replaces its one policy, so
        // the except and the allow never coexist. Here they do, as two rules of one policy
        // and then as two policies; x/c stays excepted, so the step can fail either way.
        Scenario {
            name: "an excepted IP allowed by another rule at the same time",
            steps: vec![
                Step {
                    changes: vec![apply(from_a("except-and-allow", &format!("{except_b_c}\n{allow_b}")))],
                    expect: |p| !p.from("x", "a") || !p.to("x", "c"),
                },
                Step {
                    changes: vec![
                        Change::Delete(from_a("except-and-allow", &format!("{except_b_c}\n{allow_b}"))),
                        apply(from_a("except-b-and-c", &except_b_c)),
                        apply(from_a("allow-b", &allow_b)),
                    ],
                    expect: |p| !p.from("x", "a") || !p.to("x", "c"),
                },
                Step {
                    changes: vec![Change::Delete(from_a("allow-b", &allow_b))],
                    expect: |p| !p.from("x", "a") || !(p.to("x", "b") || p.to("x", "c")),
                },
            ],
        },
    ]
    .into_iter()
    .chain(cluster_policy_scenarios(ips))
    .collect()
}

/// Traffic from x to y or from y to x.
fn between_x_and_y(p: &Pair) -> bool {
    matches!((p.from_ns, p.to_ns), ("x", "y") | ("y", "x"))
}

/// A ClusterNetworkPolicy manifest; `spec` is YAML, indented under `spec:`.
pub fn cluster_policy(name: &str, spec: &str) -> String {
    let spec: String = spec.lines().map(|l| format!("  {l}\n")).collect();
    format!(
        "---\napiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata:\n  name: {name}\nspec:\n{spec}"
    )
}

/// `rules` (YAML flow mappings) as a block list under `key`.
fn rule_list(key: &str, rules: &[&str]) -> String {
    let items: String = rules.iter().map(|r| format!("- {r}\n")).collect();
    format!("{key}:\n{items}")
}

/// ClusterNetworkPolicy scenarios (network-policy-api v0.2.0's conformance tests, on this
/// world: x plays gryffindor, the subject; y the peer whose rules are reordered; z's pods
/// a and b the peers of the port rules). Every scenario's names start with "cnp".
fn cluster_policy_scenarios(ips: &Addresses) -> Vec<Scenario> {
    let ns = |n: &str| format!("{{namespaces: {{matchLabels: {{ns: {n}}}}}}}");
    let pod = |n: &str, p: &str| {
        format!("{{pods: {{namespaceSelector: {{matchLabels: {{ns: {n}}}}}, podSelector: {{matchLabels: {{pod: {p}}}}}}}}}")
    };
    let rule = |action: &str, dir: &str, peer: &str, protocols: &str| match protocols {
        "" => format!("{{action: {action}, {dir}: [{peer}]}}"),
        p => format!("{{action: {action}, {dir}: [{peer}], protocols: [{p}]}}"),
    };
    let admin_x = |name: &str, key: &str, rules: &[String]| {
        let rules: Vec<&str> = rules.iter().map(String::as_str).collect();
        cluster_policy(
            name,
            &format!(
                "tier: Admin\npriority: 3\nsubject: {{namespaces: {{matchLabels: {{ns: x}}}}}}\n{}",
                rule_list(key, &rules)
            ),
        )
    };

    // A tier long enough that a dataplane may index it by port (iptables does from 16
    // rules): sixteen Deny rules on ports nothing serves, then rules whose port ranges
    // overlap, in an order that decides (Accept before Deny on TCP 80, Pass before Deny
    // on UDP 81). The same for the Baseline tier on y's egress.
    let fillers = |base: u16, dir: &str| -> Vec<String> {
        (0..16)
            .map(|i| {
                rule(
                    "Deny",
                    dir,
                    "{namespaces: {}}",
                    &format!("{{tcp: {{destinationPort: {{number: {}}}}}}}", base + i),
                )
            })
            .collect()
    };
    let mut admin_rules = fillers(1000, "from");
    admin_rules.extend([
        rule(
            "Accept",
            "from",
            &ns("z"),
            "{tcp: {destinationPort: {range: {start: 80, end: 81}}}}",
        ),
        rule(
            "Deny",
            "from",
            "{namespaces: {}}",
            "{tcp: {destinationPort: {number: 80}}}",
        ),
        rule(
            "Pass",
            "from",
            &ns("y"),
            "{udp: {destinationPort: {number: 81}}}",
        ),
        rule(
            "Deny",
            "from",
            "{namespaces: {}}",
            "{udp: {destinationPort: {range: {start: 79, end: 85}}}}",
        ),
        rule(
            "Deny",
            "from",
            &ns("y"),
            "{sctp: {destinationPort: {number: 81}}}",
        ),
    ]);
    let many_admin = admin_x("many-admin", "ingress", &admin_rules);
    let mut baseline_rules = fillers(2000, "to");
    baseline_rules.push(rule(
        "Deny",
        "to",
        &ns("x"),
        "{tcp: {destinationPort: {number: 81}}}",
    ));
    let baseline_rules: Vec<&str> = baseline_rules.iter().map(String::as_str).collect();
    let many_baseline = cluster_policy(
        "many-baseline",
        &format!(
            "tier: Baseline\npriority: 3\nsubject: {{namespaces: {{matchLabels: {{ns: y}}}}}}\n{}",
            rule_list("egress", &baseline_rules)
        ),
    );

    // CNPAdminTierIngress{TCP,UDP,SCTP}: rule order for y, port rules for z/a and z/b.
    let tcp80 = "{tcp: {destinationPort: {number: 80}}}";
    let (acc_y, den_y, pas_y) = (
        rule("Accept", "from", &ns("y"), ""),
        rule("Deny", "from", &ns("y"), ""),
        rule("Pass", "from", &ns("y"), ""),
    );
    let (den_za, pas_za) = (
        rule("Deny", "from", &pod("z", "a"), tcp80),
        rule("Pass", "from", &pod("z", "a"), tcp80),
    );
    let (acc_zb, den_zb) = (
        rule("Accept", "from", &pod("z", "b"), tcp80),
        rule("Deny", "from", &pod("z", "b"), ""),
    );
    let ingress = |order: [&String; 7]| {
        apply(admin_x(
            "ingress-rules",
            "ingress",
            &order.map(String::clone),
        ))
    };

    // CNPAdminTierEgress{UDP,SCTP}: the same shape from x, on other protocols.
    let (udp80, sctp81) = (
        "{udp: {destinationPort: {number: 80}}}",
        "{sctp: {destinationPort: {range: {start: 81, end: 82}}}}",
    );
    let (e_acc_y, e_den_y, e_pas_y) = (
        rule("Accept", "to", &ns("y"), ""),
        rule("Deny", "to", &ns("y"), ""),
        rule("Pass", "to", &ns("y"), ""),
    );
    let (e_den_za, e_pas_za) = (
        rule("Deny", "to", &pod("z", "a"), udp80),
        rule("Pass", "to", &pod("z", "a"), udp80),
    );
    let (e_acc_zb, e_den_zb) = (
        rule("Accept", "to", &pod("z", "b"), sctp81),
        rule("Deny", "to", &pod("z", "b"), ""),
    );
    let egress =
        |order: [&String; 7]| apply(admin_x("egress-rules", "egress", &order.map(String::clone)));

    // CNPAdminTierIntegration: Admin, NetworkPolicy and Baseline around x and y.
    let gress = |name: &str, tier: &str, ingress: &str, egress: &str| {
        cluster_policy(
            name,
            &format!(
                "tier: {tier}\npriority: 10\nsubject: {{namespaces: {{matchLabels: {{ns: x}}}}}}\ningress: [{}]\negress: [{}]",
                rule(ingress, "from", &ns("y"), ""),
                rule(egress, "to", &ns("y"), "")
            ),
        )
    };
    let allow_gress_y = policy(
        "x",
        "allow-gress-y",
        "podSelector: {}\npolicyTypes: [Ingress, Egress]\ningress: [{from: [{namespaceSelector: {matchLabels: {ns: y}}}]}]\negress: [{to: [{namespaceSelector: {matchLabels: {ns: y}}}]}]",
    );

    // CNPAdminTierPriorityField.
    let priority = |name: &str, tier: &str, priority: u16, action: &str| {
        let peer = "{pods: {namespaceSelector: {matchLabels: {ns: y}}, podSelector: {}}}";
        cluster_policy(
            name,
            &format!(
                "tier: {tier}\npriority: {priority}\nsubject: {{pods: {{namespaceSelector: {{matchLabels: {{ns: x}}}}, podSelector: {{}}}}}}\ningress: [{}]\negress: [{}]",
                rule(action, "from", peer, ""),
                rule(action, "to", peer, "")
            ),
        )
    };

    // CNPAdminTierEgressInlineCIDRPeers: networks match pods too.
    let inline_cidr = |first: &str| {
        let mut rules = vec![
            rule(
                "Accept",
                "to",
                "{namespaces: {matchLabels: {house: y}}}",
                "",
            ),
            rule("Deny", "to", "{networks: [0.0.0.0/0, '::/0']}", ""),
        ];
        if !first.is_empty() {
            rules.insert(0, first.to_string());
        }
        let rules: Vec<&str> = rules.iter().map(String::as_str).collect();
        cluster_policy(
            "inline-cidr",
            &format!(
                "tier: Admin\npriority: 85\nsubject: {{pods: {{namespaceSelector: {{matchLabels: {{ns: x}}}}, podSelector: {{}}}}}}\n{}",
                rule_list("egress", &rules)
            ),
        )
    };
    let z_a = host_cidr(&ips["z/a"]);

    // CNP{Admin,Baseline}Tier{Egress,Ingress}NamedPort.
    let named =
        cluster_policy(
            "named-ports",
            &format!(
            "tier: Admin\npriority: 6\nsubject: {{namespaces: {{matchLabels: {{ns: x}}}}}}\n{}{}",
            rule_list(
                "egress",
                &[
                    &rule("Accept", "to", &ns("z"), "{destinationNamedPort: serve-80-udp}"),
                    &rule("Deny", "to", &ns("z"), ""),
                ]
            ),
            rule_list(
                "ingress",
                &[
                    &rule("Accept", "from", &ns("y"), "{destinationNamedPort: serve-81-sctp}"),
                    &rule("Deny", "from", &ns("y"), ""),
                ]
            )
        ),
        );

    // CNPBaselineTier*: a NetworkPolicy that selects the pod overrides the Baseline.
    let baseline = |last: &str| {
        cluster_policy(
            "default",
            &format!(
                "tier: Baseline\npriority: 10\nsubject: {{namespaces: {{matchLabels: {{ns: x}}}}}}\n{}",
                rule_list(
                    "ingress",
                    &[&rule("Accept", "from", &ns("y"), tcp80), &rule(last, "from", &ns("y"), "")]
                )
            ),
        )
    };
    // CNPBaselineTier{EgressInlineCIDRPeers,EgressNamedPort}.
    let baseline_egress =
        cluster_policy(
            "default-egress",
            &format!(
            "tier: Baseline\npriority: 10\nsubject: {{namespaces: {{matchLabels: {{ns: x}}}}}}\n{}",
            rule_list(
                "egress",
                &[
                    &rule("Accept", "to", &ns("z"), "{destinationNamedPort: serve-81-tcp}"),
                    &rule("Deny", "to", "{networks: [0.0.0.0/0, '::/0']}", ""),
                ]
            )
        ),
        );
    let open_x_b_egress = policy(
        "x",
        "open-b-egress",
        "podSelector: {matchLabels: {pod: b}}\npolicyTypes: [Egress]\negress: [{}]",
    );
    let open_x_a = policy(
        "x",
        "open-a",
        "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Ingress]\ningress: [{}]",
    );

    // CNP{Admin,Baseline}TierGress, and the tiers' per-protocol tests ({Ingress,Egress}
    // {TCP,UDP,SCTP}): one policy judging both directions, each port rule listing all three
    // protocols on different ports, so a rule that matched the wrong protocol shows.
    let (out_ports, in_ports) = (
        "{tcp: {destinationPort: {number: 80}}}, {udp: {destinationPort: {number: 81}}}, {sctp: {destinationPort: {number: 80}}}",
        "{tcp: {destinationPort: {number: 81}}}, {udp: {destinationPort: {number: 80}}}, {sctp: {destinationPort: {number: 81}}}",
    );
    let both_ways = |name: &str, tier: &str, egress: &[String], ingress: &[String]| {
        let egress: Vec<&str> = egress.iter().map(String::as_str).collect();
        let ingress: Vec<&str> = ingress.iter().map(String::as_str).collect();
        cluster_policy(
            name,
            &format!(
                "tier: {tier}\npriority: 15\nsubject: {{namespaces: {{matchLabels: {{ns: x}}}}}}\n{}{}",
                rule_list("egress", &egress),
                rule_list("ingress", &ingress)
            ),
        )
    };
    let admin_gress = |y_first: &str, z_first: &str| {
        let y_order = match y_first {
            "Accept" => ["Accept", "Deny", "Pass"],
            _ => ["Deny", "Accept", "Pass"],
        };
        let z_order = match z_first {
            "Deny" => ["Deny", "Pass"],
            _ => ["Pass", "Deny"],
        };
        let side = |dir: &str, ports: &str| {
            let mut rules: Vec<String> =
                y_order.iter().map(|a| rule(a, dir, &ns("y"), "")).collect();
            rules.extend(z_order.iter().map(|a| rule(a, dir, &ns("z"), ports)));
            rules
        };
        apply(both_ways(
            "gress-rules",
            "Admin",
            &side("to", out_ports),
            &side("from", in_ports),
        ))
    };
    let baseline_gress = |y_first: &str| {
        let y_order = match y_first {
            "Accept" => ["Accept", "Deny"],
            _ => ["Deny", "Accept"],
        };
        let mut egress: Vec<String> = y_order
            .iter()
            .map(|a| rule(a, "to", &ns("y"), ""))
            .collect();
        egress.push(rule("Deny", "to", &ns("z"), out_ports));
        let mut ingress: Vec<String> = y_order
            .iter()
            .map(|a| rule(a, "from", &ns("y"), ""))
            .collect();
        ingress.push(rule("Accept", "from", &ns("z"), in_ports));
        // CNPBaselineTierIngressNamedPort.
        ingress.push(rule(
            "Accept",
            "from",
            &ns("z"),
            "{destinationNamedPort: serve-80-tcp}",
        ));
        ingress.push(rule("Deny", "from", &ns("z"), ""));
        apply(both_ways("default-gress", "Baseline", &egress, &ingress))
    };
    let x_a_from_z = policy(
        "x",
        "a-from-z",
        "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Ingress]\ningress: [{from: [{namespaceSelector: {matchLabels: {ns: z}}}]}]",
    );

    vec![
        Scenario {
            name: "cnp admin ingress: rule order and ports",
            steps: vec![
                Step {
                    changes: vec![ingress([
                        &acc_y, &den_y, &pas_y, &den_za, &pas_za, &acc_zb, &den_zb,
                    ])],
                    expect: |p| {
                        p.to_ns != "x"
                            || (!p.from("z", "a") || !p.on(80, "TCP"))
                                && (!p.from("z", "b") || p.on(80, "TCP"))
                    },
                },
                Step {
                    changes: vec![ingress([
                        &den_y, &acc_y, &pas_y, &den_za, &pas_za, &acc_zb, &den_zb,
                    ])],
                    expect: |p| {
                        p.to_ns != "x"
                            || p.from_ns != "y"
                                && (!p.from("z", "a") || !p.on(80, "TCP"))
                                && (!p.from("z", "b") || p.on(80, "TCP"))
                    },
                },
                Step {
                    changes: vec![ingress([
                        &pas_y, &den_y, &acc_y, &pas_za, &den_za, &acc_zb, &den_zb,
                    ])],
                    expect: |p| p.to_ns != "x" || !p.from("z", "b") || p.on(80, "TCP"),
                },
            ],
        },
        Scenario {
            name: "cnp admin egress: rule order and ports",
            steps: vec![
                Step {
                    changes: vec![egress([
                        &e_acc_y, &e_den_y, &e_pas_y, &e_den_za, &e_pas_za, &e_acc_zb, &e_den_zb,
                    ])],
                    expect: |p| {
                        p.from_ns != "x"
                            || (!p.to("z", "a") || !p.on(80, "UDP"))
                                && (!p.to("z", "b") || p.on(81, "SCTP"))
                    },
                },
                Step {
                    changes: vec![egress([
                        &e_den_y, &e_acc_y, &e_pas_y, &e_pas_za, &e_den_za, &e_acc_zb, &e_den_zb,
                    ])],
                    expect: |p| {
                        p.from_ns != "x" || p.to_ns != "y" && (!p.to("z", "b") || p.on(81, "SCTP"))
                    },
                },
            ],
        },
        Scenario {
            name: "cnp admin pass, then the network policy, then the baseline",
            steps: vec![
                Step {
                    changes: vec![
                        apply(gress("pass-example", "Admin", "Deny", "Deny")),
                        apply(allow_gress_y.clone()),
                        apply(gress("default", "Baseline", "Deny", "Deny")),
                    ],
                    expect: |p| p.from_ns != "x" && p.to_ns != "x",
                },
                Step {
                    changes: vec![apply(gress("pass-example", "Admin", "Pass", "Deny"))],
                    expect: |p| p.from_ns != "x" && (p.to_ns != "x" || p.from_ns == "y"),
                },
                Step {
                    changes: vec![apply(gress("pass-example", "Admin", "Pass", "Pass"))],
                    expect: |p| {
                        (p.from_ns != "x" || p.to_ns == "y") && (p.to_ns != "x" || p.from_ns == "y")
                    },
                },
                Step {
                    changes: vec![Change::Delete(allow_gress_y)],
                    expect: |p| !between_x_and_y(p),
                },
            ],
        },
        Scenario {
            name: "cnp priority: the lower number first, and a change re-evaluated",
            steps: vec![
                Step {
                    changes: vec![
                        apply(priority("priority-50", "Admin", 50, "Deny")),
                        apply(priority("priority-60", "Admin", 60, "Pass")),
                        apply(priority("default", "Baseline", 10, "Accept")),
                    ],
                    expect: |p| !between_x_and_y(p),
                },
                Step {
                    changes: vec![apply(priority("priority-60", "Admin", 40, "Pass"))],
                    expect: |_| true,
                },
            ],
        },
        Scenario {
            name: "cnp networks as peers match pods too",
            steps: vec![
                Step {
                    changes: vec![
                        apply(relabelled_namespace("y", "house: y")),
                        apply(inline_cidr("")),
                    ],
                    expect: |p| p.from_ns != "x" || p.to_ns == "y",
                },
                Step {
                    changes: vec![apply(relabelled_namespace("y", "house: other"))],
                    expect: |p| p.from_ns != "x",
                },
                Step {
                    changes: vec![apply(inline_cidr(&rule(
                        "Accept",
                        "to",
                        &format!("{{networks: [{z_a}]}}"),
                        "",
                    )))],
                    expect: |p| p.from_ns != "x" || p.to("z", "a"),
                },
            ],
        },
        Scenario {
            name: "cnp named ports resolve on the destination",
            steps: one(vec![apply(named)], |p| {
                (p.from_ns != "x" || p.to_ns != "z" || p.on(80, "UDP"))
                    && (p.to_ns != "x" || p.from_ns != "y" || p.on(81, "SCTP"))
            }),
        },
        Scenario {
            name: "cnp baseline egress: networks and a named port",
            steps: vec![
                Step {
                    changes: vec![apply(baseline_egress)],
                    expect: |p| p.from_ns != "x" || p.to_ns == "z" && p.on(81, "TCP"),
                },
                Step {
                    changes: vec![apply(open_x_b_egress)],
                    expect: |p| {
                        p.from_ns != "x" || p.from("x", "b") || p.to_ns == "z" && p.on(81, "TCP")
                    },
                },
            ],
        },
        Scenario {
            name: "cnp baseline, and a network policy over it",
            steps: vec![
                Step {
                    changes: vec![apply(baseline("Deny"))],
                    expect: |p| p.to_ns != "x" || p.from_ns != "y" || p.on(80, "TCP"),
                },
                Step {
                    changes: vec![apply(open_x_a)],
                    expect: |p| {
                        p.to_ns != "x" || p.from_ns != "y" || p.on(80, "TCP") || p.to("x", "a")
                    },
                },
                Step {
                    changes: vec![apply(baseline("Pass"))],
                    expect: |_| true,
                },
            ],
        },
        Scenario {
            name: "cnp admin gress: both directions in one policy, every protocol",
            steps: vec![
                Step {
                    changes: vec![admin_gress("Accept", "Deny")],
                    expect: |p| {
                        let out = p.on(80, "TCP") || p.on(81, "UDP") || p.on(80, "SCTP");
                        let inward = p.on(81, "TCP") || p.on(80, "UDP") || p.on(81, "SCTP");
                        (p.from_ns != "x" || p.to_ns != "z" || !out)
                            && (p.to_ns != "x" || p.from_ns != "z" || !inward)
                    },
                },
                Step {
                    changes: vec![admin_gress("Deny", "Pass")],
                    expect: |p| !between_x_and_y(p),
                },
            ],
        },
        Scenario {
            name: "cnp baseline gress: both directions in one policy, every protocol",
            steps: vec![
                Step {
                    changes: vec![baseline_gress("Accept")],
                    expect: |p| {
                        let out = p.on(80, "TCP") || p.on(81, "UDP") || p.on(80, "SCTP");
                        (p.from_ns != "x" || p.to_ns != "z" || !out)
                            && (p.to_ns != "x" || p.from_ns != "z" || !out || p.on(80, "TCP"))
                    },
                },
                Step {
                    changes: vec![baseline_gress("Deny")],
                    expect: |p| {
                        let out = p.on(80, "TCP") || p.on(81, "UDP") || p.on(80, "SCTP");
                        !between_x_and_y(p)
                            && (p.from_ns != "x" || p.to_ns != "z" || !out)
                            && (p.to_ns != "x" || p.from_ns != "z" || !out || p.on(80, "TCP"))
                    },
                },
                Step {
                    changes: vec![apply(x_a_from_z)],
                    expect: |p| {
                        let out = p.on(80, "TCP") || p.on(81, "UDP") || p.on(80, "SCTP");
                        if p.to("x", "a") {
                            return p.from_ns == "z";
                        }
                        !between_x_and_y(p)
                            && (p.from_ns != "x" || p.to_ns != "z" || !out)
                            && (p.to_ns != "x" || p.from_ns != "z" || !out || p.on(80, "TCP"))
                    },
                },
            ],
        },
        Scenario {
            name: "cnp tiers of many rules: every rule in order, whatever indexes them",
            steps: one(vec![apply(many_admin), apply(many_baseline)], |p| {
                let into_x = match (p.port, p.protocol) {
                    (80, "TCP") => p.from_ns == "z",
                    (81, "UDP") => p.from_ns == "y",
                    (80, "UDP") => false,
                    (81, "SCTP") => p.from_ns != "y",
                    _ => true,
                };
                let out_of_y = !(p.to_ns == "x" && p.on(81, "TCP"));
                (p.to_ns != "x" || into_x) && (p.from_ns != "y" || out_of_y)
            }),
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_around_a_pod_as_upstream_makes_them() {
        assert_eq!(host_cidr("10.244.0.3"), "10.244.0.3/32");
        assert_eq!(host_cidr("fd00:10:244::3"), "fd00:10:244::3/128");
        assert_eq!(large_cidr("10.244.0.3"), "0.0.0.0/4");
        assert_eq!(large_cidr("192.168.1.1"), "192.0.0.0/4");
        assert_eq!(large_cidr("fd00:10:244::3"), "f000::/4");
    }

    #[test]
    fn the_probe_set_is_the_labs() {
        let all = probes();
        assert_eq!(all.len(), 9 * 8 * 2 * 3);
        assert!(all.iter().all(|(from, to, _, _)| from != to));
        let complete: Matrix = all
            .iter()
            .map(|(f, t, port, proto)| ((f.clone(), t.clone(), *port, proto.to_string()), true))
            .collect();
        assert!(compare(&complete, |_| true).is_ok());
        let mut short = complete.clone();
        short.pop_first();
        let err = compare(&short, |_| true).unwrap_err();
        assert!(err.contains("not probed"), "{err}");
        let err = compare(&complete, |p| !p.on(81, "SCTP")).unwrap_err();
        assert!(err.starts_with("72 of 432 probes differ"), "{err}");
    }
}
