//! `weir agent` configuration: flags, environment variables and an optional YAML file.
//! Precedence: flag, then environment, then the file, then the default shown in `--help`.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, CommandFactory, FromArgMatches};

use super::select::DataplaneChoice;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Json,
    Text,
}

/// `--ebpf-attach`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AttachChoice {
    Auto,
    Tcx,
    Netlink,
}

impl AttachChoice {
    pub fn mode(self) -> Option<crate::dataplane::ebpf::AttachMode> {
        use crate::dataplane::ebpf::AttachMode;
        match self {
            AttachChoice::Auto => None,
            AttachChoice::Tcx => Some(AttachMode::Tcx),
            AttachChoice::Netlink => Some(AttachMode::Netlink),
        }
    }
}

/// `--iptables-backend`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendChoice {
    Auto,
    Legacy,
    Nft,
}

impl BackendChoice {
    pub fn backend(self) -> Option<crate::netfilter::backend::Backend> {
        use crate::netfilter::backend::Backend;
        match self {
            BackendChoice::Auto => None,
            BackendChoice::Legacy => Some(Backend::Legacy),
            BackendChoice::Nft => Some(Backend::Nft),
        }
    }
}

/// Run the node agent. Without --manifests it watches the Kubernetes API (cluster mode,
/// in-cluster config or KUBECONFIG); with --manifests it enforces the objects of a file.
#[derive(Args, Clone, Debug)]
pub struct AgentArgs {
    /// File mode: a multi-document YAML file whose first line is `# generation: N`,
    /// re-read whenever it changes.
    #[arg(long, env = "WEIR_MANIFESTS", value_name = "FILE")]
    pub manifests: Option<PathBuf>,

    /// File mode: where to write the status JSON after each convergence.
    #[arg(long, env = "WEIR_STATUS_FILE", value_name = "FILE")]
    pub status_file: Option<PathBuf>,

    /// Dataplane when this node has no `weir.io/dataplane` label. auto = eBPF when the
    /// kernel supports it, iptables otherwise. none = for benchmarks: watches, compiles and
    /// reports status, programs no kernel state (and removes none); the node label is then
    /// ignored.
    #[arg(long, env = "WEIR_DATAPLANE", value_enum, default_value_t = DataplaneChoice::Auto)]
    pub dataplane: DataplaneChoice,

