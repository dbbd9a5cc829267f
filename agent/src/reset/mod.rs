//! The tolerant reset: removes every piece of dataplane state weir (and, when migrating,
//! Azure NPM) leaves on a node, in dependency order, and reports what it could not
//! remove instead of failing. Used at boot, on a dataplane switch, by the lab's `down`
//! and by `weir reset`.
//!
//! Order: iptables jumps and chains (they hold references on sets), then ipsets
//! (classified first, one `ipset restore`, at most one more), then TC filters and BPF
//! pins. A set that stays referenced is flushed, reported, and left for
//! [`retry_undeletable`]; nothing here returns an error for it.

pub mod chains;
pub mod classify;
pub mod cli;
pub mod ipset_list;
pub mod ipset_restore;
pub mod ipsets;
pub mod iptables_save;
pub mod owners;
pub mod pins;
pub mod report;
pub mod tc_filters;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

pub use report::ResetReport;

use crate::exec;
use crate::netfilter::backend::{Backend, Family};
use owners::Owners;
use weir_policy::model::ObjectError;

/// Whether reset also removes Azure NPM's state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AzureNpm {
    /// Remove it when the node carries it (any `AZURE-NPM*` chain or `azure-npm-*` set).
    #[default]
    IfPresent,
    /// Remove it: the node is migrating from Azure NPM.
    Migrate,
    /// Leave it alone.
    Leave,
}

#[derive(Clone, Debug)]
pub struct ResetOptions {
    /// iptables chains and jumps (both backends, both families) and ipsets.
    pub iptables: bool,
    /// TC filters of `weir_*` programs and everything pinned under `bpf_root`.
    pub ebpf: bool,
    pub bpf_root: PathBuf,
    pub azure_npm: AzureNpm,
    pub dry_run: bool,
}

impl Default for ResetOptions {
    fn default() -> Self {
        ResetOptions {
            iptables: true,
            ebpf: true,
            bpf_root: PathBuf::from("/sys/fs/bpf/weir"),
            azure_npm: AzureNpm::IfPresent,
            dry_run: false,
        }
    }
}

/// Runs the reset in the current network namespace. Never fails: problems are in
/// `report.errors`, sets that cannot be destroyed in `report.undeletable_sets`.
pub fn reset(options: &ResetOptions) -> ResetReport {
    let started = Instant::now();
    let mut report = ResetReport {
        dry_run: options.dry_run,
        ..Default::default()
    };
    // Azure NPM's state is iptables state too, but it goes even when weir's own iptables
    // dataplane is the one enforcing (then weir's chains and sets stay).
    if options.iptables || options.ebpf || options.azure_npm != AzureNpm::Leave {
        let (saves, unreadable) = read_rulesets(&mut report);
        let owners = Owners {
            weir: options.iptables,
            weir_ebpf: options.ebpf,
            azure_npm: match options.azure_npm {
                AzureNpm::Migrate => true,
                AzureNpm::IfPresent => node_carries_azure_npm(&saves, &mut report),
                AzureNpm::Leave => false,
            },
        };
        report.azure_npm = owners.azure_npm;
        let mut kept = remove_chains(&saves, &owners, options.dry_run, &mut report);
        if unreadable && !options.dry_run {
            keep_referenced_sets(&owners, &mut kept, &mut report);
        }
        // A set an owned chain still uses stays as it is, full: flushing it would make
        // that chain drop what it allows until the retry removes the chain.
        let keep_all = kept.contains_key(KEEP_ALL);
        let owns_set = |s: &str| owners.owns_set(s) && !keep_all && !kept.contains_key(s);
        report.kept_sets = kept
            .iter()
            .filter(|(set, _)| owners.owns_set(set))
            .map(|(set, chains)| ObjectError {
                object: set.clone(),
                reason: format!(
                    "still used by {}, which could not be removed; left in place unflushed",
                    chains.join(", ")
                ),
            })
            .collect();
        let outcome = if options.dry_run {
            let owns_chain = |c: &str| owners.owns_chain(c);
            let mut released = BTreeMap::new();
            for (_, _, tables) in &saves {
                for (set, n) in chains::set_references(tables, &owns_chain) {
                    *released.entry(set).or_default() += n;
                }
            }
            ipsets::plan_dry_run(&owns_set, &released)
        } else {
            ipsets::remove(&owns_set)
        };
        report.destroyed_sets = outcome.destroyed;
        report.undeletable_sets = outcome.undeletable;
        report.ipset_restore_runs = outcome.restore_runs;
        report.errors.extend(outcome.errors);
    }
    if options.ebpf {
        remove_tc_filters(options.dry_run, &mut report);
        remove_pins(options, &mut report);
    }
    report.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
    report
}

/// Tries again to destroy sets a reset left behind (the daemon calls this from its
/// periodic reconcile). Returns the outcome: what is destroyed now and what is still
/// referenced. One `ipset list` and at most two `ipset restore` runs.
pub fn retry_undeletable(names: &[String]) -> ipsets::SetsOutcome {
    if names.is_empty() {
        return ipsets::SetsOutcome::default();
    }
    ipsets::remove(&|s| names.iter().any(|n| n == s))
}

/// In the kept sets: no set is known to be free of references; none is touched.
const KEEP_ALL: &str = "*";

type Rulesets = Vec<(Backend, Family, Vec<iptables_save::SavedTable>)>;

