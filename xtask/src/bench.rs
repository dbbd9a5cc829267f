//! `cargo xtask bench [--quick] [--peers]`: builds the binaries the bench measures and the
//! bench itself (bench/, `weir-bench`), then runs it with the paths and flags that make its
//! run this one; the JSON goes where it always went (target/bench/latest.json, or
//! peers.json).
use std::process::Command;

use anyhow::{Context, Result};

use crate::cmd::{cargo, exec, workspace_root};

pub fn run(quick: bool, peers: bool) -> Result<()> {
    // The full bench measures the release build; the quick run, inside `cargo xtask test`,
    // the debug build that the tests use.
    let profile = if quick { "debug" } else { "release" };
    crate::build::run(!quick)?;
    // The bench's own code times request/response round trips: built as xtask was when
    // the bench lived there (debug), so its figures stay comparable with earlier runs.
    exec(cargo().args(["build", "--package", "weir-bench", "--bin", "weir-bench"]))?;
    let root = workspace_root();
    let bins = root.join("target").join(profile);
    let command = format!(
        "cargo xtask bench{}{}",
        if quick { " --quick" } else { "" },
        if peers { " --peers" } else { "" }
    );
    let mut bench = Command::new(root.join("target/debug/weir-bench"));
    bench
        .arg("--weir")
        .arg(bins.join("weir"))
        .arg("--lab")
        .arg(bins.join("weir-lab"))
        .arg("--run-dir")
        .arg(root.join("target/bench/run"))
        .arg("--out")
        .arg(root.join(match peers {
            true => "target/bench/peers.json",
            false => "target/bench/latest.json",
        }))
        .args(["--profile", profile, "--command", &command]);
    if quick {
        bench.arg("--quick");
    }
    if peers {
        let versions = crate::peers::pinned()?
            .iter()
            .map(|p| format!("{} {}", p.name, p.version))
            .collect::<Vec<_>>()
            .join(", ");
        let kube_router = crate::peers::ensure(Some(&["kube-router"]))?
            .pop()
            .context("deploy/peer-versions pins no kube-router")?;
        bench
            .arg("--peers")
            .arg("--kube-router")
            .arg(kube_router.binary())
            .args(["--peer-versions", &versions]);
        for flag in crate::peers::kube_router_flags()? {
            bench.arg(format!("--kube-router-arg={flag}"));
        }
    }
    exec(&mut bench).context("the bench")
}
