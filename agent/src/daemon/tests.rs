//! The run loop's ordering guarantees, with backends that record what they are asked.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::metrics::Metrics;
use super::run::{Daemon, Health, RunOptions};
use super::select::DataplaneChoice;
use super::status::Status;
use super::testing::{Given, Log, RecordingNode};
use crate::dataplane::DataplaneKind;
use crate::source::event::{Batch, Event};
use weir_policy::manifest::parse_str;

struct World {
    log: Log,
    status: std::path::PathBuf,
    health: Arc<Health>,
    metrics: Arc<Metrics>,
    refuse_applies: Arc<AtomicBool>,
    given: Given,
    daemon: Daemon<RecordingNode>,
}

fn world(tag: &str, ebpf: Result<(), &'static str>, undeletable: Vec<&'static str>) -> World {
    world_choosing(tag, ebpf, undeletable, DataplaneChoice::Auto)
}

fn world_choosing(
    tag: &str,
    ebpf: Result<(), &'static str>,
    undeletable: Vec<&'static str>,
    default_choice: DataplaneChoice,
) -> World {
    let log: Log = Arc::default();
    let dir = std::env::temp_dir().join(format!("weir-daemon-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let status = dir.join("status.json");
    let health = Arc::new(Health::default());
    let opts = RunOptions {
        default_choice,
        node_name: None,
        status_file: Some(status.clone()),
        resync: Duration::from_secs(60),
        budget: weir_policy::Budget::default(),
    };
    let refuse_applies = Arc::new(AtomicBool::new(false));
    let given = Given::default();
    let node = RecordingNode {
        ebpf,
        undeletable,
        log: log.clone(),
        given: given.clone(),
        refuse_applies: refuse_applies.clone(),
    };
    let metrics = Arc::new(Metrics::new());
    let daemon = Daemon::new(opts, node, metrics.clone(), health.clone());
    World {
        log,
        status,
        health,
        metrics,
        refuse_applies,
        given,
        daemon,
    }
}

impl World {
    fn take_log(&self) -> Vec<String> {
        std::mem::take(&mut *self.log.lock().unwrap())
    }
    fn status(&self) -> Status {
        serde_json::from_str(&std::fs::read_to_string(&self.status).unwrap()).unwrap()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if let Some(dir) = self.status.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn node(label: Option<&str>) -> Event {
    let labels = label
        .map(|l| format!("  labels:\n    weir.io/dataplane: {l}\n"))
        .unwrap_or_default();
    let yaml = format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: n1\n{labels}");
    Event::upsert(parse_str(&yaml).unwrap().remove(0))
}

fn batch(generation: u64, events: Vec<Event>) -> Batch {
    Batch {
        events,
        rejected: Vec::new(),
        generation: Some(generation),
        state_digest: None,
        received: Some(std::time::Instant::now()),
    }
}

#[test]
fn start_converges_before_removing_leftovers_and_reports() {
    let mut w = world("start", Ok(()), vec![]);
    assert!(!w.health.is_ready());
    w.daemon.handle(batch(1, vec![node(None)]));
    assert_eq!(
        w.take_log(),
        ["build ebpf", "reconcile ebpf", "cleanup iptables+npm"]
    );
    let s = w.status();
    assert_eq!(
        (s.generation, s.converged, s.dataplane),
        (1, true, Some(DataplaneKind::Ebpf))
    );
    assert!(w.health.is_ready());
    // The cold start's phases are measured once, at the first start.
    let startup = s.startup.expect("the cold start's phases");
    w.daemon.handle(batch(2, vec![node(Some("ebpf"))]));
    assert_eq!(w.status().startup, Some(startup));
}

#[test]
fn status_says_when_the_applied_change_was_received() {
    let mut w = world("received", Ok(()), vec![]);
    let before = crate::kernel::monotonic_ns();
    let mut b = batch(1, vec![node(None)]);
    b.received = Some(std::time::Instant::now());
    w.daemon.handle(b);
    let first = w
        .status()
        .change_received_monotonic_ns
        .expect("a receipt time");
    assert!(first >= before && first <= crate::kernel::monotonic_ns());
    // A batch that changes nothing leaves the last change's time.
    w.daemon.handle(batch(2, vec![]));
    assert_eq!(w.status().change_received_monotonic_ns, Some(first));
}

#[test]
fn fallback_reason_reaches_the_status() {
    let mut w = world("fallback", Err("RINGBUF"), vec![]);
    w.daemon.handle(batch(1, vec![]));
    let s = w.status();
    assert_eq!(s.dataplane, Some(DataplaneKind::Iptables));
    assert!(s
        .fallback_reason
        .unwrap()
        .contains("BPF map type RINGBUF is not supported"));
    assert_eq!(
        w.take_log(),
        ["build iptables", "reconcile iptables", "cleanup ebpf+npm"]
    );
}

#[test]
fn label_change_switches_make_before_break_and_back() {
    let mut w = world("switch", Ok(()), vec![]);
    w.daemon.handle(batch(1, vec![node(Some("ebpf"))]));
    w.take_log();
    w.daemon.handle(batch(2, vec![node(Some("iptables"))]));
    assert_eq!(
        w.take_log(),
        ["build iptables", "reconcile iptables", "cleanup ebpf"]
    );
    assert_eq!(w.status().dataplane, Some(DataplaneKind::Iptables));
    w.daemon.handle(batch(3, vec![node(Some("auto"))]));
    assert_eq!(
        w.take_log(),
        ["build ebpf", "reconcile ebpf", "cleanup iptables"]
    );
    let s = w.status();
    assert_eq!((s.generation, s.dataplane), (3, Some(DataplaneKind::Ebpf)));
    // Same effective dataplane: nothing is rebuilt.
    w.daemon.handle(batch(4, vec![node(Some("ebpf"))]));
    assert!(w.take_log().is_empty());
}

#[test]
fn a_bad_label_value_is_reported_and_the_default_applies() {
    let mut w = world("badlabel", Ok(()), vec![]);
    w.daemon.handle(batch(1, vec![node(Some("nftables"))]));
    let s = w.status();
    assert_eq!(s.dataplane, Some(DataplaneKind::Ebpf));
    assert!(
        s.errors
            .iter()
            .any(|e| e.object == "Node n1" && e.reason.contains("nftables")),
        "{:?}",
        s.errors
    );
}

#[test]
fn the_none_dataplane_builds_nothing_else_removes_nothing_and_ignores_the_label() {
    let mut w = world_choosing("none", Ok(()), vec!["azure-npm-1"], DataplaneChoice::None);
    w.daemon.handle(batch(1, vec![node(Some("ebpf"))]));
    assert_eq!(w.take_log(), ["build none", "reconcile none"]);
    let s = w.status();
    assert_eq!(
        (s.converged, s.dataplane, s.errors.len()),
        (true, Some(DataplaneKind::None), 0)
    );
    // Another label switches nothing; a resync retries no cleanup.
    w.daemon.handle(batch(2, vec![node(Some("iptables"))]));
    w.daemon.resync();
    assert_eq!(w.take_log(), ["reconcile none"]);
    assert!(w
        .metrics
        .encode()
        .contains("weir_dataplane_active{dataplane=\"none\"} 1"));
}

#[test]
fn undeletable_sets_are_retried_at_resync() {
    let mut w = world("retry", Ok(()), vec!["azure-npm-1", "azure-npm-2"]);
    w.daemon.handle(batch(1, vec![]));
    w.take_log();
    assert!(w
        .metrics
        .encode()
        .contains("weir_reset_undeletable_ipsets 2"));
    w.daemon.resync();
    assert_eq!(
        w.take_log(),
        ["reconcile ebpf", "retry azure-npm-1,azure-npm-2"]
    );
    assert!(w
        .metrics
        .encode()
        .contains("weir_reset_undeletable_ipsets 0"));
    w.daemon.resync();
    assert_eq!(w.take_log(), ["reconcile ebpf"], "nothing left to retry");
}

#[test]
fn a_refused_policy_is_reported_and_the_rest_applies() {
    let mut w = world("refused", Ok(()), vec![]);
    let bad = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: bad\n  namespace: x\nspec:\n  podSelector: {}\n  policyTypes: [Sideways]\n";
    let ns = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: x\n";
    let events = [ns, bad]
        .iter()
        .map(|y| Event::upsert(parse_str(y).unwrap().remove(0)))
        .collect();
    w.daemon.handle(batch(1, events));
    let s = w.status();
    assert!(s.converged);
    assert_eq!(s.errors.len(), 1, "{:?}", s.errors);
    assert_eq!(s.errors[0].object, "networkpolicy x/bad");
}

/// A NetworkPolicy in x on every pod, admitting `blocks` single addresses on TCP and
/// UDP 1024–65535: `blocks × 12` estimated entries per selected pod.
fn block_policy(blocks: usize) -> Event {
    let mut yaml = String::from(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: wide\n  \
         namespace: x\nspec:\n  podSelector: {}\n  ingress:\n  - from:\n",
    );
    for i in 0..blocks {
        yaml.push_str(&format!(
            "    - ipBlock: {{cidr: 172.16.{}.{}/32}}\n",
            i / 250,
            i % 250 + 1
        ));
    }
    yaml.push_str(
        "    ports:\n    - {protocol: TCP, port: 1024, endPort: 65535}\n    \
         - {protocol: UDP, port: 1024, endPort: 65535}\n",
    );
    Event::upsert(parse_str(&yaml).unwrap().remove(0))
}

#[test]
fn a_policy_over_its_budget_is_refused_at_start_and_later_and_the_rest_applies() {
    let mut w = world("budget", Ok(()), vec![]);
    let pod = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: a\n  namespace: x\nstatus:\n  podIP: 10.0.0.1\n";
    let deny_y = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: deny\n  namespace: y\nspec:\n  podSelector: {}\n";
    let pod_y = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: b\n  namespace: y\nstatus:\n  podIP: 10.0.0.2\n";
    let mut events: Vec<Event> = [pod, pod_y, deny_y]
        .iter()
        .map(|y| Event::upsert(parse_str(y).unwrap().remove(0)))
        .collect();
    // 400 × 12 = 4,800 entries: over the default 4,096. Refused in the first batch (the
    // engine's load)...
    events.push(block_policy(400));
    w.daemon.handle(batch(1, events));
    let s = w.status();
    assert!(s.converged);
    assert_eq!(s.errors.len(), 1, "{:?}", s.errors);
    assert_eq!(s.errors[0].object, "networkpolicy x/wide");
    assert!(
        s.errors[0].reason.contains("4800") && s.errors[0].reason.contains("4096"),
        "{}",
        s.errors[0].reason
    );
    let given = w.given.lock().unwrap().take().expect("a desired state");
    assert!(
        !given.endpoints["x/a"].ingress.isolated,
        "the refused policy"
    );
    assert!(
        given.endpoints["y/b"].ingress.isolated,
        "y's policy applies"
    );
    // ...and in a later one; a version that fits replaces the refusal.
    w.daemon.handle(batch(2, vec![block_policy(500)]));
    let s = w.status();
    assert_eq!(s.errors.len(), 1, "{:?}", s.errors);
    assert!(s.errors[0].reason.contains("6000"), "{:?}", s.errors);
    w.daemon.handle(batch(3, vec![block_policy(300)]));
    let s = w.status();
    assert!(s.errors.is_empty(), "{:?}", s.errors);
    let given = w.given.lock().unwrap().take().expect("a desired state");
    assert!(given.endpoints["x/a"].ingress.isolated, "3,600 entries fit");
}

#[test]
fn a_failed_apply_is_reported_and_the_next_batch_converges_on_everything() {
    let mut w = world("applyfail", Ok(()), vec![]);
    w.daemon.handle(batch(1, vec![]));
    w.take_log();
    w.refuse_applies.store(true, Ordering::Relaxed);
    let pod = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: a\n  namespace: x\nstatus:\n  podIP: 10.0.0.1\n";
    let event = Event::upsert(parse_str(pod).unwrap().remove(0));
    w.daemon.handle(batch(2, vec![event]));
    assert_eq!(w.take_log(), ["apply ebpf"]);
    let s = w.status();
    assert!(!s.converged);
    assert!(
        s.errors
            .iter()
            .any(|e| e.object == "dataplane" && e.reason.contains("refused")),
        "{:?}",
        s.errors
    );
    w.refuse_applies.store(false, Ordering::Relaxed);
    *w.given.lock().unwrap() = None;
    w.daemon.handle(batch(3, vec![]));
    assert_eq!(w.take_log(), ["reconcile ebpf"]);
    // The missed change is not lost: the reconcile is given the pod the refused apply had.
    let given = w
        .given
        .lock()
        .unwrap()
        .take()
        .expect("the reconcile's desired state");
    assert!(
        given.endpoints.contains_key("x/a"),
        "the reconcile after a refused apply lacks x/a: {:?}",
        given.endpoints.keys().collect::<Vec<_>>()
    );
    let s = w.status();
    assert!(s.converged && s.errors.is_empty(), "{s:?}");
}

#[test]
fn resync_before_the_first_complete_state_touches_nothing() {
    let mut w = world("unsynced", Ok(()), vec![]);
    w.health.sync().error("pods: connection refused");
    for _ in 0..3 {
        w.daemon.resync();
    }
    assert!(
        w.take_log().is_empty(),
        "the dataplane was built or cleaned before the first complete state"
    );
    assert!(
        !w.status.exists(),
        "a status was published before the first sync"
    );
    let reason = w.health.readiness().unwrap_err().to_string();
    assert!(
        reason.contains("waiting for the first complete"),
        "{reason}"
    );
    assert!(reason.contains("connection refused"), "{reason}");

    w.daemon.handle(batch(1, vec![]));
    assert_eq!(
        w.take_log(),
        ["build ebpf", "reconcile ebpf", "cleanup iptables+npm"]
    );
    assert!(w.health.readiness().is_ok());
    w.daemon.resync();
    assert_eq!(w.take_log(), ["reconcile ebpf"]);
}

#[test]
fn readiness_names_the_kinds_still_listing_then_the_dataplane_error() {
    use crate::source::event::SyncProgress;
    let progress = Arc::new(SyncProgress::new(
        ["pods", "namespaces", "networkpolicies", "node"].map(String::from),
    ));
    let health = Health::new(progress.clone(), Duration::from_secs(5));
    progress.done("namespaces");
    let reason = health.readiness().unwrap_err().to_string();
    assert!(
        reason.contains("list of pods, networkpolicies, node;"),
        "{reason}"
    );
    progress.complete();
    assert_eq!(
        health.readiness().unwrap_err().to_string(),
        "the dataplane has not converged yet"
    );
}

#[test]
fn liveness_fails_when_the_loop_stops_turning() {
    use std::time::Instant;
    let health = Health::new(Arc::default(), Duration::from_secs(5));
    let t0 = Instant::now();
    health.beat_at(t0);
    assert!(health.liveness_at(t0 + Duration::from_secs(4)).is_ok());
    let stuck = health
        .liveness_at(t0 + Duration::from_secs(6))
        .unwrap_err()
        .to_string();
    assert!(stuck.contains("has not turned"), "{stuck}");
    // The loop turns again: live again.
    health.beat_at(t0 + Duration::from_secs(6));
    assert!(health.liveness_at(t0 + Duration::from_secs(7)).is_ok());
}

/// The metrics' `weir_drops_total{reason="default-deny"}`: a recording counts its
/// converges there.
fn default_denies(w: &World) -> String {
    let text = w.metrics.encode();
    text.lines()
        .find_map(|l| l.strip_prefix("weir_drops_total{reason=\"default-deny\"} "))
        .unwrap_or_else(|| panic!("no default-deny drops in\n{text}"))
        .to_string()
}

#[test]
fn a_counter_read_that_a_write_overlapped_is_thrown_away() {
    let mut w = world("counts", Ok(()), vec![]);
    // The start reads at once: one converge.
    w.daemon.handle(batch(1, vec![node(None)]));
    assert_eq!(default_denies(&w), "1");
    w.daemon.resync();

    // A read off the loop that a write overlapped: thrown away, the last counts stay.
    let (writes, read) = w.daemon.counts_read().expect("a dataplane to read");
    w.daemon.resync();
    w.daemon.counts_read_done(writes, read());
    assert_eq!(default_denies(&w), "1");

    // One that no write overlapped is taken.
    let (writes, read) = w.daemon.counts_read().expect("a dataplane to read");
    w.daemon.counts_read_done(writes, read());
    assert_eq!(default_denies(&w), "3");

    // Writes overlapping every read: the third in a row reads in the loop's own turn.
    for (round, after) in [(1, "3"), (2, "3"), (3, "6")] {
        let (writes, read) = w.daemon.counts_read().expect("a dataplane to read");
        w.daemon.resync();
        w.daemon.counts_read_done(writes, read());
        assert_eq!(default_denies(&w), after, "round {round}");
    }
}