/// Reads both families of both backends. A backend whose tools are not installed (an
/// nft-only distribution has no iptables-legacy) holds nothing weir could have written:
/// it is skipped with a note, not an error the agent would retry forever. The flag says
/// whether some installed backend's rules could not be read (its chains may be there).
fn read_rulesets(report: &mut ResetReport) -> (Rulesets, bool) {
    let mut saves = Vec::new();
    let mut unreadable = false;
    for backend in Backend::ALL {
        for family in Family::ALL {
            let text = match backend.save(family) {
                Ok(text) => text,
                Err(exec::ExecError::Spawn { program, source })
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    report.skipped.push(format!(
                        "{program} is not installed: {backend} {family} skipped"
                    ));
                    continue;
                }
                Err(e) => {
                    report
                        .errors
                        .push(format!("reading {backend} {family} rules: {e}"));
                    unreadable = true;
                    continue;
                }
            };
            match iptables_save::parse(&text) {
                Ok(tables) => saves.push((backend, family, tables)),
                Err(e) => {
                    unreadable = true;
                    report
                        .errors
                        .push(format!("reading {backend} {family} rules: {e}"));
                }
            }
        }
    }
    (saves, unreadable)
}

/// When some rules could not be read (an `iptables-nft-save` that cannot translate a
/// foreign nft rule), the owned chains in them may still use any owned set: every owned
/// set the kernel counts a reference on stays, unflushed, until a retry can read them.
fn keep_referenced_sets(
    owners: &Owners,
    kept: &mut BTreeMap<String, Vec<String>>,
    report: &mut ResetReport,
) {
    let listed = ipsets::list_output(&["list", "-t"])
        .map_err(|e| e.to_string())
        .and_then(|text| ipset_list::parse(&text).map_err(|e| e.to_string()));
    match listed {
        Ok(sets) => {
            for set in sets
                .iter()
                .filter(|s| owners.owns_set(&s.name) && s.references > 0)
            {
                kept.entry(set.name.clone())
                    .or_default()
                    .push("rules that could not be read".to_string());
            }
        }
        Err(e) => {
            // Nothing is known: no set is touched.
            report.errors.push(format!("listing ipsets: {e}"));
            kept.insert(KEEP_ALL.to_string(), Vec::new());
        }
    }
}

fn node_carries_azure_npm(saves: &Rulesets, report: &mut ResetReport) -> bool {
    let chains = saves
        .iter()
        .flat_map(|(_, _, tables)| tables.iter().flat_map(|t| t.chains.iter()));
    if !crate::kernel::module_present("ip_set") {
        report
            .skipped
            .push("kernel module ip_set is not loaded: there are no ipsets".to_string());
    }
    let set_names = match ipsets::list_output(&["list", "-n"]) {
        Ok(text) => text,
        Err(e) => {
            report.errors.push(format!("listing ipset names: {e}"));
            String::new()
        }
    };
    owners::carries_azure_npm(chains.map(String::as_str), set_names.lines())
}

/// Removes owned chains per (backend, family). Returns the sets that owned chains still
/// present after a failed removal use, with those chains (`<backend> <family> <chain>`).
fn remove_chains(
    saves: &Rulesets,
    owners: &Owners,
    dry_run: bool,
    report: &mut ResetReport,
) -> BTreeMap<String, Vec<String>> {
    let mut kept: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (backend, family, tables) in saves {
        let removals = chains::plan(tables, &|c| owners.owns_chain(c));
        if removals.is_empty() {
            continue;
        }
        let described = chains::describe(*backend, *family, &removals);
        if dry_run {
            report.removed_iptables.extend(described);
            continue;
        }
        report.iptables_restore_runs += 1;
        match backend.restore(*family, &chains::script(&removals)) {
            Ok(()) => report.removed_iptables.extend(described),
            Err(e) => {
                report
                    .errors
                    .push(format!("removing {backend} {family} chains: {e}"));
                // What is still there: read it again; when that fails too, assume all of
                // it (tables commit one by one, so part may be gone).
                let now = backend
                    .save(*family)
                    .ok()
                    .and_then(|text| iptables_save::parse(&text).ok());
                let still = now.as_deref().unwrap_or(tables);
                for (set, chain) in chains::sets_used(still, &|c| owners.owns_chain(c)) {
                    let users = kept.entry(set).or_default();
                    let name = format!("{backend} {family} {chain}");
                    if !users.contains(&name) {
                        users.push(name);
                    }
                }
            }
        }
    }
    kept
}

fn remove_tc_filters(dry_run: bool, report: &mut ResetReport) {
    let filters = match tc_filters::find(owners::WEIR_PROGRAM_PREFIX) {
        Ok(filters) => filters,
        Err(e) => {
            report.errors.push(format!("listing tc filters: {e}"));
            return;
        }
    };
    for filter in filters {
        let result = if dry_run { Ok(()) } else { filter.delete() };
        match result {
            Ok(()) => report.detached_filters.push(filter.describe()),
            Err(e) => report
                .errors
                .push(format!("detaching {}: {e}", filter.describe())),
        }
    }
}

fn remove_pins(options: &ResetOptions, report: &mut ResetReport) {
    let root = &options.bpf_root;
    if !root.exists() {
        return;
    }
    let pins::PinInventory { files, dirs } = match pins::inventory(root) {
        Ok(found) => found,
        Err(e) => {
            report
                .errors
                .push(format!("reading pins under {}: {e}", root.display()));
            return;
        }
    };
    for (path, kind) in files {
        let result = if options.dry_run {
            Ok(())
        } else {
            std::fs::remove_file(&path)
        };
        match result {
            Ok(()) => report
                .removed_pins
                .push(format!("{} ({kind:?})", path.display())),
            Err(e) => report
                .errors
                .push(format!("removing pin {}: {e}", path.display())),
        }
    }
    if options.dry_run {
        return;
    }
    for dir in dirs {
        if let Err(e) = std::fs::remove_dir(&dir) {
            report
                .errors
                .push(format!("removing pin directory {}: {e}", dir.display()));
        }
    }
}
