//! The ways to a pod that kube-proxy opens besides a plain ClusterIP, played as a pod that
//! wants past a policy, through the real kube-proxy (iptables mode) on both dataplanes:
//!
//! - **NodePort from a pod** (the node's address and a nodePort): kube-proxy DNATs it and
//!   masquerades it, so the backend sees the node's address. A pod the backend's ingress
//!   denies must stay denied (before the fix: eBPF judged the node's address, always
//!   allowed; iptables let kube-proxy's `KUBE-FORWARD` ACCEPT the masqueraded packet ahead
//!   of weir's chain), and a pod whose egress does not allow the backend must stay denied.
//! - **A backend on another host**: the packet leaves the node through an uplink after
//!   DNAT, past no pod's hook; the client's egress must still be judged on the backend
//!   (before the fix: eBPF let an egress-isolated pod reach anything behind a Service whose
//!   backends are off the node), also through an uplink that appeared after the agent's
//!   last converge.
//!
//! - **NodePort from off the node**: kube-proxy masquerades it to the node's address, so
//!   eBPF's hook sees the node; a host the backend's ingress does not admit must stay
//!   denied (before the fix: eBPF judged the node's address, always allowed; iptables'
//!   FORWARD judges the real client before SNAT).
//!
//! Controls show kube-proxy forwards each path for a pod no policy restricts.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::time::Duration;

use weir_tests::lab::{manifest, Lab};
use weir_tests::netns::NetNs;
use weir_tests::pods::off_node_host;
use weir_tests::probe::EchoServers;

/// The address the lab gives its Node (pods' gateway, on the node's loopback).
const NODE_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
const WEB_NODE_PORT: u16 = 30080;
const DB_NODE_PORT: u16 = 30432;
const REMOTE_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 7, 7);
/// The remote host behind the uplink, and the node's side of it.
const REMOTE_IP: &str = "10.245.0.2";
const UPLINK_IP: &str = "10.245.0.1";
const REMOTE_PORT: u16 = 8443;

/// web admits only `app: allowed`; client may reach only db:5432; free has no policy.
const WORLD: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop, labels: {app: web}}
spec: {containers: [{name: web, ports: [{containerPort: 80}]}]}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  type: NodePort
  selector: {app: web}
  ports: [{port: 8080, targetPort: 80, nodePort: 30080}]
