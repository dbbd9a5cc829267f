//! `weir-bench`: measures weir on this machine against no enforcement and against its own
//! iptables path, side by side in one run (the machine is noisy, so every comparison is
//! taken within the run). Prints one table and writes the same rows as JSON (`--out`).
//! Exits non-zero when any figure could not be measured. `cargo xtask bench [--quick]
//! [--peers]` builds the binaries it measures and runs it.
//!
//! Scenarios, each on fresh network namespaces that are removed afterwards:
//! - datapath: TCP throughput (iperf3) and request/response latency between two local
//!   pods, with N policies and M remote pods, for no enforcement, eBPF and iptables; and
//!   with the most policies plus C ClusterNetworkPolicies;
//! - per-path cost: the eBPF programs' nanoseconds per run on each path a packet can take
//!   (BPF_PROG_TEST_RUN, on the programs and maps of the largest world's agent) and the
//!   instructions the verifier counts;
//! - convergence: cold start, then policy creates, updates and deletes, pod and namespace
//!   label changes, each kind observed by a probe (p50, p99, max);
//! - memory: the agent's peak RSS and its kernel state, at M and at a larger M;
//! - reset: many weir sets (some undeletable) and chains, removed by `weir reset`.
//!
//! `--cluster` measures instead N agents against one API server (see [`cluster`]).
mod agent;
mod bpf_maps;
mod cluster;
mod convergence;
mod memory;
mod netns;
mod noop_hooks;
mod prog_cost;
mod report;
mod reset;
mod scale;
mod topology;
mod traffic;
mod trial;
mod world;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Result};
use clap::Parser;

use agent::{Dataplane, OverLimit, PeerBinary, Source};
use report::Report;
use report::Row;
use scale::Scale;
use trial::{Env, Setup};
use world::World;

