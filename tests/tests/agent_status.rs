//! What the running agent says about itself, on both dataplanes, in the lab (file mode):
//! `weir-lab status` (the agent's `/status`), `/metrics`, whose families must be exactly
//! those deploy/README.md documents, with verdict and drop counters that follow real
//! packets, and the verdict stream (the agent's log and `weir monitor`), all agreeing
//! between the dataplanes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use weir_tests::lab::Lab;

fn demo_world() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/demo.yaml")
}

/// Sample name → (type, whether only eBPF serves it), from deploy/README.md's Metrics table.
fn documented_families() -> BTreeMap<String, (String, bool)> {
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/README.md");
    let text = std::fs::read_to_string(&readme).expect("deploy/README.md");
    let section = text
        .split("\n## Metrics\n")
        .nth(1)
        .expect("deploy/README.md has a `## Metrics` section");
    let section = section.split("\n## ").next().unwrap_or(section);
    section
        .lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let name = cells.get(1)?.strip_prefix("`weir_")?.strip_suffix('`')?;
            let ebpf_only = cells.get(4)?.starts_with("eBPF only");
            Some((
                format!("weir_{name}"),
                (cells.get(2)?.to_string(), ebpf_only),
            ))
        })
        .collect()
}

/// Sample name → type, from the `# TYPE` lines of an OpenMetrics text (a counter's TYPE
/// line names it without `_total`).
fn served_families(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| {
            let sample = if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_string()
            };
            (sample, kind.to_string())
        })
        .collect()
}

