//! `cargo xtask demo`: builds weir and weir-lab and runs the lab on the default example,
//! printing the reachability matrix that the dataplane enforces with real packets.
//! `--seed-incident`: the incident weir was written for, on a real Azure NPM.
use anyhow::{bail, Context, Result};

use crate::cmd::{cargo, exec, workspace_root};

/// The NPM releases the seed incident runs: the crash loop, its fix, the newest.
pub const SEED_INCIDENT_NPM: &[&str] = &[
    "azure-npm@v1.5.36",
    "azure-npm@v1.5.37",
    "azure-npm@v1.8.12",
];

/// `cargo xtask demo --seed-incident`: NPM v1.5.36 crash-looping on 16 leaked set
/// references, v1.5.37 and v1.8.12 surviving them on the same node, and weir taking the
/// node over while the pods probe: the integration test tests/tests/npm_seed_incident.rs
/// in its full form (`cargo xtask test` runs the short one), printing as it goes; then
/// the migration off a running v1.8.12 with 100 policies, onto eBPF, then iptables.
pub fn seed_incident() -> Result<()> {
    if !crate::cmd::is_root() {
        bail!("the seed incident builds network namespaces, runs NPM and loads BPF programs: run it as root");
    }
    crate::peers::ensure(Some(SEED_INCIDENT_NPM)).context("building Azure NPM")?;
    crate::build::run(false)?;
    exec(cargo().env("WEIR_SEED_INCIDENT_FULL", "1").args([
        "test",
        "--package",
        "weir-tests",
        // The migration off a running v1.8.12 too.
        "--features",
        "npm-migration",
        "--test",
        "npm_seed_incident",
        "--",
        "--nocapture",
        "--test-threads=1",
    ]))
    .context("the seed incident")
}

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
