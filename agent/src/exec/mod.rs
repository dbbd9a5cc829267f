//! Running the kernel's userspace tools (`ipset`, `iptables-restore`, `tc`, `ip`) with an
//! optional script on stdin, capturing both outputs, killed after a timeout
//! ([`ExecError::TimedOut`] names the command). Shared by reset, both dataplanes and the
//! lab: every external command of the agent goes through here, and a failure that points
//! at a missing kernel module says which ([`modules`]).

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub mod modules;

/// What a finished tool run printed, and whether it succeeded.
#[derive(Clone, Debug)]
pub struct ToolOutput {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("cannot run `{program}` (is it installed and on PATH?): {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{program}` failed: {stderr}")]
    Failed { program: String, stderr: String },
    /// The command did not finish in time: it was killed (with everything it started).
    #[error("`{command}` did not finish within {}s and was killed", after.as_secs_f64())]
    TimedOut { command: String, after: Duration },
}

/// The default bound on every command (`weir agent --command-timeout-seconds`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

static TIMEOUT_MS: AtomicU64 = AtomicU64::new(DEFAULT_TIMEOUT.as_millis() as u64);

/// Sets the bound [`run`] and [`run_ok`] put on every command of this process.
pub fn set_default_timeout(timeout: Duration) {
    TIMEOUT_MS.store(timeout.as_millis().max(1) as u64, Ordering::Relaxed);
}

pub fn default_timeout() -> Duration {
    Duration::from_millis(TIMEOUT_MS.load(Ordering::Relaxed))
}

/// Runs `program args...`, feeding `stdin` when given, killed after the process-wide
/// timeout. A non-zero exit is not an error here: callers read `success` and `stderr`
/// (restore failures are data, not faults).
pub fn run(program: &str, args: &[&str], stdin: Option<&str>) -> Result<ToolOutput, ExecError> {
    run_with_timeout(program, args, stdin, default_timeout())
}

fn describe(program: &str, args: &[&str]) -> String {
    std::iter::once(program)
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ")
}

/// [`run`] with an explicit bound. The child runs in a process group of its own, so a
/// timeout kills whatever it started too, and the pipes close.
pub fn run_with_timeout(
    program: &str,
    args: &[&str],
    stdin: Option<&str>,
    timeout: Duration,
) -> Result<ToolOutput, ExecError> {
    let spawn_error = |source| ExecError::Spawn {
        program: program.to_string(),
        source,
    };
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(spawn_error)?;
    // Feed stdin and drain both outputs from other threads: a large script would
    // otherwise deadlock against a child blocked on writing its own full stdout pipe.
    let (status, stdout, stderr) = std::thread::scope(|scope| {
        if let (Some(script), Some(mut pipe)) = (stdin, child.stdin.take()) {
            // A child that exits early closes the pipe; its stderr says why.
            scope.spawn(move || pipe.write_all(script.as_bytes()));
        }
        let drain = |pipe: Option<Box<dyn Read + Send>>| {
            scope.spawn(move || {
                let mut buf = Vec::new();
                if let Some(mut p) = pipe {
                    let _ = p.read_to_end(&mut buf);
                }
                buf
            })
        };
        let out = drain(
            child
                .stdout
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
        );
        let err = drain(
            child
                .stderr
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
        );
        let status = wait_bounded(&mut child, timeout);
        let join = |h: std::thread::ScopedJoinHandle<'_, Vec<u8>>| h.join().unwrap_or_default();
        (status, join(out), join(err))
    });
    let status = match status {
        Ok(Some(status)) => status,
        Ok(None) => {
            return Err(ExecError::TimedOut {
                command: describe(program, args),
                after: timeout,
            })
        }
        Err(e) => return Err(spawn_error(e)),
    };
    let mut stderr = String::from_utf8_lossy(&stderr).into_owned();
    if !status.success() && program != "modprobe" {
        // "Cannot open session to kernel" says little; name the module and why.
        if let Some(module) = modules::missing_module(program, args, &stderr) {
            stderr = format!("{}\n{}", stderr.trim_end(), modules::why_missing(&module));
        }
    }
    Ok(ToolOutput {
        success: status.success(),
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr,
    })
}

/// Waits for `child` at most `timeout`; `None` when it had to be killed (its whole
/// process group, then reaped).
fn wait_bounded(child: &mut Child, timeout: Duration) -> std::io::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(1);
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(50));
    }
    // The child leads its own process group (process_group(0) above): kill the group,
    // so that nothing it started keeps the output pipes open.
    crate::sys::process::kill_group(child.id());
    let _ = child.kill();
    child.wait()?;
    Ok(None)
}

/// Like [`run`], but a non-zero exit is an [`ExecError::Failed`] carrying stderr.
pub fn run_ok(program: &str, args: &[&str], stdin: Option<&str>) -> Result<String, ExecError> {
    let out = run(program, args, stdin)?;
    if out.success {
        Ok(out.stdout)
    } else {
        Err(ExecError::Failed {
            program: describe(program, args),
            stderr: out.stderr.trim().to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_command_is_killed_and_named() {
        let started = Instant::now();
        let err = run_with_timeout("sleep", &["30"], None, Duration::from_millis(300)).unwrap_err();
        let elapsed = started.elapsed();
        assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
        assert!(
            matches!(&err, ExecError::TimedOut { command, .. } if command == "sleep 30"),
            "{err:?}"
        );
        assert!(err.to_string().contains("`sleep 30`"), "{err}");
    }

    #[test]
    fn a_timeout_kills_what_the_command_started() {
        // The shell's child keeps stdout open: only a group kill lets the call return.
        let started = Instant::now();
        let err = run_with_timeout(
            "sh",
            &["-c", "sleep 30 & sleep 30"],
            None,
            Duration::from_millis(300),
        )
        .unwrap_err();
        assert!(matches!(err, ExecError::TimedOut { .. }), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_fast_command_returns_its_output_and_stdin_is_fed() {
        let out = run_with_timeout("cat", &[], Some("hello\n"), Duration::from_secs(10)).unwrap();
        assert!(out.success);
        assert_eq!(out.stdout, "hello\n");
        let failed = run_ok("sh", &["-c", "echo nope >&2; exit 3"], None).unwrap_err();
        assert!(failed.to_string().contains("nope"), "{failed}");
    }
}
