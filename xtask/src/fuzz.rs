//! `cargo xtask fuzz`: the cargo-fuzz targets in agent/fuzz, from their seeds and
//! dictionaries, with libFuzzer's execution counts checked. `cargo xtask test` runs them
//! briefly and unoptimized; this command's default is the optimized, longer run.
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::cmd::workspace_root;

#[derive(Clone, Copy)]
pub struct FuzzOptions {
    pub seconds: u32,
    /// cargo-fuzz's `-O` (release with debug assertions) rather than `--dev`.
    pub optimized: bool,
    pub min_runs: u64,
}

/// Runs every cargo-fuzz target from its checked-in seeds (`agent/fuzz/seeds/<target>/`,
/// read only; new inputs go to a scratch corpus under target/fuzz-corpus/, kept between
/// runs) with its dictionary (`agent/fuzz/<target>.dict`), for `seconds`. libFuzzer's own
/// count of executions is printed and must reach `min_runs`: a target that barely runs
/// explores nothing. A target without seeds or dictionary, or a failing `cargo fuzz list`,
/// fails the run. Returns each target with its executions.
pub fn run(options: &FuzzOptions) -> Result<Vec<(String, u64)>> {
    let FuzzOptions {
        seconds,
        optimized,
        min_runs,
    } = *options;
    let fuzz_dir = workspace_root().join("agent/fuzz");
    let list = Command::new("cargo")
        .current_dir(workspace_root().join("agent"))
        .args(["fuzz", "list"])
        .output()
        .context("cannot run `cargo fuzz list` (cargo-fuzz is installed by `cargo xtask setup`)")?;
    if !list.status.success() {
        bail!(
            "`cargo fuzz list` failed ({}): {}",
            list.status,
            String::from_utf8_lossy(&list.stderr).trim()
        );
    }
    let targets: Vec<String> = String::from_utf8_lossy(&list.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect();
    if targets.is_empty() {
        bail!(
            "`cargo fuzz list` listed no targets in {}",
            fuzz_dir.display()
        );
    }
    let mut ran = Vec::new();
    for t in &targets {
        let seeds = fuzz_dir.join("seeds").join(t);
        let dict = fuzz_dir.join(format!("{t}.dict"));
        let seed_count = std::fs::read_dir(&seeds).map(|d| d.count()).unwrap_or(0);
        if seed_count == 0 {
            bail!("fuzz target {t} has no seeds in {}", seeds.display());
        }
        if !dict.is_file() {
            bail!("fuzz target {t} has no dictionary at {}", dict.display());
        }
        let corpus = workspace_root().join("target/fuzz-corpus").join(t);
        std::fs::create_dir_all(&corpus)
            .with_context(|| format!("creating {}", corpus.display()))?;
        // Stable rustc with RUSTC_BOOTSTRAP: no nightly toolchain can be fetched here.
        let output = Command::new("cargo")
            .current_dir(workspace_root().join("agent"))
            .env("RUSTC_BOOTSTRAP", "1")
            .args(["fuzz", "run", if optimized { "-O" } else { "--dev" }, t])
            .arg(&corpus)
            .arg(&seeds)
            .arg("--")
            .arg(format!("-dict={}", dict.display()))
            .arg(format!("-max_total_time={seconds}"))
            .stdout(Stdio::inherit())
            .stderr(Stdio::piped())
            .output()
            .with_context(|| format!("cannot run `cargo fuzz run {t}`"))?;
        let log = String::from_utf8_lossy(&output.stderr);
        eprint!("{log}");
        if !output.status.success() {
            bail!(
                "fuzz target {t} failed ({}): see its output above",
                output.status
            );
        }
        let Some(runs) = libfuzzer_runs(&log) else {
            bail!("fuzz target {t}: libFuzzer printed no \"Done N runs\" line");
        };
        println!(
            "fuzz: {t}: {runs} executions in {seconds} s from {seed_count} seeds ({})",
            if optimized {
                "optimized"
            } else {
                "unoptimized"
            }
        );
        let floor = floor(t, min_runs);
        if runs < floor {
            bail!("fuzz target {t} ran {runs} inputs, fewer than {floor}: it explores nothing");
        }
        ran.push((t.clone(), runs));
    }
    Ok(ran)
}

/// The executions `target` must reach where the others must reach `min_runs`. Each input of
/// ebpf_encoding compiles a world of policies, plans its maps and decides 32 probes three
/// ways: unoptimized, 5 to 11 inputs a second (150 in CI's 30 s after the kernel guest,
/// 215 in 20 s on a quiet machine), against hundreds for the parsers. Its floor is a
/// fortieth, about one input a second.
fn floor(target: &str, min_runs: u64) -> u64 {
    match target {
        "ebpf_encoding" => min_runs / 40,
        _ => min_runs,
    }
}

/// The executions in libFuzzer's closing line, `Done 123456 runs in 30 second(s)`.
pub fn libfuzzer_runs(log: &str) -> Option<u64> {
    log.lines()
        .rev()
        .find_map(|l| l.split("Done ").nth(1)?.split(" runs").next()?.parse().ok())
}
