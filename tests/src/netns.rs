//! Named network namespaces for tests: unique names (tag + process id), commands run
//! inside with `ip netns exec`, deleted on drop even when the test fails.

use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{bail, Context, Result};

pub struct NetNs {
    pub name: String,
    /// Deleted on drop: created here, not borrowed from another owner.
    owned: bool,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

impl NetNs {
    /// Creates `wt-<tag>-<pid>-<n>`; fails naming the prerequisite when `ip` is missing.
    pub fn new(tag: &str) -> Result<NetNs> {
        let name = format!(
            "wt-{tag}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let out = Command::new("ip")
            .args(["netns", "add", &name])
            .output()
            .context(
                "prerequisite missing: `ip` (iproute2) must be installed and we must be root",
            )?;
        if !out.status.success() {
            bail!(
                "ip netns add {name} failed (root needed): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let ns = NetNs { name, owned: true };
        ns.sh("ip link set lo up")?;
        Ok(ns)
    }

    /// A namespace someone else created and deletes (a test world's node).
    pub fn attach(name: &str) -> NetNs {
        NetNs {
            name: name.to_string(),
            owned: false,
        }
    }

    /// Runs `program args...` inside the namespace, feeding `stdin`.
    pub fn run(&self, program: &str, args: &[&str], stdin: Option<&str>) -> Result<Output> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, program])
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().with_context(|| {
            format!(
                "prerequisite missing: cannot run {program} in {}",
                self.name
            )
        })?;
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            let text = text.to_string();
            std::thread::spawn(move || {
                use std::io::Write;
                let _ = pipe.write_all(text.as_bytes());
            });
        }
        Ok(child.wait_with_output()?)
    }

    /// Runs and requires success; returns stdout.
    pub fn ok(&self, program: &str, args: &[&str], stdin: Option<&str>) -> Result<String> {
        let out = self.run(program, args, stdin)?;
        if !out.status.success() {
            bail!(
                "in netns {}: {program} {} failed: {}",
                self.name,
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Runs a shell command line inside the namespace and requires success.
    pub fn sh(&self, script: &str) -> Result<String> {
        self.ok("sh", &["-c", script], None)
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}
