//! The node controller: owns the dataplane that enforces, switches it make-before-break
//! when the node's choice changes, and cleans what other dataplanes (or Azure NPM) left
//! behind, retrying what could not be removed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::select::{
    resolve, DataplaneChoice, EbpfUnavailable, Effective, Fallback, FallbackCause,
};
use crate::dataplane::{ApplyReport, Dataplane, DataplaneError, DataplaneKind, Scope};
use crate::verdicts::{VerdictTap, VerdictTx};
use weir_policy::desired::Desired;
use weir_policy::model::ObjectError;

/// State that must go from this node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cleanup {
    /// Everything a dataplane of this kind installs (chains, sets, programs, pins).
    pub dataplane: Option<DataplaneKind>,
    /// Azure NPM's chains and sets.
    pub azure_npm: bool,
}

impl Cleanup {
    pub fn is_empty(&self) -> bool {
        self.dataplane.is_none() && !self.azure_npm
    }
}

/// What a cleanup did. Undeletable sets are expected (leaked kernel references) and
/// never fail the cleanup: they are retried later, as is a cleanup that had errors.
#[derive(Clone, Debug, Default)]
pub struct CleanupReport {
    pub removed: usize,
    /// Sets still present, by name, with the reason.
    pub undeletable: Vec<ObjectError>,
    /// Anything else that could not be done (a tool missing, a filter that stayed).
    pub errors: Vec<String>,
    pub duration: Duration,
}

/// What the run loop needs from the node. The real one builds eBPF and iptables
/// dataplanes and calls the shared reset; tests can supply their own.
pub trait Backends: Send {
    /// Whether this kernel can run the eBPF programs; the reason when not.
    fn probe_ebpf(&self) -> Result<(), EbpfUnavailable>;
    /// The same without what building the eBPF dataplane proves anyway (the verifier's
    /// verdict on the programs, which costs a second load of them): for the start, where a
    /// failed build falls back to iptables with the kernel's reason.
    fn probe_ebpf_before_build(&self) -> Result<(), EbpfUnavailable> {
        self.probe_ebpf()
    }
    fn build(&self, kind: DataplaneKind) -> Result<Box<dyn Dataplane>, DataplaneError>;
    fn cleanup(&self, what: &Cleanup) -> CleanupReport;
    /// Tries again to destroy sets an earlier cleanup could not.
    fn retry_sets(&self, names: &[String]) -> CleanupReport;
}

/// How long each step of [`Enforcer::start`] took: the cold start's programming phases.
#[derive(Clone, Copy, Debug, Default)]
pub struct StartPhases {
    /// Probing the kernel and building the dataplane (loading and attaching programs).
    pub load: Duration,
    /// Converging it on the desired state (map or set and rule writes).
    pub converge: Duration,
    /// Removing the other dataplane's and Azure NPM's state.
    pub cleanup: Duration,
}

/// What changed when the enforcer acted, for logs, metrics and the status.
#[derive(Debug, Default)]
pub struct Outcome {
    pub switched: Option<(DataplaneKind, DataplaneKind)>,
    pub cleanups: Vec<CleanupReport>,
}

pub struct Enforcer<B: Backends> {
    backends: B,
    active: Box<dyn Dataplane>,
    choice: DataplaneChoice,
    effective: Effective,
    /// Cleanup that had errors, retried on every [`Enforcer::reconcile`].
    pending: Cleanup,
    /// Sets that could not be destroyed, retried on every [`Enforcer::reconcile`].
    pending_sets: Vec<String>,
    /// Objects the dataplane could not enforce at its last apply or reconcile.
    failures: Vec<ObjectError>,
    /// Sets of its own the active dataplane could not destroy at its last write.
    held_sets: Vec<String>,
    /// Why the last switch did not happen, until one succeeds.
    switch_error: Option<String>,
    /// Where the active dataplane's verdicts go, and its reader (`Err`: why it has none).
    verdicts: Option<(Arc<VerdictTx>, Result<VerdictTap, DataplaneError>)>,
    /// Converges of the active dataplane (tried, failed ones too) and switches so far:
    /// a verdict counter read is good only if none came while it ran.
    writes: u64,
}

