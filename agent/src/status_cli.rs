//! `weir status`: ask the running agent what it enforces (`GET /status` on its HTTP port).

use std::net::SocketAddr;

use anyhow::Context;

use crate::daemon::report::{fetch, render_table};
use crate::stdout::OutputFormat;

/// Ask the running agent on this node what it enforces: the effective dataplane and why,
/// whether its sources are synced, the endpoints and policies enforced, the objects it
/// refused and why, eBPF map pressure, sets it could not destroy, and its last converge.
///
/// The agent answers on its --listen address (127.0.0.1:9402 in cluster mode; in file mode
/// only when --listen is given). In the lab, use `weir-lab status`.
#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// The agent's --listen address.
    #[arg(long, env = "WEIR_STATUS_ADDRESS", default_value = "127.0.0.1:9402")]
    pub address: SocketAddr,
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
}

pub fn run(args: StatusArgs) -> anyhow::Result<()> {
    let report = fetch(args.address).context("weir status")?;
    print(&report, args.output)
}

/// Prints a report as `--output` asks.
pub fn print(
    report: &crate::daemon::report::NodeReport,
    output: OutputFormat,
) -> anyhow::Result<()> {
    let text = match output {
        OutputFormat::Table => render_table(report),
        OutputFormat::Json => serde_json::to_string_pretty(report)? + "\n",
    };
    crate::stdout::print(&text)?;
    Ok(())
}
