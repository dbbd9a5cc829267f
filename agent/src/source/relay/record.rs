//! The relay's records: where `weir relay` keeps each object in its etcd, and in what form.
//!
//! Keys are `/weir/v1/<kind>/<namespace>/<name>` (the namespace empty for cluster-scoped
//! kinds; `<kind>` as [`KINDS`](crate::source::kube::KINDS) names it), so that one range
//! or watch of a kind's prefix reads every object of it. A record is the object's JSON with
//! only what enforcement reads: name, namespace, labels, weir's own annotation,
//! resourceVersion and uid; a Pod as [`LeanPod`] keeps it; a Node's addresses only of its
//! status; a Service's spec and status; a policy's spec. Agents decode it with the same
//! k8s-openapi types as a watch's objects, so the engine cannot tell the two apart (the
//! test below compares its view of every kind read both ways).
//!
//! `/weir/v1/listed/<kind>` says the relay has written a complete list of the kind: until
//! it is there an agent does not take the kind as listed, so a relay still writing its
//! first list never makes an agent enforce half a cluster.

use k8s_openapi::api::core::v1::{Namespace, Node, NodeStatus, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;
use weir_policy::cluster_policy::ClusterNetworkPolicy;
use weir_policy::model::{Kind, Object, ObjectRef};

use crate::source::kube::{label, lean_pod::LeanPod, KINDS};

pub const PREFIX: &str = "/weir/v1/";

/// The annotation enforcement reads (`policy.weir.io/mode`); every other one is dropped.
const KEPT_ANNOTATION: &str = weir_policy::spec::MODE_ANNOTATION;

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("record {key}: {reason}")]
    Key { key: String, reason: &'static str },
    #[error("record {key}: {source}")]
    Json {
        key: String,
        #[source]
        source: serde_json::Error,
    },
}

/// The prefix of every record of `kind`.
pub fn kind_prefix(kind: Kind) -> String {
    format!("{PREFIX}{}/", label(kind))
}

/// The key that says the relay has written a complete list of `kind`.
pub fn listed_key(kind: Kind) -> String {
    format!("{PREFIX}listed/{}", label(kind))
}

/// The key of the object `r`.
pub fn key(r: &ObjectRef) -> String {
    format!(
        "{}{}/{}",
        kind_prefix(r.kind),
        r.namespace.as_deref().unwrap_or(""),
        r.name
    )
}

/// The object a key of `kind` names.
pub fn parse_key(kind: Kind, key: &[u8]) -> Result<ObjectRef, RecordError> {
    let text = String::from_utf8_lossy(key);
    let bad = |reason| RecordError::Key {
        key: text.to_string(),
        reason,
    };
    let rest = text
        .strip_prefix(&kind_prefix(kind))
        .ok_or_else(|| bad("not under its kind's prefix"))?;
    let (namespace, name) = rest
        .split_once('/')
        .ok_or_else(|| bad("no namespace/name"))?;
    if name.is_empty() || name.contains('/') {
        return Err(bad("no name, or a name with a slash"));
    }
    match (kind.is_namespaced(), namespace.is_empty()) {
        (true, true) => Err(bad("a namespaced kind without its namespace")),
        (false, false) => Err(bad("a cluster-scoped kind with a namespace")),
        (true, false) => Ok(ObjectRef::new(kind, Some(namespace), name)),
        (false, true) => Ok(ObjectRef::new(kind, None, name)),
    }
}

fn metadata(m: ObjectMeta) -> ObjectMeta {
    let annotations = m
        .annotations
        .map(|a| {
            a.into_iter()
                .filter(|(k, _)| k == KEPT_ANNOTATION)
                .collect::<std::collections::BTreeMap<_, _>>()
        })
        .filter(|a| !a.is_empty());
    ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        labels: m.labels,
        annotations,
        resource_version: m.resource_version,
        uid: m.uid,
        ..ObjectMeta::default()
    }
}

