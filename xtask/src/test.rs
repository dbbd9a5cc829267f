//! `cargo xtask test`, the CI command: formatting, clippy with warnings as errors, unit
//! tests, then the integration tests against the real kernel, the quick groups on Debian's
//! 5.10 kernel in a virtme-ng guest, then the fuzz smoke runs and the quick bench.
//! It ends with one line naming what ran. An ignored test fails the run: nothing may pass
//! by skipping, and so does a test that leaves or removes weir state on the host
//! (`host_guard`).
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::cmd::{cargo, exec as run_cmd, is_root, workspace_root};

/// Seconds each fuzz target runs in the smoke run.
const FUZZ_SMOKE_SECONDS: u32 = 15;

#[derive(Default)]
struct Tally {
    passed: usize,
    failed: Vec<String>,
    ignored: Vec<String>,
    binaries: Vec<String>,
}

pub fn run() -> Result<()> {
    let started = Instant::now();
    crate::setup::ensure()?;
    step("formatting");
    run_cmd(cargo().args(["fmt", "--all", "--check"]))?;
    run_cmd(cargo().args([
        "fmt",
        "--manifest-path",
        "ebpf/weir-ebpf/Cargo.toml",
        "--check",
    ]))?;
    step("clippy");
    run_cmd(cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;

    step("structure");
    crate::structure::run()?;

    step("unit tests");
    let unit = cargo_test(&["--workspace", "--no-fail-fast", "--lib", "--bins"])?;

    step("integration tests (real kernel)");
    check_kernel_prerequisites()?;
    // The integration tests drive the real binary, and run it from its image too.
    run_cmd(cargo().args(["build", "--package", "weir", "--bins"]))?;
    crate::image::for_tests().context("building the image the tests run the agent from")?;
    let host_before = crate::host_guard::snapshot()?;
    let integration = cargo_test(&["--workspace", "--no-fail-fast", "--test", "*"])?;
    let host_guard = crate::host_guard::snapshot().and_then(|after| {
        crate::host_guard::check_unchanged(&host_before, &after, "the integration tests")
    });

    // The kernel floor: the quick groups in a Debian 5.10 guest (issue 17).
    step("kernels (quick: Debian 5.10 under virtme-ng)");
    let kernels = crate::kernels::run(&["5.10".to_string()], true, &[]);

    step("fuzz smoke");
    let fuzzed = fuzz_smoke()?;

    // The bench cannot rot: its quick run measures every scenario on the real kernel.
    step("bench (quick)");
    let bench = crate::bench::run(true);
    let bench_host_guard = crate::host_guard::snapshot().and_then(|after| {
        crate::host_guard::check_unchanged(&host_before, &after, "the quick bench")
    });

    for (name, t) in [("unit", &unit), ("integration", &integration)] {
        if !t.failed.is_empty() {
            bail!("{name} tests failed: {}", t.failed.join(", "));
        }
        if !t.ignored.is_empty() {
            bail!(
                "{name} tests were ignored (nothing may pass by skipping): {}",
                t.ignored.join(", ")
            );
        }
    }
    host_guard?;
    bench_host_guard?;
    kernels.context("the quick kernel run on 5.10 failed")?;
    bench.context("the quick bench failed")?;
    println!(
        "xtask test: PASS in {}s: fmt, clippy, {} unit tests, {} integration tests in {} ({}), quick kernels on 5.10, fuzz smoke {}, quick bench",
        started.elapsed().as_secs(),
        unit.passed,
        integration.passed,
        integration.binaries.len(),
        integration.binaries.join(" "),
        if fuzzed.is_empty() { "none".to_string() } else { fuzzed.join(" ") },
    );
    Ok(())
}

fn step(name: &str) {
    println!("\n==> xtask test: {name}");
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
    let line = line.trim();
    if let Some(rest) = line.strip_prefix("Running ") {
        // "Running tests/foo.rs (target/...)" or "Running unittests src/lib.rs (target/...)"
        let rest = rest.strip_prefix("unittests ").unwrap_or(rest);
        if let Some(src) = rest.split_whitespace().next() {
            tally.binaries.push(src.to_string());
        }
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

/// Runs every cargo-fuzz target briefly so the fuzz harnesses cannot rot.
fn fuzz_smoke() -> Result<Vec<String>> {
    let fuzz_dir = workspace_root().join("agent/fuzz");
    if !fuzz_dir.is_dir() {
        return Ok(Vec::new());
    }
    let list = Command::new("cargo")
        .current_dir(workspace_root().join("agent"))
        .args(["fuzz", "list"])
        .output()
        .context("cannot run `cargo fuzz list` (cargo-fuzz is installed by `cargo xtask setup`)")?;
    let targets: Vec<String> = String::from_utf8_lossy(&list.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    for t in &targets {
        // Stable rustc with RUSTC_BOOTSTRAP: no nightly toolchain can be fetched here.
        run_cmd(
            Command::new("cargo")
                .current_dir(workspace_root().join("agent"))
                .env("RUSTC_BOOTSTRAP", "1")
                .args([
                    "fuzz",
                    "run",
                    // Unoptimized: the smoke run proves the harness builds and runs, and
                    // an optimized sanitizer build of every dependency costs minutes.
                    "--dev",
                    t,
                    "--",
                    &format!("-max_total_time={FUZZ_SMOKE_SECONDS}"),
                ]),
        )?;
    }
    Ok(targets)
}
