//! `cargo xtask results [--check]`: the tables of the docs made from the committed results
//! (`docs/results/DATE/*.json`). A table stands in a document between
//!
//! ```text
//! <!-- results TABLE FILE -->
//! ...
//! <!-- /results -->
//! ```
//!
//! where FILE is relative to the document's directory and TABLE one of [`TABLES`] (the
//! `suites` table takes several files, separated by spaces). Without `--check` the
//! tables are written anew; with it (what `cargo xtask test` runs) a table that differs
//! from what its data makes is an error.
//!
//! A results file is `{date, source, conditions, report}`: `report` is the JSON the tool
//! wrote (`cargo xtask bench`'s target/bench/latest.json, `cargo xtask kernels`'
//! target/kernels/latest.json), `source` says which run it is (or that it was transcribed
//! from a document), `conditions` where and how it ran.
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::cmd::workspace_root;

/// The documents whose tables are made from data.
const DOCUMENTS: &[&str] = &[
    "docs/performance.md",
    "docs/kernels.md",
    "docs/peers.md",
    "docs/cluster.md",
    "README.md",
];

/// The tables a document can ask for, and what each is made of.
pub const TABLES: &[(&str, &str)] = &[
    (
        "datapath",
        "bench: each `datapath, N policies` world, no enforcement's figures and the others' ratios to it",
    ),
    (
        "cluster-datapath",
        "bench: each `datapath, N policies + C cluster policies` world, likewise",
    ),
    (
        "convergence",
        "bench: cold start, its phases, each change kind's p50 / p99 and the agent's share, memory, of the convergence world",
    ),
    (
        "path-cost",
        "bench: the eBPF programs' nanoseconds per run on each path (BPF_PROG_TEST_RUN) and their instruction counts",
    ),
    (
        "memory-large",
        "bench: cold start and memory of the larger memory world",
    ),
    (
        "peers",
        "bench --peers: weir's dataplanes and each peer (with its version) side by side: cold start, each change kind's p50 / p99, peak RSS, datapath ratios",
    ),
    (
        "cluster-scale",
        "bench --cluster: each figure per agent count N (agents on the none dataplane against one kube-apiserver)",
    ),
    (
        "cluster-sizes",
        "bench --cluster: the size sweep, each figure of the largest N per pod count P",
    ),
    (
        "cluster-extrapolation",
        "bench --cluster: the largest N's per-agent and per-pod figures carried to 5,000 nodes and 150,000 pods, beside the peers' published figures",
    ),
    ("kernels", "kernels: group × kernel, passed tests and time"),
    (
        "suites",
        "conformance --suite: one row per run (any number of files): suite, dataplane, passed / run, skipped and why, date, versions",
    ),
    (
        "rolling-switch",
        "conformance --suite rolling-switch: per run (any number of files) one row per phase (before the first flip, each node's flip): probes, across nodes, allowed failed, denied connected",
    ),
];

const BEGIN: &str = "<!-- results ";
const END: &str = "<!-- /results -->";

pub fn run(check: bool) -> Result<()> {
    let root = workspace_root();
    let mut stale = Vec::new();
    for doc in DOCUMENTS {
        let path = root.join(doc);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let docs_dir = path.parent().unwrap_or(&root).to_path_buf();
        let (made, tables) = regenerate(&text, &|file| read_json(&docs_dir.join(file)))
            .with_context(|| doc.to_string())?;
        if made == text {
            println!("{doc}: {tables} tables match their data");
            continue;
        }
        if check {
            stale.push(doc.to_string());
        } else {
            std::fs::write(&path, &made).with_context(|| format!("writing {}", path.display()))?;
            println!("{doc}: {tables} tables written from their data");
        }
    }
    if !stale.is_empty() {
        bail!(
            "tables that do not match their data (docs/results/): {}; `cargo xtask results` \
             writes them",
            stale.join(", ")
        );
    }
    Ok(())
}

fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// `text` with every marked table made again from its file (read by `load`), and how many
/// tables there were.
fn regenerate(text: &str, load: &dyn Fn(&str) -> Result<Value>) -> Result<(String, usize)> {
    let mut out = String::new();
    let mut rest = text;
    let mut count = 0;
    while let Some(start) = rest.find(BEGIN) {
        let header_end = rest[start..]
            .find("-->")
            .map(|i| start + i + 3)
            .context("a `<!-- results` marker is not closed")?;
        let header = rest[start + BEGIN.len()..header_end - 3].trim();
        let (table, file) = header
            .split_once(' ')
            .with_context(|| format!("marker `{header}`: expected `TABLE FILE`"))?;
        let end = rest[header_end..]
            .find(END)
            .map(|i| header_end + i)
            .with_context(|| format!("table `{header}` has no `{END}`"))?;
        let files: Vec<&str> = file.split_whitespace().collect();
        let data = match files[..] {
            [one] => load(one)?,
            _ => Value::Array(files.iter().map(|f| load(f)).collect::<Result<_>>()?),
        };
        let made = make(table, &data).with_context(|| format!("table {table} from {file}"))?;
        out.push_str(&rest[..header_end]);
        out.push('\n');
        out.push_str(&made);
        out.push_str(END);
        rest = &rest[end + END.len()..];
        count += 1;
    }
    out.push_str(rest);
    Ok((out, count))
}

fn make(table: &str, data: &Value) -> Result<String> {
    let report = &data["report"];
    match table {
        "datapath" => datapath(report, false),
        "cluster-datapath" => datapath(report, true),
        "convergence" => convergence(report),
        "memory-large" => memory_large(report),
        "path-cost" => path_cost(report),
        "peers" => peers(report),
        "cluster-scale" => cluster_scale(report),
        "cluster-sizes" => cluster_sizes(report),
        "cluster-extrapolation" => cluster_extrapolation(report),
        "kernels" => kernels(data),
        "suites" => suites(data),
        "rolling-switch" => rolling_switch(data),
        other => bail!(
            "no table {other}; one of {}",
            TABLES
                .iter()
                .map(|(name, _)| *name)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// A bench report's rows.
struct Rows<'a>(Vec<&'a Value>);

impl<'a> Rows<'a> {
    fn of(report: &'a Value) -> Result<Self> {
        let rows = report["rows"]
            .as_array()
            .context("the report has no `rows`")?;
        Ok(Rows(rows.iter().collect()))
    }

    /// Scenarios in the report's order, once each.
    fn scenarios(&self) -> Vec<&'a str> {
        let mut seen: Vec<&str> = Vec::new();
        for r in &self.0 {
            if let Some(s) = r["scenario"].as_str() {
                if !seen.contains(&s) {
                    seen.push(s);
                }
            }
        }
        seen
    }

    /// The dataplanes of a scenario, in the report's order.
    fn dataplanes(&self, scenario: &str) -> Vec<&'a str> {
        let mut seen: Vec<&str> = Vec::new();
        for r in self.0.iter().filter(|r| r["scenario"] == scenario) {
            if let Some(d) = r["dataplane"].as_str() {
                if !seen.contains(&d) {
                    seen.push(d);
                }
            }
        }
        seen
    }

    /// The row of a figure; a figure's name may go on with ` (...)` (a count, a sample
    /// size), which the tables do not show.
    fn find(&self, scenario: &str, dataplane: &str, figure: &str) -> Option<&'a Value> {
        let with_detail = format!("{figure} (");
        self.0.iter().copied().find(|r| {
            r["scenario"] == scenario
                && r["dataplane"] == dataplane
                && r["figure"]
                    .as_str()
                    .is_some_and(|f| f == figure || f.starts_with(&with_detail))
        })
    }

    /// A figure's value, as the tables print it ("–" when the report has none).
    fn value(&self, scenario: &str, dataplane: &str, figure: &str) -> String {
        match self.find(scenario, dataplane, figure) {
            Some(r) if r["error"].is_string() => "ERROR".into(),
            Some(r) => r["value"].as_f64().map_or("–".into(), number),
            None => "–".into(),
        }
    }

    /// A figure's ratio to its reference, as the tables print it.
    fn ratio(&self, scenario: &str, dataplane: &str, figure: &str) -> String {
        match self.find(scenario, dataplane, figure) {
            Some(r) if r["error"].is_string() => "ERROR".into(),
            Some(r) => r["ratio"]
                .as_f64()
                .map_or("–".into(), |v| format!("{v:.2}×")),
            None => "–".into(),
        }
    }
}