#[derive(Parser)]
#[command(
    name = "weir-bench",
    about = "Measure the weir agent binary given against no enforcement, its other dataplane and (--peers) the peers; prints a table and writes the rows as JSON. `cargo xtask bench` builds everything and runs it."
)]
struct Cli {
    /// The `weir` binary to measure.
    #[arg(long)]
    weir: PathBuf,
    /// The `weir-lab` binary, whose `kube` commands run the cluster path's control plane.
    #[arg(long)]
    lab: PathBuf,
    /// Where to write the report as JSON.
    #[arg(long)]
    out: PathBuf,
    /// Where each setup keeps its manifests, status file and agent log.
    #[arg(long)]
    run_dir: PathBuf,
    /// Scaled down to about a minute.
    #[arg(long)]
    quick: bool,
    /// Instead: weir's dataplanes and the peers side by side on the largest world through
    /// the API server (needs --kube-router; --azure-npm adds Azure NPM).
    #[arg(long)]
    peers: bool,
    /// Instead: N agents (`--dataplane none`, each a different node) against one real
    /// kube-apiserver, for each N of --cluster-agents: the API server's cost, convergence
    /// to every agent, cold start of all at once, an API server restart.
    #[arg(long, conflicts_with = "peers")]
    cluster: bool,
    /// --cluster: the agent counts, in order, each a run on the same control plane.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 10, 30], requires = "cluster")]
    cluster_agents: Vec<usize>,
    /// --cluster: the world's pods (on 100 nodes).
    #[arg(long, default_value_t = 50_000, requires = "cluster")]
    cluster_pods: usize,
    /// --cluster: the world's NetworkPolicies.
    #[arg(long, default_value_t = 1000, requires = "cluster")]
    cluster_policies: usize,
    /// --cluster: changes measured per agent count.
    #[arg(long, default_value_t = 10, requires = "cluster",
          value_parser = clap::value_parser!(u64).range(1..))]
    cluster_changes: u64,
    /// --cluster: the rate (changes a second) of the changes written without waiting for
    /// the agents (`weir-lab kube churn`), after the ones written one at a time.
    #[arg(long, default_value_t = 10.0, requires = "cluster")]
    cluster_rate: f64,
    /// --cluster: how many changes to write at --cluster-rate per agent count (rounded up
    /// to a multiple of 4, a whole cycle of the world's changes); 0: none.
    #[arg(long, default_value_t = 100, requires = "cluster")]
    cluster_rate_changes: usize,
    /// --cluster: the largest N once more with the agents on streaming lists
    /// (`weir agent --lists stream`).
    #[arg(long, requires = "cluster")]
    cluster_streaming_lists: bool,
    /// --cluster: the largest N once more with the agents reading Pods in JSON
    /// (`weir agent --pod-encoding json`) instead of protobuf.
    #[arg(long, requires = "cluster")]
    cluster_json_pods: bool,
    /// --cluster: the largest N once more with the agents reading from `weir relay`'s
    /// etcd (`weir agent --relay`), the relay started first.
    #[arg(long, requires = "cluster")]
    cluster_relay: bool,
    /// --cluster: after the sweep over N, the world resized to each of these pod counts in
    /// turn (comma-separated; one equal to --cluster-pods is skipped) and the largest N
    /// run again at each: the sweep over the cluster's size.
    #[arg(long, value_delimiter = ',', requires = "cluster")]
    cluster_pod_sweep: Vec<usize>,
    /// The kube-router binary (`cargo xtask peers` builds it).
    #[arg(long, requires = "peers")]
    kube_router: Option<PathBuf>,
    /// The Azure NPM binary (`cargo xtask peers` builds it from its source archive), with
    /// its ConfigMap `azure-npm.json` beside it.
    #[arg(long, requires = "peers")]
    azure_npm: Option<PathBuf>,
    /// --peers: a peer's change not seen by the probe (or whose rules do not settle)
    /// within this many seconds is reported as "over N s" and ends its kind's series.
    #[arg(long, default_value_t = 60, requires = "peers")]
    peer_change_limit: u64,
    /// --peers: the world's policies (default: the full bench's largest world).
    #[arg(long, requires = "peers")]
    peer_policies: Option<usize>,
    /// --peers: the world's remote pods (default: the full bench's).
    #[arg(long, requires = "peers")]
    peer_remote_pods: Option<usize>,
    /// --peers: changes of each kind per enforcer (default: the full bench's).
    #[arg(long, requires = "peers")]
    peer_changes: Option<usize>,
    /// Changes of each kind per dataplane in the convergence scenario (default: the full
    /// bench's 100, the quick run's 4); each kind's p99 wants about 100.
    #[arg(long)]
    changes: Option<usize>,
    /// One of kube-router's flags (deploy/kube-router-flags); repeat for each.
    #[arg(
        long = "kube-router-arg",
        allow_hyphen_values = true,
        value_name = "FLAG"
    )]
    kube_router_args: Vec<String>,
    /// The peers' versions, as the report's notes quote them (e.g. `kube-router v2.5.0`).
    #[arg(long, default_value = "")]
    peer_versions: String,
    /// The build profile of the binaries measured, as the report records it.
    #[arg(long, default_value = "release")]
    profile: String,
    /// Only these scenarios of the largest world, without its traffic: `path-cost` (the
    /// eBPF programs' per-path cost and instruction counts), `convergence` (cold start and
    /// the changes, both dataplanes). Repeat for each; not with --peers.
    #[arg(long, value_enum, conflicts_with = "peers")]
    only: Vec<Only>,
    /// With --only: this dataplane alone (`ebpf` or `iptables`; default both).
    #[arg(long, value_parser = ["ebpf", "iptables"], requires = "only")]
    only_dataplane: Option<String>,
    /// The command line the report records (the wrapper's, `cargo xtask bench ...`).
    #[arg(long)]
    command: Option<String>,
}

/// `--only`'s scenarios.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Only {
    PathCost,
    Convergence,
    /// The datapath with 10, 100 and 1,000 ClusterNetworkPolicies (file mode, every
    /// dataplane and no enforcement), as the full run measures it.
    ClusterDatapath,
}