    /// Where the eBPF dataplane pins its maps and records its attachments.
    #[arg(
        long,
        env = "WEIR_BPF_ROOT",
        value_name = "DIR",
        default_value = "/sys/fs/bpf/weir"
    )]
    pub bpf_root: PathBuf,

    /// This node's name (downward API `spec.nodeName`). Cluster mode needs it; in file mode
    /// it picks the Node object that selects the dataplane.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,

    /// Address of the /metrics, /healthz, /readyz, /status and /verdicts server.
    /// Default: the node's loopback, 127.0.0.1:9402, in cluster mode; none in file mode.
    /// On another address (for a Prometheus scraper), /status and /verdicts still answer
    /// loopback clients only.
    #[arg(long, env = "WEIR_LISTEN", value_name = "ADDR")]
    pub listen: Option<SocketAddr>,

    /// Full reconcile of the dataplane (drift repair, retry of undeletable sets), in seconds.
    #[arg(long, env = "WEIR_RESYNC_SECONDS", default_value_t = 60)]
    pub resync_seconds: u64,

    /// Liveness bound, in seconds: /healthz answers 503 when the run loop has not turned
    /// for this long (a dataplane write or the source wedged). Keep it above
    /// --command-timeout-seconds.
    #[arg(long, env = "WEIR_LIVENESS_SECONDS", default_value_t = 300)]
    pub liveness_seconds: u64,

    /// Every external command (ipset, iptables-restore, iptables-save, ip, tc) is killed
    /// after this many seconds, and the call fails naming the command.
    #[arg(long, env = "WEIR_COMMAND_TIMEOUT_SECONDS", default_value_t = 120)]
    pub command_timeout_seconds: u64,

    /// File mode: how often the manifest file's metadata is checked, in milliseconds.
    #[arg(long, env = "WEIR_POLL_MS", default_value_t = 100)]
    pub poll_ms: u64,

    /// Cluster mode: objects per list request, when the agent starts and when a watch has
    /// to list again. Larger pages start faster (20,000 pods: 1.8 s listed in pages of
    /// 500, 1.2 s in pages of 5,000); each page's body of the other kinds is held while it
    /// is decoded. Pods in protobuf are read as they arrive, never a whole page held. An
    /// API server answering from its watch cache may send the whole list in one page
    /// whatever this asks for.
    #[arg(long, env = "WEIR_LIST_PAGE_SIZE", default_value_t = 5000,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub list_page_size: u32,

    /// Cluster mode: how each kind's whole state is read, at the start and on a relist.
    /// pages = LIST requests of --list-page-size objects, then a watch; stream = one watch
    /// that sends the current objects first (the API server's WatchList, beta and on by
    /// default from Kubernetes 1.32), streamed from the server's watch cache instead of
    /// built into pages.
    #[arg(long, env = "WEIR_LISTS", value_enum, default_value_t = crate::source::kube::Lists::Pages)]
    pub lists: crate::source::kube::Lists,

    /// Cluster mode: read every object from the relay's etcd (`weir relay`, deploy/relay/)
    /// at these client endpoints, comma-separated, instead of watching the API server; the
    /// API server is then only written to (the node's annotation, Events). Ranges of
    /// --list-page-size records; --lists and --pod-encoding are the relay's own then.
    /// Cluster mode only.
    #[arg(long, env = "WEIR_RELAY", value_delimiter = ',')]
    pub relay: Vec<String>,

    #[command(flatten)]
    pub relay_tls: crate::source::relay::store::StoreTls,

    /// Cluster mode: the encoding Pods are asked for in. protobuf = the API server's
    /// protobuf, with JSON accepted where the server (or a proxy before it) answers in it:
    /// about 40% fewer bytes per Pod than JSON, and cheaper to encode and decode; json =
    /// JSON only, as every other kind is read.
    #[arg(long, env = "WEIR_POD_ENCODING", value_enum, default_value_t = crate::source::kube::PodEncoding::Protobuf)]
    pub pod_encoding: crate::source::kube::PodEncoding,

    /// The most table entries one NetworkPolicy may take per pod it selects, estimated
    /// from its spec (per rule, peers × port prefixes, an ipBlock's excepts counted as
    /// peers). A policy above it is refused before it is compiled, on either dataplane,
    /// with an error naming it and the figure (status, Events, log); the rest stays
    /// enforced, so one tenant cannot fill a table another needs. A Service with more
    /// frontends (addresses × ports) than this is refused too. The default is a sixteenth
    /// of eBPF's POLICY map (65,536).
    #[arg(long, env = "WEIR_MAX_ENTRIES_PER_POLICY",
          default_value_t = weir_policy::budget::DEFAULT_MAX_ENTRIES_PER_POLICY,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_entries_per_policy: u64,

    /// The most those estimates may sum to over one namespace's NetworkPolicies. The
    /// policy that would take its namespace over is refused (the ones admitted before it
    /// stay), so that many policies, each within its own bound, cannot give one tenant
    /// an unbounded share of the node's tables: every ipBlock is a prefix in eBPF's
    /// IDENTITY trie (1,048,576), and the default is a sixteenth of it.
    #[arg(long, env = "WEIR_MAX_ENTRIES_PER_NAMESPACE",
          default_value_t = weir_policy::budget::DEFAULT_MAX_ENTRIES_PER_NAMESPACE,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_entries_per_namespace: u64,

    /// Log filter (tracing `EnvFilter` syntax: `info`, `weir=debug`, ...).
    #[arg(long, env = "WEIR_LOG_LEVEL", default_value = "info")]
    pub log_level: String,

    /// Log format. Default: json in cluster mode, text in file mode.
    #[arg(long, env = "WEIR_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,

    /// Isolate a pod interface from its first packet: traffic from and to an interface
    /// named with a --pod-interface-prefixes prefix is dropped in both directions until
    /// the pod's endpoint is programmed (on both dataplanes). hostNetwork pods have no pod
    /// interface and are never affected. `false` leaves a new pod open until then.
    #[arg(
        long,
        env = "WEIR_ISOLATE_NEW_PODS",
        default_value_t = true,
        action = clap::ArgAction::Set,
        value_name = "BOOL"
    )]
    pub isolate_new_pods: bool,

    /// Host-side interface name prefixes that mark a pod interface, comma-separated:
    /// Cilium and `weir-lab` `lxc`, Calico `cali`, AWS VPC CNI `eni`, Azure CNI `azv`.
    /// Bridge CNIs (flannel, kindnet) name theirs `veth`: add it on such nodes (it is not a
    /// default because Docker's interfaces use it too).
    #[arg(
        long,
        env = "WEIR_POD_INTERFACE_PREFIXES",
        value_name = "PREFIX,...",
        value_delimiter = ',',
        default_value = "lxc,cali,eni,azv"
    )]
    pub pod_interface_prefixes: Vec<String>,

    /// Pod interfaces never isolated before their endpoint is programmed, comma-separated:
    /// exact names, or prefixes written `NAME*`. For bootstrap pods that must talk before
    /// the agent can learn them (for example CoreDNS while the agent cannot reach the API
    /// server yet). Policies still apply to them once they are programmed.
    #[arg(
        long,
        env = "WEIR_NEW_POD_EXEMPT_INTERFACES",
        value_name = "NAME[*],...",
        value_delimiter = ','
    )]
    pub new_pod_exempt_interfaces: Vec<String>,

    /// Where the node's pod network namespaces are (container runtimes: /run/netns, which
    /// the DaemonSet mounts). On a bridged CNI (flannel, kubenet, Azure CNI bridge mode)
    /// each pod's bridge port is found through the veth peer of the interface holding the
    /// pod's address in its namespace; a pod whose port is not found stays isolated.
    #[arg(
        long,
        env = "WEIR_POD_NETNS_DIR",
        value_name = "DIR",
        default_value = crate::dataplane::pod_ports::DEFAULT_POD_NETNS_DIR
    )]
    pub pod_netns_dir: PathBuf,

    /// How the eBPF dataplane attaches to pod interfaces. auto: a TCX link where the kernel
    /// has TCX (6.6 and later), a netlink clsact filter otherwise. netlink forces the path
    /// 5.10–6.5 kernels take, also on a newer kernel (tests run it so); tcx refuses to start
    /// where the kernel lacks it.
    #[arg(long, env = "WEIR_EBPF_ATTACH", value_enum, default_value_t = AttachChoice::Auto)]
    pub ebpf_attach: AttachChoice,

    /// Entries of the eBPF dataplane's IDENTITY trie: every distinct address prefix that
    /// policies name (each pod's addresses, ipBlocks and their excepts, node addresses).
    /// When they do not all fit, the prefixes left out are reported, and the pod
    /// directions that would misjudge their addresses deny every peer until they fit.
    /// A changed size replaces the pinned maps on the next start (enforcement continues
    /// on the old ones until the new are filled).
    #[arg(long, env = "WEIR_EBPF_IDENTITY_ENTRIES", value_name = "N", default_value_t = crate::dataplane::ebpf::DEFAULT_IDENTITY_ENTRIES, value_parser = clap::value_parser!(u32).range(16..))]
    pub ebpf_identity_entries: u32,

    /// Entries of the eBPF dataplane's SERVICE map: every Service frontend in the cluster
    /// (each clusterIP, externalIP and load-balancer IP with each port, and each nodePort).
    /// When they do not all fit, nodePorts and frontends on the node's own addresses go
    /// first, then each namespace's up to an equal share; the frontends left out are
    /// reported, and pods whose traffic is judged (isolated, or under
    /// ClusterNetworkPolicy tiers) are refused at them, since the backend that decides is
    /// unknown before kube-proxy's DNAT. A changed size replaces the pinned maps on the
    /// next start.
    #[arg(long, env = "WEIR_EBPF_SERVICE_ENTRIES", value_name = "N", default_value_t = crate::dataplane::ebpf::DEFAULT_SERVICE_ENTRIES, value_parser = clap::value_parser!(u32).range(16..))]
    pub ebpf_service_entries: u32,

    /// Which iptables backend the iptables dataplane writes. auto: the one the node's
    /// other rules use (kubelet's and kube-proxy's chains; nft when there are none).
    /// legacy or nft forces it: weir's rules then live where the others may not look.
    #[arg(long, env = "WEIR_IPTABLES_BACKEND", value_enum, default_value_t = BackendChoice::Auto)]
    pub iptables_backend: BackendChoice,

    /// Where the verdict log goes: `log` (one JSON line per record on stderr, beside this
    /// log), a file path (appended), or `off`. Each record is a drop or an audit verdict
    /// (what an audit-mode policy would drop) from either dataplane: the 5-tuple, both pods,
    /// the direction, and the deciding policy and rule or "default deny by" the policies
    /// isolating the pod. `weir monitor` reads the same stream from --listen's /verdicts.
    #[arg(
        long,
        env = "WEIR_VERDICT_LOG",
        value_name = "log|FILE|off",
        default_value = "log"
    )]
    pub verdict_log: crate::verdicts::VerdictSink,

    /// Records per second each pod may add to the verdict stream; what is held back is
    /// counted (`suppressed`) on the pod's next record, or in a summary record.
    #[arg(long, env = "WEIR_VERDICT_LOG_RATE", default_value_t = 10)]
    pub verdict_log_rate: u32,

    /// Records a pod may add at once, above --verdict-log-rate, after a quiet spell.
    #[arg(long, env = "WEIR_VERDICT_LOG_BURST", default_value_t = 20)]
    pub verdict_log_burst: u32,

    /// Optional YAML file whose keys are these flags' long names (`resync-seconds: 30`).
    #[arg(long, env = "WEIR_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// The default metrics/health address in cluster mode: the node's loopback (the agent
