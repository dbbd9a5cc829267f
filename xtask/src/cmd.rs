//! Running external commands with readable failures.
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{bail, Context, Result};

/// The workspace root (xtask lives one level below it).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

pub fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(workspace_root());
    c
}

/// Runs `cmd`, inheriting stdio; fails naming the command.
pub fn exec(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {shown}"))?;
    if !status.success() {
        bail!("{shown} failed ({status})");
    }
    Ok(())
}

/// Runs `cmd` and returns its stdout; `None` when it cannot start or exits non-zero.
pub fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.stderr(Stdio::null()).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Starts `cmd` in a process group of its own, stdin closed, stdout and stderr into `log`
/// (created anew): a long child whose output would drown the run's, and which
/// [`kill_group`] stops with everything it started.
pub fn spawn_logged(cmd: &mut Command, log: &Path) -> Result<Child> {
    let out = std::fs::File::create(log).with_context(|| format!("create {}", log.display()))?;
    Ok(cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .process_group(0)
        .spawn()?)
}

/// Kills the process group a [`spawn_logged`] child leads, and reaps the child.
pub fn kill_group(child: &mut Child) {
    // SAFETY: kill(2) on the process group the child leads; no memory involved.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    let _ = child.wait();
}
