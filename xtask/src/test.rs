//! `cargo xtask test`, the CI command: formatting, clippy with warnings as errors, unit
//! tests, then the integration tests against the real kernel, the quick groups on Debian's
//! 5.10 kernel in a virtme-ng guest, then the fuzz targets from their seeds, the quick
//! bench, and the field's suites' short subset on 2-node kubelet clusters (built beside the
//! integration tests: [`SubsetBuild`]).
//! It ends with one line naming what ran. An ignored test fails the run: nothing may pass
//! by skipping, and so does a test that leaves or removes weir state on the host
//! (`host_guard`).
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::cmd::{cargo, exec as run_cmd, is_root, workspace_root};

/// How CI fuzzes: each target 30 s from its seeds, unoptimized (an optimized sanitizer
/// build of the agent's dependency tree costs minutes that CI has not got: `cargo xtask
/// fuzz` is that run). The floor catches a target that explores nothing, not a slow
/// machine: on a loaded one (2026-12-04) manifest_compile ran 831 inputs in 30 s and
/// ebpf_encoding 98 (its floor is a fortieth), where a floor of 1,000 failed the run.
const CI_FUZZ: crate::fuzz::FuzzOptions = crate::fuzz::FuzzOptions {
    seconds: 30,
    optimized: false,
    min_runs: 250,
};

/// Free disk a run needs: a cold run's build directories peaked at 10.7 GiB (2026-12-03,
/// 8.2 GiB target/ and 2.3 GiB agent/fuzz/target/, line tables only), plus 30%, plus the
/// conformance subset's Go builds (the cluster's components, the suites' binaries and
/// their caches, about 4 GiB).
const COLD_RUN_DISK: u64 = 18 << 30;

/// The conformance subset's builds (kubelet, controller-manager, scheduler, containerd,
/// the e2e and network-policy-api suites: about a quarter of an hour of CPU on a fresh
/// machine), run as `cargo xtask conformance --ci-subset --build-only` in a child process
/// at the lowest CPU priority while the integration tests run: those mostly wait on the
/// kernel and the API server, and the builds take the CPU they leave. Its output goes to
/// a log (target/ci-subset-build.log), shown if it fails. Dropped before it ends (a step
/// failed), it kills the build's whole process group.
struct SubsetBuild {
    child: Option<std::process::Child>,
    log: PathBuf,
}

impl SubsetBuild {
    fn start() -> Result<SubsetBuild> {
        let log = workspace_root().join("target/ci-subset-build.log");
        let xtask = std::env::current_exe().context("finding xtask's own binary")?;
        let child = crate::cmd::spawn_logged(
            Command::new("nice")
                .args(["-n", "19"])
                .arg(xtask)
                .args(["conformance", "--ci-subset", "--build-only"])
                .current_dir(workspace_root()),
            &log,
        )
        .context("cannot start the conformance subset's build (nice, xtask)")?;
        println!(
            "xtask test: building the conformance subset's components in the background (pid {}, log {})",
            child.id(),
            log.display()
        );
        Ok(SubsetBuild {
            child: Some(child),
            log,
        })
    }

    /// Waits for the build; fails with its log's last lines if it failed.
    fn wait(mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let status = child
            .wait()
            .context("waiting for the conformance subset's build")?;
        if status.success() {
            return Ok(());
        }
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        for line in &lines[lines.len().saturating_sub(40)..] {
            eprintln!("  {line}");
        }
        bail!(
            "the conformance subset's build failed ({status}); its log: {}",
            self.log.display()
        )
    }
}

impl Drop for SubsetBuild {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            crate::cmd::kill_group(child);
        }
    }
}

/// Where a run builds: the workspace's target directory and the fuzz workspace's.
fn build_dirs() -> Vec<PathBuf> {
    let root = workspace_root();
    vec![root.join("target"), root.join("agent/fuzz/target")]
}

