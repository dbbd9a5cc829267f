//! `weir explain`: load manifests, compile them with every pod local, and explain one
//! connection.

use std::path::PathBuf;

use anyhow::Context;

use crate::source::manifest::load_files;
use weir_policy::explain::{explain, PortProtocol, Target};
use weir_policy::Engine;

/// Explain whether a connection is allowed, and which policies and rules decide it.
///
/// Reads Kubernetes YAML (Namespace, Pod, NetworkPolicy), compiles it as the agent does
/// and evaluates the source pod's egress and the destination's ingress. Objects that the
/// API server would reject are reported on stderr and left out.
#[derive(clap::Args, Debug)]
pub struct ExplainArgs {
    /// Manifest files (multi-document YAML).
    #[arg(long, required = true, num_args = 1..)]
    pub manifests: Vec<PathBuf>,
    /// Source pod, NAMESPACE/POD.
    #[arg(long)]
    pub from: String,
    /// Destination: NAMESPACE/POD or an IP address.
    #[arg(long)]
    pub to: Target,
    /// Destination port and protocol: PORT[/TCP|UDP|SCTP] (TCP by default).
    #[arg(long)]
    pub port: PortProtocol,
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Text,
    Json,
}

pub fn run(args: ExplainArgs) -> anyhow::Result<()> {
    let objects = load_files(&args.manifests).context("reading manifests")?;
    let mut engine = Engine::new(None);
    let (_, rejected) = engine.load(objects);
    for error in &rejected {
        eprintln!("warning: ignored {error}");
    }
    let explanation = explain(&engine, &args.from, &args.to, args.port)?;
    match args.output {
        OutputFormat::Text => crate::stdout::print(&explanation.to_string())?,
        OutputFormat::Json => crate::stdout::println(&serde_json::to_string_pretty(&explanation)?)?,
    }
    Ok(())
}
