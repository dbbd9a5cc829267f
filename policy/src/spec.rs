//! A NetworkPolicy after validation, in the form the compiler works with: defaults
//! applied (policyTypes, protocol), selectors canonical, CIDRs parsed.

use std::collections::BTreeSet;

use ipnet::IpNet;

use super::selector::Selector;
use crate::desired::{Direction, PortRange, Protocol};
use crate::model::PodInfo;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicySpec {
    pub namespace: String,
    pub name: String,
    pub pod_selector: Selector,
    /// `None`: the policy does not apply to ingress (policyTypes).
    pub ingress: Option<Vec<RuleSpec>>,
    pub egress: Option<Vec<RuleSpec>>,
    /// `policy.weir.io/mode: audit`: compiled and counted, but it drops nothing.
    pub audit: bool,
}

/// The annotation that puts a policy in audit mode (`audit`) or enforces it (`enforce`,
/// the default).
pub const MODE_ANNOTATION: &str = "policy.weir.io/mode";

impl PolicySpec {
    /// `namespace/name`, as in [`crate::desired::RuleOrigin::policy`].
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    pub fn rules(&self, direction: Direction) -> Option<&[RuleSpec]> {
        match direction {
            Direction::Ingress => self.ingress.as_deref(),
            Direction::Egress => self.egress.as_deref(),
        }
    }

    /// Whether the policy applies to `pod` (host-network pods are never selected).
    pub fn selects(&self, pod: &PodInfo) -> bool {
        pod.namespace == self.namespace
            && pod.selectable()
            && self.pod_selector.matches(&pod.labels)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleSpec {
    /// Empty: every peer.
    pub peers: Vec<PeerSpec>,
    /// Empty: every port and protocol.
    pub ports: Vec<PortSpec>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NamespaceScope {
    /// Only the policy's own namespace (a peer with a podSelector alone).
    Named(String),
    Selected(Selector),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PeerSpec {
    /// Pods matching `pods` in the namespaces of `namespaces` (an AND).
    Pods {
        namespaces: NamespaceScope,
        pods: Selector,
    },
    /// Any address in `cidr` and in none of `except`.
    Block {
        cidr: IpNet,
        except: BTreeSet<IpNet>,
    },
    /// The addresses of the Nodes whose labels match (a ClusterNetworkPolicy's `nodes`
    /// peer), host-network pods on them included.
    Nodes(Selector),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PortMatch {
    /// No `port`: every port of the protocol.
    Any,
    Range(PortRange),
    /// Resolved on the pod that serves it.
    Named(String),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortSpec {
    pub protocol: Protocol,
    pub port: PortMatch,
}
