use clap::{Parser, Subcommand};

/// weir: Kubernetes NetworkPolicy enforcement for Linux nodes, with an eBPF dataplane
/// and an ipset/iptables fallback.
#[derive(Parser)]
#[command(name = "weir", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the build's version and the embedded eBPF object's size.
    Version,
    Reset(weir::reset::cli::ResetArgs),
    /// A node in network namespaces, built from manifests, with real traffic probes.
    Lab(weir::lab::cli::LabArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Version => {
            println!("weir {}", env!("CARGO_PKG_VERSION"));
        }
        Command::Reset(args) => weir::reset::cli::run(args)?,
        Command::Lab(args) => weir::lab::cli::run(args)?,
    }
    Ok(())
}
