//! The bench world as Kubernetes manifests for `weir agent --manifests`: two local pods
//! (client and server) on the bench node, N policies that select them, and M remote pods on
//! other nodes, present only as addresses in a distant range. Each document is written as
//! one JSON line (JSON is YAML), so that 100,000 pods stay quick to generate and read.
use std::net::Ipv4Addr;
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::{json, Value};

pub const NODE_NAME: &str = "bench-node";
/// The bench node's InternalIP, and so its pods' hostIP (kube-router takes a pod as its
/// node's own by it); remote nodes' are [`remote_node_ip`].
const NODE_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
pub const NAMESPACE: &str = "bench";
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 2);
pub const SERVER_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 3);
/// Remote pods get consecutive addresses from here (10.128.0.0/10 holds 4 million).
const REMOTE_BASE: Ipv4Addr = Ipv4Addr::new(10, 128, 0, 0);
const REMOTE_NAMESPACES: usize = 10;
pub const REMOTE_NODES: usize = 100;
/// Label groups among remote pods; policy i allows peers of group i % GROUPS.
const GROUPS: usize = 100;

/// Ports the server listens on.
pub const IPERF_PORT: u16 = 5201;
pub const LATENCY_PORT: u16 = 7000;
/// The port whose verdict the convergence changes flip.
pub const TOGGLE_PORT: u16 = 7100;
/// Where an updated toggle policy points instead (nothing listens there).
const MOVED_PORT: u16 = 7101;
/// Ports of the generated policies (nothing listens there either).
const POLICY_PORT_BASE: u16 = 8000;
const REMOTE_PORT: u16 = 9100;

/// The policy that the convergence changes create, update and delete.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Toggle {
    Absent,
    /// Allows the client on TOGGLE_PORT.
    Allow,
    /// Allows the client on another port: TOGGLE_PORT is closed again.
    Moved,
}

pub struct World {
    /// Everything that the changes never touch, one document per line.
    fixed: String,
    pub toggle: Toggle,
    /// The client carries `access: granted`, which the `granted` policy admits on TOGGLE_PORT.
    pub client_granted: bool,
    /// The bench namespace carries `access: granted`, which the `namespace-granted` policy
    /// admits on TOGGLE_PORT (the client is in that namespace).
    pub namespace_granted: bool,
    /// An Admin-tier ClusterNetworkPolicy denies the client TOGGLE_PORT, whatever the
    /// NetworkPolicies allow.
    pub cluster_deny: bool,
}

