//! weir in cluster mode against the real kube-apiserver and etcd (`weir-lab up --api
//! server`), as the DaemonSet runs it: with deploy/'s ServiceAccount, ClusterRole and
//! ClusterRoleBinding and nothing more, on both dataplanes, proven with real packets.
//!
//! - The RBAC is enough (no request of the agent is ever forbidden, in the server's own
//!   audit log) and not more than enough (every verb on every resource the ClusterRole
//!   grants is used in the run).
//! - Watch semantics on the real server: an agent restart while objects change, an API
//!   server restart during which enforcement stays as it was, a forced relist after etcd
//!   compaction (410 Gone), and an agent started while the API server is down.
//! - The same agent reading from `weir relay`'s etcd (`weir-lab up --relay`): an API
//!   server restart is the relay's relist, not the agent's; the relay's restart and its
//!   store's compaction.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use weir_tests::lab::{manifest, Lab, Matrix};

const AGENT_USER: &str = "system:serviceaccount:kube-system:weir";

fn demo_world() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/demo.yaml")
}

/// Isolates prometheus, which the demo leaves open to everyone.
const CLOSE_PROMETHEUS: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: closed, namespace: monitoring}\nspec:\n  podSelector: {matchLabels: {app: prometheus}}\n  policyTypes: [Ingress]\n";

fn node(dataplane_label: &str) -> String {
    format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: lab-node\n  labels: {{weir.io/dataplane: {dataplane_label}}}\n")
}

/// Whether shop/web reaches prometheus:9090, the one verdict CLOSE_PROMETHEUS changes.
fn web_reaches_prometheus(matrix: &Matrix) -> bool {
    *matrix
        .get(&(
            "shop/web".to_string(),
            "monitoring/prometheus".to_string(),
            9090,
            "TCP".to_string(),
        ))
        .expect("the matrix has shop/web -> monitoring/prometheus 9090/TCP")
}

fn up(tag: &str, dataplane: &str) -> Lab {
    up_with(tag, dataplane, &[])
}

/// A lab with its own control plane; `env` is passed to `weir-lab up`, and so to its agent.
fn up_with(tag: &str, dataplane: &str, env: &[(&str, &str)]) -> Lab {
    let lab = Lab::new(tag);
    let started = Instant::now();
    let out = lab
        .weir_env(
            &[
                "up",
                "--api",
                "server",
                "--dataplane",
                dataplane,
                demo_world().to_str().unwrap(),
            ],
            env,
        )
        .unwrap_or_else(|e| panic!("{dataplane}: lab up --api server: {e}"));
    assert!(
        out.status.success(),
        "{dataplane}: lab up --api server: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "{dataplane}: lab up with its own etcd and kube-apiserver in {:.1?}",
        started.elapsed()
    );
    lab
}

fn probe(lab: &Lab, dataplane: &str) -> Matrix {
    let (reported, matrix) = lab.probe(&[]).expect("probe");
    assert_eq!(reported, dataplane, "the agent enforces another dataplane");
    matrix
}

/// Every audit event of the agent's identity, from the server's audit log.
fn agent_audit(lab: &Lab) -> Vec<serde_json::Value> {
    let log = lab.dir.join("api/audit.log");
    let text = std::fs::read_to_string(&log)
        .unwrap_or_else(|e| panic!("prerequisite missing: the audit log {}: {e}", log.display()));
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["user"]["username"] == AGENT_USER)
        .collect()
}

