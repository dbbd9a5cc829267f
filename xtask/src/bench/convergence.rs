//! Convergence: the time from one change of the manifests (a pod label change; a policy
//! create, update or delete) to the moment a probe from the client sees the new verdict on
//! the server's toggle port.
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::agent::Agent;
use super::report::Row;
use super::topology::Topology;
use super::traffic::{percentile, toggle_port_open};
use super::world::{Toggle, World};

/// A connection attempt that gets no answer within this is probably a denied one (the veth
/// round trip is tens of microseconds); it is also the resolution of an "opened" observation.
const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(5);
/// A busy machine can delay an allowed handshake past ATTEMPT_TIMEOUT: a "closed"
/// observation is confirmed by a second attempt that waits this long.
const CONFIRM_TIMEOUT: Duration = Duration::from_millis(300);
const CHANGE_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `count` pod label changes, then `count` policy changes, and returns their p50 and
/// p99.
pub fn changes(
    topo: &Topology,
    agent: &mut Agent,
    world: &mut World,
    count: usize,
    scenario: &str,
    dp: &str,
) -> Result<Vec<Row>> {
    let before = agent.apply_totals(&topo.node)?;
    let mut label = Vec::new();
    for i in 0..count {
        world.client_granted = !world.client_granted;
        label.push(one_change(topo, agent, world, i)?);
    }
    let after_label = agent.apply_totals(&topo.node)?;
    world.client_granted = false;
    agent.update(world)?;
    agent.wait_converged(CHANGE_TIMEOUT)?;
    // create, update (away), update (back), delete, ...
    let cycle = [Toggle::Allow, Toggle::Moved, Toggle::Allow, Toggle::Absent];
    let before_policy = agent.apply_totals(&topo.node)?;
    let mut policy = Vec::new();
    for i in 0..count {
        world.toggle = cycle[i % cycle.len()];
        policy.push(one_change(topo, agent, world, i)?);
    }
    let after_policy = agent.apply_totals(&topo.node)?;
    let mut rows = Vec::new();
    for (name, samples, (s0, n0), (s1, n1)) in [
        ("policy change", &mut policy, before_policy, after_policy),
        ("pod label change", &mut label, before, after_label),
    ] {
        for p in [50.0, 99.0] {
            let v = percentile(samples, p);
            rows.push(Row::number(
                scenario,
                dp,
                &format!("{name} p{p} (n={count})"),
                v,
                "ms",
            ));
        }
        // The part the agent spends in engine and dataplane, without reading the file.
        if n1 > n0 {
            let mean = (s1 - s0) / (n1 - n0) * 1e3;
            rows.push(Row::number(
                scenario,
                dp,
                &format!("{name}: agent apply mean"),
                mean,
                "ms",
            ));
        }
    }
    Ok(rows)
}

/// Writes the changed world and returns the milliseconds until the probe saw it enforced.
fn one_change(topo: &Topology, agent: &mut Agent, world: &World, i: usize) -> Result<f64> {
    // Changes land at varied offsets from the agent's own timers (file polling).
    std::thread::sleep(Duration::from_millis((i as u64 * 37) % 50));
    let expect_open = world.toggle_open();
    let written = agent.update(world)?;
    let seen = topo.client.run(|| loop {
        let attempt = Instant::now();
        let open = toggle_port_open(ATTEMPT_TIMEOUT);
        if open == expect_open && (open || !toggle_port_open(CONFIRM_TIMEOUT)) {
            return Ok(attempt);
        }
        if written.elapsed() > CHANGE_TIMEOUT {
            bail!(
                "the probe port did not become {} within {CHANGE_TIMEOUT:?}",
                if expect_open { "open" } else { "closed" }
            );
        }
    })?;
    // The next change starts from a converged agent.
    agent.wait_converged(CHANGE_TIMEOUT)?;
    Ok((seen.saturating_duration_since(written)).as_secs_f64() * 1e3)
}
