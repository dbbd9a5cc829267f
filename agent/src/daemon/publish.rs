//! Cluster mode's outputs: the node annotations that say which dataplane enforces (and
//! why it is not the one asked for), and a Kubernetes Event on each policy the agent
//! cannot enforce. Both are sent from background tasks, so a slow or absent API server
//! never stalls enforcement; the annotation is retried until it lands.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, ObjectReference};
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::{Api, Client};
use tokio::sync::{mpsc, watch};

use super::run::Publisher;
use super::status::Status;
use weir_policy::model::{Kind, ObjectRef};

/// The dataplane enforcing on the node.
pub const EFFECTIVE_ANNOTATION: &str = "weir.io/dataplane-effective";
/// Why it is not the one the label (or flag) asked for; absent when it is.
pub const FALLBACK_ANNOTATION: &str = "weir.io/dataplane-fallback-reason";

pub struct KubePublisher {
    annotations: watch::Sender<Option<BTreeMap<&'static str, Option<String>>>>,
    events: mpsc::UnboundedSender<(ObjectRef, String)>,
    reported: BTreeSet<(ObjectRef, String)>,
}

impl KubePublisher {
    /// Spawns the background tasks on the current runtime.
    pub fn spawn(client: Client, node_name: String) -> Self {
        let (annotations, mut wanted) = watch::channel(None);
        let nodes: Api<Node> = Api::all(client.clone());
        tokio::spawn(async move {
            while wanted.changed().await.is_ok() {
                let Some(values) = wanted.borrow_and_update().clone() else {
                    continue;
                };
                let patch = serde_json::json!({ "metadata": { "annotations": values } });
                // Through the status subresource: the agent needs no write on Nodes
                // themselves (their spec, taints and labels), only on nodes/status.
                while let Err(e) = nodes
                    .patch_status(&node_name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    tracing::warn!(node = %node_name, error = %e, "annotating the node failed; retrying");
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    if wanted.has_changed().unwrap_or(false) {
                        break;
                    }
                }
            }
        });
        let (events, mut queue) = mpsc::unbounded_channel::<(ObjectRef, String)>();
        let reporter = Reporter {
            controller: "weir".into(),
            instance: std::env::var("NODE_NAME").ok(),
        };
        let recorder = Recorder::new(client, reporter);
        tokio::spawn(async move {
            while let Some((object, reason)) = queue.recv().await {
                let event = KubeEvent {
                    type_: EventType::Warning,
                    reason: "PolicyNotEnforced".into(),
                    note: Some(truncate(&reason, 1000)),
                    action: "Enforce".into(),
                    secondary: None,
                };
                if let Err(e) = recorder.publish(&event, &reference(&object)).await {
                    tracing::warn!(object = %object, error = %e, "could not record a Kubernetes Event");
                }
            }
        });
        KubePublisher {
            annotations,
            events,
            reported: BTreeSet::new(),
        }
    }
}

fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

fn reference(object: &ObjectRef) -> ObjectReference {
    let api_version = match object.kind {
        Kind::NetworkPolicy => "networking.k8s.io/v1",
        _ => "v1",
    };
    ObjectReference {
        api_version: Some(api_version.into()),
        kind: Some(object.kind.name().into()),
        namespace: object.namespace.clone(),
        name: Some(object.name.clone()),
        ..Default::default()
    }
}

impl Publisher for KubePublisher {
    fn publish(&mut self, status: &Status, refused: &BTreeMap<ObjectRef, String>) {
        if let Some(kind) = status.dataplane {
            let values = BTreeMap::from([
                (EFFECTIVE_ANNOTATION, Some(kind.to_string())),
                (FALLBACK_ANNOTATION, status.fallback_reason.clone()),
            ]);
            self.annotations.send_if_modified(|current| {
                let changed = current.as_ref() != Some(&values);
                *current = Some(values);
                changed
            });
        }
        // One Event per (object, reason); a policy fixed and broken again is reported again.
        let now: BTreeSet<(ObjectRef, String)> = refused
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for item in now.difference(&self.reported) {
            let _ = self.events.send(item.clone());
        }
        self.reported = now;
    }
}
