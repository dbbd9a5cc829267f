//! The eBPF dataplane: TC classifiers on each local pod's host-side interface that decide
//! from maps alone (see ebpf/weir-ebpf). This side loads and pins them once, adopts the
//! pins on every later start, and turns the desired state into map contents.
//!
//! Every apply computes the full map contents from [`Desired`] and writes only the
//! difference to what the maps hold, in an order that never denies what both the old and
//! the new state allow: new POLICY entries, IDENTITY changes, ENDPOINT entries (written
//! *before* a new interface is attached, so a pod is enforced from its first filtered
//! packet), detaches, then stale ENDPOINT and POLICY entries.
//!
//! An attached interface without an ENDPOINT entry passes traffic: it can only be a
//! leftover filter on an interface we no longer manage (the agent writes the entry before
//! attaching and detaches before deleting it), and blocking it could cut off an unrelated
//! interface that reused the index.

mod attach;
mod config;
mod events;
mod host;
mod identities;
mod kernel_state;
mod loader;
pub mod monitor;
mod pins;
mod policy_map;
mod probe;
mod records;

use std::collections::{BTreeMap, BTreeSet};

use weir_common::{
    map_names, EndpointInfo, EP_EGRESS_ISOLATED, EP_HAS_IPV4, EP_HAS_IPV6, EP_INGRESS_ISOLATED,
};

pub use attach::AttachMode;
pub use config::{EbpfConfig, DEFAULT_PIN_ROOT};
pub use events::{MonitorEvent, OutputFormat};
pub use loader::OBJECT as EMBEDDED_OBJECT;
pub use probe::{probe, MIN_KERNEL};

use self::{
    kernel_state::KernelState,
    loader::{Maps, Programs},
    pins::PinLayout,
    records::{EndpointRecord, Records},
};
use super::{ApplyFailure, ApplyReport, Dataplane, DataplaneError, DataplaneKind, DataplaneStatus};
use crate::policy::desired::{AddressSet, Delta, Desired, Endpoint, PodKey, SetId};

/// Counters (see [`EbpfDataplane::counters`]) that count drops, by reason.
const DROP_REASONS: [&str; 4] = [
    "default-deny",
    "spoofed-source",
    "tagged-frame",
    "malformed",
];

pub struct EbpfDataplane {
    layout: PinLayout,
    programs: Programs,
    maps: Maps,
    records: Records,
    mode: AttachMode,
    /// What the maps hold (read back at start, then kept in step with every write).
    kernel: KernelState,
    /// The last identity plan and the sets it was made for: most changes leave the sets
    /// alone, and planning is the costly part of an apply at scale.
    identity_cache: Option<(BTreeMap<SetId, AddressSet>, identities::IdentityPlan)>,
    /// The node's addresses (exempt from policy); refreshed by every reconcile.
    host: Vec<identities::Prefix>,
    counts: (usize, usize, usize),
}

impl EbpfDataplane {
    /// Loads and pins the programs, or adopts the ones pinned under the pin root. Never
    /// detaches anything: what is attached keeps enforcing until [`Dataplane::reconcile`].
    pub fn new(config: EbpfConfig) -> Result<Self, DataplaneError> {
        let layout = PinLayout::new(&config.pin_root);
        let fresh = loader::ensure_loaded(&layout, &config)?;
        let mut maps = Maps::open(&layout)?;
        let mut records = records::load(&maps.records).unwrap_or_default();
        let fingerprint = loader::fingerprint(&config);
        let upgrade = !fresh && records.fingerprint.as_deref() != Some(fingerprint.as_str());
        if upgrade {
            tracing::info!("pinned eBPF programs differ from this build or settings: replacing");
            loader::load_and_pin(&layout, &config)?;
        }
        let mut programs = loader::open_programs(&layout)?;
        if upgrade {
            for (pod, r) in &records.endpoints {
                let a = &r.attachment;
                if let Err(e) =
                    attach::attach(&mut programs, &layout, &a.ifname, a.ifindex, a.mode, true)
                {
                    tracing::warn!(
                        pod,
                        "program not replaced (the old one keeps enforcing): {e}"
                    );
                }
            }
        }
        records.fingerprint = Some(fingerprint);
        records::store(&mut maps.records, &records)
            .map_err(|e| DataplaneError::Other(format!("map {}: {e}", map_names::RECORDS)))?;
        if config.kernel_debug_log {
            loader::forward_kernel_logs(&programs)?;
        }
        let kernel = KernelState::read(&maps);
        let host = host::node_prefixes().map_err(DataplaneError::Other)?;
        tracing::info!(
            pin_root = %layout.root.display(),
            endpoints = records.endpoints.len(),
            policy_entries = kernel.policy.len(),
            "eBPF dataplane ready"
        );
        Ok(EbpfDataplane {
            layout,
            programs,
            maps,
            records,
            mode: config.attach_mode.unwrap_or_else(attach::preferred_mode),
            kernel,
            host,
            identity_cache: None,
            counts: (0, 0, 0),
        })
    }