/// What `--peers` measures differently for a peer, which reports no convergence.
fn peer_notes(versions: &str, limit: Duration) -> Vec<String> {
    vec![
        format!("peers ({versions}, deploy/peer-versions; kube-router built from the Go module proxy, Azure NPM from its source archive): every enforcer watches the same kube-apiserver world; a peer runs with the lab admin's credentials, in weir's place in the node's namespace, as its DaemonSet would (kube-router: --run-firewall only; Azure NPM: `azure-npm start` with its Linux DaemonSet's ConfigMap, v2 dataplane on iptables and ipset, the lab's metadata stub and KUBE-IPTABLES-HINT chain)"),
        "a peer's cold start: from starting it to the instant its rules (iptables-save and ipset save in the node) last changed before standing still for 1 s (kube-router, after a whole sync logged) or 1.5 s (Azure NPM, once it logged its start and jumps from FORWARD to AZURE-NPM); its convergence is probe-observed like weir's, and after each change the bench waits for its rules to stand still; a peer has no 'in the agent' share".into(),
        format!("a peer's change limit: {0} s; a change the probe does not see within it is 'over {0} s' (it ranks above every measured change of its kind) and ends that kind's series, as does a change after which the peer's rules do not settle within it", limit.as_secs()),
        "memory of a peer: VmHWM of its process; ipset memory is every set in the node (only the peer's exist there)".into(),
    ]
}

