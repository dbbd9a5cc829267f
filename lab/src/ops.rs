//! The lab's life cycle: up, apply, delete, down. Every change is planned and validated
//! before anything is touched, the world (namespaces, listeners) grows before the agent
//! is told and shrinks after it converged, and objects.yaml is the one source of truth.

use std::collections::{BTreeMap, BTreeSet};
use std::io::BufRead;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use ipnet::{Ipv4Net, Ipv6Net};
use k8s_openapi::api::core::v1::{Pod, PodIP, PodStatus};

use super::agent::WeirBinary;
use super::control_plane::{ControlPlane, Identity, AGENT_GROUPS, AGENT_USER, API_READY_WITHIN};
use super::objects::{self, ObjectSet};
use super::peers::{self, Enforcer};
use super::proxy::{self, ProxyMode, ProxyState};
use super::services::{self, ServicesMode};
use super::state::{
    write_atomic, ApiState, LabDir, LabState, PodState, RelayState, ServedPort, Topology,
};
use super::{addr, agent, api, container, netns, world, LabError};
use weir::dataplane::DataplaneKind;
use weir::reset::ResetOptions;
use weir_policy::model::Object;

pub struct UpOptions {
    pub dataplane: DataplaneKind,
    pub topology: Topology,
    pub ipv4_pool: Ipv4Net,
    pub ipv6_pool: Ipv6Net,
    /// Build the world without starting the agent: nothing is enforced.
    pub without_agent: bool,
    /// How long to wait for the agent to enforce a change.
    pub timeout: Duration,
    /// Server mode: objects go through the lab's own kube-apiserver.
    pub api_server: bool,
    /// Whether the lab adds a Service per pod.
    pub services: ServicesMode,
    /// The lab's kube-proxy (server mode only).
    pub proxy: ProxyMode,
    /// `--agent-image`: the agent runs from this image under runc.
    pub agent_image: Option<String>,
    /// `--agent-arg`: flags for the agent, after the lab's.
    pub agent_args: Vec<String>,
    /// `--enforcer`: weir's agent, or a peer in its place (server mode only).
    pub enforcer: Enforcer,
    /// `--enforcer NAME@VERSION`: a pinned version other than the peer's default.
    pub enforcer_version: Option<String>,
    /// `--weir-bin`: the agent's binary, unless it runs from `agent_image`.
    pub weir: WeirBinary,
    /// `--cluster-policy-crd`: the ClusterNetworkPolicy CRD (YAML) instead of deploy/crds/'s.
    pub cluster_policy_crd: Option<String>,
    /// `--relay`: `weir relay` and its etcd, which the agent reads from.
    pub relay: bool,
}

/// The Node a server-mode lab's agent runs as when the manifests name none.
pub const DEFAULT_NODE_NAME: &str = "lab-node";

/// Builds the node, the pods and their listeners, starts the agent and waits until it
/// enforces the manifests. On failure everything built so far is removed again.
pub fn up(dir: &LabDir, opts: &UpOptions, manifests: &[PathBuf]) -> Result<(), LabError> {
    let lock = dir.lock()?;
    if dir.exists() {
        return Err(LabError::AlreadyUp(dir.dir.clone()));
    }
    let incoming = objects::load_files(manifests)?;
    if opts.proxy != ProxyMode::None {
        if !opts.api_server {
            return Err(LabError::invalid(
                "weir-lab up",
                "--proxy runs kube-proxy against the lab's API server: it needs --api server",
            ));
        }
        proxy::check_host(opts.proxy)?;
    }
    if opts.enforcer != Enforcer::Weir {
        if !opts.api_server {
            return Err(LabError::invalid(
                "weir-lab up",
                "--enforcer runs a peer against the lab's API server, as its DaemonSet would: it needs --api server",
            ));
        }
        if opts.agent_image.is_some() || !opts.agent_args.is_empty() {
            return Err(LabError::invalid(
                "weir-lab up",
                "--agent-image and --agent-arg are weir's agent's: a peer (--enforcer) runs in its place",
            ));
        }
    }
    let peer_version = peers::check_host(opts.enforcer, opts.enforcer_version.as_deref())?;
    let id = dir.lab_id();
    let mut state = LabState {
        node_netns: format!("{id}-node"),
        bpf_root: bpf_root(&id),
        id,
        dataplane: opts.dataplane,
        topology: opts.topology,
        with_agent: !opts.without_agent && opts.enforcer == Enforcer::Weir,
        ipv4_pool: opts.ipv4_pool,
        ipv6_pool: opts.ipv6_pool,
        generation: 0,
        pods: BTreeMap::new(),
        api: None,
        agent_pid: None,
        services: opts.services,
        proxy: None,
        agent_container: None,
        agent_args: opts.agent_args.clone(),
        peer: None,
    };
    // The image is unpacked and the DaemonSet read before anything is built: a lab that
    // cannot run them is refused at once. (Without an agent too: `weir-lab agent start`
    // starts it later.)
    if let Some(image) = &opts.agent_image {
        std::fs::create_dir_all(&dir.dir)
            .map_err(|e| LabError::io(format!("creating {}", dir.dir.display()), e))?;
        state.agent_container = Some(container::prepare(
            &dir.dir,
            image,
            &container::default_daemonset(),
            &state.id,
        )?);
    }
    // A missing agent binary, too, is refused before anything is built.
    if state.with_agent && state.agent_container.is_none() {
        opts.weir.path()?;
    }
    let built = world::create_node(&state.node_netns, &state.pod_network())
        .and_then(|()| dir.save(&state))
        .and_then(|()| match opts.api_server {
            true => start_control_plane(dir, &mut state, &incoming, opts),
            false => Ok(()),
        })
        .and_then(|()| {
            change(
                dir,
                &mut state,
                Some(opts.timeout),
                Some(&opts.weir),
                |set| incoming.into_iter().for_each(|o| set.apply(o)),
            )
        })
        // After the first change: kube-proxy and the peers wait for their Node to exist.
        .and_then(|()| match opts.enforcer {
            Enforcer::Weir => Ok(()),
            _ if opts.without_agent => Ok(()),
            enforcer => start_peer(dir, &mut state, enforcer, &peer_version, opts.timeout),
        })
        .and_then(|()| match opts.proxy {
            ProxyMode::None => Ok(()),
            mode => start_proxy(dir, &mut state, mode, opts.timeout),
        });
    if let Err(e) = built {
        drop(lock);
        if let Err(cleanup) = down(dir) {
            eprintln!("warning: cleaning up the half-built lab failed: {cleanup}");
        }
        return Err(e);
    }
    Ok(())
}

