//! The other NetworkPolicy agents in the lab (`weir-lab up --enforcer NAME`, server mode
//! only): each runs in the node namespace against the lab's API server, as its own
//! DaemonSet would run it on a node, in place of weir's agent. The probes and their JSON
//! stay as they are, so one scenario table judges every enforcer. All the peer plumbing is
//! here: the agent knows nothing of its peers.
//!
//! The binaries are built by `cargo xtask peers` from the Go module proxy (Azure NPM from
//! its source archive), at the versions `deploy/peer-versions` pins, into
//! `$WEIR_COMPONENTS_DIR/<name>-<version>/<name>`; a name's first line is the version
//! `--enforcer NAME` runs, `--enforcer NAME@VERSION` picks another pinned one.
//!
//! A peer reports no applied generation, as weir's agent does, so the lab takes a peer's
//! change as enforced once its rules (iptables-save and ipset for kube-router, the nft
//! ruleset for kube-network-policies) have stood still for [`QUIET`] after the write. That
//! is the lab's definition, not the peer's; a peer slower than it shows as a wrong verdict.
//! kube-network-policies decides each connection's first packet in user space from its
//! informer caches, so its rules may not change at all: the quiet wait is all it gets.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use super::control_plane::{components_root, ControlPlane, Identity, APISERVER_PORT};
pub use super::state::{Enforcer, PeerState};
use super::state::{LabDir, LabState};
use super::{netns, LabError};
use weir::exec;
use weir_policy::model::Kind;

impl Enforcer {
    pub fn name(self) -> &'static str {
        match self {
            Enforcer::Weir => "weir",
            Enforcer::KubeRouter => "kube-router",
            Enforcer::KubeNetworkPolicies => "kube-network-policies",
            Enforcer::AzureNpm => "azure-npm",
        }
    }
}

/// How long a peer's rules must stand still before the lab takes a change as enforced
/// (`WEIR_LAB_PEER_QUIET_MS` sets another: `cargo xtask kernels` does in an emulated
/// guest, where a peer takes seconds to notice a change).
pub const QUIET: Duration = Duration::from_millis(1500);

fn quiet() -> Duration {
    std::env::var("WEIR_LAB_PEER_QUIET_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis)
        .unwrap_or(QUIET)
}

/// Whether the peers react to a change of this kind: they watch Pods, Namespaces and
/// NetworkPolicies (and Nodes, Services only to find their node and the Service ranges).
pub fn watched(kind: Kind) -> bool {
    matches!(kind, Kind::Pod | Kind::Namespace | Kind::NetworkPolicy)
}

/// Where the peer's log ends now: a later wait looks for its work after this.
pub fn log_mark(dir: &LabDir) -> u64 {
    std::fs::metadata(dir.peer_log()).map_or(0, |m| m.len())
}

/// Whether kube-router logged a whole sync of its rules (`--v=1`: "Starting sync of
/// iptables", then "sync iptables took") after `mark` in its log.
fn kube_router_synced_since(dir: &LabDir, mark: u64) -> bool {
    let text = std::fs::read(dir.peer_log()).unwrap_or_default();
    let after = String::from_utf8_lossy(text.get(mark as usize..).unwrap_or_default());
    after
        .split_once("Starting sync of iptables")
        .is_some_and(|(_, rest)| rest.contains("sync iptables took"))
}

/// What NPM logs once its dataplane has booted and its controllers start.
pub const NPM_STARTED: &str = "starting NPM - (";

fn npm_started(dir: &LabDir) -> bool {
    let text = std::fs::read(dir.peer_log()).unwrap_or_default();
    String::from_utf8_lossy(&text).contains(NPM_STARTED)
}

/// The flags kube-router runs with (deploy/kube-router-flags, which the bench reads too).
fn kube_router_flags() -> impl Iterator<Item = &'static str> {
    include_str!("../../deploy/kube-router-flags")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
}

/// kube-network-policies' metrics (and /healthz) address, on the node's loopback.
const KNP_METRICS: &str = "127.0.0.1:9080";
/// The NFQUEUE number kube-network-policies reads (its default).
const KNP_QUEUE: u16 = 100;