fn notes() -> Vec<String> {
    vec![
        "datapath: RR = 64-byte request/response on one TCP connection, CRR = a new connection per request, the client and the echo server pinned to one CPU (a wakeup across CPUs costs tens of µs on these virtual machines); ratios are to no enforcement in the same run".into(),
        format!("{}: in the largest datapath world, no enforcement plus a program that does nothing (returns TC_ACT_OK) on both TCX hooks of each pod's host-side interface, where weir's eBPF classifiers attach: the floor of any eBPF enforcement at those hooks", trial::NOOP_HOOKS),
        "per-path cost: BPF_PROG_TEST_RUN of the eBPF agent's pinned programs, as if on the client's or the server's host-side interface, with the largest world in their maps (before the convergence changes); each path's figure is the median of 3 rounds' mean ns per run (100,000 runs a round; a new allowed flow 300, within the endpoint's budget of new CT entries), each run's verdict and the WEIR_COUNTERS slot its path counts checked; the established and reply paths are the four program runs of a round trip; instructions: bpf_prog_info's verified_insns (what the verifier processed over all paths), xlated_prog_len / 8 and jited_prog_len".into(),
        "convergence and both memory worlds: cluster mode, the agent watching the real kube-apiserver (etcd and kube-apiserver in the bench node's namespace) with the DaemonSet's ServiceAccount; a change is measured from just before its first write request (a server-side apply of the changed Pod, Namespace or NetworkPolicy, or a delete, on a connection already open) to the first probe connection that sees the new verdict; 'in the agent' is the agent's own share of it (weir_policy_implementation_delay_seconds: from the watch event received to the dataplane programmed); 'watch delay' is the part before it, from the write to the agent's source receiving the change (the write request's start against the status file's change_received_monotonic_ns, one clock); p99 is the nearest rank, of 100 changes per kind in the full bench (policy update: 200)".into(),
        "cold start: from starting `weir agent` (the world already on the API server, or in its manifest file) to its status file reporting the world converged; its phases are the agent's own (status file `startup`): listed = from its start to the source's first complete state, compiled = the engine's compile, loaded = kernel probes and building the dataplane (eBPF: programs loaded and attached), programmed = the state written into the kernel, cleaned = the other dataplane's leftovers removed".into(),
        format!("the datapath worlds below the largest and the cluster-policy worlds: file mode, the agent polling a manifest file every {} ms", agent::POLL_MS),
        "memory: VmHWM of the agent process; BPF map memory is the kernel's memlock for the maps the agent holds; ipset memory is `ipset list` 'Size in memory' of weir's sets; other ratios are to iptables".into(),
    ]
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("weir-bench: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the bench builds network namespaces, loads BPF programs and edits iptables: run it as root");
    }
    for tool in ["ip", "ipset", "iptables-restore", "iperf3"] {
        if Command::new(tool).arg("--help").output().is_err() {
            bail!("the bench needs `{tool}` on PATH; run `cargo xtask setup`");
        }
    }
    for (flag, binary) in [("--weir", Some(&cli.weir)), ("--lab", Some(&cli.lab))]
        .into_iter()
        .chain([
            ("--kube-router", cli.kube_router.as_ref()),
            ("--azure-npm", cli.azure_npm.as_ref()),
        ])
    {
        if let Some(binary) = binary.filter(|b| !b.is_file()) {
            bail!(
                "{flag} {}: no such file (`cargo xtask bench` builds it)",
                binary.display()
            );
        }
    }
    if cli.cluster {
        return run_cluster(cli);
    }
    let (quick, peers) = (cli.quick, cli.peers);
    let kube_router = match (peers, cli.kube_router) {
        (true, None) => {
            bail!("--peers needs --kube-router (`cargo xtask bench --peers` builds it)")
        }
        (_, binary) => binary.map(|binary| PeerBinary {
            binary,
            args: cli.kube_router_args,
        }),
    };
    if let Some(npm) = &cli.azure_npm {
        let config = npm.with_file_name(agent::NPM_CONFIG);
        if !config.is_file() {
            bail!(
                "--azure-npm: {} not found beside it (`cargo xtask peers --build-only` puts it there)",
                config.display()
            );
        }
    }
    let azure_npm = cli.azure_npm.map(|binary| PeerBinary {
        binary,
        args: Vec::new(),
    });
    let peer_limit = Duration::from_secs(cli.peer_change_limit);
    let mut scale = Scale::new(quick);
    scale.changes = cli.changes.unwrap_or(scale.changes);
    scale.resize_peers(cli.peer_policies, cli.peer_remote_pods, cli.peer_changes);
    netns::sweep_stale();
    let started = Instant::now();
    let env = Env {
        weir: cli.weir,
        lab: cli.lab,
        kube_router,
        azure_npm,
        peer_limit,
        run_dir: cli.run_dir,
        scale,
    };
    let mut report = Report {
        command: cli
            .command
            .unwrap_or_else(|| std::env::args().collect::<Vec<_>>().join(" ")),
        quick,
        profile: cli.profile,
        kernel: kernel_release(),
        started_unix: SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        seconds: 0.0,
        notes: match peers {
            true => notes()
                .into_iter()
                .take(3)
                .chain(peer_notes(&cli.peer_versions, peer_limit))
                .collect(),
            false => notes(),
        },
        versions: versions(&cli.peer_versions),
        rows: Vec::new(),
    };
    match peers {
        true => run_peers(&env, &mut report),
        false if !cli.only.is_empty() => {
            run_only(&env, &mut report, &cli.only, cli.only_dataplane.as_deref())
        }
        false => {
            binary_rows(&env.weir, &mut report);
            run_scenarios(&env, &mut report);
        }
    }
    report.seconds = (started.elapsed().as_secs_f64() * 10.0).round() / 10.0;

    let json = cli.out;
    report.write_json(&json)?;
    println!("\n{}", report.table());
    println!(
        "{} in {:.0}s ({} build); JSON: {}",
        report.command,
        report.seconds,
        report.profile,
        json.display()
    );
    let failures = report.failures();
    if !failures.is_empty() {
        bail!(
            "{} figure(s) could not be measured (see ERROR rows)",
            failures.len()
        );
    }
    if let Some(row) = report
        .rows
        .iter()
        .find(|r| r.value.as_str().is_some_and(|v| v.starts_with("FAILED")))
    {
        bail!("{}: {}", row.scenario, row.value);
    }
    Ok(())
}