impl World {
    pub fn new(policies: usize, remote_pods: usize) -> Self {
        let mut docs = vec![json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE_NAME},
            "status": {"addresses": [{"type": "InternalIP", "address": NODE_IP.to_string()}]},
        })];
        for n in 0..REMOTE_NAMESPACES {
            docs.push(namespace(&format!("remote-{n}"), json!({"tier": "remote"})));
        }
        for i in 0..remote_pods {
            docs.push(remote_pod(i));
        }
        docs.push(server_pod());
        for i in 0..policies {
            docs.push(generated_policy(i));
        }
        docs.push(policy(
            "allow-client",
            "server",
            ingress(
                json!({"podSelector": {"matchLabels": {"app": "client"}}}),
                &[IPERF_PORT, LATENCY_PORT],
            ),
        ));
        docs.push(policy(
            "allow-remote",
            "server",
            ingress(
                json!({"namespaceSelector": {"matchLabels": {"tier": "remote"}}}),
                &[REMOTE_PORT],
            ),
        ));
        docs.push(policy(
            "granted",
            "server",
            ingress(
                json!({"podSelector": {"matchLabels": {"access": "granted"}}}),
                &[TOGGLE_PORT],
            ),
        ));
        docs.push(policy(
            "namespace-granted",
            "server",
            ingress(
                json!({"namespaceSelector": {"matchLabels": {"access": "granted"}}}),
                &[TOGGLE_PORT],
            ),
        ));
        docs.push(policy(
            "client-egress",
            "client",
            json!({"policyTypes": ["Egress"], "egress": [{"to": [{"podSelector": {"matchLabels": {"app": "server"}}}]}]}),
        ));
        let mut fixed = String::new();
        for d in docs {
            fixed.push_str("---\n");
            fixed.push_str(&d.to_string());
            fixed.push('\n');
        }
        World {
            fixed,
            toggle: Toggle::Absent,
            client_granted: false,
            namespace_granted: false,
            cluster_deny: false,
        }
    }

    /// Adds the Node objects of the remote pods' nodes (each carries P / 100 of them): the
    /// cluster bench runs its agents as those nodes.
    pub fn with_remote_nodes(mut self) -> Self {
        for n in 0..REMOTE_NODES {
            let node = json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": remote_node_name(n)},
                "status": {"addresses": [{"type": "InternalIP", "address": remote_node_ip(n).to_string()}]},
            });
            self.fixed.push_str("---\n");
            self.fixed.push_str(&node.to_string());
            self.fixed.push('\n');
        }
        self
    }

    /// Adds `count` ClusterNetworkPolicies (see [`cluster_policy`]).
    pub fn with_cluster_policies(mut self, count: usize) -> Self {
        for i in 0..count {
            self.fixed.push_str("---\n");
            self.fixed.push_str(&cluster_policy(i).to_string());
            self.fixed.push('\n');
        }
        self
    }

    /// Whether the client may connect to the server's TOGGLE_PORT in this state.
    pub fn toggle_open(&self) -> bool {
        !self.cluster_deny
            && (self.toggle == Toggle::Allow || self.client_granted || self.namespace_granted)
    }

    pub fn manifest(&self, generation: u64) -> String {
        let mut labels = json!({"app": "client"});
        if self.client_granted {
            labels["access"] = json!("granted");
        }
        let mut text = format!("# generation: {generation}\n{}", self.fixed);
        let namespace_labels = match self.namespace_granted {
            true => json!({"access": "granted"}),
            false => json!({}),
        };
        text.push_str(&format!(
            "---\n{}\n",
            namespace(NAMESPACE, namespace_labels)
        ));
        text.push_str(&format!(
            "---\n{}\n",
            local_pod("client", CLIENT_IP, labels, &[])
        ));
        let toggle_port = match self.toggle {
            Toggle::Absent => None,
            Toggle::Allow => Some(TOGGLE_PORT),
            Toggle::Moved => Some(MOVED_PORT),
        };
        if let Some(port) = toggle_port {
            let from_client = json!({"podSelector": {"matchLabels": {"app": "client"}}});
            text.push_str(&format!(
                "---\n{}\n",
                policy("toggle", "server", ingress(from_client, &[port]))
            ));
        }
        if self.cluster_deny {
            text.push_str(&format!("---\n{}\n", toggle_guard()));
        }
        text
    }

    /// Replaces `path` atomically (the agent must never read half a file).
    pub fn write(&self, path: &Path, generation: u64) -> Result<()> {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, self.manifest(generation))
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
    }
}

fn namespace(name: &str, mut labels: Value) -> Value {
    labels["kubernetes.io/metadata.name"] = json!(name);
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
}

/// The name of remote node `n`.
pub fn remote_node_name(n: usize) -> String {
    format!("remote-node-{n}")
}

/// The address of remote node `n` (no packet goes there).
fn remote_node_ip(n: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 255, 0, n as u8)
}

fn pod(
    namespace: &str,
    name: &str,
    (node, host_ip): (&str, Ipv4Addr),
    ip: Ipv4Addr,
    labels: Value,
    ports: &[u16],
) -> Value {
    let ports: Vec<Value> = ports
        .iter()
        .map(|p| json!({"containerPort": p, "protocol": "TCP"}))
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "bench", "ports": ports}]},
        "status": {
            "phase": "Running", "hostIP": host_ip.to_string(),
            "podIP": ip.to_string(), "podIPs": [{"ip": ip.to_string()}],
        },
    })
}

