//! `weir agent --dataplane none` (benchmarks run many agents on one machine with it) touches
//! no kernel state: on a node namespace holding what a start would otherwise remove (Azure
//! NPM's chain and set, a weir set) and a pod interface, the agent watches, compiles,
//! converges and reports twice, and afterwards every rule of the four iptables
//! backend/family pairs, every set, the interface's qdiscs and filters are as before, and
//! its pin root on bpffs was never made. The same run with `--dataplane iptables` changes
//! that snapshot, so the comparison is not blind.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::Value;
use weir_tests::kernel_state::all_rules;
use weir_tests::netns::NetNs;
use weir_tests::{weir_bin, PinRoot};

const POD_IF: &str = "lxcnone0";

fn world(generation: u64, allow: bool) -> String {
    let from = if allow { "a" } else { "nobody" };
    format!(
        r#"# generation: {generation}
apiVersion: v1
kind: Node
metadata: {{name: n1}}
---
apiVersion: v1
kind: Pod
metadata: {{name: a, namespace: default, labels: {{app: a}}}}
spec: {{nodeName: n1, containers: [{{name: c, image: i}}]}}
status: {{podIP: 10.79.0.1, podIPs: [{{ip: 10.79.0.1}}]}}
---
apiVersion: v1
kind: Pod
metadata: {{name: b, namespace: default, labels: {{app: b}}}}
spec: {{nodeName: n1, containers: [{{name: c, image: i}}]}}
status: {{podIP: 10.79.0.2, podIPs: [{{ip: 10.79.0.2}}]}}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {{name: b-from-a, namespace: default}}
spec:
  podSelector: {{matchLabels: {{app: b}}}}
  ingress: [{{from: [{{podSelector: {{matchLabels: {{app: {from}}}}}}}]}}]
"#
    )
}

/// What the node's kernel holds that either dataplane (or a start's cleanup) would touch.
fn snapshot(ns: &NetNs, pins: &Path) -> String {
    let mut text = all_rules(ns).expect("iptables-save of all four backends");
    // Counters move with any packet; the rules are what matters.
    text = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split(" [").next().unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    text.push_str(&ns.ok("ipset", &["save"], None).expect("ipset save"));
    text.push_str(&ns.ok("tc", &["qdisc", "show"], None).expect("tc qdisc"));
    for dir in ["ingress", "egress"] {
        text.push_str(
            &ns.ok("tc", &["filter", "show", "dev", POD_IF, dir], None)
                .expect("tc filter"),
        );
    }
    text.push_str(&format!("pin root exists: {}\n", pins.exists()));
    text
}

struct Agent {
    child: Child,
    log: PathBuf,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Agent {
    /// Waits until the status file reports `generation` converged; returns the status.
    fn wait(&mut self, status: &Path, generation: u64) -> Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let s: Option<Value> = std::fs::read_to_string(status)
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok());
            if let Some(s) =
                s.filter(|s| s["converged"] == true && s["generation"].as_u64() >= Some(generation))
            {
                return s;
            }
            if let Ok(Some(exit)) = self.child.try_wait() {
                panic!(
                    "the agent exited ({exit}):\n{}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "generation {generation} not converged in 60 s:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Runs the agent on `dataplane` through two generations of the world; returns the
/// status it reported last.
fn run_agent(ns: &NetNs, dir: &Path, pins: &Path, dataplane: &str) -> Value {
    let manifests = dir.join(format!("{dataplane}.yaml"));
    let status = dir.join(format!("{dataplane}-status.json"));
    let log = dir.join(format!("{dataplane}.log"));
    std::fs::write(&manifests, world(1, false)).unwrap();
    let mut cmd = Command::new(weir_bin::path().expect("weir binary"));
    cmd.arg("agent")
        .args(["--dataplane", dataplane, "--poll-ms", "20"])
        .arg("--manifests")
        .arg(&manifests)
        .arg("--status-file")
        .arg(&status)
        .arg("--bpf-root")
        .arg(pins)
        .args(["--node-name", "n1", "--pod-interface-prefixes", "lxc"])
        .args(["--verdict-log", "off"])
        .env_remove("NODE_NAME");
    let child =
        weir_lab::netns::spawn_detached(&ns.name, &mut cmd, &log, weir_lab::netns::Stdout::Log)
            .expect("start weir agent");
    let mut agent = Agent { child, log };
    agent.wait(&status, 1);
    // Rewritten atomically, so the poll never sees half a file.
    let next = dir.join("next.yaml");
    std::fs::write(&next, world(2, true)).unwrap();
    std::fs::rename(&next, &manifests).unwrap();
    agent.wait(&status, 2)
}

#[test]
fn the_none_dataplane_leaves_the_kernel_as_it_found_it() {
    weir_tests::require_root_and_tools();
    let ns = NetNs::new("dpnone").expect("node namespace");
    let dir = std::env::temp_dir().join(format!("weir-dpnone-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pins = PinRoot::new("dpnone");
    // What a start removes (Azure NPM's) or a dataplane writes over (weir's own).
    ns.sh(&format!(
        "ip link add {POD_IF} type veth peer name podnone0 && ip link set {POD_IF} up && \
         tc qdisc add dev {POD_IF} clsact && \
         iptables-nft -N AZURE-NPM && iptables-nft -A FORWARD -j AZURE-NPM && \
         ipset create azure-npm-1 hash:ip && ipset create weir-leftover hash:ip"
    ))
    .expect("seeding the node");
    let before = snapshot(&ns, &pins.0);

    let status = run_agent(&ns, &dir, &pins.0, "none");
    assert_eq!(status["dataplane"], "none", "{status}");
    assert_eq!(status["errors"], Value::Array(Vec::new()), "{status}");
    assert_eq!(
        snapshot(&ns, &pins.0),
        before,
        "--dataplane none changed the kernel"
    );

    // The control: an enforcing dataplane changes exactly what the snapshot reads.
    let status = run_agent(&ns, &dir, &pins.0, "iptables");
    assert_eq!(status["dataplane"], "iptables", "{status}");
    assert_ne!(
        snapshot(&ns, &pins.0),
        before,
        "the snapshot does not see an enforcing dataplane's writes"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
