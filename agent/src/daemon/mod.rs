//! `weir agent`: the run loop that turns cluster state into enforcement on one node.
//!
//! ```text
//! EventSource (file | kube) ──Batch──▶ Daemon ──▶ policy::Engine ──Desired──▶ Enforcer ──▶ Dataplane
//!                                        │                                   (node controller:
//!                                        └─▶ status file / node annotation,   pick, switch, reset)
//!                                            metrics, readiness
//! ```
//!
//! Start-up: read the first full state (until then nothing on the node changes, whatever
//! the resync timer says, and /readyz names what is missing), pick the dataplane (node label, else flag; `auto`
//! probes the kernel), converge it, then remove the other dataplane's leftovers and Azure
//! NPM's state (make before break), then serve events. The lab runs the same loop through
//! `weir agent --manifests FILE --status-file FILE`.

pub mod config;
pub mod enforcer;
pub mod http;
mod known;
pub mod metrics;
pub mod node;
pub mod publish;
pub mod report;
pub mod run;
pub mod select;
pub mod status;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

pub use config::AgentArgs;
pub use config::LogFormat;
use run::{Daemon, Health, RunOptions};

/// Logs to stderr at `level` (tracing's EnvFilter syntax) in `format`: the agent's and the
/// relay's.
pub fn init_logging(level: &str, format: LogFormat) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .with_context(|| format!("--log-level {level:?}"))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
    result.map_err(|e| anyhow::anyhow!("install the logger: {e}"))
}

/// `weir agent`. `argv` is what followed `agent` on the command line (for --config).
pub fn main(args: AgentArgs, argv: &[String]) -> anyhow::Result<()> {
    let args = args.with_config_file(argv)?;
    init_logging(&args.log_level, args.log_format())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("start the async runtime")?;
    runtime.block_on(run_agent(args))
}