/// The value of the sample whose name and labels are exactly `series`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// `/metrics` once every one of `series` has a sample above 0 (the counters are read every
/// 5 s); fails naming `what` after 30 s.
fn counted_within_30s(lab: &Lab, what: &str, series: &[&str]) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = metrics(lab);
        if series
            .iter()
            .all(|s| sample(&text, s).is_some_and(|v| v > 0.0))
        {
            return text;
        }
        if Instant::now() >= deadline {
            // What the rules' counters say, to tell a reading fault from a counting one.
            let saved: String = ["iptables-legacy-save", "iptables-nft-save"]
                .iter()
                .map(|tool| {
                    let out = std::process::Command::new("ip")
                        .args([
                            "netns",
                            "exec",
                            &lab.node_netns(),
                            tool,
                            "-c",
                            "-t",
                            "mangle",
                        ])
                        .output();
                    let text = out
                        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                        .unwrap_or_default();
                    format!("{tool} -c -t mangle:\n{text}\n")
                })
                .collect();
            let log = std::fs::read_to_string(lab.dir.join("agent.log")).unwrap_or_default();
            let log: Vec<&str> = log.lines().filter(|l| !l.starts_with('{')).collect();
            panic!(
                "{what}: not counted 30 s after the probe:\n{text}\n{saved}\nagent log:\n{}",
                log.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn metrics(lab: &Lab) -> String {
    let addr = weir_lab::agent::LISTEN.parse().unwrap();
    let (code, body) = weir_tests::http::get(&lab.node_netns(), addr, "/metrics")
        .expect("the lab's agent serves /metrics");
    assert_eq!(code, 200, "/metrics: {body}");
    body
}

/// Policies (namespace, name, direction) with allows counted.
type Allowed = BTreeSet<(String, String, String)>;

/// Verdict records as (verdict, direction, pod, source pod, destination port, rule).
type Verdicts = BTreeSet<(String, String, String, String, u64, String)>;

/// Link-scope control traffic from a pod to the node (IPv6 MLD reports from its
/// link-local address) is left out: the node never forwards it, so iptables (in FORWARD)
/// never sees it, while eBPF judges every packet a pod sends.
fn verdicts(records: &[Value]) -> Verdicts {
    let text = |v: &Value| v.as_str().unwrap_or("?").to_string();
    records
        .iter()
        .filter(|r| r["verdict"] != "suppressed")
        .filter(|r| r["src_pod"].is_string() || r["dst_pod"].is_string())
        .map(|r| {
            (
                text(&r["verdict"]),
                text(&r["direction"]),
                text(&r["pod"]),
                text(&r["src_pod"]),
                r["dport"].as_u64().unwrap_or(0),
                text(&r["rule"]),
            )
        })
        .collect()
}

/// The JSON lines in `text` (the verdict records among the agent's log lines).
fn json_lines(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("verdict").is_some())
        .collect()
}

/// `weir monitor` reading the lab agent's stream from the node's namespace, once it says
/// it is streaming.
struct Monitor {
    child: std::process::Child,
}

impl Monitor {
    fn start(lab: &Lab) -> Monitor {
        use std::io::BufRead;
        let weir = weir_tests::weir_bin::path().expect("the weir binary");
        let mut child = std::process::Command::new("ip")
            .args(["netns", "exec", &lab.node_netns()])
            .arg(weir)
            .args([
                "monitor",
                "--output",
                "json",
                "--address",
                weir_lab::agent::LISTEN,
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("weir monitor starts");
        let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        let mut first = String::new();
        stderr.read_line(&mut first).unwrap();
        assert!(
            first.contains("streaming verdicts from the agent"),
            "weir monitor: {first}"
        );
        // Keep reading, so its last words never meet a closed pipe.
        std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
        Monitor { child }
    }

    fn stop(mut self) -> Vec<Value> {
        let _ = self.child.kill();
        let out = self
            .child
            .wait_with_output()
            .expect("weir monitor's output");
        json_lines(&String::from_utf8_lossy(&out.stdout))
    }
}

fn status_and_metrics(dataplane: &str) -> (Allowed, Verdicts) {
    let lab = Lab::new(&format!("status-{dataplane}"));
    lab.weir(&[
        "up",
        "--dataplane",
        dataplane,
        demo_world().to_str().unwrap(),
    ])
    .unwrap_or_else(|e| panic!("{dataplane}: lab up: {e}"));

    // weir-lab status, as JSON and as a table.
    let status: Value = serde_json::from_str(&lab.weir(&["status", "--output", "json"]).unwrap())
        .expect("weir-lab status --output json prints JSON");
    assert_eq!(status["dataplane"], dataplane, "{status:#}");
    assert_eq!(status["requested"], dataplane, "{status:#}");
    assert_eq!(status["converged"], true, "{status:#}");
    assert_eq!(status["sync"]["complete"], true, "{status:#}");
    assert_eq!(status["enforced"]["endpoints"], 4, "{status:#}");
    assert_eq!(status["enforced"]["policies"], 5, "{status:#}");
    assert_eq!(status["refused"], serde_json::json!([]), "{status:#}");
    assert!(
        status["last_converge"]["duration_ms"].is_number(),
        "{status:#}"
    );
    let maps = status["map_pressure"].as_array().expect("map_pressure");
    match dataplane {
        "ebpf" => assert!(
            maps.iter()
                .any(|m| m["map"] == "WEIR_POLICY" && m["used"].as_u64() > Some(0)),
            "{status:#}"
        ),
        _ => assert!(maps.is_empty(), "iptables has no maps: {status:#}"),
    }
    let table = lab.weir(&["status"]).unwrap();
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("dataplane ") && l.ends_with(&format!(" {dataplane}"))),
        "{table}"
    );

    // Every documented family is served, and nothing undocumented. The agent reads its
    // counters right after its status says converged: allow it that read (a few ms on the
    // host, more under emulation), not the 5 s of its periodic reads.
    let documented = documented_families();
    assert!(documented.len() >= 12, "the README's table: {documented:?}");
    let expected: BTreeMap<String, String> = documented
        .into_iter()
        .filter(|(_, (_, ebpf_only))| dataplane == "ebpf" || !ebpf_only)
        .map(|(name, (kind, _))| (name, kind))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut text = metrics(&lab);
    while served_families(&text) != expected && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        text = metrics(&lab);
    }
    assert_eq!(
        served_families(&text),
        expected,
        "{dataplane}: /metrics (left) and deploy/README.md's Metrics table (right) differ"
    );

    // Real packets move the counters: the probe connects through every policy's rules and
    // into the default deny both ways (db may start nothing).
    let (_, matrix) = lab.probe(&[]).unwrap();
    assert!(matrix.values().any(|c| *c) && matrix.values().any(|c| !*c));
    let deny = |direction: &str| {
        format!("weir_policy_verdicts_total{{namespace=\"\",policy=\"\",direction=\"{direction}\",verdict=\"deny\"}}")
    };
    let text = counted_within_30s(
        &lab,
        &format!("{dataplane}: default denies"),
        &[&deny("ingress"), &deny("egress")],
    );
    assert!(
        sample(&text, "weir_drops_total{reason=\"default-deny\"}").is_some_and(|v| v > 0.0),
        "{text}"
    );
    let allowed: Allowed = text
        .lines()
        .filter(|l| l.starts_with("weir_policy_verdicts_total{") && l.contains("verdict=\"allow\""))
        .filter(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) > Some(0.0))
        .map(|l| {
            let label = |name: &str| {
                l.split(&format!("{name}=\""))
                    .nth(1)
                    .and_then(|r| r.split('"').next())
                    .unwrap_or_default()
                    .to_string()
            };
            (label("namespace"), label("policy"), label("direction"))
        })
        .collect();
    let verdicts = audit_mode(&lab, dataplane);
    lab.weir(&["down"]).unwrap();
    (allowed, verdicts)
}

