//! The tolerant reset against the real kernel: sets that other components still
//! reference (rules in the other iptables backend, rules in chains weir does not own,
//! membership in a foreign list:set) never make reset fail, are flushed and reported,
//! and do not change how many `ipset restore` runs reset makes.

use std::collections::BTreeSet;
use std::fmt::Write;
use weir::dataplane::Scope;

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use serde_json::Value;
use weir::dataplane::iptables::IptablesConfig;
use weir_policy::desired::{Peer, SetId};
use weir_tests::desired::{desired, endpoint, pod_set, tcp_rule};
use weir_tests::kernel_state::{all_rules, set_names, set_sizes};
use weir_tests::netns::NetNs;
use weir_tests::node_dataplane::NodeDataplane;
use weir_tests::pods::World;
use weir_tests::probe::{tcp_from, EchoServers};
use weir_tests::weir_bin;

const A: Ipv4Addr = Ipv4Addr::new(10, 202, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(10, 202, 0, 2);
const T: Duration = Duration::from_millis(500);

/// Whose names a scenario uses: weir's own, or Azure NPM's.
struct Names {
    set_prefix: &'static str,
    /// Top chain, entered from FORWARD by `forward_jump`.
    chain: &'static str,
    /// Further owned chains, jumped to from `chain`.
    sub_chains: &'static [&'static str],
    forward_jump: &'static str,
}

const WEIR: Names = Names {
    set_prefix: "weir-",
    chain: "WEIR-FORWARD",
    sub_chains: &["WEIR-INGRESS", "WEIR-EGRESS"],
    forward_jump: "-A FORWARD -j WEIR-FORWARD",
};

const AZURE_NPM: Names = Names {
    set_prefix: "azure-npm-",
    chain: "AZURE-NPM",
    sub_chains: &[
        "AZURE-NPM-INGRESS",
        "AZURE-NPM-EGRESS",
        "AZURE-NPM-ACCEPT",
        "AZURE-NPM-INGRESS-2697641196",
    ],
    forward_jump: "-A FORWARD -m conntrack --ctstate NEW -j AZURE-NPM",
};

/// Sets the reset may destroy in every scenario.
const DELETABLE: usize = 50;
/// Owned list:sets among them, each holding other owned sets.
const OWNED_LISTS: usize = 3;

fn undeletable_name(n: &Names, i: usize) -> String {
    format!("{}u{i}", n.set_prefix)
}

fn deletable_name(n: &Names, i: usize) -> String {
    format!("{}d{i}", n.set_prefix)
}

fn is_v6(i: usize) -> bool {
    i.is_multiple_of(10) && i < DELETABLE - OWNED_LISTS
}