/// The suffixes of cluster scenarios whose agents read otherwise than by default, and
/// their columns' names: streaming lists, Pods in JSON, from the relay.
const VARIANTS: [(&str, &str); 3] = [
    (", streaming lists", "streaming lists"),
    (", pods in JSON", "pods in JSON"),
    (", from the relay", "from the relay"),
];

fn variant(scenario: &str) -> Option<&'static str> {
    VARIANTS
        .iter()
        .find(|(suffix, _)| scenario.ends_with(suffix))
        .map(|&(_, column)| column)
}

/// Every `cluster, N agents, P pods` scenario: (N, P, scenario), in the report's order;
/// those of the other ways of reading (streaming lists, Pods in JSON, the relay) only with
/// `variants`.
fn all_cluster_scenarios<'a>(rows: &Rows<'a>, variants: bool) -> Vec<(i64, i64, &'a str)> {
    rows.scenarios()
        .into_iter()
        .filter(|s| s.starts_with("cluster, ") && (variants || variant(s).is_none()))
        .filter_map(|s| Some((count_after(s, "cluster, ")?, count_after(s, "agents, ")?, s)))
        .collect()
}

/// The sweep over N: the cluster scenarios at the first one's pod count (the size
/// sweep's runs come after it, each at its own).
fn cluster_scenarios<'a>(rows: &Rows<'a>, variants: bool) -> Vec<(i64, i64, &'a str)> {
    let all = all_cluster_scenarios(rows, variants);
    let pods = all.first().map(|&(_, p, _)| p);
    all.into_iter()
        .filter(|&(_, p, _)| Some(p) == pods)
        .collect()
}

/// Whether the report has a figure of scenario `s` (a run stopped or failed before its
/// first has none).
fn measured(rows: &Rows, s: &str) -> bool {
    rows.0
        .iter()
        .any(|r| r["scenario"] == s && r["value"].is_number())
}

/// One line per figure of the scenarios `from`, in the order they first appear, one
/// column per run of `runs`.
fn cluster_lines(rows: &Rows, runs: &[(i64, i64, &str)], from: &[&str]) -> String {
    let mut figures: Vec<(&str, &str)> = Vec::new();
    for s in from {
        for r in rows.0.iter().filter(|r| r["scenario"] == *s) {
            if let (Some(f), Some(u)) = (r["figure"].as_str(), r["unit"].as_str()) {
                if !figures.iter().any(|(g, _)| *g == bare(f)) {
                    figures.push((bare(f), u));
                }
            }
        }
    }
    let mut out = String::new();
    for (figure, unit) in figures {
        let label = match unit {
            "" => figure.to_string(),
            unit => format!("{figure} ({unit})"),
        };
        out.push_str(&line(
            &label,
            runs.iter().map(|(_, _, s)| rows.value(s, "none", figure)),
        ));
    }
    out
}

/// The size sweep: the largest N at each pod count, one column per count, ascending.
fn cluster_sizes(report: &Value) -> Result<String> {
    let rows = Rows::of(report)?;
    let all = all_cluster_scenarios(&rows, false);
    let Some(n) = all.iter().map(|&(n, _, _)| n).max() else {
        bail!("the report has no `cluster, N agents, P pods` scenario");
    };
    let mut runs: Vec<_> = all
        .into_iter()
        .filter(|&(m, _, s)| m == n && measured(&rows, s))
        .collect();
    runs.sort_by_key(|&(_, p, _)| p);
    if runs.len() < 2 {
        bail!("the report has no size sweep: N = {n} was measured at one pod count only");
    }
    Ok(format!(
        "| N = {n}, P pods | {} |\n|---|{}\n{}",
        runs.iter()
            .map(|&(_, p, _)| format!("P = {}", thousands(p)))
            .collect::<Vec<_>>()
            .join(" | "),
        "---|".repeat(runs.len()),
        cluster_lines(
            &rows,
            &runs,
            &runs.iter().map(|&(_, _, s)| s).collect::<Vec<_>>()
        )
    ))
}

/// A figure's name without its ` (n=...)` detail.
fn bare(figure: &str) -> &str {
    figure.split(" (n=").next().unwrap_or(figure)
}

fn cluster_scale(report: &Value) -> Result<String> {
    let rows = Rows::of(report)?;
    let Some(&(_, pods, last)) = cluster_scenarios(&rows, false).last() else {
        bail!("the report has no `cluster, N agents, P pods` scenario");
    };
    // A run that measured nothing (stopped, or failed before its first figure) has no column.
    let runs: Vec<_> = cluster_scenarios(&rows, true)
        .into_iter()
        .filter(|(_, _, s)| measured(&rows, s))
        .collect();
    Ok(format!(
        "| {} pods, N agents | {} |\n|---|{}\n{}",
        thousands(pods),
        runs.iter()
            .map(|(n, _, s)| match variant(s) {
                Some(column) => format!("N = {n}, {column}"),
                None => format!("N = {n}"),
            })
            .collect::<Vec<_>>()
            .join(" | "),
        "---|".repeat(runs.len()),
        cluster_lines(&rows, &runs, &[last])
    ))
}