/// Prometheus may be scraped by shop/web only; in audit mode first.
const PROMETHEUS_FROM_WEB: &str = "apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: prometheus-from-web
  namespace: monitoring
  annotations: {policy.weir.io/mode: MODE}
spec:
  podSelector: {matchLabels: {app: prometheus}}
  ingress:
  - from:
    - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: shop}}
      podSelector: {matchLabels: {app: web}}
";

fn reaches_prometheus(matrix: &weir_tests::lab::Matrix, from: &str) -> bool {
    matrix[&(
        from.to_string(),
        "monitoring/prometheus".to_string(),
        9090,
        "TCP".to_string(),
    )]
}

/// An audit-mode policy lets everything through, while what it would drop is counted in
/// `/metrics`, written to the agent's verdict log and streamed by `weir monitor`; once
/// enforced it drops. Returns the verdicts the log recorded while it was in audit mode.
fn audit_mode(lab: &Lab, dataplane: &str) -> Verdicts {
    let (_, before) = lab.probe(&[]).unwrap();
    assert!(reaches_prometheus(&before, "shop/api"));
    let monitor = Monitor::start(lab);
    let audit = weir_tests::lab::manifest(
        lab,
        "audit.yaml",
        &PROMETHEUS_FROM_WEB.replace("MODE", "audit"),
    );
    lab.weir(&["apply", audit.to_str().unwrap()]).unwrap();
    let (_, audited) = lab.probe(&[]).unwrap();
    let text = metrics(lab);
    assert!(
        sample(&text, "weir_policy_implementation_delay_seconds_count").is_some_and(|n| n >= 1.0),
        "{dataplane}: the change's implementation delay is observed:\n{text}"
    );
    assert_eq!(
        audited, before,
        "{dataplane}: an audit-mode policy changed what connects"
    );

    let series = |verdict: &str| {
        format!("weir_policy_verdicts_total{{namespace=\"monitoring\",policy=\"prometheus-from-web\",direction=\"ingress\",verdict=\"{verdict}\"}}")
    };
    // web's scrape is the policy's own allow; api's would be dropped.
    counted_within_30s(
        lab,
        &format!("{dataplane}: audit and allow verdicts of prometheus-from-web"),
        &[&series("audit"), &series("allow")],
    );
    // The same records in `weir monitor` and in the agent's log (the lab agent's stderr).
    let streamed = monitor.stop();
    let log = std::fs::read_to_string(lab.dir.join("agent.log")).expect("the lab agent's log");
    let logged = json_lines(&log);
    for (source, records) in [("weir monitor", &streamed), ("the agent's log", &logged)] {
        let is_audit = |e: &&Value| {
            e["verdict"] == "audit"
                && e["rule"] == "monitoring/prometheus-from-web ingress audit: would be dropped"
                && e["pod"] == "monitoring/prometheus"
                && e["src_pod"] == "shop/api"
                && e["dst_pod"] == "monitoring/prometheus"
                && e["dport"] == 9090
                && e["dataplane"] == dataplane
        };
        assert!(
            records.iter().any(|e| is_audit(&e)),
            "{dataplane}: {source} shows no audit verdict of prometheus-from-web:\n{records:#?}"
        );
        // Default denies name the policies that isolate the pod.
        assert!(
            records.iter().any(|e| e["verdict"] == "drop"
                && e["reason"] == "policy-deny"
                && e["rule"]
                    .as_str()
                    .is_some_and(|r| r.starts_with("default deny by shop/"))
                && e["src_pod"].is_string()
                && e["dst_pod"].is_string()),
            "{dataplane}: {source} shows no named default deny:\n{records:#?}"
        );
    }

    // Enforced: web still scrapes, api no longer.
    let enforce = weir_tests::lab::manifest(
        lab,
        "enforce.yaml",
        &PROMETHEUS_FROM_WEB.replace("MODE", "enforce"),
    );
    lab.weir(&["apply", enforce.to_str().unwrap()]).unwrap();
    let (_, enforced) = lab.probe(&[]).unwrap();
    assert!(
        reaches_prometheus(&enforced, "shop/web"),
        "{dataplane}: enforced"
    );
    assert!(
        !reaches_prometheus(&enforced, "shop/api"),
        "{dataplane}: enforced"
    );
    verdicts(&logged)
}