fn local_pod(name: &str, ip: Ipv4Addr, labels: Value, ports: &[u16]) -> Value {
    pod(NAMESPACE, name, (NODE_NAME, NODE_IP), ip, labels, ports)
}

fn server_pod() -> Value {
    local_pod(
        "server",
        SERVER_IP,
        json!({"app": "server"}),
        &[IPERF_PORT, LATENCY_PORT, TOGGLE_PORT],
    )
}

fn remote_pod(i: usize) -> Value {
    let ip = Ipv4Addr::from(u32::from(REMOTE_BASE) + i as u32);
    pod(
        &format!("remote-{}", i % REMOTE_NAMESPACES),
        &format!("r{i}"),
        (
            &remote_node_name(i % REMOTE_NODES),
            remote_node_ip(i % REMOTE_NODES),
        ),
        ip,
        json!({"group": format!("g{}", i % GROUPS)}),
        &[],
    )
}

/// Policy i selects the server (ingress, even i) or the client (egress, odd i) and allows
/// remote pods of one group on a port nothing uses, so it costs without changing verdicts.
fn generated_policy(i: usize) -> Value {
    let peer = json!({
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"group": format!("g{}", i % GROUPS)}},
    });
    let port = POLICY_PORT_BASE + (i % 1000) as u16;
    let name = format!("p{i:05}");
    if i.is_multiple_of(2) {
        policy(&name, "server", ingress(peer, &[port]))
    } else {
        let ports = json!([{"protocol": "TCP", "port": port}]);
        policy(
            &name,
            "client",
            json!({"policyTypes": ["Egress"], "egress": [{"to": [peer], "ports": ports}]}),
        )
    }
}

/// ClusterNetworkPolicy i: Admin (even i) or Baseline, for the server's ingress (i % 4
/// < 2) or the client's egress, with a Deny of one remote group and a Pass of the remote
/// namespaces, each on a port nothing uses: it costs without changing a verdict.
/// The Admin-tier Deny that the cluster policy changes create and delete: the client may
/// not reach the server's TOGGLE_PORT.
fn toggle_guard() -> Value {
    let pod = |app: &str| json!({"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": app}}}});
    json!({
        "apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy",
        "metadata": {"name": "toggle-guard"},
        "spec": {
            "tier": "Admin",
            "priority": 0,
            "subject": pod("server"),
            "ingress": [{"name": "no-client", "action": "Deny", "from": [pod("client")],
                "protocols": [{"tcp": {"destinationPort": {"number": TOGGLE_PORT}}}]}],
        },
    })
}

fn cluster_policy(i: usize) -> Value {
    let port = POLICY_PORT_BASE + (i % 1000) as u16;
    let group = json!({"pods": {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"group": format!("g{}", i % GROUPS)}},
    }});
    let remote = json!({"namespaces": {"matchLabels": {"tier": "remote"}}});
    let tcp = |port: u16| json!([{"tcp": {"destinationPort": {"number": port}}}]);
    let (app, direction, peers) = match i % 4 < 2 {
        true => ("server", "ingress", "from"),
        false => ("client", "egress", "to"),
    };
    json!({
        "apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy",
        "metadata": {"name": format!("c{i:05}")},
        "spec": {
            "tier": if i.is_multiple_of(2) { "Admin" } else { "Baseline" },
            "priority": i % 1001,
            "subject": {"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": app}}}},
            direction: [
                {"name": "deny-group", "action": "Deny", peers: [group], "protocols": tcp(port)},
                {"name": "pass-remote", "action": "Pass", peers: [remote], "protocols": tcp(port + 1)},
            ],
        },
    })
}

fn ingress(peer: Value, ports: &[u16]) -> Value {
    let ports: Vec<Value> = ports
        .iter()
        .map(|p| json!({"protocol": "TCP", "port": p}))
        .collect();
    json!({"policyTypes": ["Ingress"], "ingress": [{"from": [peer], "ports": ports}]})
}

