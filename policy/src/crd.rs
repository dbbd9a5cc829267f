//! Custom resources weir reads, as the API server serves them: `ClusterNetworkPolicy`
//! (policy.networking.k8s.io/v1alpha2 of network-policy-api v0.2.0 and v0.3.0, and v1beta1,
//! v0.3.0's storage version with the same schema: [`ClusterNetworkPolicyV1beta1`]). k8s-openapi has no types for custom resources, so these
//! mirror the CRD's schema (`apis/v1alpha2/clusternetworkpolicy_types.go`): every field
//! the schema requires is still `Option` here, so that a missing one is a validation
//! error naming the field rather than a decode error. The one-ofs (peers, protocols) keep
//! the names of fields they do not know: a peer or protocol of a newer API version, which
//! fails closed, or an egress-only peer written into an ingress rule, which is refused as
//! the API server's pruning and schema refuse it.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};

/// The fields of a one-of (a peer, a protocol) that these types do not know, by name:
/// those of a newer API version, or another direction's peers.
pub type UnknownFields = BTreeMap<String, IgnoredAny>;

/// Serializes with its `apiVersion` and `kind`, as k8s-openapi's types do.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct ClusterNetworkPolicy {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: Option<ClusterNetworkPolicySpec>,
}

impl Serialize for ClusterNetworkPolicy {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use k8s_openapi::Resource;
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Typed<'a> {
            api_version: &'a str,
            kind: &'a str,
            metadata: &'a ObjectMeta,
            #[serde(skip_serializing_if = "Option::is_none")]
            spec: &'a Option<ClusterNetworkPolicySpec>,
        }
        Typed {
            api_version: Self::API_VERSION,
            kind: Self::KIND,
            metadata: &self.metadata,
            spec: &self.spec,
        }
        .serialize(serializer)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicySpec {
    /// `Admin` or `Baseline`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    /// 0-1000; lower is evaluated first within the tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<Subject>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingress: Option<Vec<IngressRule>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<Vec<EgressRule>>,
}

/// Exactly one field.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Subject {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NamespacedPod {
    /// Empty or absent: every namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// Required; empty: every pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IngressRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `Accept`, `Deny` or `Pass`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<Vec<IngressPeer>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocols: Option<Vec<ProtocolEntry>>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EgressRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<Vec<EgressPeer>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocols: Option<Vec<ProtocolEntry>>,
}

/// Exactly one field.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IngressPeer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
    #[serde(flatten, skip_serializing)]
    pub unknown: UnknownFields,
}

/// Exactly one field. `nodes` and `domainNames` are the experimental channel's.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EgressPeer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub networks: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain_names: Option<Vec<String>>,
    #[serde(flatten, skip_serializing)]
    pub unknown: UnknownFields,
}

/// Exactly one field.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProtocolEntry {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp: Option<ProtocolPort>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp: Option<ProtocolPort>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sctp: Option<ProtocolPort>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_named_port: Option<String>,
    #[serde(flatten, skip_serializing)]
    pub unknown: UnknownFields,
}

/// `tcp`, `udp` or `sctp`: at least one field (`tcp: {}` is refused).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProtocolPort {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_port: Option<Port>,
}

/// Exactly one field.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Port {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub number: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range: Option<PortRange>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortRange {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<i64>,
}

impl k8s_openapi::Resource for ClusterNetworkPolicy {
    const API_VERSION: &'static str = "policy.networking.k8s.io/v1alpha2";
    const GROUP: &'static str = "policy.networking.k8s.io";
    const KIND: &'static str = "ClusterNetworkPolicy";
    const VERSION: &'static str = "v1alpha2";
    const URL_PATH_SEGMENT: &'static str = "clusternetworkpolicies";
    type Scope = k8s_openapi::ClusterResourceScope;
}

impl k8s_openapi::ListableResource for ClusterNetworkPolicy {
    const LIST_KIND: &'static str = "ClusterNetworkPolicyList";
}

/// A [`ClusterNetworkPolicy`] as served at v1beta1: network-policy-api v0.3.0 stores that
/// version and serves v1alpha2 with the same schema, so only the version a client asks for
/// differs.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(transparent)]
pub struct ClusterNetworkPolicyV1beta1(pub ClusterNetworkPolicy);

impl k8s_openapi::Resource for ClusterNetworkPolicyV1beta1 {
    const API_VERSION: &'static str = "policy.networking.k8s.io/v1beta1";
    const GROUP: &'static str = "policy.networking.k8s.io";
    const KIND: &'static str = "ClusterNetworkPolicy";
    const VERSION: &'static str = "v1beta1";
    const URL_PATH_SEGMENT: &'static str = "clusternetworkpolicies";
    type Scope = k8s_openapi::ClusterResourceScope;
}

impl k8s_openapi::ListableResource for ClusterNetworkPolicyV1beta1 {
    const LIST_KIND: &'static str = "ClusterNetworkPolicyList";
}

impl k8s_openapi::Metadata for ClusterNetworkPolicyV1beta1 {
    type Ty = ObjectMeta;
    fn metadata(&self) -> &ObjectMeta {
        &self.0.metadata
    }
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.0.metadata
    }
}

impl k8s_openapi::Metadata for ClusterNetworkPolicy {
    type Ty = ObjectMeta;
    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}
