//! ClusterNetworkPolicy (policy.networking.k8s.io/v1beta1 and v1alpha2): the cluster-scoped Admin and
//! Baseline tiers around NetworkPolicies. [`crate::crd`] is the resource as served,
//! [`validate`] mirrors its CRD, [`spec`] is the validated form the compiler turns into
//! [`crate::desired::TierRule`]s.
//!
//! Evaluation, per direction of a pod (the subject): the Admin tier's rules in order
//! (policies by priority, then name; rules as written), where the first that matches
//! decides: Accept allows, Deny drops, Pass skips the rest of the tier. Then the
//! NetworkPolicies, if any selects the pod for that direction. Then the Baseline tier,
//! likewise. What nothing decided is allowed. An egress Accept does not bypass the
//! destination's ingress.

pub mod spec;
mod validate;

pub use crate::crd::{ClusterNetworkPolicy, ClusterNetworkPolicyV1beta1};
pub use spec::{Action, ClusterPolicySpec, Subject, Tier, TierRuleSpec};
pub use validate::parse_cluster_policy;
