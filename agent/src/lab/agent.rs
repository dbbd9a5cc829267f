//! The lab's agent: the real `weir agent` in file mode, inside the node namespace, and
//! the wait for it to enforce a given generation of objects.yaml.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::netns;
use super::state::{LabDir, LabState};
use super::LabError;

/// What the agent reports in its status file after converging.
#[derive(Debug, Deserialize)]
pub struct AgentStatus {
    pub generation: u64,
    pub converged: bool,
    pub dataplane: Option<String>,
    pub fallback_reason: Option<String>,
    #[serde(default)]
    pub errors: Vec<StatusError>,
}

#[derive(Debug, Deserialize)]
pub struct StatusError {
    pub object: String,
    pub reason: String,
}

/// Starts the agent in the node namespace. It is entered with setns in the child, not
/// with `ip netns exec`, which would remount /sys and hide the host's bpffs pins.
pub fn start(dir: &LabDir, state: &LabState) -> Result<(), LabError> {
    let exe = std::env::current_exe().map_err(|e| LabError::io("locating the weir binary", e))?;
    let mut command = Command::new(exe);
    command
        .arg("agent")
        .arg("--manifests")
        .arg(dir.objects_file())
        .arg("--status-file")
        .arg(dir.status_file())
        .arg("--dataplane")
        .arg(state.dataplane.to_string())
        .arg("--bpf-root")
        .arg(&state.bpf_root)
        // The lab waits for each change: notice it at once.
        .args(["--poll-ms", "10"]);
    netns::spawn_detached(
        &state.node_netns,
        &mut command,
        &dir.agent_log(),
        netns::Stdout::Log,
    )?;
    Ok(())
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
            if status.generation >= state.generation && status.converged {
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
        }
        if netns::pids(&state.node_netns)?.is_empty() {
            return Err(LabError::Agent(format!(
                "the agent is not running; last lines of {}:\n{}",
                dir.agent_log().display(),
                log_tail(&dir.agent_log())
            )));
        }
        if Instant::now() > deadline {
            return Err(LabError::Agent(format!(
                "generation {} not enforced after {timeout:?}; last lines of {}:\n{}",
                state.generation,
                dir.agent_log().display(),
                log_tail(&dir.agent_log())
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

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// The dataplane the agent reports enforcing (it may have fallen back or switched).
pub fn current_dataplane(dir: &LabDir) -> Option<String> {
    read_status(&dir.status_file()).ok()??.dataplane
}