/// `--cluster`: its own report, written and checked as the others.
fn run_cluster(cli: Cli) -> Result<()> {
    if Command::new("ss").arg("--version").output().is_err() {
        bail!("the cluster bench needs `ss` (iproute2) on PATH");
    }
    if !(cli.cluster_rate > 0.0 && cli.cluster_rate <= 1000.0) {
        bail!(
            "--cluster-rate {}: changes a second must be above 0 and at most 1000",
            cli.cluster_rate
        );
    }
    let plan = cluster::Plan {
        agents: cli.cluster_agents,
        pods: cli.cluster_pods,
        policies: cli.cluster_policies,
        changes: cli.cluster_changes as usize,
        rate: cli.cluster_rate,
        rate_changes: cli.cluster_rate_changes,
        streaming_too: cli.cluster_streaming_lists,
        json_pods_too: cli.cluster_json_pods,
        relay_too: cli.cluster_relay,
        pod_sweep: cli.cluster_pod_sweep,
    };
    netns::sweep_stale();
    let started = Instant::now();
    let mut report = Report {
        command: cli
            .command
            .unwrap_or_else(|| std::env::args().collect::<Vec<_>>().join(" ")),
        quick: cli.quick,
        profile: cli.profile,
        kernel: kernel_release(),
        started_unix: SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        seconds: 0.0,
        notes: cluster::notes(&plan),
        versions: Default::default(),
        rows: cluster::run(&cli.weir, &cli.lab, &cli.run_dir, &plan),
    };
    report.seconds = (started.elapsed().as_secs_f64() * 10.0).round() / 10.0;
    report.write_json(&cli.out)?;
    println!("\n{}", report.table());
    println!(
        "{} in {:.0}s ({} build); JSON: {}",
        report.command,
        report.seconds,
        report.profile,
        cli.out.display()
    );
    let failures = report.failures();
    if !failures.is_empty() {
        bail!(
            "{} figure(s) could not be measured (see ERROR rows)",
            failures.len()
        );
    }
    Ok(())
}

/// The measured binary's size, as built and stripped the way the image strips it.
fn binary_rows(weir: &std::path::Path, report: &mut Report) {
    const SCENARIO: &str = "binary";
    let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    match std::fs::metadata(weir) {
        Ok(m) => report.rows.push(Row::number(
            SCENARIO,
            "-",
            "weir as built",
            mib(m.len()),
            "MiB",
        )),
        Err(e) => report.rows.push(Row::failed(
            SCENARIO,
            "-",
            "weir as built",
            format!("{}: {e}", weir.display()),
        )),
    }
    let stripped = weir.with_extension("stripped");
    let strip = std::process::Command::new("objcopy")
        .arg("--strip-all")
        .arg(weir)
        .arg(&stripped)
        .output();
    match (strip, std::fs::metadata(&stripped)) {
        (Ok(out), Ok(m)) if out.status.success() => report.rows.push(Row::number(
            SCENARIO,
            "-",
            "weir stripped (as in the image)",
            mib(m.len()),
            "MiB",
        )),
        (out, _) => report.rows.push(Row::failed(
            SCENARIO,
            "-",
            "weir stripped (as in the image)",
            format!("objcopy --strip-all: {out:?}"),
        )),
    }
    let _ = std::fs::remove_file(&stripped);
}

