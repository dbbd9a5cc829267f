//! `cargo xtask <cmd>`: the one entry point for building, testing and demonstrating weir
//! on a fresh machine. Every install step lives in `setup`, so nothing is done by hand.
//!
//! **Dependencies:** none of weir's crates: it drives them through cargo and their
//! binaries, as CI does.
mod bench;
mod build;
mod cluster;
mod cmd;
mod components;
mod conformance;
mod demo;
mod disk;
mod fuzz;
mod host_guard;
mod image;
mod kernels;
mod peers;
mod results;
mod setup;
mod structure;
mod suites;
mod test;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "Build, test and demo weir. Start with `cargo xtask demo` and `cargo xtask test`."
)]
struct Cli {
    /// Where the peers' source archives are (Azure NPM's: the module proxy refuses its
    /// module): default ../shared/peers beside the repository.
    #[arg(long, env = "WEIR_PEER_ARCHIVES", global = true, value_name = "DIR")]
    peer_archives: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install what weir needs (Debian packages, bpf-linker, cargo-fuzz, and kube-apiserver,
    /// kube-proxy and etcd built with Go from the module proxy). Idempotent: only what is
    /// missing is installed or built. Needs root, apt and Go.
    Setup,
    /// Build the eBPF object, then the agent that embeds it.
    Build {
        #[arg(long)]
        release: bool,
    },
    /// The CI command: formatting, clippy (warnings are errors), unit tests, then the
    /// integration tests against the real kernel (root, bpffs, network namespaces).
    Test,
    /// The upstream netpol scenarios on both dataplanes, both lab modes and both lab
    /// topologies, all of them (the test step runs the bridge topology on a subset).
    /// With --suite: instead the field's own suite against weir's DaemonSet on a real
    /// kubelet cluster (`weir-lab cluster`) on one dataplane, with the suite's own summary,
    /// a result in docs/results/DATE/ and the cluster torn down after.
    Conformance {
        /// e2e: Kubernetes' NetworkPolicy e2e (every `Feature:NetworkPolicy` and
        /// `NetworkPolicy API` spec of the pinned release); npapi: network-policy-api's
        /// conformance, ClusterNetworkPolicy profile, all features; cyclonus: cyclonus's
        /// generated cases (about two hours per dataplane here); rolling-switch: pods on
        /// every node probing each other while each node's dataplane is switched in turn
        /// (fails on any denied probe connecting or allowed one failing).
        #[arg(long, value_enum)]
        suite: Option<suites::Suite>,
        /// --suite: the dataplane every node's weir runs (rolling-switch: node 1's at the
        /// start, the other nodes on the other one).
        #[arg(long, value_enum, requires = "suite", default_value = "ebpf")]
        dataplane: suites::Dataplane,
        /// --suite: kubelet nodes.
        #[arg(long, requires = "suite", default_value_t = 2)]
        nodes: usize,
        /// --suite: e2e, a ginkgo focus regex instead of every NetworkPolicy spec; npapi, a
        /// `go test -run` pattern below TestConformanceProfiles; cyclonus, its `--include`
        /// tags (comma-separated).
        #[arg(long, requires = "suite", value_name = "REGEX")]
        focus: Option<String>,
        /// Instead: the short subset (2 nodes; on each dataplane one denying and one
        /// allowing e2e spec and one ClusterNetworkPolicy conformance test), as CI could
        /// run it; writes no result.
        #[arg(long, conflicts_with_all = ["suite", "scenarios", "cells"])]
        ci_subset: bool,
        /// With --ci-subset: only build (or find cached) what it runs, the cluster's
        /// components and the two suites' binaries; run nothing.
        #[arg(long, requires = "ci_subset")]
        build_only: bool,
        /// Only the scenarios whose names start with this (repeatable), e.g. `cnp` for
        /// the ClusterNetworkPolicy ones.
        #[arg(long = "scenarios", value_name = "PREFIX", conflicts_with = "suite")]
        scenarios: Vec<String>,
        /// Only these cells, as `dataplane/api/topology/proxy[/subset][/image][/variant]`
        /// separated by commas (e.g. `ebpf/server/routed/iptables`); the whole matrix
        /// without it.
        #[arg(long, value_name = "CELLS", conflicts_with = "suite")]
        cells: Option<String>,
    },
    /// Fuzz every cargo-fuzz target (agent/fuzz) from its seeds and dictionary, optimized,
    /// printing libFuzzer's execution count for each; fails when a target crashes or runs
    /// fewer than --min-runs inputs. New inputs collect in target/fuzz-corpus/.
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = 300)]
        seconds: u32,
        /// Build unoptimized (what `cargo xtask test` runs: minutes faster to build).
        #[arg(long)]
        dev: bool,
        /// Fewest executions a target must reach (ebpf_encoding: a fortieth, its inputs are
        /// whole policy worlds).
        #[arg(long, default_value_t = 100_000)]
        min_runs: u64,
    },
    /// Check the layering: weir-policy's dependencies reach no kernel, Kubernetes client,
    /// async runtime or HTTP crate, the agent depends on none of the harnesses, and no
    /// crate's modules use their siblings in a cycle, at any level (known cycles listed).
    /// `cargo xtask test` runs it.
    Structure,
    /// Write the tables of docs/performance.md and docs/kernels.md from the committed
    /// results they name (docs/results/DATE/*.json), between their `<!-- results TABLE
    /// FILE -->` and `<!-- /results -->` markers.
    Results {
        /// Only check that every table matches its data (what `cargo xtask test` runs).
        #[arg(long)]
        check: bool,
    },
    /// Build the image deploy/daemonset.yaml runs, with no container engine: the stripped
    /// release binary and the tools it runs, from the Debian packages pinned in
    /// deploy/image/packages.lock, as an OCI layout, an oci-archive and a docker-archive in
    /// target/image/, with its digest (target/image/digest) and bill of materials
    /// (target/image/packages.txt).
    Image {
        /// The image's name:tag.
        #[arg(long, default_value = concat!("weir:", env!("CARGO_PKG_VERSION")))]
        tag: String,
        /// Pin the apt sources' current versions in deploy/image/packages.lock first.
        #[arg(long)]
        relock: bool,
        /// Put the unoptimised (dev) binary in the image, in target/image-dev/ (what `cargo
        /// xtask test` runs its container tests on).
        #[arg(long)]
        dev: bool,
        /// Build deploy/Dockerfile with this engine (docker or podman) instead.
        #[arg(long, value_parser = ["docker", "podman"])]
        engine: Option<String>,
    },
    /// Run the lab on the default example: build a node from network namespaces, enforce
    /// its policies and print the reachability matrix.
    Demo {
        /// ebpf or iptables.
        #[arg(long, default_value = "ebpf")]
        dataplane: String,
        /// Instead: the incident weir was written for, live: Azure NPM v1.5.36 (built from
        /// its source archive, see --peer-archives) crash-looping on 16 leaked ipset
        /// references with the seed's error, v1.5.37 and v1.8.12 surviving the same, and
        /// weir taking the node over while the pods probe.
        #[arg(long, conflicts_with = "npm_migration")]
        seed_incident: bool,
        /// Instead: the migration off a running Azure NPM v1.8.12 enforcing 100 policies,
        /// onto weir's eBPF dataplane and then its iptables one, while every pod probes.
        #[arg(long)]
        npm_migration: bool,
    },
    /// The privileged integration tests and conformance scenarios, both dataplanes, on
    /// Debian's 5.10 and 6.1 kernels (booted under virtme-ng: KVM where it works, software
    /// emulation otherwise) and on the host's kernel; prints a group × kernel table.
    Kernels {
        /// 5.10, 6.1 or host; repeat for several. Default: all three.
        #[arg(long = "kernel")]
        kernels: Vec<String>,
        /// Only the quick groups (eBPF and iptables enforcement, a conformance subset): what
        /// `cargo xtask test` runs on 5.10.
        #[arg(long)]
        quick: bool,
        /// Only these groups (a row of the table); repeat for several.
        #[arg(long = "group")]
        groups: Vec<String>,
        /// In the conformance groups, only the scenarios whose names start with this
        /// (repeatable), as `conformance --scenarios`; e.g. `cnp` with `--group
        /// conformance_ipvs` runs the ClusterNetworkPolicy scenarios through ipvs.
        #[arg(long = "scenarios", value_name = "PREFIX")]
        scenarios: Vec<String>,
    },
    /// The other NetworkPolicy agents (deploy/peer-versions: kube-router,
    /// kube-network-policies, Azure NPM), built from the Go module proxy (NPM from its
    /// source archive, see --peer-archives) and cached, then the upstream
    /// netpol scenarios on each of them and on weir, printed as a scenario × enforcer
    /// table. A peer's failures are findings, reported, not errors; a peer that cannot run
    /// on this kernel is reported as not run, with the reason. Needs root and Go.
    Peers {
        /// Only build (or find cached) the peers' binaries.
        #[arg(long)]
        build_only: bool,
        /// Only these peers, as NAME or NAME@VERSION (repeatable), e.g.
        /// `--only azure-npm@v1.5.36`.
        #[arg(long = "only", value_name = "NAME[@VERSION]")]
        only: Vec<String>,
    },
    /// What `weir-lab cluster` runs (kubelet, kube-controller-manager, kube-scheduler,
    /// kubectl, containerd, the pause and agnhost images), built from the pins in
    /// deploy/kubernetes-version and deploy/cluster-versions and cached beside the other
    /// components; runc and the CNI plugins from Debian. Then weir's dev image and the
    /// real-cluster test: weir's DaemonSet on a 2-node kubelet cluster, eBPF then iptables
    /// (about a minute; not part of `cargo xtask test`). Needs root, apt and Go.
    Cluster {
        /// Only build (or find cached) the components.
        #[arg(long)]
        build_only: bool,
    },
    /// Measure datapath, convergence, memory and reset against no enforcement and the
    /// iptables path, in one run (the bench is `weir-bench`, in bench/; this builds it
    /// and what it measures); prints a table and writes target/bench/latest.json.
    Bench {
        /// Scaled down to about a minute (the run that `cargo xtask test` makes).
        #[arg(long)]
        quick: bool,
        /// Instead: weir's dataplanes and the peers (deploy/peer-versions, built as by
        /// `cargo xtask peers`) side by side on the largest world through the API server:
        /// datapath ratios, cold start, convergence, memory; writes target/bench/peers.json.
        #[arg(long)]
        peers: bool,
        /// --peers: seconds a peer's change (or its rules settling after it) may take
        /// before it is reported as over the limit (Azure NPM takes minutes per change at
        /// hundreds of policies).
        #[arg(long, requires = "peers")]
        peer_change_limit: Option<u64>,
        /// --peers: the world's policies instead of the full bench's 1,000.
        #[arg(long, requires = "peers")]
        peer_policies: Option<usize>,
        /// --peers: the world's remote pods instead of the full bench's 20,000.
        #[arg(long, requires = "peers")]
        peer_remote_pods: Option<usize>,
        /// --peers: changes of each kind per enforcer instead of the full bench's 25.
        #[arg(long, requires = "peers")]
        peer_changes: Option<usize>,
        /// Instead: N weir agents (`--dataplane none`, each a different node) against one
        /// real kube-apiserver, for N = 1, 10, 30 at 50,000 pods: the API server's CPU,
        /// memory and watch events, bytes per agent per change, convergence to every
        /// agent (changes one at a time, then 100 at 10 a second), cold start of all at
        /// once, an API server restart and a 410 storm; then the largest N
        /// again with the agents on streaming lists, with Pods read in JSON instead of
        /// protobuf, and reading from `weir relay`'s etcd, and at 20,000, 100,000 and 150,000
        /// pods; writes target/bench/cluster.json. With --quick: N = 1, 2 at 500 pods, then
        /// 250 and 1,000 (a smoke run).
        #[arg(long, conflicts_with = "peers")]
        cluster: bool,
        /// --cluster: agent counts instead of 1,10,30 (comma-separated).
        #[arg(long, requires = "cluster")]
        cluster_agents: Option<String>,
        /// --cluster: pods instead of 50,000.
        #[arg(long, requires = "cluster")]
        cluster_pods: Option<usize>,
        /// --cluster: changes per agent count instead of 10.
        #[arg(long, requires = "cluster")]
        cluster_changes: Option<usize>,
        /// --cluster: the pod counts of the size sweep (the largest N run again with the
        /// world resized to each) instead of 20,000, 100,000 and 150,000 (250 and 1,000
        /// with --quick); comma-separated, empty for none.
        #[arg(long, requires = "cluster")]
        cluster_pod_sweep: Option<String>,
    },
}

