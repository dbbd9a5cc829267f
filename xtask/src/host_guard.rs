//! The host's own weir state, before and after the tests that run on the real kernel.
//! Every test works in its own network namespaces and pin roots, so anything of weir's
//! (or Azure NPM's) that differs afterwards in the host's network namespace or bpffs was
//! made, left behind or removed by a test: the run fails and names it. Read-only: the
//! guard lists, it never changes the host.
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

/// What is weir's or Azure NPM's in a chain, rule or set listing.
const MARKERS: &[&str] = &["WEIR", "weir-", "weir_", "AZURE-NPM", "azure-npm-"];

/// The iptables dumps read, legacy and nft, both families.
const SAVES: &[&str] = &[
    "iptables-legacy-save",
    "ip6tables-legacy-save",
    "iptables-nft-save",
    "ip6tables-nft-save",
];

/// One line per thing of weir's on the host: pins, chains and rules, sets.
#[derive(Debug, PartialEq, Eq)]
pub struct HostState(BTreeSet<String>);

pub fn snapshot() -> Result<HostState> {
    let mut lines = BTreeSet::new();
    pins(Path::new("/sys/fs/bpf"), 0, &mut lines)?;
    for save in SAVES {
        for line in tool_lines(save, &[])? {
            // Counters change with traffic; the rule is what matters.
            let rule = line.split(" [").next().unwrap_or(&line).to_owned();
            if !rule.starts_with('#') && MARKERS.iter().any(|m| rule.contains(m)) {
                lines.insert(format!("{save}: {rule}"));
            }
        }
    }
    for name in tool_lines("ipset", &["list", "-n"])? {
        if MARKERS.iter().any(|m| name.starts_with(m)) {
            lines.insert(format!("ipset: {name}"));
        }
    }
    Ok(HostState(lines))
}

/// Fails naming every difference, as what tests added or removed on the host.
pub fn check_unchanged(before: &HostState, after: &HostState, during: &str) -> Result<()> {
    let added: Vec<&String> = after.0.difference(&before.0).collect();
    let removed: Vec<&String> = before.0.difference(&after.0).collect();
    if added.is_empty() && removed.is_empty() {
        println!(
            "host guard: the host's weir state is as before {during} ({} entries)",
            after.0.len()
        );
        return Ok(());
    }
    let mut message = format!("{during} touched the host's own state (tests must keep to their own namespaces and pin roots)");
    for line in added {
        message.push_str(&format!("\n  left on the host: {line}"));
    }
    for line in removed {
        message.push_str(&format!("\n  removed from the host: {line}"));
    }
    bail!(message)
}

/// Everything under bpffs whose name starts with `weir` (a node's pins, or a test's pin
/// root left behind), to depth 4.
fn pins(dir: &Path, depth: usize, out: &mut BTreeSet<String>) -> Result<()> {
    let entries =
        std::fs::read_dir(dir).with_context(|| format!("host guard: listing {}", dir.display()))?;
    for entry in entries {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if depth == 0 && !name.starts_with("weir") {
            continue;
        }
        out.insert(format!("bpffs: {}", path.display()));
        if path.is_dir() && depth < 4 {
            pins(&path, depth + 1, out)?;
        }
    }
    Ok(())
}

/// A listing tool's output lines; a tool that is not installed lists nothing, one that
/// fails is an error (an empty listing must not pass for a clean host).
fn tool_lines(program: &str, args: &[&str]) -> Result<Vec<String>> {
    let output = match Command::new(program).args(args).output() {
        Ok(output) => output,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("host guard: running {program}")),
    };
    if !output.status.success() {
        bail!(
            "host guard: `{program} {}` failed ({}): {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_owned)
        .collect())
}
