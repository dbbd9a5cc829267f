//! Pods as the watcher decodes them: only the fields enforcement reads
//! ([`PodInfo::from_pod`](weir_policy::model::PodInfo::from_pod)), so that a list of
//! 20,000 pods does not build 20,000 full k8s-openapi Pods first. The rest of a Pod (its
//! managedFields above all: two thirds of a Pod's JSON in the bench's cluster) is skipped
//! by the JSON decoder without being allocated.
//!
//! A field the engine starts to read must be added here too: the round-trip test below
//! compares the engine's view of a full Pod with its view of the same Pod read through
//! this type.
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, ContainerPort, Pod, PodIP, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;

/// A Pod with only the fields enforcement reads; [`LeanPod::into_pod`] makes it a Pod.
#[derive(Clone, Debug, Deserialize)]
pub struct LeanPod {
    #[serde(deserialize_with = "lean_metadata")]
    metadata: ObjectMeta,
    spec: Option<LeanSpec>,
    status: Option<LeanStatus>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LeanMetadata {
    name: Option<String>,
    namespace: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    /// The watcher resumes from it; the state digest covers it.
    resource_version: Option<String>,
    uid: Option<String>,
}

fn lean_metadata<'de, D: serde::Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    let m = LeanMetadata::deserialize(d)?;
    Ok(ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        labels: m.labels,
        resource_version: m.resource_version,
        uid: m.uid,
        ..ObjectMeta::default()
    })
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LeanSpec {
    node_name: Option<String>,
    host_network: Option<bool>,
    #[serde(default)]
    containers: Vec<LeanContainer>,
}

#[derive(Clone, Debug, Deserialize)]
struct LeanContainer {
    #[serde(default)]
    name: String,
    ports: Option<Vec<ContainerPort>>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LeanStatus {
    phase: Option<String>,
    #[serde(rename = "podIP")]
    pod_ip: Option<String>,
    #[serde(rename = "podIPs")]
    pod_ips: Option<Vec<PodIP>>,
}

impl LeanPod {
    pub fn into_pod(self) -> Pod {
        Pod {
            metadata: self.metadata,
            spec: self.spec.map(|s| PodSpec {
                node_name: s.node_name,
                host_network: s.host_network,
                containers: s
                    .containers
                    .into_iter()
                    .map(|c| Container {
                        name: c.name,
                        ports: c.ports,
                        ..Container::default()
                    })
                    .collect(),
                ..PodSpec::default()
            }),
            status: self.status.map(|s| PodStatus {
                phase: s.phase,
                pod_ip: s.pod_ip,
                pod_ips: s.pod_ips,
                ..PodStatus::default()
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_policy::model::PodInfo;

    /// A Pod as the API server serves it, with the fields the engine reads and many it
    /// does not (managedFields, other containers' settings, conditions).
    const SERVED: &str = r#"{
      "apiVersion": "v1", "kind": "Pod",
      "metadata": {"name": "web-1", "namespace": "shop", "uid": "u-1", "resourceVersion": "42",
        "labels": {"app": "web", "tier": "front"}, "annotations": {"a": "b"},
        "managedFields": [{"manager": "kubectl", "operation": "Apply", "apiVersion": "v1",
          "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:labels": {".": {}}}}}]},
      "spec": {"nodeName": "node-1", "hostNetwork": false,
        "containers": [
          {"name": "app", "image": "x", "env": [{"name": "A", "value": "1"}],
           "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"},
                     {"containerPort": 53, "protocol": "UDP"}]},
          {"name": "side", "image": "y", "ports": [{"name": "sctp", "containerPort": 9, "protocol": "SCTP"}]}],
        "volumes": [{"name": "v", "emptyDir": {}}]},
      "status": {"phase": "Running", "podIP": "10.0.0.7",
        "podIPs": [{"ip": "10.0.0.7"}, {"ip": "fd00::7"}],
        "conditions": [{"type": "Ready", "status": "True"}]}
    }"#;

    fn info(pod: &Pod) -> PodInfo {
        PodInfo::from_pod("shop", "web-1", pod).expect("a valid pod")
    }

    #[test]
    fn the_engine_sees_a_lean_pod_as_the_full_one() {
        let full: Pod = serde_json::from_str(SERVED).unwrap();
        let lean: LeanPod = serde_json::from_str(SERVED).unwrap();
        let lean = lean.into_pod();
        assert_eq!(info(&lean), info(&full));
        assert_eq!(lean.metadata.resource_version.as_deref(), Some("42"));
        assert!(lean.metadata.managed_fields.is_none());
    }

    #[test]
    fn a_pod_without_spec_or_status_reads_as_one() {
        let text = r#"{"metadata": {"name": "p", "namespace": "shop"}}"#;
        let full: Pod = serde_json::from_str(text).unwrap();
        let lean: LeanPod = serde_json::from_str(text).unwrap();
        assert_eq!(info(&lean.into_pod()), info(&full));
    }

    #[test]
    fn a_finished_or_host_networked_pod_reads_as_one() {
        for (phase, host) in [("Succeeded", false), ("Running", true), ("Failed", false)] {
            let text = SERVED
                .replace("\"Running\"", &format!("{phase:?}"))
                .replace(
                    "\"hostNetwork\": false",
                    &format!("\"hostNetwork\": {host}"),
                );
            let full: Pod = serde_json::from_str(&text).unwrap();
            let lean: LeanPod = serde_json::from_str(&text).unwrap();
            assert_eq!(info(&lean.into_pod()), info(&full), "{phase} {host}");
        }
    }
}
