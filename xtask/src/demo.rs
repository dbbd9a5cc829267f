//! `cargo xtask demo`: builds weir and weir-lab and runs the lab on the default example,
//! printing the reachability matrix that the dataplane enforces with real packets.
//! `--seed-incident` and `--npm-migration`: the incident weir was written for, and the migration
//! off a running NPM, on a real Azure NPM.
use anyhow::{bail, Context, Result};

use crate::cmd::{cargo, exec, workspace_root};

/// The NPM demos: tests/tests/npm_seed_incident.rs, printing as they go.
#[derive(Clone, Copy)]
pub enum NpmDemo {
    /// `--seed-incident`: NPM v1.5.36 crash-looping on 16 leaked set references, v1.5.37
    /// and v1.8.12 surviving them on the same node, and weir taking the node over while
    /// the pods probe (`cargo xtask test` runs the short form).
    SeedIncident,
    /// `--npm-migration`: off a running v1.8.12 with 100 policies, onto eBPF, then
    /// iptables (the test behind the feature `npm-migration`).
    Migration,
}

impl NpmDemo {
    /// The NPM releases it runs.
    fn releases(self) -> &'static [&'static str] {
        match self {
            NpmDemo::SeedIncident => &[
                "azure-npm@v1.5.36",
                "azure-npm@v1.5.37",
                "azure-npm@v1.8.12",
            ],
            NpmDemo::Migration => &["azure-npm@v1.8.12"],
        }
    }
}

pub fn npm(demo: NpmDemo) -> Result<()> {
    if !crate::cmd::is_root() {
        bail!("the NPM demos build network namespaces, run NPM and load BPF programs: run them as root");
    }
    crate::peers::ensure(Some(demo.releases())).context("building Azure NPM")?;
    crate::build::run(false)?;
    let mut test = cargo();
    test.args(["test", "--package", "weir-tests"]);
    match demo {
        NpmDemo::SeedIncident => test.env("WEIR_SEED_INCIDENT_FULL", "1").args([
            "--test",
            "npm_seed_incident",
            "--",
            "--nocapture",
            "--exact",
            "npm_v1_5_36_crash_loops_on_16_leaked_references_and_weir_takes_the_node_over",
        ]),
        NpmDemo::Migration => test.args([
            "--features",
            "npm-migration",
            "--test",
            "npm_seed_incident",
            "--",
            "--nocapture",
            "migration::",
        ]),
    };
    exec(&mut test).context("the NPM demo")
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
