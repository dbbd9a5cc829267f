//! The lab's state directory: which namespaces, addresses and ports exist, so that
//! separate `weir-lab` commands work on the same lab. Every type state.json holds is
//! defined here (the modes `up` was given, the records of kube-proxy and of a peer), so
//! this module uses none of the modules that act on the lab, and they all use it.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use ipnet::{Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};

use super::LabError;
use weir::dataplane::DataplaneKind;
use weir_policy::desired::Protocol;

pub const DEFAULT_DIR: &str = "/run/weir-lab";

/// A port a pod declares, which its listener serves and the prober probes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ServedPort {
    pub port: u16,
    pub protocol: Protocol,
}

/// How the node wires its pods.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Topology {
    /// One veth per pod, a host route (/32, /128) per pod address and a link-local
    /// gateway, as Calico and Cilium wire pods.
    #[default]
    Routed,
    /// Every pod's host-side veth is a port of one Linux bridge, cni0, that carries the
    /// pools' gateway addresses, as flannel (cni0), kubenet (cbr0) and Azure CNI in bridge
    /// mode wire pods; br_netfilter passes bridged packets to iptables.
    Bridge,
}

/// One Pod of the lab.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodState {
    pub namespace: String,
    pub name: String,
    /// The pod's own network namespace.
    pub netns: String,
    /// The veth end in the node namespace: the pod interface the dataplane attaches to.
    pub host_if: String,
    pub ipv4: Option<Ipv4Addr>,
    pub ipv6: Option<Ipv6Addr>,
    pub ports: Vec<ServedPort>,
}

impl PodState {
    /// `NAMESPACE/NAME`, as the prober and `weir-lab pods` print it.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LabState {
    /// Prefix of every namespace this lab owns.
    pub id: String,
    pub node_netns: String,
    pub bpf_root: PathBuf,
    pub dataplane: DataplaneKind,
    /// How pods are wired (absent in the state of labs from before topologies: routed).
    #[serde(default)]
    pub topology: Topology,
    /// False for a lab built without an agent (no enforcement: a baseline world).
    pub with_agent: bool,
    pub ipv4_pool: Ipv4Net,
    pub ipv6_pool: Ipv6Net,
    /// Generation of the last objects.yaml written.
    pub generation: u64,
    /// Pods by `NAMESPACE/NAME`.
    pub pods: BTreeMap<String, PodState>,
    /// Server mode: the lab's control plane. None: file mode.
    #[serde(default)]
    pub api: Option<ApiState>,
    /// The agent's process, once started.
    #[serde(default)]
    pub agent_pid: Option<u32>,
    /// `--services`: whether the lab adds a Service per pod.
    #[serde(default)]
    pub services: ServicesMode,
    /// `--proxy`: the lab's kube-proxy, once started. None: no kube-proxy.
    #[serde(default)]
    pub proxy: Option<ProxyState>,
    /// `--agent-image`: the agent's container. None: the agent runs directly.
    #[serde(default)]
    pub agent_container: Option<super::container::AgentContainer>,
    /// `--agent-arg`: the agent's own flags, after the lab's, at every start.
    #[serde(default)]
    pub agent_args: Vec<String>,
    /// `--enforcer`: the peer enforcing in place of weir's agent, once started.
    #[serde(default)]
    pub peer: Option<PeerState>,
}

/// The control plane of a lab in server mode (files in [`LabDir::api_dir`]).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ApiState {
    /// The Node the agent runs as (`--node-name`); every lab Pod is scheduled on it.
    pub node_name: String,
    pub etcd_pid: u32,
    pub apiserver_pid: u32,
    /// `up --relay`: the relay and its etcd.
    #[serde(default)]
    pub relay: Option<RelayState>,
}

/// `weir-lab up --relay`: `weir relay` and its etcd, in the node namespace; the agent
/// reads from that etcd (`weir agent --relay`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RelayState {
    pub store_pid: u32,
    pub relay_pid: u32,
}

/// `weir-lab up --services`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ServicesMode {
    /// Only the Services the manifests declare.
    #[default]
    None,
    /// Also one ClusterIP Service per pod, named after it, on all its declared ports.
    Auto,
}

/// `weir-lab up --proxy`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ProxyMode {
    /// No kube-proxy: ClusterIPs lead nowhere.
    #[default]
    None,
    Iptables,
    Ipvs,
    Nftables,
}

/// The lab's kube-proxy, in state.json.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProxyState {
    pub mode: ProxyMode,
    pub pid: u32,
}

/// `weir-lab up --enforcer`: who enforces the lab's policies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Enforcer {
    /// weir's own agent (`--dataplane` chooses its dataplane).
    #[default]
    Weir,
    /// kube-router's network-policy controller alone (iptables and ipset).
    KubeRouter,
    /// sigs.k8s.io/kube-network-policies (nftables, the first packet judged in user space
    /// through NFQUEUE).
    KubeNetworkPolicies,
    /// Azure NPM (v2 dataplane: iptables and ipset), built from its source archive.
    AzureNpm,
}