fn cluster_extrapolation(report: &Value) -> Result<String> {
    const NODES: f64 = 5000.0;
    const PODS: f64 = 150_000.0;
    /// Changes per second the extrapolation assumes (the issue's convergence target's).
    const RATE: f64 = 10.0;
    let rows = Rows::of(report)?;
    let runs = cluster_scenarios(&rows, false);
    let (Some(&(n1, _, first)), Some(&(n, pods, last))) = (runs.first(), runs.last()) else {
        bail!("the report has no `cluster, N agents, P pods` scenario");
    };
    let get = |s: &str, f: &str| -> Result<f64> {
        rows.find(s, "none", f)
            .and_then(|r| r["value"].as_f64())
            .with_context(|| format!("{s}: no figure {f}"))
    };
    // What each agent added: the growth from the smallest N to the largest, per agent
    // (the API server has watchers and background work of its own).
    let marginal = |f: &str| -> Result<Option<f64>> {
        let (a, b) = (get(first, f)?, get(last, f)?);
        Ok((n > n1).then(|| (b - a) / (n - n1) as f64))
    };
    let events = marginal("API server watch events per change")?
        .unwrap_or(get(last, "API server watch events per change")? / n as f64);
    // A pod change's own figure where the run has it (older runs: pod and policy changes
    // together).
    let bytes = get(last, "bytes received per agent per pod change (mean)")
        .or_else(|_| get(last, "bytes received per agent per change (mean)"))?;
    let cpu_per_agent = marginal("API server CPU per change")?;
    let list_cpu = marginal("cold start: API server CPU")?;
    // The cold start's peak where the run has it; the peak over the whole run also takes
    // in a relist after the API server's restart (its own row below).
    let cold_rss = get(last, "cold start: agent peak RSS (mean)").ok();
    let rss = get(last, "agent peak RSS (mean)")?;
    // The storm's figure where the run has it, else the plain restart's.
    let restart = get(
        last,
        "410 storm: MiB received per agent from the new server (mean)",
    )
    .or_else(|_| {
        get(
            last,
            "restart: MiB received per agent from the new server (mean)",
        )
    })?;
    let mut out = format!(
        "| from N = {n}, {} pods | per agent (measured) | at 5,000 nodes, 150,000 pods, {RATE} changes/s | peers, as published |\n|---|---|---|---|\n",
        thousands(pods)
    );
    out.push_str(&line(
        "API server watch events",
        [
            format!("{} per change", number(events)),
            format!("{} events/s", number(events * NODES * RATE)),
            "Cilium: about 90,000/s at 1,000 nodes; its CFP-44774 (agents read from an etcd) cut them 95%".into(),
        ],
    ));
    out.push_str(&line(
        "bytes the API server sends per pod change",
        [
            format!("{} bytes per change", number(bytes)),
            format!(
                "{} MiB per change, {} MiB/s",
                number(bytes * NODES / 1048576.0),
                number(bytes * NODES * RATE / 1048576.0)
            ),
            "–".into(),
        ],
    ));
    let peers_cpu = "Calico: Typha above about 100 nodes (one per 200), direct watches \"melt\" the API server; Cilium: CFP-44774 more than halved its CPU";
    out.push_str(&line(
        "API server CPU for the fan-out of a change",
        match cpu_per_agent.filter(|c| *c > 0.0) {
            Some(c) => [
                format!("{} ms per change", number(c)),
                format!("{} cores", number(c * NODES * RATE / 1e3)),
                peers_cpu.into(),
            ],
            None => [
                "not resolved: the per-change figure did not grow with N in this run (the writer's requests and the server's own background work dominate it)".into(),
                "–".into(),
                peers_cpu.into(),
            ],
        },
    ));
    if let Some(c) = list_cpu.filter(|c| *c > 0.0) {
        out.push_str(&line(
            "API server CPU for one agent's cold start (its lists and watches)",
            [
                format!("{} s at {} pods", number(c), thousands(pods)),
                format!(
                    "{} s per agent, {} CPU-hours for all 5,000 starting at once",
                    number(c * PODS / pods as f64),
                    number(c * PODS / pods as f64 * NODES / 3600.0)
                ),
                "–".into(),
            ],
        ));
    }
    let memory = |label: &str, rss: f64, peer: &str| {
        line(
            label,
            [
                format!(
                    "{} MiB at {} pods ({} KiB per pod)",
                    number(rss),
                    thousands(pods),
                    number(rss * 1024.0 / pods as f64)
                ),
                format!("{} MiB", number(rss * PODS / pods as f64)),
                peer.into(),
            ],
        )
    };
    let cilium = "Cilium: 10.5 KiB per cluster pod (1,538 MiB at 150,000)";
    match cold_rss {
        Some(cold) => {
            out.push_str(&memory(
                "agent memory after its cold start (every pod of the cluster held)",
                cold,
                cilium,
            ));
            out.push_str(&memory(
                "agent memory, peak over the run (a relist after the API server's restart included)",
                rss,
                "–",
            ));
        }
        None => out.push_str(&memory(
            "agent memory (every pod of the cluster held)",
            rss,
            cilium,
        )),
    }
    out.push_str(&line(
        "an API server restart that makes every agent list again (410)",
        [
            format!("{} MiB received", number(restart)),
            format!(
                "{} GiB sent, at {} MiB per agent × 5,000",
                number(restart * NODES * PODS / pods as f64 / 1024.0),
                number(restart * PODS / pods as f64)
            ),
            "kube-network-policies and Antrea: agents do not watch every pod (a central tracker; each node's span)".into(),
        ],
    ));
    Ok(out)
}

/// Three significant digits at most (no more than the noise allows), without trailing
/// zeros; whole numbers from 100 on, with thousands separated by commas.
fn number(v: f64) -> String {
    if !v.is_finite() {
        return v.to_string();
    }
    if v.abs() >= 100.0 || v == 0.0 {
        return thousands(v.round() as i64);
    }
    let decimals = (2 - v.abs().log10().floor() as i32).max(0) as usize;
    let text = format!("{v:.decimals$}");
    match text.contains('.') {
        true => text.trim_end_matches('0').trim_end_matches('.').to_string(),
        false => text,
    }
}

fn thousands(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        out.insert(0, '-');
    }
    out
}