---
apiVersion: v1
kind: Pod
metadata: {name: db, namespace: shop, labels: {app: db}}
spec: {containers: [{name: db, ports: [{containerPort: 5432}]}]}
---
apiVersion: v1
kind: Service
metadata: {name: db, namespace: shop}
spec:
  type: NodePort
  selector: {app: db}
  ports: [{port: 5432, targetPort: 5432, nodePort: 30432}]
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: shop, labels: {app: client}}
spec: {containers: [{name: c}]}
---
apiVersion: v1
kind: Pod
metadata: {name: free, namespace: shop, labels: {app: free}}
spec: {containers: [{name: c}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: web-from-allowed, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Ingress]
  ingress: [{from: [{podSelector: {matchLabels: {app: allowed}}}]}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: client-to-db, namespace: shop}
spec:
  podSelector: {matchLabels: {app: client}}
  policyTypes: [Egress]
  egress: [{to: [{podSelector: {matchLabels: {app: db}}}], ports: [{port: 5432}]}]
"#;

/// A Service without a selector whose one endpoint is the remote host.
fn remote_service() -> String {
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: remote, namespace: shop}}
spec:
  clusterIP: {REMOTE_CLUSTER_IP}
  ports: [{{name: https, port: 443, targetPort: {REMOTE_PORT}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: remote-1
  namespace: shop
  labels: {{kubernetes.io/service-name: remote}}
addressType: IPv4
endpoints: [{{addresses: ["{REMOTE_IP}"], conditions: {{ready: true}}}}]
ports: [{{name: https, port: {REMOTE_PORT}, protocol: TCP}}]
"#
    )
}

/// Whether a TCP connection from pod netns `ns` to `to` is accepted (a denied SYN is
/// dropped: the connect times out).
fn connects(ns: &str, to: SocketAddrV4) -> bool {
    let ns = ns.to_string();
    weir_tests::pods::run_in(&ns, move || {
        TcpStream::connect_timeout(&SocketAddr::V4(to), Duration::from_millis(1500)).is_ok()
    })
}

fn service_paths(dataplane: &str) {
    let lab = Lab::new(&format!("svcpath-{dataplane}"));
    let world = manifest(&lab, "world.yaml", WORLD);
    lab.weir(&[
        "up",
        "--dataplane",
        dataplane,
        "--proxy",
        "iptables",
        world.to_str().unwrap(),
    ])
    .unwrap_or_else(|e| panic!("{dataplane}: lab up: {e}"));
    let node = lab.node_netns();
    let (client, _) = lab.pod("shop/client");
    let (free, _) = lab.pod("shop/free");

    // The Service goes to the API server with `weir-lab apply`; its EndpointSlice (no
    // selector: the lab manages none) with kubectl, as an operator would.
    let service = manifest(&lab, "remote.yaml", &remote_service());
    NetNs::attach(&node)
        .ok(
            "kubectl",
            &[
                "--kubeconfig",
                lab.dir.join("api/kubeconfig-admin").to_str().unwrap(),
                "apply",
                "-f",
                service.to_str().unwrap(),
            ],
            None,
        )
        .expect("kubectl apply the remote Service and its EndpointSlice");
    // A host off the node, behind an uplink that appears after the agent converged: the
    // link watch must cover it at once (the next resync is a minute away).
    let uplink = format!("up{}", std::process::id() % 100_000);
    let remote = off_node_host(
        &node,
        "svc-remote",
        &uplink,
        &format!("{UPLINK_IP}/24"),
        &format!("{REMOTE_IP}/24"),
    );
    let _listener = EchoServers::start(&remote.name, &[REMOTE_PORT]);
    // kube-proxy and the agent take the Service in; wait until the control path works.
    let remote_front = SocketAddrV4::new(REMOTE_CLUSTER_IP, 443);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !connects(&free, remote_front) {
        assert!(
            std::time::Instant::now() < deadline,
            "{dataplane}: kube-proxy never forwarded {remote_front} to the remote host"
        );
        std::thread::sleep(Duration::from_millis(300));
    }

    let web_node_port = SocketAddrV4::new(NODE_IP, WEB_NODE_PORT);
    let db_node_port = SocketAddrV4::new(NODE_IP, DB_NODE_PORT);
    let cases = [
        // (what, from, to, expected)
        (
            "a pod web's ingress denies, through web's NodePort (masqueraded)",
            &free,
            web_node_port,
            false,
        ),
        (
            "a pod whose egress allows only db, through web's NodePort",
            &client,
            web_node_port,
            false,
        ),
        (
            "a pod whose egress allows db, through db's NodePort",
            &client,
            db_node_port,
            true,
        ),
        (
            "control: no policy, db's NodePort",
            &free,
            db_node_port,
            true,
        ),
        (
            "a pod whose egress allows only db, to a Service whose backend is off the node",
            &client,
            remote_front,
            false,
        ),
        (
            "control: no policy, the Service whose backend is off the node",
            &free,
            remote_front,
            true,
        ),
        (
            "a host off the node web's ingress denies, through web's NodePort (masqueraded)",
            &remote.name,
            SocketAddrV4::new(UPLINK_IP.parse().unwrap(), WEB_NODE_PORT),
            false,
        ),
        (
            "control: a host off the node, through db's NodePort (db has no policy)",
            &remote.name,
            SocketAddrV4::new(UPLINK_IP.parse().unwrap(), DB_NODE_PORT),
            true,
        ),
    ];
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|(what, from, to, want)| {
            let got = connects(from, *to);
            (got != *want).then(|| {
                format!(
                    "{what} ({to}): expected {}, got {}",
                    if *want { "connected" } else { "blocked" },
                    if got { "connected" } else { "blocked" }
                )
            })
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{dataplane}, kube-proxy iptables: {} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn nodeports_and_remote_backends_pass_no_policy_on_ebpf() {
    service_paths("ebpf");
}

#[test]
fn nodeports_and_remote_backends_pass_no_policy_on_iptables() {
    service_paths("iptables");
}
