//! Memory of a running agent: its peak RSS, and the kernel memory its dataplane holds
//! (BPF maps for eBPF, ipsets for iptables), with how full each BPF map is.
use std::process::Command;

use anyhow::{bail, Context, Result};

use super::agent::{Agent, Dataplane};
use super::bpf_maps;
use super::netns::Netns;
use super::report::Row;
use super::topology::Topology;

const MIB: f64 = 1024.0 * 1024.0;

pub fn rows(
    topo: &Topology,
    agent: &Agent,
    scenario: &str,
    dataplane: Dataplane,
) -> Result<Vec<Row>> {
    let dp = dataplane.as_str();
    let rss = agent.peak_rss()? as f64 / MIB;
    let mut rows = vec![Row::number(
        scenario,
        dp,
        "agent peak RSS (VmHWM)",
        rss,
        "MiB",
    )];
    match dataplane {
        Dataplane::Ebpf => {
            let maps = bpf_maps::maps_of(agent.pid())?;
            if maps.is_empty() {
                bail!("the eBPF agent holds no BPF map open");
            }
            let memlock: u64 = maps.iter().map(|m| m.memlock).sum();
            rows.push(Row::number(
                scenario,
                dp,
                &format!("BPF map memory ({} maps)", maps.len()),
                memlock as f64 / MIB,
                "MiB",
            ));
            for m in maps.iter().filter(|m| m.entries.is_some_and(|n| n > 0)) {
                let entries = m.entries.unwrap_or_default() as f64;
                let unit = format!("entries of {}", m.max_entries);
                rows.push(Row::number(
                    scenario,
                    dp,
                    &format!("BPF map {}", m.name),
                    entries,
                    &unit,
                ));
            }
        }
        Dataplane::Iptables | Dataplane::KubeRouter | Dataplane::AzureNpm => {
            // kube-router's sets have no common prefix: the node holds no others.
            let prefix = if dataplane.is_peer() { "" } else { "weir-" };
            let (sets, bytes) = ipset_memory(&topo.node, prefix)?;
            rows.push(Row::number(
                scenario,
                dp,
                &format!("ipset memory ({sets} sets)"),
                bytes as f64 / MIB,
                "MiB",
            ));
        }
    }
    Ok(rows)
}

/// Number and total size in memory of the sets named `prefix...` in the namespace
/// (`ipset list -terse`: one `Name:` line, then that set's `Size in memory:` line).
fn ipset_memory(ns: &Netns, prefix: &str) -> Result<(usize, u64)> {
    let mut c = Command::new("ipset");
    c.args(["list", "-terse"]);
    ns.command(&mut c)?;
    let out = c.output().context("running ipset list")?;
    if !out.status.success() {
        bail!(
            "ipset list -terse: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let (mut sets, mut bytes, mut ours) = (0, 0, false);
    for line in text.lines() {
        if let Some(name) = line.strip_prefix("Name: ") {
            ours = name.trim().starts_with(prefix);
            sets += usize::from(ours);
        } else if let Some(size) = line.strip_prefix("Size in memory: ") {
            if ours {
                bytes += size
                    .trim()
                    .parse::<u64>()
                    .with_context(|| format!("ipset: {line:?}"))?;
            }
        }
    }
    Ok((sets, bytes))
}