/// A policy in the bench namespace selecting pods with `app: <app>`.
fn policy(name: &str, app: &str, mut spec: Value) -> Value {
    spec["podSelector"] = json!({"matchLabels": {"app": app}});
    json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn docs(text: &str) -> Vec<Value> {
        text.split("---\n")
            .skip(1)
            .map(|d| serde_json::from_str(d).expect("each document is one JSON object"))
            .collect()
    }

    #[test]
    fn manifest_holds_the_world_and_its_generation() {
        let world = World::new(4, 30);
        let text = world.manifest(7);
        assert!(text.starts_with("# generation: 7\n"));
        let docs = docs(&text);
        let kind = |k: &str| docs.iter().filter(|d| d["kind"] == k).count();
        assert_eq!(kind("Namespace"), 1 + REMOTE_NAMESPACES);
        assert_eq!(kind("Pod"), 30 + 2);
        assert_eq!(kind("NetworkPolicy"), 4 + 5);
        let remote: Vec<&Value> = docs
            .iter()
            .filter(|d| d["kind"] == "Pod" && d["spec"]["nodeName"] != NODE_NAME)
            .collect();
        assert_eq!(remote.len(), 30);
        let ips: std::collections::BTreeSet<&str> = remote
            .iter()
            .map(|p| p["status"]["podIP"].as_str().unwrap())
            .collect();
        assert_eq!(ips.len(), 30, "remote pod addresses are distinct");
    }

    #[test]
    fn cluster_policies_are_added_to_the_world() {
        let text = World::new(2, 3).with_cluster_policies(5).manifest(1);
        let docs = docs(&text);
        let cnps: Vec<&Value> = docs
            .iter()
            .filter(|d| d["kind"] == "ClusterNetworkPolicy")
            .collect();
        assert_eq!(cnps.len(), 5);
        assert_eq!(cnps[0]["spec"]["tier"], "Admin");
        assert_eq!(cnps[1]["spec"]["tier"], "Baseline");
        assert_eq!(cnps[2]["spec"]["egress"][0]["action"], "Deny");
    }

    #[test]
    fn changes_flip_the_toggle_port() {
        let mut world = World::new(2, 3);
        let toggle_doc = |w: &World| {
            docs(&w.manifest(1))
                .into_iter()
                .find(|d| d["metadata"]["name"] == "toggle")
        };
        assert!(!world.toggle_open());
        assert!(toggle_doc(&world).is_none());
        world.toggle = Toggle::Allow;
        assert!(world.toggle_open());
        let port = &toggle_doc(&world).unwrap()["spec"]["ingress"][0]["ports"][0]["port"];
        assert_eq!(port, TOGGLE_PORT);
        world.toggle = Toggle::Moved;
        assert!(!world.toggle_open());
        let port = &toggle_doc(&world).unwrap()["spec"]["ingress"][0]["ports"][0]["port"];
        assert_eq!(port, MOVED_PORT);
        world.toggle = Toggle::Absent;
        world.client_granted = true;
        assert!(world.toggle_open());
        let client = docs(&world.manifest(2))
            .into_iter()
            .find(|d| d["metadata"]["name"] == "client")
            .unwrap();
        assert_eq!(client["metadata"]["labels"]["access"], "granted");
        world.client_granted = false;
        world.namespace_granted = true;
        assert!(world.toggle_open());
        let bench = docs(&world.manifest(3))
            .into_iter()
            .find(|d| d["kind"] == "Namespace" && d["metadata"]["name"] == NAMESPACE)
            .unwrap();
        assert_eq!(bench["metadata"]["labels"]["access"], "granted");
        // An Admin Deny closes the port whatever the NetworkPolicies allow.
        world.cluster_deny = true;
        assert!(!world.toggle_open());
        let guard = docs(&world.manifest(4))
            .into_iter()
            .find(|d| d["metadata"]["name"] == "toggle-guard")
            .unwrap();
        assert_eq!(guard["spec"]["ingress"][0]["action"], "Deny");
        assert_eq!(
            guard["spec"]["ingress"][0]["protocols"][0]["tcp"]["destinationPort"]["number"],
            TOGGLE_PORT
        );
    }
}
