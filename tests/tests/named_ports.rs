//! Named ports that differ per pod, with real packets on both dataplanes: two servers call
//! different numbers `web` (srv-1 serves it on 80, srv-2 on 81, each also serves the other
//! number under another name), so a rule on port `web` must open 80 on one and 81 on the
//! other, in ingress (resolved on the selected pod) and in egress (resolved on each
//! destination pod). Every test pod in the netpol world declares the same names, so the
//! conformance table cannot show this.

use netpol_scenarios::Matrix;
use weir_tests::lab::{manifest, Lab};

const WORLD: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: np, labels: {ns: np}}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: np, labels: {app: client}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 9000, protocol: TCP, name: unused}]
---
apiVersion: v1
kind: Pod
metadata: {name: srv-1, namespace: np, labels: {app: srv}}
spec:
  containers:
  - name: c
    ports:
    - {containerPort: 80, protocol: TCP, name: web}
    - {containerPort: 81, protocol: TCP, name: admin}
---
apiVersion: v1
kind: Pod
metadata: {name: srv-2, namespace: np, labels: {app: srv}}
spec:
  containers:
  - name: c
    ports:
    - {containerPort: 81, protocol: TCP, name: web}
    - {containerPort: 80, protocol: TCP, name: admin}
"#;

/// The servers admit only their own `web`.
const INGRESS_WEB: &str = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: srv-web-only, namespace: np}
spec:
  podSelector: {matchLabels: {app: srv}}
  policyTypes: [Ingress]
  ingress:
  - ports: [{port: web}]
"#;

/// The client sends only to each destination's `web`.
const EGRESS_WEB: &str = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: client-to-web-only, namespace: np}
spec:
  podSelector: {matchLabels: {app: client}}
  policyTypes: [Egress]
  egress:
  - ports: [{port: web}]
"#;

/// Whether `to`'s port is its `web`.
fn is_web(to: &str, port: u16) -> bool {
    matches!((to, port), ("np/srv-1", 80) | ("np/srv-2", 81))
}

/// Every probe of the matrix against `expect(from, to, port)`; the differences.
fn differences(matrix: &Matrix, expect: impl Fn(&str, &str, u16) -> bool) -> Vec<String> {
    matrix
        .iter()
        .filter(|((from, to, port, _), connected)| expect(from, to, *port) != **connected)
        .map(|((from, to, port, proto), connected)| {
            format!("{from} -> {to} {port}/{proto}: got connected={connected}")
        })
        .collect()
}

fn named_ports_resolve_per_pod_on(dataplane: &str) {
    let lab = Lab::new(&format!("named-{dataplane}"));
    let world = manifest(&lab, "world.yaml", WORLD);
    lab.weir(&["up", "--dataplane", dataplane, world.to_str().unwrap()])
        .unwrap_or_else(|e| panic!("{dataplane}: lab up: {e}"));
    let mut failures = Vec::new();
    let mut probe = |when: &str, expect: &dyn Fn(&str, &str, u16) -> bool| {
        for family in ["ipv4", "ipv6"] {
            let (named, matrix) = lab
                .probe(&["--family", family])
                .unwrap_or_else(|e| panic!("{dataplane} {when}: probe: {e}"));
            assert_eq!(named, dataplane, "the agent enforces another dataplane");
            // Both servers on both numbers, from each of the other two pods.
            let to_servers = matrix.keys().filter(|k| k.1.starts_with("np/srv")).count();
            assert_eq!(
                to_servers, 8,
                "{dataplane} {when} {family}: probes to servers"
            );
            failures.extend(
                differences(&matrix, expect)
                    .into_iter()
                    .map(|d| format!("{when} ({family}): {d}")),
            );
        }
    };

    let ingress = manifest(&lab, "ingress.yaml", INGRESS_WEB);
    lab.weir(&["apply", ingress.to_str().unwrap()]).unwrap();
    probe("ingress on port web", &|_, to, port| {
        !to.starts_with("np/srv") || is_web(to, port)
    });
    lab.weir(&["delete", ingress.to_str().unwrap()]).unwrap();

    let egress = manifest(&lab, "egress.yaml", EGRESS_WEB);
    lab.weir(&["apply", egress.to_str().unwrap()]).unwrap();
    probe("egress to port web", &|from, to, port| {
        from != "np/client" || is_web(to, port)
    });

    assert!(
        failures.is_empty(),
        "{dataplane}: {} probes wrong:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn named_ports_resolve_per_pod_on_ebpf() {
    named_ports_resolve_per_pod_on("ebpf");
}

#[test]
fn named_ports_resolve_per_pod_on_iptables() {
    named_ports_resolve_per_pod_on("iptables");
}
