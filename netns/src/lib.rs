//! Named network namespaces (`/run/netns/<name>`, as iproute2 makes them) for weir's lab,
//! bench and tests: created and deleted through `ip` (bounded by a timeout), entered from
//! a thread ([`in_netns`]) or a child process ([`Netns::command`]), listed, and their
//! processes found. [`Netns`] deletes a namespace it created when dropped, so a failing
//! test or scenario still cleans up.
//!
//! Only the network namespace is entered (not the mounts, as `ip netns exec` also does),
//! so the host's bpffs stays visible to what runs inside.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use wait_timeout::ChildExt;

/// Where iproute2 keeps named namespaces.
pub const RUN_DIR: &str = "/run/netns";

/// How long an `ip` command may take before it is killed.
pub const IP_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("running `ip` (is iproute2 installed? `cargo xtask setup` installs it): {0}")]
    Spawn(#[source] std::io::Error),
    #[error("`ip {command}` failed: {stderr}")]
    Failed { command: String, stderr: String },
    #[error("`ip {command}` did not finish within {}s and was killed", after.as_secs())]
    TimedOut { command: String, after: Duration },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("a thread in netns {0} panicked")]
    Panicked(String),
}

impl Error {
    fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            what: what.into(),
            source,
        }
    }
}

/// Runs `ip ARGS...`, killed after [`IP_TIMEOUT`], and returns its stdout; a non-zero exit
/// is an error quoting stderr.
pub fn ip(args: &[&str]) -> Result<String, Error> {
    let command = || args.join(" ");
    let mut child = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(Error::Spawn)?;
    // `ip` prints little here (a list of pids at most), far less than a pipe holds, so
    // reading after it exits cannot block it.
    match child.wait_timeout(IP_TIMEOUT) {
        Ok(Some(_)) => {}
        Ok(None) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::TimedOut {
                command: command(),
                after: IP_TIMEOUT,
            });
        }
        Err(e) => return Err(Error::io(format!("waiting for `ip {}`", command()), e)),
    }
    let output = child
        .wait_with_output()
        .map_err(|e| Error::io(format!("reading `ip {}`", command()), e))?;
    let (status, stdout, stderr) = (
        output.status,
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr),
    );
    if !status.success() {
        return Err(Error::Failed {
            command: command(),
            stderr: stderr.trim().to_string(),
        });
    }
    Ok(stdout)
}

pub fn path(netns: &str) -> PathBuf {
    PathBuf::from(RUN_DIR).join(netns)
}

pub fn exists(netns: &str) -> bool {
    path(netns).exists()
}

/// Creates the namespace with its loopback up.
pub fn add(netns: &str) -> Result<(), Error> {
    ip(&["netns", "add", netns])?;
    ip(&["-n", netns, "link", "set", "lo", "up"])?;
    Ok(())
}

/// Deletes a namespace (with every interface in it) if it exists.
pub fn delete(netns: &str) -> Result<(), Error> {
    if exists(netns) {
        ip(&["netns", "delete", netns])?;
    }
    Ok(())
}

/// Names of all namespaces whose name starts with `prefix`, sorted.
pub fn list_with_prefix(prefix: &str) -> Result<Vec<String>, Error> {
    let dir = match std::fs::read_dir(RUN_DIR) {
        Ok(dir) => dir,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(format!("listing {RUN_DIR}"), e)),
    };
    let mut names: Vec<String> = dir
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|name| name.starts_with(prefix))
        .collect();
    names.sort();
    Ok(names)
}

/// Process ids running in the namespace (`ip netns pids`).
pub fn pids(netns: &str) -> Result<Vec<i32>, Error> {
    if !exists(netns) {
        return Ok(Vec::new());
    }
    let out = ip(&["netns", "pids", netns])?;
    Ok(out
        .split_whitespace()
        .filter_map(|pid| pid.parse().ok())
        .collect())
}

