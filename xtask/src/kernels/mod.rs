//! `cargo xtask kernels`: the privileged integration tests and the lab's conformance
//! scenarios, on both dataplanes, on real kernels: Debian's 5.10 (bullseye) and 6.1
//! (bookworm) booted under virtme-ng with the host's userspace, and the host's own kernel.
//! Prints one table, test group × kernel, and writes target/kernels/latest.json.
//!
//! Nothing is built in a guest: the test binaries, `weir` and `weir-lab` are built on the
//! host, and the guest sees the host's filesystem read-only; each group's log and status go to
//! target/kernels/<kernel>/, which the guest can write.
//!
//! `--quick` (what `cargo xtask test` runs, on 5.10 in software emulation) runs the groups
//! marked quick: eBPF enforcement, a conformance subset on both dataplanes, and DNS through
//! kube-proxy's ipvs mode on eBPF.
mod debian;
mod groups;
mod guest;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::cmd::{cargo, exec, is_root, workspace_root};
use groups::Group;

/// How long one kernel's groups may take in all, quick and full (software emulation is
/// several times slower than the host).
const QUICK_TIMEOUT: Duration = Duration::from_secs(35 * 60);
const FULL_TIMEOUT: Duration = Duration::from_secs(5 * 3600);

#[derive(Clone, Debug, Serialize)]
struct GroupResult {
    group: String,
    passed: usize,
    failed: Vec<String>,
    ignored: usize,
    seconds: u64,
    /// Exit code of the test binary; `None` when it never finished.
    exit: Option<i32>,
    /// Why the group does not run on this kernel (one that boots with its own command
    /// line, on the host; a host-only one, in a guest).
    not_applicable: Option<&'static str>,
}

impl GroupResult {
    /// A group that cannot run on this kernel: `why` goes in the table.
    fn not_applicable(group: &str, why: &'static str) -> GroupResult {
        GroupResult {
            group: group.to_string(),
            passed: 0,
            failed: Vec::new(),
            ignored: 0,
            seconds: 0,
            exit: None,
            not_applicable: Some(why),
        }
    }

    fn ok(&self) -> bool {
        self.not_applicable.is_some()
            || (self.exit == Some(0)
                && self.failed.is_empty()
                && self.ignored == 0
                && self.passed > 0)
    }

    fn cell(&self) -> String {
        if let Some(why) = self.not_applicable {
            return format!("n/a: {why}");
        }
        match (self.ok(), self.exit) {
            (true, _) => format!("pass {} ({}s)", self.passed, self.seconds),
            (false, None) => "not finished".into(),
            (false, Some(_)) if self.ignored > 0 => format!("FAIL: {} ignored", self.ignored),
            (false, Some(_)) => format!(
                "FAIL {}/{} ({}s)",
                self.failed.len().max(1),
                self.passed + self.failed.len(),
                self.seconds
            ),
        }
    }
}

#[derive(Debug, Serialize)]
struct KernelRun {
    /// `5.10`, `6.1` or `host`.
    kernel: String,
    /// `uname -r` as the tests saw it.
    release: String,
    /// Where it ran: the host, KVM or software emulation.
    machine: String,
    seconds: u64,
    groups: Vec<GroupResult>,
    /// Why the run stopped early, if it did.
    error: Option<String>,
}

pub fn run(kernels: &[String], quick: bool, only: &[String], scenarios: &[String]) -> Result<()> {
    if !is_root() {
        bail!("kernels boots VMs and runs the privileged tests: run it as root");
    }
    let kernels: Vec<String> = if kernels.is_empty() {
        ["5.10", "6.1", "host"].map(String::from).to_vec()
    } else {
        kernels.to_vec()
    };
    for k in &kernels {
        if k != "host" && debian::series(k).is_none() {
            bail!("--kernel {k}: unknown; one of 5.10, 6.1, host");
        }
    }
    if let Some(p) = scenarios.iter().find(|p| p.contains(['\'', ','])) {
        bail!("--scenarios {p:?}: a prefix cannot hold a quote or a comma");
    }
    for name in only {
        if !groups::GROUPS.iter().any(|g| g.name == name) {
            bail!("--group {name}: no such group");
        }
    }
    let groups: Vec<&Group> = groups::GROUPS
        .iter()
        // A quick-only slice runs in the full matrix only when named.
        .filter(|g| {
            if quick {
                g.quick
            } else {
                !g.quick_only || !only.is_empty()
            }
        })
        .filter(|g| only.is_empty() || only.iter().any(|o| o == g.name))
        .collect();
    let binaries = build_tests()?;
    // The agent-from-its-image tests (dataplane_switch, agent_image) need it; the quick
    // groups do not.
    if !quick {
        crate::image::for_tests().context("building the image the tests run the agent from")?;
    }
    let started = Instant::now();
    let mut runs = Vec::new();
    for k in &kernels {
        let run = run_kernel(k, &groups, &binaries, quick, scenarios);
        println!("{}", table(std::slice::from_ref(&run), &groups));
        runs.push(run);
    }
    let text = table(&runs, &groups);
    println!(
        "\nkernels: {} in {}s\n{text}",
        if quick { "quick run" } else { "full matrix" },
        started.elapsed().as_secs()
    );
    let out = workspace_root().join("target/kernels/latest.json");
    fs::write(&out, serde_json::to_string_pretty(&runs)?)?;
    println!("kernels: results in {}", out.display());
    let failed: Vec<String> = runs
        .iter()
        .flat_map(|r| {
            let err = r.error.as_ref().map(|e| format!("{}: {e}", r.kernel));
            err.into_iter().chain(
                r.groups
                    .iter()
                    .filter(|g| !g.ok())
                    .map(move |g| format!("{} on {}: {}", g.group, r.kernel, g.cell())),
            )
        })
        .collect();
    if !failed.is_empty() {
        bail!("kernels: {}", failed.join("; "));
    }
    Ok(())
}

