//! The agent's Prometheus metrics (`weir_*`), one registry per agent.
//!
//! Map pressure and drops come from [`DataplaneStatus::details`]: a detail named
//! `map_pressure.<map>` carries `used/capacity ...`, one named `drops.<reason>` a drop count.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::enforcer::CleanupReport;
use super::select::Effective;
use crate::dataplane::{DataplaneKind, DataplaneStatus};

type Labels = Vec<(String, String)>;

pub struct Metrics {
    registry: Registry,
    objects: Family<Labels, Gauge>,
    endpoints: Gauge,
    apply_seconds: Histogram,
    object_errors: Gauge,
    resets: Family<Labels, Counter>,
    undeletable_ipsets: Gauge,
    dataplane: Family<Labels, Gauge>,
    fallback: Family<Labels, Gauge>,
    switches: Counter,
    map_fill: Family<Labels, Gauge<f64, AtomicU64>>,
    drops: Family<Labels, Gauge>,
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
            object_errors: Gauge::default(),
            resets: Family::default(),
            undeletable_ipsets: Gauge::default(),
            dataplane: Family::default(),
            fallback: Family::default(),
            switches: Counter::default(),
            map_fill: Family::default(),
            drops: Family::default(),
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
            "1 with the reason when the dataplane is not the one asked for",
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
            "Packets dropped by the dataplane, by reason",
            m.drops.clone(),
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
        for kind in [DataplaneKind::Ebpf, DataplaneKind::Iptables] {
            let on = i64::from(kind == e.kind);
            self.dataplane
                .get_or_create(&label("dataplane", kind.to_string()))
                .set(on);
        }
        self.fallback.clear();
        if let Some(reason) = &e.fallback_reason {
            self.fallback
                .get_or_create(&label("reason", reason.clone()))
                .set(1);
        }
    }

    pub fn set_dataplane_status(&self, s: &DataplaneStatus) {
        self.endpoints.set(s.endpoints as i64);
        for (key, value) in &s.details {
            if let Some(map) = key.strip_prefix("map_pressure.") {
                if let Some(ratio) = fill_ratio(value) {
                    self.map_fill.get_or_create(&label("map", map)).set(ratio);
                }
            } else if let Some(reason) = key.strip_prefix("drops.") {
                if let Ok(v) = value.parse::<i64>() {
                    self.drops.get_or_create(&label("reason", reason)).set(v);
                }
            }
        }
    }
}

/// `used/capacity` at the start of `value` as a ratio.
fn fill_ratio(value: &str) -> Option<f64> {
    let head = value.split_whitespace().next()?;
    let (used, cap) = head.split_once('/')?;
    let (used, cap): (f64, f64) = (used.parse().ok()?, cap.parse().ok()?);
    (cap > 0.0).then(|| used / cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_format_names_dataplane_fallback_and_map_pressure() {
        let m = Metrics::new();
        m.set_effective(&Effective {
            kind: DataplaneKind::Iptables,
            fallback_reason: Some("auto: eBPF unavailable: no BTF".into()),
        });
        m.set_dataplane_status(&DataplaneStatus {
            kind: Some(DataplaneKind::Iptables),
            endpoints: 4,
            details: vec![
                ("map_pressure.POLICY".into(), "4096/16384 (25.0%)".into()),
                ("drops.policy".into(), "7".into()),
            ],
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
            text.contains("weir_dataplane_fallback{reason=\"auto: eBPF unavailable: no BTF\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("weir_map_fill_ratio{map=\"POLICY\"} 0.25"),
            "{text}"
        );
        assert!(text.contains("weir_drops{reason=\"policy\"} 7"), "{text}");
        assert!(text.contains("weir_endpoints 4"), "{text}");
    }
}