#[derive(Default)]
struct Tally {
    passed: usize,
    failed: Vec<String>,
    ignored: Vec<String>,
    /// Each test binary (its source), in the order cargo ran them.
    binaries: Vec<String>,
    /// Each binary's "test result:" line: passed, failed (same order as `binaries`).
    results: Vec<(usize, usize)>,
    /// What each failed test printed (libtest's `---- NAME stdout ----` section), so the
    /// end of the run can say why: CI keeps only the tail of a long log.
    failure_output: Vec<(String, Vec<String>)>,
    /// The failure section being read, if any.
    in_failure: Option<usize>,
}

/// At most this many lines of each failed test's output are printed again at the end.
const FAILURE_LINES: usize = 40;

impl Tally {
    /// Prints again what each failed test printed (its first [`FAILURE_LINES`] lines).
    fn print_failures(&self, kind: &str) {
        for (test, lines) in &self.failure_output {
            println!("\n{kind} test {test} failed; it printed:");
            let shown = lines.len().min(FAILURE_LINES);
            for line in &lines[..shown] {
                println!("  | {line}");
            }
            if lines.len() > shown {
                println!(
                    "  | … {} more lines above, in the test's output",
                    lines.len() - shown
                );
            }
        }
    }

    /// One line per binary with its count; fails when a binary ran no test, or when an
    /// integration test source (`*/tests/*.rs`) ran as no binary at all: a test file that
    /// stops compiling into the run, or loses its tests, must not pass unnoticed.
    fn check_every_binary_ran(&self, expected: &[String]) -> Result<()> {
        if self.binaries.len() != self.results.len() {
            bail!(
                "cargo ran {} test binaries but printed {} results",
                self.binaries.len(),
                self.results.len()
            );
        }
        let mut empty = Vec::new();
        for (binary, (passed, failed)) in self.binaries.iter().zip(&self.results) {
            println!("  {passed:>4} passed {failed:>3} failed  {binary}");
            if passed + failed == 0 && !FEATURE_GATED.contains(&binary.as_str()) {
                empty.push(binary.clone());
            }
        }
        let missing: Vec<&String> = expected
            .iter()
            .filter(|e| !self.binaries.iter().any(|b| b == *e))
            .collect();
        if !missing.is_empty() {
            bail!("test sources that ran as no binary: {missing:?}");
        }
        if !empty.is_empty() {
            bail!("test binaries that ran no test: {}", empty.join(", "));
        }
        Ok(())
    }
}

/// Test binaries that are empty without their cargo feature, and run by their own command:
/// the real-cluster test (feature `real-cluster`, `cargo xtask cluster`), whose components
/// `cargo xtask test` does not build. (A `required-features` target would make cargo refuse
/// `--test '*'` instead.)
const FEATURE_GATED: &[&str] = &["cluster/real_cluster.rs"];

/// Every integration test source of the workspace, as cargo names it when it runs one
/// (`tests/foo.rs`, relative to its package).
fn integration_sources() -> Result<Vec<String>> {
    let mut found = Vec::new();
    for package in ["agent", "netns", "policy", "tests"] {
        let dir = workspace_root().join(package).join("tests");
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?
        {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "rs") {
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                found.push(format!("tests/{name}"));
            }
        }
    }
    if found.is_empty() {
        bail!("no integration test sources found");
    }
    Ok(found)
}

