//! `weir-lab ...`: the command line over [`super::ops`], the prober and the listener. The
//! subcommands and flags are those `weir lab` had before the lab left the agent's binary:
//! other tools drive them, so they only ever gain flags.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use ipnet::{Ipv4Net, Ipv6Net};
use serde::Serialize;

use super::addr::{DEFAULT_IPV4_POOL, DEFAULT_IPV6_POOL};
use super::agent::WeirBinary;
use super::objects::ObjectSet;
use super::ops::{self, ApiAction, RelayAction, UpOptions};
use super::output::{self, OutputFormat};
use super::peers::Enforcer;
use super::probe::{self, IpFamily, Via};
use super::proxy::ProxyMode;
use super::services::ServicesMode;
use super::state::{LabDir, ServedPort, Topology, DEFAULT_DIR};
use weir::dataplane::DataplaneKind;

/// weir-lab: a Kubernetes node built from network namespaces, with real traffic probes,
/// enforced by the weir agent binary it is given.
#[derive(Parser)]
#[command(name = "weir-lab", version)]
pub struct LabArgs {
    /// Where the lab keeps its state; several labs can coexist in different directories.
    #[arg(long, env = "WEIR_LAB_STATE_DIR", default_value = DEFAULT_DIR, global = true)]
    pub state_dir: PathBuf,
    /// The `weir` binary the lab runs as its agent (`weir agent` in the node namespace).
    /// Default: `weir` in the directory of this weir-lab binary. Unused with
    /// --agent-image, which runs the image's.
    #[arg(long, env = "WEIR_BIN", value_name = "PATH", global = true)]
    pub weir_bin: Option<PathBuf>,
    #[command(subcommand)]
    pub command: LabCommand,
}

