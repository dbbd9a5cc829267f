//! Trials: bench nodes that exist side by side (no enforcement, eBPF, iptables), each with
//! its servers and, for a dataplane, the agent enforcing a world. Traffic is measured in
//! interleaved rounds across them, so that the noise of a shared machine falls on every
//! setup alike. Everything a setup made is gone when it is dropped.
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::agent::{Agent, Dataplane, PeerBinary, Source};
use super::noop_hooks::NoopHooks;
use super::report::Row;
use super::scale::Scale;
use super::topology::{Topology, HOST_INTERFACES};
use super::traffic::{self, Servers};
use super::world::World;
use super::{convergence, memory, prog_cost};

/// The label of the hook-floor setup in the report.
pub const NOOP_HOOKS: &str = "noop-hooks";

pub struct Env {
    pub weir: PathBuf,
    /// `weir-lab`, whose hidden `kube` commands run the cluster path's control plane.
    pub lab: PathBuf,
    /// `--peers`: kube-router, built by `cargo xtask peers`.
    pub kube_router: Option<PeerBinary>,
    /// `--peers`: Azure NPM, built by `cargo xtask peers` from its source archive.
    pub azure_npm: Option<PeerBinary>,
    /// `--peers`: how long a peer's cold start, and each of its changes, may take before
    /// the bench reports it as over the limit.
    pub peer_limit: Duration,
    /// Where each setup keeps its manifests, status file and agent log.
    pub run_dir: PathBuf,
    pub scale: Scale,
}

impl Env {
    /// A peer's cold start gets the scale's cold-start timeout, or the per-change limit
    /// when that is longer.
    pub fn peer_cold_start_limit(&self) -> Duration {
        self.scale.cold_start_timeout.max(self.peer_limit)
    }
}

/// One bench node. Fields drop in order: the agent stops before its node goes away.
pub struct Setup {
    agent: Option<Agent>,
    /// The hook floor: a no-op program where weir's eBPF classifiers attach.
    noop: Option<NoopHooks>,
    _servers: Servers,
    topo: Topology,
    world: World,
    dataplane: Option<Dataplane>,
    /// From starting the agent to its first full convergence.
    pub cold_start: Option<Duration>,
    /// Where the cold start went, as the agent measured it (phase, milliseconds).
    pub startup_phases: Result<Vec<(String, f64)>, String>,
}

impl Setup {
    /// A bench node with no enforcement at all: the datapath reference.
    pub fn baseline(tag: &str) -> Result<Self> {
        let topo = Topology::create(tag)?;
        let servers = Servers::start(&topo.server)?;
        Ok(Setup {
            agent: None,
            noop: None,
            _servers: servers,
            topo,
            world: World::new(0, 0),
            dataplane: None,
            cold_start: None,
            startup_phases: Ok(Vec::new()),
        })
    }

    /// A bench node with no enforcement and a no-op program on both TCX hooks of each
    /// pod's host-side interface, where weir's eBPF dataplane attaches its classifiers.
    pub fn noop_hooks(tag: &str) -> Result<Self> {
        let mut setup = Self::baseline(tag)?;
        setup.noop = Some(NoopHooks::attach(&setup.topo.node, &HOST_INTERFACES)?);
        Ok(setup)
    }

    /// A bench node whose agent has converged on `world` with `dataplane`, and whose probe
    /// sees the world's verdicts.
    pub fn enforcing(
        env: &Env,
        tag: &str,
        dataplane: Dataplane,
        world: World,
        source: Source,
    ) -> Result<Self> {
        let topo = Topology::create(tag)?;
        let servers = Servers::start(&topo.server)?;
        let dir = env.run_dir.join(tag);
        let peer = match dataplane {
            Dataplane::KubeRouter => env.kube_router.as_ref(),
            Dataplane::AzureNpm => env.azure_npm.as_ref(),
            _ => None,
        };
        let (mut agent, started) = Agent::start(
            &env.weir, &env.lab, peer, &topo.node, &dir, dataplane, &world, source,
        )?;
        let timeout = match dataplane.is_peer() {
            true => env.peer_cold_start_limit(),
            false => env.scale.cold_start_timeout,
        };
        let converged = agent.wait_converged(timeout)?;
        let startup_phases = agent.startup_phases().map_err(|e| format!("{e:#}"));
        let setup = Setup {
            agent: Some(agent),
            noop: None,
            _servers: servers,
            topo,
            world,
            dataplane: Some(dataplane),
            cold_start: Some(converged - started),
            startup_phases,
        };
        setup.check_enforced()?;
        Ok(setup)
    }