/// Builds `weir`, `weir-lab` and every integration test binary on the host, and copies them
/// into target/kernels/bin (a build during a long guest run must not replace what the guest
/// runs); returns the copies by test target name, and `weir` and `weir-lab` under their own
/// names. The tests find `weir-lab` beside `WEIR_BIN`'s `weir`.
fn build_tests() -> Result<BTreeMap<String, PathBuf>> {
    exec(cargo().args([
        "build",
        "--package",
        "weir",
        "--package",
        "weir-lab",
        "--bins",
    ]))?;
    let out = cargo()
        .args([
            "test",
            "--package",
            "weir-tests",
            "--tests",
            "--no-run",
            "--message-format=json",
        ])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("cargo test --no-run")?;
    if !out.status.success() {
        bail!("building the integration tests failed");
    }
    let mut found = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] == "compiler-artifact" && msg["target"]["kind"][0] == "test" {
            if let (Some(name), Some(exe)) =
                (msg["target"]["name"].as_str(), msg["executable"].as_str())
            {
                found.insert(name.to_string(), PathBuf::from(exe));
            }
        }
    }
    for g in groups::GROUPS {
        if !found.contains_key(g.test) {
            bail!("group {}: no integration test binary {}", g.name, g.test);
        }
    }
    found.insert("weir".into(), workspace_root().join("target/debug/weir"));
    found.insert(
        "weir-lab".into(),
        workspace_root().join("target/debug/weir-lab"),
    );
    let bin = workspace_root().join("target/kernels/bin");
    let _ = fs::remove_dir_all(&bin);
    fs::create_dir_all(&bin)?;
    for (name, path) in found.iter_mut() {
        let copy = bin.join(name);
        fs::copy(&*path, &copy).with_context(|| format!("copy {}", path.display()))?;
        *path = copy;
    }
    Ok(found)
}

fn run_kernel(
    kernel: &str,
    groups: &[&Group],
    binaries: &BTreeMap<String, PathBuf>,
    quick: bool,
    scenarios: &[String],
) -> KernelRun {
    let started = Instant::now();
    let mut run = KernelRun {
        kernel: kernel.to_string(),
        release: String::new(),
        machine: String::new(),
        seconds: 0,
        groups: Vec::new(),
        error: None,
    };
    if let Err(e) = run_kernel_inner(kernel, groups, binaries, quick, scenarios, &mut run) {
        run.error = Some(format!("{e:#}"));
    }
    run.seconds = started.elapsed().as_secs();
    run
}

