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
    /// Print the build's version, the embedded eBPF object's size and the oldest kernel it
    /// is built for, this binary's size, then what the running kernel lacks that weir would use, with the
    /// fallback for each (probing the eBPF dataplane needs root).
    Version,
    Reset(weir::reset::cli::ResetArgs),
    Explain(weir::explain_cli::ExplainArgs),
    Monitor(weir::monitor_cli::MonitorArgs),
    /// Run the node agent (cluster mode, or file mode with --manifests).
    Agent(Box<weir::daemon::AgentArgs>),
    Status(weir::status_cli::StatusArgs),
    /// Run the cluster's relay: one watch per kind on the API server, written into an etcd
    /// of the relay's own, from which agents started with --relay read what weir enforces
    /// (deploy/relay/). For clusters whose API server the agents' watches would load.
    Relay(Box<weir::relay::RelayArgs>),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Version => {
            let (major, minor) = weir::dataplane::ebpf::MIN_KERNEL;
            let mut text = format!(
                "weir {}\nembedded eBPF object: {} bytes, built for Linux {major}.{minor} or later\n",
                env!("CARGO_PKG_VERSION"),
                weir::dataplane::ebpf::EMBEDDED_OBJECT.len()
            );
            if let Some(bytes) = std::env::current_exe()
                .and_then(std::fs::metadata)
                .ok()
                .map(|m| m.len())
            {
                text.push_str(&format!(
                    "binary: {:.1} MiB ({} bytes)\n",
                    bytes as f64 / (1024.0 * 1024.0),
                    bytes
                ));
            }
            text.push_str(&format!("running kernel: {}\n", weir::kernel::release()));
            let lacks = weir::dataplane::ebpf::kernel_lacks();
            if lacks.is_empty() {
                text.push_str("it lacks nothing weir uses\n");
            }
            for l in lacks {
                text.push_str(&format!("it lacks {l}\n"));
            }
            weir::stdout::print(&text)?;
        }
        Command::Reset(args) => weir::reset::cli::run(args)?,
        Command::Explain(args) => weir::explain_cli::run(args)?,
        Command::Status(args) => weir::status_cli::run(args)?,
        Command::Monitor(args) => weir::monitor_cli::run(args)?,
        Command::Relay(args) => weir::relay::main(*args)?,
        Command::Agent(args) => {
            let argv: Vec<String> = std::env::args()
                .skip_while(|a| a != "agent")
                .skip(1)
                .collect();
            weir::daemon::main(*args, &argv)?;
        }
    }
    Ok(())
}
