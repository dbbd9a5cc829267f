//! Convergence: the time from one change of the manifests (a pod or namespace label change;
//! a policy create, update or delete) to the moment a probe from the client sees the new
//! verdict on the server's toggle port.
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::agent::{Agent, OverLimit};
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
/// How long weir gets for one change before the bench fails; a peer gets the limit it is
/// given (`weir-bench --peer-change-limit`), past which its change is reported as over it.
pub const CHANGE_TIMEOUT: Duration = Duration::from_secs(60);

/// The kinds of change measured, each flipping the toggle port's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    PodLabel,
    NamespaceLabel,
    PolicyCreate,
    PolicyUpdate,
    PolicyDelete,
    ClusterPolicyCreate,
    ClusterPolicyDelete,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::PodLabel => "pod label change",
            Kind::NamespaceLabel => "namespace label change",
            Kind::PolicyCreate => "policy create",
            Kind::PolicyUpdate => "policy update",
            Kind::PolicyDelete => "policy delete",
            Kind::ClusterPolicyCreate => "cluster policy create",
            Kind::ClusterPolicyDelete => "cluster policy delete",
        }
    }
}

/// One change as the probe saw it.
struct Outcome {
    /// Milliseconds to the first probe that saw the new verdict; None: not within the
    /// limit (a peer).
    seen: Option<f64>,
    /// The agent's own share, in milliseconds.
    agent_ms: f64,
    /// From the write to the agent's source receiving it (the watch event), in
    /// milliseconds; None for a peer.
    watch_ms: Option<f64>,
    /// Whether the enforcer's state settled after it within the limit (a peer that did
    /// not is given no further change of the group).
    settled: bool,
}

/// Runs `count` pod label changes, `count` namespace label changes, `count` cycles of
/// policy create, update (away), update (back) and delete, then (weir only: the peers
/// implement no ClusterNetworkPolicy) `count` cycles of an Admin Deny's create and delete
/// over an allowed port; returns p50, p99 and max of each kind, and the agent's own apply
/// time per group. A peer's change that the probe does not see within `limit` counts as
/// "over N s" (it sorts above every measured one) and ends its group, as does a change
/// after which its rules do not settle within `limit`; if they have not settled before
/// the next group either, the kinds left are reported as not measured, rather than
/// waiting for hours.
pub fn changes(
    topo: &Topology,
    agent: &mut Agent,
    world: &mut World,
    count: usize,
    scenario: &str,
    dp: &str,
    limit: Duration,
) -> Result<Vec<Row>> {
    let limit = if agent.is_peer() {
        limit
    } else {
        CHANGE_TIMEOUT
    };
    let over = format!("over {} s", limit.as_secs());
    let mut samples: Vec<(Kind, Outcome)> = Vec::new();
    let mut applies = Vec::new();
    let mut abandoned: Option<String> = None;
    let mut n = 0;
    'groups: for group in [
        "pod label change",
        "namespace label change",
        "policy change",
        "cluster policy change",
    ] {
        if group == "cluster policy change" {
            if agent.is_peer() {
                continue;
            }
            // The Deny closes a port the toggle policy opened.
            world.toggle = Toggle::Allow;
            agent.update(world)?;
            agent.wait_converged(CHANGE_TIMEOUT)?;
        }
        let before = agent.apply_totals(&topo.node)?;
        'changes: for i in 0..count {
            let kinds: &[Kind] = match group {
                "pod label change" => &[Kind::PodLabel],
                "namespace label change" => &[Kind::NamespaceLabel],
                "cluster policy change" => &[Kind::ClusterPolicyCreate, Kind::ClusterPolicyDelete],
                _ => &[
                    Kind::PolicyCreate,
                    Kind::PolicyUpdate,
                    Kind::PolicyUpdate,
                    Kind::PolicyDelete,
                ],
            };
            for (step, kind) in kinds.iter().enumerate() {
                match (kind, step) {
                    (Kind::PodLabel, _) => world.client_granted = i % 2 == 0,
                    (Kind::NamespaceLabel, _) => world.namespace_granted = i % 2 == 0,
                    (Kind::PolicyCreate, _) => world.toggle = Toggle::Allow,
                    (Kind::PolicyUpdate, 1) => world.toggle = Toggle::Moved,
                    (Kind::PolicyUpdate, _) => world.toggle = Toggle::Allow,
                    (Kind::PolicyDelete, _) => world.toggle = Toggle::Absent,
                    (Kind::ClusterPolicyCreate, _) => world.cluster_deny = true,
                    (Kind::ClusterPolicyDelete, _) => world.cluster_deny = false,
                }
                let outcome = one_change(topo, agent, world, n, limit)?;
                n += 1;
                let last = outcome.seen.is_none() || !outcome.settled;
                samples.push((*kind, outcome));
                if last {
                    break 'changes;
                }
            }
        }
        // Every group starts from the port closed (and a peer from its rules settled).
        if world.toggle_open() {
            world.client_granted = false;
            world.namespace_granted = false;
            world.toggle = Toggle::Absent;
            agent.update(world)?;
        }
        if let Err(e) = agent.wait_converged(limit) {
            match e.downcast_ref::<OverLimit>() {
                Some(o) if agent.is_peer() => {
                    abandoned = Some(format!(
                        "not measured: after a change {over}, {dp}'s rules had not settled within a further {} s",
                        o.limit.as_secs()
                    ));
                    break 'groups;
                }
                _ => return Err(e),
            }
        }
        applies.push((group, before, agent.apply_totals(&topo.node)?));
    }
    let mut rows = Vec::new();
    for kind in [
        Kind::PolicyCreate,
        Kind::PolicyUpdate,
        Kind::PolicyDelete,
        Kind::PodLabel,
        Kind::NamespaceLabel,
        Kind::ClusterPolicyCreate,
        Kind::ClusterPolicyDelete,
    ] {
        let of_kind = samples.iter().filter(|(k, ..)| *k == kind);
        if of_kind.clone().next().is_none() {
            let measured_elsewhere =
                !matches!(kind, Kind::ClusterPolicyCreate | Kind::ClusterPolicyDelete)
                    || !agent.is_peer();
            if let Some(why) = abandoned.as_ref().filter(|_| measured_elsewhere) {
                rows.push(Row::text(
                    scenario,
                    dp,
                    &format!("{} p50", kind.name()),
                    why,
                ));
            }
            continue;
        }
        let mut seen: Vec<Option<f64>> = of_kind.clone().map(|(_, o)| o.seen).collect();
        let mut agent_ms: Vec<f64> = of_kind.clone().map(|(_, o)| o.agent_ms).collect();
        let mut watch_ms: Vec<f64> = of_kind.filter_map(|(_, o)| o.watch_ms).collect();
        let n = seen.len();
        for (label, p) in [("p50", 50.0), ("p99", 99.0), ("max", 100.0)] {
            let name = format!("{} {label} (n={n})", kind.name());
            rows.push(match percentile_or_over(&mut seen, p) {
                Some(v) => Row::number(scenario, dp, &name, v, "ms"),
                None => Row::text(scenario, dp, &name, &over),
            });
        }
        // The agent's part of the same changes: event received to dataplane programmed.
        // (A peer's is not measured.)
        for (label, p) in [("p50", 50.0), ("p99", 99.0)]
            .into_iter()
            .filter(|_| !agent.is_peer())
        {
            let v = percentile(&mut agent_ms, p);
            let name = format!("{}: in the agent {label}", kind.name());
            rows.push(Row::number(scenario, dp, &name, v, "ms"));
        }
        // Before the agent's share: the API server's (or the file poll's) delivery of the
        // change, write to watch event received.
        let watched = !watch_ms.is_empty();
        for (label, p) in [("p50", 50.0), ("p99", 99.0)]
            .into_iter()
            .filter(|_| watched)
        {
            let v = percentile(&mut watch_ms, p);
            let name = format!("{}: watch delay {label}", kind.name());
            rows.push(Row::number(scenario, dp, &name, v, "ms"));
        }
    }
    // The part the agent spends in engine and dataplane, without the source.
    for (group, (s0, n0), (s1, n1)) in applies {
        if n1 > n0 && !agent.is_peer() {
            let mean = (s1 - s0) / (n1 - n0) * 1e3;
            let name = format!("{group}: agent apply mean");
            rows.push(Row::number(scenario, dp, &name, mean, "ms"));
        }
    }
    Ok(rows)
}

