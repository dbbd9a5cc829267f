//! The reset scenario: a node namespace holding many weir sets, some of which cannot be
//! destroyed because rules and list:sets that weir does not own refer to them (to weir
//! these look exactly like leaked references), plus many WEIR-* chains. `weir reset` runs
//! there once; the rows give its time, its `ipset restore` runs and the outcome, checked
//! against what is left in the kernel.
use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::netns::Netns;
use super::report::Row;
use super::scale::Scale;

/// Members of a foreign list:set (list:set sizes are fixed at creation).
const LIST_SIZE: usize = 100;

pub fn scenario(scale: &Scale) -> String {
    format!(
        "reset, {} weir sets ({} undeletable), {} chains",
        scale.reset_sets, scale.reset_undeletable, scale.reset_chains
    )
}

pub fn rows(weir: &Path, scale: &Scale, scenario: &str) -> Vec<Row> {
    run(weir, scale, scenario)
        .unwrap_or_else(|e| vec![Row::failed(scenario, "-", "outcome", format!("{e:#}"))])
}

fn set_name(i: usize) -> String {
    format!("weir-bench-{i:05}")
}

fn run(weir: &Path, scale: &Scale, scenario: &str) -> Result<Vec<Row>> {
    let ns = Netns::create("reset")?;
    fill(&ns, scale)?;
    let bpf_root = format!("/sys/fs/bpf/weir-bench-reset-{}", std::process::id());
    let mut c = Command::new(weir);
    c.args(["reset", "--output", "json", "--bpf-root", &bpf_root]);
    ns.command(&mut c)?;
    let started = Instant::now();
    let out = c
        .output()
        .with_context(|| format!("starting {}", weir.display()))?;
    let wall = started.elapsed();
    let report: Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "weir reset printed no JSON report (exit {}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
    })?;

    let expected: BTreeSet<String> = (0..scale.reset_undeletable).map(set_name).collect();
    let left: BTreeSet<String> = weir_sets(&ns)?;
    let reported: BTreeSet<String> = report["undeletable_sets"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["name"].as_str().map(str::to_string))
        .collect();
    let chains_left = weir_chains(&ns)?;
    let mut problems = Vec::new();
    if !out.status.success() {
        problems.push(format!("exit {}", out.status));
    }
    if left != expected {
        problems.push(format!(
            "{} weir sets left, {} expected",
            left.len(),
            expected.len()
        ));
    }
    if reported != expected {
        problems.push(format!(
            "{} sets reported undeletable, {} expected",
            reported.len(),
            expected.len()
        ));
    }
    if chains_left > 0 {
        problems.push(format!("{chains_left} WEIR-* chains left"));
    }
    let outcome = if problems.is_empty() {
        "success".to_string()
    } else {
        format!("FAILED: {}", problems.join("; "))
    };
    let count = |key: &str| report[key].as_array().map_or(0, Vec::len) as f64;
    let number = |key: &str| report[key].as_f64().unwrap_or(f64::NAN);
    let s = scenario;
    Ok(vec![
        Row::text(s, "-", "outcome", &outcome),
        Row::number(
            s,
            "-",
            "wall time of `weir reset`",
            wall.as_secs_f64() * 1e3,
            "ms",
        ),
        Row::number(s, "-", "duration reported", number("duration_ms"), "ms"),
        Row::number(
            s,
            "-",
            "ipset restore runs",
            number("ipset_restore_runs"),
            "runs",
        ),
        Row::number(
            s,
            "-",
            "iptables-restore runs",
            number("iptables_restore_runs"),
            "runs",
        ),
        Row::number(s, "-", "sets destroyed", count("destroyed_sets"), "sets"),
        Row::number(
            s,
            "-",
            "sets reported undeletable",
            reported.len() as f64,
            "sets",
        ),
        Row::number(
            s,
            "-",
            "iptables items removed",
            count("removed_iptables"),
            "items",
        ),
    ])
}

/// Creates the sets (a few members each), the foreign references to the first
/// `reset_undeletable` of them (half from foreign list:sets, half from rules in a foreign
/// chain) and the WEIR-* chains, each with a rule matching a deletable set.
fn fill(ns: &Netns, scale: &Scale) -> Result<()> {
    let mut sets = String::new();
    for i in 0..scale.reset_sets {
        sets.push_str(&format!(
            "create {} hash:net family inet hashsize 64 maxelem 1024\n",
            set_name(i)
        ));
        for m in 0..4u32 {
            let ip = std::net::Ipv4Addr::from(0x0a_c8_00_00u32 + (i as u32) * 4 + m);
            sets.push_str(&format!("add {} {ip}\n", set_name(i)));
        }
    }
    let in_lists = scale.reset_undeletable / 2;
    for i in 0..in_lists {
        if i.is_multiple_of(LIST_SIZE) {
            sets.push_str(&format!(
                "create foreign-list-{} list:set size {LIST_SIZE}\n",
                i / LIST_SIZE
            ));
        }
        sets.push_str(&format!(
            "add foreign-list-{} {}\n",
            i / LIST_SIZE,
            set_name(i)
        ));
    }
    feed(ns, &["ipset", "restore"], &sets)?;

    let mut rules = String::from("*filter\n:FOREIGN-REFS - [0:0]\n");
    for c in 0..scale.reset_chains {
        rules.push_str(&format!(":WEIR-BENCH-{c:05} - [0:0]\n"));
    }
    for i in in_lists..scale.reset_undeletable {
        rules.push_str(&format!(
            "-A FOREIGN-REFS -m set --match-set {} src -j ACCEPT\n",
            set_name(i)
        ));
    }
    let deletable = scale.reset_sets - scale.reset_undeletable;
    for c in 0..scale.reset_chains {
        let set = set_name(scale.reset_undeletable + c % deletable);
        rules.push_str(&format!(
            "-A WEIR-BENCH-{c:05} -m set --match-set {set} src -j ACCEPT\n"
        ));
        if c < 10 {
            rules.push_str(&format!("-A FORWARD -j WEIR-BENCH-{c:05}\n"));
        }
    }
    rules.push_str("COMMIT\n");
    feed(ns, &["iptables-restore", "--noflush"], &rules)
}

fn feed(ns: &Netns, argv: &[&str], input: &str) -> Result<()> {
    let mut c = Command::new(argv[0]);
    c.args(&argv[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    ns.command(&mut c)?;
    let mut child = c.spawn().with_context(|| format!("starting {}", argv[0]))?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(input.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "{}: {}",
            argv.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn capture(ns: &Netns, argv: &[&str]) -> Result<String> {
    let mut c = Command::new(argv[0]);
    c.args(&argv[1..]);
    ns.command(&mut c)?;
    let out = c.output().with_context(|| format!("running {}", argv[0]))?;
    if !out.status.success() {
        bail!(
            "{}: {}",
            argv.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn weir_sets(ns: &Netns) -> Result<BTreeSet<String>> {
    Ok(capture(ns, &["ipset", "list", "-name"])?
        .lines()
        .map(str::trim)
        .filter(|n| n.starts_with("weir-"))
        .map(str::to_string)
        .collect())
}

/// WEIR-* chains left in either iptables backend.
fn weir_chains(ns: &Netns) -> Result<usize> {
    let mut n = 0;
    for save in ["iptables-nft-save", "iptables-legacy-save"] {
        n += capture(ns, &[save])?
            .lines()
            .filter(|l| l.starts_with(":WEIR-"))
            .count();
    }
    Ok(n)
}