/// Starts etcd and kube-apiserver in the node namespace and applies deploy/'s RBAC. The
/// agent's Node is the manifests' first Node, or [`DEFAULT_NODE_NAME`].
fn start_control_plane(
    dir: &LabDir,
    state: &mut LabState,
    incoming: &[Object],
    opts: &UpOptions,
) -> Result<(), LabError> {
    let node_name = incoming
        .iter()
        .find_map(|o| match o {
            Object::Node(n) => n.metadata.name.clone(),
            _ => None,
        })
        .unwrap_or_else(|| DEFAULT_NODE_NAME.to_string());
    let cp = ControlPlane {
        cluster_policy_crd: opts.cluster_policy_crd.clone(),
        ..ControlPlane::new(dir.api_dir())
    };
    let (etcd_pid, apiserver_pid) = cp.start(&state.node_netns, opts.timeout)?;
    state.api = Some(ApiState {
        node_name,
        etcd_pid,
        apiserver_pid,
        relay: None,
    });
    dir.save(state)?;
    install_rbac(&cp, &state.node_netns)?;
    if opts.relay {
        let store_pid = cp.start_relay_store(&state.node_netns)?;
        let relay_pid = cp.start_relay(&state.node_netns, &opts.weir.path()?)?;
        if let Some(api) = state.api.as_mut() {
            api.relay = Some(RelayState {
                store_pid,
                relay_pid,
            });
        }
        // Before the lab's own flags: --agent-arg can still name another.
        let args = cp.relay_client_args("--relay");
        state.agent_args.splice(0..0, args);
        dir.save(state)?;
    }
    Ok(())
}

/// Starts kube-proxy in the node namespace and waits until it is healthy and has
/// programmed the lab's Services.
fn start_proxy(
    dir: &LabDir,
    state: &mut LabState,
    mode: ProxyMode,
    timeout: Duration,
) -> Result<(), LabError> {
    let pid = proxy::start(dir, state, mode)?;
    state.proxy = Some(ProxyState { mode, pid });
    dir.save(state)?;
    proxy::wait_healthy(dir, state, timeout)?;
    let set = ObjectSet::load(&dir.objects_file())?;
    proxy::wait_programmed(dir, state, mode, &ObjectSet::default(), &set, timeout)
}

/// Starts the peer in the node namespace and waits until it has programmed the lab's
/// objects (see [`peers::wait_programmed`]).
fn start_peer(
    dir: &LabDir,
    state: &mut LabState,
    enforcer: Enforcer,
    version: &str,
    timeout: Duration,
) -> Result<(), LabError> {
    state.peer = Some(peers::start(dir, state, enforcer, version)?);
    dir.save(state)?;
    peers::wait_programmed(dir, state, 0, timeout)
}

