//! `weir agent` taking a node over from Azure NPM: the agent converges its own (eBPF)
//! dataplane first, then removes NPM's chains and sets. 16 NPM sets held by a foreign
//! reference (the leaked-reference case that crash-looped NPM) cannot be destroyed: the
//! agent converges anyway, names them, and destroys them at a later resync once the
//! reference is gone.

use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use weir_tests::pods::World;
use weir_tests::probe::{tcp_from, EchoServers};
use weir_tests::{weir_bin, PinRoot};

const A: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
const LEAKED: std::ops::Range<u32> = 4..20;

/// NPM as a node carries it: sets, a list:set, chains hooked into FORWARD, one rule that
/// drops a → b. A foreign list:set (not NPM's, not weir's) holds 16 of NPM's sets.
fn npm_state() -> String {
    let mut s = String::new();
    for i in 0..20 {
        s.push_str(&format!("ipset create azure-npm-{i} hash:net\n"));
    }
    s.push_str(&format!("ipset add azure-npm-1 {A}/32\n"));
    s.push_str("ipset create azure-npm-list list:set\nipset add azure-npm-list azure-npm-0\n");
    s.push_str("ipset create foreign-holder list:set size 32\n");
    for i in LEAKED {
        s.push_str(&format!("ipset add foreign-holder azure-npm-{i}\n"));
    }
    s.push_str(
        "iptables -N AZURE-NPM\n\
         iptables -N AZURE-NPM-EGRESS\n\
         iptables -A FORWARD -j AZURE-NPM\n\
         iptables -A AZURE-NPM -j AZURE-NPM-EGRESS\n\
         iptables -A AZURE-NPM-EGRESS -p tcp --dport 80 -m set --match-set azure-npm-1 src -j DROP\n",
    );
    s
}

fn sh(netns: &str, script: &str) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", netns, "sh", "-ec", script])
        .output()
        .expect("ip netns exec");
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn set_names(netns: &str) -> Vec<String> {
    sh(netns, "ipset list -n")
        .lines()
        .map(str::to_string)
        .collect()
}

