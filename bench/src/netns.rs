//! Network namespaces owned by one bench run: created through iproute2, deleted on drop
//! (so a failing scenario still cleans up), entered from a thread or a child process.
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

/// Runs `ip ARGS...`; a non-zero exit is an error quoting stderr.
pub fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running `ip` (is iproute2 installed? `cargo xtask setup`)")?;
    if !out.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// A named network namespace, deleted (with every interface in it) when dropped.
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates `weir-bench-<tag>-<pid>` with its loopback up.
    pub fn create(tag: &str) -> Result<Self> {
        let name = format!("weir-bench-{tag}-{}", std::process::id());
        ip(&["netns", "add", &name])?;
        let ns = Netns { name };
        ip(&["-n", &ns.name, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    fn open(&self) -> Result<OwnedFd> {
        let path = PathBuf::from("/run/netns").join(&self.name);
        File::open(&path)
            .map(OwnedFd::from)
            .with_context(|| format!("opening {}", path.display()))
    }

    /// Runs `f` on a thread that entered this namespace; sockets it creates stay in it.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        let fd = self.open()?;
        std::thread::scope(|s| {
            s.spawn(|| {
                enter(&fd).with_context(|| format!("entering netns {}", self.name))?;
                f()
            })
            .join()
            .map_err(|_| anyhow::anyhow!("a thread in netns {} panicked", self.name))?
        })
    }

    /// Makes `command` start inside this namespace. Only the network namespace changes
    /// (not the mounts, as `ip netns exec` would), so the host's bpffs stays visible. The
    /// child is killed if the bench dies (for example on Ctrl-C), so that nothing keeps
    /// running in a namespace that the next run sweeps away.
    pub fn command(&self, command: &mut Command) -> Result<()> {
        let fd = self.open()?;
        // SAFETY: between fork and exec the child only calls prctl and setns, both
        // async-signal-safe system calls.
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                enter(&fd)
            });
        }
        Ok(())
    }

    /// Writes a sysctl of this namespace (/proc/sys/net follows the writer's namespace).
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        let path = PathBuf::from("/proc/sys").join(key.replace('.', "/"));
        self.run(|| {
            std::fs::write(&path, value)
                .with_context(|| format!("{}: writing {}", self.name, path.display()))
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "delete", &self.name]) {
            eprintln!("bench: cleanup: {e}");
        }
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
            let removed = if dir == "/run/netns" {
                ip(&["netns", "delete", &name])
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

fn enter(fd: &OwnedFd) -> std::io::Result<()> {
    // SAFETY: setns on a valid namespace fd only changes this thread's network namespace.
    if unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
