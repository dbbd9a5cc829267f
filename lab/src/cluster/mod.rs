//! `weir-lab cluster up|status|kubectl|import|down`: a real Kubernetes cluster on one
//! machine, with kubelets instead of the lab's hand-made pods.
//!
//! The control plane (the lab's etcd and kube-apiserver, plus kube-controller-manager and
//! kube-scheduler) runs in the network namespace `NAME-cp`, which also holds the bridge every
//! node is plugged into (so nothing is added to the host's own network). Each node is a
//! network namespace `NAME-node-I` *and* a mount namespace of its own, with a private /run,
//! bpffs at /sys/fs/bpf, and per-node directories bound over /var/lib (kubelet, containerd,
//! CNI state) and /var/log (pod logs): the DaemonSet's hostPaths (/sys/fs/bpf, /run/netns,
//! /run/xtables.lock) resolve to that node's own, unchanged. Every node runs containerd
//! (runc), a kubelet with its own client certificate (`system:node:NAME`, judged by the
//! Node authorizer and NodeRestriction), and kube-proxy; pods are wired by the `ptp` CNI
//! plugin from a per-node /24, with routes between the nodes.
//!
//! What the cluster runs is built by `cargo xtask cluster --build-only` (kubelet,
//! controller-manager, scheduler, kubectl, containerd, pause and agnhost images) and
//! `cargo xtask setup` (etcd, kube-apiserver, kube-proxy). Tear-down stops every process by
//! its pid and cgroup, drops the namespaces, cgroups and mounts, and removes the directory.
//! Settings this machine forced are in shared/docs/real-node.md.

pub mod cli;
mod components;
mod control;
mod node;

mod runc;

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{netns, LabError};

pub use components::Components;

/// Where a cluster keeps its files unless told otherwise: not under /run, /var/lib or
/// /var/log, which each node's mount namespace covers with its own.
pub const DEFAULT_DIR: &str = "/var/tmp/weir-cluster";
pub const DEFAULT_NAME: &str = "wcl";
/// The bridge's address in the control plane's namespace: the API server's.
pub const CONTROL_PLANE_IP: Ipv4Addr = Ipv4Addr::new(10, 250, 0, 1);
pub const API_PORT: u16 = 6443;
/// Pods of node I get 10.250.I.0/24; the cluster's pods are 10.250.0.0/16.
pub const CLUSTER_CIDR: &str = "10.250.0.0/16";
const STATE_FILE: &str = "cluster.json";

/// How pods are wired.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Cni {
    /// The `ptp` plugin: one veth per pod, a host route to it, static routes between
    /// nodes (what kindnet does).
    #[default]
    Ptp,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ControlPlaneState {
    pub netns: String,
    pub etcd: Option<u32>,
    pub apiserver: Option<u32>,
    pub controller_manager: Option<u32>,
    pub scheduler: Option<u32>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeState {
    pub name: String,
    pub netns: String,
    pub ip: Ipv4Addr,
    pub pod_cidr: String,
    /// The file the node's mount namespace is bound to.
    pub mount_ns: PathBuf,
    /// `cgroupRoot`: /NAME in every cgroup hierarchy.
    pub cgroup: String,
    pub containerd: Option<u32>,
    pub kubelet: Option<u32>,
    pub kube_proxy: Option<u32>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ClusterState {
    pub name: String,
    pub dir: PathBuf,
    pub cni: Cni,
    pub control_plane: ControlPlaneState,
    pub nodes: Vec<NodeState>,
    /// Host directories that did not exist and the cluster made (hostPaths the DaemonSet
    /// names); removed by down.
    pub created_host_dirs: Vec<PathBuf>,
    /// Whether `dir/mnt` is bind-mounted (private) to hold the nodes' mount namespaces.
    pub mnt_bound: bool,
}

impl ClusterState {
    pub fn load(dir: &Path) -> Result<ClusterState, LabError> {
        let path = dir.join(STATE_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(LabError::invalid(
                    "weir-lab cluster",
                    format!(
                        "no cluster in {} (run `weir-lab cluster up` first)",
                        dir.display()
                    ),
                ))
            }
            Err(e) => return Err(LabError::io(format!("reading {}", path.display()), e)),
        };
        serde_json::from_str(&text)
            .map_err(|e| LabError::invalid(path.display().to_string(), e.to_string()))
    }

    fn save(&self) -> Result<(), LabError> {
        let path = self.dir.join(STATE_FILE);
        let text = serde_json::to_string_pretty(self).expect("state serializes");
        std::fs::write(&path, text)
            .map_err(|e| LabError::io(format!("writing {}", path.display()), e))
    }

    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.dir.join("control-plane/kubeconfig-admin")
    }
}