fn main() {
    let cli = Cli::parse();
    peers::set_archives(cli.peer_archives);
    let result = match cli.command {
        Command::Setup => setup::run(),
        Command::Build { release } => build::run(release),
        Command::Test => test::run(),
        Command::Conformance {
            ci_subset: true,
            build_only,
            ..
        } => suites::ci_subset(build_only),
        Command::Conformance {
            suite: Some(suite),
            dataplane,
            nodes,
            focus,
            ..
        } => suites::run(&suites::Options {
            suite,
            dataplane,
            nodes,
            focus,
        }),
        Command::Conformance {
            scenarios, cells, ..
        } => conformance::run(&scenarios, cells.as_deref()),
        Command::Structure => structure::run(),
        Command::Results { check } => results::run(check),
        Command::Fuzz {
            seconds,
            dev,
            min_runs,
        } => fuzz::run(&fuzz::FuzzOptions {
            seconds,
            optimized: !dev,
            min_runs,
        })
        .map(drop),
        Command::Image {
            tag,
            relock,
            dev,
            engine,
        } => image::run(&image::Options {
            reference: tag,
            dev,
            relock,
            engine,
        }),
        Command::Demo {
            dataplane,
            seed_incident,
            npm_migration,
        } => match (seed_incident, npm_migration) {
            (true, _) => demo::npm(demo::NpmDemo::SeedIncident),
            (_, true) => demo::npm(demo::NpmDemo::Migration),
            _ => demo::run(&dataplane),
        },
        Command::Bench {
            quick,
            cluster: true,
            cluster_agents,
            cluster_pods,
            cluster_changes,
            cluster_pod_sweep,
            ..
        } => bench::cluster(
            quick,
            &bench::ClusterRun {
                agents: cluster_agents,
                pods: cluster_pods,
                changes: cluster_changes,
                pod_sweep: cluster_pod_sweep,
            },
        ),
        Command::Bench {
            quick,
            peers,
            peer_change_limit,
            peer_policies,
            peer_remote_pods,
            peer_changes,
            ..
        } => bench::run(
            quick,
            peers.then_some(bench::PeerRun {
                change_limit: peer_change_limit,
                policies: peer_policies,
                remote_pods: peer_remote_pods,
                changes: peer_changes,
            }),
        ),
        Command::Peers { build_only, only } => peers::run(build_only, &only),
        Command::Cluster { build_only } => cluster::run(build_only),
        Command::Kernels {
            kernels,
            quick,
            groups,
            scenarios,
        } => kernels::run(&kernels, quick, &groups, &scenarios),
    };
    if let Err(e) = result {
        eprintln!("xtask: error: {e:#}");
        std::process::exit(1);
    }
}
