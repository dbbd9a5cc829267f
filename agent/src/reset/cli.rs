//! `weir reset`: the tolerant reset, run by hand.

use std::path::PathBuf;

use anyhow::bail;

use super::{reset, AzureNpm, ResetOptions};

/// Remove weir's dataplane state from this node (and Azure NPM's, when migrating)
///
/// In the current network namespace, in dependency order:
///   1. iptables: jumps into WEIR-* chains from chains weir does not own, then the WEIR-*
///      chains themselves, in every table, for iptables and ip6tables, on both the legacy
///      and the nft backend (one atomic `iptables-restore --noflush -w` per backend and
///      family, so traffic never sees a half-removed chain);
///   2. ipsets: every weir-* set is flushed; those that nothing else references are
///      destroyed in one `ipset restore` run (at most one more if the state changed
///      meanwhile);
///   3. eBPF: TC filters whose program name starts with `weir_` are detached from every
///      interface, then objects pinned under --bpf-root are removed (links, programs, maps).
///
/// Azure NPM: with `--migrate-from azure-npm`, or when the node carries NPM's state, its
/// FORWARD jump, AZURE-NPM* chains and azure-npm-* sets are removed the same way.
///
/// Sets that cannot be destroyed (a rule or list:set weir does not own refers to them, or
/// the kernel holds a leaked reference) never make reset fail: they are flushed, listed
/// with the reason, and destroyed later by the agent's background retry once the
/// reference is gone. Their number does not change how many `ipset restore` runs reset
/// makes. Running reset twice is harmless, and it is safe while traffic flows.
///
/// Exit status: 0 when everything removable was removed (undeletable sets included),
/// 1 when a tool failed or refused a write (listed as `error:`). An iptables backend
/// whose tools are not installed is skipped with a note.
#[derive(clap::Args, Debug)]
#[command(verbatim_doc_comment)]
pub struct ResetArgs {
    /// Print what would be removed; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Also remove this other agent's state even if it does not look present.
    #[arg(long, value_enum)]
    pub migrate_from: Option<MigrateFrom>,
    /// Root of weir's BPF pins.
    #[arg(long, default_value = "/sys/fs/bpf/weir")]
    pub bpf_root: PathBuf,
    /// Report format: text for people, json for tools.
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MigrateFrom {
    AzureNpm,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Text,
    Json,
}

pub fn run(args: ResetArgs) -> anyhow::Result<()> {
    let options = ResetOptions {
        bpf_root: args.bpf_root,
        azure_npm: match args.migrate_from {
            Some(MigrateFrom::AzureNpm) => AzureNpm::Migrate,
            None => AzureNpm::IfPresent,
        },
        dry_run: args.dry_run,
        ..Default::default()
    };
    let report = reset(&options);
    match args.output {
        OutputFormat::Text => crate::stdout::print(&report.to_text())?,
        OutputFormat::Json => crate::stdout::println(&serde_json::to_string_pretty(&report)?)?,
    }
    if !report.succeeded() {
        bail!("reset finished with {} error(s)", report.errors.len());
    }
    Ok(())
}
