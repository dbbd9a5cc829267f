//! Hostile timing and a hostile neighbour on the node, with real packets in network
//! namespaces, on both dataplanes where both apply:
//!
//! - the API server is down at boot: a restarted agent that cannot list the cluster
//!   changes nothing on the node (the previous run's pins or chains keep enforcing, probed
//!   well past the resync interval), and `/readyz` says why it is not ready; once its
//!   source completes the first list it converges;
//! - another agent inserts a rule ahead of `WEIR-FILTER` in FORWARD: the next resync puts
//!   the jump back in first place;
//! - ipsets made by the previous release (maxelem 65,536) are upgraded in place;
//! - a reset whose chain removal fails leaves the sets those chains use in place, full;
//! - an `ipset restore` that hangs: /healthz fails while the run loop is stuck, the command
//!   is killed at its timeout and named in the status, and the agent recovers.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::Value;
use weir_tests::lab::{manifest, Lab};
use weir_tests::weir_bin;

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

/// Replaces the policy above: the intruder is now the one allowed.
const SWAPPED_POLICY: &str = r#"apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: server-from-client, namespace: s}
spec:
  podSelector: {matchLabels: {app: server}}
  policyTypes: [Ingress]
  ingress:
  - from: [{podSelector: {matchLabels: {app: intruder}}}]
    ports: [{port: 80, protocol: TCP}]
"#;

const NODE: &str = "lab-node";
const HEALTH_PORT: u16 = 9402;

fn node(dataplane: &str) -> String {
    format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE}\n  labels: {{weir.io/dataplane: {dataplane}}}\n")
}

/// (client → server:80 connected, intruder → server:80 connected).
fn probe(lab: &Lab) -> (bool, bool) {
    let (_, matrix) = lab.probe(&["--timeout-ms", "300"]).expect("lab probe");
    let connected = |from: &str| {
        *matrix
            .get(&(from.into(), "s/server".into(), 80, "TCP".into()))
            .unwrap_or_else(|| panic!("no probe from {from}: {matrix:?}"))
    };
    (connected("s/client"), connected("s/intruder"))
}

fn in_node(netns: &str, program: &str, args: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", netns, program])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("prerequisite missing: {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} in {netns}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Everything either dataplane keeps on the node: weir's rules (without counters), sets
/// with members, tc filters on the pod interfaces, and the pins.
fn snapshot(lab: &Lab) -> Vec<String> {
    let st = lab.state();
    let netns = lab.node_netns();
    let mut out = Vec::new();
    for save in [
        "iptables-legacy-save",
        "iptables-nft-save",
        "ip6tables-legacy-save",
        "ip6tables-nft-save",
    ] {
        out.extend(
            in_node(&netns, save, &[])
                .lines()
                .filter(|l| l.contains("WEIR") && !l.starts_with('#'))
                .map(|l| format!("{save}: {}", l.split(" [").next().unwrap_or(l))),
        );
    }
    out.extend(
        in_node(&netns, "ipset", &["save"])
            .lines()
            .filter(|l| l.contains("weir-"))
            .map(str::to_string),
    );
    for pod in st["pods"].as_object().expect("pods").values() {
        let host_if = pod["host_if"].as_str().expect("host_if");
        for hook in ["ingress", "egress"] {
            out.extend(
                in_node(&netns, "tc", &["filter", "show", "dev", host_if, hook])
                    .lines()
                    .map(|l| format!("{host_if} {hook}: {l}")),
            );
        }
    }
    let root = PathBuf::from(st["bpf_root"].as_str().expect("bpf_root"));
    out.extend(walk(&root));
    out
}

fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            out.push(e.path().display().to_string());
            if e.path().is_dir() {
                out.extend(walk(&e.path()));
            }
        }
    }
    out.sort();
    out
}