fn run_scenarios(env: &Env, report: &mut Report) {
    let scale = &env.scale;
    let (max, remote) = (scale.max_policies(), scale.remote_pods);
    let convergence = format!("convergence, {max} policies, {remote} remote pods");
    let memory = format!("memory, {max} policies, {remote} remote pods");
    let path_cost = format!("per-path cost, {max} policies, {remote} remote pods");
    for &n in &scale.policy_counts {
        let datapath = format!("datapath, {n} policies, {remote} remote pods");
        progress(&datapath);
        let last = n == max;
        let mut planned = vec![&datapath];
        if last {
            planned.extend([&path_cost, &convergence, &memory]);
        }
        // The largest world's agents watch the real API server: their convergence, cold
        // start and memory are the cluster path's.
        let source = if last { Source::Cluster } else { Source::File };
        let world = || World::new(n, remote);
        let mut setups = datapath_setups(
            env,
            report,
            &planned,
            &n.to_string(),
            world,
            source,
            Lineup {
                enforcers: &Dataplane::ALL,
                noop_hooks: last,
            },
        );
        if last {
            // Before the changes, so that the maps hold the world as the datapath saw it.
            progress(&path_cost);
            for setup in &setups {
                report.rows.extend(setup.path_cost_rows(&path_cost));
            }
            converge_and_measure(env, report, &mut setups, &convergence, &memory);
        }
    }
    cluster_datapath(env, report);
    // The second memory world through the API server too, as the 20,000-pod one: the lab
    // writes it 16 requests at a time (about 100 s per 20,000 pods here).
    let large = scale.large_remote_pods;
    let memory_large = format!("memory, {max} policies, {large} remote pods");
    progress(&memory_large);
    for dp in Dataplane::ALL {
        let tag = format!("{}{large}", dp.as_str());
        match Setup::enforcing(env, &tag, dp, World::new(max, large), Source::Cluster) {
            Ok(setup) => {
                report.rows.extend(cold_start_rows(&memory_large, &setup));
                let rows = setup.memory_rows(&memory_large);
                report
                    .rows
                    .extend(rows_or_failure(rows, &memory_large, dp.as_str()));
            }
            Err(e) => report.rows.extend(unavailable(&[&memory_large], dp, &e)),
        }
    }
    for scenario in [&convergence, &memory, &memory_large] {
        report.add_ratios(scenario, Dataplane::Iptables.as_str());
    }
    let reset = reset::scenario(scale);
    progress(&reset);
    report.rows.extend(reset::rows(&env.weir, scale, &reset));
}

/// The datapath under each count of ClusterNetworkPolicies over the largest world (file
/// mode): every dataplane against no enforcement, in interleaved rounds.
fn cluster_datapath(env: &Env, report: &mut Report) {
    let scale = &env.scale;
    let (max, remote) = (scale.max_policies(), scale.remote_pods);
    for &c in scale.cluster_policy_counts {
        let datapath =
            format!("datapath, {max} policies + {c} cluster policies, {remote} remote pods");
        progress(&datapath);
        let world = || World::new(max, remote).with_cluster_policies(c);
        let tag = format!("c{c}");
        datapath_setups(
            env,
            report,
            &[&datapath],
            &tag,
            world,
            Source::File,
            Lineup {
                enforcers: &Dataplane::ALL,
                noop_hooks: false,
            },
        );
    }
}

/// `--only`: the largest world's enforcing setups through the API server, as the full run
/// makes them, and only the scenarios asked for.
fn run_only(env: &Env, report: &mut Report, only: &[Only], dataplane: Option<&str>) {
    if only.contains(&Only::ClusterDatapath) {
        cluster_datapath(env, report);
    }
    let scale = &env.scale;
    let (max, remote) = (scale.max_policies(), scale.remote_pods);
    let path_cost = format!("per-path cost, {max} policies, {remote} remote pods");
    let convergence = format!("convergence, {max} policies, {remote} remote pods");
    let planned: Vec<&String> = [
        (Only::PathCost, &path_cost),
        (Only::Convergence, &convergence),
    ]
    .into_iter()
    .filter(|(o, _)| only.contains(o))
    .map(|(_, s)| s)
    .collect();
    if planned.is_empty() {
        return;
    }
    let enforcers: &[Dataplane] = match only.contains(&Only::Convergence) {
        true => &Dataplane::ALL,
        false => &[Dataplane::Ebpf],
    };
    for &dp in enforcers
        .iter()
        .filter(|dp| dataplane.is_none_or(|d| d == dp.as_str()))
    {
        progress(&format!("{}: {}", planned[0], dp.as_str()));
        let tag = format!("{}{max}", dp.as_str());
        let world = World::new(max, remote);
        let mut setup = match Setup::enforcing(env, &tag, dp, world, Source::Cluster) {
            Ok(setup) => setup,
            Err(e) => {
                report.rows.extend(unavailable(&planned, dp, &e));
                continue;
            }
        };
        if only.contains(&Only::PathCost) {
            report.rows.extend(setup.path_cost_rows(&path_cost));
        }
        if only.contains(&Only::Convergence) {
            report.rows.extend(cold_start_rows(&convergence, &setup));
            let rows = setup.convergence_rows(scale.changes, &convergence, env.peer_limit);
            report
                .rows
                .extend(rows_or_failure(rows, &convergence, setup.label()));
        }
    }
    report.add_ratios(&convergence, Dataplane::Iptables.as_str());
}

