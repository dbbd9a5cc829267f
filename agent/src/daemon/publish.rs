//! Cluster mode's outputs: the node annotations that say which dataplane enforces (and
//! why it is not the one asked for), and Kubernetes Events. Both are sent from background
//! tasks, so a slow or absent API server never stalls enforcement; the annotation is
//! retried until it lands.
//!
//! Events go on the right object, once:
//! - A policy (any namespaced object) the agent cannot enforce gets one Event for the
//!   whole cluster, not one per node: every node names the Event after the object and the
//!   reason, so the first node's create makes it and the others' get AlreadyExists.
//! - What concerns one node goes on its Node, through kube's recorder (which counts
//!   repeats as a series): an unusable `weir.io/dataplane` label, a dataplane switch, a
//!   fallback from eBPF to iptables.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, ObjectReference};
use k8s_openapi::api::events::v1::Event as EventV1;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::{Api, Client};
use tokio::sync::{mpsc, watch};

use super::run::Publisher;
use super::status::Status;
use crate::dataplane::DataplaneKind;
use weir_policy::model::{Kind, ObjectRef};

/// The dataplane enforcing on the node.
pub const EFFECTIVE_ANNOTATION: &str = "weir.io/dataplane-effective";
/// Why it is not the one the label (or flag) asked for; absent when it is.
pub const FALLBACK_ANNOTATION: &str = "weir.io/dataplane-fallback-reason";

/// An Event to send.
#[derive(Debug)]
enum Notice {
    /// `object` cannot be enforced, because `reason`.
    NotEnforced { object: ObjectRef, reason: String },
    /// The node's dataplane changed from one to the other.
    Switched {
        from: DataplaneKind,
        to: DataplaneKind,
    },
    /// The node enforces with iptables, not eBPF, because `reason`.
    Fallback { reason: String },
}

pub struct KubePublisher {
    annotations: watch::Sender<Option<BTreeMap<&'static str, Option<String>>>>,
    events: mpsc::UnboundedSender<Notice>,
    reported: BTreeSet<(ObjectRef, String)>,
    /// The dataplane and fallback reason last published.
    dataplane: Option<(DataplaneKind, Option<String>)>,
}

impl KubePublisher {
    /// Spawns the background tasks on the current runtime.
    pub fn spawn(client: Client, node_name: String) -> Self {
        let this_node = ObjectRef::new(Kind::Node, None, &node_name);
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
        let (events, mut queue) = mpsc::unbounded_channel::<Notice>();
        let reporter = Reporter {
            controller: "weir".into(),
            instance: std::env::var("NODE_NAME").ok(),
        };
        let recorder = Recorder::new(client.clone(), reporter);
        tokio::spawn(async move {
            while let Some(notice) = queue.recv().await {
                // A namespaced object's refusal is the cluster's; the rest is this node's.
                let (on, result) = match &notice {
                    Notice::NotEnforced { object, reason } if object.namespace.is_some() => {
                        (object, once_for_the_cluster(&client, object, reason).await)
                    }
                    _ => {
                        let (on, event) = node_event(&notice, &this_node);
                        (on, recorder.publish(&event, &reference(on)).await)
                    }
                };
                if let Err(e) = result {
                    tracing::warn!(object = %on, error = %e, "could not record a Kubernetes Event");
                }
            }
        });
        KubePublisher {
            annotations,
            events,
            reported: BTreeSet::new(),
            dataplane: None,
        }
    }
}

/// The recorder's Event for a notice about one node, and the object it goes on.
fn node_event<'a>(notice: &'a Notice, this_node: &'a ObjectRef) -> (&'a ObjectRef, KubeEvent) {
    let (on, type_, reason, action, note) = match notice {
        Notice::NotEnforced { object, reason } => (
            object,
            EventType::Warning,
            "PolicyNotEnforced",
            "Enforce",
            reason.clone(),
        ),
        Notice::Switched { from, to } => (
            this_node,
            EventType::Normal,
            "DataplaneSwitched",
            "Switch",
            format!("the dataplane switched from {from} to {to} (make before break)"),
        ),
        Notice::Fallback { reason } => (
            this_node,
            EventType::Warning,
            "DataplaneFallback",
            "Enforce",
            reason.clone(),
        ),
    };
    let event = KubeEvent {
        type_,
        reason: reason.into(),
        note: Some(truncate(&note, 1000)),
        action: action.into(),
        secondary: None,
    };
    (on, event)
}

/// The reporting instance of cluster-wide Events: any node may be the one that writes it.
const CLUSTER_INSTANCE: &str = "weir";

/// The name every node gives the Event saying `object` is not enforced because `reason`:
/// the object's name (shortened), then a checksum of the object and the reason.
pub fn cluster_event_name(object: &ObjectRef, reason: &str) -> String {
    let identity = format!(
        "{}\0{}\0{}\0{reason}",
        object.kind.name(),
        object.namespace.as_deref().unwrap_or_default(),
        object.name
    );
    let head: String = object.name.chars().take(200).collect();
    format!("{head}.weir-{:08x}", crc32c::crc32c(identity.as_bytes()))
}

/// Creates the cluster's one Event for `object` and `reason`; another node having made it
/// already (AlreadyExists) is success.
async fn once_for_the_cluster(
    client: &Client,
    object: &ObjectRef,
    reason: &str,
) -> Result<(), kube::Error> {
    let namespace = object.namespace.as_deref().unwrap_or("default");
    let events: Api<EventV1> = Api::namespaced(client.clone(), namespace);
    let event = EventV1 {
        metadata: ObjectMeta {
            name: Some(cluster_event_name(object, reason)),
            namespace: Some(namespace.to_string()),
            ..Default::default()
        },
        action: Some("Enforce".into()),
        reason: Some("PolicyNotEnforced".into()),
        note: Some(truncate(reason, 1000)),
        type_: Some("Warning".into()),
        event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
        regarding: Some(reference(object)),
        reporting_controller: Some("weir".into()),
        reporting_instance: Some(CLUSTER_INSTANCE.into()),
        ..Default::default()
    };
    match events.create(&PostParams::default(), &event).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 409 => {
            tracing::debug!(object = %object, "another node reported it already");
            Ok(())
        }
        Err(e) => Err(e),
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
            let now = (kind, status.fallback_reason.clone());
            if let Some((before, _)) = &self.dataplane {
                if *before != kind {
                    let _ = self.events.send(Notice::Switched {
                        from: *before,
                        to: kind,
                    });
                }
            }
            if let Some(reason) = &now.1 {
                if self.dataplane.as_ref().and_then(|d| d.1.as_ref()) != Some(reason) {
                    let _ = self.events.send(Notice::Fallback {
                        reason: reason.clone(),
                    });
                }
            }
            self.dataplane = Some(now);
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
        for (object, reason) in now.difference(&self.reported) {
            let _ = self.events.send(Notice::NotEnforced {
                object: object.clone(),
                reason: reason.clone(),
            });
        }
        self.reported = now;
    }
}