#[derive(Args)]
pub struct UpArgs {
    #[arg(long, value_enum, default_value_t = DataplaneKind::Ebpf)]
    pub dataplane: DataplaneKind,
    /// How the node wires its pods. routed: one veth per pod with a /32 and /128 host
    /// route and a link-local gateway (Calico, Cilium). bridge: every pod's veth is a port
    /// of the Linux bridge cni0, which holds the pools' first addresses as the pods'
    /// gateway; pods have the pools' prefix length, and bridged packets pass iptables
    /// (bridge-nf-call-iptables=1), as on flannel, kubenet and Azure CNI bridge nodes.
    /// Later commands use the topology the lab was built with.
    #[arg(long, value_enum, default_value_t = Topology::Routed)]
    pub topology: Topology,
    /// Pool for pod IPv4 addresses not given in status.podIPs.
    #[arg(long, default_value = DEFAULT_IPV4_POOL)]
    pub ipv4_pool: Ipv4Net,
    /// Pool for pod IPv6 addresses not given in status.podIPs.
    #[arg(long, default_value = DEFAULT_IPV6_POOL)]
    pub ipv6_pool: Ipv6Net,
    /// Build the world without the agent: nothing is enforced (a baseline).
    #[arg(long, hide = true)]
    pub without_agent: bool,
    /// Where the lab's objects live. file: objects.yaml in the state directory, read by the
    /// agent in file mode. server: the real etcd and kube-apiserver of the pinned
    /// Kubernetes release (built by `cargo xtask setup`) run in the node namespace; the lab
    /// writes Namespaces, Pods (with status), NetworkPolicies, Services (with their
    /// EndpointSlices) and the Node there, and the
    /// agent runs in cluster mode with deploy/'s ServiceAccount and RBAC, as the DaemonSet.
    /// Default: file, or server when --proxy is given.
    #[arg(long, value_enum)]
    pub api: Option<ApiMode>,
    /// Services the lab adds. none: only the manifests' own. auto: one ClusterIP Service
    /// per pod, named after it, on all its declared ports, selecting it by the label
    /// `weir.io/lab-pod: NAME` that the lab adds to every pod (only selectors on that key
    /// see it), as the upstream e2e netpol suite does. In both cases the lab allocates
    /// IPv4 ClusterIPs (from 10.96.0.0/16) and nodePorts for Services that name none, and,
    /// in server mode, writes their EndpointSlices (there is no controller-manager).
    #[arg(long, value_enum, default_value_t = ServicesMode::None)]
    pub services: ServicesMode,
    /// Run the real kube-proxy (built by `cargo xtask setup`) in the node namespace, in
    /// this mode, against the lab's API server (implies --api server), with the least
    /// privilege of the built-in system:node-proxier ClusterRole. Its log is
    /// kube-proxy.log in the state directory. ipvs needs IPVS and dummy devices in the
    /// kernel, nftables the `nft` binary; both are checked first.
    #[arg(long, value_enum, default_value_t = ProxyMode::None)]
    pub proxy: ProxyMode,
    /// Run the agent from weir's image (an OCI layout, PATH[:TAG]; `cargo xtask image`
    /// writes target/image/oci) under runc, as the DaemonSet's pod: the runtime spec is
    /// derived from deploy/daemonset.yaml (or the file WEIR_LAB_DAEMONSET names): its
    /// command and args, env, securityContext, hostNetwork, hostPath volumes and mounts, and
    /// memory limit. The lab adds its state directory, bound at the same path (status file,
    /// objects, kubeconfig), and its agent flags. Default: the agent is the weir binary
    /// (--weir-bin), run directly in the node namespace.
    #[arg(long, value_name = "LAYOUT[:TAG]")]
    pub agent_image: Option<String>,
    /// A flag for the lab's agent, after the lab's own (repeatable), kept for every later
    /// start: `--agent-arg=--ebpf-attach=netlink` runs the eBPF dataplane's netlink
    /// attachment, `--agent-arg=--iptables-backend=legacy` the legacy iptables backend, as
    /// a node configured so would.
    #[arg(long = "agent-arg", value_name = "FLAG", allow_hyphen_values = true)]
    pub agent_args: Vec<String>,
    /// Who enforces the lab's policies. weir: weir's agent, on --dataplane. The others are
    /// the peers weir is measured against, run in its place in the node namespace against
    /// the lab's API server (implies --api server) as their DaemonSets would, from the
    /// binaries `cargo xtask peers --build-only` builds at the versions deploy/peer-versions
    /// pins; their log is peer.log in the state directory. kube-router: its
    /// network-policy controller alone (iptables and ipset). kube-network-policies:
    /// nftables with NFQUEUE (the kernel's nft `queue` is checked first). azure-npm: Azure
    /// NPM with its Linux DaemonSet's config and flags (iptables and ipset), built from its
    /// source archive. NAME@VERSION runs another version deploy/peer-versions pins
    /// (azure-npm@v1.5.36). The lab takes a peer's change as enforced once its rules have
    /// stood still for 1.5 s (a peer reports no applied generation); probes and JSON are
    /// the same, with the enforcer's name where the dataplane's would be.
    #[arg(long, value_name = "NAME[@VERSION]", value_parser = parse_enforcer, default_value = "weir")]
    pub enforcer: EnforcerChoice,
    /// The ClusterNetworkPolicy CRD (a YAML file) the lab's API server gets instead of the
    /// one deploy/crds/ ships (network-policy-api's standard channel): its experimental
    /// channel, say, whose `nodes` peers the standard schema refuses. Server mode only.
    #[arg(long, value_name = "FILE")]
    pub cluster_policy_crd: Option<PathBuf>,
    /// Server mode: run `weir relay` and its own etcd in the node namespace (the relay's
    /// log is api/relay.log) and the agent with --relay, reading every object from that
    /// etcd instead of from the API server. `weir-lab relay` stops, starts and compacts it.
    #[arg(long)]
    pub relay: bool,
    #[command(flatten)]
    pub wait: WaitArgs,
    #[arg(required = true)]
    pub manifests: Vec<PathBuf>,
}