pub fn run() -> Result<()> {
    let started = Instant::now();
    let mut steps = Steps::new(started);
    steps.start("setup");
    crate::setup::ensure()?;
    let build_dirs = build_dirs();
    let build_dirs: Vec<&Path> = build_dirs.iter().map(PathBuf::as_path).collect();
    crate::disk::check_room(&build_dirs, COLD_RUN_DISK, "a cold `cargo xtask test`")?;
    steps.start("formatting");
    run_cmd(cargo().args(["fmt", "--all", "--check"]))?;
    run_cmd(cargo().args([
        "fmt",
        "--manifest-path",
        "ebpf/weir-ebpf/Cargo.toml",
        "--check",
    ]))?;
    steps.start("clippy");
    run_cmd(cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;

    steps.start("structure");
    crate::structure::run()?;
    steps.start("results tables");
    crate::results::run(true)?;

    steps.start("unit tests");
    let unit = cargo_test(&["--workspace", "--no-fail-fast", "--lib", "--bins"])?;
    // Binaries without unit tests (main.rs files) print a result line of 0: not checked.

    steps.start("the binary and its image");
    check_kernel_prerequisites()?;
    // The integration tests drive the real binary, and run it from its image too.
    run_cmd(cargo().args([
        "build",
        "--package",
        "weir",
        "--package",
        "weir-lab",
        "--bins",
    ]))?;
    crate::image::for_tests().context("building the image the tests run the agent from")?;
    // The side-by-side conformance test runs kube-router (kube-network-policies needs the
    // nft queue the host kernel lacks: `cargo xtask peers` builds and runs every peer), the
    // seed incident's short form Azure NPM v1.5.36 (from its source archive).
    crate::peers::ensure(Some(&["kube-router", "azure-npm@v1.5.36"]))
        .context("building the peers the tests run")?;
    let subset_build = SubsetBuild::start()?;
    steps.start("integration tests (real kernel)");
    let host_before = crate::host_guard::snapshot()?;
    let conformance_table = workspace_root().join("target/conformance/latest.txt");
    let _ = std::fs::remove_file(&conformance_table);
    let integration = cargo_test(&["--workspace", "--no-fail-fast", "--test", "*"])?;
    let integration_counts = integration.check_every_binary_ran(&integration_sources()?);
    // What the conformance suite ran, by cell (dataplane, variant, IPv6 steps).
    let conformance = std::fs::read_to_string(&conformance_table).with_context(|| {
        format!(
            "the conformance suite left no table in {}",
            conformance_table.display()
        )
    });
    if let Ok(table) = &conformance {
        println!("{table}");
    }
    let host_guard = crate::host_guard::snapshot().and_then(|after| {
        crate::host_guard::check_unchanged(&host_before, &after, "the integration tests")
    });

    // The kernel floor: the quick groups in a Debian 5.10 guest (the kernel matrix).
    steps.start("kernels (quick: Debian 5.10 under virtme-ng)");
    let kernels = crate::kernels::run(&["5.10".to_string()], true, &[], &[]);

    steps.start("fuzz");
    let fuzzed = crate::fuzz::run(&CI_FUZZ)?;

    // The bench cannot rot: its quick run measures every scenario on the real kernel.
    steps.start("bench (quick)");
    let bench = crate::bench::run(true, None);
    let bench_host_guard = crate::host_guard::snapshot().and_then(|after| {
        crate::host_guard::check_unchanged(&host_before, &after, "the quick bench")
    });

    // The field's suites: a denying and an allowing e2e spec and one ClusterNetworkPolicy
    // conformance test, on both dataplanes, against weir as its DaemonSet.
    steps.start("conformance subset (2-node kubelet clusters)");
    let subset = subset_build
        .wait()
        .and_then(|()| crate::suites::ci_subset(false));
    let subset_host_guard = crate::host_guard::snapshot().and_then(|after| {
        crate::host_guard::check_unchanged(&host_before, &after, "the conformance subset")
    });

    steps.finish();
    for (name, t) in [("unit", &unit), ("integration", &integration)] {
        if !t.failed.is_empty() {
            t.print_failures(name);
            bail!("{name} tests failed: {}", t.failed.join(", "));
        }
        if !t.ignored.is_empty() {
            bail!(
                "{name} tests were ignored (nothing may pass by skipping): {}",
                t.ignored.join(", ")
            );
        }
    }
    integration_counts?;
    conformance?;
    host_guard?;
    bench_host_guard?;
    kernels.context("the quick kernel run on 5.10 failed")?;
    bench.context("the quick bench failed")?;
    subset.context("the conformance subset failed")?;
    subset_host_guard?;
    println!(
        "disk: the build directories hold {} after the run",
        crate::disk::gib(crate::disk::used_bytes(&build_dirs))
    );
    println!(
        "xtask test: PASS in {}s: fmt, clippy, {} unit tests, {} integration tests in {} ({}), quick kernels on 5.10, fuzz {}, quick bench, conformance subset",
        started.elapsed().as_secs(),
        unit.passed,
        integration.passed,
        integration.binaries.len(),
        integration.binaries.join(" "),
        fuzzed
            .iter()
            .map(|(t, runs)| format!("{t} ({runs} runs)"))
            .collect::<Vec<_>>()
            .join(" "),
    );
    Ok(())
}

/// The run's steps and how long each took: printed as each starts and as one line at the
/// end, so a slow CI run shows where its time went.
struct Steps {
    started: Instant,
    current: Option<(&'static str, Instant)>,
    done: Vec<(&'static str, u64)>,
}

impl Steps {
    fn new(started: Instant) -> Self {
        Steps {
            started,
            current: None,
            done: Vec::new(),
        }
    }

    fn start(&mut self, name: &'static str) {
        self.end_current();
        let at = self.started.elapsed().as_secs();
        println!("\n==> xtask test: {name} (at {at}s)");
        self.current = Some((name, Instant::now()));
    }

    fn end_current(&mut self) {
        if let Some((name, since)) = self.current.take() {
            self.done.push((name, since.elapsed().as_secs()));
        }
    }

    /// Ends the last step and prints every step's time.
    fn finish(&mut self) {
        self.end_current();
        let times: Vec<String> = self.done.iter().map(|(n, s)| format!("{n} {s}s")).collect();
        println!("\nxtask test: steps took: {}", times.join(", "));
    }
}

/// Runs `cargo test ARGS`, echoing its output and tallying the per-test result lines.
fn cargo_test(args: &[&str]) -> Result<Tally> {
    let mut child = cargo()
        .arg("test")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start cargo test")?;
    // Cargo names each test binary ("Running tests/foo.rs ...") on stderr.
    let stderr = child.stderr.take().expect("piped");
    let binaries = std::thread::spawn(move || {
        let mut found = Tally::default();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("{line}");
            tally_line(&mut found, &line);
        }
        found.binaries
    });
    let mut tally = Tally::default();
    let stdout = child.stdout.take().expect("piped");
    for line in BufReader::new(stdout).lines() {
        let line = line.context("reading cargo test output")?;
        println!("{line}");
        tally_line(&mut tally, &line);
    }
    let status = child.wait()?;
    tally.binaries = binaries.join().unwrap_or_default();
    if !status.success() && tally.failed.is_empty() {
        bail!("cargo test {} failed ({status})", args.join(" "));
    }
    Ok(tally)
}

fn tally_line(tally: &mut Tally, line: &str) {
    if let Some(name) = line
        .strip_prefix("---- ")
        .and_then(|l| l.strip_suffix(" stdout ----"))
    {
        tally.failure_output.push((name.to_string(), Vec::new()));
        tally.in_failure = Some(tally.failure_output.len() - 1);
        return;
    }
    if let Some(i) = tally.in_failure {
        // libtest ends the sections with a second "failures:" line listing the names.
        if line == "failures:" {
            tally.in_failure = None;
        } else {
            tally.failure_output[i].1.push(line.to_string());
            return;
        }
    }
    let line = line.trim();
    if let Some(rest) = line.strip_prefix("Running ") {
        // "Running tests/foo.rs (target/...)" or "Running unittests src/lib.rs (target/...)"
        let rest = rest.strip_prefix("unittests ").unwrap_or(rest);
        if let Some(src) = rest.split_whitespace().next() {
            tally.binaries.push(src.to_string());
        }
        return;
    }
    if let Some(rest) = line.strip_prefix("test result: ") {
        // "ok. 6 passed; 0 failed; 0 ignored; ..."
        let count = |word: &str| {
            rest.split(';')
                .find_map(|part| part.trim().rsplit_once(' ').filter(|(_, w)| *w == word))
                .and_then(|(n, _)| n.rsplit(' ').next()?.parse::<usize>().ok())
                .unwrap_or(0)
        };
        tally.results.push((count("passed"), count("failed")));
        return;
    }
    let Some(rest) = line.strip_prefix("test ") else {
        return;
    };
    let Some((name, verdict)) = rest.rsplit_once(" ... ") else {
        return;
    };
    match verdict {
        "ok" => tally.passed += 1,
        "FAILED" => tally.failed.push(name.to_string()),
        v if v.starts_with("ignored") => tally.ignored.push(name.to_string()),
        _ => {}
    }
}

/// The integration tests need these; say which one is missing instead of failing obscurely.
fn check_kernel_prerequisites() -> Result<()> {
    if !is_root() {
        bail!("integration tests need root (network namespaces, BPF, iptables): run `cargo xtask test` as root");
    }
    if !Path::new("/sys/fs/bpf").is_dir() {
        bail!("integration tests need /sys/fs/bpf (bpffs mount point) and it does not exist");
    }
    for tool in [
        "ip",
        "ipset",
        "iptables",
        "ip6tables",
        "iptables-legacy",
        "iptables-nft",
        "tc",
        "conntrack",
    ] {
        if Command::new(tool).arg("-V").output().is_err()
            && Command::new(tool).arg("--version").output().is_err()
        {
            bail!("integration tests need `{tool}` on PATH; run `cargo xtask setup`");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_pair_with_their_binaries_and_an_empty_binary_fails() {
        let mut t = Tally::default();
        for line in [
            "Running tests/a.rs (target/debug/deps/a-1)",
            "test x ... ok",
            "test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.1s",
            "Running tests/b.rs (target/debug/deps/b-1)",
            "test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.0s",
        ] {
            tally_line(&mut t, line);
        }
        assert_eq!(t.results, [(1, 0), (0, 0)]);
        assert_eq!(t.passed, 1);
        let err = t
            .check_every_binary_ran(&["tests/a.rs".into()])
            .unwrap_err();
        assert!(err.to_string().contains("tests/b.rs"), "{err}");
        let err = t
            .check_every_binary_ran(&["tests/a.rs".into(), "tests/c.rs".into()])
            .unwrap_err();
        assert!(err.to_string().contains("tests/c.rs"), "{err}");
        // The feature-gated harness may be empty; nothing else may.
        let mut gated = Tally::default();
        for line in [
            "Running tests/a.rs (target/debug/deps/a-1)",
            "test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.1s",
            "Running cluster/real_cluster.rs (target/debug/deps/real_cluster-1)",
            "test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.0s",
        ] {
            tally_line(&mut gated, line);
        }
        gated
            .check_every_binary_ran(&["tests/a.rs".into()])
            .expect("the real-cluster harness is empty without its feature");
    }

    #[test]
    fn a_failed_tests_output_is_kept_for_the_end_of_the_run() {
        let mut t = Tally::default();
        for line in [
            "test a ... FAILED",
            "test b ... ok",
            "",
            "failures:",
            "",
            "---- a stdout ----",
            "thread 'a' panicked at tests/x.rs:1:1:",
            "ebpf (ipv4, at first): x/a → y/b: got blocked",
            "",
            "failures:",
            "    a",
            "",
            "test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1s",
        ] {
            tally_line(&mut t, line);
        }
        assert_eq!(t.failed, ["a"]);
        assert_eq!(t.passed, 1);
        assert_eq!(t.results, [(1, 1)]);
        assert_eq!(t.failure_output.len(), 1);
        assert_eq!(t.failure_output[0].0, "a");
        assert_eq!(
            t.failure_output[0].1,
            [
                "thread 'a' panicked at tests/x.rs:1:1:",
                "ebpf (ipv4, at first): x/a → y/b: got blocked",
                ""
            ]
        );
    }

    #[test]
    fn libfuzzer_runs_are_read_from_its_closing_line() {
        let log = "#2342\tDONE   cov: 20466 ft: 47722\nDone 2342 runs in 21 second(s)\n";
        assert_eq!(crate::fuzz::libfuzzer_runs(log), Some(2342));
        assert_eq!(crate::fuzz::libfuzzer_runs("crashed"), None);
    }
}
