//! One trial: a fresh bench node, optionally an agent enforcing a world on it, and the
//! measurements taken while it runs. Everything the trial made is gone when it returns.
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::agent::{Agent, Dataplane};
use super::report::Row;
use super::scale::Scale;
use super::topology::Topology;
use super::traffic::{self, Servers};
use super::world::World;
use super::{convergence, memory};

pub struct Env {
    pub weir: PathBuf,
    /// Where each trial keeps its manifests, status file and agent log.
    pub run_dir: PathBuf,
    pub scale: Scale,
}

/// What to measure in a trial, by the scenario name the rows go under.
#[derive(Default)]
pub struct Plan {
    pub datapath: Option<String>,
    pub convergence: Option<String>,
    pub memory: Option<String>,
}

impl Plan {
    fn scenarios(&self) -> impl Iterator<Item = &String> {
        [&self.datapath, &self.convergence, &self.memory]
            .into_iter()
            .flatten()
    }
}

/// Traffic with no enforcement at all: the reference for the datapath figures.
pub fn baseline(env: &Env, tag: &str, scenario: &str) -> Vec<Row> {
    let result = (|| {
        let topo = Topology::create(tag)?;
        let _servers = Servers::start(&topo.server)?;
        traffic_rows(env, &topo, scenario, "none")
    })();
    result.unwrap_or_else(|e| vec![Row::failed(scenario, "none", "traffic", format!("{e:#}"))])
}

/// Starts `dataplane` cold on `world` and measures what `plan` asks for. A failure is a
/// row per planned scenario naming it (for example a dataplane that is not available).
pub fn with_agent(
    env: &Env,
    tag: &str,
    dataplane: Dataplane,
    world: World,
    plan: &Plan,
) -> Vec<Row> {
    let mut rows = Vec::new();
    if let Err(e) = measure(env, tag, dataplane, world, plan, &mut rows) {
        for scenario in plan.scenarios() {
            rows.push(Row::failed(
                scenario,
                dataplane.as_str(),
                "all figures",
                format!("not available: {e:#}"),
            ));
        }
    }
    rows
}

fn measure(
    env: &Env,
    tag: &str,
    dataplane: Dataplane,
    mut world: World,
    plan: &Plan,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let dp = dataplane.as_str();
    let topo = Topology::create(tag)?;
    let _servers = Servers::start(&topo.server)?;
    let (mut agent, started) = Agent::start(
        &env.weir,
        &topo.node,
        &env.run_dir.join(tag),
        dataplane,
        &world,
    )?;
    let converged = agent.wait_converged(env.scale.cold_start_timeout)?;
    check_enforced(&topo, &world)?;
    if let Some(scenario) = plan.convergence.as_ref().or(plan.memory.as_ref()) {
        let ms = (converged - started).as_secs_f64() * 1e3;
        rows.push(Row::number(
            scenario,
            dp,
            "cold start to converged",
            ms,
            "ms",
        ));
    }
    if let Some(scenario) = &plan.datapath {
        rows.extend(traffic_rows(env, &topo, scenario, dp)?);
    }
    if let Some(scenario) = &plan.convergence {
        rows.extend(convergence::changes(
            &topo,
            &mut agent,
            &mut world,
            env.scale.changes,
            scenario,
            dp,
        )?);
    }
    if let Some(scenario) = &plan.memory {
        rows.extend(memory::rows(&topo, &agent, scenario, dataplane)?);
    }
    Ok(())
}

/// The world closes the toggle port and opens the latency port: make sure the dataplane
/// really enforces before measuring it.
fn check_enforced(topo: &Topology, world: &World) -> Result<()> {
    let open = topo
        .client
        .run(|| Ok(traffic::toggle_port_open(Duration::from_millis(200))))?;
    if open != world.toggle_open() {
        bail!(
            "the agent reports convergence but the probe port is {}",
            if open { "open" } else { "closed" }
        );
    }
    Ok(())
}

fn traffic_rows(env: &Env, topo: &Topology, scenario: &str, dp: &str) -> Result<Vec<Row>> {
    let bps = traffic::throughput(&topo.client, env.scale.throughput_seconds)?;
    let mut rows = vec![Row::number(
        scenario,
        dp,
        "TCP throughput",
        bps / 1e9,
        "Gbit/s",
    )];
    for (reconnect, name) in [(false, "RR"), (true, "CRR")] {
        let started = Instant::now();
        let mut rtts = traffic::round_trips(&topo.client, env.scale.latency, reconnect)?;
        let rate = rtts.len() as f64 / started.elapsed().as_secs_f64();
        for p in [50.0, 99.0] {
            let v = traffic::percentile(&mut rtts, p);
            rows.push(Row::number(
                scenario,
                dp,
                &format!("{name} latency p{p}"),
                v,
                "µs",
            ));
        }
        rows.push(Row::number(
            scenario,
            dp,
            &format!("{name} rate"),
            rate,
            "req/s",
        ));
    }
    Ok(rows)
}