async fn run_agent(args: AgentArgs) -> anyhow::Result<()> {
    let metrics = Arc::new(metrics::Metrics::new());
    crate::exec::set_default_timeout(Duration::from_secs(args.command_timeout_seconds.max(1)));
    // What the first complete state needs: until the source has read all of it, nothing
    // on the node is changed (see `Daemon::resync`).
    let waiting = match &args.manifests {
        Some(path) => vec![format!("the manifest file {}", path.display())],
        None => crate::source::kube::KINDS
            .iter()
            .map(|k| k.to_string())
            .collect(),
    };
    let health = Arc::new(Health::new(
        Arc::new(crate::source::event::SyncProgress::new(waiting)),
        Duration::from_secs(args.liveness_seconds.max(1)),
    ));
    let reports = Arc::new(report::ReportBoard::default());
    let verdicts = Arc::new(
        crate::verdicts::VerdictHub::new(&args.verdict_log)
            .with_context(|| format!("--verdict-log {:?}", args.verdict_log))?,
    );
    if let Some(addr) = args.listen_addr() {
        let served = http::Served {
            metrics: metrics.clone(),
            health: health.clone(),
            reports: reports.clone(),
            verdicts: verdicts.clone(),
        };
        let bound = http::serve(addr, served)
            .await
            .with_context(|| format!("listen on {addr}"))?;
        tracing::info!(%bound, "serving /metrics, /healthz, /readyz, /status, /verdicts");
    }
    let (rate, burst) = (args.verdict_log_rate, args.verdict_log_burst);
    let opts = RunOptions {
        default_choice: args.dataplane,
        node_name: args.node_name.clone(),
        status_file: args.status_file.clone(),
        resync: Duration::from_secs(args.resync_seconds.max(1)),
        budget: weir_policy::Budget {
            max_entries_per_policy: args.max_entries_per_policy,
            max_entries_per_namespace: args.max_entries_per_namespace,
        },
    };
    let backends = node::NodeBackends::new(args.bpf_root.clone())
        .with_new_pods(args.new_pods())
        .with_pod_netns_dir(args.pod_netns_dir.clone())
        .with_variants(args.ebpf_attach.mode(), args.iptables_backend.backend())
        .with_identity_entries(args.ebpf_identity_entries)
        .with_service_entries(args.ebpf_service_entries);
    // The verifier's second at a node's first start overlaps the lists when eBPF is the
    // likely choice (the node's label, read with the lists, may still choose iptables).
    let ebpf_likely = match args.dataplane {
        select::DataplaneChoice::Ebpf => true,
        // The map and program types only, as the start checks them (not the verifier).
        select::DataplaneChoice::Auto => crate::dataplane::ebpf::probe_kernel().is_ok(),
        select::DataplaneChoice::Iptables | select::DataplaneChoice::None => false,
    };
    if ebpf_likely {
        backends.preload_ebpf();
    }
    match &args.manifests {
        Some(_) if !args.relay.is_empty() => {
            anyhow::bail!("--relay reads a cluster's objects from the relay's etcd; --manifests reads them from a file: give one of the two")
        }
        Some(path) => {
            tracing::info!(manifests = %path.display(), "file mode");
            let source = crate::source::file::FileSource::new(
                path.clone(),
                Duration::from_millis(args.poll_ms.max(1)),
            );
            Daemon::new(opts, backends, metrics, health)
                .with_reports(reports)
                .with_verdicts(verdicts, rate, burst)
                .with_own_addresses(own_address_reader())
                .run(source)
                .await?;
        }
        None => {
            let node = args
                .node_name
                .clone()
                .context("cluster mode needs this node's name: --node-name or NODE_NAME (downward API spec.nodeName)")?;
            let client = kube::Client::try_default()
                .await
                .context("connect to the Kubernetes API (in-cluster config or KUBECONFIG)")?;
            let source = if args.relay.is_empty() {
                tracing::info!(%node, "cluster mode");
                crate::source::kube::KubeSource::new(
                    client.clone(),
                    args.list_page_size,
                    args.lists,
                    args.pod_encoding,
                )
            } else {
                tracing::info!(%node, relay = %args.relay.join(","), "cluster mode, reading from the relay");
                let store = connect_relay(&args, health.sync()).await?;
                crate::source::kube::KubeSource::from_relay(store, args.list_page_size)
            }
            .with_progress(health.sync().clone());
            let publisher = publish::KubePublisher::spawn(client, node);
            Daemon::new(opts, backends, metrics, health)
                .with_reports(reports)
                .with_verdicts(verdicts, rate, burst)
                .with_own_addresses(own_address_reader())
                .with_publisher(Box::new(publisher))
                .run(source)
                .await?;
        }
    }
    Ok(())
}

/// A client of the relay's etcd. One that cannot be reached yet (its Pod still starting) is
/// retried with backoff, said in `/readyz`; unreadable certificate files end the agent.
async fn connect_relay(
    args: &AgentArgs,
    progress: &crate::source::event::SyncProgress,
) -> anyhow::Result<etcd_client::Client> {
    use crate::source::relay::store::{connect, ConnectError};
    let mut backoff = Duration::from_millis(500);
    loop {
        match connect(&args.relay, &args.relay_tls).await {
            Ok(store) => return Ok(store),
            Err(e @ ConnectError::Connect { .. }) => {
                let e = format!("{:#}", anyhow::Error::from(e));
                tracing::warn!(error = %e, "the relay's etcd cannot be reached; retrying");
                progress.error(e);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(30));
            }
            Err(e) => return Err(e).context("--relay"),
        }
    }
}

/// The node's interface addresses, as the dataplanes read them.
fn own_address_reader() -> run::OwnAddressReader {
    Box::new(|| {
        crate::dataplane::node_addresses::read()
            .map(|a| a.into_iter().collect())
            .map_err(|e| e.to_string())
    })
}

#[cfg(test)]
mod kube_source_tests;
#[cfg(test)]
pub(crate) mod testing;
#[cfg(test)]
mod tests;
