//! The live dataplane switch, end to end: a lab world under continuous probing while the
//! Node's `weir.io/dataplane` label flips ebpf → iptables → ebpf → iptables → ebpf.
//! A denied flow never connects; the allowed flow's longest outage is measured, printed
//! and bounded; after each switch nothing of the old dataplane is left.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;
use weir_tests::lab::{manifest, Lab};

const WORLD: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: s}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: s, labels: {app: server}}
spec:
  containers:
  - name: c
    image: i
    ports: [{containerPort: 80, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: s, labels: {app: client}}
spec: {containers: [{name: c, image: i}]}
---
apiVersion: v1
kind: Pod
metadata: {name: intruder, namespace: s, labels: {app: intruder}}
spec: {containers: [{name: c, image: i}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: server-from-client, namespace: s}
spec:
  podSelector: {matchLabels: {app: server}}
  policyTypes: [Ingress]
  ingress:
  - from: [{podSelector: {matchLabels: {app: client}}}]
    ports: [{port: 80, protocol: TCP}]
"#;

fn node(dataplane: &str) -> String {
    format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: lab-node\n  labels: {{weir.io/dataplane: {dataplane}}}\n")
}

/// The outcome of one probe round.
struct Round {
    start: Instant,
    end: Instant,
    allowed: bool,
    denied_connected: bool,
}

fn probe_round(lab: &Lab) -> Round {
    let start = Instant::now();
    let out = lab
        .weir(&["probe", "--output", "json", "--timeout-ms", "150"])
        .expect("probe");
    let json: Value = serde_json::from_str(&out).expect("probe output is JSON");
    let connected = |from: &str| {
        json["probes"]
            .as_array()
            .expect("probes")
            .iter()
            .find(|p| p["from"] == from && p["to"] == "s/server" && p["port"] == 80)
            .unwrap_or_else(|| panic!("no probe from {from}"))["connected"]
            .as_bool()
            .expect("connected")
    };
    Round {
        start,
        end: Instant::now(),
        allowed: connected("s/client"),
        denied_connected: connected("s/intruder"),
    }
}

/// Longest time the allowed flow was failing among `rounds`: from the start of the first
/// failing round to the end of the last one before it connected again.
fn longest_outage(rounds: &[Round]) -> Duration {
    let mut longest = Duration::ZERO;
    let mut since: Option<Instant> = None;
    for r in rounds {
        match (r.allowed, since) {
            (false, None) => since = Some(r.start),
            (false, Some(s)) => longest = longest.max(r.end - s),
            (true, Some(s)) => {
                longest = longest.max(r.start - s);
                since = None;
            }
            (true, None) => {}
        }
    }
    longest
}

fn state(lab: &Lab) -> Value {
    serde_json::from_str(&std::fs::read_to_string(lab.dir.join("state.json")).expect("lab state"))
        .unwrap()
}

fn in_node(lab: &Lab, program: &str, args: &[&str]) -> String {
    let netns = state(lab)["node_netns"]
        .as_str()
        .expect("node_netns")
        .to_string();
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &netns, program])
        .args(args)
        .output()
        .expect("ip netns exec");
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What each dataplane leaves in the node: (iptables chains and sets, tc filters, pins
/// and the eBPF dataplane's one chain).
fn leftovers(lab: &Lab) -> (Vec<String>, Vec<String>) {
    let ebpf_chain = weir::netfilter::WEIR_EBPF_CHAIN;
    let mut iptables: Vec<String> = Vec::new();
    let mut ebpf: Vec<String> = Vec::new();
    for save in [
        "iptables-legacy-save",
        "iptables-nft-save",
        "ip6tables-legacy-save",
        "ip6tables-nft-save",
    ] {
        for line in in_node(lab, save, &[])
            .lines()
            .filter(|l| l.contains("WEIR"))
        {
            match line.contains(ebpf_chain) {
                true => ebpf.push(line.to_string()),
                false => iptables.push(line.to_string()),
            }
        }
    }
    iptables.extend(
        in_node(lab, "ipset", &["list", "-n"])
            .lines()
            .filter(|l| l.starts_with("weir"))
            .map(str::to_string),
    );

    let st = state(lab);
    for pod in st["pods"].as_object().expect("pods").values() {
        let host_if = pod["host_if"].as_str().expect("host_if");
        for dir in ["ingress", "egress"] {
            let filters = in_node(lab, "tc", &["filter", "show", "dev", host_if, dir]);
            ebpf.extend(
                filters
                    .lines()
                    .filter(|l| l.contains("weir_"))
                    .map(|l| format!("{host_if} {dir}: {l}")),
            );
        }
    }
    // TCX links live as long as their pins: an empty pin root means none is left.
    let root = std::path::PathBuf::from(st["bpf_root"].as_str().expect("bpf_root"));
    if let Ok(entries) = std::fs::read_dir(&root) {
        ebpf.extend(entries.flatten().map(|e| e.path().display().to_string()));
    }
    (iptables, ebpf)
}

#[test]
fn label_flips_switch_live_without_opening_or_leaving_anything() {
    switch_live("switch", None);
}

/// The same, with the agent in its container as the DaemonSet runs it (the image's own
/// ipset and iptables, the DaemonSet's capabilities and mounts).
#[test]
fn from_the_image_label_flips_switch_live_without_opening_or_leaving_anything() {
    switch_live("switch-image", Some(weir_tests::agent_image()));
}

fn switch_live(tag: &str, image: Option<String>) {
    let lab = Lab::new(tag);
    let world = manifest(&lab, "world.yaml", &format!("{}---\n{WORLD}", node("ebpf")));
    let mut up = vec!["up", "--dataplane", "ebpf"];
    if let Some(image) = &image {
        up.extend(["--agent-image", image.as_str()]);
    }
    up.push(world.to_str().unwrap());
    lab.weir(&up).expect("lab up");

    let rounds = Mutex::new(Vec::new());
    let stop = AtomicBool::new(false);
    let mut report = Vec::new();
    let mut failures = Vec::new();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let r = probe_round(&lab);
                rounds.lock().unwrap().push(r);
            }
        });
        for target in ["iptables", "ebpf", "iptables", "ebpf"] {
            std::thread::sleep(Duration::from_millis(600));
            let from = rounds.lock().unwrap().len();
            let flip = manifest(&lab, "node.yaml", &node(target));
            let started = Instant::now();
            let applied = lab.weir(&["apply", flip.to_str().unwrap()]);
            let converged = started.elapsed();
            if let Err(e) = applied {
                failures.push(format!("switch to {target}: {e}"));
                break;
            }
            std::thread::sleep(Duration::from_millis(600));
            let status: Value = serde_json::from_str(
                &std::fs::read_to_string(lab.dir.join("status.json")).unwrap(),
            )
            .unwrap();
            if status["dataplane"] != target {
                failures.push(format!("status after the switch to {target}: {status}"));
            }
            let (iptables, ebpf) = leftovers(&lab);
            let (new, old) = if target == "ebpf" {
                (ebpf, iptables)
            } else {
                (iptables, ebpf)
            };
            // The same readers see the new dataplane's state: an empty "old" means removed.
            if new.is_empty() {
                failures.push(format!(
                    "no state of the {target} dataplane found after switching to it"
                ));
            }
            if !old.is_empty() {
                failures.push(format!(
                    "switch to {target} left the old dataplane behind: {old:?}"
                ));
            }
            let all = rounds.lock().unwrap();
            let outage = longest_outage(&all[from..]);
            report.push(format!(
                "switch to {target:8} converged in {:>6.1} ms; allowed flow's longest outage {:>6.1} ms over {} probe rounds",
                converged.as_secs_f64() * 1e3,
                outage.as_secs_f64() * 1e3,
                all.len() - from
            ));
        }
        stop.store(true, Ordering::Relaxed);
    });

    let all = rounds.into_inner().unwrap();
    let breaches = all.iter().filter(|r| r.denied_connected).count();
    let total_outage = longest_outage(&all);
    report.push(format!(
        "{} probe rounds; denied flow connected {breaches} times; longest allowed outage {:.1} ms",
        all.len(),
        total_outage.as_secs_f64() * 1e3
    ));
    // Straight to the process's stderr, past the test harness's capture: the figures
    // belong in every run's output, passing or not.
    let mut err = std::io::stderr();
    for line in &report {
        let _ = writeln!(err, "dataplane switch: {line}");
    }
    assert!(failures.is_empty(), "{failures:#?}");
    assert_eq!(breaches, 0, "the denied flow connected during a switch");
    assert!(
        all.len() >= 8,
        "too few probe rounds to mean anything: {}",
        all.len()
    );
    assert!(
        total_outage < Duration::from_secs(2),
        "the allowed flow was down for {total_outage:?} (bound: 2 s)"
    );
}
