//! `cargo xtask bench [--quick] [--peers | --cluster]`: builds the binaries the bench measures and the
//! bench itself (bench/, `weir-bench`), then runs it with the paths and flags that make its
//! run this one; the JSON goes where it always went (target/bench/latest.json, or
//! peers.json).
use std::process::Command;

use anyhow::{Context, Result};

use crate::cmd::{cargo, exec, workspace_root};

/// `--peers` and how its world and limits differ from the full bench's (None: as
/// weir-bench's defaults).
pub struct PeerRun {
    pub change_limit: Option<u64>,
    pub policies: Option<usize>,
    pub remote_pods: Option<usize>,
    pub changes: Option<usize>,
}

pub fn run(quick: bool, peer_run: Option<PeerRun>) -> Result<()> {
    let peers = peer_run.is_some();
    // The full bench measures the release build; the quick run, inside `cargo xtask test`,
    // the debug build that the tests use.
    let profile = if quick { "debug" } else { "release" };
    crate::build::run(!quick)?;
    // The bench's own code times request/response round trips: built as xtask was when
    // the bench lived there (debug), so its figures stay comparable with earlier runs.
    exec(cargo().args(["build", "--package", "weir-bench", "--bin", "weir-bench"]))?;
    let root = workspace_root();
    let bins = root.join("target").join(profile);
    let mut command = format!(
        "cargo xtask bench{}{}",
        if quick { " --quick" } else { "" },
        if peers { " --peers" } else { "" }
    );
    // The options given, for weir-bench and as the report records the command.
    let mut peer_options = Vec::new();
    if let Some(p) = &peer_run {
        for (flag, value) in [
            ("--peer-change-limit", p.change_limit.map(|v| v as usize)),
            ("--peer-policies", p.policies),
            ("--peer-remote-pods", p.remote_pods),
            ("--peer-changes", p.changes),
        ] {
            if let Some(v) = value {
                peer_options.push(format!("{flag}={v}"));
            }
        }
    }
    for option in &peer_options {
        command.push(' ');
        command.push_str(option);
    }
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
        // Each peer's default version (its first line in deploy/peer-versions).
        let default = |name: &str| -> Result<crate::peers::Peer> {
            crate::peers::pinned()?
                .into_iter()
                .find(|p| p.name == name)
                .with_context(|| format!("deploy/peer-versions pins no {name}"))
        };
        let (kube_router, npm) = (default("kube-router")?, default("azure-npm")?);
        let wanted = [
            format!("kube-router@{}", kube_router.version),
            format!("azure-npm@{}", npm.version),
        ];
        crate::peers::ensure(Some(&[&wanted[0], &wanted[1]]))?;
        let versions = [&kube_router, &npm]
            .iter()
            .map(|p| format!("{} {}", p.name, p.version))
            .collect::<Vec<_>>()
            .join(", ");
        bench
            .arg("--peers")
            .arg("--kube-router")
            .arg(kube_router.binary())
            .arg("--azure-npm")
            .arg(npm.binary())
            .args(["--peer-versions", &versions])
            .args(&peer_options);
        for flag in crate::peers::kube_router_flags()? {
            bench.arg(format!("--kube-router-arg={flag}"));
        }
    }
    exec(&mut bench).context("the bench")
}

/// `--cluster` and how its sweep differs from weir-bench's defaults (None: as them, or
/// the smoke run's with --quick).
pub struct ClusterRun {
    pub agents: Option<String>,
    pub pods: Option<usize>,
    pub changes: Option<usize>,
    /// The size sweep's pod counts, comma-separated ("": none).
    pub pod_sweep: Option<String>,
}

/// The size sweep's pod counts of a full run, at the largest N.
const POD_SWEEP: &str = "20000,100000,150000";

/// `cargo xtask bench --cluster`: the release build's agents (their CPU and memory are the
/// figures), or with --quick the debug build's, at a smoke run's size.
pub fn cluster(quick: bool, run: &ClusterRun) -> Result<()> {
    let profile = if quick { "debug" } else { "release" };
    crate::build::run(!quick)?;
    exec(cargo().args(["build", "--package", "weir-bench", "--bin", "weir-bench"]))?;
    let root = workspace_root();
    let bins = root.join("target").join(profile);
    let smoke = |v: &str| quick.then(|| v.to_string());
    let pod_sweep = match (&run.pod_sweep, quick) {
        (Some(p), _) => p.clone(),
        (None, true) => "250,1000".into(),
        (None, false) => POD_SWEEP.into(),
    };
    let options: Vec<String> = [
        (
            "--cluster-agents",
            run.agents.clone().or_else(|| smoke("1,2")),
        ),
        (
            "--cluster-pods",
            run.pods.map(|p| p.to_string()).or_else(|| smoke("500")),
        ),
        ("--cluster-policies", smoke("50")),
        ("--cluster-rate-changes", smoke("8")),
        (
            "--cluster-changes",
            run.changes.map(|c| c.to_string()).or_else(|| smoke("3")),
        ),
    ]
    .into_iter()
    .filter_map(|(flag, value)| Some(format!("{flag}={}", value?)))
    .collect();
    let sweep = (!pod_sweep.is_empty()).then(|| format!("--cluster-pod-sweep={pod_sweep}"));
    let mut command = format!(
        "cargo xtask bench --cluster{}",
        if quick { " --quick" } else { "" }
    );
    let given_sweep = run.pod_sweep.as_ref().map(|_| match &sweep {
        Some(s) => s.clone(),
        None => "--cluster-pod-sweep=".into(),
    });
    for option in options
        .iter()
        .filter(|o| {
            !o.starts_with("--cluster-policies") && !o.starts_with("--cluster-rate-changes")
        })
        .chain(&given_sweep)
    {
        command.push(' ');
        command.push_str(option);
    }
    let mut bench = Command::new(root.join("target/debug/weir-bench"));
    bench
        .arg("--weir")
        .arg(bins.join("weir"))
        .arg("--lab")
        .arg(bins.join("weir-lab"))
        .arg("--run-dir")
        .arg(root.join("target/bench/run"))
        .arg("--out")
        .arg(root.join("target/bench/cluster.json"))
        .args(["--profile", profile, "--command", &command, "--cluster"])
        .arg("--cluster-streaming-lists")
        .arg("--cluster-json-pods")
        .arg("--cluster-relay")
        .args(&options)
        .args(&sweep);
    if quick {
        bench.arg("--quick");
    }
    exec(&mut bench).context("the cluster bench")
}