/// `--peers`: weir's two dataplanes and each peer the host can run, on the largest world
/// through the API server, side by side: datapath ratios to no enforcement (interleaved
/// rounds, as every datapath scenario), cold start, convergence and memory.
fn run_peers(env: &Env, report: &mut Report) {
    let scale = &env.scale;
    let (max, remote) = (scale.max_policies(), scale.remote_pods);
    let datapath = format!("peers: datapath, {max} policies, {remote} remote pods");
    let convergence = format!("peers: convergence, {max} policies, {remote} remote pods");
    let memory = format!("peers: memory, {max} policies, {remote} remote pods");
    let planned = [&datapath, &convergence, &memory];
    progress(&datapath);
    let world = || World::new(max, remote);
    let mut enforcers = vec![Dataplane::Ebpf, Dataplane::Iptables, Dataplane::KubeRouter];
    if env.azure_npm.is_some() {
        enforcers.push(Dataplane::AzureNpm);
    }
    let mut setups = datapath_setups(
        env,
        report,
        &planned,
        "peers",
        world,
        Source::Cluster,
        Lineup {
            enforcers: &enforcers,
            noop_hooks: false,
        },
    );
    // kube-network-policies needs nftables' queue statement (CONFIG_NFT_QUEUE).
    if !nft_queue_available() {
        for scenario in planned {
            report.rows.push(Row::text(
                scenario,
                "kube-network-policies",
                "all figures",
                "not measured: this kernel refuses nftables' queue statement (CONFIG_NFT_QUEUE)",
            ));
        }
    }
    converge_and_measure(env, report, &mut setups, &convergence, &memory);
    for scenario in [&convergence, &memory] {
        report.add_ratios(scenario, Dataplane::Iptables.as_str());
    }
}

/// Each enforcing setup of the largest world: its cold start and convergence (under
/// `convergence`), then its memory (under `memory`).
fn converge_and_measure(
    env: &Env,
    report: &mut Report,
    setups: &mut [Setup],
    convergence: &str,
    memory: &str,
) {
    for setup in setups.iter_mut().filter(|s| s.cold_start.is_some()) {
        progress(&format!("{convergence}: {}", setup.label()));
        report.rows.extend(cold_start_rows(convergence, setup));
        let rows = setup.convergence_rows(env.scale.changes, convergence, env.peer_limit);
        report
            .rows
            .extend(rows_or_failure(rows, convergence, setup.label()));
        let rows = setup.memory_rows(memory);
        report
            .rows
            .extend(rows_or_failure(rows, memory, setup.label()));
    }
}

/// Whether nftables accepts a `queue` rule, in a scratch namespace.
fn nft_queue_available() -> bool {
    let Ok(ns) = netns::Netns::create("nftq") else {
        return false;
    };
    let rule =
        "table inet t { chain c { type filter hook forward priority 0; queue num 100 bypass; }; }";
    let mut c = Command::new("nft");
    c.arg(rule);
    ns.command(&mut c).is_ok() && c.output().is_ok_and(|o| o.status.success())
}

/// What a datapath scenario measures beside no enforcement.
struct Lineup<'a> {
    enforcers: &'a [Dataplane],
    /// The hook floor too: a no-op program at eBPF's hooks.
    noop_hooks: bool,
}