/// Opens a namespace handle, to enter it later with [`enter`].
pub fn open(netns: &str) -> Result<OwnedFd, Error> {
    File::open(path(netns))
        .map(OwnedFd::from)
        .map_err(|e| Error::io(format!("opening netns {netns}"), e))
}

/// Moves the calling thread into the namespace. Only that thread moves; in a freshly
/// forked child (`pre_exec`) it is the whole process. Async-signal-safe.
pub fn enter(fd: &OwnedFd) -> std::io::Result<()> {
    // SAFETY: setns on a valid namespace fd only changes this thread's network namespace.
    if unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Runs `f` on a thread that entered the namespace; sockets it opens and processes it
/// starts are in it.
pub fn in_netns<T: Send>(netns: &str, f: impl FnOnce() -> T + Send) -> Result<T, Error> {
    let fd = open(netns)?;
    std::thread::scope(|s| {
        s.spawn(|| {
            enter(&fd).map_err(|e| Error::io(format!("entering netns {netns}"), e))?;
            Ok(f())
        })
        .join()
        .map_err(|_| Error::Panicked(netns.to_string()))?
    })
}

/// Writes a sysctl inside a namespace (/proc/sys/net follows the writing thread's
/// namespace).
pub fn sysctl(netns: &str, key: &str, value: &str) -> Result<(), Error> {
    let path = PathBuf::from("/proc/sys").join(key.replace('.', "/"));
    in_netns(netns, || std::fs::write(&path, value))?
        .map_err(|e| Error::io(format!("{netns}: writing {}", path.display()), e))
}

/// Makes `command` start inside the namespace (only its network namespace changes).
pub fn command(netns: &str, command: &mut Command) -> Result<(), Error> {
    let fd = open(netns)?;
    // SAFETY: between fork and exec the child only calls setns, an async-signal-safe
    // system call.
    unsafe {
        command.pre_exec(move || enter(&fd));
    }
    Ok(())
}

/// A named network namespace, deleted (with every interface in it) when dropped if it was
/// created here.
#[derive(Debug)]
pub struct Netns {
    name: String,
    /// Deleted on drop: created here, not borrowed from another owner.
    owned: bool,
}

impl Netns {
    /// Creates `name` with its loopback up.
    pub fn create(name: impl Into<String>) -> Result<Self, Error> {
        let ns = Netns {
            name: name.into(),
            owned: true,
        };
        ip(&["netns", "add", &ns.name])?;
        // From here on a failure drops `ns`, which deletes the namespace.
        ip(&["-n", &ns.name, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// A namespace someone else created and deletes.
    pub fn attach(name: impl Into<String>) -> Self {
        Netns {
            name: name.into(),
            owned: false,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `f` on a thread that entered this namespace.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T, Error> {
        in_netns(&self.name, f)
    }

    /// Makes `command` start inside this namespace.
    pub fn command(&self, command: &mut Command) -> Result<(), Error> {
        self::command(&self.name, command)
    }

    /// Writes a sysctl of this namespace.
    pub fn sysctl(&self, key: &str, value: &str) -> Result<(), Error> {
        sysctl(&self.name, key, value)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        if let Err(e) = delete(&self.name) {
            eprintln!("netns: cleanup: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_ip_is_an_error_quoting_it() {
        let name = format!("weir-netns-absent-{}", std::process::id());
        match ip(&["netns", "delete", &name]) {
            Err(Error::Failed { command, stderr }) => {
                assert_eq!(command, format!("netns delete {name}"));
                assert!(!stderr.is_empty());
            }
            other => panic!("expected a failure quoting ip's stderr, got {other:?}"),
        }
    }

    #[test]
    fn an_attached_namespace_is_not_deleted() {
        // Dropping it runs no `ip` at all, so this passes without root.
        let ns = Netns::attach("weir-netns-never-created");
        assert_eq!(ns.name(), "weir-netns-never-created");
        assert!(!exists(ns.name()));
    }
}