impl<B: Backends> Enforcer<B> {
    /// Start-up: pick and build the dataplane, converge it on `desired`, and only then
    /// remove the other dataplane's leftovers and Azure NPM's state, so the node is never
    /// less protected than before weir started.
    pub fn start(
        backends: B,
        choice: DataplaneChoice,
        desired: &Desired,
    ) -> Result<(Self, Outcome, StartPhases), (B, DataplaneError)> {
        let loading = Instant::now();
        let mut effective = resolve(choice, || backends.probe_ebpf_before_build());
        let mut active = match backends.build(effective.kind) {
            Ok(dp) => dp,
            Err(e) if effective.kind == DataplaneKind::Ebpf => {
                tracing::warn!(error = %e, "eBPF dataplane failed to start, falling back to iptables");
                effective = Effective {
                    kind: DataplaneKind::Iptables,
                    fallback: Some(Fallback {
                        cause: FallbackCause::EbpfStartFailed,
                        reason: format!("{choice}: eBPF dataplane failed to start: {e}"),
                    }),
                };
                match backends.build(DataplaneKind::Iptables) {
                    Ok(dp) => dp,
                    Err(e) => return Err((backends, e)),
                }
            }
            Err(e) => return Err((backends, e)),
        };
        let load = loading.elapsed();
        let converging = Instant::now();
        let report = match active.converge(desired, Scope::Kernel) {
            Ok(r) => r,
            Err(e) => return Err((backends, e)),
        };
        let converge = converging.elapsed();
        let mut enforcer = Enforcer {
            backends,
            active,
            choice,
            effective,
            pending: Cleanup::default(),
            pending_sets: Vec::new(),
            failures: Vec::new(),
            held_sets: Vec::new(),
            switch_error: None,
            verdicts: None,
            writes: 0,
        };
        enforcer.take(report);
        // `none` (benchmarks) removes nothing either: not even Azure NPM's state.
        let cleanup = Cleanup {
            dataplane: other(enforcer.effective.kind),
            azure_npm: enforcer.effective.kind != DataplaneKind::None,
        };
        let cleaning = Instant::now();
        let outcome = Outcome {
            switched: None,
            cleanups: vec![enforcer.clean(cleanup)],
        };
        let phases = StartPhases {
            load,
            converge,
            cleanup: cleaning.elapsed(),
        };
        Ok((enforcer, outcome, phases))
    }

    /// Reads the active dataplane's verdicts into `tx`, and each next one's after a switch.
    pub fn tap_verdicts(&mut self, tx: Arc<VerdictTx>) {
        let tap = self.open_tap(&tx);
        self.verdicts = Some((tx, tap));
    }

    fn open_tap(&self, tx: &Arc<VerdictTx>) -> Result<VerdictTap, DataplaneError> {
        let kind = self.effective.kind;
        match self.active.verdict_tap(tx.clone()) {
            Ok(tap) => {
                tracing::info!(dataplane = %kind, "reading the dataplane's verdicts");
                Ok(tap)
            }
            Err(e) => {
                tracing::warn!(dataplane = %kind, error = %e, "no verdict stream from this dataplane; enforcement is unaffected");
                Err(e)
            }
        }
    }

    /// Why the active dataplane's verdicts are not read, when they are not.
    pub fn verdict_tap_error(&self) -> Option<&DataplaneError> {
        match &self.verdicts {
            Some((_, Err(e))) => Some(e),
            _ => None,
        }
    }

    pub fn effective(&self) -> &Effective {
        &self.effective
    }

    pub fn failures(&self) -> &[ObjectError] {
        &self.failures
    }

    pub fn switch_error(&self) -> Option<&str> {
        self.switch_error.as_deref()
    }

    pub fn status(&self) -> crate::dataplane::DataplaneStatus {
        self.active.status()
    }

    pub fn verdict_counts(
        &self,
    ) -> Result<crate::dataplane::VerdictCounts, crate::dataplane::DataplaneError> {
        self.active.verdict_counts()
    }

    /// The active dataplane's [`Dataplane::verdict_counts_read`], with the writes so far.
    pub fn verdict_counts_read(&self) -> (u64, crate::dataplane::CountsRead) {
        (self.writes, self.active.verdict_counts_read())
    }

    /// Converges and switches so far (see [`Enforcer::verdict_counts_read`]).
    pub fn writes(&self) -> u64 {
        self.writes
    }

    /// A change: converge on `desired`, against what the dataplane last wrote.
    pub fn apply(&mut self, desired: &Desired) -> Result<(), DataplaneError> {
        self.writes += 1;
        let report = self.active.converge(desired, Scope::Mirror)?;
        self.take(report);
        Ok(())
    }

    /// Periodic repair: converge the dataplane again and retry pending cleanups.
    pub fn reconcile(&mut self, desired: &Desired) -> Result<Outcome, DataplaneError> {
        self.writes += 1;
        let report = self.active.converge(desired, Scope::Kernel)?;
        self.take(report);
        let mut outcome = Outcome::default();
        if !self.pending.is_empty() {
            let retry = std::mem::take(&mut self.pending);
            outcome.cleanups.push(self.clean(retry));
        }
        if !self.pending_sets.is_empty() {
            let report = self.backends.retry_sets(&self.pending_sets);
            self.pending_sets = report
                .undeletable
                .iter()
                .map(|u| u.object.clone())
                .collect();
            outcome.cleanups.push(report);
        }
        Ok(outcome)
    }