/// The nearest-rank percentile of samples where None is over the limit (above all).
fn percentile_or_over(samples: &mut [Option<f64>], p: f64) -> Option<f64> {
    samples.sort_by(|a, b| match (a, b) {
        (Some(a), Some(b)) => a.total_cmp(b),
        (a, b) => a.is_none().cmp(&b.is_none()),
    });
    let rank = ((p / 100.0) * samples.len() as f64).ceil() as usize;
    samples[rank.clamp(1, samples.len()) - 1]
}

/// Writes the changed world; returns the milliseconds until the probe saw it enforced, and
/// the agent's own share of them (its implementation delay: from receiving the change to
/// having programmed it, summed over the batches the change took).
fn one_change(
    topo: &Topology,
    agent: &mut Agent,
    world: &World,
    i: usize,
    limit: Duration,
) -> Result<Outcome> {
    // Changes land at varied offsets from the agent's own timers (file polling).
    std::thread::sleep(Duration::from_millis((i as u64 * 37) % 50));
    let expect_open = world.toggle_open();
    let (delay_before, _) = agent.implementation_delay_totals(&topo.node)?;
    let written = agent.update(world)?;
    let seen = topo.client.run(|| loop {
        let attempt = Instant::now();
        let open = toggle_port_open(ATTEMPT_TIMEOUT);
        if open == expect_open && (open || !toggle_port_open(CONFIRM_TIMEOUT)) {
            return Ok(Some(attempt));
        }
        if written.elapsed() > limit {
            if agent.is_peer() {
                return Ok(None);
            }
            bail!(
                "the probe port did not become {} within {limit:?}",
                if expect_open { "open" } else { "closed" }
            );
        }
    })?;
    let Some(seen) = seen else {
        return Ok(Outcome {
            seen: None,
            agent_ms: 0.0,
            watch_ms: None,
            settled: false,
        });
    };
    // The next change starts from a converged agent.
    let settled = match agent.wait_converged(limit) {
        Ok(_) => true,
        Err(e) if agent.is_peer() && e.downcast_ref::<OverLimit>().is_some() => false,
        Err(e) => return Err(e),
    };
    let (delay_after, _) = agent.implementation_delay_totals(&topo.node)?;
    let watch = agent.watch_delay()?;
    Ok(Outcome {
        seen: Some(seen.saturating_duration_since(written).as_secs_f64() * 1e3),
        agent_ms: (delay_after - delay_before) * 1e3,
        watch_ms: watch.map(|d| d.as_secs_f64() * 1e3),
        settled,
    })
}

#[cfg(test)]
mod tests {
    use super::percentile_or_over;

    #[test]
    fn a_change_over_the_limit_ranks_above_every_measured_one() {
        let mut v = vec![Some(3.0), None, Some(1.0), Some(2.0)];
        assert_eq!(percentile_or_over(&mut v, 50.0), Some(2.0));
        assert_eq!(percentile_or_over(&mut v, 99.0), None);
        assert_eq!(percentile_or_over(&mut [None], 50.0), None);
    }
}