const MANIFEST: &str = r#"# generation: 1
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: default, labels: {app: a}}
spec: {containers: [{name: c, image: i, ports: [{containerPort: 80}]}]}
status: {podIP: 10.77.0.1, podIPs: [{ip: 10.77.0.1}]}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: default, labels: {app: b}}
spec: {containers: [{name: c, image: i, ports: [{containerPort: 80}]}]}
status: {podIP: 10.77.0.2, podIPs: [{ip: 10.77.0.2}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-accepts-nothing, namespace: default}
spec: {podSelector: {matchLabels: {app: a}}, policyTypes: [Ingress]}
"#;

/// The agent, started inside the node namespace (setns, so bpffs stays the host's);
/// killed on drop.
struct Agent {
    child: Child,
    log: PathBuf,
}

impl Agent {
    fn start(netns: &str, dir: &Path, pins: &Path, dataplane: &str) -> Agent {
        let ns = std::fs::File::open(format!("/var/run/netns/{netns}")).expect("open netns");
        let log = dir.join("agent.log");
        let mut cmd = Command::new(weir_bin::path().expect("weir binary"));
        cmd.args([
            "agent",
            "--dataplane",
            dataplane,
            "--resync-seconds",
            "1",
            "--poll-ms",
            "20",
        ])
        .arg("--manifests")
        .arg(dir.join("objects.yaml"))
        .arg("--status-file")
        .arg(dir.join("status.json"))
        .arg("--bpf-root")
        .arg(pins)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(&log).unwrap());
        let fd = ns.as_raw_fd();
        // SAFETY: setns is async-signal-safe; `ns` outlives the spawn.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        let child = cmd.spawn().expect("start weir agent");
        Agent { child, log }
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

fn wait_for(what: &str, timeout: Duration, mut check: impl FnMut() -> bool, agent: &Agent) {
    let deadline = Instant::now() + timeout;
    while !check() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; agent log:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn agent_on_ebpf_takes_over_from_azure_npm_and_retries_leaked_sets() {
    takes_over_from_azure_npm("ebpf", "npme");
}

/// weir's own iptables chains and sets enforce while NPM's are removed around them.
#[test]
fn agent_on_iptables_takes_over_from_azure_npm_and_retries_leaked_sets() {
    takes_over_from_azure_npm("iptables", "npmi");
}

fn takes_over_from_azure_npm(dataplane: &str, tag: &str) {
    weir_tests::require_root_and_tools();
    let world = World::new(tag, &[("a", A), ("b", B)]);
    let pins = PinRoot::new(tag);
    let dir = std::env::temp_dir().join(format!("weir-agent-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let _servers = [
        EchoServers::start(&world.pods[0].ns, &[80]),
        EchoServers::start(&world.pods[1].ns, &[80]),
    ];
    let (to_a, to_b) = (SocketAddr::from((A, 80)), SocketAddr::from((B, 80)));
    let (ns_a, ns_b) = (world.pods[0].ns.clone(), world.pods[1].ns.clone());
    let t = Duration::from_millis(500);

    sh(&world.node, &npm_state());
    assert!(
        !tcp_from(&ns_a, to_b, t),
        "NPM's rule drops a → b before the migration"
    );
    assert!(
        tcp_from(&ns_b, to_a, t),
        "nothing denies b → a before the migration"
    );

    std::fs::write(dir.join("objects.yaml"), MANIFEST).unwrap();
    let agent = Agent::start(&world.node, &dir, &pins.0, dataplane);
    let status_file = dir.join("status.json");
    wait_for(
        "convergence",
        Duration::from_secs(60),
        || {
            std::fs::read_to_string(&status_file)
                .ok()
                .and_then(|s| serde_json::from_str::<Value>(&s).ok())
                .is_some_and(|s| s["generation"] == 1 && s["converged"] == true)
        },
        &agent,
    );
    let status: Value =
        serde_json::from_str(&std::fs::read_to_string(&status_file).unwrap()).unwrap();
    assert_eq!(status["dataplane"], dataplane);
    assert_eq!(
        status["errors"],
        serde_json::json!([]),
        "undeletable sets are not object errors"
    );

    // weir enforces, NPM is gone.
    assert!(!tcp_from(&ns_b, to_a, t), "weir's policy denies b → a");
    assert!(tcp_from(&ns_a, to_b, t), "NPM's drop rule is gone");
    let rules = sh(&world.node, "iptables-save");
    assert!(!rules.contains("AZURE-NPM"), "NPM chains left:\n{rules}");
    if dataplane == "iptables" {
        assert!(
            rules.contains(":WEIR-FILTER"),
            "weir's own chains must stay:\n{rules}"
        );
    }
    let sets = set_names(&world.node);
    for i in 0..4 {
        assert!(
            !sets.contains(&format!("azure-npm-{i}")),
            "azure-npm-{i} should be destroyed: {sets:?}"
        );
    }
    assert!(!sets.contains(&"azure-npm-list".to_string()));
    let log = agent.log();
    for i in LEAKED {
        let name = format!("azure-npm-{i}");
        assert!(
            sets.contains(&name),
            "{name} is held by a foreign reference and must stay"
        );
        assert!(
            log.contains(&name),
            "{name} not named in the agent log:\n{log}"
        );
    }
    // Converged first, cleaned after.
    let converged = log.find("dataplane converged").expect("convergence logged");
    let cleaned = log.find("cleanup done").expect("cleanup logged");
    assert!(
        converged < cleaned,
        "NPM's state was removed before weir enforced:\n{log}"
    );

    // The reference goes away: a later resync destroys the sets.
    sh(&world.node, "ipset destroy foreign-holder");
    wait_for(
        "the retry to destroy the leaked sets",
        Duration::from_secs(20),
        || {
            !set_names(&world.node)
                .iter()
                .any(|s| s.starts_with("azure-npm-"))
        },
        &agent,
    );
    drop(agent);
    let _ = std::fs::remove_dir_all(&dir);
}
