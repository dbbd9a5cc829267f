//! The Kubernetes objects weir consumes, as k8s-openapi types, and their identity.

use std::fmt;

use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use serde::{Deserialize, Serialize};

use crate::crd::ClusterNetworkPolicy;

/// Namespace of a namespaced object whose manifest names none (as `kubectl apply`).
pub const DEFAULT_NAMESPACE: &str = "default";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Kind {
    Namespace,
    Pod,
    NetworkPolicy,
    Node,
    Service,
    ClusterNetworkPolicy,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Namespace => "Namespace",
            Kind::Pod => "Pod",
            Kind::NetworkPolicy => "NetworkPolicy",
            Kind::Node => "Node",
            Kind::Service => "Service",
            Kind::ClusterNetworkPolicy => "ClusterNetworkPolicy",
        }
    }

    pub fn is_namespaced(self) -> bool {
        matches!(self, Kind::Pod | Kind::NetworkPolicy | Kind::Service)
    }
}

/// Identity of an object: kind, namespace (namespaced kinds only) and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ObjectRef {
    pub kind: Kind,
    pub namespace: Option<String>,
    pub name: String,
}

impl ObjectRef {
    pub fn new(kind: Kind, namespace: Option<&str>, name: &str) -> Self {
        ObjectRef {
            kind,
            namespace: namespace.map(str::to_owned),
            name: name.to_owned(),
        }
    }

    /// `namespace/name` for namespaced objects, `name` otherwise.
    pub fn qualified_name(&self) -> String {
        match &self.namespace {
            Some(ns) => format!("{ns}/{}", self.name),
            None => self.name.clone(),
        }
    }

    fn display_name(&self) -> String {
        match self.name.as_str() {
            "" => format!(
                "{}<unnamed>",
                self.namespace
                    .as_ref()
                    .map(|ns| format!("{ns}/"))
                    .unwrap_or_default()
            ),
            _ => self.qualified_name(),
        }
    }
}

/// Renders as `networkpolicy x/deny-all`, the form used in every error message.
impl fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}",
            self.kind.name().to_ascii_lowercase(),
            self.display_name()
        )
    }
}

/// A cluster object. Variants hold the k8s-openapi types unboxed (the agreed interface);
/// objects are moved once from source to engine, so the size difference is harmless.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Object {
    Namespace(Namespace),
    Pod(Pod),
    NetworkPolicy(NetworkPolicy),
    Node(Node),
    /// Only its frontends matter: traffic to them is judged after kube-proxy's DNAT.
    Service(Service),
    ClusterNetworkPolicy(ClusterNetworkPolicy),
}

impl Object {
    pub fn kind(&self) -> Kind {
        match self {
            Object::Namespace(_) => Kind::Namespace,
            Object::Pod(_) => Kind::Pod,
            Object::NetworkPolicy(_) => Kind::NetworkPolicy,
            Object::Node(_) => Kind::Node,
            Object::Service(_) => Kind::Service,
            Object::ClusterNetworkPolicy(_) => Kind::ClusterNetworkPolicy,
        }
    }

    pub fn metadata(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        match self {
            Object::Namespace(o) => &o.metadata,
            Object::Pod(o) => &o.metadata,
            Object::NetworkPolicy(o) => &o.metadata,
            Object::Node(o) => &o.metadata,
            Object::Service(o) => &o.metadata,
            Object::ClusterNetworkPolicy(o) => &o.metadata,
        }
    }

    /// The object's identity. A namespaced object without a namespace is in
    /// [`DEFAULT_NAMESPACE`]; a missing name is the empty string (the engine rejects it).
    pub fn key(&self) -> ObjectRef {
        let meta = self.metadata();
        let kind = self.kind();
        let namespace = kind
            .is_namespaced()
            .then(|| meta.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE));
        ObjectRef::new(kind, namespace, meta.name.as_deref().unwrap_or_default())
    }
}