/// Builds the owner's state plus `k` sets that something else references:
/// i % 3 == 0: a rule in the legacy backend (the owner's rules are in nft);
/// i % 3 == 1: a rule in an nft chain the owner does not own;
/// i % 3 == 2: membership in a foreign list:set.
fn build(ns: &NetNs, n: &Names, k: usize) -> Result<()> {
    let mut sets = String::new();
    let net = |i: usize| format!("10.{}.{}.0/24", i / 256, i % 256);
    for i in 0..k {
        let name = undeletable_name(n, i);
        writeln!(sets, "create {name} hash:net family inet")?;
        writeln!(sets, "add {name} {}", net(i))?;
    }
    for i in 0..DELETABLE - OWNED_LISTS {
        let name = deletable_name(n, i);
        if is_v6(i) {
            writeln!(sets, "create {name} hash:net family inet6")?;
            writeln!(sets, "add {name} fd00:{i:x}::/64")?;
        } else {
            let (net, hole) = (net(2000 + i), net(2000 + i).replace("/24", "/28"));
            writeln!(sets, "create {name} hash:net family inet")?;
            writeln!(sets, "add {name} {net}")?;
            writeln!(sets, "add {name} {hole} nomatch")?;
        }
    }
    for l in 0..OWNED_LISTS {
        let list = deletable_name(n, DELETABLE - OWNED_LISTS + l);
        writeln!(sets, "create {list} list:set")?;
        // v4 sets that the owner's rules reference as well.
        writeln!(sets, "add {list} {}", deletable_name(n, 1 + l))?;
    }
    writeln!(sets, "create foreign-list list:set size {}", k + 8)?;
    for i in (0..k).filter(|i| i % 3 == 2) {
        writeln!(sets, "add foreign-list {}", undeletable_name(n, i))?;
    }
    ns.ok("ipset", &["restore"], Some(&sets))?;

    // The owner's chains in nft, entered from FORWARD, referencing its sets.
    let mut nft4 = String::from("*filter\n:FOREIGN-CHAIN - [0:0]\n");
    let mut nft6 = String::from("*filter\n");
    for chain in std::iter::once(&n.chain).chain(n.sub_chains) {
        writeln!(nft4, ":{chain} - [0:0]")?;
        writeln!(nft6, ":{chain} - [0:0]")?;
    }
    for table in [&mut nft4, &mut nft6] {
        writeln!(
            table,
            "-A FORWARD -m comment --comment \"not ours\" -j ACCEPT"
        )?;
        writeln!(table, "{}", n.forward_jump)?;
        for sub in n.sub_chains {
            writeln!(table, "-A {} -j {sub}", n.chain)?;
        }
    }
    for i in 0..DELETABLE {
        let (set, chain) = (deletable_name(n, i), n.sub_chains[i % n.sub_chains.len()]);
        let table = if is_v6(i) { &mut nft6 } else { &mut nft4 };
        writeln!(table, "-A {chain} -m set --match-set {set} src -j ACCEPT")?;
    }
    for i in (0..k).filter(|i| i % 3 == 1) {
        let set = undeletable_name(n, i);
        writeln!(
            nft4,
            "-A FOREIGN-CHAIN -m set --match-set {set} dst -j ACCEPT"
        )?;
    }
    nft4.push_str("COMMIT\n");
    nft6.push_str("COMMIT\n");
    ns.ok("iptables-nft-restore", &["--noflush"], Some(&nft4))?;
    ns.ok("ip6tables-nft-restore", &["--noflush"], Some(&nft6))?;

    let mut legacy = String::from("*filter\n");
    for i in (0..k).filter(|i| i.is_multiple_of(3)) {
        let set = undeletable_name(n, i);
        writeln!(legacy, "-A INPUT -m set --match-set {set} src -j ACCEPT")?;
    }
    legacy.push_str("COMMIT\n");
    ns.ok("iptables-legacy-restore", &["--noflush"], Some(&legacy))?;
    Ok(())
}

/// Runs `weir reset --output json` in the namespace; reset must exit 0.
fn reset(ns: &NetNs, extra: &[&str]) -> Result<Value> {
    let bin = weir_bin::path()?;
    let bpf_root = format!("/sys/fs/bpf/weir-test-reset-{}", std::process::id());
    let mut args = vec!["reset", "--output", "json", "--bpf-root", &bpf_root];
    args.extend(extra);
    let out = ns.run(bin.to_str().context("binary path")?, &args, None)?;
    let stdout = &out.stdout;
    ensure!(
        out.success,
        "weir reset failed in {}: {}\n{stdout}",
        ns.name,
        out.stderr
    );
    serde_json::from_str(stdout).with_context(|| format!("reset report is not JSON: {stdout}"))
}

fn undeletable_in(report: &Value) -> BTreeSet<String> {
    report["undeletable_sets"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|u| !u["reason"].as_str().unwrap_or("").is_empty())
        .filter_map(|u| u["name"].as_str().map(str::to_string))
        .collect()
}

fn count(report: &Value, key: &str) -> usize {
    report[key].as_array().map_or(0, Vec::len)
}

fn owned_sets(ns: &NetNs, n: &Names) -> Result<BTreeSet<String>> {
    Ok(set_names(ns)?
        .into_iter()
        .filter(|s| s.starts_with(n.set_prefix))
        .collect())
}

