//! The dataplane that programs nothing (`weir agent --dataplane none`), for benchmarks
//! that run many agents on one machine: the agent still watches, compiles and reports its
//! status and metrics, and touches no kernel state (no programs, maps, pins, sets, rules or
//! filters; no cleanup of anyone else's either).

use weir_policy::desired::Desired;

use super::{
    ApplyReport, Dataplane, DataplaneError, DataplaneKind, DataplaneStatus, Scope, VerdictCounts,
};

/// Counts what it was asked to enforce (endpoints, address sets), so the status still says
/// how large the node's desired state is.
#[derive(Debug, Default)]
pub struct NoneDataplane {
    endpoints: usize,
    sets: usize,
}

impl Dataplane for NoneDataplane {
    fn kind(&self) -> DataplaneKind {
        DataplaneKind::None
    }

    fn converge(
        &mut self,
        desired: &Desired,
        _scope: Scope,
    ) -> Result<ApplyReport, DataplaneError> {
        self.endpoints = desired.endpoints.len();
        self.sets = desired.sets.len();
        Ok(ApplyReport::default())
    }

    fn status(&self) -> DataplaneStatus {
        DataplaneStatus {
            kind: Some(DataplaneKind::None),
            endpoints: self.endpoints,
            sets: self.sets,
            rules: 0,
            details: vec![("programs".into(), "nothing (--dataplane none)".into())],
        }
    }

    fn verdict_counts(&self) -> Result<VerdictCounts, DataplaneError> {
        Ok(VerdictCounts::default())
    }

    fn verdict_tap(
        &self,
        _tx: std::sync::Arc<crate::verdicts::VerdictTx>,
    ) -> Result<crate::verdicts::VerdictTap, DataplaneError> {
        Err(DataplaneError::Unsupported(
            "the none dataplane judges no packets".into(),
        ))
    }
}