#[test]
fn status_and_metrics_agree_on_both_dataplanes() {
    weir_tests::require_root_and_tools();
    let (ebpf, ebpf_verdicts) = status_and_metrics("ebpf");
    let (iptables, iptables_verdicts) = status_and_metrics("iptables");
    assert_eq!(
        ebpf_verdicts, iptables_verdicts,
        "the dataplanes' verdict logs (left eBPF, right iptables) name different verdicts"
    );
    // In the demo each connection is allowed by one rule only, so both dataplanes must
    // count the same policies.
    let expected: Allowed = [
        "web-public",
        "api-from-web",
        "db-from-api",
        "metrics-from-monitoring",
    ]
    .iter()
    .map(|p| ("shop".to_string(), p.to_string(), "ingress".to_string()))
    .collect();
    assert_eq!(ebpf, expected, "eBPF counted allows for these policies");
    assert_eq!(
        iptables, expected,
        "iptables counted allows for these policies"
    );
}

/// A policy beside `web-public` that selects shop/web too, admitting nothing new: applying
/// or deleting it makes web's ingress chain again.
const WEB_EXTRA: &str = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: web-extra, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Ingress]
  ingress: [{ports: [{port: 81, protocol: TCP}]}]
"#;

/// Rounds of probes, `between` after each; how many connections the `web-public` rule let
/// in, and whether the agent counted at least those (polling its metrics up to 15 s).
fn web_public_allows_counted(lab: &Lab, between: impl Fn(usize)) -> (u64, u64, u64) {
    let series = "weir_policy_verdicts_total{namespace=\"shop\",policy=\"web-public\",direction=\"ingress\",verdict=\"allow\"}";
    let counted = || sample(&metrics(lab), series).unwrap_or(0.0) as u64;
    let before = counted();
    let mut connections = 0;
    for round in 0..4 {
        let (_, matrix) = lab.probe(&[]).unwrap();
        connections += matrix
            .iter()
            .filter(|((_, to, port, proto), connected)| {
                **connected && to == "shop/web" && *port == 80 && proto == "TCP"
            })
            .count() as u64;
        between(round);
    }
    assert!(connections > 0, "no probe reached shop/web on 80/TCP");
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut now = counted();
    while now < before + connections && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        now = counted();
    }
    (before, connections, now)
}