    /// Kernel ids of the two programs (stable across policy changes and restarts).
    pub fn program_ids(&self) -> Result<[u32; 2], DataplaneError> {
        let id = |p: &aya::programs::SchedClassifier| {
            p.info()
                .map(|i| i.id())
                .map_err(|e| DataplaneError::Other(format!("program info: {e}")))
        };
        Ok([id(&self.programs.from_pod)?, id(&self.programs.to_pod)?])
    }

    /// Packets and bytes admitted per rule (summed over CPUs), and the reserved slots
    /// (drops by reason, replies and established flows, non-isolated traffic, flows in the
    /// overflow table, followed fragments, suppressed events).
    pub fn counters(&self) -> Vec<(String, u64, u64)> {
        let mut out = Vec::new();
        let mut read = |name: String, index: u32| {
            if let Ok(per_cpu) = self.maps.counters.get(&index, 0) {
                let (p, b) = per_cpu
                    .iter()
                    .fold((0, 0), |(p, b), c| (p + c.packets, b + c.bytes));
                out.push((name, p, b));
            }
        };
        for (index, name) in [
            (weir_common::COUNTER_DEFAULT_DENY, "default-deny"),
            (weir_common::COUNTER_REPLY, "reply"),
            (weir_common::COUNTER_NOT_ISOLATED, "not-isolated"),
            (weir_common::COUNTER_ICMP_ERROR, "icmp-error"),
            (weir_common::COUNTER_HOST, "node-address"),
            (weir_common::COUNTER_SPOOFED, "spoofed-source"),
            (weir_common::COUNTER_TAGGED, "tagged-frame"),
            (weir_common::COUNTER_MALFORMED, "malformed"),
            (weir_common::COUNTER_CT_OVERFLOW, "ct-overflow"),
            (
                weir_common::COUNTER_NEIGHBOR_DISCOVERY,
                "neighbor-discovery",
            ),
            (weir_common::COUNTER_FRAGMENT_FOLLOWED, "fragment-followed"),
            (weir_common::COUNTER_EVENTS_SUPPRESSED, "events-suppressed"),
        ] {
            read(name.to_string(), index);
        }
        for (id, name) in &self.records.rules.by_id {
            read(name.to_string(), *id);
        }
        out
    }

    pub fn pin_root(&self) -> &std::path::Path {
        &self.layout.root
    }

    /// Where `pod`'s programs are attached, if they are.
    pub fn attachment(&self, pod: &str) -> Option<(String, u32, AttachMode)> {
        self.records.endpoints.get(pod).map(|r| {
            (
                r.attachment.ifname.clone(),
                r.attachment.ifindex,
                r.attachment.mode,
            )
        })
    }

    /// Program ids on `pod`'s TCX hooks (from the pod, to the pod).
    pub fn tcx_program_ids(&self, pod: &str) -> Result<[Vec<u32>; 2], DataplaneError> {
        let r = self
            .records
            .endpoints
            .get(pod)
            .ok_or_else(|| DataplaneError::Other(format!("pod {pod} is not attached")))?;
        attach::tcx_program_ids(&r.attachment)
    }

    /// Finds (or keeps) the interface of each endpoint and its endpoint id.
    fn place_endpoints(
        &self,
        desired: &Desired,
        failures: &mut Vec<ApplyFailure>,
    ) -> BTreeMap<PodKey, (u32, String, u32)> {
        let mut used: BTreeSet<u32> = self.records.endpoints.values().map(|r| r.id).collect();
        let mut next = 1;
        let mut placed = BTreeMap::new();
        for (pod, ep) in &desired.endpoints {
            let known = self.records.endpoints.get(pod);
            let iface = match known {
                // Still the same interface (not deleted and recreated under the name).
                Some(r) if attach::ifindex(&r.attachment.ifname) == Some(r.attachment.ifindex) => {
                    Ok((r.attachment.ifname.clone(), r.attachment.ifindex))
                }
                _ => locate(ep),
            };
            let (ifname, ifindex) = match iface {
                Ok(i) => i,
                Err(reason) => {
                    failures.push(ApplyFailure {
                        object: pod.clone(),
                        reason,
                    });
                    continue;
                }
            };
            let id = match known {
                Some(r) => r.id,
                None => {
                    while used.contains(&next) {
                        next += 1;
                    }
                    used.insert(next);
                    next
                }
            };
            placed.insert(pod.clone(), (id, ifname, ifindex));
        }
        placed
    }

