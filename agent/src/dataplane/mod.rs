//! The two dataplanes behind one trait. Neither knows about Kubernetes: they enforce a
//! [`Desired`] state and apply [`Delta`]s. Cleaning a node is not theirs: both call the
//! one tolerant routine in [`crate::reset`].

pub mod ebpf;

use serde::{Deserialize, Serialize};

pub mod iptables;
pub mod netlink;
pub mod new_pods;
pub mod pod_ports;

use weir_policy::desired::{Delta, Desired};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DataplaneKind {
    Ebpf,
    Iptables,
}

impl std::fmt::Display for DataplaneKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DataplaneKind::Ebpf => "ebpf",
            DataplaneKind::Iptables => "iptables",
        })
    }
}

/// One thing a dataplane could not enforce (a full map, a kernel refusal, a failed
/// restore), named so an operator can find it. Everything else stays enforced.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApplyFailure {
    /// What failed: a pod (`ns/name`), a set id, a policy, a map.
    pub object: String,
    pub reason: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApplyReport {
    pub failures: Vec<ApplyFailure>,
    /// Sets weir no longer uses that something else still references: flushed, so they
    /// enforce nothing; not failures of enforcement. The enforcer retries them with the
    /// cleanups' undeletable sets and reports them the same way on both dataplanes (log and
    /// `weir_reset_undeletable_ipsets`).
    pub held_sets: Vec<ApplyFailure>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DataplaneStatus {
    pub kind: Option<DataplaneKind>,
    pub endpoints: usize,
    pub sets: usize,
    pub rules: usize,
    /// Free-form, dataplane-specific facts (map fill levels, backend in use, ...).
    pub details: Vec<(String, String)>,
}

/// A dataplane error that stopped a whole operation (as opposed to an [`ApplyFailure`]
/// that concerned one object).
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("kernel feature missing: {0}")]
    Unsupported(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Other(String),
}

pub trait Dataplane: Send {
    fn kind(&self) -> DataplaneKind;
    /// Make the node enforce exactly `desired` (start-up, adoption after restart,
    /// periodic repair). Idempotent.
    fn reconcile(&mut self, desired: &Desired) -> Result<ApplyReport, DataplaneError>;
    /// Apply one change; `desired` is the state after it, for dataplanes that need context.
    fn apply(&mut self, delta: &Delta, desired: &Desired) -> Result<ApplyReport, DataplaneError>;
    fn status(&self) -> DataplaneStatus;
}