/// What `up` is asked for.
#[derive(Clone, Debug)]
pub struct UpOptions {
    pub dir: PathBuf,
    pub name: String,
    pub nodes: usize,
    pub cni: Cni,
    /// Image archives (docker-archive or oci-archive) imported into every node besides
    /// pause and agnhost.
    pub images: Vec<PathBuf>,
    /// How long the nodes get to become Ready.
    pub timeout: Duration,
}

/// What `up` and `status` print.
#[derive(Debug, Serialize)]
pub struct Summary {
    pub name: String,
    pub dir: PathBuf,
    pub kubeconfig: PathBuf,
    pub api_server: String,
    pub control_plane: ControlPlaneState,
    pub nodes: Vec<NodeSummary>,
    /// Capabilities deploy/'s DaemonSet asks for that this host cannot give a container:
    /// the nodes' runc drops them from its spec (see `runc`).
    pub dropped_capabilities: Vec<String>,
    pub seconds: Option<f64>,
}

/// The capabilities deploy/daemonset.yaml adds, as `CAP_X`.
fn daemonset_capabilities() -> Vec<String> {
    let ds: serde_yaml::Value =
        serde_yaml::from_str(include_str!("../../../deploy/daemonset.yaml")).unwrap_or_default();
    ds["spec"]["template"]["spec"]["containers"]
        .as_sequence()
        .into_iter()
        .flatten()
        .flat_map(|c| {
            c["securityContext"]["capabilities"]["add"]
                .as_sequence()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|c| c.as_str().map(|c| format!("CAP_{c}")))
        .collect()
}

#[derive(Debug, Serialize)]
pub struct NodeSummary {
    pub name: String,
    pub ip: Ipv4Addr,
    pub pod_cidr: String,
    pub ready: bool,
    pub dataplane_label: Option<String>,
    pub containerd: Option<u32>,
    pub kubelet: Option<u32>,
    pub kube_proxy: Option<u32>,
    /// Which of the node's processes are not running.
    pub dead: Vec<String>,
}

fn check_name(name: &str) -> Result<(), LabError> {
    // Interface names (NAME-vI) must fit in 15 bytes.
    if name.is_empty()
        || name.len() > 8
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
    {
        return Err(LabError::invalid(
            "--name",
            format!("{name:?}: 1 to 8 lowercase letters or digits"),
        ));
    }
    Ok(())
}

/// Node `i`'s name (and its network namespace's).
pub fn node_name(cluster: &str, i: usize) -> String {
    format!("{cluster}-node-{i}")
}

/// Brings a cluster up; on failure tears down what was built and returns the error.
pub fn up(opts: &UpOptions) -> Result<Summary, LabError> {
    check_name(&opts.name)?;
    if !(1..=9).contains(&opts.nodes) {
        return Err(LabError::invalid("--nodes", "1 to 9 nodes"));
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(LabError::invalid(
            "weir-lab cluster up",
            "needs root (namespaces, mounts, cgroups)",
        ));
    }
    let components = Components::find()?;
    if opts.dir.join(STATE_FILE).exists() {
        return Err(LabError::invalid(
            "weir-lab cluster up",
            format!(
                "a cluster is already up in {} (run `weir-lab cluster down` first)",
                opts.dir.display()
            ),
        ));
    }
    let cp_netns = format!("{}-cp", opts.name);
    if netns::exists(&cp_netns) {
        return Err(LabError::invalid(
            "weir-lab cluster up",
            format!(
                "the network namespace {cp_netns} exists: another cluster of that --name is up"
            ),
        ));
    }
    // Absolute: the nodes' tools run from / in another mount namespace.
    let images = absolute(&opts.images)?;
    std::fs::create_dir_all(&opts.dir)
        .map_err(|e| LabError::io(format!("creating {}", opts.dir.display()), e))?;
    let mut state = ClusterState {
        name: opts.name.clone(),
        dir: opts.dir.clone(),
        cni: opts.cni,
        control_plane: ControlPlaneState {
            netns: cp_netns,
            ..Default::default()
        },
        nodes: Vec::new(),
        created_host_dirs: Vec::new(),
        mnt_bound: false,
    };
    state.save()?;
    let started = Instant::now();
    match build(&mut state, opts, &images, &components) {
        Ok(()) => {
            let mut summary = status(&state)?;
            summary.seconds = Some(started.elapsed().as_secs_f64());
            Ok(summary)
        }
        Err(e) => {
            let _ = state.save();
            if let Err(down_error) = down(&opts.dir) {
                eprintln!("weir-lab cluster up: tearing down after the failure: {down_error}");
            }
            Err(e)
        }
    }
}

fn build(
    state: &mut ClusterState,
    opts: &UpOptions,
    images: &[PathBuf],
    c: &Components,
) -> Result<(), LabError> {
    // The DaemonSet mounts /lib/modules (DirectoryOrCreate): made here and removed by down
    // when the host has none, rather than left behind by a kubelet.
    for dir in [Path::new("/lib/modules")] {
        if !dir.exists() {
            std::fs::create_dir_all(dir)
                .map_err(|e| LabError::io(format!("creating {}", dir.display()), e))?;
            state.created_host_dirs.push(dir.to_path_buf());
            state.save()?;
        }
    }
    runc::write_wrapper(&state.dir, &state.dir)?;
    control::network(state)?;
    state.save()?;
    let cp = control::start(state, c, opts.nodes)?;
    state.save()?;
    node::prepare_mounts(state)?;
    state.save()?;
    for i in 1..=opts.nodes {
        let n = node::create(state, i, opts.nodes)?;
        state.nodes.push(n);
        state.save()?;
        let last = state.nodes.len() - 1;
        node::start(state, last, c, &cp, images)?;
        state.save()?;
    }
    control::wait_nodes_ready(state, opts.timeout)
}

/// The cluster's state, with each node's readiness as the API server reports it.
pub fn status(state: &ClusterState) -> Result<Summary, LabError> {
    let c = Components::find()?;
    let nodes_json = control::kubectl_json(state, &c, &["get", "nodes", "-o", "json"]).ok();
    let ready = |name: &str| -> (bool, Option<String>) {
        let Some(items) = nodes_json.as_ref().and_then(|j| j["items"].as_array()) else {
            return (false, None);
        };
        let Some(node) = items.iter().find(|n| n["metadata"]["name"] == name) else {
            return (false, None);
        };
        let ready = node["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True");
        let label = node["metadata"]["labels"]["weir.io/dataplane"]
            .as_str()
            .map(str::to_string);
        (ready, label)
    };
    let nodes = state
        .nodes
        .iter()
        .map(|n| {
            let (ready, dataplane_label) = ready(&n.name);
            let dead = [
                ("containerd", n.containerd),
                ("kubelet", n.kubelet),
                ("kube-proxy", n.kube_proxy),
            ]
            .iter()
            .filter(|(_, pid)| !pid.is_some_and(netns::alive))
            .map(|(what, _)| what.to_string())
            .collect();
            NodeSummary {
                name: n.name.clone(),
                ip: n.ip,
                pod_cidr: n.pod_cidr.clone(),
                ready,
                dataplane_label,
                containerd: n.containerd,
                kubelet: n.kubelet,
                kube_proxy: n.kube_proxy,
                dead,
            }
        })
        .collect();
    Ok(Summary {
        name: state.name.clone(),
        dir: state.dir.clone(),
        kubeconfig: state.admin_kubeconfig(),
        api_server: format!("https://{CONTROL_PLANE_IP}:{API_PORT}"),
        control_plane: state.control_plane.clone(),
        nodes,
        dropped_capabilities: {
            let asked = daemonset_capabilities();
            runc::missing(&asked.iter().map(String::as_str).collect::<Vec<_>>())
        },
        seconds: None,
    })
}

/// What `down` found and removed, and what it could not.
#[derive(Debug, Default, Serialize)]
pub struct DownReport {
    pub stopped_processes: usize,
    pub removed_netns: Vec<String>,
    pub removed_cgroups: usize,
    pub removed_dirs: Vec<PathBuf>,
    /// Anything still on the host after down (empty when all is gone).
    pub left: Vec<String>,
}

/// Tears the cluster in `dir` down: nodes first (kubelet, kube-proxy, pods, containerd),
/// then the control plane; namespaces, cgroups, mounts and the directory. Safe to run twice.
pub fn down(dir: &Path) -> Result<DownReport, LabError> {
    let mut report = DownReport::default();
    let state = match ClusterState::load(dir) {
        Ok(s) => s,
        Err(_) if !dir.exists() => return Ok(report),
        Err(e) => return Err(e),
    };
    for n in state.nodes.iter().rev() {
        node::stop(n, &mut report);
    }
    control::stop(&state, &mut report);
    node::release_mounts(&state, &mut report);
    for d in state.created_host_dirs.iter().rev() {
        if std::fs::remove_dir(d).is_ok() {
            report.removed_dirs.push(d.clone());
        }
    }
    match std::fs::remove_dir_all(dir) {
        Ok(()) => report.removed_dirs.push(dir.to_path_buf()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => report.left.push(format!("{}: {e}", dir.display())),
    }
    report.left.extend(leftovers(&state));
    Ok(report)
}

/// What of the cluster is still on the host: its namespaces, cgroups, directory, mounts
/// and processes. Empty after a clean down.
pub fn leftovers(state: &ClusterState) -> Vec<String> {
    let mut left = Vec::new();
    let mut names = vec![state.control_plane.netns.clone()];
    names.extend(state.nodes.iter().map(|n| n.netns.clone()));
    for n in &names {
        if netns::exists(n) {
            left.push(format!("network namespace {n}"));
        }
    }
    for n in &state.nodes {
        for c in node::cgroup_dirs(&n.cgroup) {
            if c.exists() {
                left.push(format!("cgroup {}", c.display()));
            }
        }
    }
    if state.dir.exists() {
        left.push(format!("directory {}", state.dir.display()));
    }
    for d in &state.created_host_dirs {
        if d.exists() {
            left.push(format!("directory {}", d.display()));
        }
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let dir = state.dir.display().to_string();
    for line in mounts.lines() {
        if let Some(point) = line.split(' ').nth(4) {
            if point.starts_with(&dir) {
                left.push(format!("mount {point}"));
            }
        }
    }
    left
}

/// Runs the cluster's kubectl as the admin, in the control plane's namespace; returns
/// its stdout, or an error quoting its stderr.
pub fn kubectl(dir: &Path, args: &[String], timeout: Duration) -> Result<String, LabError> {
    let state = ClusterState::load(dir)?;
    let c = Components::find()?;
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    control::kubectl(&state, &c, &args, timeout)
}

/// Imports image archives into every node's containerd.
pub fn import(dir: &Path, images: &[PathBuf]) -> Result<(), LabError> {
    let state = ClusterState::load(dir)?;
    let c = Components::find()?;
    let images = absolute(images)?;
    for n in &state.nodes {
        for image in &images {
            node::import(n, &c, image)?;
        }
    }
    Ok(())
}

/// Image archives as absolute paths, each checked to exist.
fn absolute(images: &[PathBuf]) -> Result<Vec<PathBuf>, LabError> {
    images
        .iter()
        .map(|p| {
            std::fs::canonicalize(p)
                .map_err(|e| LabError::io(format!("image archive {}", p.display()), e))
        })
        .collect()
}