/// Every request the agent's identity made, from the server's audit log: (group,
/// resource[/subresource], verb, response code).
fn agent_requests(lab: &Lab) -> Vec<(String, String, String, u64)> {
    agent_audit(lab)
        .into_iter()
        .map(|e| {
            let o = &e["objectRef"];
            let mut resource = o["resource"].as_str().unwrap_or("").to_string();
            if let Some(sub) = o["subresource"].as_str() {
                resource = format!("{resource}/{sub}");
            }
            (
                o["apiGroup"].as_str().unwrap_or("").to_string(),
                resource,
                e["verb"].as_str().unwrap_or("").to_string(),
                e["responseStatus"]["code"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

/// (group, resource, verb) for every rule of deploy/clusterrole.yaml.
fn granted() -> BTreeSet<(String, String, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/clusterrole.yaml");
    let role: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let strings = |v: &serde_yaml::Value| -> Vec<String> {
        v.as_sequence()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect()
    };
    let mut out = BTreeSet::new();
    for rule in role["rules"].as_sequence().expect("rules") {
        for g in strings(&rule["apiGroups"]) {
            for r in strings(&rule["resources"]) {
                for v in strings(&rule["verbs"]) {
                    out.insert((g.clone(), r.clone(), v));
                }
            }
        }
    }
    out
}

fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not after {timeout:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn rbac_is_enough_and_every_grant_is_used(dataplane: &'static str) {
    let lab = up(&format!("rbac-{dataplane}"), dataplane);
    let closed = manifest(&lab, "closed.yaml", CLOSE_PROMETHEUS);
    lab.weir(&["apply", closed.to_str().unwrap()]).unwrap();
    assert!(!web_reaches_prometheus(&probe(&lab, dataplane)));
    lab.weir(&["delete", closed.to_str().unwrap()]).unwrap();
    assert!(web_reaches_prometheus(&probe(&lab, dataplane)));

    // An unusable dataplane label is reported as an Event on the Node (create); the same
    // again after a good label is the same Event again (patch of its series).
    let bad = manifest(&lab, "bad-node.yaml", &node("bogus"));
    let good = manifest(&lab, "good-node.yaml", &node(dataplane));
    let events = |verb: &str| {
        agent_requests(&lab)
            .iter()
            .filter(|(g, r, v, code)| {
                g == "events.k8s.io" && r == "events" && v == verb && *code < 300
            })
            .count()
    };
    lab.weir(&["apply", "--no-wait", bad.to_str().unwrap()])
        .unwrap();
    wait_until(
        "an Event for the bad label",
        Duration::from_secs(30),
        || events("create") > 0,
    );
    lab.weir(&["apply", good.to_str().unwrap()]).unwrap();
    lab.weir(&["apply", "--no-wait", bad.to_str().unwrap()])
        .unwrap();
    wait_until(
        "the Event's series patched",
        Duration::from_secs(30),
        || events("patch") > 0,
    );
    lab.weir(&["apply", good.to_str().unwrap()]).unwrap();
    assert!(web_reaches_prometheus(&probe(&lab, dataplane)));

    let requests = agent_requests(&lab);
    assert!(
        !requests.is_empty(),
        "the audit log has no request of {AGENT_USER}"
    );
    let forbidden: Vec<_> = requests.iter().filter(|r| r.3 == 403).collect();
    assert!(
        forbidden.is_empty(),
        "{dataplane}: deploy/clusterrole.yaml is not enough: forbidden {forbidden:?}"
    );
    let used: BTreeSet<(String, String, String)> = requests
        .iter()
        .map(|(g, r, v, _)| (g.clone(), r.clone(), v.clone()))
        .collect();
    let grants = granted();
    eprintln!("{dataplane}: the ClusterRole grants, and each is used:");
    for g in &grants {
        eprintln!("  {:<16} {:<16} {}", g.0, g.1, g.2);
    }
    let unused: Vec<_> = grants.difference(&used).collect();
    assert!(
        unused.is_empty(),
        "{dataplane}: deploy/clusterrole.yaml grants more than the agent uses: {unused:?} (used: {used:?})"
    );
    let ungranted: Vec<_> = used.difference(&grants).collect();
    assert!(
        ungranted.is_empty(),
        "{dataplane}: requests outside the ClusterRole that were not forbidden: {ungranted:?}"
    );
}

#[test]
fn ebpf_the_daemonset_rbac_is_enough_and_every_grant_is_used() {
    rbac_is_enough_and_every_grant_is_used("ebpf");
}

#[test]
fn iptables_the_daemonset_rbac_is_enough_and_every_grant_is_used() {
    rbac_is_enough_and_every_grant_is_used("iptables");
}

fn listings(lab: &Lab) -> usize {
    std::fs::read_to_string(lab.dir.join("agent.log"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("listing"))
        .count()
}

/// `lists`: the agent's `--lists` (its environment's `WEIR_LISTS`), for every start of it.
/// The Pods are read in protobuf either way (the agent's default), so this covers both of
/// the Pod watcher's list paths against the real server: its 410s, restarts and late start.
fn watch_semantics(dataplane: &'static str, lists: &'static str) {
    // Pages of two objects: the demo's pods take several, each asked for while the one
    // before is decoded.
    let env: &[(&str, &str)] = match lists {
        "pages" => &[("WEIR_LISTS", "pages"), ("WEIR_LIST_PAGE_SIZE", "2")],
        _ => &[("WEIR_LISTS", "stream")],
    };
    let lab = up_with(&format!("watch-{dataplane}"), dataplane, env);
    let start_agent = |extra: &[(&'static str, &'static str)]| {
        let env: Vec<_> = env.iter().chain(extra).copied().collect();
        let out = lab.weir_env(&["agent", "start"], &env).unwrap();
        assert!(out.status.success(), "agent start: {out:?}");
    };
    let closed = manifest(&lab, "closed.yaml", CLOSE_PROMETHEUS);
    let path = closed.to_str().unwrap();
    let open = probe(&lab, dataplane);
    assert!(web_reaches_prometheus(&open));

    // 1. The agent killed while a policy is created: enforcement stays as it was until a
    //    new agent lists the change.
    lab.weir(&["agent", "signal", "kill"]).unwrap();
    lab.weir(&["apply", "--no-wait", path]).unwrap();
    assert_eq!(
        probe(&lab, dataplane),
        open,
        "{dataplane}: changed with no agent"
    );
    start_agent(&[]);
    lab.weir(&["apply", path]).unwrap();
    let closed_matrix = probe(&lab, dataplane);
    assert!(
        !web_reaches_prometheus(&closed_matrix),
        "{dataplane}: restarted agent"
    );

    // 2. The API server restarts: nothing changes on the node meanwhile, and the watches
    //    resume (a deletion afterwards is enforced).
    lab.weir(&["api", "stop"]).unwrap();
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        probe(&lab, dataplane),
        closed_matrix,
        "{dataplane}: enforcement changed while the API server was down"
    );
    lab.weir(&["api", "start"]).unwrap();
    lab.weir(&["delete", path]).unwrap();
    assert_eq!(
        probe(&lab, dataplane),
        open,
        "{dataplane}: after the API server restart"
    );

    // 3. 410 Gone: the agent frozen and cut off (its connections closed by a server
    //    restart) while the policy is created; etcd compacted past the agent's
    //    resourceVersion and the server restarted again, so the watches cannot resume:
    //    only a relist shows the policy.
    let before = listings(&lab);
    lab.weir(&["agent", "signal", "stop"]).unwrap();
    lab.weir(&["api", "stop"]).unwrap();
    lab.weir(&["api", "start"]).unwrap();
    lab.weir(&["apply", "--no-wait", path]).unwrap();
    lab.weir(&["api", "stop"]).unwrap();
    let revision = lab.weir(&["api", "compact"]).unwrap();
    eprintln!(
        "{dataplane}: etcd compacted at revision {}",
        revision.trim()
    );
    lab.weir(&["api", "start"]).unwrap();
    lab.weir(&["agent", "signal", "cont"]).unwrap();
    wait_until(
        &format!("{dataplane}: a relist after 410 Gone"),
        Duration::from_secs(60),
        || listings(&lab) > before,
    );
    lab.weir(&["apply", path]).unwrap();
    assert_eq!(
        probe(&lab, dataplane),
        closed_matrix,
        "{dataplane}: after 410"
    );

    // 4. An agent started while the API server is down, with a resync far shorter than
    //    the outage: it changes nothing on the node until it has listed everything.
    lab.weir(&["api", "stop"]).unwrap();
    lab.weir(&["agent", "signal", "kill"]).unwrap();
    start_agent(&[("WEIR_RESYNC_SECONDS", "1")]);
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(
        probe(&lab, dataplane),
        closed_matrix,
        "{dataplane}: an agent that could not reach its API server changed enforcement"
    );
    // `weir status` says why: nothing listed yet, and the source's error.
    let waiting = status(&lab);
    assert_eq!(waiting["sync"]["complete"], false, "{waiting:#}");
    assert!(
        waiting["sync"]["waiting"]
            .as_array()
            .is_some_and(|w| w.iter().any(|k| k == "pods")),
        "{waiting:#}"
    );
    assert!(waiting["sync"]["last_error"].is_string(), "{waiting:#}");
    assert!(waiting["dataplane"].is_null(), "{waiting:#}");
    lab.weir(&["api", "start"]).unwrap();
    lab.weir(&["delete", path]).unwrap();
    assert_eq!(
        probe(&lab, dataplane),
        open,
        "{dataplane}: after the late start"
    );
    let synced = status(&lab);
    assert_eq!(synced["node"], "lab-node", "{synced:#}");
    assert_eq!(synced["dataplane"], dataplane, "{synced:#}");
    assert_eq!(synced["converged"], true, "{synced:#}");
    assert_eq!(synced["sync"]["complete"], true, "{synced:#}");
    // The demo's five policies (CLOSE_PROMETHEUS deleted again).
    assert_eq!(synced["enforced"]["policies"], 5, "{synced:#}");
    assert_eq!(synced["enforced"]["endpoints"], 4, "{synced:#}");
    // The agent read the Pods as asked: LIST requests with pages, none with streaming
    // lists (their watches send the objects first).
    let pod_lists = agent_requests(&lab)
        .iter()
        .filter(|(group, resource, verb, _)| {
            group.is_empty() && resource == "pods" && verb == "list"
        })
        .count();
    let continued = agent_audit(&lab)
        .iter()
        .filter_map(|e| e["requestURI"].as_str())
        .filter(|uri| uri.starts_with("/api/v1/pods?") && uri.contains("continue="))
        .count();
    match lists {
        "pages" => {
            assert!(pod_lists >= 3, "{dataplane}: {pod_lists} LISTs of the Pods");
            assert!(
                continued >= 3,
                "{dataplane}: {continued} later pages of the Pods"
            );
        }
        _ => assert_eq!(
            pod_lists, 0,
            "{dataplane}: LISTs of the Pods with streaming lists"
        ),
    }
    // ... in protobuf, as asked, and never in JSON.
    let log = std::fs::read_to_string(lab.dir.join("agent.log")).unwrap_or_default();
    assert!(
        log.contains("the API server sends Pods in protobuf"),
        "{dataplane}: no protobuf in the agent's log"
    );
    assert!(
        !log.contains("the API server sends Pods in JSON"),
        "{dataplane}: Pods in JSON"
    );
}

/// `weir-lab status --output json`: the lab agent's `/status`.
fn status(lab: &Lab) -> serde_json::Value {
    let text = lab
        .weir(&["status", "--output", "json"])
        .expect("weir-lab status");
    serde_json::from_str(&text).expect("weir-lab status prints JSON")
}

#[test]
fn ebpf_watch_semantics_on_the_real_api_server() {
    watch_semantics("ebpf", "pages");
}

#[test]
fn iptables_watch_semantics_on_the_real_api_server() {
    // The same scenario; the streaming lists are the source's, not the dataplane's.
    watch_semantics("iptables", "stream");
}

fn relay_listings(lab: &Lab) -> usize {
    std::fs::read_to_string(lab.dir.join("api/relay.log"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(r#""message":"listing""#))
        .count()
}

/// The agent reading every object from the relay's etcd (`weir agent --relay`), the relay
/// watching the real API server.
fn relay_semantics(dataplane: &'static str) {
    let lab = Lab::new(&format!("relay-{dataplane}"));
    let out = lab
        .weir_raw(&[
            "up",
            "--api",
            "server",
            "--relay",
            "--dataplane",
            dataplane,
            demo_world().to_str().unwrap(),
        ])
        .unwrap();
    assert!(
        out.status.success(),
        "{dataplane}: lab up --relay: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let closed = manifest(&lab, "closed.yaml", CLOSE_PROMETHEUS);
    let path = closed.to_str().unwrap();
    let open = probe(&lab, dataplane);
    assert!(web_reaches_prometheus(&open));
    lab.weir(&["apply", path]).unwrap();
    let closed_matrix = probe(&lab, dataplane);
    assert!(
        !web_reaches_prometheus(&closed_matrix),
        "{dataplane}: via the relay"
    );

    // Its etcd answers only a client with a certificate of its CA: whoever could write
    // there would decide the node's policy.
    let plane = weir_lab::control_plane::ControlPlane::new(lab.dir.join("api"));
    let node = lab.node_netns();
    let records = plane.relay_store_count(&node, "/weir/v1/", true);
    assert!(
        records.as_ref().is_ok_and(|n| *n > 6),
        "{dataplane}: the relay's records: {records:?}"
    );
    let refused = plane.relay_store_count(&node, "/weir/v1/", false);
    assert!(
        refused.is_err(),
        "{dataplane}: a client without a certificate read {refused:?}"
    );

    // 1. The API server restarts with history compacted away (410 Gone for every watch
    //    on it): the relay lists again, the agent does not (its watches are on the
    //    relay's etcd, whose revisions did not change), and a change after it arrives.
    let (agent_before, relay_before) = (listings(&lab), relay_listings(&lab));
    lab.weir(&["api", "stop"]).unwrap();
    lab.weir(&["api", "compact"]).unwrap();
    lab.weir(&["api", "start"]).unwrap();
    lab.weir(&["delete", path]).unwrap();
    assert_eq!(
        probe(&lab, dataplane),
        open,
        "{dataplane}: after the API server restart"
    );
    wait_until(
        &format!("{dataplane}: the relay's relist after the restart"),
        Duration::from_secs(60),
        || relay_listings(&lab) > relay_before,
    );
    assert_eq!(
        listings(&lab),
        agent_before,
        "{dataplane}: the agent listed again after the API server's restart"
    );

    // 2. The relay down while a policy is created: enforcement stays as it was; once the
    //    relay is back it has the change, and the agent's watches carry it, no relist.
    lab.weir(&["relay", "stop"]).unwrap();
    lab.weir(&["apply", "--no-wait", path]).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        probe(&lab, dataplane),
        open,
        "{dataplane}: changed with no relay"
    );
    lab.weir(&["relay", "start"]).unwrap();
    lab.weir(&["apply", path]).unwrap();
    assert_eq!(
        probe(&lab, dataplane),
        closed_matrix,
        "{dataplane}: after the relay's restart"
    );
    assert_eq!(
        listings(&lab),
        agent_before,
        "{dataplane}: the agent listed again after the relay's restart"
    );

    // 3. The relay's etcd compacted past the frozen agent's revision and restarted (which
    //    cuts the agent's watches): they cannot resume, so it lists from the relay's store
    //    again, and has the change made meanwhile.
    lab.weir(&["agent", "signal", "stop"]).unwrap();
    lab.weir(&["delete", "--no-wait", path]).unwrap();
    // The relay writes it within milliseconds; the compaction must come after it.
    std::thread::sleep(Duration::from_secs(2));
    let revision = lab.weir(&["relay", "compact"]).unwrap();
    eprintln!(
        "{dataplane}: the relay's etcd compacted at revision {}",
        revision.trim()
    );
    lab.weir(&["relay", "stop-store"]).unwrap();
    lab.weir(&["relay", "start-store"]).unwrap();
    lab.weir(&["agent", "signal", "cont"]).unwrap();
    wait_until(
        &format!("{dataplane}: the agent's relist after the relay's compaction"),
        Duration::from_secs(60),
        || listings(&lab) > agent_before,
    );
    lab.weir(&["delete", path]).unwrap_or_default();
    assert_eq!(
        probe(&lab, dataplane),
        open,
        "{dataplane}: after the relay's compaction"
    );

    // 4. An agent started while the relay's etcd is down: it changes nothing until it
    //    reaches the store and has listed everything, and says why meanwhile.
    lab.weir(&["agent", "signal", "kill"]).unwrap();
    lab.weir(&["relay", "stop-store"]).unwrap();
    let out = lab
        .weir_env(&["agent", "start"], &[("WEIR_RESYNC_SECONDS", "1")])
        .unwrap();
    assert!(out.status.success(), "agent start: {out:?}");
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        probe(&lab, dataplane),
        open,
        "{dataplane}: an agent without its store changed enforcement"
    );
    let waiting = status(&lab);
    assert_eq!(waiting["sync"]["complete"], false, "{waiting:#}");
    assert!(
        waiting["sync"]["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("relay")),
        "{waiting:#}"
    );
    lab.weir(&["relay", "start-store"]).unwrap();
    lab.weir(&["apply", path]).unwrap();
    assert_eq!(
        probe(&lab, dataplane),
        closed_matrix,
        "{dataplane}: after the store came back"
    );
    lab.weir(&["delete", path]).unwrap();

    let synced = status(&lab);
    assert_eq!(synced["converged"], true, "{synced:#}");
    assert_eq!(synced["sync"]["complete"], true, "{synced:#}");
    assert_eq!(synced["enforced"]["policies"], 5, "{synced:#}");
    // The agent never listed or watched the API server itself: the relay did.
    let log = std::fs::read_to_string(lab.dir.join("agent.log")).unwrap_or_default();
    assert!(
        log.contains("reading from the relay"),
        "{dataplane}: not in relay mode"
    );
    assert!(
        !log.contains("the API server sends Pods"),
        "{dataplane}: the agent read Pods from the API server"
    );
}

#[test]
fn ebpf_reads_from_the_relay() {
    relay_semantics("ebpf");
}

#[test]
fn iptables_reads_from_the_relay() {
    relay_semantics("iptables");
}

/// `kubectl apply --dry-run=server -k DIR` against the lab's API server.
fn dry_run(lab: &Lab, kubeconfig: &Path, dir: &Path) -> weir::exec::ToolOutput {
    weir_tests::netns::NetNs::attach(&lab.node_netns())
        .run(
            "kubectl",
            &[
                "--kubeconfig",
                kubeconfig.to_str().unwrap(),
                "apply",
                "--dry-run=server",
                "-k",
                dir.to_str().unwrap(),
            ],
            None,
        )
        .expect("running kubectl (cargo xtask setup installs it)")
}

/// deploy/ as the real kube-apiserver admits it: `kubectl apply --dry-run=server -k deploy/`
/// (admission and validation, such as the rules on privileged containers, capabilities
/// and mount propagation, which rendering alone does not apply).
#[test]
fn the_real_api_server_admits_deploy() {
    let lab = Lab::new("deploy-admitted");
    lab.weir(&[
        "up",
        "--api",
        "server",
        "--without-agent",
        demo_world().to_str().unwrap(),
    ])
    .expect("lab up --api server");
    let kubeconfig = lab.dir.join("api/kubeconfig-admin");
    let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let out = dry_run(&lab, &kubeconfig, &deploy);
    let stdout = &out.stdout;
    assert!(
        out.success,
        "the API server refused deploy/: {}{stdout}",
        out.stderr
    );
    assert!(
        stdout.contains("daemonset.apps/weir created (server dry run)"),
        "kubectl did not admit the DaemonSet: {stdout}"
    );

    // With the relay: deploy/ copied, its `components: [relay]` uncommented.
    let copy = lab.dir.join("deploy-with-relay");
    let out = std::process::Command::new("cp")
        .args(["-r", deploy.to_str().unwrap(), copy.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "cp -r deploy: {out:?}");
    let kustomization = copy.join("kustomization.yaml");
    let text = std::fs::read_to_string(&kustomization).unwrap();
    let with_relay = text.replace("# components:\n#   - relay", "components:\n  - relay");
    assert_ne!(
        text, with_relay,
        "deploy/kustomization.yaml names no relay component"
    );
    std::fs::write(&kustomization, with_relay).unwrap();
    let out = dry_run(&lab, &kubeconfig, &copy);
    let stdout = &out.stdout;
    assert!(
        out.success,
        "the API server refused deploy/ with the relay: {}{stdout}",
        out.stderr
    );
    for created in [
        "deployment.apps/weir-relay created (server dry run)",
        "service/weir-relay created (server dry run)",
        "clusterrole.rbac.authorization.k8s.io/weir-relay created (server dry run)",
        "daemonset.apps/weir created (server dry run)",
    ] {
        assert!(
            stdout.contains(created),
            "kubectl did not admit {created}: {stdout}"
        );
    }
}

/// A policy every node refuses gets one Event, not one per node: two nodes' publishers
/// (as two agents would run them, with the DaemonSet's ServiceAccount) report the same
/// refusal to the real API server, which keeps the first node's Event and answers the
/// second's with AlreadyExists. A dataplane fallback and a switch go on the Node.
#[test]
fn a_refused_policy_gets_one_event_however_many_nodes_report_it() {
    use weir::daemon::publish::{cluster_event_name, KubePublisher};
    use weir::daemon::run::Publisher;
    use weir::daemon::status::Status;
    use weir::dataplane::DataplaneKind;
    use weir_lab::control_plane::{ControlPlane, Identity};
    use weir_policy::model::{Kind, ObjectRef};

    let lab = up("events", "iptables");
    let policy = ObjectRef::new(Kind::NetworkPolicy, Some("shop"), "web-public");
    let reason = "spec.ingress[0]: refused by the test".to_string();
    let refused = std::collections::BTreeMap::from([(policy.clone(), reason.clone())]);
    let plane = ControlPlane::new(lab.dir.join("api"));
    let netns = lab.node_netns();
    plane
        .block_on(&netns, Identity::Agent, |client| async move {
            let mut nodes: Vec<KubePublisher> = ["node-a", "node-b"]
                .iter()
                .map(|n| KubePublisher::spawn(client.clone(), n.to_string()))
                .collect();
            let status = |dataplane, fallback: Option<&str>| Status {
                generation: 0,
                converged: true,
                dataplane: Some(dataplane),
                fallback_reason: fallback.map(str::to_string),
                errors: Vec::new(),
                state_digest: None,
                change_received_monotonic_ns: None,
                startup: None,
            };
            for node in &mut nodes {
                node.publish(&status(DataplaneKind::Ebpf, None), &refused);
            }
            // node-a falls back, then switches: two Events on node-a.
            nodes[0].publish(
                &status(
                    DataplaneKind::Iptables,
                    Some("auto: eBPF unavailable: test"),
                ),
                &refused,
            );
            // The publishers send from background tasks: give them time.
            tokio::time::sleep(Duration::from_secs(3)).await;
        })
        .expect("the publishers ran");
    let events: Vec<serde_json::Value> = plane
        .block_on(&netns, Identity::Admin, |client| async move {
            let api: kube::Api<k8s_openapi::api::events::v1::Event> = kube::Api::all(client);
            api.list(&Default::default())
                .await
                .expect("list events")
                .items
                .into_iter()
                .map(|e| serde_json::to_value(e).unwrap())
                .collect()
        })
        .expect("events listed");
    let about = |kind: &str, name: &str| -> Vec<&serde_json::Value> {
        events
            .iter()
            .filter(|e| e["regarding"]["kind"] == kind && e["regarding"]["name"] == name)
            .collect()
    };
    let on_policy = about("NetworkPolicy", "web-public");
    assert_eq!(
        on_policy.len(),
        1,
        "one Event for the policy: {on_policy:#?}"
    );
    assert_eq!(
        on_policy[0]["metadata"]["name"],
        cluster_event_name(&policy, &reason)
    );
    assert_eq!(on_policy[0]["reason"], "PolicyNotEnforced");
    assert_eq!(on_policy[0]["note"], reason.as_str());
    let on_node: Vec<&str> = about("Node", "node-a")
        .iter()
        .filter_map(|e| e["reason"].as_str())
        .collect();
    assert!(
        on_node.contains(&"DataplaneFallback") && on_node.contains(&"DataplaneSwitched"),
        "node-a's fallback and switch: {on_node:?}"
    );
    assert!(about("Node", "node-b").is_empty(), "node-b changed nothing");
}
