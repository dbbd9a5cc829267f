//! The other NetworkPolicy agents in the lab (`weir-lab up --enforcer NAME`, server mode
//! only): each runs in the node namespace against the lab's API server, as its own
//! DaemonSet would run it on a node, in place of weir's agent. The probes and their JSON
//! stay as they are, so one scenario table judges every enforcer. All the peer plumbing is
//! here: the agent knows nothing of its peers.
//!
//! The binaries are built by `cargo xtask peers` from the Go module proxy, at the versions
//! `deploy/peer-versions` pins, into `$WEIR_COMPONENTS_DIR/<name>-<version>/<name>`.
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

/// The pinned version of a peer, from deploy/peer-versions.
fn version(enforcer: Enforcer) -> Option<&'static str> {
    include_str!("../../deploy/peer-versions")
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .find_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            [name, _, version] if name == enforcer.name() => Some(version),
            _ => None,
        })
}

/// Where `cargo xtask peers` puts the peer's binary.
pub fn binary(enforcer: Enforcer) -> Option<PathBuf> {
    let version = version(enforcer)?;
    Some(
        components_root()
            .join(format!("{}-{version}", enforcer.name()))
            .join(enforcer.name()),
    )
}

/// Refuses a peer this host cannot run, before anything is built: Azure NPM (no source),
/// a binary not built yet, and for kube-network-policies the kernel's nftables `queue`
/// statement (probed in a scratch namespace).
pub fn check_host(enforcer: Enforcer) -> Result<(), LabError> {
    let what = format!("--enforcer {}", enforcer.name());
    let binary = match (enforcer, binary(enforcer)) {
        (Enforcer::Weir, _) => return Ok(()),
        (Enforcer::AzureNpm, _) | (_, None) => {
            return Err(LabError::invalid(
                &what,
                "Azure NPM cannot be built here: the Go module proxy refuses github.com/Azure/azure-container-networking (403 Forbidden, every version), and the lab runs peers built from the proxy only",
            ))
        }
        (_, Some(b)) => b,
    };
    if !binary.is_file() {
        return Err(LabError::invalid(
            &what,
            format!(
                "{} not found: `cargo xtask peers --build-only` builds {} {} from the Go module proxy (or set WEIR_COMPONENTS_DIR)",
                binary.display(),
                enforcer.name(),
                version(enforcer).unwrap_or("?"),
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
    Ok(())
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

/// Starts the peer in the node namespace with the lab admin's credentials (the lab does
/// not reproduce each peer's ClusterRole); returns its state.
pub fn start(dir: &LabDir, state: &LabState, enforcer: Enforcer) -> Result<PeerState, LabError> {
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
    let binary = binary(enforcer).expect("check_host passed");
    let mut command = Command::new(&binary);
    match enforcer {
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
        Enforcer::Weir | Enforcer::AzureNpm => unreachable!("not a runnable peer"),
    }
    let child = netns::spawn_detached(
        &state.node_netns,
        &mut command,
        &dir.peer_log(),
        netns::Stdout::Log,
    )?;
    Ok(PeerState {
        enforcer,
        version: version(enforcer).unwrap_or_default().to_string(),
        pid: child.id(),
    })
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
        Enforcer::KubeRouter => &[
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
        for enforcer in [Enforcer::KubeRouter, Enforcer::KubeNetworkPolicies] {
            assert!(
                version(enforcer).is_some_and(|v| v.starts_with('v')),
                "{enforcer:?}"
            );
        }
        assert_eq!(version(Enforcer::AzureNpm), None);
    }
}