    fn converge(&mut self, desired: &Desired) -> Result<ApplyReport, DataplaneError> {
        let mut failures = Vec::new();
        let plan = match &self.identity_cache {
            Some((sets, plan)) if *sets == desired.sets => plan.clone(),
            _ => {
                let plan = self.records.identities.plan(desired.sets.values());
                self.identity_cache = Some((desired.sets.clone(), plan.clone()));
                plan
            }
        };
        let rule_ids = self.records.rules.plan(desired.endpoints.values());
        let placed = self.place_endpoints(desired, &mut failures);

        let mut target = KernelState {
            identity: plan.trie,
            ..Default::default()
        };
        for prefix in &self.host {
            target.identity.insert(*prefix, weir_common::IDENTITY_HOST);
        }
        let mut owner: BTreeMap<u32, String> = BTreeMap::new();
        for (pod, (id, _, ifindex)) in &placed {
            let ep = &desired.endpoints[pod];
            let mut flags = 0;
            if ep.ingress.isolated {
                flags |= EP_INGRESS_ISOLATED;
            }
            if ep.egress.isolated {
                flags |= EP_EGRESS_ISOLATED;
            }
            target
                .endpoint
                .insert(*ifindex, endpoint_info(*id, flags, ep));
            for addr in [
                ep.ipv4.map(|a| a.to_ipv6_mapped().octets()),
                ep.ipv6.map(|a| a.octets()),
            ]
            .into_iter()
            .flatten()
            {
                target.local.insert(addr, *id);
            }
            owner.insert(*id, pod.clone());
            policy_map::endpoint_entries(
                *id,
                ep,
                &plan.identities_of_set,
                &rule_ids,
                &mut target.policy,
            );
        }

        let errors = &mut failures;
        let name_policy = |e: &policy_map::PolicyEntry| {
            let id = e.1.endpoint_id;
            format!(
                "map {} (pod {})",
                map_names::POLICY,
                owner.get(&id).map_or("?", String::as_str)
            )
        };
        self.kernel
            .upsert_policy(&mut self.maps, &target, name_policy, errors);
        self.kernel.upsert_identity(&mut self.maps, &target, errors);
        self.kernel.delete_identity(&mut self.maps, &target, errors);
        self.kernel.upsert_endpoint(&mut self.maps, &target, errors);
        self.kernel.upsert_local(&mut self.maps, &target, errors);

        // Attach pods whose interface is new; endpoint entries are in place already.
        let mut attached = BTreeMap::new();
        for (pod, (id, ifname, ifindex)) in &placed {
            if !target.endpoint.contains_key(ifindex) || !self.kernel.endpoint.contains_key(ifindex)
            {
                // Its ENDPOINT entry failed: never attach without it.
                continue;
            }
            let same = self
                .records
                .endpoints
                .get(pod)
                .is_some_and(|r| r.attachment.ifindex == *ifindex);
            let attachment = if same {
                self.records.endpoints[pod].attachment.clone()
            } else {
                match attach::attach(
                    &mut self.programs,
                    &self.layout,
                    ifname,
                    *ifindex,
                    self.mode,
                    false,
                ) {
                    Ok(a) => a,
                    Err(e) => {
                        errors.push(ApplyFailure {
                            object: pod.clone(),
                            reason: e.to_string(),
                        });
                        continue;
                    }
                }
            };
            attached.insert(
                pod.clone(),
                EndpointRecord {
                    id: *id,
                    attachment,
                },
            );
        }
        // Detach what is no longer wanted (or moved to another interface).
        let stale: Vec<(PodKey, EndpointRecord)> = self
            .records
            .endpoints
            .iter()
            .filter(|(pod, r)| {
                attached
                    .get(*pod)
                    .is_none_or(|n| n.attachment.ifindex != r.attachment.ifindex)
            })
            .map(|(pod, r)| (pod.clone(), r.clone()))
            .collect();
        for (pod, record) in stale {
            if let Err(e) = attach::detach(&self.layout, &record.attachment) {
                errors.push(ApplyFailure {
                    object: pod.clone(),
                    reason: e.to_string(),
                });
                // Still attached: keep the record so the next reconcile retries.
                attached.entry(pod).or_insert(record);
            }
        }
        self.records.endpoints = attached;

        self.kernel.delete_endpoint(&mut self.maps, &target, errors);
        self.kernel.delete_local(&mut self.maps, &target, errors);
        self.kernel
            .delete_policy(&mut self.maps, &target, name_policy, errors);
        if let Err(e) = records::store(&mut self.maps.records, &self.records) {
            failures.push(ApplyFailure {
                object: format!("map {}", map_names::RECORDS),
                reason: e.to_string(),
            });
        }
        self.counts = (
            self.records.endpoints.len(),
            desired.sets.len(),
            self.records.rules.by_id.len(),
        );
        Ok(ApplyReport { failures })
    }
}