/// runs on the host network), so no pod reaches it unless the operator says so.
pub const CLUSTER_LISTEN: &str = "127.0.0.1:9402";

#[derive(clap::Parser)]
#[command(name = "weir agent", args_override_self = true)]
struct Standalone {
    #[command(flatten)]
    args: AgentArgs,
}

impl AgentArgs {
    pub fn is_file_mode(&self) -> bool {
        self.manifests.is_some()
    }

    pub fn listen_addr(&self) -> Option<SocketAddr> {
        match self.listen {
            Some(a) => Some(a),
            None if self.is_file_mode() => None,
            // A constant that parses.
            None => CLUSTER_LISTEN.parse().ok(),
        }
    }

    /// What --isolate-new-pods, --pod-interface-prefixes and --new-pod-exempt-interfaces say.
    pub fn new_pods(&self) -> crate::dataplane::new_pods::NewPodIsolation {
        if !self.isolate_new_pods {
            return crate::dataplane::new_pods::NewPodIsolation::off();
        }
        let list = |v: &[String]| {
            v.iter()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect()
        };
        crate::dataplane::new_pods::NewPodIsolation {
            prefixes: list(&self.pod_interface_prefixes),
            exempt: list(&self.new_pod_exempt_interfaces),
        }
    }

    pub fn log_format(&self) -> LogFormat {
        self.log_format.unwrap_or(if self.is_file_mode() {
            LogFormat::Text
        } else {
            LogFormat::Json
        })
    }

