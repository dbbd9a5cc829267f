//! The lab's namespaces and processes: the namespace primitives are weir-netns's (shared
//! with the bench and the tests); here are the lab's tools run with its timeout, rule
//! listings, and the processes it starts inside namespaces and stops.

use std::fs::File;
use std::process::Command;

use super::LabError;

/// Runs `ip ARGS...` and returns its stdout; a non-zero exit is an error quoting stderr.
pub fn ip(args: &[&str]) -> Result<String, LabError> {
    tool("ip", "iproute2", args, weir::exec::default_timeout())
}

/// Runs `program ARGS...` (from the package `package`, named when it is missing), killed
/// after `timeout`, and returns its stdout; a non-zero exit is an error quoting stderr.
pub fn tool(
    program: &str,
    package: &str,
    args: &[&str],
    timeout: std::time::Duration,
) -> Result<String, LabError> {
    use weir::exec::{self, ExecError};
    let command = || format!("{program} {}", args.join(" "));
    let output = exec::run_with_timeout(program, args, None, timeout).map_err(|e| match e {
        ExecError::Spawn { source, .. } => LabError::io(
            format!(
                "running `{program}` (is {package} installed? `cargo xtask setup` installs it)"
            ),
            source,
        ),
        other => LabError::Command {
            command: command(),
            stderr: other.to_string(),
        },
    })?;
    if !output.success {
        return Err(LabError::Command {
            command: command(),
            stderr: output.stderr.trim().to_string(),
        });
    }
    Ok(output.stdout)
}

/// Runs a rule listing (`iptables-save`, `nft list ...`) in `netns`, killed after 10 s:
/// its output whatever its exit status, which the caller judges (a table that does not
/// exist yet is no error to some).
pub fn listing(
    netns: &str,
    program: &str,
    args: &[&str],
) -> Result<weir::exec::ToolOutput, LabError> {
    in_netns(netns, || {
        weir::exec::run_with_timeout(program, args, None, std::time::Duration::from_secs(10))
    })?
    .map_err(|e| LabError::Command {
        command: format!("{program} {}", args.join(" ")),
        stderr: e.to_string(),
    })
}

pub use weir_netns::{enter, exists, list_with_prefix, open, path};

/// Runs `f` on a thread that entered the namespace (and so do the processes it starts).
pub fn in_netns<T: Send>(netns: &str, f: impl FnOnce() -> T + Send) -> Result<T, LabError> {
    Ok(weir_netns::in_netns(netns, f)?)
}

/// Sets a sysctl inside a namespace.
pub fn sysctl(netns: &str, key: &str, value: &str) -> Result<(), LabError> {
    Ok(weir_netns::sysctl(netns, key, value)?)
}

/// Creates a namespace with its loopback up.
pub fn add(netns: &str) -> Result<(), LabError> {
    Ok(weir_netns::add(netns)?)
}

/// Deletes a namespace if it exists (idempotent).
pub fn delete(netns: &str) -> Result<(), LabError> {
    Ok(weir_netns::delete(netns)?)
}

/// Process ids running in the namespace.
pub fn pids(netns: &str) -> Result<Vec<i32>, LabError> {
    Ok(weir_netns::pids(netns)?)
}

/// What a detached process does with its standard output.
pub enum Stdout {
    /// Into the log, with stderr.
    Log,
    /// To a pipe the caller reads (a readiness line).
    Piped,
}

/// Starts `command` inside the namespace as a session leader of its own, so that it
/// outlives this process; its stderr (and stdout, unless piped) goes to `log`.
pub fn spawn_detached(
    netns: &str,
    command: &mut Command,
    log: &std::path::Path,
    stdout: Stdout,
) -> Result<std::process::Child, LabError> {
    let fd = open(netns)?;
    let log_file =
        File::create(log).map_err(|e| LabError::io(format!("creating {}", log.display()), e))?;
    let stdout = match stdout {
        Stdout::Piped => std::process::Stdio::piped(),
        Stdout::Log => log_file
            .try_clone()
            .map_err(|e| LabError::io(format!("opening {}", log.display()), e))?
            .into(),
    };
    command
        .stdin(std::process::Stdio::null())
        .stdout(stdout)
        .stderr(log_file);
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec the child only calls setns and setsid, both
    // async-signal-safe system calls.
    unsafe {
        command.pre_exec(move || {
            enter(&fd)?;
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command.spawn().map_err(|e| {
        LabError::io(
            format!("starting {:?} in netns {netns}", command.get_program()),
            e,
        )
    })
}

/// Stops every process in the namespace: SIGTERM, then SIGKILL after a grace period.
/// Only processes the lab started live in the lab's namespaces.
pub fn stop_processes(netns: &str) -> Result<(), LabError> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut signal = libc::SIGTERM;
    loop {
        let pids = pids(netns)?;
        if pids.is_empty() {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            signal = libc::SIGKILL;
        }
        for pid in pids {
            // SAFETY: kill only sends a signal to the given process id.
            unsafe { libc::kill(pid, signal) };
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Whether the process is alive (a zombie, not yet reaped by its parent, is not).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z'))
    })
}

/// A helper process (kube-proxy, a peer) that is not doing its job: the reason, then the
/// end of its log.
pub fn not_ready(what: impl Into<String>, reason: &str, log: &std::path::Path) -> LabError {
    LabError::invalid(
        what,
        format!(
            "{reason}; last lines of {}:\n{}",
            log.display(),
            log_tail(log)
        ),
    )
}

/// A process's log as an error quotes it: its last 15 lines.
pub fn log_tail(path: &std::path::Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

pub fn stop_pid(pid: u32, grace: std::time::Duration) {
    // A zombie leader is not enough: its other threads may still be exiting, holding the
    // process's files (the agent's listening port, say) until the last one is gone.
    let gone = || {
        let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat")).map(|stat| {
            stat.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('Z'))
        });
        let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map(|d| d.count());
        match (zombie, threads) {
            (Err(_), _) | (_, Err(_)) => true,
            (Ok(zombie), Ok(threads)) => zombie && threads <= 1,
        }
    };
    let deadline = std::time::Instant::now() + grace;
    // SAFETY: kill only sends a signal to the given process id.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    while !gone() {
        if std::time::Instant::now() > deadline {
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