/// The pinned versions of a peer, from deploy/peer-versions; the first is its default.
fn versions(enforcer: Enforcer) -> Vec<&'static str> {
    include_str!("../../deploy/peer-versions")
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            [name, _, version] if name == enforcer.name() => Some(version),
            _ => None,
        })
        .collect()
}

/// The pinned version of a peer that `--enforcer NAME` runs.
fn version(enforcer: Enforcer) -> Option<&'static str> {
    versions(enforcer).first().copied()
}

/// The directory `cargo xtask peers` builds this version of the peer into.
fn build_dir(enforcer: Enforcer, version: &str) -> PathBuf {
    components_root().join(format!("{}-{version}", enforcer.name()))
}

/// Where `cargo xtask peers` puts the peer's binary (of its default version).
pub fn binary(enforcer: Enforcer) -> Option<PathBuf> {
    Some(build_dir(enforcer, version(enforcer)?).join(enforcer.name()))
}

/// Refuses a peer this host cannot run, before anything is built: a version not pinned,
/// a binary not built yet, and for kube-network-policies the kernel's nftables `queue`
/// statement (probed in a scratch namespace). Returns the version to run: `version`, or
/// the peer's default.
pub fn check_host(enforcer: Enforcer, version: Option<&str>) -> Result<String, LabError> {
    let what = format!("--enforcer {}", enforcer.name());
    if enforcer == Enforcer::Weir {
        return match version {
            None => Ok(String::new()),
            Some(v) => Err(LabError::invalid(
                &what,
                format!("weir's agent is the binary the lab is given, not a pinned version ({v})"),
            )),
        };
    }
    let pinned = versions(enforcer);
    let version = match version {
        None => pinned.first().copied(),
        Some(v) => pinned.iter().copied().find(|p| *p == v),
    }
    .ok_or_else(|| {
        LabError::invalid(
            &what,
            format!(
                "deploy/peer-versions pins {} at {}",
                enforcer.name(),
                pinned.join(", ")
            ),
        )
    })?;
    let dir = build_dir(enforcer, version);
    let mut needed = vec![dir.join(enforcer.name())];
    if enforcer == Enforcer::AzureNpm {
        needed.push(dir.join(NPM_CONFIG));
    }
    if let Some(missing) = needed.iter().find(|f| !f.is_file()) {
        let how = match enforcer {
            Enforcer::AzureNpm => {
                "from its source archive (../shared/peers, or --peer-archives DIR)"
            }
            _ => "from the Go module proxy",
        };
        return Err(LabError::invalid(
            &what,
            format!(
                "{} not found: `cargo xtask peers --build-only` builds {} {version} {how} (or set WEIR_COMPONENTS_DIR)",
                missing.display(),
                enforcer.name(),
            ),
        ));
    }
    if enforcer == Enforcer::KubeNetworkPolicies {
        nft_queue_support().map_err(|why| {
            LabError::invalid(
                &what,
                format!("kube-network-policies queues packets with nftables' `queue` statement, which this kernel refuses (CONFIG_NFT_QUEUE): {why}; run it on a kernel that has it (e.g. Debian's, in a VM)"),
            )
        })?;
    }
    Ok(version.to_string())
}

