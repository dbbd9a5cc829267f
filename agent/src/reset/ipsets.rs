//! Removing owned ipsets with a bounded number of `ipset restore` runs: one pass from
//! the classification, and at most one more for sets whose state changed in between.
//! The number of runs never depends on how many sets cannot be destroyed.

use std::collections::{BTreeMap, BTreeSet};

use super::classify::{classify, SetOp, SetPlan};
use super::ipset_list;
use super::ipset_restore::{self, IpsetRestoreError, RestoreFailure};
use crate::exec;
use weir_policy::model::ObjectError;

#[cfg(test)]
mod tests;

/// What happened to the owned ipsets.
#[derive(Clone, Debug, Default)]
pub struct SetsOutcome {
    pub destroyed: Vec<String>,
    pub undeletable: Vec<ObjectError>,
    pub restore_runs: u32,
    pub errors: Vec<String>,
}

/// The two things removal needs from ipset: one listing, one restore run.
pub trait SetTool {
    /// Every set, with list:set members.
    fn list(&mut self) -> Result<Vec<ipset_list::SetInfo>, String>;
    /// One `ipset restore -exist` run.
    fn restore(&mut self, script: &str) -> Result<(), IpsetRestoreError>;
}

/// `ipset ARGS` (a listing). Without ip_set in the kernel no set can exist, and listing
/// would fail ("Kernel error received: Invalid argument"): the listing is empty then.
pub fn list_output(args: &[&str]) -> Result<String, exec::ExecError> {
    if !crate::kernel::module_present("ip_set") {
        return Ok(String::new());
    }
    exec::run_ok("ipset", args, None)
}

/// The kernel's sets in the current network namespace, through the `ipset` tool.
pub struct KernelSets;

impl SetTool for KernelSets {
    fn list(&mut self) -> Result<Vec<ipset_list::SetInfo>, String> {
        let text = list_output(&["list"]).map_err(|e| e.to_string())?;
        ipset_list::parse(&text).map_err(|e| e.to_string())
    }

    fn restore(&mut self, script: &str) -> Result<(), IpsetRestoreError> {
        ipset_restore::run(script, true)
    }
}

/// What [`remove`] would do once the owned chains holding `released` references are
/// gone; writes nothing.
pub fn plan_dry_run(owned: &dyn Fn(&str) -> bool, released: &BTreeMap<String, u64>) -> SetsOutcome {
    let mut outcome = SetsOutcome::default();
    match KernelSets.list() {
        Ok(sets) => {
            let plan = classify(&sets, owned, released);
            outcome.destroyed = plan.destroys().map(str::to_string).collect();
            outcome.undeletable = plan.undeletable;
        }
        Err(e) => outcome.errors.push(format!("listing ipsets: {e}")),
    }
    outcome
}

/// Flushes every owned set and destroys those nothing else references.
pub fn remove(owned: &dyn Fn(&str) -> bool) -> SetsOutcome {
    remove_with(&mut KernelSets, owned)
}

pub fn remove_with(tool: &mut dyn SetTool, owned: &dyn Fn(&str) -> bool) -> SetsOutcome {
    let mut outcome = SetsOutcome::default();
    let plan = match tool.list() {
        Ok(sets) => classify(&sets, owned, &BTreeMap::new()),
        Err(e) => {
            outcome.errors.push(format!("listing ipsets: {e}"));
            return outcome;
        }
    };
    if plan.ops.is_empty() {
        outcome.undeletable = plan.undeletable;
        return outcome;
    }
    outcome.restore_runs += 1;
    let failure = match tool.restore(&plan.script()) {
        Ok(()) => {
            outcome.destroyed = plan.destroys().map(str::to_string).collect();
            outcome.undeletable = plan.undeletable;
            return outcome;
        }
        Err(IpsetRestoreError::Exec(e)) => {
            outcome.errors.push(e.to_string());
            return outcome;
        }
        Err(IpsetRestoreError::Stopped(f)) => f,
    };
    // Lines before the failing one were applied.
    let applied = applied_ops(&plan, &failure);
    outcome.destroyed.extend(destroys_in(applied));
    second_pass(tool, owned, &plan, &failure, &mut outcome);
    outcome
}

/// The ops that ran before `failure` stopped the script (none when ipset gave no line).
fn applied_ops<'p>(plan: &'p SetPlan, failure: &RestoreFailure) -> &'p [SetOp] {
    let done = failure.line.map_or(0, |l| l.saturating_sub(1));
    &plan.ops[..done.min(plan.ops.len())]
}

fn destroys_in(ops: &[SetOp]) -> impl Iterator<Item = String> + '_ {
    ops.iter().filter_map(|op| match op {
        SetOp::Destroy(n) => Some(n.clone()),
        SetOp::Flush(_) => None,
    })
}

/// Re-reads the sets, re-classifies what is left, and runs one more restore. Whatever
/// that pass cannot do is reported as undeletable, not retried here.
fn second_pass(
    tool: &mut dyn SetTool,
    owned: &dyn Fn(&str) -> bool,
    first: &SetPlan,
    first_failure: &RestoreFailure,
    outcome: &mut SetsOutcome,
) {
    let failed_set = failure_set(first, first_failure);
    let sets = match tool.list() {
        Ok(sets) => sets,
        Err(e) => {
            outcome.errors.push(format!("listing ipsets again: {e}"));
            return;
        }
    };
    let mut plan = classify(&sets, owned, &BTreeMap::new());
    // The kernel's word beats the count we read: a set it refused to destroy is
    // flushed and left for the background retry.
    if let Some(name) = failed_set.filter(|n| plan.destroys().any(|d| d == *n)) {
        plan.ops
            .retain(|op| *op != SetOp::Destroy(name.to_string()));
        plan.undeletable.push(ObjectError {
            object: name.to_string(),
            reason: first_failure.message.clone(),
        });
    }
    outcome.undeletable = plan.undeletable.clone();
    if plan.ops.is_empty() {
        return;
    }
    outcome.restore_runs += 1;
    match tool.restore(&plan.script()) {
        Ok(()) => outcome.destroyed.extend(destroys_in(&plan.ops)),
        Err(IpsetRestoreError::Exec(e)) => outcome.errors.push(e.to_string()),
        Err(IpsetRestoreError::Stopped(f)) => {
            let applied = applied_ops(&plan, &f);
            let destroyed: BTreeSet<String> = destroys_in(applied).collect();
            let left = plan
                .destroys()
                .filter(|n| !destroyed.contains(*n))
                .map(|n| ObjectError {
                    object: n.to_string(),
                    reason: format!(
                        "state changed twice during reset (second ipset restore: {}); \
                         left for the background retry",
                        f.message
                    ),
                });
            outcome.undeletable.extend(left);
            outcome.destroyed.extend(destroyed);
        }
    }
}

fn failure_set<'p>(plan: &'p SetPlan, failure: &RestoreFailure) -> Option<&'p str> {
    let line = failure.line?;
    match plan.ops.get(line.checked_sub(1)?)? {
        SetOp::Destroy(name) => Some(name),
        SetOp::Flush(_) => None,
    }
}
