//! Booting an installed kernel under virtme-ng with the host's userspace (read-only, over
//! 9p) and running one script in it as root. The script writes its results into a
//! read-write directory of the host; the console is kept as a log.
//!
//! KVM is probed, not assumed: on machines like the project's own /dev/kvm exists, yet
//! qemu aborts with `-cpu host` ("failed to set MSR 0x10a") and other CPU models hang, so
//! a short KVM boot decides and software emulation (TCG) is the fallback.
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// Guest size: enough for a lab with kube-apiserver and etcd, on the project's 2 cores.
const MEMORY: &str = "4G";
const CPUS: &str = "2";
/// A KVM guest that has not printed its marker by then is taken as hung.
const KVM_PROBE_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

impl std::fmt::Display for Accel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Accel::Kvm => "KVM",
            Accel::Tcg => "software emulation (TCG)",
        })
    }
}

fn vng(release: &str, accel: Accel) -> Command {
    let mut c = Command::new("vng");
    c.args([
        "-r", release, "--user", "root", "--memory", MEMORY, "--cpus", CPUS,
    ]);
    if accel == Accel::Tcg {
        c.arg("--disable-kvm");
    }
    // These kernels lack virtio-serial script ports; the script's output only reaches the
    // console with --verbose.
    c.arg("--verbose");
    c
}

/// KVM when a guest boots under it and runs a command, software emulation otherwise; the
/// reason is printed either way.
pub fn probe_accel(release: &str, log: &Path) -> Result<Accel> {
    if !Path::new("/dev/kvm").exists() {
        println!("kernels: no /dev/kvm: software emulation");
        return Ok(Accel::Tcg);
    }
    let marker = "weir-kvm-probe-ok";
    let started = Instant::now();
    let ran = run(
        vng(release, Accel::Kvm).args(["--", &format!("echo {marker}")]),
        log,
        KVM_PROBE_TIMEOUT,
    )?;
    let console = fs::read_to_string(log).unwrap_or_default();
    if ran && console.lines().any(|l| l.trim() == marker) {
        println!("kernels: KVM works ({:.0?})", started.elapsed());
        return Ok(Accel::Kvm);
    }
    let why = console
        .lines()
        .rev()
        .find(|l| l.contains("qemu-system") || l.contains("error"))
        .unwrap_or("the guest hung")
        .trim()
        .to_string();
    println!("kernels: /dev/kvm exists but a KVM guest failed ({why}): software emulation (TCG)");
    Ok(Accel::Tcg)
}

/// Boots `release` (with `append` on its command line) and runs `sh script` in it; the script's results go to `results`
/// (writable in the guest), the console to `console`. `false` when it timed out.
pub fn boot_and_run(
    release: &str,
    accel: Accel,
    append: Option<&str>,
    script: &Path,
    results: &Path,
    console: &Path,
    timeout: Duration,
) -> Result<bool> {
    // Not /tmp or /var/tmp: virtme mounts its own over them.
    let mut c = vng(release, accel);
    if let Some(append) = append {
        c.args(["--append", append]);
    }
    c.arg(format!("--rwdir={}", results.display()))
        .args(["--", &format!("sh {}", script.display())]);
    run(&mut c, console, timeout)
}

/// Runs `cmd` with stdout and stderr in `log`, killing it (and qemu) after `timeout`.
fn run(cmd: &mut Command, log: &Path, timeout: Duration) -> Result<bool> {
    let mut child = crate::cmd::spawn_logged(cmd, log)
        .context("cannot start vng (virtme-ng; `cargo xtask setup` installs it)")?;
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            if status.code().is_none() {
                bail!("vng was killed ({status}); console in {}", log.display());
            }
            return Ok(true);
        }
        if started.elapsed() > timeout {
            crate::cmd::kill_group(&mut child);
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}
