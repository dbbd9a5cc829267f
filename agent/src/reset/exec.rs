//! Running the kernel's userspace tools (`ipset`, `iptables-restore`, `tc`, `ip`) with an
//! optional script on stdin, capturing both outputs. Shared by reset and the iptables
//! dataplane: every kernel write goes through here.

use std::io::Write;
use std::process::{Command, Stdio};

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
}

/// Runs `program args...`, feeding `stdin` when given. A non-zero exit is not an error
/// here: callers read `success` and `stderr` (restore failures are data, not faults).
pub fn run(program: &str, args: &[&str], stdin: Option<&str>) -> Result<ToolOutput, ExecError> {
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
        .spawn()
        .map_err(spawn_error)?;
    // Write stdin from another thread: a large script would otherwise deadlock against
    // a child blocked on writing its own full stdout pipe.
    let output = std::thread::scope(|scope| {
        if let (Some(script), Some(mut pipe)) = (stdin, child.stdin.take()) {
            // A child that exits early closes the pipe; its stderr says why.
            scope.spawn(move || pipe.write_all(script.as_bytes()));
        }
        child.wait_with_output()
    })
    .map_err(spawn_error)?;
    Ok(ToolOutput {
        success: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    })
}

/// Like [`run`], but a non-zero exit is an [`ExecError::Failed`] carrying stderr.
pub fn run_ok(program: &str, args: &[&str], stdin: Option<&str>) -> Result<String, ExecError> {
    let out = run(program, args, stdin)?;
    if out.success {
        Ok(out.stdout)
    } else {
        Err(ExecError::Failed {
            program: std::iter::once(program)
                .chain(args.iter().copied())
                .collect::<Vec<_>>()
                .join(" "),
            stderr: out.stderr.trim().to_string(),
        })
    }
}
