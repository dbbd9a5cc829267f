//! The agent's Prometheus metrics (`weir_*`), one registry per agent. deploy/README.md
//! documents every family; a test checks that the agent serves each one it documents.
//!
//! Map pressure comes from [`DataplaneStatus::details`] (`map_pressure.<map>` carries
//! `used/capacity ...`); verdicts and drops from the dataplane's own counters
//! ([`VerdictCounts`]), mirrored into Prometheus counters.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::enforcer::CleanupReport;
use super::report::MapPressure;
use super::select::{Effective, FallbackCause};
use crate::dataplane::{DataplaneKind, DataplaneStatus, VerdictCounts};
use weir_policy::desired::Direction;

type Labels = Vec<(String, String)>;

pub struct Metrics {
    registry: Registry,
    objects: Family<Labels, Gauge>,
    endpoints: Gauge,
    apply_seconds: Histogram,
    implementation_delay: Histogram,
    object_errors: Gauge,
    resets: Family<Labels, Counter>,
    undeletable_ipsets: Gauge,
    dataplane: Family<Labels, Gauge>,
    fallback: Family<Labels, Gauge>,
    switches: Counter,
    map_fill: Family<Labels, Gauge<f64, AtomicU64>>,
    drops: Family<Labels, Counter>,
    verdicts: Family<Labels, Counter>,
    /// The dataplane's count behind each mirrored counter, when last read.
    mirrored: Mutex<HashMap<(&'static str, Labels), u64>>,
}

fn label(k: &str, v: impl Into<String>) -> Labels {
    vec![(k.to_string(), v.into())]
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut m = Metrics {
            registry: Registry::with_prefix("weir"),
            objects: Family::default(),
            endpoints: Gauge::default(),
            apply_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            implementation_delay: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            object_errors: Gauge::default(),
            resets: Family::default(),
            undeletable_ipsets: Gauge::default(),
            dataplane: Family::default(),
            fallback: Family::default(),
            switches: Counter::default(),
            map_fill: Family::default(),
            drops: Family::default(),
            verdicts: Family::default(),
            mirrored: Mutex::default(),
        };
        let r = &mut m.registry;
        r.register(
            "objects",
            "Objects known, by kind (NetworkPolicy, Pod, Namespace, Node)",
            m.objects.clone(),
        );
        r.register(
            "endpoints",
            "Local pods the dataplane enforces for",
            m.endpoints.clone(),
        );
        r.register(
            "apply_duration_seconds",
            "Time from an event batch to the dataplane having applied it",
            m.apply_seconds.clone(),
        );
        r.register(
            "policy_implementation_delay_seconds",
            "From the source receiving a change (a watch event, the manifest file changing) to the dataplane having programmed it (Cilium's metric of the same name)",
            m.implementation_delay.clone(),
        );
        r.register(
            "object_errors",
            "Objects that are not enforced (invalid, refused by the dataplane)",
            m.object_errors.clone(),
        );
        r.register(
            "reset_runs",
            "Cleanup runs of other dataplanes' or Azure NPM's state, by result",
            m.resets.clone(),
        );
        r.register(
            "reset_undeletable_ipsets",
            "Sets the last cleanup could not destroy (retried)",
            m.undeletable_ipsets.clone(),
        );
        r.register(
            "dataplane_active",
            "1 for the dataplane that enforces on this node",
            m.dataplane.clone(),
        );
        r.register(
            "dataplane_fallback",
            "1 when the dataplane is not the one asked for, by reason (ebpf_unavailable, ebpf_start_failed; the words are in `weir status`)",
            m.fallback.clone(),
        );
        r.register(
            "dataplane_switches",
            "Completed make-before-break dataplane switches",
            m.switches.clone(),
        );
        r.register(
            "map_fill_ratio",
            "Fill level of each eBPF map (1 = full)",
            m.map_fill.clone(),
        );
        r.register(
            "drops",
            "Packets dropped by the dataplane, by reason (default-deny, spoofed-source, tagged-frame, malformed)",
            m.drops.clone(),
        );
        r.register(
            "policy_verdicts",
            "Policy verdicts: connections each NetworkPolicy allowed (verdict=allow) or, in audit mode, would have dropped (verdict=audit), and packets isolated pods' default deny dropped (verdict=deny, namespace and policy empty), by direction",
            m.verdicts.clone(),
        );
        m
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    pub fn set_objects(&self, kind: &str, count: usize) {
        self.objects
            .get_or_create(&label("kind", kind))
            .set(count as i64);
    }

    pub fn observe_apply(&self, seconds: f64) {
        self.apply_seconds.observe(seconds);
    }

    pub fn observe_implementation_delay(&self, seconds: f64) {
        self.implementation_delay.observe(seconds);
    }

    pub fn set_object_errors(&self, n: usize) {
        self.object_errors.set(n as i64);
    }

    pub fn record_cleanup(&self, report: &CleanupReport) {
        let result = if report.undeletable.is_empty() {
            "clean"
        } else {
            "undeletable"
        };
        self.resets.get_or_create(&label("result", result)).inc();
    }

    /// Sets still waiting to be destroyed, over every cleanup so far.
    pub fn set_undeletable_sets(&self, n: usize) {
        self.undeletable_ipsets.set(n as i64);
    }

    pub fn record_switch(&self) {
        self.switches.inc();
    }

    pub fn set_effective(&self, e: &Effective) {
        for kind in [
            DataplaneKind::Ebpf,
            DataplaneKind::Iptables,
            DataplaneKind::None,
        ] {
            let on = i64::from(kind == e.kind);
            self.dataplane
                .get_or_create(&label("dataplane", kind.to_string()))
                .set(on);
        }
        // Every reason always has a sample (0 or 1), so an alert can tell "no fallback"
        // from "no agent".
        for cause in FallbackCause::ALL {
            self.fallback
                .get_or_create(&label("reason", cause.label()))
                .set(i64::from(
                    e.fallback.as_ref().map(|f| f.cause) == Some(cause),
                ));
        }
    }

    pub fn set_dataplane_status(&self, s: &DataplaneStatus) {
        self.endpoints.set(s.endpoints as i64);
        for (key, value) in &s.details {
            if let Some(m) = MapPressure::from_detail(key, value) {
                self.map_fill
                    .get_or_create(&label("map", m.map.clone()))
                    .set(m.ratio());
            }
        }
    }

    /// Brings the verdict and drop counters up to the dataplane's counts.
    pub fn set_verdict_counts(&self, counts: &VerdictCounts) {
        let labels = |policy: &str, d: Direction, verdict: &str| -> Labels {
            let (namespace, name) = policy.split_once('/').unwrap_or(("", policy));
            [
                ("namespace", namespace),
                ("policy", name),
                ("direction", d.name()),
                ("verdict", verdict),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .to_vec()
        };
        for (verdict, by_policy) in [("allow", &counts.allowed), ("audit", &counts.audited)] {
            for ((policy, d), packets) in by_policy {
                self.mirror(
                    "verdicts",
                    &self.verdicts,
                    labels(policy, *d, verdict),
                    *packets,
                );
            }
        }
        for (d, packets) in &counts.denied {
            self.mirror("verdicts", &self.verdicts, labels("", *d, "deny"), *packets);
        }
        self.mirror(
            "drops",
            &self.drops,
            label("reason", "default-deny"),
            counts.denied.values().sum(),
        );
        for (reason, packets) in &counts.drops {
            self.mirror("drops", &self.drops, label("reason", *reason), *packets);
        }
    }

    /// Advances a counter by what `count` (a dataplane's own, monotonic until its state
    /// is recreated) grew since the last read. A count below the last one started again
    /// from zero (new maps or chains after a switch or restart): all of it is new.
    fn mirror(
        &self,
        family: &'static str,
        into: &Family<Labels, Counter>,
        labels: Labels,
        count: u64,
    ) {
        let mut last = self.mirrored.lock().unwrap_or_else(|e| e.into_inner());
        let seen = last.entry((family, labels.clone())).or_default();
        let grown = if count >= *seen { count - *seen } else { count };
        *seen = count;
        into.get_or_create(&labels).inc_by(grown);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_format_names_dataplane_fallback_and_map_pressure() {
        let m = Metrics::new();
        m.set_effective(&Effective {
            kind: DataplaneKind::Iptables,
            fallback: Some(super::super::select::Fallback {
                cause: FallbackCause::EbpfUnavailable,
                reason: "auto: eBPF unavailable: no BTF".into(),
            }),
        });
        m.set_dataplane_status(&DataplaneStatus {
            kind: Some(DataplaneKind::Iptables),
            endpoints: 4,
            details: vec![("map_pressure.POLICY".into(), "4096/16384 (25.0%)".into())],
            ..Default::default()
        });
        let text = m.encode();
        assert!(
            text.contains("weir_dataplane_active{dataplane=\"iptables\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("weir_dataplane_active{dataplane=\"ebpf\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("weir_dataplane_fallback{reason=\"ebpf_unavailable\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("weir_dataplane_fallback{reason=\"ebpf_start_failed\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("weir_map_fill_ratio{map=\"POLICY\"} 0.25"),
            "{text}"
        );
        assert!(text.contains("weir_endpoints 4"), "{text}");
    }

    #[test]
    fn verdict_counters_follow_the_dataplane_and_survive_its_reset() {
        let m = Metrics::new();
        let counts = |allowed: u64, denied: u64| VerdictCounts {
            allowed: [(("x/allow-a".to_string(), Direction::Ingress), allowed)].into(),
            denied: [(Direction::Egress, denied)].into(),
            audited: [(("y/try".to_string(), Direction::Egress), denied)].into(),
            drops: [(crate::dataplane::DROP_SPOOFED, 2)].into(),
        };
        m.set_verdict_counts(&counts(5, 3));
        m.set_verdict_counts(&counts(9, 4));
        let text = m.encode();
        for line in [
            "weir_policy_verdicts_total{namespace=\"x\",policy=\"allow-a\",direction=\"ingress\",verdict=\"allow\"} 9",
            "weir_policy_verdicts_total{namespace=\"\",policy=\"\",direction=\"egress\",verdict=\"deny\"} 4",
            "weir_drops_total{reason=\"default-deny\"} 4",
            "weir_policy_verdicts_total{namespace=\"y\",policy=\"try\",direction=\"egress\",verdict=\"audit\"} 4",
            "weir_drops_total{reason=\"spoofed-source\"} 2",
            "# TYPE weir_drops counter",
        ] {
            assert!(text.contains(line), "{line} not in\n{text}");
        }
        // The dataplane's maps recreated: its counts start again, the counters go on.
        m.set_verdict_counts(&counts(1, 0));
        let text = m.encode();
        assert!(
            text.contains("weir_policy_verdicts_total{namespace=\"x\",policy=\"allow-a\",direction=\"ingress\",verdict=\"allow\"} 10"),
            "{text}"
        );
        assert!(
            text.contains("weir_drops_total{reason=\"default-deny\"} 4"),
            "{text}"
        );
    }
}