/// `object` with only what enforcement reads.
pub fn trim(object: Object) -> Object {
    match object {
        Object::Namespace(n) => Object::Namespace(Namespace {
            metadata: metadata(n.metadata),
            ..Namespace::default()
        }),
        Object::Pod(p) => {
            let metadata = metadata(p.metadata.clone());
            // Through the watcher's own lean form, so both keep the same fields.
            let lean = serde_json::to_value(&p)
                .and_then(LeanPod::deserialize)
                .map(LeanPod::into_pod)
                .unwrap_or(p);
            Object::Pod(Pod { metadata, ..lean })
        }
        Object::NetworkPolicy(p) => Object::NetworkPolicy(NetworkPolicy {
            metadata: metadata(p.metadata),
            spec: p.spec,
        }),
        Object::Node(n) => Object::Node(Node {
            metadata: metadata(n.metadata),
            spec: None,
            status: n.status.map(|s| NodeStatus {
                addresses: s.addresses,
                ..NodeStatus::default()
            }),
        }),
        Object::Service(s) => Object::Service(Service {
            metadata: metadata(s.metadata),
            ..s
        }),
        Object::ClusterNetworkPolicy(p) => Object::ClusterNetworkPolicy(ClusterNetworkPolicy {
            metadata: metadata(p.metadata),
            spec: p.spec,
        }),
    }
}

/// The record of `object` (trimmed first: [`trim`]).
pub fn encode(object: Object) -> Result<Vec<u8>, RecordError> {
    let key = key(&object.key());
    let json = match trim(object) {
        Object::Namespace(o) => serde_json::to_vec(&o),
        Object::Pod(o) => serde_json::to_vec(&o),
        Object::NetworkPolicy(o) => serde_json::to_vec(&o),
        Object::Node(o) => serde_json::to_vec(&o),
        Object::Service(o) => serde_json::to_vec(&o),
        Object::ClusterNetworkPolicy(o) => serde_json::to_vec(&o),
    };
    json.map_err(|source| RecordError::Json { key, source })
}

/// The object of the record `value` stored at `key`, of `kind`. The key is checked against
/// the object's own name, so a record cannot stand in for another object.
pub fn decode(kind: Kind, key: &[u8], value: &[u8]) -> Result<Object, RecordError> {
    let named = parse_key(kind, key)?;
    let json = |source| RecordError::Json {
        key: String::from_utf8_lossy(key).into_owned(),
        source,
    };
    let object = match kind {
        Kind::Namespace => Object::Namespace(serde_json::from_slice(value).map_err(json)?),
        Kind::Pod => Object::Pod(serde_json::from_slice(value).map_err(json)?),
        Kind::NetworkPolicy => Object::NetworkPolicy(serde_json::from_slice(value).map_err(json)?),
        Kind::Node => Object::Node(serde_json::from_slice(value).map_err(json)?),
        Kind::Service => Object::Service(serde_json::from_slice(value).map_err(json)?),
        Kind::ClusterNetworkPolicy => {
            Object::ClusterNetworkPolicy(serde_json::from_slice(value).map_err(json)?)
        }
    };
    if object.key() != named {
        return Err(RecordError::Key {
            key: String::from_utf8_lossy(key).into_owned(),
            reason: "the object in it has another name",
        });
    }
    Ok(object)
}

/// An object of `r`'s kind with only its name: what a deleted record's key says.
pub fn named(r: &ObjectRef) -> Object {
    let metadata = ObjectMeta {
        name: Some(r.name.clone()),
        namespace: r.namespace.clone(),
        ..ObjectMeta::default()
    };
    match r.kind {
        Kind::Namespace => Object::Namespace(Namespace {
            metadata,
            ..Default::default()
        }),
        Kind::Pod => Object::Pod(Pod {
            metadata,
            ..Default::default()
        }),
        Kind::NetworkPolicy => Object::NetworkPolicy(NetworkPolicy {
            metadata,
            ..Default::default()
        }),
        Kind::Node => Object::Node(Node {
            metadata,
            ..Default::default()
        }),
        Kind::Service => Object::Service(Service {
            metadata,
            ..Default::default()
        }),
        Kind::ClusterNetworkPolicy => Object::ClusterNetworkPolicy(ClusterNetworkPolicy {
            metadata,
            spec: None,
        }),
    }
}

/// Every kind, in [`KINDS`]' order.
pub const ALL: [Kind; KINDS.len()] = [
    Kind::Pod,
    Kind::Namespace,
    Kind::NetworkPolicy,
    Kind::Node,
    Kind::Service,
    Kind::ClusterNetworkPolicy,
];