    pub fn label(&self) -> &'static str {
        match (self.dataplane, &self.noop) {
            (Some(dp), _) => dp.as_str(),
            (None, Some(_)) => NOOP_HOOKS,
            (None, None) => "none",
        }
    }

    /// The world closes the toggle port: make sure the dataplane really enforces before
    /// measuring it.
    fn check_enforced(&self) -> Result<()> {
        let open = self
            .topo
            .client
            .run(|| Ok(traffic::toggle_port_open(Duration::from_millis(200))))?;
        if open != self.world.toggle_open() {
            bail!(
                "the agent reports convergence but the probe port is {}",
                if open { "open" } else { "closed" }
            );
        }
        Ok(())
    }

    pub fn convergence_rows(
        &mut self,
        changes: usize,
        scenario: &str,
        limit: Duration,
    ) -> Result<Vec<Row>> {
        let label = self.label();
        let agent = self.agent.as_mut().expect("an enforcing setup");
        convergence::changes(
            &self.topo,
            agent,
            &mut self.world,
            changes,
            scenario,
            label,
            limit,
        )
    }

    /// The eBPF dataplane's per-path cost and its programs' instruction counts, on the
    /// programs and maps this setup's agent loaded (nothing for another dataplane).
    pub fn path_cost_rows(&self, scenario: &str) -> Vec<Row> {
        match (&self.agent, self.dataplane) {
            (Some(agent), Some(Dataplane::Ebpf)) => {
                prog_cost::rows(&self.topo.node, agent.bpf_root(), scenario)
            }
            _ => Vec::new(),
        }
    }

    pub fn memory_rows(&self, scenario: &str) -> Result<Vec<Row>> {
        let (Some(agent), Some(dp)) = (&self.agent, self.dataplane) else {
            bail!("no agent runs without enforcement");
        };
        memory::rows(&self.topo, agent, scenario, dp)
    }
}

/// What the traffic rounds gathered for one setup.
#[derive(Default)]
struct Samples {
    throughput: Vec<f64>,
    rr: Vec<f64>,
    crr: Vec<f64>,
    elapsed_rr: f64,
    elapsed_crr: f64,
    error: Option<String>,
}

/// Measures throughput and latency on every setup in `rounds` interleaved rounds (each
/// round starts with a different setup) and returns their rows under `scenario`.
pub fn traffic_rows(setups: &[&Setup], scale: &Scale, scenario: &str) -> Vec<Row> {
    let rounds = scale.traffic_rounds;
    let mut samples: Vec<Samples> = setups.iter().map(|_| Samples::default()).collect();
    for round in 0..rounds {
        for k in 0..setups.len() {
            let i = (k + round) % setups.len();
            if samples[i].error.is_none() {
                if let Err(e) = one_round(setups[i], scale, &mut samples[i]) {
                    samples[i].error = Some(format!("{e:#}"));
                }
            }
        }
    }
    let mut rows = Vec::new();
    for (setup, s) in setups.iter().zip(&mut samples) {
        let dp = setup.label();
        if let Some(e) = &s.error {
            rows.push(Row::failed(scenario, dp, "traffic", e.clone()));
            continue;
        }
        let gbps = s.throughput.iter().sum::<f64>() / s.throughput.len() as f64 / 1e9;
        rows.push(Row::number(scenario, dp, "TCP throughput", gbps, "Gbit/s"));
        for (name, rtts, elapsed) in [
            ("RR", &mut s.rr, s.elapsed_rr),
            ("CRR", &mut s.crr, s.elapsed_crr),
        ] {
            for p in [50.0, 99.0] {
                let v = traffic::percentile(rtts, p);
                rows.push(Row::number(
                    scenario,
                    dp,
                    &format!("{name} latency p{p}"),
                    v,
                    "µs",
                ));
            }
            let rate = rtts.len() as f64 / elapsed;
            rows.push(Row::number(
                scenario,
                dp,
                &format!("{name} rate"),
                rate,
                "req/s",
            ));
        }
    }
    rows
}

fn one_round(setup: &Setup, scale: &Scale, s: &mut Samples) -> Result<()> {
    let client = &setup.topo.client;
    s.throughput
        .push(traffic::throughput(client, scale.throughput_seconds)?);
    for (reconnect, rtts, elapsed) in [
        (false, &mut s.rr, &mut s.elapsed_rr),
        (true, &mut s.crr, &mut s.elapsed_crr),
    ] {
        let started = Instant::now();
        rtts.extend(traffic::round_trips(client, scale.latency, reconnect)?);
        *elapsed += started.elapsed().as_secs_f64();
    }
    Ok(())
}