/// A datapath scenario (the first of `planned`): no enforcement and the `lineup` on `world`, their
/// traffic rows and ratios to no enforcement. Returns the setups that
/// started (`tag` tells their namespaces apart); a dataplane that did not fails every
/// planned scenario.
fn datapath_setups(
    env: &Env,
    report: &mut Report,
    planned: &[&String],
    tag: &str,
    world: impl Fn() -> World,
    source: Source,
    lineup: Lineup,
) -> Vec<Setup> {
    let datapath = planned[0];
    let mut setups = Vec::new();
    match Setup::baseline(&format!("none{tag}")) {
        Ok(s) => setups.push(s),
        Err(e) => report.rows.push(Row::failed(
            datapath,
            "none",
            "all figures",
            format!("{e:#}"),
        )),
    }
    if lineup.noop_hooks {
        match Setup::noop_hooks(&format!("noop{tag}")) {
            Ok(s) => setups.push(s),
            Err(e) => report.rows.push(Row::failed(
                datapath,
                trial::NOOP_HOOKS,
                "all figures",
                format!("{e:#}"),
            )),
        }
    }
    for &dp in lineup.enforcers {
        let tag = format!("{}{tag}", dp.as_str());
        match Setup::enforcing(env, &tag, dp, world(), source) {
            Ok(s) => setups.push(s),
            Err(e) => report.rows.extend(unavailable(planned, dp, &e)),
        }
    }
    let all: Vec<&Setup> = setups.iter().collect();
    report
        .rows
        .extend(trial::traffic_rows(&all, &env.scale, datapath));
    report.add_ratios(datapath, "none");
    setups
}

/// A dataplane that could not be started or did not enforce: one row per scenario. A peer
/// whose cold start was over its limit is no failure: its convergence scenario says so,
/// and the rest is not measured.
fn unavailable(scenarios: &[&String], dp: Dataplane, e: &anyhow::Error) -> Vec<Row> {
    if let Some(over) = e.downcast_ref::<OverLimit>() {
        let mut rows = Vec::new();
        for s in scenarios {
            if s.contains("convergence") {
                rows.push(Row::text(
                    s,
                    dp.as_str(),
                    "cold start to converged",
                    &over.value(),
                ));
            }
            rows.push(Row::text(
                s,
                dp.as_str(),
                "all figures",
                &format!("not measured: {over}"),
            ));
        }
        return rows;
    }
    scenarios
        .iter()
        .map(|s| {
            Row::failed(
                s,
                dp.as_str(),
                "all figures",
                format!("not available: {e:#}"),
            )
        })
        .collect()
}

/// `--peer-versions` ("kube-router v2.1.0, azure-npm v1.8.12") as the report's map from
/// a peer's name to its version.
fn versions(text: &str) -> std::collections::BTreeMap<String, String> {
    text.split(',')
        .filter_map(|p| {
            let (name, version) = p.trim().split_once(' ')?;
            Some((name.to_string(), version.trim().to_string()))
        })
        .collect()
}

fn rows_or_failure(rows: Result<Vec<Row>>, scenario: &str, dp: &str) -> Vec<Row> {
    rows.unwrap_or_else(|e| vec![Row::failed(scenario, dp, "measurement", format!("{e:#}"))])
}

/// The cold start as the bench saw it, then its phases as the agent measured them.
fn cold_start_rows(scenario: &str, setup: &Setup) -> Vec<Row> {
    let ms = setup.cold_start.unwrap_or_default().as_secs_f64() * 1e3;
    let mut rows = vec![Row::number(
        scenario,
        setup.label(),
        "cold start to converged",
        ms,
        "ms",
    )];
    match &setup.startup_phases {
        Ok(phases) => rows.extend(phases.iter().map(|(phase, ms)| {
            Row::number(
                scenario,
                setup.label(),
                &format!("cold start: {phase}"),
                *ms,
                "ms",
            )
        })),
        Err(e) => rows.push(Row::failed(
            scenario,
            setup.label(),
            "cold start phases",
            e.clone(),
        )),
    }
    rows
}

fn progress(scenario: &str) {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    println!(
        "==> bench: {scenario} ({:02}:{:02}:{:02} UTC)",
        now / 3600 % 24,
        now / 60 % 60,
        now % 60
    );
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}