fn run_kernel_inner(
    kernel: &str,
    groups: &[&Group],
    binaries: &BTreeMap<String, PathBuf>,
    quick: bool,
    scenarios: &[String],
    run: &mut KernelRun,
) -> Result<()> {
    let dir = workspace_root().join("target/kernels").join(kernel);
    let results = dir.join("results");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&results)?;
    let timeout = if quick { QUICK_TIMEOUT } else { FULL_TIMEOUT };
    println!("\n==> kernels: {kernel}: {} groups", groups.len());
    let mut problems = Vec::new();
    if kernel == "host" {
        run.machine = "host".into();
        // The host cannot be booted with another command line.
        let (here, elsewhere): (Vec<&Group>, Vec<&Group>) = groups
            .iter()
            .partition(|g| g.boot_append.is_none() && g.guests_only.is_none());
        let script = dir.join("run.sh");
        fs::write(
            &script,
            groups::script(&here, binaries, &results, "done", false, scenarios),
        )?;
        let status = Command::new("sh")
            .arg(&script)
            .status()
            .context("sh run.sh")?;
        if status.code().is_none() || !results.join("done").exists() {
            problems.push(format!("the script did not finish ({status})"));
        }
        run.groups = here.iter().map(|g| collect(g, &results)).collect();
        run.groups.extend(elsewhere.iter().map(|g| {
            let why = g
                .guests_only
                .unwrap_or("needs a guest booted with its command line");
            GroupResult::not_applicable(g.name, why)
        }));
    } else {
        let series = debian::series(kernel).expect("checked");
        let release = debian::ensure(series)?;
        let accel = guest::probe_accel(&release, &dir.join("kvm-probe.log"))?;
        run.machine = accel.to_string();
        let slow = accel == guest::Accel::Tcg;
        // One boot per kernel command line, the plain one first.
        let (groups, host_only): (Vec<&Group>, Vec<&Group>) =
            groups.iter().partition(|g| g.host_only.is_none());
        let mut appends: Vec<Option<&str>> = groups.iter().map(|g| g.boot_append).collect();
        appends.sort();
        appends.dedup();
        for (i, append) in appends.into_iter().enumerate() {
            let these: Vec<&Group> = groups
                .iter()
                .filter(|g| g.boot_append == append)
                .copied()
                .collect();
            let done = format!("done-{i}");
            let script = dir.join(format!("run-{i}.sh"));
            let console = dir.join(format!("console-{i}.log"));
            fs::write(
                &script,
                groups::script(&these, binaries, &results, &done, slow, scenarios),
            )?;
            println!(
                "kernels: booting {release} ({accel}{}); console in {}",
                append.map(|a| format!(", {a}")).unwrap_or_default(),
                console.display()
            );
            let finished = guest::boot_and_run(
                &release, accel, append, &script, &results, &console, timeout,
            )?;
            if !finished {
                problems.push(format!("boot {i} timed out after {}s", timeout.as_secs()));
            } else if !results.join(&done).exists() {
                problems.push(format!(
                    "boot {i}: the script did not finish (see {})",
                    console.display()
                ));
            }
        }
        run.groups = groups.iter().map(|g| collect(g, &results)).collect();
        run.groups.extend(
            host_only
                .iter()
                .map(|g| GroupResult::not_applicable(g.name, "host only")),
        );
    }
    run.release = fs::read_to_string(results.join("release"))
        .unwrap_or_default()
        .trim()
        .to_string();
    if !problems.is_empty() {
        bail!("{}", problems.join("; "));
    }
    Ok(())
}

/// A group's outcome from its log (libtest's per-test lines) and status file.
fn collect(group: &Group, results: &Path) -> GroupResult {
    let log = fs::read_to_string(results.join(format!("{}.log", group.name))).unwrap_or_default();
    let status =
        fs::read_to_string(results.join(format!("{}.status", group.name))).unwrap_or_default();
    let mut fields = status.split_whitespace();
    let exit = fields.next().and_then(|s| s.parse().ok());
    let seconds = fields.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let mut r = GroupResult {
        group: group.name.to_string(),
        passed: 0,
        failed: Vec::new(),
        ignored: 0,
        seconds,
        exit,
        not_applicable: None,
    };
    for line in log.lines() {
        let Some(rest) = line.trim().strip_prefix("test ") else {
            continue;
        };
        let Some((name, verdict)) = rest.rsplit_once(" ... ") else {
            continue;
        };
        match verdict {
            "ok" => r.passed += 1,
            "FAILED" => r.failed.push(name.to_string()),
            v if v.starts_with("ignored") => r.ignored += 1,
            _ => {}
        }
    }
    r
}

fn table(runs: &[KernelRun], groups: &[&Group]) -> String {
    let head: Vec<String> = runs
        .iter()
        .map(|r| {
            format!(
                "{} {} ({}, {}s)",
                r.kernel,
                if r.release.is_empty() {
                    "?"
                } else {
                    &r.release
                },
                r.machine,
                r.seconds
            )
        })
        .collect();
    let width = groups
        .iter()
        .map(|g| g.name.len())
        .max()
        .unwrap_or(5)
        .max(5);
    let mut t = format!("{:width$}", "group");
    for h in &head {
        write!(t, " | {h}").unwrap();
    }
    t.push('\n');
    for g in groups {
        write!(t, "{:width$}", g.name).unwrap();
        for (r, h) in runs.iter().zip(&head) {
            let cell = r
                .groups
                .iter()
                .find(|x| x.group == g.name)
                .map_or_else(|| "-".to_string(), GroupResult::cell);
            write!(t, " | {cell:w$}", w = h.len()).unwrap();
        }
        t.push('\n');
    }
    for r in runs {
        if let Some(e) = &r.error {
            writeln!(t, "{}: {e}", r.kernel).unwrap();
        }
    }
    t
}
