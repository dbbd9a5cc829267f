//! The lab's agent: the real `weir agent` inside the node namespace, run from the `weir`
//! binary the lab is given ([`WeirBinary`]) or from weir's image, in file mode (reading
//! objects.yaml) or, in server mode, in cluster mode against the lab's kube-apiserver with
//! the DaemonSet's ServiceAccount; and the wait for it to enforce the lab's objects.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::container;
use super::control_plane::{ControlPlane, Identity};
use super::netns;
use super::state::{LabDir, LabState};
use super::LabError;
use weir_policy::model::ObjectError;

/// What the agent reports in its status file after converging.
#[derive(Debug, Deserialize)]
pub struct AgentStatus {
    pub generation: u64,
    pub converged: bool,
    pub dataplane: Option<String>,
    pub fallback_reason: Option<String>,
    #[serde(default)]
    pub errors: Vec<ObjectError>,
    /// Cluster mode: the digest of the objects the agent applied.
    #[serde(default)]
    pub state_digest: Option<String>,
}

/// Where the lab's agent serves /status, /metrics, /healthz and /readyz, inside the node
/// namespace (each lab has its own, so the port never collides). Not the DaemonSet's
/// 9402: tests start agents of their own in the node namespace on that one.
pub const LISTEN: &str = "127.0.0.1:9419";

/// The agent's --listen address: the lab's, unless `--agent-arg` gave one.
pub fn listen_address(state: &LabState) -> Result<std::net::SocketAddr, LabError> {
    let mut given = None;
    let mut args = state.agent_args.iter();
    while let Some(a) = args.next() {
        if a == "--listen" {
            given = args.next().cloned();
        } else if let Some(v) = a.strip_prefix("--listen=") {
            given = Some(v.to_string());
        }
    }
    let text = given.unwrap_or_else(|| LISTEN.to_string());
    text.parse().map_err(|e: std::net::AddrParseError| {
        LabError::invalid(format!("the agent's --listen {text}"), e.to_string())
    })
}

/// The `weir` binary the lab runs as its agent: the one given (`--weir-bin`, `WEIR_BIN`),
/// else `weir` beside the running `weir-lab`, as `cargo build -p weir -p weir-lab` leaves
/// them. Found only when an agent is started, so the commands that start none run
/// without it.
#[derive(Clone, Debug, Default)]
pub struct WeirBinary {
    given: Option<PathBuf>,
}

impl WeirBinary {
    pub fn new(given: Option<PathBuf>) -> Self {
        WeirBinary { given }
    }

    /// The binary's path, checked to exist: an error names the path and how to get it.
    pub fn path(&self) -> Result<PathBuf, LabError> {
        let path = match &self.given {
            Some(p) => p.clone(),
            None => std::env::current_exe()
                .map_err(|e| LabError::io("locating the weir-lab binary", e))?
                .with_file_name("weir"),
        };
        if !path.is_file() {
            return Err(LabError::WeirBinaryMissing(path));
        }
        Ok(path)
    }
}

/// Starts the agent in the node namespace and returns its pid: `weir`'s binary (see
/// [`WeirBinary`]), or with `--agent-image` runc running the image (the pid is runc's,
/// which forwards signals). It is entered with setns in the child, not with `ip netns
/// exec`, which would remount /sys and hide the host's bpffs pins.
pub fn start(dir: &LabDir, state: &LabState, weir: &WeirBinary) -> Result<u32, LabError> {
    let mut args: Vec<String> = vec![
        "--status-file".into(),
        dir.status_file().to_string_lossy().into(),
        "--dataplane".into(),
        state.dataplane.to_string(),
        "--bpf-root".into(),
        state.bpf_root.to_string_lossy().into(),
        // Before --agent-arg, which may override it.
        "--listen".into(),
        LISTEN.into(),
    ];
    // The lab quotes the log's last lines when the agent exits: they must be its error,
    // not the error's backtrace (anyhow captures one when RUST_BACKTRACE is set).
    let mut env: Vec<(String, String)> = vec![("RUST_LIB_BACKTRACE".into(), "0".into())];
    match &state.api {
        // As the DaemonSet runs it: NODE_NAME and the ServiceAccount's credentials.
        Some(api) => {
            let kubeconfig = ControlPlane::new(dir.api_dir()).kubeconfig(Identity::Agent);
            env.push(("KUBECONFIG".into(), kubeconfig.to_string_lossy().into()));
            env.push(("NODE_NAME".into(), api.node_name.clone()));
            args.extend(["--log-format".into(), "text".into()]);
        }
        None => {
            args.extend([
                "--manifests".into(),
                dir.objects_file().to_string_lossy().into(),
            ]);
            // The lab waits for each change: notice it at once.
            args.extend(["--poll-ms".into(), "10".into()]);
        }
    }
    args.extend(state.agent_args.iter().cloned());
    let mut command = match &state.agent_container {
        Some(c) => container::command(
            c,
            &container::Launch {
                node_netns: &state.node_netns,
                node_name: state.api.as_ref().map(|a| a.node_name.as_str()),
                args,
                env,
                binds: vec![dir.dir.clone()],
            },
        )?,
        None => {
            let mut command = Command::new(weir.path()?);
            command.arg("agent").args(args).envs(env);
            command
        }
    };
    let child = netns::spawn_detached(
        &state.node_netns,
        &mut command,
        &dir.agent_log(),
        netns::Stdout::Log,
    )?;
    Ok(child.id())
}