/// The lab's peer, in state.json.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerState {
    pub enforcer: Enforcer,
    pub version: String,
    pub pid: u32,
}

/// The files of one lab directory.
#[derive(Clone, Debug)]
pub struct LabDir {
    pub dir: PathBuf,
}

impl LabDir {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        LabDir { dir: dir.into() }
    }

    pub fn state_file(&self) -> PathBuf {
        self.dir.join("state.json")
    }
    pub fn objects_file(&self) -> PathBuf {
        self.dir.join("objects.yaml")
    }
    pub fn status_file(&self) -> PathBuf {
        self.dir.join("status.json")
    }
    /// Server mode: etcd's data, kube-apiserver's certificates, tokens, kubeconfigs, logs
    /// and the audit log.
    pub fn api_dir(&self) -> PathBuf {
        self.dir.join("api")
    }
    pub fn proxy_log(&self) -> PathBuf {
        self.dir.join("kube-proxy.log")
    }
    /// The log of the peer that `--enforcer` runs.
    pub fn peer_log(&self) -> PathBuf {
        self.dir.join("peer.log")
    }
    pub fn agent_log(&self) -> PathBuf {
        self.dir.join("agent.log")
    }
    pub fn listener_log(&self, pod: &PodState) -> PathBuf {
        self.dir
            .join(format!("listen-{}-{}.log", pod.namespace, pod.name))
    }

    /// A name derived from the directory, so that labs in different directories never
    /// share namespaces or pins, and `down` finds them even without a state file.
    pub fn lab_id(&self) -> String {
        let absolute = std::path::absolute(&self.dir).unwrap_or_else(|_| self.dir.clone());
        // FNV-1a: stable across builds, unlike the std hasher.
        let hash = absolute
            .as_os_str()
            .as_encoded_bytes()
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
            });
        format!("weirlab-{:08x}", hash as u32)
    }

    /// Numbers probe runs (see [`super::probe::probe_all`]), under the lab's lock.
    pub fn next_probe_run(&self) -> Result<u64, LabError> {
        let _lock = self.lock()?;
        let path = self.dir.join("probe-runs");
        let last: u64 = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0);
        write_atomic(&path, (last + 1).to_string().as_bytes())?;
        Ok(last + 1)
    }

    pub fn exists(&self) -> bool {
        self.state_file().exists()
    }

    pub fn load(&self) -> Result<LabState, LabError> {
        let text = match std::fs::read_to_string(self.state_file()) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(LabError::NotUp(self.dir.clone()))
            }
            Err(e) => {
                return Err(LabError::io(
                    format!("reading {}", self.state_file().display()),
                    e,
                ))
            }
        };
        serde_json::from_str(&text)
            .map_err(|e| LabError::invalid(self.state_file().display().to_string(), e.to_string()))
    }

    pub fn save(&self, state: &LabState) -> Result<(), LabError> {
        let json = serde_json::to_string_pretty(state).expect("lab state serializes");
        write_atomic(&self.state_file(), json.as_bytes())
    }

    /// Takes the directory's lock: one `weir-lab` command at a time per lab.
    pub fn lock(&self) -> Result<File, LabError> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| LabError::io(format!("creating {}", self.dir.display()), e))?;
        let path = self.dir.join("lock");
        let file = File::create(&path)
            .map_err(|e| LabError::io(format!("opening {}", path.display()), e))?;
        // SAFETY: flock on a file descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(LabError::io(
                format!("locking {}", path.display()),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(file)
    }
}

/// Writes a file so that readers see either the old or the new content, never a part.
pub fn write_atomic(path: &Path, content: &[u8]) -> Result<(), LabError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, content)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| LabError::io(format!("writing {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topology_is_recorded_and_defaults_to_routed() {
        let mut state = LabState {
            id: "weirlab-0".into(),
            node_netns: "weirlab-0-node".into(),
            bpf_root: "/sys/fs/bpf/weirlab-0".into(),
            dataplane: DataplaneKind::Ebpf,
            topology: Topology::Bridge,
            with_agent: true,
            ipv4_pool: "10.244.0.0/16".parse().unwrap(),
            ipv6_pool: "fd00:10:244::/64".parse().unwrap(),
            generation: 0,
            pods: BTreeMap::new(),
            api: None,
            agent_pid: None,
            services: Default::default(),
            proxy: None,
            agent_container: None,
            peer: None,
            agent_args: Vec::new(),
        };
        let mut json: serde_json::Value = serde_json::to_value(&state).unwrap();
        assert_eq!(json["topology"], "bridge");
        // A state file from before topologies: routed, as those labs were.
        json.as_object_mut().unwrap().remove("topology");
        state = serde_json::from_value(json).unwrap();
        assert_eq!(state.topology, Topology::Routed);
    }
}
