//! `cargo xtask demo`: builds weir and weir-lab and runs the lab on the default example,
//! printing the reachability matrix that the dataplane enforces with real packets.
use anyhow::{bail, Result};

use crate::cmd::{exec, workspace_root};

pub const DEMO_MANIFEST: &str = "deploy/examples/demo.yaml";

pub fn run(dataplane: &str) -> Result<()> {
    if !crate::cmd::is_root() {
        bail!("the demo builds network namespaces and loads BPF programs: run it as root");
    }
    crate::build::run(false)?;
    let root = workspace_root();
    let state = std::env::temp_dir().join(format!("weir-demo-{}", std::process::id()));
    exec(
        std::process::Command::new(root.join("target/debug/weir-lab"))
            .current_dir(&root)
            .arg("--weir-bin")
            .arg(root.join("target/debug/weir"))
            .arg("--state-dir")
            .arg(&state)
            .args(["run", "--dataplane", dataplane, DEMO_MANIFEST]),
    )
}
