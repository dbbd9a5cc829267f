//! The watch-to-event path against the in-test API server: initial list, watch events,
//! bookmarks, relist after 410 Gone and after an API server restart, the Node label,
//! and cluster mode's outputs (node annotation, Events).

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::daemon::metrics::Metrics;
use crate::daemon::publish::{KubePublisher, EFFECTIVE_ANNOTATION};
use crate::daemon::run::{Daemon, Health, RunOptions};
use crate::daemon::select::DataplaneChoice;
use crate::daemon::testing::{Log, RecordingNode};
use crate::source::event::{Batch, Event, EventSource};
use crate::source::kube::mock_api::{MockApi, NAMESPACES, NODES, PODS, POLICIES};
use crate::source::kube::KubeSource;

fn namespace(name: &str) -> Value {
    json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": name } })
}

fn pod(ns: &str, name: &str, node: &str, ip: &str) -> Value {
    json!({ "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": ns, "labels": { "pod": name } },
        "spec": { "nodeName": node, "containers": [{ "name": "c", "image": "i" }] },
        "status": { "podIP": ip, "podIPs": [{ "ip": ip }], "phase": "Running" } })
}

fn policy(ns: &str, name: &str, policy_types: &[&str]) -> Value {
    json!({ "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": { "name": name, "namespace": ns },
        "spec": { "podSelector": {}, "policyTypes": policy_types } })
}

fn node(name: &str, dataplane: &str) -> Value {
    json!({ "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": name, "labels": { "weir.io/dataplane": dataplane } } })
}

async fn world() -> MockApi {
    let api = MockApi::start().await;
    api.apply(NAMESPACES, namespace("x"));
    api.apply(NODES, node("n1", "ebpf"));
    api.apply(PODS, pod("x", "a", "n1", "10.0.0.1"));
    api.apply(PODS, pod("x", "b", "n2", "10.0.0.2"));
    api.apply(POLICIES, policy("x", "deny", &["Ingress"]));
    api
}

fn summary(batch: &Batch) -> Vec<String> {
    let mut v: Vec<String> = batch
        .events
        .iter()
        .map(|e| match e {
            Event::Upsert(o) => format!("+{}", o.key()),
            Event::Refused(e) => format!("!{}", e.object()),
            Event::Delete(r) => format!("-{r}"),
        })
        .collect();
    v.sort();
    v
}

/// Runs the source as the agent does (always polled) and hands its batches over.
fn spawn(mut source: KubeSource) -> tokio::sync::mpsc::UnboundedReceiver<Batch> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(batch) = source.next().await {
            if tx.send(batch).is_err() {
                break;
            }
        }
    });
    rx
}

async fn next(batches: &mut tokio::sync::mpsc::UnboundedReceiver<Batch>) -> Batch {
    tokio::time::timeout(Duration::from_secs(20), batches.recv())
        .await
        .expect("a batch within 20 s")
        .expect("the source keeps running")
}

/// The mock answers in JSON whatever is asked for, so the Pods' watcher, which asks for
/// protobuf first, reads them here on its JSON path (a server or proxy without protobuf).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_watch_and_bookmark() {
    let api = world().await;
    let mut source = spawn(KubeSource::new(
        api.client(),
        500,
        Default::default(),
        Default::default(),
    ));

    // The first batch is the whole initial state, of all four kinds at once.
    let first = next(&mut source).await;
    assert_eq!(
        summary(&first),
        [
            "+namespace x",
            "+networkpolicy x/deny",
            "+node n1",
            "+pod x/a",
            "+pod x/b"
        ]
    );
    assert_eq!(first.generation, None);

    // A watch event is one batch.
    api.apply(PODS, pod("x", "c", "n1", "10.0.0.3"));
    assert_eq!(summary(&next(&mut source).await), ["+pod x/c"]);

    // A bookmark moves the resume point: the next watch starts from it, with no relist.
    let lists_before = api.lists(PODS);
    let mark = api.bookmark(PODS);
    api.end_watches(PODS);
    api.wait_for("a watch resumed from the bookmark", |a| {
        a.watch_versions(PODS).last() == Some(&mark)
    })
    .await;
    api.apply(PODS, pod("x", "a", "n1", "10.0.0.11"));
    assert_eq!(summary(&next(&mut source).await), ["+pod x/a"]);
    assert_eq!(
        api.lists(PODS),
        lists_before,
        "a bookmark resume does not relist"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_mode_annotates_the_node_switches_and_reports_refused_policies() {
    let api = world().await;
    api.apply(POLICIES, policy("x", "bad", &["Sideways"]));
    let log: Log = Arc::default();
    let backends = RecordingNode {
        ebpf: Ok(()),
        undeletable: vec![],
        log: log.clone(),
        given: Arc::default(),
        refuse_applies: Arc::default(),
    };
    let opts = RunOptions {
        default_choice: DataplaneChoice::Auto,
        node_name: Some("n1".into()),
        status_file: None,
        resync: Duration::from_secs(3600),
        budget: weir_policy::Budget::default(),
    };
    let health = Arc::new(Health::default());
    let publisher = KubePublisher::spawn(api.client(), "n1".into());
    let daemon = Daemon::new(opts, backends, Arc::new(Metrics::new()), health.clone())
        .with_publisher(Box::new(publisher));
    let source = KubeSource::new(api.client(), 500, Default::default(), Default::default());
    let run = tokio::spawn(daemon.run(source));

    let annotated = |a: &MockApi, dataplane: &str| {
        a.node_patches()
            .last()
            .is_some_and(|p| p["metadata"]["annotations"][EFFECTIVE_ANNOTATION] == dataplane)
    };
    api.wait_for("the node annotated with ebpf", |a| annotated(a, "ebpf"))
        .await;
    assert!(health.is_ready());
    api.wait_for("an Event on the refused policy", |a| !a.events().is_empty())
        .await;
    let event = &api.events()[0];
    assert_eq!(event["regarding"]["name"], "bad");
    assert_eq!(event["regarding"]["kind"], "NetworkPolicy");
    assert_eq!(event["type"], "Warning");

    api.apply(NODES, node("n1", "iptables"));
    api.wait_for("the node annotated with iptables", |a| {
        annotated(a, "iptables")
    })
    .await;
    let log = log.lock().unwrap().clone();
    let switch: Vec<&str> = log
        .iter()
        .map(String::as_str)
        .skip_while(|l| *l != "build iptables")
        .collect();
    assert_eq!(
        switch[..3],
        ["build iptables", "reconcile iptables", "cleanup ebpf"],
        "{log:?}"
    );
    run.abort();
}
