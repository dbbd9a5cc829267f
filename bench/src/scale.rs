//! How big each scenario is: the full bench (the sizes its targets are stated at) or the quick run that
//! `cargo xtask test` makes so that the bench cannot rot.
use std::time::Duration;

pub struct Scale {
    /// Datapath worlds, by number of policies; the last one is also the convergence and
    /// memory world.
    pub policy_counts: Vec<usize>,
    pub remote_pods: usize,
    /// Datapath worlds with this many ClusterNetworkPolicies besides the largest number
    /// of policies: the programs' per-packet cost must not grow with them.
    pub cluster_policy_counts: &'static [usize],
    /// The second memory world.
    pub large_remote_pods: usize,
    /// Traffic is measured in this many interleaved rounds per setup, each with:
    pub traffic_rounds: usize,
    pub throughput_seconds: u32,
    pub latency: Duration,
    /// Pod label changes, as many namespace label changes, then as many cycles of policy
    /// create, update, update back and delete; each kind measured on its own (the full
    /// bench makes 100 of each kind per dataplane, so that a p99 is not one sample).
    pub changes: usize,
    pub reset_sets: usize,
    pub reset_undeletable: usize,
    pub reset_chains: usize,
    /// How long a cold start may take before the bench calls it failed.
    pub cold_start_timeout: Duration,
}

impl Scale {
    pub fn new(quick: bool) -> Self {
        if quick {
            Scale {
                policy_counts: vec![10],
                remote_pods: 500,
                cluster_policy_counts: &[10],
                large_remote_pods: 2_000,
                traffic_rounds: 1,
                throughput_seconds: 1,
                latency: Duration::from_millis(500),
                changes: 4,
                reset_sets: 500,
                reset_undeletable: 100,
                reset_chains: 200,
                cold_start_timeout: Duration::from_secs(60),
            }
        } else {
            Scale {
                policy_counts: vec![10, 100, 1_000],
                remote_pods: 20_000,
                cluster_policy_counts: &[10, 100, 1_000],
                large_remote_pods: 100_000,
                traffic_rounds: 4,
                throughput_seconds: 2,
                latency: Duration::from_secs(1),
                changes: 100,
                reset_sets: 5_000,
                reset_undeletable: 1_000,
                reset_chains: 2_000,
                cold_start_timeout: Duration::from_secs(600),
            }
        }
    }

    /// `weir-bench --peers` on another world or with fewer changes than the full bench
    /// (a peer that takes minutes per change would otherwise run for hours): the largest
    /// world becomes `policies` policies and `remote_pods` remote pods.
    pub fn resize_peers(
        &mut self,
        policies: Option<usize>,
        remote_pods: Option<usize>,
        changes: Option<usize>,
    ) {
        if let Some(p) = policies {
            self.policy_counts = vec![p];
        }
        self.remote_pods = remote_pods.unwrap_or(self.remote_pods);
        self.changes = changes.unwrap_or(self.changes);
    }

    pub fn max_policies(&self) -> usize {
        *self.policy_counts.last().expect("at least one world")
    }
}