/// `--enforcer NAME[@VERSION]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnforcerChoice {
    pub enforcer: Enforcer,
    pub version: Option<String>,
}

fn parse_enforcer(text: &str) -> Result<EnforcerChoice, String> {
    let (name, version) = match text.split_once('@') {
        Some((name, version)) => (name, Some(version.to_string())),
        None => (text, None),
    };
    let enforcer = <Enforcer as clap::ValueEnum>::from_str(name, false).map_err(|_| {
        let names: Vec<&str> = Enforcer::value_variants()
            .iter()
            .map(|e| e.name())
            .collect();
        format!("{name:?} is not one of {}", names.join(", "))
    })?;
    Ok(EnforcerChoice { enforcer, version })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ApiMode {
    File,
    Server,
}

#[derive(Args)]
pub struct WaitArgs {
    /// Seconds to wait for the agent to enforce a change (more on a slow machine, such as
    /// a software-emulated kernel: `cargo xtask kernels` sets the variable).
    #[arg(long, env = "WEIR_LAB_TIMEOUT_SECS", default_value_t = 60)]
    pub timeout_secs: u64,
    /// Write the change and return without waiting for the agent (apply and delete only;
    /// for tests of an agent that is stopped or cut off from its API server). Applying the
    /// same manifest again without it waits until the agent enforces everything.
    #[arg(long)]
    pub no_wait: bool,
}

#[derive(Args)]
pub struct ProbeArgs {
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
    /// Address family to probe over.
    #[arg(long, value_enum, default_value_t = IpFamily::Ipv4)]
    pub family: IpFamily,
    /// How long one probe waits for an answer (a local veth answers in microseconds;
    /// the margin is for a loaded machine).
    #[arg(long, env = "WEIR_LAB_PROBE_TIMEOUT_MS", default_value_t = 700)]
    pub timeout_ms: u64,
    /// What to connect to. pod: each pod's own address. service: the ClusterIP and port
    /// of a Service whose backend is that pod on that port (the first by namespace/name;
    /// targets no Service reaches are listed as skipped, never counted as blocked);
    /// needs a kube-proxy (--proxy) to lead anywhere. both: each target both ways. The
    /// entries' from/to/port/protocol are the pod's, so verdicts compare across `via`.
    #[arg(long, value_enum, default_value_t = Via::Pod)]
    pub via: Via,
}

#[derive(Subcommand)]
pub enum LabCommand {
    /// Build the node and its pods from MANIFEST..., start the agent, wait for enforcement.
    Up(UpArgs),
    /// Create or update objects, as `kubectl apply`; returns once they are enforced.
    Apply {
        #[command(flatten)]
        wait: WaitArgs,
        #[arg(required = true)]
        manifests: Vec<PathBuf>,
    },
    /// Delete the objects MANIFEST... names; returns once the deletion is enforced.
    Delete {
        #[command(flatten)]
        wait: WaitArgs,
        #[arg(required = true)]
        manifests: Vec<PathBuf>,
    },
    /// Send real traffic between all pods and print the reachability matrices.
    Probe(ProbeArgs),
    /// List the pods and their addresses.
    Pods {
        #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
        output: OutputFormat,
    },
    /// Ask the lab's agent what it enforces, as `weir status` asks a node's: the dataplane
    /// and why, sync state, what is enforced and refused, map pressure, undeletable sets
    /// and the last converge.
    Status {
        #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
        output: OutputFormat,
    },
    /// Remove the whole lab: agent, listeners, namespaces, pins. Safe to run twice.
    Down,
    /// up, probe, down in one command (down also on failure): the demo.
    Run {
        #[command(flatten)]
        up: UpArgs,
        #[command(flatten)]
        probe: ProbeArgs,
    },
    /// Server mode: stop, start or compact the lab's control plane, to test the agent
    /// against an API server that goes away, comes back or forgets history.
    Api {
        #[command(subcommand)]
        action: ApiAction,
    },
    /// `up --relay`: stop, start or compact the relay or its etcd, to test the agent
    /// against a relay that goes away, comes back or forgets history.
    Relay {
        #[command(subcommand)]
        action: RelayAction,
    },
    /// Signal or (re)start the lab's agent, to test restarts, crashes and freezes.
    Agent {
        #[command(subcommand)]
        action: AgentAction,
    },
    /// The lab's peer (`up --enforcer`): its status, a signal, a restart as kubelet
    /// restarts a crashed container, or the node handed over to weir's agent.
    Peer {
        #[command(subcommand)]
        action: PeerAction,
    },
    /// A real cluster on this machine: kubelet nodes (each its own network and mount
    /// namespace, containerd, runc, kube-proxy, the ptp CNI plugin) against the lab's
    /// control plane plus controller-manager and scheduler. Components are built by `cargo
    /// xtask setup` and `cargo xtask cluster --build-only`.
    Cluster {
        /// Where the cluster keeps its files (not under /run, /var/lib or /var/log).
        #[arg(long, default_value = super::cluster::DEFAULT_DIR)]
        dir: PathBuf,
        #[command(subcommand)]
        action: super::cluster::cli::ClusterAction,
    },
    /// A control plane outside a lab, in a namespace of the caller's (the bench's cluster
    /// path drives it).
    #[command(hide = true)]
    Kube {
        #[command(subcommand)]
        action: KubeAction,
    },
    /// Serve the given PORT/PROTOCOL pairs (started by the lab inside each pod).
    #[command(hide = true)]
    Listen {
        #[arg(value_parser = ops::parse_port)]
        ports: Vec<ServedPort>,
    },
    /// Answer Azure NPM's instance-metadata requests (started by the lab in the node
    /// namespace when NPM enforces).
    #[command(hide = true)]
    Imds,
}

#[derive(Subcommand)]
pub enum KubeAction {
    /// Start etcd and kube-apiserver inside NETNS with their files in DIR, apply deploy/'s
    /// RBAC, and print their pids as JSON. The agent's kubeconfig is DIR/kubeconfig-agent.
    Start {
        #[arg(long)]
        netns: String,
        #[arg(long)]
        dir: PathBuf,
    },
    /// Write FILE's objects to that server (only what differs from --previous), print
    /// `written NS` (CLOCK_MONOTONIC nanoseconds just before the first write) once the last
    /// write is acknowledged, then
    /// `digest HEX`, the state digest the agent reports once it has applied them.
    Apply {
        #[arg(long)]
        netns: String,
        #[arg(long)]
        dir: PathBuf,
        /// The agent's Node. Accepted as before, and no longer needed: the digest covers
        /// every Node, as the agent now watches them all.
        #[arg(long)]
        node: Option<String>,
        #[arg(long)]
        previous: Option<PathBuf>,
        file: PathBuf,
    },
    /// Start kube-apiserver again on that control plane's files (after its process was
    /// stopped; etcd still runs), wait until it is ready, and print its pid as JSON.
    StartApiserver {
        #[arg(long)]
        netns: String,
        #[arg(long)]
        dir: PathBuf,
    },
    /// Start `weir relay` and its etcd (127.0.0.1:2381) in NETNS on that control plane, wait
    /// until the relay has written a complete list of every kind, and print their pids as
    /// JSON. Agents started with --relay=http://127.0.0.1:2381 read from it.
    StartRelay {
        #[arg(long)]
        netns: String,
        #[arg(long)]
        dir: PathBuf,
    },
    /// Print that server's /metrics (Prometheus text), read as the admin.
    Metrics {
        #[arg(long)]
        netns: String,
        #[arg(long)]
        dir: PathBuf,
    },
    /// Write changes at a steady rate, whether or not anyone has seen the ones before: the
    /// change from each FILE to the next (the last back to the first) in turn, CHANGES of
    /// them, the k-th due k × INTERVAL after the first. The first FILE must be what the
    /// server holds (as the last `kube apply` left it). Prints `written NS digest HEX` per
    /// change once it is acknowledged (NS: CLOCK_MONOTONIC nanoseconds just before its first
    /// write; HEX: the state digest an agent reports once it has applied it).
    Churn {
        #[arg(long)]
        netns: String,
        #[arg(long)]
        dir: PathBuf,
        /// Milliseconds between the changes' due times (100: ten a second).
        #[arg(long, default_value_t = 100)]
        interval_ms: u64,
        /// How many changes to write.
        #[arg(long)]
        changes: usize,
        #[arg(num_args = 2.., required = true)]
        files: Vec<PathBuf>,
    },
    /// Write an object no weir agent watches (ConfigMap default/weir-lab-touch, its data
    /// the time): the cluster's resourceVersion moves on while every agent's watches stay
    /// where they were, so that a kube-apiserver started after it finds them too old (410)
    /// and the agents list again: the bench's 410 storm. Prints the new resourceVersion.
    Touch {
        #[arg(long)]
        netns: String,
        #[arg(long)]
        dir: PathBuf,
        /// Write a key outside the API server's prefix to etcd itself instead (works
        /// while the API server is stopped): no bookmark can carry that revision to an
        /// agent before a restart, so every watch is found too old, not only those whose
        /// last bookmark came before the write.
        #[arg(long)]
        etcd: bool,
    },
}

#[derive(Subcommand)]
pub enum AgentAction {
    /// Send a signal to the agent: term, kill, stop (freeze) or cont (thaw).
    Signal {
        #[arg(value_enum)]
        signal: AgentSignal,
    },
    /// Start the agent again (after `signal kill` or `signal term`); returns at once.
    /// The agent inherits this command's environment (WEIR_RESYNC_SECONDS, ...).
    Start,
}

#[derive(Subcommand)]
pub enum PeerAction {
    /// Print the peer's name, version, pid and whether it runs, as JSON.
    Status,
    /// Send a signal to the peer: term, kill, stop (freeze) or cont (thaw).
    Signal {
        #[arg(value_enum)]
        signal: AgentSignal,
    },
    /// Start the peer again, as kubelet restarts a crashed container (a process still
    /// running is stopped first); returns at once and prints its status as JSON. Its log
    /// (peer.log) starts afresh.
    Start {
        /// Another version deploy/peer-versions pins, as a new image of its DaemonSet.
        #[arg(long)]
        version: Option<String>,
    },
    /// Hand the node over to weir's agent: the peer stops (its DaemonSet no longer
    /// selects the node; its rules stay behind), the Node gets the `weir.io/dataplane`
    /// label, and weir's agent starts and takes over; returns once it enforces everything.
    Handover {
        #[arg(long, value_enum, default_value_t = DataplaneKind::Ebpf)]
        dataplane: DataplaneKind,
        #[command(flatten)]
        wait: WaitArgs,
    },
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum AgentSignal {
    Term,
    Kill,
    Stop,
    Cont,
}

impl AgentSignal {
    fn number(self) -> i32 {
        match self {
            AgentSignal::Term => libc::SIGTERM,
            AgentSignal::Kill => libc::SIGKILL,
            AgentSignal::Stop => libc::SIGSTOP,
            AgentSignal::Cont => libc::SIGCONT,
        }
    }
}

pub fn run(args: LabArgs) -> anyhow::Result<()> {
    let dir = LabDir::new(&args.state_dir);
    let weir = WeirBinary::new(args.weir_bin);
    match args.command {
        LabCommand::Up(up) => up_lab(&dir, &up, &weir),
        LabCommand::Apply { wait, manifests } => {
            ops::apply(&dir, &manifests, wait.wait()).context("weir-lab apply")
        }
        LabCommand::Delete { wait, manifests } => {
            ops::delete(&dir, &manifests, wait.wait()).context("weir-lab delete")
        }
        LabCommand::Probe(probe) => probe_lab(&dir, &probe),
        LabCommand::Pods { output } => print_pods(&dir, output),
        LabCommand::Status { output } => dir
            .load()
            .and_then(|state| super::agent::report(&state))
            .map_err(anyhow::Error::from)
            .and_then(|report| weir::status_cli::print(&report, output))
            .context("weir-lab status"),
        LabCommand::Down => ops::down(&dir).context("weir-lab down"),
        LabCommand::Run { up, probe } => {
            let result = up_lab(&dir, &up, &weir).and_then(|()| probe_lab(&dir, &probe));
            let down = ops::down(&dir).context("weir-lab down");
            result.and(down)
        }
        LabCommand::Api { action } => ops::api(&dir, &action).context("weir-lab api"),
        LabCommand::Relay { action } => ops::relay(&dir, &action, &weir).context("weir-lab relay"),
        LabCommand::Agent { action } => match action {
            AgentAction::Signal { signal } => ops::signal_agent(&dir, signal.number()),
            AgentAction::Start => ops::restart_agent(&dir, &weir),
        }
        .context("weir-lab agent"),
        LabCommand::Peer { action } => match action {
            PeerAction::Status => print_json(&super::peers::status(&dir)?),
            PeerAction::Signal { signal } => Ok(super::peers::signal(&dir, signal.number())?),
            PeerAction::Start { version } => {
                print_json(&super::peers::restart(&dir, version.as_deref())?)
            }
            PeerAction::Handover { dataplane, wait } => Ok(super::peers::handover(
                &dir,
                &weir,
                dataplane,
                wait.timeout(),
            )?),
        }
        .context("weir-lab peer"),
        LabCommand::Kube { action } => match action {
            KubeAction::Start { netns, dir } => ops::kube_start(&netns, &dir),
            KubeAction::Apply {
                netns,
                dir,
                node: _,
                previous,
                file,
            } => ops::kube_apply(&netns, &dir, previous.as_deref(), &file),
            KubeAction::StartApiserver { netns, dir } => ops::kube_start_apiserver(&netns, &dir),
            KubeAction::StartRelay { netns, dir } => ops::kube_start_relay(&netns, &dir, &weir),
            KubeAction::Metrics { netns, dir } => ops::kube_metrics(&netns, &dir),
            KubeAction::Touch { netns, dir, etcd } => ops::kube_touch(&netns, &dir, etcd),
            KubeAction::Churn {
                netns,
                dir,
                interval_ms,
                changes,
                files,
            } => ops::kube_churn(
                &netns,
                &dir,
                Duration::from_millis(interval_ms),
                changes,
                &files,
            ),
        }
        .context("weir-lab kube"),
        LabCommand::Cluster { dir, action } => super::cluster::cli::run(&dir, action),
        LabCommand::Listen { ports } => super::listen::serve(&ports).context("weir-lab listen"),
        LabCommand::Imds => super::peers::serve_imds().context("weir-lab imds"),
    }
}

impl WaitArgs {
    fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout_secs)
    }
    /// None: do not wait.
    fn wait(&self) -> Option<Duration> {
        (!self.no_wait).then(|| self.timeout())
    }
}