/// The ENDPOINT record: id, isolation, and the addresses the pod may send from
/// (anti-spoofing: a family without an address is dropped whole).
fn endpoint_info(endpoint_id: u32, mut flags: u32, ep: &Endpoint) -> EndpointInfo {
    let mut info = EndpointInfo {
        endpoint_id,
        ..Default::default()
    };
    if let Some(v4) = ep.ipv4 {
        flags |= EP_HAS_IPV4;
        info.ipv4 = v4.to_ipv6_mapped().octets();
    }
    if let Some(v6) = ep.ipv6 {
        flags |= EP_HAS_IPV6;
        info.ipv6 = v6.octets();
    }
    info.flags = flags;
    info
}

fn locate(ep: &Endpoint) -> Result<(String, u32), String> {
    let addr = ep
        .ipv4
        .map(std::net::IpAddr::V4)
        .or(ep.ipv6.map(std::net::IpAddr::V6))
        .ok_or_else(|| "pod has no address yet".to_string())?;
    attach::interface_for(addr)
}

impl Dataplane for EbpfDataplane {
    fn kind(&self) -> DataplaneKind {
        DataplaneKind::Ebpf
    }

    fn reconcile(&mut self, desired: &Desired) -> Result<ApplyReport, DataplaneError> {
        // Repair drift: trust the kernel's maps, not the mirror.
        self.kernel = KernelState::read(&self.maps);
        match host::node_prefixes() {
            Ok(host) => self.host = host,
            Err(e) => tracing::warn!("node addresses not refreshed: {e}"),
        }
        self.converge(desired)
    }

    fn apply(&mut self, _delta: &Delta, desired: &Desired) -> Result<ApplyReport, DataplaneError> {
        self.converge(desired)
    }

    fn status(&self) -> DataplaneStatus {
        let mut details = vec![
            ("pin_root".into(), self.layout.root.display().to_string()),
            (
                "attach_mode".into(),
                format!("{:?}", self.mode).to_lowercase(),
            ),
        ];
        for (name, used) in [
            (map_names::IDENTITY, self.kernel.identity.len()),
            (map_names::ENDPOINT, self.kernel.endpoint.len()),
            (map_names::POLICY, self.kernel.policy.len()),
        ] {
            if let Some(cap) = loader::capacity(&self.layout, name) {
                details.push((
                    format!("map_pressure.{name}"),
                    format!(
                        "{used}/{cap} ({:.1}%)",
                        used as f64 * 100.0 / f64::from(cap)
                    ),
                ));
            }
        }
        // Drops by reason (no rule denies: policy drops are default denies); the metrics
        // export them as weir_drops{reason}.
        for (name, packets, _) in self.counters() {
            if DROP_REASONS.contains(&name.as_str()) {
                details.push((format!("drops.{name}"), packets.to_string()));
            }
        }
        DataplaneStatus {
            kind: Some(DataplaneKind::Ebpf),
            endpoints: self.counts.0,
            sets: self.counts.1,
            rules: self.counts.2,
            details,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::desired::DirectionPolicy;

    #[test]
    fn endpoint_record_carries_the_addresses_it_may_send_from() {
        let mut ep = Endpoint {
            pod: "x/a".into(),
            ipv4: Some("10.244.0.7".parse().unwrap()),
            ipv6: None,
            ingress: DirectionPolicy::default(),
            egress: DirectionPolicy::default(),
        };
        let info = endpoint_info(3, EP_INGRESS_ISOLATED, &ep);
        assert_eq!(info.endpoint_id, 3);
        assert_eq!(info.flags, EP_INGRESS_ISOLATED | EP_HAS_IPV4);
        // IPv4-mapped, as the programs store every address.
        assert_eq!(
            info.ipv4,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 244, 0, 7]
        );
        assert_eq!(info.ipv6, [0; 16], "no IPv6 address: IPv6 is all spoofed");
        ep.ipv6 = Some("fd00::7".parse().unwrap());
        let info = endpoint_info(3, 0, &ep);
        assert_eq!(info.flags, EP_HAS_IPV4 | EP_HAS_IPV6);
        assert_eq!(
            info.ipv6,
            "fd00::7".parse::<std::net::Ipv6Addr>().unwrap().octets()
        );
    }
}