/// Stops every process in the lab's node namespace (its agent) with SIGKILL: a previous
/// run that died, leaving its enforcement behind.
fn kill_lab_agent(lab: &Lab) {
    let netns = lab.node_netns();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let pids = weir_lab::netns::pids(&netns).expect("ip netns pids");
        if pids.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "the lab's agent did not die");
        for pid in pids {
            // SAFETY: kill only sends a signal; these are the lab agent this test started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A `weir agent` this test started in the node namespace; killed on drop.
struct Agent {
    child: Child,
    log: PathBuf,
}

impl Agent {
    fn start(netns: &str, log: PathBuf, args: &[&str], env: &[(&str, &Path)]) -> Agent {
        let mut cmd = Command::new(weir_bin::path().expect("weir binary"));
        cmd.arg("agent").args(args).env_remove("NODE_NAME");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child =
            weir_lab::netns::spawn_detached(netns, &mut cmd, &log, weir_lab::netns::Stdout::Log)
                .expect("start weir agent");
        Agent { child, log }
    }

    fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "the agent exited ({status}):\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// GET `path` from the agent's health server inside the node namespace: (status, body).
fn get(netns: &str, path: &str) -> Option<(u16, String)> {
    weir_tests::http::get(
        netns,
        std::net::SocketAddr::from(([127, 0, 0, 1], HEALTH_PORT)),
        path,
    )
}

/// `secs`, or two minutes in an emulated guest.
fn slow_guest(secs: u64) -> Duration {
    weir_tests::lab::guest_timeout(Duration::from_secs(secs), Duration::from_secs(120))
}

fn wait_for_server(netns: &str, agent: &mut Agent) {
    let deadline = Instant::now() + slow_guest(20);
    while get(netns, "/healthz").is_none() {
        agent.assert_running();
        assert!(
            Instant::now() < deadline,
            "the agent's health server never answered:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// For `duration`: probes keep showing the old policy, the node's state is exactly
/// `before`, and /readyz answers 503 with a reason containing every word of `reason`.
fn holds_without_change(
    lab: &Lab,
    agent: &mut Agent,
    before: &[String],
    duration: Duration,
    reason: &[&str],
) {
    let netns = lab.node_netns();
    let end = Instant::now() + duration;
    let mut rounds = 0;
    while Instant::now() < end {
        agent.assert_running();
        assert_eq!(
            probe(lab),
            (true, false),
            "enforcement changed while the source had not synced (round {rounds}):\n{}",
            agent.log()
        );
        let (code, body) = get(&netns, "/readyz").expect("/readyz answers");
        assert_eq!(code, 503, "/readyz before the first sync: {body}");
        for word in reason {
            assert!(body.contains(word), "/readyz does not say {word:?}: {body}");
        }
        rounds += 1;
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(rounds >= 3, "too few probe rounds");
    assert_eq!(
        snapshot(lab),
        before,
        "the node's dataplane state changed before the first sync:\n{}",
        agent.log()
    );
}

/// The API server is unreachable when the agent restarts (nothing listens at its
/// address): for well over the resync interval nothing on the node changes and /readyz
/// says why. Then an agent whose source completes late (the manifest file appears after
/// start) converges on what it then reads.
fn api_server_down_at_boot_changes_nothing(dataplane: &str) {
    let lab = Lab::new(&format!("boot-{dataplane}"));
    let world = manifest(
        &lab,
        "world.yaml",
        &format!("{}---\n{WORLD}", node(dataplane)),
    );
    lab.weir(&["up", "--dataplane", dataplane, world.to_str().unwrap()])
        .expect("lab up");
    assert_eq!(probe(&lab), (true, false), "the lab does not enforce");
    let objects = std::fs::read_to_string(lab.dir.join("objects.yaml")).expect("objects.yaml");
    kill_lab_agent(&lab);
    let before = snapshot(&lab);
    assert!(!before.is_empty(), "no {dataplane} state on the node");
    let netns = lab.node_netns();
    let bpf_root = lab.state()["bpf_root"].as_str().unwrap().to_string();

    // Cluster mode against an API server address where nothing listens.
    let kubeconfig = manifest(
        &lab,
        "kubeconfig",
        "apiVersion: v1\nkind: Config\n\
         clusters: [{name: c, cluster: {server: 'http://127.0.0.1:6443'}}]\n\
         users: [{name: u, user: {token: t}}]\n\
         contexts: [{name: c, context: {cluster: c, user: u}}]\ncurrent-context: c\n",
    );
    let common = [
        "--dataplane",
        dataplane,
        "--bpf-root",
        &bpf_root,
        "--resync-seconds",
        "1",
        "--log-format",
        "text",
    ];
    let listen = format!("127.0.0.1:{HEALTH_PORT}");
    let mut args: Vec<&str> = common.to_vec();
    args.extend(["--listen", &listen]);
    let mut agent = Agent::start(
        &netns,
        lab.dir.join("cluster-agent.log"),
        &args,
        &[("KUBECONFIG", &kubeconfig), ("NODE_NAME", Path::new(NODE))],
    );
    wait_for_server(&netns, &mut agent);
    // Its first list must have failed before /readyz can name the error (an emulated
    // guest takes seconds to get there).
    wait_until(&mut agent, "/readyz never named the source's error", || {
        get(&netns, "/readyz").is_some_and(|(_, body)| body.contains("last source error"))
    });
    holds_without_change(
        &lab,
        &mut agent,
        &before,
        Duration::from_secs(6),
        &[
            "waiting for the first complete list",
            "pods",
            "networkpolicies",
            "last source error",
        ],
    );
    drop(agent);

    // File mode, the file not there yet: the same; then it appears and the agent converges.
    let late = lab.dir.join("late.yaml");
    let status = lab.dir.join("late-status.json");
    let mut args: Vec<&str> = common.to_vec();
    args.extend(["--listen", &listen, "--poll-ms", "20"]);
    args.extend(["--manifests", late.to_str().unwrap()]);
    args.extend(["--status-file", status.to_str().unwrap()]);
    let mut agent = Agent::start(&netns, lab.dir.join("file-agent.log"), &args, &[]);
    wait_for_server(&netns, &mut agent);
    holds_without_change(
        &lab,
        &mut agent,
        &before,
        Duration::from_secs(3),
        &["waiting for the first complete", "late.yaml"],
    );
    assert!(
        !status.exists(),
        "a status was written before the first sync"
    );
    // The same objects, with the policy swapped: the intruder is now the one allowed.
    let docs: Vec<&str> = objects.split("---\n").collect();
    let kept: Vec<&str> = docs
        .iter()
        .copied()
        .filter(|d| !d.contains("kind: NetworkPolicy"))
        .collect();
    assert_eq!(
        kept.len() + 1,
        docs.len(),
        "one policy in objects.yaml:\n{objects}"
    );
    let tmp = lab.dir.join("late.yaml.tmp");
    std::fs::write(&tmp, format!("{}---\n{SWAPPED_POLICY}", kept.join("---\n"))).unwrap();
    std::fs::rename(&tmp, &late).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        agent.assert_running();
        let converged = std::fs::read_to_string(&status)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .is_some_and(|s| s["converged"] == true);
        if converged && probe(&lab) == (false, true) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no convergence after the source synced: probes (client, intruder) {:?}, \
             status {:?}\n{}",
            probe(&lab),
            std::fs::read_to_string(&status),
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let (code, body) = get(&netns, "/readyz").expect("/readyz answers");
    assert_eq!(code, 200, "/readyz after convergence: {body}");
}

#[test]
fn api_server_down_at_boot_changes_nothing_on_ebpf() {
    api_server_down_at_boot_changes_nothing("ebpf");
}

#[test]
fn api_server_down_at_boot_changes_nothing_on_iptables() {
    api_server_down_at_boot_changes_nothing("iptables");
}

/// `weir-lab up` whose agent resyncs every second (the agent inherits the environment).
fn lab_up_fast_resync(lab: &Lab, dataplane: &str) {
    let world = manifest(
        lab,
        "world.yaml",
        &format!("{}---\n{WORLD}", node(dataplane)),
    );
    let out = weir_bin::lab_command()
        .expect("weir-lab binary")
        .arg("--state-dir")
        .arg(&lab.dir)
        .args(["up", "--dataplane", dataplane])
        .arg(&world)
        .env("WEIR_RESYNC_SECONDS", "1")
        .output()
        .expect("run weir-lab up");
    assert!(
        out.status.success(),
        "lab up: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(probe(lab), (true, false), "the lab does not enforce");
}

/// The iptables backend the agent writes to in the node (the one holding WEIR-FILTER).
fn weir_backend(netns: &str) -> &'static str {
    if in_node(netns, "iptables-nft-save", &[]).contains(":WEIR-FILTER") {
        "nft"
    } else if in_node(netns, "iptables-legacy-save", &[]).contains(":WEIR-FILTER") {
        "legacy"
    } else {
        panic!("no WEIR-FILTER chain in the node {netns}")
    }
}

fn forward_rules(netns: &str, backend: &str) -> Vec<String> {
    in_node(
        netns,
        &format!("iptables-{backend}-save"),
        &["-t", "mangle"],
    )
    .lines()
    .filter(|l| l.starts_with("-A FORWARD "))
    .map(str::to_string)
    .collect()
}

/// A hostile agent inserts `-I FORWARD 1 -j ACCEPT` in filter (nothing changes) and ahead
/// of weir's jump in mangle: the next resync puts the jump first again and closes the flow.
#[test]
fn a_rule_inserted_ahead_of_weir_filter_is_overtaken_at_the_next_resync() {
    let lab = Lab::new("jump-first");
    lab_up_fast_resync(&lab, "iptables");
    let netns = lab.node_netns();
    let backend = weir_backend(&netns);
    assert_eq!(
        forward_rules(&netns, backend).first().map(String::as_str),
        Some("-A FORWARD -j WEIR-FILTER")
    );
    // An ACCEPT ahead of everything in filter FORWARD (kube-proxy's KUBE-FORWARD accepts
    // what it masquerades) changes nothing: weir's chains are in mangle, which runs first.
    in_node(
        &netns,
        &format!("iptables-{backend}"),
        &["-t", "filter", "-I", "FORWARD", "1", "-j", "ACCEPT"],
    );
    assert_eq!(
        probe(&lab),
        (true, false),
        "an ACCEPT in filter FORWARD let a denied flow through"
    );
    in_node(
        &netns,
        &format!("iptables-{backend}"),
        &["-t", "mangle", "-I", "FORWARD", "1", "-j", "ACCEPT"],
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let rules = forward_rules(&netns, backend);
        if rules.first().map(String::as_str) == Some("-A FORWARD -j WEIR-FILTER")
            && probe(&lab) == (true, false)
        {
            // The hostile rule is still there, behind the jump: weir only moved its own.
            assert!(
                rules.contains(&"-A FORWARD -j ACCEPT".to_string()),
                "{rules:?}"
            );
            assert_eq!(
                rules.iter().filter(|r| r.contains("WEIR-FILTER")).count(),
                1,
                "{rules:?}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "WEIR-FILTER is not first in FORWARD 15 s after a rule was inserted ahead of it \
             (resync every 1 s): {rules:?}, probes (client, intruder) = {:?}",
            probe(&lab)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn weir_sets(netns: &str) -> std::collections::BTreeMap<String, u32> {
    let listed = in_node(netns, "ipset", &["list", "-t"]);
    weir::dataplane::iptables::sets::maxelems(&listed)
        .into_iter()
        .filter(|(n, _)| n.starts_with("weir-"))
        .collect()
}

fn status_errors(lab: &Lab) -> (bool, Vec<String>) {
    let text = std::fs::read_to_string(lab.dir.join("status.json")).unwrap_or_default();
    let status: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let errors = status["errors"]
        .as_array()
        .map(|a| a.iter().map(|e| e.to_string()).collect())
        .unwrap_or_default();
    (status["converged"] == true, errors)
}

/// The node carries the sets of the previous release (maxelem 65,536, same names, same
/// members, referenced by the chains): the agent's resync upgrades them in place, stays
/// converged, keeps enforcing, and later changes apply.
#[test]
fn sets_of_the_old_maxelem_are_upgraded_in_place() {
    let lab = Lab::new("maxelem");
    lab_up_fast_resync(&lab, "iptables");
    let netns = lab.node_netns();
    let sets = weir_sets(&netns);
    assert!(!sets.is_empty(), "no weir sets in the node");
    // Make them as the previous release did: same name, members, references; old size.
    let mut script = String::new();
    for name in sets.keys() {
        let header = in_node(&netns, "ipset", &["list", "-t", name]);
        let family = if header.contains("family inet6") {
            "inet6"
        } else {
            "inet"
        };
        script.push_str(&format!(
            "create old-size-tmp hash:net family {family} maxelem 65536\n"
        ));
        for line in in_node(&netns, "ipset", &["save", name]).lines() {
            if let Some(member) = line.strip_prefix(&format!("add {name} ")) {
                script.push_str(&format!("add old-size-tmp {member}\n"));
            }
        }
        script.push_str(&format!("swap old-size-tmp {name}\ndestroy old-size-tmp\n"));
    }
    let out = Command::new("ip")
        .args(["netns", "exec", &netns, "ipset", "restore"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(script.as_bytes())?;
            c.wait_with_output()
        })
        .expect("ipset restore");
    assert!(
        out.status.success(),
        "making old sets: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // (The agent may upgrade them from its next resync on, within a second.)
    assert_eq!(
        probe(&lab),
        (true, false),
        "old sets do not enforce the same"
    );

    // Several resyncs (one per second) later: upgraded, converged, still enforcing.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (converged, errors) = status_errors(&lab);
        let sizes = weir_sets(&netns);
        if converged && errors.is_empty() && sizes.values().all(|m| *m == 1 << 20) {
            assert_eq!(sizes.len(), sets.len(), "{sizes:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "old sets not upgraded: converged={converged}, errors={errors:?}, sizes={sizes:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(probe(&lab), (true, false), "enforcement after the upgrade");
    let swapped = manifest(&lab, "swapped.yaml", SWAPPED_POLICY);
    lab.weir(&["apply", swapped.to_str().unwrap()])
        .expect("a policy change after the upgrade");
    assert_eq!(probe(&lab), (false, true), "the change did not apply");
}

/// Runs `weir reset --output json` in the node: (exit success, report).
fn weir_reset(netns: &str, tag: &str) -> (bool, Value) {
    let bpf_root = format!("/sys/fs/bpf/weir-test-{tag}-{}", std::process::id());
    let out = Command::new("ip")
        .args(["netns", "exec", netns])
        .arg(weir_bin::path().expect("weir binary"))
        .args(["reset", "--output", "json", "--bpf-root", &bpf_root])
        .output()
        .expect("run weir reset");
    let report = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "reset report is not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.success(), report)
}

fn set_members(netns: &str) -> Vec<String> {
    in_node(netns, "ipset", &["save"])
        .lines()
        .filter(|l| l.starts_with("add weir-"))
        .map(str::to_string)
        .collect()
}

/// A foreign nft rule (a verdict map, which iptables-nft-save cannot show) jumps into
/// WEIR-FILTER, so reset cannot remove weir's chains. The sets those chains use must stay
/// full, or the chains would drop what they allow: the allowed flow keeps connecting.
/// Once the foreign rule is gone, the next reset removes everything.
#[test]
fn reset_leaves_sets_in_place_while_chains_using_them_stay() {
    let lab = Lab::new("reset-keep");
    lab_up_fast_resync(&lab, "iptables");
    let netns = lab.node_netns();
    assert_eq!(
        weir_backend(&netns),
        "nft",
        "this test needs the nft backend (a fresh namespace picks it)"
    );
    kill_lab_agent(&lab);
    let members = set_members(&netns);
    assert!(!members.is_empty(), "weir's sets are empty before reset");
    in_node(
        &netns,
        "nft",
        &["add rule ip mangle FORWARD ip saddr vmap { 192.0.2.1 : jump WEIR-FILTER }"],
    );

    // The removal of the chains fails: reset says so (exit status and errors).
    let (ok, report) = weir_reset(&netns, "reset-keep");
    assert!(!ok, "reset hid the failed chain removal: {report}");
    let errors = report["errors"].as_array().expect("errors");
    assert!(
        errors
            .iter()
            .any(|e| e.as_str().unwrap_or_default().contains("chains")),
        "the chain removal was expected to fail: {report}"
    );
    assert!(
        in_node(&netns, "iptables-nft-save", &[]).contains(":WEIR-FILTER"),
        "weir's chains were removed despite the foreign reference"
    );
    // The foreign rule is in the IPv4 table: the IPv4 chains and their sets stay (the
    // IPv6 ones go).
    let v4 = |members: Vec<String>| -> Vec<String> {
        members
            .into_iter()
            .filter(|m| {
                m.split_whitespace()
                    .nth(1)
                    .is_some_and(|s| s.ends_with("-4"))
            })
            .collect()
    };
    assert!(!v4(members.clone()).is_empty());
    assert_eq!(
        v4(set_members(&netns)),
        v4(members),
        "reset flushed sets that chains still in place use: {report}"
    );
    assert!(
        !report["kept_sets"]
            .as_array()
            .expect("kept_sets")
            .is_empty(),
        "{report}"
    );
    assert_eq!(
        probe(&lab),
        (true, false),
        "after a failed chain removal the chains must enforce as before"
    );

    // The foreign rule goes: the next reset removes chains and sets.
    let handle = in_node(
        &netns,
        "nft",
        &["-a", "list", "chain", "ip", "mangle", "FORWARD"],
    )
    .lines()
    .find(|l| l.contains("vmap"))
    .and_then(|l| l.rsplit("handle ").next())
    .map(|h| h.trim().to_string())
    .expect("the foreign rule's handle");
    in_node(
        &netns,
        "nft",
        &[
            "delete", "rule", "ip", "mangle", "FORWARD", "handle", &handle,
        ],
    );
    let (ok, report) = weir_reset(&netns, "reset-keep");
    assert!(
        ok && report["errors"].as_array().expect("errors").is_empty(),
        "{report}"
    );
    assert!(set_members(&netns).is_empty(), "{report}");
    assert!(!in_node(&netns, "iptables-nft-save", &[]).contains("WEIR"));
    assert_eq!(
        probe(&lab),
        (true, true),
        "no policy is enforced after reset"
    );
}

const WEDGE_MANIFEST: &str = r#"# generation: 1
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: default, labels: {app: a}}
spec: {containers: [{name: c, image: i, ports: [{containerPort: 80}]}]}
status: {podIP: 10.78.0.1, podIPs: [{ip: 10.78.0.1}]}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: default, labels: {app: b}}
spec: {containers: [{name: c, image: i, ports: [{containerPort: 80}]}]}
status: {podIP: 10.78.0.2, podIPs: [{ip: 10.78.0.2}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: b-from-a, namespace: default}
spec:
  podSelector: {matchLabels: {app: b}}
  ingress: [{from: [{podSelector: {matchLabels: {app: a}}}]}]
"#;

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Waits until `check` holds, polling; panics with `what` and the agent's log after 20 s
/// (two minutes in an emulated guest).
fn wait_until(agent: &mut Agent, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + slow_guest(20);
    while !check() {
        agent.assert_running();
        assert!(Instant::now() < deadline, "{what}:\n{}", agent.log());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `ipset restore` hangs (a wedged kernel lock, as far as the agent can tell): while the
/// run loop is stuck in it /healthz answers 503; at --command-timeout-seconds the command
/// is killed (nothing of it is left running) and the status names it; the loop turns
/// again, /healthz recovers, and the next resync converges once ipset answers again.
#[test]
fn a_hung_command_is_killed_and_healthz_tells_while_it_hangs() {
    weir_tests::require_root_and_tools();
    let ns = weir_tests::netns::NetNs::new("wedge").expect("node namespace");
    let dir = TempDir(std::env::temp_dir().join(format!("weir-wedge-{}", std::process::id())));
    let bin = dir.0.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let real = Command::new("sh")
        .args(["-c", "command -v ipset"])
        .output()
        .expect("sh");
    let real = String::from_utf8_lossy(&real.stdout).trim().to_string();
    assert!(!real.is_empty(), "prerequisite missing: ipset");
    let flag = dir.0.join("wedge");
    std::fs::write(&flag, "").unwrap();
    // The real ipset, except that `restore` hangs while the flag file exists.
    let shim = bin.join("ipset");
    std::fs::write(
        &shim,
        format!(
            "#!/bin/sh\nif [ \"$1\" = restore ] && [ -e {} ]; then exec sleep 60; fi\nexec {real} \"$@\"\n",
            flag.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&shim, std::fs::Permissions::from_mode(0o755)).unwrap();
    let manifest = dir.0.join("objects.yaml");
    std::fs::write(&manifest, WEDGE_MANIFEST).unwrap();
    let status = dir.0.join("status.json");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let listen = format!("127.0.0.1:{HEALTH_PORT}");
    let bpf_root = format!("/sys/fs/bpf/weir-test-wedge-{}", std::process::id());
    let mut agent = Agent::start(
        &ns.name,
        dir.0.join("agent.log"),
        &[
            "--dataplane",
            "iptables",
            "--bpf-root",
            &bpf_root,
            "--manifests",
            manifest.to_str().unwrap(),
            "--status-file",
            status.to_str().unwrap(),
            "--listen",
            &listen,
            "--resync-seconds",
            "8",
            "--liveness-seconds",
            "2",
            "--command-timeout-seconds",
            "6",
            "--log-format",
            "text",
        ],
        &[("PATH", Path::new(&path))],
    );
    wait_for_server(&ns.name, &mut agent);

    // Stuck in `ipset restore`: not live.
    let mut stuck = String::new();
    wait_until(
        &mut agent,
        "/healthz never failed while the loop was stuck",
        || match get(&ns.name, "/healthz") {
            Some((503, body)) => {
                stuck = body;
                true
            }
            _ => false,
        },
    );
    assert!(stuck.contains("has not turned"), "{stuck}");

    // Killed at the timeout, named in the status; the loop turns again.
    let mut errors = String::new();
    wait_until(&mut agent, "the timeout is not in the status", || {
        errors = std::fs::read_to_string(&status).unwrap_or_default();
        errors.contains("did not finish within 6s and was killed")
    });
    assert!(errors.contains("`ipset restore -exist`"), "{errors}");
    let left: Vec<String> = weir_lab::netns::pids(&ns.name)
        .expect("ip netns pids")
        .into_iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).ok())
        .filter(|comm| comm.trim() == "sleep")
        .collect();
    assert!(left.is_empty(), "the hung command was not killed: {left:?}");
    wait_until(&mut agent, "/healthz did not recover", || {
        get(&ns.name, "/healthz").is_some_and(|(code, _)| code == 200)
    });
    let (code, body) = get(&ns.name, "/readyz").expect("/readyz");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("ipset restore"), "{body}");

    // ipset answers again: the next resync converges.
    std::fs::remove_file(&flag).unwrap();
    wait_until(&mut agent, "no convergence once ipset answered", || {
        get(&ns.name, "/readyz").is_some_and(|(code, _)| code == 200)
    });
    let saved = in_node(&ns.name, "iptables-nft-save", &[])
        + &in_node(&ns.name, "iptables-legacy-save", &[]);
    assert!(saved.contains(":WEIR-FILTER"), "{saved}");
}
