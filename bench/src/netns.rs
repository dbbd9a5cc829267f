//! The bench's network namespaces (weir-netns), named `weir-bench-<tag>-<pid>` so that a
//! later run sweeps what a killed one left behind, and deleted on drop (so a failing
//! scenario still cleans up); what they run dies with the bench.
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};

pub use weir_netns::ip;

/// A namespace of this bench run, deleted (with every interface in it) when dropped.
pub struct Netns(weir_netns::Netns);

impl Netns {
    /// Creates `weir-bench-<tag>-<pid>` with its loopback up.
    pub fn create(tag: &str) -> Result<Self> {
        let name = format!("weir-bench-{tag}-{}", std::process::id());
        Ok(Netns(weir_netns::Netns::create(name)?))
    }

    pub fn name(&self) -> &str {
        self.0.name()
    }

    /// Runs `f` on a thread that entered this namespace; sockets it creates stay in it.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        self.0.run(f)?
    }

    /// Makes `command` start inside this namespace (only the network namespace changes,
    /// so the host's bpffs stays visible). The child is killed if the bench dies (for
    /// example on Ctrl-C), so that nothing keeps running in a namespace that the next run
    /// sweeps away.
    pub fn command(&self, command: &mut Command) -> Result<()> {
        self.0.command(command)?;
        // SAFETY: between fork and exec the child only calls prctl, an async-signal-safe
        // system call.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(())
    }

    /// Writes a sysctl of this namespace.
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        self.0
            .sysctl(key, value)
            .with_context(|| format!("bench namespace {}", self.name()))
    }
}

/// Removes what an earlier bench run that was killed left behind: its namespaces and BPF
/// pin directories, recognised by the `weir-bench-` prefix and the pid of a process that
/// no longer exists.
pub fn sweep_stale() {
    for dir in ["/run/netns", "/sys/fs/bpf"] {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = name
                .strip_prefix("weir-bench-")
                .and_then(|rest| rest.rsplit('-').next())
                .and_then(|pid| pid.parse::<u32>().ok())
            else {
                continue;
            };
            if PathBuf::from(format!("/proc/{pid}")).exists() {
                continue;
            }
            let removed: Result<()> = if dir == "/run/netns" {
                weir_netns::delete(&name).map_err(Into::into)
            } else {
                std::fs::remove_dir_all(entry.path()).map_err(Into::into)
            };
            match removed {
                Ok(()) => println!("bench: removed {dir}/{name}, left by a run that died"),
                Err(e) => eprintln!("bench: cannot remove {dir}/{name}: {e:#}"),
            }
        }
    }
}
