//! A ClusterNetworkPolicy after validation, in the form the compiler works with.

pub use crate::desired::{Action, Tier};
use crate::model::PodInfo;
use crate::selector::Selector;
use crate::spec::{PeerSpec, PortSpec};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterPolicySpec {
    pub name: String,
    pub tier: Tier,
    /// 0-1000.
    pub priority: u16,
    pub subject: Subject,
    /// In the order written, which is the order of evaluation.
    pub ingress: Vec<TierRuleSpec>,
    pub egress: Vec<TierRuleSpec>,
}

impl ClusterPolicySpec {
    pub fn rules(&self, direction: crate::desired::Direction) -> &[TierRuleSpec] {
        match direction {
            crate::desired::Direction::Ingress => &self.ingress,
            crate::desired::Direction::Egress => &self.egress,
        }
    }

    /// The order in which policies of one tier are evaluated: priority, then name. The
    /// API leaves equal priorities to the implementation; weir orders them by name so
    /// the choice is the same on every node and after every restart.
    pub fn precedence(&self) -> (Tier, u16, &str) {
        (self.tier, self.priority, &self.name)
    }
}

/// The pods a ClusterNetworkPolicy applies to (host-network pods never).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Subject {
    /// Every pod in the selected namespaces.
    Namespaces(Selector),
    /// Pods matching `pods` in namespaces matching `namespaces`.
    Pods {
        namespaces: Selector,
        pods: Selector,
    },
}

impl Subject {
    /// Whether the subject selects `pod`, whose namespace has `namespace_labels`.
    pub fn selects(&self, pod: &PodInfo, namespace_labels: &crate::model::Labels) -> bool {
        pod.selectable()
            && match self {
                Subject::Namespaces(sel) => sel.matches(namespace_labels),
                Subject::Pods { namespaces, pods } => {
                    namespaces.matches(namespace_labels) && pods.matches(&pod.labels)
                }
            }
    }

    /// The selector over namespace labels.
    pub fn namespace_selector(&self) -> &Selector {
        match self {
            Subject::Namespaces(sel)
            | Subject::Pods {
                namespaces: sel, ..
            } => sel,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierRuleSpec {
    /// The rule's `name`, if it has one.
    pub name: Option<String>,
    pub action: Action,
    /// At least one (the API requires `from`/`to`): `namespaces` and `pods` as pod
    /// peers, each of `networks` as a block, `nodes` as the selected Nodes' addresses.
    pub peers: Vec<PeerSpec>,
    /// Empty: every protocol and port.
    pub ports: Vec<PortSpec>,
    /// A peer or protocol with none of the fields weir knows (a newer API version's), by
    /// field path. The rule fails closed, as the API asks: an Accept rule matches
    /// nothing, a Deny or Pass rule denies everything.
    pub unknown: Option<String>,
}