fn up_lab(dir: &LabDir, up: &UpArgs, weir: &WeirBinary) -> anyhow::Result<()> {
    if up.api == Some(ApiMode::File) && up.proxy != ProxyMode::None {
        anyhow::bail!(
            "weir-lab up: --proxy runs kube-proxy against the lab's API server; it cannot be combined with --api file"
        );
    }
    if up.api == Some(ApiMode::File) && up.enforcer.enforcer != Enforcer::Weir {
        anyhow::bail!(
            "weir-lab up: --enforcer {} runs against the lab's API server; it cannot be combined with --api file",
            up.enforcer.enforcer.name()
        );
    }
    let api_server = match up.api {
        Some(mode) => mode == ApiMode::Server,
        None => up.proxy != ProxyMode::None || up.enforcer.enforcer != Enforcer::Weir,
    };
    if up.relay && (!api_server || up.enforcer.enforcer != Enforcer::Weir) {
        anyhow::bail!("weir-lab up: --relay serves weir's agent from the lab's API server: it needs --api server and no --enforcer");
    }
    let opts = UpOptions {
        relay: up.relay,
        dataplane: up.dataplane,
        topology: up.topology,
        ipv4_pool: up.ipv4_pool,
        ipv6_pool: up.ipv6_pool,
        without_agent: up.without_agent,
        timeout: up.wait.timeout(),
        api_server,
        services: up.services,
        proxy: up.proxy,
        agent_image: up.agent_image.clone(),
        agent_args: up.agent_args.clone(),
        enforcer: up.enforcer.enforcer,
        enforcer_version: up.enforcer.version.clone(),
        weir: weir.clone(),
        cluster_policy_crd: match &up.cluster_policy_crd {
            Some(_) if !api_server => {
                anyhow::bail!(
                    "weir-lab up: --cluster-policy-crd is for the lab's API server (--api server)"
                )
            }
            Some(path) => Some(std::fs::read_to_string(path).with_context(|| {
                format!("weir-lab up: --cluster-policy-crd {}", path.display())
            })?),
            None => None,
        },
    };
    ops::up(dir, &opts, &up.manifests).context("weir-lab up")
}