/// Whether nftables accepts a `queue` rule, in a namespace of its own (the tests ask it
/// too, to say why a kube-network-policies cell does not run).
pub fn nft_queue_support() -> Result<(), String> {
    let _ = exec::run_with_timeout("modprobe", &["nft_queue"], None, Duration::from_secs(10));
    let ns = format!("weir-nftq-probe-{}", std::process::id());
    netns::add(&ns).map_err(|e| e.to_string())?;
    // nft 1.0.6 wants the `;` after the chain's block.
    let ruleset = format!(
        "table inet weir_probe {{ chain c {{ type filter hook forward priority 0; queue num {KNP_QUEUE} bypass; }}; }}\n"
    );
    let loaded = netns::in_netns(&ns, || {
        exec::run_with_timeout(
            "nft",
            &["-c", "-f", "-"],
            Some(&ruleset),
            Duration::from_secs(10),
        )
    });
    let _ = netns::delete(&ns);
    match loaded {
        Ok(Ok(out)) if out.success => Ok(()),
        Ok(Ok(out)) => Err(out.stderr.trim().to_string()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(e) => Err(e.to_string()),
    }
}

/// Azure NPM's config, beside its binary: the ConfigMap its Linux DaemonSet mounts at
/// /etc/azure-npm (`cargo xtask peers` copies it out of the source archive).
const NPM_CONFIG: &str = "azure-npm.json";

/// Azure's instance metadata service, where NPM asks which cloud it runs in.
const IMDS: std::net::Ipv4Addr = std::net::Ipv4Addr::new(169, 254, 169, 254);
const IMDS_ANSWER: &str = "AzurePublicCloud";

/// `weir-lab imds` (hidden; the lab starts it in the node namespace for Azure NPM): the
/// instance metadata service as far as NPM uses it off Azure. NPM's telemetry starts only
/// in Azure's public cloud and, anywhere else, holds NPM back 3 × 1 min (v1.8.12: before
/// it resets its dataplane), so every request is answered `AzurePublicCloud` (its metadata
/// refresh gets the same, and logs that it cannot parse it).
pub fn serve_imds() -> Result<(), LabError> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind((IMDS, 80))
        .map_err(|e| LabError::io(format!("listening on {IMDS}:80"), e))?;
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let mut request = Vec::new();
        let mut buf = [0u8; 4096];
        while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 65536 {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => request.extend_from_slice(&buf[..n]),
            }
        }
        let _ = write!(
            stream,
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{IMDS_ANSWER}",
            IMDS_ANSWER.len()
        );
    }
    Ok(())
}

fn imds_answers(node: &str) -> Result<bool, LabError> {
    netns::in_netns(node, || {
        std::net::TcpStream::connect_timeout(&(IMDS, 80).into(), Duration::from_millis(200)).is_ok()
    })
}

