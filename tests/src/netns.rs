//! Named network namespaces for tests (weir-netns's): unique names (tag + process id),
//! commands run inside with `ip netns exec` (which also shows the namespace's own /sys)
//! under the agent's command timeout, deleted on drop even when the test fails.

use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{bail, Context, Result};
use weir::exec::ToolOutput;

pub struct NetNs {
    pub name: String,
    /// Deletes the namespace on drop when it was created here, not borrowed from another
    /// owner.
    _guard: weir_netns::Netns,
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
        let guard = weir_netns::Netns::create(name.clone()).with_context(|| {
            format!("creating netns {name} (prerequisites: root, and `ip` from iproute2)")
        })?;
        Ok(NetNs {
            name,
            _guard: guard,
        })
    }

    /// A namespace someone else created and deletes (a test world's node).
    pub fn attach(name: &str) -> NetNs {
        NetNs {
            name: name.to_string(),
            _guard: weir_netns::Netns::attach(name),
        }
    }

    /// Runs `program args...` inside the namespace, feeding `stdin`; killed (with what it
    /// started) after the agent's default command timeout.
    pub fn run(&self, program: &str, args: &[&str], stdin: Option<&str>) -> Result<ToolOutput> {
        let mut argv = vec!["netns", "exec", &self.name, program];
        argv.extend_from_slice(args);
        weir::exec::run("ip", &argv, stdin).with_context(|| {
            format!(
                "prerequisite missing: cannot run {program} in {}",
                self.name
            )
        })
    }

    /// Runs and requires success; returns stdout.
    pub fn ok(&self, program: &str, args: &[&str], stdin: Option<&str>) -> Result<String> {
        let out = self.run(program, args, stdin)?;
        if !out.success {
            bail!(
                "in netns {}: {program} {} failed: {}",
                self.name,
                args.join(" "),
                out.stderr
            );
        }
        Ok(out.stdout)
    }

    /// Runs a shell command line inside the namespace and requires success.
    pub fn sh(&self, script: &str) -> Result<String> {
        self.ok("sh", &["-c", script], None)
    }
}