fn probe_lab(dir: &LabDir, args: &ProbeArgs) -> anyhow::Result<()> {
    let state = dir.load()?;
    let pods: Vec<_> = state.pods.values().cloned().collect();
    let started = Instant::now();
    let run = dir.next_probe_run()?;
    if args.via != Via::Pod && state.proxy.is_none() {
        eprintln!(
            "warning: this lab runs no kube-proxy (weir-lab up --proxy): nothing forwards its ClusterIPs, so probes via service fail"
        );
    }
    let frontends = match args.via {
        Via::Pod => Default::default(),
        _ => super::services::frontends(&ObjectSet::load(&dir.objects_file())?),
    };
    let plan = probe::plan(&pods, args.family, args.via, &frontends);
    let probes = probe::probe_all(&pods, &plan, Duration::from_millis(args.timeout_ms), run)
        .context("weir-lab probe")?;
    let dataplane = match (&state.peer, state.with_agent) {
        (Some(peer), _) => peer.enforcer.name().to_string(),
        (None, true) => super::agent::current_dataplane(dir).unwrap_or(state.dataplane.to_string()),
        (None, false) => "none".to_string(),
    };
    let text = match args.output {
        OutputFormat::Json => output::json_with_skipped(&dataplane, &probes, &plan.skipped) + "\n",
        OutputFormat::Table => format!(
            "{}{}{} probes in {:.2?}\n",
            output::table(&dataplane, &probes),
            output::skipped(&plan.skipped),
            probes.len(),
            started.elapsed()
        ),
    };
    Ok(weir::stdout::print(&text)?)
}

fn print_json(value: &impl Serialize) -> anyhow::Result<()> {
    Ok(weir::stdout::print(
        &(serde_json::to_string(value)? + "\n"),
    )?)
}

#[derive(Serialize)]
struct PodAddresses {
    pod: String,
    ip: Option<String>,
    ipv6: Option<String>,
}

fn print_pods(dir: &LabDir, output: OutputFormat) -> anyhow::Result<()> {
    let state = dir.load()?;
    let pods: Vec<PodAddresses> = state
        .pods
        .values()
        .map(|p| PodAddresses {
            pod: p.key(),
            ip: p.ipv4.map(|a| a.to_string()),
            ipv6: p.ipv6.map(|a| a.to_string()),
        })
        .collect();
    let text = match output {
        OutputFormat::Json => serde_json::to_string(&pods)? + "\n",
        OutputFormat::Table => pods
            .iter()
            .map(|p| {
                format!(
                    "{:20} {:16} {}\n",
                    p.pod,
                    p.ip.as_deref().unwrap_or("-"),
                    p.ipv6.as_deref().unwrap_or("-")
                )
            })
            .collect(),
    };
    Ok(weir::stdout::print(&text)?)
}
