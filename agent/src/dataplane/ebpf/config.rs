//! Configuration of the eBPF dataplane: where its pins live and how big its maps are.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::hooks::AttachMode;
use crate::dataplane::new_pods::NewPodIsolation;

pub const DEFAULT_PIN_ROOT: &str = "/sys/fs/bpf/weir";

/// Entries of the IDENTITY trie unless `--ebpf-identity-entries` says otherwise.
pub const DEFAULT_IDENTITY_ENTRIES: u32 = 1 << 20;
/// Entries of the SERVICE hash unless `--ebpf-service-entries` says otherwise.
pub const DEFAULT_SERVICE_ENTRIES: u32 = 65536;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EbpfConfig {
    /// Directory on bpffs for maps, programs, links and the records that name them.
    pub pin_root: PathBuf,
    /// Entries of the IDENTITY trie (distinct prefixes of all address sets).
    pub identity_entries: u32,
    /// Entries of the ENDPOINT hash (local pods).
    pub endpoint_entries: u32,
    /// Entries of the SERVICE hash (every Service frontend in the cluster).
    #[serde(default = "default_service_entries")]
    pub service_entries: u32,
    /// Entries of the POLICY trie (sum over pods of rules × identities × port prefixes).
    pub policy_entries: u32,
    /// Entries of the conntrack LRU (flows).
    pub ct_entries: u32,
    /// Entries of the overflow conntrack LRU: flows of endpoints over their budget.
    pub ct_overflow_entries: u32,
    /// New entries per second an endpoint may add to the main conntrack table; more go
    /// to the overflow table, so no one pod can churn the main table (see ARCHITECTURE.md).
    pub ct_new_per_sec: u64,
    /// How many new main-table entries an endpoint may add at once.
    pub ct_new_burst: u64,
    /// Entries of the fragment LRU (fragmented datagrams in flight, for 30 s at most).
    pub frag_entries: u32,
    /// COUNTERS slots, hence the highest rule id + 1.
    pub counter_entries: u32,
    /// Bytes of the EVENTS ring buffer (a power of two, a multiple of the page size).
    pub events_bytes: u32,
    /// Verdict events per second and CPU (also the burst); the rest are counted only.
    pub events_per_sec: u64,
    /// Kernel-side aya-log debug records (off: the verifier removes the logging code).
    /// Fixed when the programs are first loaded; pinned programs keep their setting.
    pub kernel_debug_log: bool,
    /// How to attach: `None` picks TCX where the kernel has it (6.6+), else netlink.
    pub attach_mode: Option<AttachMode>,
    /// The node's iptables backend, for the one chain this dataplane keeps there;
    /// `None`: detected as kube-proxy's wrapper does.
    pub iptables_backend: Option<crate::netfilter::backend::Backend>,
    /// Pod interfaces isolated from their first packet until their endpoint is programmed.
    #[serde(default)]
    pub new_pods: NewPodIsolation,
    /// Where pods' network namespaces are: a pod on a bridge is matched to its port
    /// through them (see [`crate::dataplane::pod_ports`]).
    #[serde(default = "default_pod_netns_dir")]
    pub pod_netns_dir: PathBuf,
}

fn default_service_entries() -> u32 {
    DEFAULT_SERVICE_ENTRIES
}

fn default_pod_netns_dir() -> PathBuf {
    PathBuf::from(crate::dataplane::pod_ports::DEFAULT_POD_NETNS_DIR)
}

impl Default for EbpfConfig {
    fn default() -> Self {
        EbpfConfig {
            pin_root: PathBuf::from(DEFAULT_PIN_ROOT),
            // LPM tries are never preallocated: capacity costs nothing until used, and
            // 100,000 remote pods need more than 65,536 prefixes.
            identity_entries: DEFAULT_IDENTITY_ENTRIES,
            endpoint_entries: 4096,
            service_entries: DEFAULT_SERVICE_ENTRIES,
            policy_entries: 65536,
            ct_entries: 262144,
            ct_overflow_entries: 65536,
            ct_new_per_sec: 100,
            ct_new_burst: 2000,
            frag_entries: 16384,
            counter_entries: 16384,
            events_bytes: 1 << 20,
            events_per_sec: 1000,
            kernel_debug_log: false,
            attach_mode: None,
            iptables_backend: None,
            new_pods: NewPodIsolation::default(),
            pod_netns_dir: default_pod_netns_dir(),
        }
    }
}

impl EbpfConfig {
    /// The default sizes with another pin root (tests, `--bpf-root`).
    pub fn with_pin_root(pin_root: impl Into<PathBuf>) -> Self {
        EbpfConfig {
            pin_root: pin_root.into(),
            ..Default::default()
        }
    }
}