/// A write that makes a chain again restarts its rules' counters: what they counted since
/// the agent's last read (every 5 s) must still be counted. Two ways on iptables: the
/// periodic repair, which writes every rule again, and a policy change that makes web's
/// chain again after each round of probes. On 5.10, a repair between a probe and the next
/// read lost its counts; this test counted 0 of 8 allows before the fix.
///
/// A packet counted between the carry's read and the restore's commit is still lost: no
/// atomic read-and-replace exists. So each round of probes starts right after a repair
/// ends and is over before the next (every 5 s): with a repair every second, under
/// emulation, the two overlapped and 6 of 8 allows were counted.
#[test]
fn iptables_counts_survive_rewrites_of_their_chains() {
    let extra = std::env::temp_dir().join(format!("weir-web-extra-{}.yaml", std::process::id()));
    std::fs::write(&extra, WEB_EXTRA).unwrap();
    for (name, resync, changes) in [("repair", "5", false), ("change", "60", true)] {
        let lab = Lab::new(&format!("status-{name}"));
        lab.weir(&[
            "up",
            "--dataplane",
            "iptables",
            &format!("--agent-arg=--resync-seconds={resync}"),
            demo_world().to_str().unwrap(),
        ])
        .expect("lab up");
        if !changes {
            after_next_repair(&lab);
        }
        let (before, connections, now) = web_public_allows_counted(&lab, |round| {
            if changes {
                let verb = if round % 2 == 0 { "apply" } else { "delete" };
                lab.weir(&[verb, extra.to_str().unwrap()]).unwrap();
            } else {
                after_next_repair(&lab);
            }
        });
        lab.weir(&["down"]).unwrap();
        assert!(
            now >= before + connections,
            "{name}: web-public's allows: {now} counted, at least {} expected ({before} before, then {connections} connections)",
            before + connections
        );
    }
    let _ = std::fs::remove_file(&extra);
}

/// Returns once the agent's status shows a periodic repair that ended after this call.
fn after_next_repair(lab: &Lab) {
    let last = || -> Value {
        let status: Value =
            serde_json::from_str(&lab.weir(&["status", "--output", "json"]).unwrap()).unwrap();
        status["last_converge"].clone()
    };
    let seen = last();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = last();
        if now != seen && now["trigger"] == "resync" {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no periodic repair within 30 s; last converge: {now}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// ClusterNetworkPolicies over the demo world: both tiers, a Pass, networks, a node
/// peer and every protocol, so that the repair below compares every kind of rule the
/// iptables dataplane writes.
const TIERS: &str = r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: guard}
spec:
  tier: Admin
  priority: 1
  subject: {namespaces: {matchLabels: {kubernetes.io/metadata.name: shop}}}
  ingress:
  - {action: Pass, from: [{namespaces: {matchLabels: {kubernetes.io/metadata.name: monitoring}}}], protocols: [{tcp: {destinationPort: {number: 9090}}}]}
  egress:
  - {action: Deny, to: [{networks: [192.0.2.0/24, "2001:db8::/64"]}], protocols: [{udp: {destinationPort: {number: 53}}}, {sctp: {destinationPort: {number: 5000}}}]}
  - {action: Accept, to: [{nodes: {matchLabels: {kubernetes.io/hostname: lab-node}}}], protocols: [{tcp: {destinationPort: {range: {start: 10250, end: 10255}}}}]}
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: floor}
spec:
  tier: Baseline
  priority: 1
  subject: {namespaces: {}}
  ingress:
  - {action: Deny, from: [{namespaces: {}}], protocols: [{tcp: {destinationPort: {number: 5432}}}]}
"#;

/// On a node where nothing drifted, the periodic repair reads the rules back and writes
/// none: every rule weir writes reads back from `iptables-save` as it was written, on a
/// routed and a bridged node, IPv4 and IPv6, with the verdict log (NFLOG rules) and
/// both tiers. A chain a repair writes again is logged by name, which this test reads.
#[test]
fn an_iptables_repair_of_an_undrifted_node_writes_nothing() {
    let tiers = std::env::temp_dir().join(format!("weir-tiers-{}.yaml", std::process::id()));
    std::fs::write(&tiers, TIERS).unwrap();
    for topology in ["routed", "bridge"] {
        let lab = Lab::new(&format!("repair-{topology}"));
        lab.weir(&[
            "up",
            "--dataplane",
            "iptables",
            "--topology",
            topology,
            "--agent-arg=--resync-seconds=2",
            demo_world().to_str().unwrap(),
        ])
        .expect("lab up");
        lab.weir(&["apply", tiers.to_str().unwrap()])
            .expect("apply the tiers");
        after_next_repair(&lab);
        after_next_repair(&lab);
        let log = std::fs::read_to_string(lab.dir.join("agent.log")).unwrap_or_default();
        lab.weir(&["down"]).unwrap();
        let rewrote: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("repair: rewrote chains") || l.contains("differs"))
            .collect();
        assert!(
            rewrote.is_empty(),
            "{topology}: a repair with nothing drifted wrote chains again:\n{}",
            rewrote.join("\n")
        );
    }
    let _ = std::fs::remove_file(&tiers);
}
