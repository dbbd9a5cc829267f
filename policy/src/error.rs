use crate::model::{FieldError, ObjectRef};

/// An object the engine rejected. It names the object and the field, e.g.
/// `networkpolicy x/deny-all: spec.ingress[0].ports[1].endPort: must be >= port (80)`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("{object}: {field}: {reason}")]
    Invalid {
        object: ObjectRef,
        field: String,
        reason: String,
    },
    /// A valid object that would take more of the node's tables than one object may
    /// (see [`crate::budget`]).
    #[error(
        "{object}: refused: its rules would take an estimated {entries} table entries per \
         selected pod (largest rule: {largest_rule_peers} peers × {largest_rule_ports} port \
         prefixes), more than one policy may (--max-entries-per-policy {budget})"
    )]
    OverBudget {
        object: ObjectRef,
        entries: u64,
        budget: u64,
        largest_rule_peers: u64,
        largest_rule_ports: u64,
    },
    /// A valid policy within its own budget that would take its namespace's policies
    /// together over theirs (see [`crate::budget`]).
    #[error(
        "{object}: refused: its rules would take an estimated {entries} table entries per \
         selected pod, and namespace {namespace}'s other policies take {others}: more than \
         one namespace's policies may together (--max-entries-per-namespace {budget})"
    )]
    NamespaceOverBudget {
        object: ObjectRef,
        namespace: String,
        entries: u64,
        others: u64,
        budget: u64,
    },
    /// A Service whose frontends (addresses × ports, and its nodePorts) would take more
    /// of the node's Service table than one object may.
    #[error(
        "{object}: refused: {frontends} frontends (addresses × ports), more than one object \
         may (--max-entries-per-policy {budget})"
    )]
    ServiceOverBudget {
        object: ObjectRef,
        frontends: u64,
        budget: u64,
    },
}

impl PolicyError {
    pub fn invalid(object: &ObjectRef, e: FieldError) -> Self {
        PolicyError::Invalid {
            object: object.clone(),
            field: e.field,
            reason: e.reason,
        }
    }

    pub fn object(&self) -> &ObjectRef {
        match self {
            PolicyError::Invalid { object, .. }
            | PolicyError::OverBudget { object, .. }
            | PolicyError::NamespaceOverBudget { object, .. }
            | PolicyError::ServiceOverBudget { object, .. } => object,
        }
    }
}