    /// Fills what neither a flag nor the environment set from the `--config` file.
    /// `argv` is the agent's own arguments (after `agent`).
    pub fn with_config_file(self, argv: &[String]) -> Result<AgentArgs, ConfigError> {
        let Some(path) = self.config.clone() else {
            return Ok(self);
        };
        let text = std::fs::read_to_string(&path).map_err(|e| ConfigError::Read {
            path: path.clone(),
            source: e,
        })?;
        let map: std::collections::BTreeMap<String, serde_yaml::Value> =
            serde_yaml::from_str(&text).map_err(|e| ConfigError::Parse {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        let cmd = Standalone::command();
        let mut merged = vec!["weir-agent".to_string()];
        for (key, value) in map {
            let arg = cmd
                .get_arguments()
                .find(|a| a.get_long() == Some(key.as_str()) && key != "config")
                .ok_or_else(|| ConfigError::Parse {
                    path: path.clone(),
                    reason: format!("unknown key {key:?}"),
                })?;
            if arg
                .get_env()
                .is_some_and(|var| std::env::var_os(var).is_some())
            {
                continue;
            }
            let value = match value {
                serde_yaml::Value::String(s) => s,
                serde_yaml::Value::Number(n) => n.to_string(),
                serde_yaml::Value::Bool(b) => b.to_string(),
                other => {
                    return Err(ConfigError::Parse {
                        path: path.clone(),
                        reason: format!("{key}: expected a scalar, got {other:?}"),
                    })
                }
            };
            merged.push(format!("--{key}={value}"));
        }
        merged.extend(argv.iter().cloned());
        let matches = cmd
            .try_get_matches_from(&merged)
            .map_err(|e| ConfigError::Parse {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        Standalone::from_arg_matches(&matches)
            .map(|s| s.args)
            .map_err(|e| ConfigError::Parse {
                path,
                reason: e.to_string(),
            })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path}: {reason}")]
    Parse { path: PathBuf, reason: String },
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn file_fills_what_flags_leave_and_flags_win() {
        let dir = std::env::temp_dir().join(format!("weir-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("agent.yaml");
        std::fs::write(
            &file,
            "resync-seconds: 7\npoll-ms: 250\ndataplane: iptables\n",
        )
        .unwrap();
        let argv = vec![
            format!("--config={}", file.display()),
            "--poll-ms=50".to_string(),
        ];
        let args =
            Standalone::parse_from(std::iter::once("x".to_string()).chain(argv.clone())).args;
        let args = args.with_config_file(&argv).unwrap();
        assert_eq!(args.resync_seconds, 7);
        assert_eq!(args.poll_ms, 50);
        assert_eq!(args.dataplane, DataplaneChoice::Iptables);

        std::fs::write(&file, "no-such-flag: 1\n").unwrap();
        let args =
            Standalone::parse_from(std::iter::once("x".to_string()).chain(argv.clone())).args;
        let err = args.with_config_file(&argv).unwrap_err().to_string();
        assert!(err.contains("no-such-flag"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