/// Applies deploy/'s RBAC and waits until the server's authorizer lets the agent's
/// identity list pods (it learns of the new binding from its own watch), so that the
/// agent's first requests are not refused.
fn install_rbac(cp: &ControlPlane, node: &str) -> Result<(), LabError> {
    cp.block_on(node, Identity::Admin, |client| async move {
        api::install_rbac(&client).await
    })
    .and_then(|r| r)
    .map_err(|e| LabError::invalid("deploy/ RBAC on the lab's API server", e))?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let allowed = cp.block_on(node, Identity::Admin, |client| async move {
            api::can_list_pods(&client, AGENT_USER, AGENT_GROUPS).await
        });
        match allowed {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) | Err(e) if std::time::Instant::now() > deadline => {
                return Err(LabError::invalid(
                    "deploy/ RBAC on the lab's API server",
                    format!("the agent's ServiceAccount still cannot list pods: {e}"),
                ))
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// `weir-lab kube start`.
pub fn kube_start(netns: &str, dir: &Path) -> Result<(), LabError> {
    let cp = ControlPlane::new(dir);
    let (etcd, apiserver) = cp.start(netns, API_READY_WITHIN)?;
    install_rbac(&cp, netns)?;
    let pids = serde_json::json!({ "etcd_pid": etcd, "apiserver_pid": apiserver });
    weir::stdout::println(&pids.to_string()).map_err(|e| LabError::io("writing to stdout", e))?;
    Ok(())
}

/// `weir-lab kube start-apiserver`: the server alone, on the files and etcd of a
/// control plane `kube start` made.
pub fn kube_start_apiserver(netns: &str, dir: &Path) -> Result<(), LabError> {
    let cp = ControlPlane::new(dir);
    let apiserver = cp.start_apiserver(netns)?;
    cp.wait_ready(netns, API_READY_WITHIN)?;
    let pid = serde_json::json!({ "apiserver_pid": apiserver });
    weir::stdout::println(&pid.to_string()).map_err(|e| LabError::io("writing to stdout", e))?;
    Ok(())
}

/// `weir-lab kube start-relay`.
pub fn kube_start_relay(netns: &str, dir: &Path, weir: &WeirBinary) -> Result<(), LabError> {
    let cp = ControlPlane::new(dir);
    let store_pid = cp.start_relay_store(netns)?;
    let relay_pid = cp.start_relay(netns, &weir.path()?)?;
    cp.wait_relay_listed(netns, API_READY_WITHIN)?;
    let pids = serde_json::json!({ "store_pid": store_pid, "relay_pid": relay_pid });
    weir::stdout::println(&pids.to_string()).map_err(|e| LabError::io("writing to stdout", e))?;
    Ok(())
}

/// `weir-lab kube metrics`: the server's /metrics text.
pub fn kube_metrics(netns: &str, dir: &Path) -> Result<(), LabError> {
    let text = ControlPlane::new(dir)
        .block_on(netns, Identity::Admin, |client| async move {
            let req = http::Request::get("/metrics")
                .body(Vec::new())
                .map_err(|e| e.to_string())?;
            client.request_text(req).await.map_err(|e| e.to_string())
        })
        .and_then(|r| r)
        .map_err(|e| LabError::invalid("the API server's /metrics", e))?;
    weir::stdout::print(&text).map_err(|e| LabError::io("writing to stdout", e))?;
    Ok(())
}

/// `weir-lab kube touch`: server-side applies ConfigMap default/weir-lab-touch with the
/// time in its data, as the admin; prints its resourceVersion. With `etcd`, writes a key
/// to etcd itself instead ([`ControlPlane::advance_etcd`]) and prints etcd's revision.
pub fn kube_touch(netns: &str, dir: &Path, etcd: bool) -> Result<(), LabError> {
    if etcd {
        let revision = ControlPlane::new(dir).advance_etcd(netns)?;
        return weir::stdout::print(&format!("{revision}\n"))
            .map_err(|e| LabError::io("writing to stdout", e));
    }
    let version = ControlPlane::new(dir)
        .block_on(netns, Identity::Admin, |client| async move {
            let api: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
                kube::Api::namespaced(client, "default");
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos();
            let object = serde_json::json!({
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "weir-lab-touch"},
                "data": {"unix_nanos": now.to_string()},
            });
            api.patch(
                "weir-lab-touch",
                &kube::api::PatchParams::apply("weir-lab").force(),
                &kube::api::Patch::Apply(&object),
            )
            .await
            .map(|cm| cm.metadata.resource_version.unwrap_or_default())
            .map_err(|e| e.to_string())
        })
        .and_then(|r| r)
        .map_err(|e| LabError::invalid("ConfigMap default/weir-lab-touch", e))?;
    weir::stdout::print(&format!("{version}\n"))
        .map_err(|e| LabError::io("writing to stdout", e))?;
    Ok(())
}

/// `weir-lab kube apply`: writes the difference, then computes the digest from the
/// resourceVersions of what it wrote and a record of the rest (DIR/applied-versions.json),
/// so that a change to one object of a large world does not list the whole world.
pub fn kube_apply(
    netns: &str,
    dir: &Path,
    previous: Option<&Path>,
    file: &Path,
) -> Result<(), LabError> {
    let before = match previous {
        Some(p) => ObjectSet::load(p)?,
        None => ObjectSet::default(),
    };
    let after = ObjectSet::load(file)?;
    let known = AppliedVersions::read(dir);
    let versions = ControlPlane::new(dir)
        .block_on(netns, Identity::Admin, |client| async move {
            open_connection(&client).await?;
            let synced = api::sync(&client, &before, &after, None).await?;
            // From just before the first write request: a change may take effect with its
            // first write (a Pod's labels) before the last one (its status) is acknowledged.
            let started = synced
                .first_write_ns
                .unwrap_or_else(weir::kernel::monotonic_ns);
            weir::stdout::println(&format!("written {started}")).map_err(|e| e.to_string())?;
            let mut versions = AppliedVersions::recorded_or_listed(known, &client).await?;
            versions.record(synced.written);
            // The agent annotates its Node itself: take the Nodes as the server has them.
            versions.refresh_nodes(&client).await?;
            Ok::<_, String>(versions)
        })
        .and_then(|r| r)
        .map_err(|e| LabError::invalid("weir-lab kube apply", e))?;
    weir::stdout::println(&format!("digest {}", versions.digest))
        .map_err(|e| LabError::io("writing to stdout", e))?;
    versions.write(dir)
}

/// `weir-lab kube churn`: writes the change from each FILE to the next (the last back to
/// the first), `changes` of them in turn, the k-th due `k × interval` after the first
/// whether or not anyone has seen the one before (an open loop: the rate is the writer's,
/// as in a busy cluster); a change whose time came while the one before was still being
/// written goes right after it. FILES[0] must be what the server holds (as the last
/// `kube apply` left it). Prints `written NS digest HEX` for each change once the server
/// acknowledged it (NS: CLOCK_MONOTONIC nanoseconds just before its first write request;
/// HEX: the state digest an agent reports once it has applied it and those before).
pub fn kube_churn(
    netns: &str,
    dir: &Path,
    interval: Duration,
    changes: usize,
    files: &[PathBuf],
) -> Result<(), LabError> {
    if files.len() < 2 {
        return Err(LabError::invalid(
            "weir-lab kube churn",
            "needs at least two files to change between",
        ));
    }
    let sets = files
        .iter()
        .map(|f| ObjectSet::load(f))
        .collect::<Result<Vec<_>, _>>()?;
    // Only the objects that differ between neighbours: each write is computed once.
    let steps: Vec<(ObjectSet, ObjectSet)> = (0..sets.len())
        .map(|i| ObjectSet::difference(&sets[i], &sets[(i + 1) % sets.len()]))
        .collect();
    let known = AppliedVersions::read(dir);
    let versions = ControlPlane::new(dir)
        .block_on(netns, Identity::Admin, |client| async move {
            open_connection(&client).await?;
            let mut versions = AppliedVersions::recorded_or_listed(known, &client).await?;
            versions.refresh_nodes(&client).await?;
            let start = tokio::time::Instant::now();
            for k in 0..changes {
                tokio::time::sleep_until(start + interval * k as u32).await;
                let (before, after) = &steps[k % steps.len()];
                let synced = api::sync(&client, before, after, None).await.map_err(|e| {
                    format!(
                        "change {k} (from {} to the next): {e}",
                        files[k % files.len()].display()
                    )
                })?;
                let written = synced
                    .first_write_ns
                    .unwrap_or_else(weir::kernel::monotonic_ns);
                versions.record(synced.written);
                weir::stdout::println(&format!("written {written} digest {}", versions.digest))
                    .map_err(|e| e.to_string())?;
            }
            Ok::<_, String>(versions)
        })
        .and_then(|r| r)
        .map_err(|e| LabError::invalid("weir-lab kube churn", e))?;
    versions.write(dir)
}

/// Opens the connection before anything is timed, as a controller's would already be
/// open: what is timed is the cluster's work, not this process's TLS handshake.
async fn open_connection(client: &kube::Client) -> Result<(), String> {
    client
        .apiserver_version()
        .await
        .map(drop)
        .map_err(|e| format!("asking the API server its version: {e}"))
}

/// The resourceVersion of every object the agent watches, as this lab last wrote them
/// (DIR/applied-versions.json), and their state digest, kept as they change.
struct AppliedVersions {
    versions: BTreeMap<weir_policy::model::ObjectRef, String>,
    digest: weir::source::digest::StateDigest,
}

impl AppliedVersions {
    const FILE: &str = "applied-versions.json";

    /// What DIR/applied-versions.json holds, if it could be read.
    fn read(dir: &Path) -> Option<BTreeMap<weir_policy::model::ObjectRef, String>> {
        let list: Vec<(weir_policy::model::ObjectRef, String)> =
            serde_json::from_slice(&std::fs::read(dir.join(Self::FILE)).ok()?).ok()?;
        Some(list.into_iter().collect())
    }

    /// The record `read` found, or (none yet) the server's own list.
    async fn recorded_or_listed(
        recorded: Option<BTreeMap<weir_policy::model::ObjectRef, String>>,
        client: &kube::Client,
    ) -> Result<Self, String> {
        let versions = match recorded {
            Some(versions) => versions,
            None => api::list_versions(client)
                .await
                .map_err(|e| e.to_string())?,
        };
        Ok(Self::new(versions))
    }

    fn new(versions: BTreeMap<weir_policy::model::ObjectRef, String>) -> Self {
        let mut digest = weir::source::digest::StateDigest::default();
        for (key, rv) in &versions {
            digest.toggle(weir::source::digest::StateDigest::entry(key, rv));
        }
        Self { versions, digest }
    }

    /// Takes in what a sync wrote (None: deleted), the digest with it.
    fn record(&mut self, written: Vec<(weir_policy::model::ObjectRef, Option<String>)>) {
        use weir::source::digest::StateDigest;
        for (key, rv) in written {
            if let Some(old) = self.versions.remove(&key) {
                self.digest.toggle(StateDigest::entry(&key, &old));
            }
            if let Some(rv) = rv {
                self.digest.toggle(StateDigest::entry(&key, &rv));
                self.versions.insert(key, rv);
            }
        }
    }

    /// Every Node as the server has it (agents annotate their own).
    async fn refresh_nodes(&mut self, client: &kube::Client) -> Result<(), String> {
        let fresh = api::list_versions_of_nodes(client)
            .await
            .map_err(|e| e.to_string())?;
        let gone = self
            .versions
            .keys()
            .filter(|k| k.kind == weir_policy::model::Kind::Node)
            .map(|k| (k.clone(), None));
        let written: Vec<_> = gone
            .chain(fresh.into_iter().map(|(k, rv)| (k, Some(rv))))
            .collect();
        self.record(written);
        Ok(())
    }

    fn write(self, dir: &Path) -> Result<(), LabError> {
        let list: Vec<_> = self.versions.into_iter().collect();
        write_atomic(
            &dir.join(Self::FILE),
            serde_json::to_string(&list)
                .expect("versions serialize")
                .as_bytes(),
        )
    }
}

/// Creates or updates objects, as `kubectl apply`.
pub fn apply(
    dir: &LabDir,
    manifests: &[PathBuf],
    timeout: Option<Duration>,
) -> Result<(), LabError> {
    let _lock = dir.lock()?;
    let mut state = dir.load()?;
    let incoming = objects::load_files(manifests)?;
    change(dir, &mut state, timeout, None, |set| {
        incoming.into_iter().for_each(|o| set.apply(o))
    })
}

/// Deletes the objects the manifests name, as `kubectl delete -f`.
pub fn delete(
    dir: &LabDir,
    manifests: &[PathBuf],
    timeout: Option<Duration>,
) -> Result<(), LabError> {
    let _lock = dir.lock()?;
    let mut state = dir.load()?;
    let named = objects::load_files(manifests)?;
    change(dir, &mut state, timeout, None, |set| {
        named.iter().for_each(|o| set.delete(&o.key()))
    })
}

/// Removes everything the lab made: processes, namespaces, pins, state files. Safe to
/// run twice, and it finds the lab's namespaces by name even without a state file.
pub fn down(dir: &LabDir) -> Result<(), LabError> {
    let _lock = dir.lock()?;
    let id = dir.lab_id();
    let namespaces = netns::list_with_prefix(&id)?;
    let node = format!("{id}-node");
    let agent_container = dir.load().ok().and_then(|s| s.agent_container);
    if let Some(agent_ns) = namespaces.iter().find(|ns| **ns == node) {
        netns::stop_processes(agent_ns)?;
    }
    if let Some(c) = &agent_container {
        container::remove(c);
        for d in [&c.bundle, &c.runc_root] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
    reset_node(&node, &bpf_root(&id))?;
    for ns in &namespaces {
        netns::stop_processes(ns)?;
    }
    for ns in &namespaces {
        netns::delete(ns)?;
    }
    for file in [
        dir.state_file(),
        dir.objects_file(),
        dir.status_file(),
        dir.dir.join("probe-runs"),
    ] {
        match std::fs::remove_file(&file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(LabError::io(format!("removing {}", file.display()), e)),
        }
    }
    match std::fs::remove_dir_all(dir.api_dir()) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(LabError::io(
            format!("removing {}", dir.api_dir().display()),
            e,
        )),
        _ => Ok(()),
    }
}

/// How long kube-apiserver may drain its requests on SIGTERM before it is killed.
const APISERVER_GRACE: Duration = Duration::from_secs(5);

// `weir-lab api ACTION`: the command line's, defined here, where it is carried out.
#[derive(clap::Subcommand)]
pub enum ApiAction {
    /// Stop kube-apiserver (SIGTERM, then SIGKILL); etcd keeps its data.
    Stop,
    /// Start kube-apiserver again and wait until it is ready.
    Start,
    /// Advance etcd's revision and compact its history up to it, so that a watch resuming
    /// from an older resourceVersion gets 410 Gone and must relist. Prints the revision.
    Compact,
}

/// `weir-lab api stop|start|compact`.
pub fn api(dir: &LabDir, action: &ApiAction) -> Result<(), LabError> {
    let _lock = dir.lock()?;
    let mut state = dir.load()?;
    let Some(api_state) = state.api.as_mut() else {
        return Err(LabError::invalid(
            "weir-lab api",
            "this lab reads a file (up without --api server): it has no API server",
        ));
    };
    let cp = ControlPlane::new(dir.api_dir());
    match action {
        ApiAction::Stop => netns::stop_pid(api_state.apiserver_pid, APISERVER_GRACE),
        ApiAction::Start => {
            netns::stop_pid(api_state.apiserver_pid, APISERVER_GRACE);
            api_state.apiserver_pid = cp.start_apiserver(&state.node_netns)?;
            dir.save(&state)?;
            cp.wait_ready(&state.node_netns, API_READY_WITHIN)?;
        }
        ApiAction::Compact => {
            let revision = cp.compact_etcd(&state.node_netns)?;
            weir::stdout::println(&revision.to_string())
                .map_err(|e| LabError::io("writing to stdout", e))?
        }
    }
    Ok(())
}

// `weir-lab relay ACTION`.
#[derive(clap::Subcommand)]
pub enum RelayAction {
    /// Stop `weir relay` (SIGTERM); its etcd, and the agent's watches on it, stay.
    Stop,
    /// Start `weir relay` again (stopping the old one first).
    Start,
    /// Compact the relay's etcd's history up to its current revision, so that an agent's
    /// watch resuming from an older revision must list again. Prints the revision.
    Compact,
    /// Stop the relay's etcd (SIGTERM); its data stays. Every watch on it is cut.
    StopStore,
    /// Start the relay's etcd again on its data (stopping the old one first).
    StartStore,
}

/// `weir-lab relay stop|start|compact`.
pub fn relay(dir: &LabDir, action: &RelayAction, weir: &WeirBinary) -> Result<(), LabError> {
    let _lock = dir.lock()?;
    let mut state = dir.load()?;
    let node = state.node_netns.clone();
    let Some(relay) = state.api.as_mut().and_then(|a| a.relay.as_mut()) else {
        return Err(LabError::invalid(
            "weir-lab relay",
            "this lab has no relay (up without --relay)",
        ));
    };
    let cp = ControlPlane::new(dir.api_dir());
    match action {
        RelayAction::Stop => netns::stop_pid(relay.relay_pid, APISERVER_GRACE),
        RelayAction::Start => {
            netns::stop_pid(relay.relay_pid, APISERVER_GRACE);
            relay.relay_pid = cp.start_relay(&node, &weir.path()?)?;
            dir.save(&state)?;
        }
        RelayAction::StopStore => netns::stop_pid(relay.store_pid, APISERVER_GRACE),
        RelayAction::StartStore => {
            netns::stop_pid(relay.store_pid, APISERVER_GRACE);
            relay.store_pid = cp.start_relay_store(&node)?;
            dir.save(&state)?;
        }
        RelayAction::Compact => {
            let revision = cp.compact_relay_store(&node)?;
            weir::stdout::println(&revision.to_string())
                .map_err(|e| LabError::io("writing to stdout", e))?
        }
    }
    Ok(())
}

/// `weir-lab agent signal SIGNAL`.
pub fn signal_agent(dir: &LabDir, signal: i32) -> Result<(), LabError> {
    let state = dir.load()?;
    let pid = state
        .agent_pid
        .ok_or_else(|| LabError::Agent("this lab has no agent".into()))?;
    // In its container the agent is not runc (whose pid the lab holds): runc signals it.
    if let Some(c) = &state.agent_container {
        return container::signal(c, signal);
    }
    // SAFETY: kill only sends a signal to the given process id.
    if unsafe { libc::kill(pid as i32, signal) } != 0 {
        return Err(LabError::io(
            format!("signalling the agent (pid {pid})"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// `weir-lab agent start`: a new agent process, after the old one was stopped.
pub fn restart_agent(dir: &LabDir, weir: &WeirBinary) -> Result<(), LabError> {
    let _lock = dir.lock()?;
    let mut state = dir.load()?;
    if let Some(pid) = state.agent_pid {
        netns::stop_pid(pid, Duration::from_secs(10));
    }
    state.agent_pid = Some(agent::start(dir, &state, weir)?);
    dir.save(&state)
}

/// Removes what the agent left on the node (chains, sets, TC filters, pins) with the
/// shared reset routine, run inside the node namespace. Without one, only pins can remain.
fn reset_node(node: &str, pins: &Path) -> Result<(), LabError> {
    if !netns::exists(node) {
        if pins.exists() {
            std::fs::remove_dir_all(pins)
                .map_err(|e| LabError::io(format!("removing {}", pins.display()), e))?;
        }
        return Ok(());
    }
    let options = ResetOptions {
        bpf_root: pins.to_path_buf(),
        ..ResetOptions::default()
    };
    let report = netns::in_netns(node, || weir::reset::reset(&options))?;
    if !report.errors.is_empty() {
        return Err(LabError::invalid(
            format!("reset of {node}"),
            report.errors.join("; "),
        ));
    }
    Ok(())
}

/// The pin root of a lab: its own directory under bpffs, never weir's default.
fn bpf_root(id: &str) -> PathBuf {
    PathBuf::from("/sys/fs/bpf").join(id)
}

/// Applies `edit` to the lab's objects: validate and plan, grow the world, write
/// objects.yaml, (start the agent from `start_agent`,) wait for enforcement, shrink the
/// world.
fn change(
    dir: &LabDir,
    state: &mut LabState,
    timeout: Option<Duration>,
    start_agent: Option<&WeirBinary>,
    edit: impl FnOnce(&mut ObjectSet),
) -> Result<(), LabError> {
    let before = ObjectSet::load(&dir.objects_file())?;
    let mut set = before.clone();
    edit(&mut set);
    if let Some(api) = &state.api {
        set.ensure_node(&api.node_name);
    }
    services::plan(state.services, &before, &mut set)?;
    let pods = plan_pods(state, &mut set)?;
    set.validate()?;
    let mut created = Vec::new();
    let grown = pods
        .iter()
        .try_for_each(|(key, pod)| match state.pods.get(key) {
            None => {
                created.push(pod);
                world::create_pod(&state.node_netns, &state.pod_network(), pod)?;
                start_listener(dir, pod)
            }
            Some(old) if old.ports != pod.ports => {
                netns::stop_processes(&pod.netns)?;
                start_listener(dir, pod)
            }
            Some(_) => Ok(()),
        });
    if let Err(e) = grown {
        // Leave no half-built pod behind: the next apply would trip over it.
        for pod in created {
            let _ = netns::stop_processes(&pod.netns);
            let _ = world::delete_pod(&state.node_netns, pod);
        }
        return Err(e);
    }
    let removed: Vec<PodState> = state
        .pods
        .iter()
        .filter(|(key, _)| !pods.contains_key(*key))
        .map(|(_, pod)| pod.clone())
        .collect();
    state.generation += 1;
    state.pods = pods;
    let peer_mark = peers::log_mark(dir);
    set.save(&dir.objects_file(), state.generation)?;
    dir.save(state)?;
    if let Some(api_state) = &state.api {
        let node = api_state.node_name.clone();
        let slices_before = services::endpoint_slices(&before, &node);
        let slices_after = services::endpoint_slices(&set, &node);
        let (before, set) = (&before, &set);
        ControlPlane::new(dir.api_dir())
            .block_on(&state.node_netns, Identity::Admin, |client| async move {
                api::sync(&client, before, set, Some(&node)).await?;
                // No endpointslice controller: the lab writes them, after their Services.
                api::sync_endpoint_slices(&client, &slices_before, &slices_after).await
            })
            .and_then(|r| r)
            .map_err(|e| LabError::invalid("writing to the lab's API server", e))?;
    }
    if state.with_agent {
        if let Some(weir) = start_agent {
            state.agent_pid = Some(agent::start(dir, state, weir)?);
            dir.save(state)?;
        }
        if let Some(timeout) = timeout {
            agent::wait_for(dir, state, timeout)?;
        }
    }
    // A peer shows nothing for a change to what it does not watch (nothing at all, or a
    // ClusterNetworkPolicy, which none of them implements).
    if let (Some(_), Some(timeout)) = (&state.peer, timeout) {
        let changed = set
            .objects
            .keys()
            .chain(before.objects.keys())
            .filter(|k| before.objects.get(*k) != set.objects.get(*k))
            .map(|k| k.kind);
        if changed.into_iter().any(peers::watched) {
            peers::wait_programmed(dir, state, peer_mark, timeout)?;
        }
    }
    if let (Some(p), Some(timeout)) = (&state.proxy, timeout) {
        proxy::wait_programmed(dir, state, p.mode, &before, &set, timeout)?;
    }
    for pod in removed {
        netns::stop_processes(&pod.netns)?;
        world::delete_pod(&state.node_netns, &pod)?;
    }
    Ok(())
}

/// Decides each pod's namespace, interface and addresses: kept for existing pods, from
/// `status.podIP(s)` when the manifest gives them, otherwise allocated. The addresses are
/// written into the Pod objects' status, where the agent reads them.
fn plan_pods(
    state: &LabState,
    set: &mut ObjectSet,
) -> Result<BTreeMap<String, PodState>, LabError> {
    let mut planned = BTreeMap::new();
    let mut used4 = BTreeSet::new();
    let mut used6 = BTreeSet::new();
    let mut pending = Vec::new();
    for object in set.objects.values_mut() {
        let Object::Pod(pod) = object else {
            continue;
        };
        let key = objects::pod_key(pod);
        let ports = objects::served_ports(pod)?;
        let (mut v4, mut v6) = declared_ips(pod)?;
        if let Some(old) = state.pods.get(&key) {
            if (v4.is_some() || v6.is_some()) && (v4, v6) != (old.ipv4, old.ipv6) {
                return Err(LabError::invalid(
                    format!("Pod {key}"),
                    "status.podIPs differ from the running pod's; delete the pod first",
                ));
            }
            (v4, v6) = (old.ipv4, old.ipv6);
        }
        used4.extend(v4);
        used6.extend(v6);
        pending.push((pod, key, ports, v4, v6));
    }
    for (pod, key, ports, mut v4, mut v6) in pending {
        if v4.is_none() && v6.is_none() {
            let a4 = addr::next_ipv4(state.ipv4_pool, &used4)?;
            let a6 = addr::next_ipv6(state.ipv6_pool, &used6)?;
            used4.insert(a4);
            used6.insert(a6);
            (v4, v6) = (Some(a4), Some(a6));
        }
        let pod_state = PodState {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            netns: format!("{}_{}", state.id, key.replace('/', "_")),
            host_if: host_interface(&key),
            ipv4: v4,
            ipv6: v6,
            ports,
        };
        write_status(pod, &pod_state);
        planned.insert(key, pod_state);
    }
    Ok(planned)
}

/// The addresses a manifest gives in `status.podIPs` (or `status.podIP`).
fn declared_ips(
    pod: &Pod,
) -> Result<(Option<std::net::Ipv4Addr>, Option<std::net::Ipv6Addr>), LabError> {
    let status = pod.status.as_ref();
    let listed = status.and_then(|s| s.pod_ips.as_ref());
    let texts: Vec<(String, &str)> = match (listed, status.and_then(|s| s.pod_ip.as_deref())) {
        (Some(ips), _) => ips
            .iter()
            .enumerate()
            .map(|(i, ip)| (format!("status.podIPs[{i}].ip"), ip.ip.as_str()))
            .collect(),
        (None, Some(ip)) => vec![("status.podIP".to_string(), ip)],
        (None, None) => Vec::new(),
    };
    let (mut v4, mut v6) = (None, None);
    for (field, text) in texts {
        let ip: IpAddr = text.parse().map_err(|_| {
            LabError::invalid(
                format!("Pod {}", objects::pod_key(pod)),
                format!("{field}: {text:?} is not an IP address"),
            )
        })?;
        match ip {
            IpAddr::V4(a) => v4 = Some(a),
            IpAddr::V6(a) => v6 = Some(a),
        }
    }
    Ok((v4, v6))
}

fn write_status(pod: &mut Pod, planned: &PodState) {
    let ips: Vec<String> = planned
        .ipv4
        .map(|a| a.to_string())
        .into_iter()
        .chain(planned.ipv6.map(|a| a.to_string()))
        .collect();
    let status = pod.status.get_or_insert_with(PodStatus::default);
    status.phase = Some("Running".to_string());
    status.pod_ip = ips.first().cloned();
    status.pod_ips = Some(ips.into_iter().map(|ip| PodIP { ip }).collect());
}

/// `lxc` and a hash of the pod's name: unique, stable, and within the 15-byte limit.
fn host_interface(key: &str) -> String {
    let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("lxc{:011x}", hash & 0xfff_ffff_ffff)
}

/// Starts the pod's listener (`weir-lab listen`) in its namespace and waits until it
/// has bound every port.
fn start_listener(dir: &LabDir, pod: &PodState) -> Result<(), LabError> {
    let exe =
        std::env::current_exe().map_err(|e| LabError::io("locating the weir-lab binary", e))?;
    let mut command = Command::new(exe);
    command.arg("listen");
    for p in &pod.ports {
        command.arg(format_port(p));
    }
    let log = dir.listener_log(pod);
    let mut child = netns::spawn_detached(&pod.netns, &mut command, &log, netns::Stdout::Piped)?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut line = String::new();
    std::io::BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(|e| LabError::io(format!("waiting for the listener of {}", pod.key()), e))?;
    if line.trim() != "ready" {
        let log_text = std::fs::read_to_string(&log).unwrap_or_default();
        return Err(LabError::invalid(
            format!("listener of Pod {}", pod.key()),
            format!("did not start: {}", log_text.trim()),
        ));
    }
    Ok(())
}

/// `80/TCP`, the listener's argument format.
pub fn format_port(p: &ServedPort) -> String {
    format!("{}/{}", p.port, p.protocol)
}

pub fn parse_port(text: &str) -> Result<ServedPort, String> {
    let (port, protocol) = text
        .split_once('/')
        .ok_or_else(|| format!("{text:?} is not PORT/PROTOCOL"))?;
    Ok(ServedPort {
        port: port
            .parse()
            .map_err(|_| format!("{port:?} is not a port number"))?,
        protocol: objects::parse_protocol(protocol)?,
    })
}
