//! The two dataplanes behind one trait. Neither knows about Kubernetes: they converge the
//! node on a [`Desired`] state, level-triggered. Cleaning a node is not theirs: both call the
//! one tolerant routine in [`crate::reset`].

pub mod ebpf;

use serde::{Deserialize, Serialize};

pub mod iptables;
pub mod new_pods;
pub mod node_addresses;
pub mod none;
pub mod pod_ports;

use std::collections::BTreeMap;

use weir_policy::desired::{Desired, Direction};
use weir_policy::model::ObjectError;

use crate::exec::ExecError;
use crate::netfilter::backend::Family;
use crate::reset::ipset_restore::IpsetRestoreError;
use crate::reset::iptables_save::SaveParseError;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DataplaneKind {
    Ebpf,
    Iptables,
    /// Programs nothing (`weir agent --dataplane none`, for benchmarks). Not a value of
    /// the lab's `--dataplane`: the lab's nodes always enforce.
    #[value(skip)]
    None,
}

impl std::fmt::Display for DataplaneKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DataplaneKind::Ebpf => "ebpf",
            DataplaneKind::Iptables => "iptables",
            DataplaneKind::None => "none",
        })
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApplyReport {
    pub failures: Vec<ObjectError>,
    /// Sets weir no longer uses that something else still references: flushed, so they
    /// enforce nothing; not failures of enforcement. The enforcer retries them with the
    /// cleanups' undeletable sets and reports them the same way on both dataplanes (log and
    /// `weir_reset_undeletable_ipsets`).
    pub held_sets: Vec<ObjectError>,
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

/// A dataplane error that stopped a whole operation (as opposed to an [`ObjectError`]
/// that concerned one object). Each variant keeps the error it came from as its source,
/// boxed: the error stays small on the happy path's `Result`s.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    /// The kernel lacks what this dataplane needs (a module, TCX, a map type).
    #[error("kernel feature missing: {0}")]
    Unsupported(String),
    /// A kernel module this dataplane needs that cannot be loaded.
    #[error("kernel feature missing: {0}")]
    Module(#[from] crate::exec::modules::ModuleError),
    /// The dataplane's configuration is invalid (named field and why).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The new-pod isolation's interface names are invalid.
    #[error("invalid configuration: {0}")]
    NewPods(#[from] new_pods::NewPodsConfigError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// A node tool (ipset, iptables-restore, ip, tc) could not run, refused or timed out.
    #[error("{context}: {source}")]
    Tool {
        context: String,
        #[source]
        source: Box<ExecError>,
    },
    /// A tool's JSON output that could not be read.
    #[error("`{tool}`: unreadable output: {source}")]
    ToolOutput {
        tool: &'static str,
        #[source]
        source: serde_json::Error,
    },
    /// iptables-save's output for one family that could not be read.
    #[error("{family} rules: {source}")]
    SavedRules {
        family: Family,
        #[source]
        source: Box<SaveParseError>,
    },
    #[error(transparent)]
    IpsetRestore(#[from] IpsetRestoreError),
    /// The kernel refused the eBPF object (maps, BTF, relocations); `detail` adds the
    /// source chain and the RLIMIT_MEMLOCK hint where it applies.
    #[error("load eBPF object: {detail}")]
    Load {
        detail: String,
        #[source]
        source: Box<aya::EbpfError>,
    },
    /// The embedded eBPF object could not be parsed.
    #[error("parse the eBPF object: {0}")]
    Object(#[source] Box<aya_obj::ParseError>),
    #[error("program {0} is missing from the eBPF object")]
    MissingProgram(&'static str),
    /// Loading (the verifier), pinning, opening or querying a program.
    #[error("{context}: {source}")]
    Program {
        context: String,
        #[source]
        source: Box<aya::programs::ProgramError>,
    },
    #[error("{context}: {source}")]
    Pin {
        context: String,
        #[source]
        source: Box<aya::pin::PinError>,
    },
    /// The reader of the programs' aya-log records.
    #[error("kernel log reader: {0}")]
    KernelLog(#[source] Box<aya_log::Error>),
    #[error("{context}: {source}")]
    Map {
        context: String,
        #[source]
        source: Box<aya::maps::MapError>,
    },
    /// Attaching to (or inspecting) a pod's interface: TCX links and tc filters.
    #[error("{what} on interface {ifname}: {source}")]
    Attach {
        what: &'static str,
        ifname: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("pod {0} is not attached")]
    NotAttached(String),
}

impl DataplaneError {
    pub fn map(context: impl Into<String>, source: aya::maps::MapError) -> Self {
        DataplaneError::Map {
            context: context.into(),
            source: Box::new(source),
        }
    }
    pub fn program(context: impl Into<String>, source: aya::programs::ProgramError) -> Self {
        DataplaneError::Program {
            context: context.into(),
            source: Box::new(source),
        }
    }
    pub fn tool(context: impl Into<String>, source: ExecError) -> Self {
        DataplaneError::Tool {
            context: context.into(),
            source: Box::new(source),
        }
    }
}

/// What a [`Dataplane::converge`] compares `desired` with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// What the kernel holds, read again: start-up, adoption after a restart, periodic
    /// repair of drift.
    Kernel,
    /// The dataplane's mirror of what it last wrote: a change, costing what changed (a
    /// dataplane without a mirror, after a failed write, reads the kernel instead).
    Mirror,
}

/// The dataplanes are level-triggered: each converge makes the node enforce exactly the
/// desired state it is given, whatever happened before (a missed or repeated call cannot
/// leave the kernel out of step).
pub trait Dataplane: Send {
    fn kind(&self) -> DataplaneKind;
    /// Makes the node enforce exactly `desired`, writing only what differs from `scope`.
    /// Idempotent.
    fn converge(&mut self, desired: &Desired, scope: Scope) -> Result<ApplyReport, DataplaneError>;
    fn status(&self) -> DataplaneStatus;
    /// The packets this dataplane judged, from its own counters (eBPF's COUNTERS map,
    /// iptables' rule counters). Read on the metrics' schedule, not per event.
    fn verdict_counts(&self) -> Result<VerdictCounts, DataplaneError>;
    /// [`Dataplane::verdict_counts`] as a read to run on another thread, so that the run
    /// loop does not keep a change waiting for it. What costs time goes in the read; the
    /// default reads at once (eBPF's map read is cheap) and hands the result over.
    fn verdict_counts_read(&self) -> CountsRead {
        let counts = self.verdict_counts();
        Box::new(move || counts)
    }
    /// Starts reading this dataplane's verdicts (drops, audits; allows while `tx` wants
    /// them) into `tx`, on a thread that stops when the tap is dropped.
    fn verdict_tap(
        &self,
        tx: std::sync::Arc<crate::verdicts::VerdictTx>,
    ) -> Result<crate::verdicts::VerdictTap, DataplaneError>;
}

/// A read of a dataplane's verdict counters, detached from it ([`Dataplane::verdict_counts_read`]).
pub type CountsRead = Box<dyn FnOnce() -> Result<VerdictCounts, DataplaneError> + Send>;

/// Packets a dataplane judged since its state was created: the source of
/// `weir_policy_verdicts_total` and `weir_drops_total`. Each count only grows, except that
/// it starts again from zero when the dataplane's maps or chains are created anew.
///
/// Both dataplanes count the same thing: an allow is the first packet of a connection
/// (later ones are established), a deny every packet dropped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerdictCounts {
    /// Connections each policy's rules allowed, by policy (`namespace/name`) and direction.
    pub allowed: BTreeMap<(String, Direction), u64>,
    /// Packets an isolated pod's default deny dropped (no rule allowed them), by direction.
    pub denied: BTreeMap<Direction, u64>,
    /// Connections each audit-mode policy would have dropped (they passed), by policy and
    /// direction.
    pub audited: BTreeMap<(String, Direction), u64>,
    /// Drops that are not policy verdicts, by reason ([`DROP_SPOOFED`], ...).
    pub drops: BTreeMap<&'static str, u64>,
}

impl VerdictCounts {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &VerdictCounts) {
        for (key, n) in &other.allowed {
            *self.allowed.entry(key.clone()).or_default() += n;
        }
        for (key, n) in &other.audited {
            *self.audited.entry(key.clone()).or_default() += n;
        }
        for (key, n) in &other.denied {
            *self.denied.entry(*key).or_default() += n;
        }
        for (key, n) in &other.drops {
            *self.drops.entry(*key).or_default() += n;
        }
    }

    /// Adds what one rule admitted: an allow of its policy, or, for an audit rule
    /// (`policy` then names every audit policy it stands for), an audit of each.
    pub fn add_rule(&mut self, policy: &str, audit: bool, direction: Direction, packets: u64) {
        if audit {
            for p in weir_policy::desired::RuleOrigin::split_audited(policy) {
                *self.audited.entry((p.to_string(), direction)).or_default() += packets;
            }
        } else {
            *self
                .allowed
                .entry((policy.to_string(), direction))
                .or_default() += packets;
        }
    }
}

/// A packet from a pod whose source is not one of the pod's addresses.
pub const DROP_SPOOFED: &str = "spoofed-source";
/// A VLAN- or QinQ-tagged frame from a pod (eBPF; iptables never sees the inner packet).
pub const DROP_TAGGED: &str = "tagged-frame";
/// An IP packet from a pod too short to read (eBPF).
pub const DROP_MALFORMED: &str = "malformed";