/// Checks everything a reset of `k` undeletable sets promises; returns the report.
fn reset_and_check(ns: &NetNs, n: &Names, k: usize, extra: &[&str]) -> Result<Value> {
    let report = reset(ns, extra)?;
    let expected: BTreeSet<String> = (0..k).map(|i| undeletable_name(n, i)).collect();
    ensure!(
        undeletable_in(&report) == expected,
        "K={k}: reported undeletable sets differ: {:?}",
        report["undeletable_sets"]
    );
    ensure!(
        owned_sets(ns, n)? == expected,
        "K={k}: sets left in the kernel are not exactly the undeletable ones"
    );
    for (name, size) in set_sizes(ns)? {
        ensure!(
            !expected.contains(&name) || size == 0,
            "K={k}: undeletable set {name} was not flushed ({size} entries)"
        );
    }
    let rules = all_rules(ns)?;
    let owned_chain = |line: &str| {
        std::iter::once(&n.chain)
            .chain(n.sub_chains)
            .any(|c| line.contains(c))
    };
    ensure!(
        !rules.lines().any(owned_chain),
        "K={k}: owned chains or jumps are left:\n{rules}"
    );
    ensure!(
        rules.contains("--comment \"not ours\" -j ACCEPT") && rules.contains(":FOREIGN-CHAIN"),
        "K={k}: reset touched rules it does not own:\n{rules}"
    );
    Ok(report)
}

/// After a reset, the iptables dataplane starts on the same node and enforces: b admits
/// TCP 80 from a only. Sets the reset had to leave are reported, not fatal.
fn dataplane_enforces_after_reset(world: &World, leftover: &BTreeSet<String>) -> Result<()> {
    let _servers = EchoServers::start(&world.pod("b").ns, &[80, 81]);
    let state = desired(
        vec![pod_set(1, &[A])],
        vec![
            // a is a known pod (not isolated): unknown pod interfaces are isolated.
            endpoint("x/a", A, None, None),
            endpoint(
                "x/b",
                B,
                Some(vec![tcp_rule(Peer::Set(SetId(1)), 80, 80, "x/allow-a", 0)]),
                None,
            ),
        ],
    );
    let mut dp = NodeDataplane::start(&world.node, IptablesConfig::default())?;
    let report = dp.converge(&state, Scope::Kernel)?;
    for failure in &report.failures {
        let name = failure.object.trim_start_matches("ipset ");
        ensure!(
            leftover.contains(name),
            "unexpected dataplane failure: {failure:?}"
        );
    }
    let a_ns = &world.pod("a").ns;
    ensure!(
        tcp_from(a_ns, SocketAddr::from((B, 80)), T),
        "a->b:80 must pass after reset"
    );
    ensure!(
        !tcp_from(a_ns, SocketAddr::from((B, 81)), T),
        "a->b:81 must be dropped after reset"
    );
    Ok(())
}

fn restore_runs(report: &Value) -> u64 {
    report["ipset_restore_runs"].as_u64().unwrap_or(u64::MAX)
}

#[test]
fn any_number_of_undeletable_weir_sets_costs_the_same_restore_runs() -> Result<()> {
    let mut runs = Vec::new();
    for k in [0, 1, 11, 15, 16, 17, 100, 1000] {
        let world = World::new(&format!("rk{k}"), &[("a", A), ("b", B)]);
        let ns = NetNs::attach(&world.node);
        build(&ns, &WEIR, k)?;
        let report = reset_and_check(&ns, &WEIR, k, &[])?;
        println!(
            "K={k}: reset {:.1} ms, {} ipset restore run(s), {} destroyed",
            report["duration_ms"].as_f64().unwrap_or(-1.0),
            restore_runs(&report),
            count(&report, "destroyed_sets")
        );
        ensure!(
            count(&report, "destroyed_sets") == DELETABLE,
            "K={k}: expected {DELETABLE} destroyed sets: {report}"
        );
        runs.push((k, restore_runs(&report)));
        dataplane_enforces_after_reset(&world, &undeletable_in(&report))?;
    }
    ensure!(
        runs.iter().all(|(_, r)| *r == 1),
        "ipset restore runs depend on K: {runs:?}"
    );
    Ok(())
}

#[test]
fn reset_is_idempotent_and_destroys_sets_once_their_references_go() -> Result<()> {
    let ns = NetNs::new("rstagain")?;
    build(&ns, &WEIR, 17)?;
    reset_and_check(&ns, &WEIR, 17, &[])?;
    let again = reset_and_check(&ns, &WEIR, 17, &[])?;
    ensure!(
        count(&again, "destroyed_sets") == 0 && count(&again, "removed_iptables") == 0,
        "second reset removed something: {again}"
    );
    // The foreign references go away: the next reset destroys the sets.
    ns.sh("iptables-legacy -F INPUT && iptables-nft -F FOREIGN-CHAIN && ipset flush foreign-list")?;
    let last = reset_and_check(&ns, &WEIR, 0, &[])?;
    ensure!(count(&last, "destroyed_sets") == 17, "{last}");
    Ok(())
}

