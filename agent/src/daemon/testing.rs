//! Backends that record what they are asked instead of touching the kernel, for the
//! run loop's ordering tests. The real dataplanes are exercised by the integration tests.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::enforcer::{Backends, Cleanup, CleanupReport};
use super::select::EbpfUnavailable;
use crate::dataplane::{
    ApplyReport, Dataplane, DataplaneError, DataplaneKind, DataplaneStatus, Scope, VerdictCounts,
};
use weir_policy::desired::Desired;
use weir_policy::model::ObjectError;

pub type Log = Arc<Mutex<Vec<String>>>;
/// The desired state a recording dataplane was last given (refused or not).
pub type Given = Arc<Mutex<Option<Desired>>>;

pub struct Recording {
    kind: DataplaneKind,
    log: Log,
    given: Given,
    refuse_applies: Arc<AtomicBool>,
    /// Converges so far: what it reports as ingress denies, so that a test can tell
    /// which counter read reached the metrics.
    converges: u64,
}

impl Dataplane for Recording {
    fn kind(&self) -> DataplaneKind {
        self.kind
    }
    /// Logs `reconcile KIND` (against the kernel) or `apply KIND` (against the mirror).
    fn converge(&mut self, desired: &Desired, scope: Scope) -> Result<ApplyReport, DataplaneError> {
        *self.given.lock().unwrap() = Some(desired.clone());
        self.converges += 1;
        let verb = match scope {
            Scope::Kernel => "reconcile",
            Scope::Mirror => "apply",
        };
        self.log
            .lock()
            .unwrap()
            .push(format!("{verb} {}", self.kind));
        if scope == Scope::Mirror && self.refuse_applies.load(Ordering::Relaxed) {
            return Err(DataplaneError::Io {
                context: "apply".into(),
                source: std::io::Error::other("refused by the test"),
            });
        }
        Ok(ApplyReport::default())
    }
    fn status(&self) -> DataplaneStatus {
        DataplaneStatus {
            kind: Some(self.kind),
            ..Default::default()
        }
    }
    /// No packet passes a recording: it counts its converges as ingress denies.
    fn verdict_counts(&self) -> Result<VerdictCounts, DataplaneError> {
        let mut counts = VerdictCounts::default();
        counts
            .denied
            .insert(weir_policy::desired::Direction::Ingress, self.converges);
        Ok(counts)
    }
    /// No packet passes a recording, so it has no verdicts to read.
    fn verdict_tap(
        &self,
        _: std::sync::Arc<crate::verdicts::VerdictTx>,
    ) -> Result<crate::verdicts::VerdictTap, DataplaneError> {
        Err(DataplaneError::Unsupported(
            "a recording judges no packets".into(),
        ))
    }
}

pub struct RecordingNode {
    /// `Err(map type)`: the kernel lacks that BPF map type.
    pub ebpf: Result<(), &'static str>,
    pub undeletable: Vec<&'static str>,
    pub log: Log,
    pub given: Given,
    /// While set, every `apply` fails (a whole-operation dataplane error).
    pub refuse_applies: Arc<AtomicBool>,
}

impl Backends for RecordingNode {
    fn probe_ebpf(&self) -> Result<(), EbpfUnavailable> {
        self.ebpf
            .map_err(|map_type| crate::dataplane::ebpf::ProbeError::NoMapType(map_type).into())
    }
    fn build(&self, kind: DataplaneKind) -> Result<Box<dyn Dataplane>, DataplaneError> {
        self.log.lock().unwrap().push(format!("build {kind}"));
        Ok(Box::new(Recording {
            kind,
            log: self.log.clone(),
            given: self.given.clone(),
            refuse_applies: self.refuse_applies.clone(),
            converges: 0,
        }))
    }
    fn cleanup(&self, what: &Cleanup) -> CleanupReport {
        let target = what.dataplane.map(|k| k.to_string()).unwrap_or_default();
        let npm = if what.azure_npm { "+npm" } else { "" };
        self.log
            .lock()
            .unwrap()
            .push(format!("cleanup {target}{npm}"));
        CleanupReport {
            undeletable: self
                .undeletable
                .iter()
                .map(|s| ObjectError {
                    object: s.to_string(),
                    reason: "in use by a kernel component".into(),
                })
                .collect(),
            ..Default::default()
        }
    }
    fn retry_sets(&self, names: &[String]) -> CleanupReport {
        self.log
            .lock()
            .unwrap()
            .push(format!("retry {}", names.join(",")));
        CleanupReport::default()
    }
}
