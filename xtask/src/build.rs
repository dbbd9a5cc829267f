//! `cargo xtask build`: the eBPF object first (so its errors are shown on their own), then
//! the agent, whose build script embeds the object, and the lab (`weir-lab`), which runs
//! the agent's binary from beside it. Cargo rebuilds only what changed.
use anyhow::Result;

use crate::cmd::{cargo, exec, workspace_root};

pub fn run(release: bool) -> Result<()> {
    packages(&["weir", "weir-lab"], release)
}

/// The agent's binary alone: all the image holds.
pub fn agent(release: bool) -> Result<()> {
    packages(&["weir"], release)
}

fn packages(names: &[&str], release: bool) -> Result<()> {
    crate::setup::ensure()?;
    build_ebpf()?;
    let mut c = cargo();
    c.arg("build");
    for name in names {
        c.args(["--package", name]);
    }
    c.arg("--bins");
    if release {
        c.arg("--release");
    }
    exec(&mut c)
}

/// Builds ebpf/weir-ebpf with Debian's toolchain (its own workspace and config).
pub fn build_ebpf() -> Result<()> {
    let dir = workspace_root().join("ebpf/weir-ebpf");
    let mut c = std::process::Command::new("/usr/bin/cargo");
    c.current_dir(&dir).args(["build", "--release"]);
    for (key, _) in std::env::vars() {
        if key.starts_with("CARGO") || key.starts_with("RUSTC") || key == "RUSTFLAGS" {
            c.env_remove(key);
        }
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    c.env(
        "PATH",
        format!(
            "{home}/.cargo/bin:{}",
            std::env::var("PATH").unwrap_or_default()
        ),
    );
    exec(&mut c)
}