/// The integer after `prefix` in `text` (`"1000 policies"` after `"datapath, "`).
fn count_after(text: &str, prefix: &str) -> Option<i64> {
    let rest = text.split_once(prefix)?.1;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

fn datapath(report: &Value, cluster: bool) -> Result<String> {
    let rows = Rows::of(report)?;
    let scenarios: Vec<&str> = rows
        .scenarios()
        .into_iter()
        .filter(|s| s.starts_with("datapath, ") && s.contains("cluster policies") == cluster)
        .collect();
    if scenarios.is_empty() {
        bail!("the report has no datapath scenario");
    }
    let mut out = format!(
        "| {} | dataplane | throughput | RR p50 / p99 | CRR p50 / p99 |\n|---|---|---|---|---|\n",
        if cluster {
            "cluster policies"
        } else {
            "policies"
        }
    );
    for s in scenarios {
        let size = if cluster {
            count_after(s, "+ ")
        } else {
            count_after(s, "datapath, ")
        }
        .with_context(|| format!("{s}: no size in its name"))?;
        for dp in rows.dataplanes(s) {
            let cells = if dp == "none" {
                let v = |f| rows.value(s, dp, f);
                [
                    format!("{} Gbit/s", v("TCP throughput")),
                    format!("{} / {} µs", v("RR latency p50"), v("RR latency p99")),
                    format!("{} / {} µs", v("CRR latency p50"), v("CRR latency p99")),
                ]
            } else {
                let r = |f| rows.ratio(s, dp, f);
                [
                    r("TCP throughput"),
                    format!("{} / {}", r("RR latency p50"), r("RR latency p99")),
                    format!("{} / {}", r("CRR latency p50"), r("CRR latency p99")),
                ]
            };
            out.push_str(&format!(
                "| {} | {dp} | {} |\n",
                thousands(size),
                cells.join(" | ")
            ));
        }
    }
    Ok(out)
}

/// The change kinds, in the bench's order, as the tables name them.
const KINDS: &[&str] = &[
    "policy create",
    "policy update",
    "policy delete",
    "pod label change",
    "namespace label change",
    "cluster policy create",
    "cluster policy delete",
];

/// The cold start's phases (the agent's status file `startup`), as the tables name them.
const PHASES: &[(&str, &str)] = &[
    (
        "listed",
        "listed (pods, namespaces, policies, services, node)",
    ),
    ("compiled", "compiled"),
    (
        "loaded",
        "loaded (eBPF: programs verified, pinned and attached)",
    ),
    ("programmed", "programmed"),
    ("cleaned", "cleaned (the other dataplane's leftovers)"),
];

/// The world a scenario name gives: (remote pods, policies).
fn world(scenario: &str) -> Option<(i64, i64)> {
    let policies = count_after(scenario, ", ")?;
    let pods = count_after(scenario, "policies, ")?;
    Some((pods, policies))
}

/// A row of a two-or-more-column table: the label, then one cell per dataplane.
fn line(label: &str, cells: impl IntoIterator<Item = String>) -> String {
    let cells: Vec<String> = cells.into_iter().collect();
    format!("| {label} | {} |\n", cells.join(" | "))
}

fn kernel_state(rows: &Rows, s: &str, dp: &str) -> String {
    match (
        rows.find(s, dp, "BPF map memory"),
        rows.find(s, dp, "ipset memory"),
    ) {
        (Some(_), _) => format!("BPF maps {} MiB", rows.value(s, dp, "BPF map memory")),
        (None, Some(_)) => format!("ipsets {} MiB", rows.value(s, dp, "ipset memory")),
        (None, None) => "–".into(),
    }
}

/// A world's table up to its cold start: the head (the world, then one column per
/// dataplane) and the cold start's row.
fn world_head(rows: &Rows, s: &str, dps: &[&str], pods: i64, policies: i64) -> String {
    let head = format!(
        "| {} pods, {} policies | {} |\n|---|{}\n",
        thousands(pods),
        thousands(policies),
        dps.join(" | "),
        "---|".repeat(dps.len())
    );
    head + &line(
        "cold start to converged",
        dps.iter()
            .map(|dp| format!("{} ms", rows.value(s, dp, "cold start to converged"))),
    )
}

fn convergence(report: &Value) -> Result<String> {
    let rows = Rows::of(report)?;
    let s = rows
        .scenarios()
        .into_iter()
        .find(|s| s.starts_with("convergence, "))
        .context("the report has no convergence scenario")?;
    let (pods, policies) = world(s).with_context(|| format!("{s}: no world in its name"))?;
    let memory = format!("memory, {policies} policies, {pods} remote pods");
    let dps = rows.dataplanes(s);
    let mut out = world_head(&rows, s, &dps, pods, policies);
    for (phase, label) in PHASES {
        let figure = format!("cold start: {phase}");
        out += &line(
            &format!("— {label}"),
            dps.iter().map(|dp| rows.value(s, dp, &figure)),
        );
    }
    for (i, kind) in KINDS.iter().enumerate() {
        if dps
            .iter()
            .all(|dp| rows.find(s, dp, &format!("{kind} p50")).is_none())
        {
            continue;
        }
        // Reports since the watch delay was measured give it before the agent's share.
        let watched = dps.iter().any(|dp| {
            rows.find(s, dp, &format!("{kind}: watch delay p50"))
                .is_some()
        });
        let label = match (i, watched) {
            (0, false) => format!("{kind} p50 / p99 (in the agent p50 / p99)"),
            (0, true) => {
                format!("{kind} p50 / p99 (watch delay p50 / p99; in the agent p50 / p99)")
            }
            _ => format!("{kind} p50 / p99"),
        };
        out += &line(
            &label,
            dps.iter().map(|dp| {
                let v = |f: &str| rows.value(s, dp, &format!("{kind}{f}"));
                let seen = format!("{} / {} ms", v(" p50"), v(" p99"));
                let agent = format!("{} / {}", v(": in the agent p50"), v(": in the agent p99"));
                let in_agent = rows.find(s, dp, &format!("{kind}: in the agent p50"));
                match (in_agent, watched) {
                    (Some(_), false) => format!("{seen} ({agent})"),
                    (Some(_), true) => format!(
                        "{seen} ({} / {}; {agent})",
                        v(": watch delay p50"),
                        v(": watch delay p99")
                    ),
                    (None, _) => seen,
                }
            }),
        );
    }
    // A run of the convergence scenario alone (`weir-bench --only`) has no memory world.
    if rows.scenarios().contains(&memory.as_str()) {
        out += &line(
            "agent peak RSS",
            dps.iter()
                .map(|dp| format!("{} MiB", rows.value(&memory, dp, "agent peak RSS"))),
        );
        out += &line(
            "kernel state",
            dps.iter().map(|dp| kernel_state(&rows, &memory, dp)),
        );
    }
    Ok(out)
}

/// The per-path cost: one line per path (its program and nanoseconds per run), then one
/// per program (the verifier's instruction count, the instructions as loaded, the JIT
/// image).
fn path_cost(report: &Value) -> Result<String> {
    let rows = Rows::of(report)?;
    let s = rows
        .scenarios()
        .into_iter()
        .find(|s| s.starts_with("per-path cost, "))
        .context("the report has no per-path cost scenario")?;
    let (pods, policies) = world(s).with_context(|| format!("{s}: no world in its name"))?;
    let of_scenario = || rows.0.iter().filter(move |r| r["scenario"] == s);
    let mut out = format!(
        "| path ({} pods, {} policies) | program | ns per run |\n|---|---|---|\n",
        thousands(pods),
        thousands(policies)
    );
    for r in of_scenario().filter(|r| r["unit"] == "ns/run" || r["error"].is_string()) {
        let figure = r["figure"].as_str().unwrap_or_default();
        if figure.contains("instructions") {
            continue;
        }
        let (path, program) = figure.rsplit_once(": ").unwrap_or((figure, "–"));
        let value = rows.value(s, r["dataplane"].as_str().unwrap_or_default(), figure);
        out += &format!("| {path} | {program} | {value} |\n");
    }
    out += "\n| program | instructions the verifier processed | instructions as loaded | JIT image |\n|---|---|---|---|\n";
    let mut programs: Vec<&str> = Vec::new();
    for r in of_scenario() {
        let figure = r["figure"].as_str().unwrap_or_default();
        if let Some((program, _)) = figure.split_once(": instructions the verifier processed") {
            programs.push(program);
        }
    }
    for program in programs {
        let v = |f: &str| rows.value(s, "ebpf", &format!("{program}: {f}"));
        out += &format!(
            "| {program} | {} | {} | {} bytes |\n",
            v("instructions the verifier processed"),
            v("instructions as loaded (xlated)"),
            v("JIT image")
        );
    }
    Ok(out)
}

fn memory_large(report: &Value) -> Result<String> {
    let rows = Rows::of(report)?;
    let memory: Vec<&str> = rows
        .scenarios()
        .into_iter()
        .filter(|s| s.starts_with("memory, "))
        .collect();
    let s = memory
        .iter()
        .copied()
        .max_by_key(|s| world(s).map_or(0, |(pods, _)| pods))
        .context("the report has no memory scenario")?;
    if memory.len() < 2 {
        bail!("the report has one memory world only");
    }
    let (pods, policies) = world(s).with_context(|| format!("{s}: no world in its name"))?;
    let dps = rows.dataplanes(s);
    let mut out = world_head(&rows, s, &dps, pods, policies);
    let phases = ["listed", "compiled", "programmed"];
    out += &line(
        &format!("— {}", phases.join(" / ")),
        dps.iter().map(|dp| {
            let values: Vec<String> = phases
                .iter()
                .map(|p| rows.value(s, dp, &format!("cold start: {p}")))
                .collect();
            format!("{} ms", values.join(" / "))
        }),
    );
    out += &line(
        "agent peak RSS",
        dps.iter()
            .map(|dp| format!("{} MiB", rows.value(s, dp, "agent peak RSS"))),
    );
    out += &line(
        "kernel state",
        dps.iter().map(|dp| kernel_state(&rows, s, dp)),
    );
    Ok(out)
}

/// A peers report's cell: a number as the tables print it, a word the bench wrote (a
/// change "over N s"; "not measured" without its reason, which the JSON keeps), "–"
/// when there is no row, "ERROR" for a failed one.
/// An enforcer with no figures has one row, "all figures", that says why: every cell of
/// its column says it too.
fn peer_cell(rows: &Rows, s: &str, dp: &str, figure: &str) -> String {
    match rows
        .find(s, dp, figure)
        .or_else(|| rows.find(s, dp, "all figures"))
    {
        Some(r) if r["error"].is_string() => "ERROR".into(),
        Some(r) => match (&r["value"], r["value"].as_f64()) {
            (_, Some(v)) => number(v),
            (Value::String(text), None) => match text.split_once(':') {
                Some((head, _)) if head == "not measured" => head.to_string(),
                _ => text.clone(),
            },
            _ => "–".into(),
        },
        None => "–".into(),
    }
}

/// The column heading of an enforcer in the peers table: weir's dataplanes, or a peer
/// with the version the report gives it.
fn enforcer_heading(report: &Value, dp: &str) -> String {
    let name = match dp {
        "ebpf" => return "weir eBPF".into(),
        "iptables" => return "weir iptables".into(),
        "azure-npm" => "Azure NPM",
        other => other,
    };
    match report["versions"][dp].as_str() {
        Some(version) => format!("{name} {version}"),
        None => name.to_string(),
    }
}

fn peers(report: &Value) -> Result<String> {
    let rows = Rows::of(report)?;
    let scenario = |prefix: &str| {
        rows.scenarios()
            .into_iter()
            .find(|s| s.starts_with(prefix))
            .with_context(|| format!("the report has no `{prefix}...` scenario"))
    };
    let (datapath, convergence, memory) = (
        scenario("peers: datapath, ")?,
        scenario("peers: convergence, ")?,
        scenario("peers: memory, ")?,
    );
    // Those measured first, in the report's order; those not measured at all last.
    let mut dps: Vec<&str> = rows.dataplanes(convergence);
    dps.sort_by_key(|dp| rows.find(convergence, dp, "all figures").is_some());
    let (pods, policies) = world(convergence.trim_start_matches("peers: "))
        .with_context(|| format!("{convergence}: no world in its name"))?;
    let mut out = format!(
        "| {} pods, {} policies | {} |\n|---|{}\n",
        thousands(pods),
        thousands(policies),
        dps.iter()
            .map(|dp| enforcer_heading(report, dp))
            .collect::<Vec<_>>()
            .join(" | "),
        "---|".repeat(dps.len())
    );
    out += &line(
        "cold start, ms",
        dps.iter()
            .map(|dp| peer_cell(&rows, convergence, dp, "cold start to converged")),
    );
    for kind in KINDS {
        if dps
            .iter()
            .all(|dp| rows.find(convergence, dp, &format!("{kind} p50")).is_none())
        {
            continue;
        }
        out += &line(
            &format!("{kind} p50 / p99, ms"),
            dps.iter().map(|dp| {
                let p50 = peer_cell(&rows, convergence, dp, &format!("{kind} p50"));
                match rows.find(convergence, dp, &format!("{kind} p99")) {
                    Some(_) => {
                        let p99 = peer_cell(&rows, convergence, dp, &format!("{kind} p99"));
                        format!("{p50} / {p99}")
                    }
                    None => p50,
                }
            }),
        );
    }
    out += &line(
        "peak RSS, MiB",
        dps.iter()
            .map(|dp| peer_cell(&rows, memory, dp, "agent peak RSS")),
    );
    for (label, figure) in [
        ("TCP throughput", "TCP throughput"),
        ("RR latency p50", "RR latency p50"),
        ("CRR latency p50", "CRR latency p50"),
    ] {
        out += &line(
            &format!("{label}, × no enforcement"),
            dps.iter().map(|dp| match rows.find(datapath, dp, figure) {
                Some(_) => rows.ratio(datapath, dp, figure),
                None => peer_cell(&rows, datapath, dp, figure),
            }),
        );
    }
    Ok(out)
}

/// `cargo xtask kernels`' result for one group, as a table cell.
fn kernel_cell(g: &Value) -> String {
    if let Some(why) = g["not_applicable"].as_str() {
        return format!("n/a: {why}");
    }
    let passed = g["passed"].as_u64().unwrap_or(0);
    let failed = g["failed"].as_array().map_or(0, Vec::len) as u64;
    let seconds = g["seconds"]
        .as_i64()
        .map(|s| format!(" ({} s)", thousands(s)));
    let ok = g["exit"].as_i64() == Some(0) && failed == 0 && passed > 0;
    let cell = match (ok, g["exit"].is_null()) {
        (true, _) => format!("pass {passed}{}", seconds.unwrap_or_default()),
        (false, true) => "not finished".into(),
        (false, false) => format!(
            "FAIL {}/{}{}",
            failed.max(1),
            passed + failed,
            seconds.unwrap_or_default()
        ),
    };
    match g["note"].as_str() {
        Some(note) => format!("{cell}: {note}"),
        None => cell,
    }
}

/// One row per `cargo xtask conformance --suite` result.
fn suites(data: &Value) -> Result<String> {
    let runs = match data {
        Value::Array(runs) => runs.iter().collect(),
        one => vec![one],
    };
    let mut out = String::from(
        "| suite | dataplane | passed / run | skipped | date | versions |\n|---|---|---|---|---|---|\n",
    );
    for run in runs {
        let r = &run["report"];
        let count = |k: &str| r[k].as_array().map_or(0, Vec::len);
        let (passed, failed, skipped) = (count("passed"), count("failed"), count("skipped"));
        let suite = match r["suite"].as_str() {
            Some("e2e") => "Kubernetes NetworkPolicy e2e",
            Some("npapi") => "network-policy-api ClusterNetworkPolicy",
            Some("cyclonus") => "cyclonus generated cases",
            _ => bail!("a result with no known `suite`"),
        };
        let dataplane = match r["dataplane"].as_str() {
            Some("ebpf") => "eBPF",
            Some("iptables") => "iptables",
            _ => bail!("a result with no known `dataplane`"),
        };
        let mut cell = format!("{passed} / {}", passed + failed);
        let (sp, sf) = (
            r["subtests_passed"].as_u64().unwrap_or(0),
            r["subtests_failed"].as_u64().unwrap_or(0),
        );
        if sp + sf > 0 {
            cell += &format!(" ({sp} / {} subtests)", sp + sf);
        }
        let why = r["skip_reasons"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .any(|w| w.contains("no SCTP"));
        let skipped = match (skipped, why) {
            (0, _) => "0".to_string(),
            (n, true) => format!("{n} (SCTP: the kernel has none)"),
            (n, false) => n.to_string(),
        };
        let v = &r["versions"];
        out += &line(
            suite,
            [
                dataplane.to_string(),
                cell,
                skipped,
                run["date"].as_str().unwrap_or("?").to_string(),
                format!(
                    "{}, Kubernetes {}, containerd {}, weir {}",
                    r["suite_version"].as_str().unwrap_or("?"),
                    v["kubernetes"].as_str().unwrap_or("?"),
                    v["containerd"].as_str().unwrap_or("?"),
                    v["weir"].as_str().unwrap_or("?")
                ),
            ],
        );
    }
    Ok(out)
}

/// Per `cargo xtask conformance --suite rolling-switch` result, one row per phase.
fn rolling_switch(data: &Value) -> Result<String> {
    let runs = match data {
        Value::Array(runs) => runs.iter().collect(),
        one => vec![one],
    };
    let mut out = String::from(
        "| run | phase | seconds | probes (across nodes) | allowed probes failed | denied probes connected |\n|---|---|---|---|---|---|\n",
    );
    for run in runs {
        let r = &run["report"];
        let start = r["start"]
            .as_object()
            .context("a rolling-switch result with no `start`")?;
        let label = format!(
            "{}; {}, weir {}",
            start
                .iter()
                .map(|(node, dp)| format!("{node} {}", dp.as_str().unwrap_or("?")))
                .collect::<Vec<_>>()
                .join(", "),
            run["date"].as_str().unwrap_or("?"),
            r["versions"]["weir"].as_str().unwrap_or("?")
        );
        let phases = r["phases"]
            .as_array()
            .context("a rolling-switch result with no `phases`")?;
        let flips = r["flips"].as_array().cloned().unwrap_or_default();
        let mut rows = vec![];
        for p in phases {
            let c = &p["counts"];
            let n = |k: &str| c[k].as_u64().unwrap_or(0);
            let mut phase = p["phase"].as_str().unwrap_or("?").to_string();
            // A flip's phase names how long its node took to report the new dataplane.
            if let Some(f) = flips.iter().find(|f| {
                f["node"]
                    .as_str()
                    .is_some_and(|node| phase.contains(&format!("{node}:")))
            }) {
                phase += &format!(
                    " (reported converged after {} s)",
                    f["seconds_to_converged"]
                );
            }
            rows.push((
                phase,
                [
                    p["seconds"].to_string(),
                    format!("{} ({})", n("probes"), n("cross_node")),
                    format!("{} of {}", n("allowed_failed"), n("allowed")),
                    format!("{} of {}", n("denied_connected"), n("denied")),
                ],
            ));
        }
        let t = &r["total"];
        let n = |k: &str| t[k].as_u64().unwrap_or(0);
        rows.push((
            "**in all**".to_string(),
            [
                String::new(),
                format!("{} ({})", n("probes"), n("cross_node")),
                format!("{} of {}", n("allowed_failed"), n("allowed")),
                format!("{} of {}", n("denied_connected"), n("denied")),
            ],
        ));
        // The run is named on its first row only.
        for (k, (phase, cells)) in rows.into_iter().enumerate() {
            let run = if k == 0 { label.as_str() } else { "" };
            out += &line(run, std::iter::once(phase).chain(cells));
        }
    }
    Ok(out)
}

fn kernels(data: &Value) -> Result<String> {
    let runs = data["report"]
        .as_array()
        .context("`report` is not the list of kernel runs")?;
    let header = |run: &Value| -> String {
        let kernel = run["kernel"].as_str().unwrap_or("?");
        match kernel {
            "host" => {
                let release = run["release"].as_str().unwrap_or("");
                let version: Vec<&str> = release.split('.').take(2).collect();
                format!("host {}", version.join("."))
            }
            k => k.to_string(),
        }
    };
    let mut groups: Vec<&str> = Vec::new();
    for run in runs {
        for g in run["groups"].as_array().into_iter().flatten() {
            if let Some(name) = g["group"].as_str() {
                if !groups.contains(&name) {
                    groups.push(name);
                }
            }
        }
    }
    let mut out = format!(
        "| group | {} |\n|---|{}\n",
        runs.iter().map(header).collect::<Vec<_>>().join(" | "),
        "---|".repeat(runs.len())
    );
    for name in groups {
        let label = match data["descriptions"][name].as_str() {
            Some(d) => format!("{name} ({d})"),
            None => name.to_string(),
        };
        out += &line(
            &label,
            runs.iter().map(|run| {
                run["groups"]
                    .as_array()
                    .and_then(|gs| gs.iter().find(|g| g["group"] == name))
                    .map_or(String::new(), kernel_cell)
            }),
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn row(s: &str, dp: &str, f: &str, v: Value, ratio: Option<f64>) -> Value {
        json!({"scenario": s, "dataplane": dp, "figure": f, "value": v, "unit": "",
               "ratio": ratio, "reference": "none", "error": null})
    }

    #[test]
    fn the_cluster_tables_give_each_n_and_each_size_a_column_and_extrapolate() {
        let mut rows = Vec::new();
        for (s, n) in [
            ("cluster, 1 agents, 1000 pods", 1.0),
            ("cluster, 10 agents, 1000 pods", 10.0),
            ("cluster, 10 agents, 1000 pods, streaming lists", 10.0),
            ("cluster, 10 agents, 1000 pods, pods in JSON", 10.0),
        ] {
            for (f, v) in [
                ("change to every agent p99 (n=30 agent-changes)", 50.0 * n),
                ("API server watch events per change", 2.0 * n),
                ("bytes received per agent per change (mean)", 1000.0),
                ("API server CPU per change", 10.0 + n),
                ("cold start: API server CPU", n),
                ("agent peak RSS (mean)", 100.0),
                (
                    "restart: MiB received per agent from the new server (mean)",
                    1.0,
                ),
            ] {
                rows.push(row(s, "none", f, json!(v), None));
            }
        }
        // The size sweep's runs, after: the largest N at other pod counts, with figures
        // of their own, which the tables over N must not take.
        for (s, p) in [
            ("cluster, 10 agents, 2000 pods", 2000.0),
            ("cluster, 10 agents, 500 pods", 500.0),
        ] {
            rows.push(row(
                s,
                "none",
                "world resized to this many pods",
                json!(p / 100.0),
                None,
            ));
            rows.push(row(
                s,
                "none",
                "API server watch events per change",
                json!(p),
                None,
            ));
        }
        let report = json!({ "rows": rows });
        let table = cluster_sizes(&report).unwrap();
        assert!(
            table.starts_with(
                "| N = 10, P pods | P = 500 | P = 1,000 | P = 2,000 |\n|---|---|---|---|\n"
            ),
            "{table}"
        );
        assert!(
            table.contains("| change to every agent p99 | – | 500 | – |"),
            "{table}"
        );
        assert!(
            table.contains("| API server watch events per change | 500 | 20 | 2,000 |"),
            "{table}"
        );
        assert!(
            table.contains("| world resized to this many pods | 5 | – | 20 |"),
            "{table}"
        );
        let table = cluster_scale(&report).unwrap();
        assert!(
            table
                .starts_with("| 1,000 pods, N agents | N = 1 | N = 10 | N = 10, streaming lists | N = 10, pods in JSON |"),
            "{table}"
        );
        assert!(
            table.contains("| change to every agent p99 | 50 | 500 | 500 | 500 |"),
            "{table}"
        );
        let table = cluster_extrapolation(&report).unwrap();
        // 2 events per agent per change, 5,000 agents, 10 changes/s.
        assert!(
            table.contains("| 2 per change | 100,000 events/s |"),
            "{table}"
        );
        // 1 ms of API server CPU per agent per change, from the growth between N = 1 and 10.
        assert!(table.contains("| 1 ms per change | 50 cores |"), "{table}");
        // 100 MiB at 1,000 pods, carried to 150,000.
        assert!(table.contains("15,000 MiB"), "{table}");
        assert!(table.contains("| agent memory (every pod"), "{table}");

        // A pod change's own bytes, where the run has them, over pod and policy changes.
        let mut rows = report["rows"].as_array().unwrap().clone();
        rows.push(row(
            "cluster, 10 agents, 1000 pods",
            "none",
            "bytes received per agent per pod change (mean)",
            json!(600.0),
            None,
        ));
        let table = cluster_extrapolation(&json!({ "rows": rows })).unwrap();
        assert!(
            table.contains("| bytes the API server sends per pod change | 600 bytes per change |"),
            "{table}"
        );

        // With the cold start's peak, memory is that, and the run's peak its own row.
        let mut rows = report["rows"].as_array().unwrap().clone();
        rows.push(row(
            "cluster, 10 agents, 1000 pods",
            "none",
            "cold start: agent peak RSS (mean)",
            json!(40.0),
            None,
        ));
        let table = cluster_extrapolation(&json!({ "rows": rows })).unwrap();
        assert!(
            table.contains("| agent memory after its cold start (every pod of the cluster held) | 40 MiB at 1,000 pods (41 KiB per pod) | 6,000 MiB |"),
            "{table}"
        );
        assert!(
            table.contains("| agent memory, peak over the run (a relist after the API server's restart included) | 100 MiB"),
            "{table}"
        );
    }

    #[test]
    fn numbers_keep_three_significant_digits() {
        assert_eq!(number(5.342), "5.34");
        assert_eq!(number(10.54), "10.5");
        assert_eq!(number(9.8), "9.8");
        assert_eq!(number(62.0), "62");
        assert_eq!(number(5.104), "5.1");
        assert_eq!(number(1793.4), "1,793");
        assert_eq!(number(100_000.0), "100,000");
        assert_eq!(number(0.0), "0");
    }

    #[test]
    fn a_datapath_table_gives_the_reference_and_the_ratios() {
        let s = "datapath, 1000 policies, 20000 remote pods";
        let mut rows = Vec::new();
        for (f, v) in [
            ("TCP throughput", 16.9),
            ("RR latency p50", 5.22),
            ("RR latency p99", 6.38),
            ("CRR latency p50", 28.7),
            ("CRR latency p99", 1561.0),
        ] {
            rows.push(row(s, "none", f, json!(v), Some(1.0)));
            rows.push(row(s, "ebpf", f, json!(v * 1.2), Some(1.2)));
        }
        let table = datapath(&json!({ "rows": rows }), false).expect("a table");
        assert_eq!(
            table,
            "| policies | dataplane | throughput | RR p50 / p99 | CRR p50 / p99 |\n\
             |---|---|---|---|---|\n\
             | 1,000 | none | 16.9 Gbit/s | 5.22 / 6.38 µs | 28.7 / 1,561 µs |\n\
             | 1,000 | ebpf | 1.20× | 1.20× / 1.20× | 1.20× / 1.20× |\n"
        );
    }

    #[test]
    fn a_path_cost_table_gives_each_path_and_each_program() {
        let s = "per-path cost, 1000 policies, 20000 remote pods";
        let rows = vec![
            row(
                s,
                "ebpf",
                "weir_to_pod: instructions the verifier processed",
                json!(274400),
                None,
            ),
            row(
                s,
                "ebpf",
                "weir_to_pod: instructions as loaded (xlated)",
                json!(7803),
                None,
            ),
            row(s, "ebpf", "weir_to_pod: JIT image", json!(37970), None),
            json!({"scenario": s, "dataplane": "ebpf", "figure": "established, to the pod: weir_to_pod",
                   "value": 357.0, "unit": "ns/run", "ratio": null, "reference": null, "error": null}),
        ];
        let table = path_cost(&json!({ "rows": rows })).expect("a table");
        assert_eq!(
            table,
            "| path (20,000 pods, 1,000 policies) | program | ns per run |\n\
             |---|---|---|\n\
             | established, to the pod | weir_to_pod | 357 |\n\
             \n\
             | program | instructions the verifier processed | instructions as loaded | JIT image |\n\
             |---|---|---|---|\n\
             | weir_to_pod | 274,400 | 7,803 | 37,970 bytes |\n"
        );
    }

    #[test]
    fn a_peers_table_names_the_versions_and_says_over_the_limit() {
        let (d, c, m) = (
            "peers: datapath, 100 policies, 2000 remote pods",
            "peers: convergence, 100 policies, 2000 remote pods",
            "peers: memory, 100 policies, 2000 remote pods",
        );
        let rows = vec![
            row(d, "ebpf", "RR latency p50", json!(6.0), Some(1.2)),
            row(d, "azure-npm", "RR latency p50", json!(7.0), Some(1.4)),
            row(c, "ebpf", "cold start to converged", json!(1048.2), None),
            row(c, "ebpf", "policy create p50 (n=5)", json!(10.0), None),
            row(c, "ebpf", "policy create p99 (n=5)", json!(19.0), None),
            row(
                c,
                "azure-npm",
                "cold start to converged",
                json!(42000.0),
                None,
            ),
            row(
                c,
                "azure-npm",
                "policy create p50 (n=1)",
                json!("over 30 s"),
                None,
            ),
            row(
                c,
                "azure-npm",
                "policy create p99 (n=1)",
                json!("over 30 s"),
                None,
            ),
            row(
                c,
                "azure-npm",
                "pod label change p50",
                json!("not measured: why"),
                None,
            ),
            row(m, "ebpf", "agent peak RSS (VmHWM)", json!(105.0), None),
            row(m, "azure-npm", "agent peak RSS (VmHWM)", json!(250.0), None),
            row(
                c,
                "knp",
                "all figures",
                json!("not measured: no queue"),
                None,
            ),
        ];
        let report = json!({"versions": {"azure-npm": "v1.8.12"}, "rows": rows});
        assert_eq!(
            peers(&report).expect("a table"),
            "| 2,000 pods, 100 policies | weir eBPF | Azure NPM v1.8.12 | knp |\n|---|---|---|---|\n\
             | cold start, ms | 1,048 | 42,000 | not measured |\n\
             | policy create p50 / p99, ms | 10 / 19 | over 30 s / over 30 s | not measured |\n\
             | pod label change p50 / p99, ms | – | not measured | not measured |\n\
             | peak RSS, MiB | 105 | 250 | – |\n\
             | TCP throughput, × no enforcement | – | – | – |\n\
             | RR latency p50, × no enforcement | 1.20× | 1.40× | – |\n\
             | CRR latency p50, × no enforcement | – | – | – |\n"
        );
    }

    #[test]
    fn markers_are_filled_and_a_missing_end_is_an_error() {
        let data = json!({"report": [
            {"kernel": "host", "release": "6.18.44", "groups": [
                {"group": "a", "passed": 2, "failed": [], "seconds": 1200, "exit": 0},
                {"group": "b", "passed": 0, "failed": [], "exit": null,
                 "not_applicable": "host only"}]}]});
        let load = |_: &str| Ok(data.clone());
        let doc = "x\n<!-- results kernels results/k.json -->\nold\n<!-- /results -->\ny\n";
        let (made, n) = regenerate(doc, &load).expect("regenerated");
        assert_eq!(n, 1);
        assert_eq!(
            made,
            "x\n<!-- results kernels results/k.json -->\n\
             | group | host 6.18 |\n|---|---|\n\
             | a | pass 2 (1,200 s) |\n\
             | b | n/a: host only |\n\
             <!-- /results -->\ny\n"
        );
        // Made again from the same data, nothing changes.
        assert_eq!(regenerate(&made, &load).expect("again").0, made);
        assert!(regenerate("<!-- results kernels k.json -->\n", &load).is_err());
        assert!(regenerate("<!-- results nosuch k.json -->\n<!-- /results -->", &load).is_err());
    }

    #[test]
    fn a_suites_table_has_a_row_per_run() {
        let run = |suite: &str, dp: &str, sub: u64| {
            json!({"date": "2026-12-06", "report": {
                "suite": suite, "dataplane": dp, "suite_version": "S v1",
                "versions": {"kubernetes": "v1.34.4", "containerd": "v2.2.10", "weir": "abc"},
                "passed": ["a", "b"], "failed": ["c"], "skipped": ["d"],
                "skip_reasons": ["d: this kernel has no SCTP (...)"],
                "subtests_passed": sub, "subtests_failed": 0}})
        };
        let t = suites(&Value::Array(vec![
            run("e2e", "ebpf", 0),
            run("npapi", "iptables", 9),
        ]))
        .unwrap();
        assert_eq!(
            t,
            "| suite | dataplane | passed / run | skipped | date | versions |\n|---|---|---|---|---|---|\n\
             | Kubernetes NetworkPolicy e2e | eBPF | 2 / 3 | 1 (SCTP: the kernel has none) | 2026-12-06 | S v1, Kubernetes v1.34.4, containerd v2.2.10, weir abc |\n\
             | network-policy-api ClusterNetworkPolicy | iptables | 2 / 3 (9 / 9 subtests) | 1 (SCTP: the kernel has none) | 2026-12-06 | S v1, Kubernetes v1.34.4, containerd v2.2.10, weir abc |\n"
        );
        assert!(suites(&json!({"report": {}})).is_err());
    }

    #[test]
    fn a_rolling_switch_table_has_a_row_per_phase_and_the_totals() {
        let counts = |p: u64, f: u64| {
            json!({"probes": p, "cross_node": p - 1, "allowed": p - 2, "allowed_failed": f,
                   "denied": 2, "denied_connected": 0, "unjudged": 0})
        };
        let run = json!({"date": "2026-12-06", "report": {
            "start": {"n-1": "ebpf", "n-2": "iptables"},
            "versions": {"weir": "abc"},
            "flips": [{"node": "n-1", "from": "ebpf", "to": "iptables", "seconds_to_converged": 0.8}],
            "phases": [
                {"phase": "before the first flip (mixed dataplanes)", "seconds": 20.5, "counts": counts(10, 0)},
                {"phase": "flip n-1: ebpf -> iptables", "seconds": 21.0, "counts": counts(12, 1)}],
            "total": counts(22, 1)}});
        assert_eq!(
            rolling_switch(&run).unwrap(),
            "| run | phase | seconds | probes (across nodes) | allowed probes failed | denied probes connected |\n|---|---|---|---|---|---|\n\
             | n-1 ebpf, n-2 iptables; 2026-12-06, weir abc | before the first flip (mixed dataplanes) | 20.5 | 10 (9) | 0 of 8 | 0 of 2 |\n\
             |  | flip n-1: ebpf -> iptables (reported converged after 0.8 s) | 21.0 | 12 (11) | 1 of 10 | 0 of 2 |\n\
             |  | **in all** |  | 22 (21) | 1 of 20 | 0 of 2 |\n"
        );
        assert!(rolling_switch(&json!({"report": {}})).is_err());
    }

    #[test]
    fn the_committed_results_parse() {
        let dir = workspace_root().join("docs/results");
        let mut files = 0;
        for day in std::fs::read_dir(&dir).expect("docs/results") {
            for file in std::fs::read_dir(day.expect("entry").path()).expect("a day") {
                let path = file.expect("entry").path();
                let data = read_json(&path).expect("JSON");
                for key in ["date", "source", "conditions", "report"] {
                    assert!(!data[key].is_null(), "{}: no {key}", path.display());
                }
                files += 1;
            }
        }
        assert!(files > 0);
    }
}