/// Starts the metadata stub ([`serve_imds`]) in the node namespace unless it answers
/// already: IMDS's address on the node's loopback, this binary's `imds` command.
fn ensure_imds(dir: &LabDir, node: &str) -> Result<(), LabError> {
    if imds_answers(node)? {
        return Ok(());
    }
    netns::ip(&[
        "-n",
        node,
        "addr",
        "replace",
        &format!("{IMDS}/32"),
        "dev",
        "lo",
    ])?;
    let exe =
        std::env::current_exe().map_err(|e| LabError::io("finding weir-lab's own binary", e))?;
    let log = dir.dir.join("imds.log");
    netns::spawn_detached(
        node,
        Command::new(exe).arg("imds"),
        &log,
        netns::Stdout::Log,
    )?;
    let started = Instant::now();
    while !imds_answers(node)? {
        if started.elapsed() > Duration::from_secs(10) {
            return Err(netns::not_ready(
                "the lab's metadata stub",
                "it does not answer",
                &log,
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// The chain kubelet makes on every node (Kubernetes 1.24 and later) to tell which iptables
/// backend the node uses; NPM v1.8 reads it and refuses to start without it. The lab has
/// no kubelet, so it makes the chain in the backend the node's `iptables` is.
fn kubelet_hint(node: &str) -> Result<(), LabError> {
    let listed = netns::listing(
        node,
        "iptables",
        &["-t", "mangle", "-S", "KUBE-IPTABLES-HINT"],
    )?;
    if listed.success {
        return Ok(());
    }
    let made = netns::listing(
        node,
        "iptables",
        &["-t", "mangle", "-N", "KUBE-IPTABLES-HINT"],
    )?;
    match made.success {
        true => Ok(()),
        false => Err(LabError::Command {
            command: "iptables -t mangle -N KUBE-IPTABLES-HINT".into(),
            stderr: made.stderr.trim().to_string(),
        }),
    }
}

/// Starts `version` of the peer (see [`check_host`]) in the node namespace with the lab
/// admin's credentials (the lab does not reproduce each peer's ClusterRole); returns its
/// state.
pub fn start(
    dir: &LabDir,
    state: &LabState,
    enforcer: Enforcer,
    version: &str,
) -> Result<PeerState, LabError> {
    let api = state.api.as_ref().ok_or_else(|| {
        LabError::invalid(enforcer.name(), "needs the lab's API server (--api server)")
    })?;
    let cp = ControlPlane::new(dir.api_dir());
    let node = api.node_name.clone();
    // kube-router finds its node's address, and so which pods are its own, in the Node's
    // status, as kube-proxy does.
    cp.block_on(&state.node_netns, Identity::Admin, |client| async move {
        super::api::set_node_address(&client, &node, super::world::NODE_IP).await
    })
    .and_then(|r| r)
    .map_err(|e| LabError::invalid("the lab's Node", e))?;
    let binary = build_dir(enforcer, version).join(enforcer.name());
    let mut command = Command::new(&binary);
    match enforcer {
        Enforcer::AzureNpm => {
            ensure_imds(dir, &state.node_netns)?;
            kubelet_hint(&state.node_netns)?;
            // Its Linux DaemonSet: the image's `azure-npm start`, HOSTNAME from the
            // pod's node name, NPM_CONFIG naming the mounted ConfigMap; hostNetwork.
            command
                .arg("start")
                .arg(format!(
                    "--kubeconfig={}",
                    cp.kubeconfig(Identity::Admin).display()
                ))
                .env("HOSTNAME", &api.node_name)
                .env("NPM_CONFIG", build_dir(enforcer, version).join(NPM_CONFIG));
        }
        Enforcer::KubeRouter => {
            let kubeconfig = cp.kubeconfig(Identity::Admin);
            command
                .arg(format!("--kubeconfig={}", kubeconfig.display()))
                .arg(format!("--hostname-override={}", api.node_name))
                .args(kube_router_flags())
                .env("NODE_NAME", &api.node_name);
        }
        Enforcer::KubeNetworkPolicies => {
            // It reads only the in-cluster config: the ServiceAccount's files at a fixed
            // path and the Service's address in the environment. The files go into a
            // tmpfs on /run of a mount namespace of its own, so the host's stay untouched.
            command = Command::new("unshare");
            command
                .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
                .arg(concat!(
                    "set -e; token=$(cat \"$1\"); ca=$(cat \"$2\"); shift 2; ",
                    "mount -t tmpfs -o size=1m weir-peer /run; ",
                    "d=/run/secrets/kubernetes.io/serviceaccount; mkdir -p $d; ",
                    "printf '%s' \"$token\" > $d/token; printf '%s\\n' \"$ca\" > $d/ca.crt; ",
                    "exec \"$@\""
                ))
                .arg("sh")
                .arg(cp.token_file(Identity::Admin))
                .arg(cp.server_certificate())
                .arg(&binary)
                .arg(format!("--hostname-override={}", api.node_name))
                .arg(format!("--nfqueue-id={KNP_QUEUE}"))
                .arg(format!("--metrics-bind-address={KNP_METRICS}"))
                .arg("--v=2")
                .env("KUBERNETES_SERVICE_HOST", "127.0.0.1")
                .env("KUBERNETES_SERVICE_PORT", APISERVER_PORT.to_string())
                // Either one set makes its NRI stub fail, and it then dereferences nil.
                .env_remove("NRI_PLUGIN_NAME")
                .env_remove("NRI_PLUGIN_IDX");
        }
        Enforcer::Weir => {
            return Err(LabError::invalid(
                "the lab's peer",
                "weir's agent is not a peer",
            ))
        }
    }
    let child = netns::spawn_detached(
        &state.node_netns,
        &mut command,
        &dir.peer_log(),
        netns::Stdout::Log,
    )?;
    Ok(PeerState {
        enforcer,
        version: version.to_string(),
        pid: child.id(),
    })
}

/// `weir-lab peer status`: the lab's peer and whether its process runs.
#[derive(Debug, serde::Serialize)]
pub struct PeerStatus {
    pub enforcer: &'static str,
    pub version: String,
    pub pid: u32,
    pub running: bool,
}

fn lab_peer(state: &LabState, what: &str) -> Result<PeerState, LabError> {
    state.peer.clone().ok_or_else(|| {
        LabError::invalid(what, "this lab runs no peer (weir-lab up --enforcer NAME)")
    })
}

pub fn status(dir: &LabDir) -> Result<PeerStatus, LabError> {
    let peer = lab_peer(&dir.load()?, "weir-lab peer status")?;
    Ok(PeerStatus {
        enforcer: peer.enforcer.name(),
        version: peer.version,
        pid: peer.pid,
        running: netns::alive(peer.pid),
    })
}

/// `weir-lab peer start [--version V]`: the lab's peer started again, as kubelet restarts
/// its container after a crash (or, with another pinned version, as a new image of its
/// DaemonSet replaces it); a process still running is stopped first. Returns at once:
/// whether it comes up is for `weir-lab peer status` and its log to tell.
pub fn restart(dir: &LabDir, version: Option<&str>) -> Result<PeerStatus, LabError> {
    let _lock = dir.lock()?;
    let mut state = dir.load()?;
    let peer = lab_peer(&state, "weir-lab peer start")?;
    let version = check_host(peer.enforcer, Some(version.unwrap_or(&peer.version)))?;
    if netns::alive(peer.pid) {
        netns::stop_pid(peer.pid, Duration::from_secs(10));
    }
    let started = start(dir, &state, peer.enforcer, &version)?;
    let pid = started.pid;
    state.peer = Some(started);
    dir.save(&state)?;
    Ok(PeerStatus {
        enforcer: peer.enforcer.name(),
        version,
        pid,
        running: netns::alive(pid),
    })
}

/// `weir-lab peer signal`: a signal to the peer's process (kill: a crash, term: its pod
/// deleted).
pub fn signal(dir: &LabDir, signal: i32) -> Result<(), LabError> {
    let peer = lab_peer(&dir.load()?, "weir-lab peer signal")?;
    // SAFETY: kill only sends a signal to the given process id.
    if unsafe { libc::kill(peer.pid as i32, signal) } != 0 {
        return Err(LabError::io(
            format!("signalling {} (pid {})", peer.enforcer.name(), peer.pid),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// `weir-lab peer handover`: the node moves from the peer to weir's agent as an operator
/// moves it: the peer's DaemonSet no longer selects the node (its process is stopped, and
/// leaves its rules behind, as a deleted pod does), the Node gets weir's
/// `weir.io/dataplane` label, and weir's agent starts on it and takes over (it removes
/// the peer's leftovers itself). Returns once the agent enforces the lab's objects; from
/// then on the lab is weir's.
pub fn handover(
    dir: &LabDir,
    weir: &super::agent::WeirBinary,
    dataplane: weir::dataplane::DataplaneKind,
    timeout: Duration,
) -> Result<(), LabError> {
    let lock = dir.lock()?;
    let mut state = dir.load()?;
    let peer = lab_peer(&state, "weir-lab peer handover")?;
    let api = state
        .api
        .clone()
        .ok_or_else(|| LabError::invalid("weir-lab peer handover", "needs the lab's API server"))?;
    if netns::alive(peer.pid) {
        netns::stop_pid(peer.pid, Duration::from_secs(10));
    }
    let node = api.node_name.clone();
    let label = dataplane.to_string();
    ControlPlane::new(dir.api_dir())
        .block_on(&state.node_netns, Identity::Admin, |client| async move {
            let patch = serde_json::json!({
                "metadata": { "labels": { weir::daemon::select::DATAPLANE_LABEL: label } }
            });
            kube::Api::<k8s_openapi::api::core::v1::Node>::all(client)
                .patch(
                    &node,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&patch),
                )
                .await
                .map(drop)
                .map_err(|e| format!("labelling node {node}: {e}"))
        })
        .and_then(|r| r)
        .map_err(|e| LabError::invalid("the lab's Node", e))?;
    state.peer = None;
    state.with_agent = true;
    state.dataplane = dataplane;
    dir.save(&state)?;
    state.agent_pid = Some(super::agent::start(dir, &state, weir)?);
    dir.save(&state)?;
    // Probes take the lock too: they go on while the agent takes over.
    drop(lock);
    super::agent::wait_for(dir, &state, timeout).map(drop)
}

/// Waits until the peer has worked on the change made after `mark` (its log; see
/// [`log_mark`]): kube-router has run a whole sync since, kube-network-policies reads its
/// queue; and until then its rules have stood still for [`QUIET`] (see the module's doc).
pub fn wait_programmed(
    dir: &LabDir,
    state: &LabState,
    mark: u64,
    timeout: Duration,
) -> Result<(), LabError> {
    let Some(peer) = &state.peer else {
        return Ok(());
    };
    let quiet = quiet();
    let started = Instant::now();
    let mut last = None;
    let mut still_since = Instant::now();
    loop {
        check_alive(dir, peer)?;
        let rules = rules(&state.node_netns, peer.enforcer)?;
        let programmed = match peer.enforcer {
            Enforcer::KubeRouter => {
                rules.contains(":KUBE-ROUTER-FORWARD") && kube_router_synced_since(dir, mark)
            }
            // NPM logs nothing the lab can tie to one change: that it has booted (this
            // process: the log starts afresh with each), its jump from FORWARD and the
            // quiet are all.
            Enforcer::AzureNpm => {
                npm_started(dir)
                    && rules
                        .lines()
                        .any(|l| l.starts_with("-A FORWARD ") && l.ends_with("-j AZURE-NPM"))
            }
            _ => {
                rules.contains("table inet kube-network-policies")
                    && knp_listening(&state.node_netns)?
            }
        };
        if last.as_ref() != Some(&rules) {
            last = Some(rules);
            still_since = Instant::now();
        } else if programmed && still_since.elapsed() >= quiet {
            return Ok(());
        }
        if started.elapsed() > timeout {
            return Err(not_ready(
                dir,
                peer,
                &format!(
                    "its rules did not {} within {timeout:?}",
                    if programmed { "settle" } else { "appear" }
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether a process reads kube-network-policies' queue in the node namespace (until it
/// does, its rules drop what they queue).
fn knp_listening(node: &str) -> Result<bool, LabError> {
    let table = netns::in_netns(node, || {
        std::fs::read_to_string("/proc/thread-self/net/netfilter/nfnetlink_queue")
            .unwrap_or_default()
    })?;
    // "  100  12345 ...": queue number, then the listener's netlink port id (0: none).
    Ok(table.lines().any(|l| {
        let mut fields = l.split_whitespace();
        fields.next() == Some(KNP_QUEUE.to_string().as_str())
            && fields.next().is_some_and(|port| port != "0")
    }))
}

/// The peer's rules as text in the node namespace, without packet counters.
fn rules(node: &str, enforcer: Enforcer) -> Result<String, LabError> {
    let listings: &[(&str, &[&str])] = match enforcer {
        Enforcer::KubeRouter | Enforcer::AzureNpm => &[
            ("iptables-save", &[]),
            ("ip6tables-save", &[]),
            ("ipset", &["save"]),
        ],
        _ => &[("nft", &["list", "ruleset"])],
    };
    let mut text = String::new();
    for (program, args) in listings {
        let out = netns::listing(node, program, args)?;
        for line in out.stdout.lines().filter(|l| !l.starts_with('#')) {
            // ":CHAIN POLICY [packets:bytes]": the counters move with the probes.
            text.push_str(line.split(" [").next().unwrap_or(line));
            text.push('\n');
        }
    }
    Ok(text)
}

fn check_alive(dir: &LabDir, peer: &PeerState) -> Result<(), LabError> {
    match netns::alive(peer.pid) {
        true => Ok(()),
        false => Err(not_ready(dir, peer, "it exited")),
    }
}

fn not_ready(dir: &LabDir, peer: &PeerState, reason: &str) -> LabError {
    let what = format!("{} {}", peer.enforcer.name(), peer.version);
    netns::not_ready(what, reason, &dir.peer_log())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_runnable_peer_has_a_pinned_version() {
        for enforcer in [
            Enforcer::KubeRouter,
            Enforcer::KubeNetworkPolicies,
            Enforcer::AzureNpm,
        ] {
            assert!(
                version(enforcer).is_some_and(|v| v.starts_with('v')),
                "{enforcer:?}"
            );
        }
        // The seed's release, its fix and the newest one.
        assert_eq!(
            versions(Enforcer::AzureNpm),
            ["v1.8.12", "v1.5.36", "v1.5.37"]
        );
        assert!(check_host(Enforcer::AzureNpm, Some("v9.9.9"))
            .is_err_and(|e| e.to_string().contains("v1.5.36")));
    }
}
