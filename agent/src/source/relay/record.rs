//! The relay's records: where `weir relay` keeps each object in its etcd, and in what form.
//!
//! Keys are `/weir/v1/<kind>/<namespace>/<name>` (the namespace empty for cluster-scoped
//! kinds; `<kind>` as [`KINDS`](crate::source::kinds::KINDS) names it), so that one range
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

use crate::source::kinds::{label, KINDS};
use crate::source::lean_pod::LeanPod;

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
    to_json(&trim(object)).map_err(|source| RecordError::Json { key, source })
}

fn to_json(object: &Object) -> serde_json::Result<Vec<u8>> {
    match object {
        Object::Namespace(o) => serde_json::to_vec(o),
        Object::Pod(o) => serde_json::to_vec(o),
        Object::NetworkPolicy(o) => serde_json::to_vec(o),
        Object::Node(o) => serde_json::to_vec(o),
        Object::Service(o) => serde_json::to_vec(o),
        Object::ClusterNetworkPolicy(o) => serde_json::to_vec(o),
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use weir_policy::Validated;

    fn managed() -> serde_json::Value {
        json!([{ "manager": "kubectl", "operation": "Update", "fieldsType": "FieldsV1",
                 "fieldsV1": { "f:metadata": { "f:labels": {} } } }])
    }

    /// Every kind with fields enforcement reads and fields it does not.
    fn full_objects() -> Vec<Object> {
        let meta = |ns: Option<&str>, name: &str| {
            let mut m = json!({ "name": name, "resourceVersion": "42", "uid": "u-1",
                "labels": { "app": name }, "managedFields": managed(),
                "annotations": { "policy.weir.io/mode": "audit", "note": "x".repeat(500) } });
            if let Some(ns) = ns {
                m["namespace"] = json!(ns);
            }
            m
        };
        vec![
            Object::Namespace(
                serde_json::from_value(json!({ "metadata": meta(None, "shop"),
                "status": { "phase": "Active" } }))
                .unwrap(),
            ),
            Object::Pod(
                serde_json::from_value(json!({ "metadata": meta(Some("shop"), "web"),
                "spec": { "nodeName": "n1", "containers": [{ "name": "c", "image": "i",
                    "ports": [{ "name": "http", "containerPort": 80, "protocol": "TCP" }],
                    "env": [{ "name": "A", "value": "b" }] }] },
                "status": { "phase": "Running", "podIP": "10.0.0.5",
                    "podIPs": [{ "ip": "10.0.0.5" }, { "ip": "fd00::5" }],
                    "conditions": [{ "type": "Ready", "status": "True" }] } }))
                .unwrap(),
            ),
            Object::NetworkPolicy(
                serde_json::from_value(json!({
                "metadata": meta(Some("shop"), "web"),
                "spec": { "podSelector": { "matchLabels": { "app": "web" } },
                    "policyTypes": ["Ingress"],
                    "ingress": [{ "from": [{ "ipBlock": { "cidr": "10.0.0.0/8",
                        "except": ["10.1.0.0/16"] } }], "ports": [{ "port": "http" }] }] } }))
                .unwrap(),
            ),
            Object::Node(
                serde_json::from_value(json!({ "metadata": meta(None, "n1"),
                "spec": { "podCIDR": "10.0.0.0/24" },
                "status": { "addresses": [{ "type": "InternalIP", "address": "192.168.1.5" },
                    { "type": "Hostname", "address": "n1" }],
                    "images": [{ "names": ["x"], "sizeBytes": 5 }],
                    "conditions": [{ "type": "Ready", "status": "True" }] } }))
                .unwrap(),
            ),
            Object::Service(
                serde_json::from_value(json!({ "metadata": meta(Some("shop"), "web"),
                "spec": { "type": "LoadBalancer", "clusterIP": "10.96.0.10",
                    "clusterIPs": ["10.96.0.10"], "selector": { "app": "web" },
                    "ports": [{ "port": 80, "targetPort": "http", "protocol": "TCP" }] },
                "status": { "loadBalancer": { "ingress": [{ "ip": "203.0.113.9" }] } } }))
                .unwrap(),
            ),
            Object::ClusterNetworkPolicy(
                serde_json::from_value(json!({
                "apiVersion": "policy.networking.k8s.io/v1alpha2",
                "kind": "ClusterNetworkPolicy", "metadata": meta(None, "deny-all"),
                "spec": { "tier": "Admin", "priority": 10, "subject": { "namespaces": {} },
                    "ingress": [{ "action": "Deny", "from": [{ "namespaces": {} }] }] } }))
                .unwrap(),
            ),
        ]
    }

    /// The engine's view of every kind is the same read through a record as read whole,
    /// and the record is smaller than the object.
    #[test]
    fn a_record_gives_the_engine_what_the_object_does() {
        let objects = full_objects();
        assert_eq!(objects.len(), ALL.len());
        for object in objects {
            let key = key(&object.key());
            let whole = to_json(&object).unwrap();
            let record = encode(object.clone()).unwrap();
            assert!(
                record.len() < whole.len(),
                "{key}: {} >= {}",
                record.len(),
                whole.len()
            );
            let read = decode(object.kind(), key.as_bytes(), &record).unwrap();
            assert_eq!(
                read.metadata().resource_version.as_deref(),
                Some("42"),
                "{key}"
            );
            match (Validated::from_object(object), Validated::from_object(read)) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "{key}"),
                (a, b) => panic!("{key}: {a:?} / {b:?}"),
            }
        }
    }

    /// A record is refused when its key names another object, a key of another kind, or
    /// none; its deletion's key gives back the object's identity.
    #[test]
    fn keys_name_their_object() {
        let pod = full_objects().remove(1);
        let record = encode(pod.clone()).unwrap();
        let other = ObjectRef::new(Kind::Pod, Some("shop"), "db");
        let err = decode(Kind::Pod, key(&other).as_bytes(), &record).unwrap_err();
        assert!(err.to_string().contains("another name"), "{err}");
        for bad in [
            "/weir/v1/pods/shop",
            "/weir/v1/pods//web",
            "/weir/v1/nodes/shop/n1",
            "/weir/v1/pods/shop/a/b",
            "/other/pods/shop/web",
        ] {
            let kind = if bad.contains("nodes") {
                Kind::Node
            } else {
                Kind::Pod
            };
            assert!(parse_key(kind, bad.as_bytes()).is_err(), "{bad}");
        }
        for object in full_objects() {
            let r = object.key();
            assert_eq!(parse_key(r.kind, key(&r).as_bytes()).unwrap(), r);
            assert_eq!(named(&r).key(), r);
        }
    }
}
