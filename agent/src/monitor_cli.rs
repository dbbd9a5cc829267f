//! `weir monitor`: prints the agent's verdict stream (`GET /verdicts`), on either
//! dataplane. Where no agent runs, it reads the eBPF dataplane's pinned ring itself.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{bail, Context};

use crate::verdicts::record::OutputFormat;
use crate::verdicts::VerdictRecord;

/// Stream the node's policy verdicts as they happen: every drop (default deny, naming the
/// policies that isolate the pod; anti-spoofing; tagged frames) and every audit verdict
/// (what an audit-mode policy would drop), from either dataplane, with both pods and the
/// deciding policy and rule. The same records the agent writes to its --verdict-log,
/// rate-limited per pod the same way.
///
/// It reads the running agent's stream at --address. When no agent answers there (and
/// neither --address nor WEIR_STATUS_ADDRESS was given), or with --bpf-root, it reads the
/// eBPF dataplane's pinned ring buffer itself; beside a running agent that would split the
/// events between the two readers, so prefer the agent.
#[derive(clap::Args, Debug)]
pub struct MonitorArgs {
    /// text: one line per verdict; json: each record as the stream carries it.
    #[arg(long, value_enum, default_value = "text")]
    pub output: OutputFormat,
    /// Also show allowed connections (eBPF: the programs emit them while someone asks).
    #[arg(long)]
    pub allow: bool,
    /// The agent's --listen address [default: 127.0.0.1:9402].
    #[arg(long, env = "WEIR_STATUS_ADDRESS")]
    pub address: Option<SocketAddr>,
    /// Read the eBPF ring buffer pinned under this root instead of asking an agent.
    #[arg(long)]
    pub bpf_root: Option<PathBuf>,
}

const DEFAULT_ADDRESS: &str = "127.0.0.1:9402";

pub fn run(args: MonitorArgs) -> anyhow::Result<()> {
    crate::sys::process::catch_stop_signals();
    if let Some(root) = &args.bpf_root {
        return ring(root, &args);
    }
    let explicit = args.address.is_some();
    let addr = args
        .address
        .unwrap_or_else(|| DEFAULT_ADDRESS.parse().expect("a socket address"));
    match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
        Ok(stream) => from_agent(stream, addr, &args),
        Err(e) if !explicit => {
            eprintln!(
                "weir monitor: no agent answers at {addr} ({e}); reading the eBPF ring buffer \
                 under {} instead",
                crate::dataplane::ebpf::DEFAULT_PIN_ROOT
            );
            ring(&PathBuf::from(crate::dataplane::ebpf::DEFAULT_PIN_ROOT), &args)
        }
        Err(e) => Err(e).with_context(|| {
            format!("weir monitor: connect to the agent at {addr} (is it running with --listen {addr}?)")
        }),
    }
}

fn ring(root: &std::path::Path, args: &MonitorArgs) -> anyhow::Result<()> {
    crate::dataplane::ebpf::monitor::run(
        root,
        args.output,
        args.allow,
        crate::sys::process::stop_flag(),
    )?;
    Ok(())
}

fn from_agent(mut stream: TcpStream, addr: SocketAddr, args: &MonitorArgs) -> anyhow::Result<()> {
    // HTTP/1.0: the agent ends the body by closing, no chunked framing to undo.
    let request = format!(
        "GET /verdicts{} HTTP/1.0\r\nHost: weir\r\n\r\n",
        if args.allow { "?allow=true" } else { "" }
    );
    stream
        .write_all(request.as_bytes())
        .with_context(|| format!("weir monitor: ask {addr} for its verdicts"))?;
    stream.set_read_timeout(Some(Duration::from_millis(200)))?;
    let mut reader = BufReader::new(stream);
    let mut status = String::new();
    let mut line = String::new();
    let mut in_head = true;
    let stdout = std::io::stdout();
    while !crate::sys::process::stop_flag().load(Ordering::SeqCst) {
        match reader.read_line(&mut line) {
            Ok(0) => {
                if in_head {
                    bail!("weir monitor: {addr} closed the connection before answering");
                }
                eprintln!("weir monitor: the agent at {addr} ended the stream");
                return Ok(());
            }
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                // A partial line stays in `line` until the rest arrives.
                continue;
            }
            Err(e) => return Err(e).with_context(|| format!("weir monitor: read from {addr}")),
        }
        let text = std::mem::take(&mut line);
        if in_head {
            if status.is_empty() {
                status = text.trim().to_string();
                if status.split_whitespace().nth(1) != Some("200") {
                    bail!(
                        "weir monitor: {addr} answered `{status}` (an agent older than this weir?)"
                    );
                }
            } else if text.trim().is_empty() {
                in_head = false;
                // On stderr, so stdout stays pure events; callers wait for it.
                eprintln!("weir monitor: streaming verdicts from the agent at {addr} (SIGINT or SIGTERM stops)");
            }
            continue;
        }
        let out = match args.output {
            OutputFormat::Json => text.trim_end().to_string(),
            OutputFormat::Text => match serde_json::from_str::<VerdictRecord>(&text) {
                Ok(r) => r.render(OutputFormat::Text),
                Err(_) => text.trim_end().to_string(),
            },
        };
        let mut lock = stdout.lock();
        if writeln!(lock, "{out}").and_then(|()| lock.flush()).is_err() {
            break;
        }
    }
    Ok(())
}
