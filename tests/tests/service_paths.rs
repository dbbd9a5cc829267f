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
//! - **A backend on the node itself** (host network): kube-proxy DNATs the packet to one
//!   of the node's addresses and it is delivered locally, past every pod's hook. A
//!   ClusterNetworkPolicy Admin Deny to the node must hold through the Service (before
//!   the fix: eBPF connected), and a `nodes` peer must cover the node's addresses that its
//!   Node's status does not list, such as an uplink's (before the fix: both connected).
//!
//! Controls show kube-proxy forwards each path for a pod no policy restricts.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::time::Duration;

use weir_tests::lab::{experimental_cluster_policy_crd, manifest, Lab};
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
/// A Service whose one endpoint is the node's uplink address, where a host-network
/// listener waits.
const NODE_LOCAL_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 7, 8);
const NODE_LOCAL_PORT: u16 = 8081;

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
apiVersion: v1
kind: Pod
metadata: {name: guarded, namespace: shop, labels: {app: guarded}}
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

/// guarded may not reach any node on 8081: a `nodes` peer (the experimental channel's).
const GUARDED_OFF_NODES: &str = r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: guarded-keeps-off-nodes}
spec:
  tier: Admin
  priority: 1
  subject: {pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: guarded}}}}
  egress:
  - {action: Deny, to: [{nodes: {}}], protocols: [{tcp: {destinationPort: {number: 8081}}}]}
"#;

/// A Service without a selector whose one endpoint is the node's uplink address (a
/// host-network backend; EndpointSlices refuse link-local addresses such as the Node's).
fn node_local_service() -> String {
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: node-local, namespace: shop}}
spec:
  clusterIP: {NODE_LOCAL_CLUSTER_IP}
  ports: [{{name: http, port: 80, targetPort: {NODE_LOCAL_PORT}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: node-local-1
  namespace: shop
  labels: {{kubernetes.io/service-name: node-local}}
addressType: IPv4
endpoints: [{{addresses: ["{UPLINK_IP}"], conditions: {{ready: true}}}}]
ports: [{{name: http, port: {NODE_LOCAL_PORT}, protocol: TCP}}]
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
        // `nodes` peers are the experimental channel's.
        "--cluster-policy-crd",
        experimental_cluster_policy_crd().to_str().unwrap(),
        world.to_str().unwrap(),
    ])
    .unwrap_or_else(|e| panic!("{dataplane}: lab up: {e}"));
    let node = lab.node_netns();
    let (client, _) = lab.pod("shop/client");
    let (free, _) = lab.pod("shop/free");
    let (guarded, _) = lab.pod("shop/guarded");

    // Services and their EndpointSlices (no selector: the lab manages none) go to the API
    // server with kubectl, as an operator would.
    let kubectl_apply = |name: &str, text: &str| {
        let file = manifest(&lab, name, text);
        NetNs::attach(&node)
            .ok(
                "kubectl",
                &[
                    "--kubeconfig",
                    lab.dir.join("api/kubeconfig-admin").to_str().unwrap(),
                    "apply",
                    "-f",
                    file.to_str().unwrap(),
                ],
                None,
            )
            .unwrap_or_else(|e| panic!("kubectl apply {name}: {e}"));
    };
    kubectl_apply("remote.yaml", &remote_service());
    let cnp = manifest(&lab, "guarded.yaml", GUARDED_OFF_NODES);
    lab.weir(&["apply", cnp.to_str().unwrap()])
        .unwrap_or_else(|e| panic!("{dataplane}: apply the ClusterNetworkPolicy: {e}"));
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
    // The host-network backend, behind the uplink's address, which the Node's status does
    // not list: the agent reads it from the node's interfaces at its next batch (this
    // Service's) or resync.
    let _node_listener = EchoServers::start(&node, &[NODE_LOCAL_PORT]);
    kubectl_apply("node-local.yaml", &node_local_service());
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
    let node_local_front = SocketAddrV4::new(NODE_LOCAL_CLUSTER_IP, 80);
    let uplink = SocketAddrV4::new(UPLINK_IP.parse().unwrap(), NODE_LOCAL_PORT);
    while !connects(&free, node_local_front) {
        assert!(
            std::time::Instant::now() < deadline,
            "{dataplane}: kube-proxy never forwarded {node_local_front} to the node"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    // kube-proxy is ready; the agent takes the Service's batch in on its own time.
    while connects(&guarded, uplink) && std::time::Instant::now() < deadline {
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
        (
            "a pod an Admin Deny keeps off the node, to the Node's status address",
            &guarded,
            SocketAddrV4::new(NODE_IP, NODE_LOCAL_PORT),
            false,
        ),
        (
            "a pod an Admin Deny keeps off the node, to the node's uplink address",
            &guarded,
            uplink,
            false,
        ),
        (
            "a pod an Admin Deny keeps off the node, through a Service whose backend is the node",
            &guarded,
            node_local_front,
            false,
        ),
        (
            "control: no policy, the node's uplink address",
            &free,
            uplink,
            true,
        ),
        (
            "control: no policy, the Service whose backend is the node",
            &free,
            node_local_front,
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
