//! An object validated and reduced to what enforcement needs. Sources convert each object
//! as it arrives ([`Validated::from_object`]), so neither they nor the engine keep a full
//! Kubernetes object: a Pod as k8s-openapi holds 2.4 KB inline before its strings and
//! managedFields, a [`PodInfo`] 144 bytes.

use std::collections::BTreeSet;

use crate::cluster_policy::{parse_cluster_policy, ClusterPolicySpec};
use crate::desired::Frontend;
use crate::error::PolicyError;
use crate::model::{FieldError, Kind, Labels, NodeInfo, Object, ObjectRef, PodInfo};
use crate::spec::PolicySpec;
use crate::validate::parse_policy;

#[derive(Clone, Debug, PartialEq)]
pub enum Validated {
    Namespace {
        name: String,
        labels: Labels,
    },
    Pod(PodInfo),
    Policy(PolicySpec),
    ClusterPolicy(ClusterPolicySpec),
    Node(NodeInfo),
    /// Only its frontends matter: traffic to them is judged after kube-proxy's DNAT.
    Service {
        namespace: String,
        name: String,
        frontends: BTreeSet<Frontend>,
    },
}

impl Validated {
    /// Validates `object` as the API server would and keeps what enforcement needs. The
    /// error names the object and the field.
    pub fn from_object(object: Object) -> Result<Validated, PolicyError> {
        let key = object.key();
        if key.name.is_empty() {
            return Err(PolicyError::invalid(
                &key,
                FieldError::new("metadata.name", "required"),
            ));
        }
        let namespace = key.namespace.clone().unwrap_or_default();
        Ok(match object {
            Object::Namespace(ns) => Validated::Namespace {
                name: key.name,
                labels: ns.metadata.labels.unwrap_or_default().into(),
            },
            Object::Pod(pod) => Validated::Pod(
                PodInfo::from_pod(&namespace, &key.name, &pod)
                    .map_err(|e| PolicyError::invalid(&key, e))?,
            ),
            Object::NetworkPolicy(np) => Validated::Policy(parse_policy(&np)?),
            Object::ClusterNetworkPolicy(cnp) => {
                Validated::ClusterPolicy(parse_cluster_policy(&cnp)?)
            }
            Object::Node(node) => Validated::Node(NodeInfo {
                addresses: node_addresses(&node),
                name: key.name,
                labels: node.metadata.labels.unwrap_or_default().into(),
            }),
            Object::Service(service) => Validated::Service {
                frontends: crate::service::frontends(&service)
                    .map_err(|e| PolicyError::invalid(&key, e))?,
                namespace,
                name: key.name,
            },
        })
    }

    pub fn kind(&self) -> Kind {
        match self {
            Validated::Namespace { .. } => Kind::Namespace,
            Validated::Pod(_) => Kind::Pod,
            Validated::Policy(_) => Kind::NetworkPolicy,
            Validated::ClusterPolicy(_) => Kind::ClusterNetworkPolicy,
            Validated::Node(_) => Kind::Node,
            Validated::Service { .. } => Kind::Service,
        }
    }

    /// The object's identity, as [`Object::key`] gives it.
    pub fn key(&self) -> ObjectRef {
        match self {
            Validated::Namespace { name, .. } => ObjectRef::new(Kind::Namespace, None, name),
            Validated::Pod(pod) => ObjectRef::new(Kind::Pod, Some(&pod.namespace), &pod.name),
            Validated::Policy(spec) => {
                ObjectRef::new(Kind::NetworkPolicy, Some(&spec.namespace), &spec.name)
            }
            Validated::ClusterPolicy(spec) => {
                ObjectRef::new(Kind::ClusterNetworkPolicy, None, &spec.name)
            }
            Validated::Node(node) => ObjectRef::new(Kind::Node, None, &node.name),
            Validated::Service {
                namespace, name, ..
            } => ObjectRef::new(Kind::Service, Some(namespace), name),
        }
    }
}

/// The IP addresses among a Node's `status.addresses` (the others are host names).
fn node_addresses(node: &k8s_openapi::api::core::v1::Node) -> BTreeSet<std::net::IpAddr> {
    node.status
        .iter()
        .flat_map(|s| s.addresses.iter().flatten())
        .filter_map(|a| a.address.parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(yaml: &str) -> Object {
        crate::manifest::parse_str(yaml).expect(yaml).remove(0)
    }

    #[test]
    fn every_kind_keeps_its_key() {
        for yaml in [
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: shop, labels: {a: b}}",
            "apiVersion: v1\nkind: Pod\nmetadata: {name: db, namespace: shop}\nstatus: {podIP: 10.0.0.1}",
            "apiVersion: v1\nkind: Pod\nmetadata: {name: db}",
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: deny, namespace: shop}\nspec: {podSelector: {}}",
            "apiVersion: v1\nkind: Node\nmetadata: {name: n1, labels: {weir.io/dataplane: ebpf}}",
            "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}",
        ] {
            let object = one(yaml);
            let key = object.key();
            let validated = Validated::from_object(object).expect(yaml);
            assert_eq!(validated.key(), key, "{yaml}");
            assert_eq!(validated.kind(), key.kind);
        }
    }

    #[test]
    fn a_refusal_names_the_object_and_the_field() {
        let object = one("apiVersion: v1\nkind: Pod\nmetadata: {name: db, namespace: shop}\nstatus: {podIP: nope}");
        let e = Validated::from_object(object).unwrap_err();
        assert_eq!(
            e.to_string(),
            "pod shop/db: status.podIP: invalid IP address \"nope\""
        );
    }
}