#[test]
fn dry_run_changes_nothing() -> Result<()> {
    let ns = NetNs::new("rstdry")?;
    build(&ns, &WEIR, 5)?;
    let (sets, rules) = (set_names(&ns)?, all_rules(&ns)?);
    let report = reset(&ns, &["--dry-run"])?;
    ensure!(report["dry_run"] == Value::Bool(true), "{report}");
    ensure!(count(&report, "destroyed_sets") == DELETABLE, "{report}");
    ensure!(undeletable_in(&report).len() == 5, "{report}");
    ensure!(restore_runs(&report) == 0, "dry run ran ipset restore");
    ensure!(set_names(&ns)? == sets, "dry run changed sets");
    let without_comments = |t: &str| {
        t.lines()
            .filter(|l| !l.starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n")
    };
    ensure!(
        without_comments(&all_rules(&ns)?) == without_comments(&rules),
        "dry run changed rules"
    );
    Ok(())
}

#[test]
fn migrating_from_azure_npm_removes_its_state_and_survives_leaked_sets() -> Result<()> {
    for k in [0, 16, 20, 100] {
        let world = World::new(&format!("rn{k}"), &[("a", A), ("b", B)]);
        let ns = NetNs::attach(&world.node);
        build(&ns, &AZURE_NPM, k)?;
        let report = reset_and_check(&ns, &AZURE_NPM, k, &["--migrate-from", "azure-npm"])?;
        ensure!(report["azure_npm"] == Value::Bool(true), "{report}");
        ensure!(restore_runs(&report) == 1, "K={k}: {report}");
        // NPM's leaked sets are not weir's: the dataplane does not even report them.
        dataplane_enforces_after_reset(&world, &BTreeSet::new())?;
    }
    Ok(())
}

#[test]
fn azure_npm_state_is_removed_when_found_without_the_flag() -> Result<()> {
    let ns = NetNs::new("rstnpmauto")?;
    build(&ns, &AZURE_NPM, 16)?;
    let report = reset_and_check(&ns, &AZURE_NPM, 16, &[])?;
    ensure!(report["azure_npm"] == Value::Bool(true), "{report}");
    Ok(())
}

/// A node with only the nft tools installed (no iptables-legacy): the legacy backend is
/// skipped with a note, weir's nft state is removed, and reset succeeds.
#[test]
fn nft_only_node_without_legacy_tools_resets_cleanly() -> Result<()> {
    let ns = NetNs::new("rstnft")?;
    build(&ns, &WEIR, 0)?;
    let bin_dir = std::env::temp_dir().join(format!("weir-test-nftonly-{}", std::process::id()));
    std::fs::create_dir_all(&bin_dir)?;
    let _cleanup = RemoveDir(bin_dir.clone());
    for tool in [
        "ipset",
        "iptables-nft-save",
        "ip6tables-nft-save",
        "iptables-nft-restore",
        "ip6tables-nft-restore",
        "tc",
        "ip",
    ] {
        let found = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
            .iter()
            .map(|d| std::path::Path::new(d).join(tool))
            .find(|p| p.exists())
            .with_context(|| format!("prerequisite missing: {tool}"))?;
        std::os::unix::fs::symlink(found, bin_dir.join(tool))?;
    }
    let bin = weir_bin::path()?;
    let path = format!("PATH={}", bin_dir.display());
    // Its own pin root: bpffs is the host's, whatever the network namespace.
    let bpf_root = format!("/sys/fs/bpf/weir-test-nftonly-{}", std::process::id());
    let out = ns.run(
        "env",
        &[
            &path,
            bin.to_str().context("binary path")?,
            "reset",
            "--output",
            "json",
            "--bpf-root",
            &bpf_root,
        ],
        None,
    )?;
    let stdout = &out.stdout;
    ensure!(out.success, "reset failed: {stdout}");
    let report: Value = serde_json::from_str(stdout)?;
    ensure!(
        count(&report, "skipped") == 2,
        "legacy v4 and v6 skipped: {report}"
    );
    ensure!(count(&report, "destroyed_sets") == DELETABLE, "{report}");
    ensure!(owned_sets(&ns, &WEIR)?.is_empty(), "sets left");
    Ok(())
}

struct RemoveDir(std::path::PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