/// The agent's node report (`GET /status` inside the node namespace).
pub fn report(state: &LabState) -> Result<weir::daemon::report::NodeReport, LabError> {
    let addr = listen_address(state)?;
    Ok(netns::in_netns(&state.node_netns, move || {
        weir::daemon::report::fetch(addr)
    })??)
}

/// Whether the agent enforces the lab's current objects: in file mode the status names
/// the generation of objects.yaml; in server mode its digest equals the server's.
fn caught_up(dir: &LabDir, state: &LabState, status: &AgentStatus) -> Result<bool, LabError> {
    if state.api.is_none() {
        return Ok(status.generation >= state.generation);
    }
    let server = ControlPlane::new(dir.api_dir())
        .block_on(&state.node_netns, Identity::Admin, |client| async move {
            super::api::server_digest(&client).await
        })
        .map_err(|e| LabError::invalid("the lab's API server", e))?;
    Ok(matches!(server, Ok(d) if status.state_digest.as_deref() == Some(d.as_str())))
}

/// Whether the agent process is alive.
fn agent_alive(state: &LabState) -> Result<bool, LabError> {
    match state.agent_pid {
        Some(pid) => Ok(netns::alive(pid)),
        None => Ok(!netns::pids(&state.node_netns)?.is_empty()),
    }
}

/// Waits until the agent reports `generation` or later, converged. Dataplane errors in
/// the status are an error listing them.
pub fn wait_for(
    dir: &LabDir,
    state: &LabState,
    timeout: Duration,
) -> Result<AgentStatus, LabError> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = read_status(&dir.status_file())? {
            if status.converged && caught_up(dir, state, &status)? {
                if !status.errors.is_empty() {
                    let list: Vec<String> = status
                        .errors
                        .iter()
                        .map(|e| format!("{}: {}", e.object, e.reason))
                        .collect();
                    return Err(LabError::Agent(format!(
                        "generation {} applied with errors: {}",
                        status.generation,
                        list.join("; ")
                    )));
                }
                return Ok(status);
            }
            // No dataplane could start (a kernel module missing, say): the agent retries
            // at its next resync, but the reason is known now.
            if let Some(e) = status.errors.iter().find(|e| e.object == "dataplane") {
                if !status.converged && status.generation >= state.generation {
                    return Err(LabError::Agent(format!(
                        "generation {}: the agent could not start a dataplane: {}",
                        status.generation, e.reason
                    )));
                }
            }
        }
        if !agent_alive(state)? {
            return Err(LabError::Agent(format!(
                "the agent is not running; last lines of {}:\n{}",
                dir.agent_log().display(),
                netns::log_tail(&dir.agent_log())
            )));
        }
        if Instant::now() > deadline {
            return Err(LabError::Agent(format!(
                "generation {} not enforced after {timeout:?}{}; last lines of {}:\n{}",
                state.generation,
                if state.api.is_some() {
                    " (its applied state never matched the API server's)"
                } else {
                    ""
                },
                dir.agent_log().display(),
                netns::log_tail(&dir.agent_log())
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_status(path: &Path) -> Result<Option<AgentStatus>, LabError> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| LabError::invalid(path.display().to_string(), e.to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(LabError::io(format!("reading {}", path.display()), e)),
    }
}

/// The dataplane the agent reports enforcing (it may have fallen back or switched).
pub fn current_dataplane(dir: &LabDir) -> Option<String> {
    read_status(&dir.status_file()).ok()??.dataplane
}