    /// Follows a change of the node's choice. When it changes the effective dataplane:
    /// build the new one and converge it while the old one still enforces (they are
    /// independent: iptables in FORWARD, tc on the pod interfaces), then reset the old one.
    /// When anything fails before the new one has converged, the old one stays in charge.
    pub fn choose(&mut self, choice: DataplaneChoice, desired: &Desired) -> Outcome {
        let mut outcome = Outcome::default();
        if choice == self.choice && self.switch_error.is_none() {
            return outcome;
        }
        self.choice = choice;
        let next = resolve(choice, || self.backends.probe_ebpf());
        let from = self.effective.kind;
        if next.kind == from {
            self.effective = next;
            self.switch_error = None;
            return outcome;
        }
        let started = Instant::now();
        let mut fresh = match self.backends.build(next.kind) {
            Ok(dp) => dp,
            Err(e) => {
                self.switch_error = Some(format!("switch {from} -> {}: build: {e}", next.kind));
                return outcome;
            }
        };
        let report = match fresh.converge(desired, Scope::Kernel) {
            Ok(r) => r,
            Err(e) => {
                self.switch_error = Some(format!("switch {from} -> {}: converge: {e}", next.kind));
                drop(fresh);
                // Whatever the half-built dataplane installed goes; the old one still enforces.
                let partial = Cleanup {
                    dataplane: installs(next.kind),
                    azure_npm: false,
                };
                outcome.cleanups.push(self.clean(partial));
                return outcome;
            }
        };
        tracing::info!(from = %from, to = %next.kind, converge_ms = started.elapsed().as_millis() as u64,
            "new dataplane converged; removing the old one");
        // The old reader stops before its dataplane goes (the new one may read the same
        // kernel source, as the NFLOG group).
        let tx = self.verdicts.take().map(|(tx, _)| tx);
        let old = std::mem::replace(&mut self.active, fresh);
        self.writes += 1;
        drop(old);
        self.effective = next;
        if let Some(tx) = tx {
            self.tap_verdicts(tx);
        }
        self.switch_error = None;
        // Never clean what now enforces: a set name of the new dataplane may be one an
        // earlier cleanup could not destroy.
        if self.pending.dataplane == Some(self.effective.kind) {
            self.pending.dataplane = None;
        }
        if self.effective.kind == DataplaneKind::Iptables {
            self.pending_sets
                .retain(|name| !name.starts_with(WEIR_SET_PREFIX));
        }
        self.take(report);
        let old_state = Cleanup {
            dataplane: installs(from),
            azure_npm: false,
        };
        outcome.cleanups.push(self.clean(old_state));
        outcome.switched = Some((from, self.effective.kind));
        outcome
    }

    /// A dataplane's report: its failures, and the sets of its own it could not destroy
    /// (it retries them itself; they are logged, once, and counted like the cleanups').
    fn take(&mut self, report: ApplyReport) {
        self.failures = report.failures;
        for held in &report.held_sets {
            if !self.held_sets.contains(&held.object) {
                tracing::warn!(set = %held.object, reason = %held.reason, "could not destroy; will retry");
            }
        }
        self.held_sets = report.held_sets.into_iter().map(|h| h.object).collect();
    }

    /// Sets that could not be destroyed: the cleanups' and the active dataplane's own.
    pub fn undeletable_sets(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .pending_sets
            .iter()
            .chain(&self.held_sets)
            .cloned()
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// Runs a cleanup; what could not be removed is kept for the next retry.
    fn clean(&mut self, what: Cleanup) -> CleanupReport {
        if what.is_empty() {
            return CleanupReport::default();
        }
        let report = self.backends.cleanup(&what);
        for item in &report.undeletable {
            tracing::warn!(set = %item.object, reason = %item.reason, "could not destroy; will retry");
            if !self.pending_sets.contains(&item.object) {
                self.pending_sets.push(item.object.clone());
            }
        }
        for e in &report.errors {
            tracing::warn!(error = %e, "cleanup incomplete; will retry");
        }
        if !report.errors.is_empty() {
            self.pending.dataplane = self.pending.dataplane.or(what.dataplane);
            self.pending.azure_npm |= what.azure_npm;
        }
        report
    }
}

/// Prefix of the iptables dataplane's set names.
const WEIR_SET_PREFIX: &str = "weir-";

/// The other dataplane, whose leftovers a start removes (none for `none`).
fn other(kind: DataplaneKind) -> Option<DataplaneKind> {
    match kind {
        DataplaneKind::Ebpf => Some(DataplaneKind::Iptables),
        DataplaneKind::Iptables => Some(DataplaneKind::Ebpf),
        DataplaneKind::None => None,
    }
}

/// A dataplane whose state a cleanup must remove (`none` has none).
fn installs(kind: DataplaneKind) -> Option<DataplaneKind> {
    (kind != DataplaneKind::None).then_some(kind)
}
