//! The eBPF dataplane: TC classifiers on each local pod's host-side interface that decide
//! from maps alone (see ebpf/weir-ebpf). This side loads and pins them once, adopts the
//! pins on every later start, and turns the desired state into map contents.
//!
//! Every apply computes the full map contents from [`Desired`] and writes only the
//! difference to what the maps hold, in an order that never denies what both the old and
//! the new state allow: new POLICY entries, IDENTITY changes, ENDPOINT entries (written
//! *before* a new interface is attached, so a pod is enforced from its first filtered
//! packet), detaches, then stale ENDPOINT and POLICY entries. A new identity's entries
//! are thus in place before any address is given it, and a released identity's go after
//! every address left it; an id the maps still hold is never given to a new signature
//! (see `plan_identities`), so an id means one signature for a whole convergence. POLICY is written one pod
//! direction at a time, whole or not at all: a direction whose entries do not fit the
//! map's room is closed (its allowing entries removed, see `KernelState::upsert_policy`),
//! so a peer whose identity was just written can never fall back to the any-peer entries.
//!
//! An attached interface without an ENDPOINT entry passes traffic: it can only be a
//! leftover filter on an interface we no longer manage (the agent writes the entry before
//! attaching and detaches before deleting it), and blocking it could cut off an unrelated
//! interface that reused the index. A pod interface that appears before its endpoint is
//! programmed gets a pending entry instead (both directions isolated, no rules: see
//! `link_watch`), which the endpoint's real entry replaces. Pinned maps whose shape differs
//! from this build's are migrated, never reused (see `migrate`). One iptables chain
//! belongs to this dataplane: Service traffic kube-proxy DNATs to the node itself passes
//! no pod's hook, and is judged from INPUT (see `deferred_to_node`).

mod attach;
mod config;
pub mod decode;
mod deferred_to_node;
mod events;
mod flow_state;
mod hooks;
mod identities;
mod identity_index;
mod identity_room;
mod kernel_state;
mod link_watch;
mod loader;
mod migrate;
pub mod monitor;
mod pins;
mod policy_map;
mod probe;
mod records;
mod service_room;

use std::{
    borrow::Cow,
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
};

use weir_common::{
    map_names, EndpointInfo, ServiceKey, EP_EGRESS_ISOLATED, EP_HAS_IPV4, EP_HAS_IPV6,
    EP_INGRESS_ISOLATED,
};

pub use attach::tcx_missing;
pub use config::{EbpfConfig, DEFAULT_IDENTITY_ENTRIES, DEFAULT_PIN_ROOT, DEFAULT_SERVICE_ENTRIES};
pub use hooks::{AttachMode, Role, PENDING_ENDPOINT_ID};
pub use loader::{Preload, OBJECT as EMBEDDED_OBJECT};
pub use migrate::{expected as expected_map_shapes, Shape as MapShape};
pub use probe::{kernel_lacks, probe, probe_kernel, ProbeError, MIN_KERNEL};

use self::{
    kernel_state::KernelState,
    loader::{Maps, Programs},
    pins::PinLayout,
    records::{EndpointRecord, Records},
};
use super::{
    pod_ports, ApplyReport, Dataplane, DataplaneError, DataplaneKind, DataplaneStatus, Scope,
    VerdictCounts, DROP_MALFORMED, DROP_SPOOFED, DROP_TAGGED,
};
use weir_policy::desired::{Desired, Direction, Endpoint, Frontend, PodKey};
use weir_policy::model::ObjectError;

pub struct EbpfDataplane {
    layout: PinLayout,
    /// Shared with the new-pod link watch, which attaches them too.
    programs: Arc<Mutex<Programs>>,
    maps: Maps,
    records: Records,
    mode: AttachMode,
    /// Why not TCX, when the kernel lacks it (for status).
    no_tcx: Option<String>,
    /// What the maps hold (read back at start, then kept in step with every write).
    kernel: KernelState,
    /// The identity plan, kept up to date with what changed between convergences:
    /// planning every set is the costly part of an apply at scale.
    identities: identity_index::IdentityIndex,
    /// The node's addresses (exempt from policy); refreshed by every reconcile.
    host: Vec<identities::Prefix>,
    counts: (usize, usize, usize),
    /// Pinned maps of another shape being replaced: the new programs (on the new maps)
    /// are swapped in after the first converge has filled those maps.
    migration: Option<migrate::Migration>,
    /// New pod interfaces isolated until programmed (`None`: switched off).
    isolator: Option<Arc<link_watch::Isolator>>,
    /// Where pods' network namespaces are: bridge ports are found through them.
    pod_netns_dir: std::path::PathBuf,
    /// Whether the endpoint records were checked for bridges since the start.
    records_checked_for_bridges: std::cell::Cell<bool>,
    /// Pod directions held closed because an IDENTITY prefix they tell apart had no room
    /// (see `identity_room`): they open only after it is written.
    held_for_identity: BTreeSet<kernel_state::PolicyGroup>,
    /// Frontends SERVICE has no room for (see `service_room`): their addresses are
    /// marked in IDENTITY before their entries leave SERVICE.
    unlisted_frontends: BTreeSet<ServiceKey>,
    /// Their marks whose frontends are listed again: removed once SERVICE holds those.
    lingering_unlisted: BTreeSet<identities::Prefix>,
    _link_watch: Option<link_watch::LinkWatch>,
    /// The node's iptables backend, which holds `deferred_to_node`'s chain.
    iptables_backend: crate::netfilter::backend::Backend,
    /// Why `deferred_to_node`'s chain is not in place (then Service traffic DNATed to the
    /// node is not judged), for the status.
    deferred_to_node_error: Option<String>,
}

/// The shape of the map pinned as `name` under `pin_root`, if there is one.
pub fn pinned_map_shape(pin_root: &std::path::Path, name: &str) -> Option<MapShape> {
    MapShape::of_pin(&PinLayout::new(pin_root).map(name)).ok()
}

impl EbpfDataplane {
    /// Loads and pins the programs, or adopts the ones pinned under the pin root. Never
    /// detaches anything: what is attached keeps enforcing until [`Dataplane::reconcile`].
    pub fn new(config: EbpfConfig) -> Result<Self, DataplaneError> {
        Self::with_preload(config, None)
    }

    /// [`EbpfDataplane::new`], taking the programs a [`Preload`] loaded while the cluster
    /// was listed (it waits for them).
    pub fn with_preload(
        config: EbpfConfig,
        preload: Option<Preload>,
    ) -> Result<Self, DataplaneError> {
        let preloaded = preload.is_some_and(Preload::finish);
        let no_tcx = attach::tcx_missing();
        let mode = match config.attach_mode {
            Some(AttachMode::Tcx) => match &no_tcx {
                // Refused before anything is loaded or pinned.
                Some(why) => {
                    return Err(DataplaneError::Unsupported(format!(
                        "attach mode tcx was asked for, but this kernel lacks {why}; without \
                         a forced mode weir attaches clsact filters over netlink here"
                    )))
                }
                None => AttachMode::Tcx,
            },
            Some(mode) => mode,
            None => match &no_tcx {
                None => AttachMode::Tcx,
                Some(why) => {
                    tracing::info!(
                        "this kernel lacks {why}: attaching clsact filters over netlink"
                    );
                    AttachMode::Netlink
                }
            },
        };
        let layout = PinLayout::new(&config.pin_root);
        layout.prepare()?;
        let migration = migrate::Migration::prepare(&layout, &config)?;
        let fresh = match &migration {
            Some(_) => false,
            // Pinned by the preload, unless something (a cleanup) removed them since.
            None => loader::ensure_loaded(&layout, &config)? || preloaded,
        };
        let mut maps = Maps::open(|name| match &migration {
            Some(m) => m.map_path(&layout, name),
            None => layout.map(name),
        })?;
        let mut records = records::load(&maps.records).unwrap_or_default();
        let fingerprint = loader::fingerprint(&config);
        let upgrade = migration.is_none()
            && !fresh
            && records.fingerprint.as_deref() != Some(fingerprint.as_str());
        if upgrade {
            tracing::info!("pinned eBPF programs differ from this build or settings: replacing");
            loader::load_and_pin(&layout, &config)?;
        }
        let mut programs = match &migration {
            Some(m) => loader::open_programs_in(&m.progs_dir())?,
            None => loader::open_programs(&layout)?,
        };
        if upgrade {
            for a in records.attachments() {
                if let Err(e) = attach::attach(
                    &mut programs,
                    &layout,
                    &a.ifname,
                    a.ifindex,
                    a.mode,
                    a.role,
                    true,
                ) {
                    tracing::warn!(
                        interface = a.ifname,
                        "program not replaced (the old one keeps enforcing): {e}"
                    );
                }
            }
        }
        records.fingerprint = Some(fingerprint);
        records::store(&mut maps.records, &records)
            .map_err(|e| DataplaneError::map(format!("map {}", map_names::RECORDS), e))?;
        if config.kernel_debug_log {
            loader::forward_kernel_logs(&programs)?;
        }
        let kernel = KernelState::read(&maps);
        let host = node_prefixes()?;
        let programs = Arc::new(Mutex::new(programs));
        let (isolator, link_watch) = if config.new_pods.enabled() {
            config.new_pods.validate()?;
            let endpoint_pin = match &migration {
                Some(m) => m.map_path(&layout, map_names::ENDPOINT),
                None => layout.map(map_names::ENDPOINT),
            };
            let endpoint = aya::maps::MapData::from_pin(&endpoint_pin)
                .and_then(|d| aya::maps::HashMap::try_from(aya::maps::Map::HashMap(d)))
                .map_err(|e| DataplaneError::map(format!("map {}", map_names::ENDPOINT), e))?;
            let isolator = Arc::new(link_watch::Isolator {
                layout: layout.clone(),
                filter: config.new_pods.clone(),
                programs: programs.clone(),
                endpoint: Mutex::new(endpoint),
            });
            let watch =
                link_watch::watch(isolator.clone()).map_err(|source| DataplaneError::Io {
                    context: "watch links for new pod interfaces".into(),
                    source,
                })?;
            (Some(isolator), Some(watch))
        } else {
            (None, None)
        };
        tracing::info!(
            pin_root = %layout.root.display(),
            endpoints = records.endpoints.len(),
            policy_entries = kernel.policy.len(),
            "eBPF dataplane ready"
        );
        let mut dataplane = EbpfDataplane {
            layout,
            programs,
            maps,
            records,
            mode,
            no_tcx,
            kernel,
            host,
            identities: Default::default(),
            counts: (0, 0, 0),
            migration,
            isolator,
            pod_netns_dir: config.pod_netns_dir.clone(),
            records_checked_for_bridges: std::cell::Cell::new(false),
            held_for_identity: BTreeSet::new(),
            unlisted_frontends: BTreeSet::new(),
            lingering_unlisted: BTreeSet::new(),
            _link_watch: link_watch,
            iptables_backend: config
                .iptables_backend
                .unwrap_or_else(crate::netfilter::backend::detect),
            deferred_to_node_error: None,
        };
        dataplane.ensure_deferred_to_node();
        Ok(dataplane)
    }

    /// (Re)writes the INPUT chain that judges Service traffic DNATed to the node, on the
    /// program pinned now. A failure leaves that one path unjudged: said once in the log
    /// and kept in the status until it succeeds (every reconcile tries again).
    fn ensure_deferred_to_node(&mut self) {
        let program = self
            .layout
            .prog(weir_common::program_names::DEFERRED_TO_NODE);
        let result =
            deferred_to_node::ensure(self.iptables_backend, &program).map_err(|e| e.to_string());
        match (&result, &self.deferred_to_node_error) {
            (Err(e), last) if last.as_ref() != Some(e) => tracing::warn!(
                error = %e,
                "Service traffic DNATed to this node is not judged (a ClusterNetworkPolicy deny to the node does not hold through a Service with a host-network backend)"
            ),
            (Ok(()), Some(_)) => {
                tracing::info!("Service traffic DNATed to this node is judged again")
            }
            _ => {}
        }
        self.deferred_to_node_error = result.err();
    }

    /// Ends a migration once the new maps hold the desired state: the new programs go
    /// onto every attached hook (atomically each), then the staging pins replace the old.
    fn finish_migration(&mut self, failures: &mut Vec<ObjectError>) {
        if self.migration.is_none() {
            return;
        }
        // Swap only onto complete maps: a write that failed (a full map) would turn into
        // a gap the old programs do not have.
        if let Some(f) = failures.iter().find(|f| f.object.starts_with("map ")) {
            tracing::warn!(
                "map migration waits: the new maps are incomplete ({}: {})",
                f.object,
                f.reason
            );
            return;
        }
        let Some(mut migration) = self.migration.take() else {
            return;
        };
        migration.refresh(&self.layout);
        let mut hooks: BTreeMap<u32, (String, AttachMode, Role)> = BTreeMap::new();
        for a in self.records.attachments() {
            hooks.insert(a.ifindex, (a.ifname.clone(), a.mode, a.role));
        }
        // Every pinned TCX link, ours by construction, whoever attached it; and the
        // interfaces isolated as new pods (netlink filters have no pins).
        for ifindex in attach::pinned_link_ifindexes(&self.layout) {
            if let Some(name) = attach::ifname(ifindex) {
                hooks
                    .entry(ifindex)
                    .or_insert((name, AttachMode::Tcx, Role::Pod));
            }
        }
        for (ifindex, info) in KernelState::read(&self.maps).endpoint {
            if info.endpoint_id == PENDING_ENDPOINT_ID {
                // Pending without a TCX pin: isolated by a netlink filter.
                if let Some(name) = attach::ifname(ifindex) {
                    hooks
                        .entry(ifindex)
                        .or_insert((name, AttachMode::Netlink, Role::Pod));
                }
            }
        }
        let mut swapped = true;
        let mut programs = self.programs.lock().unwrap_or_else(|e| e.into_inner());
        for (ifindex, (ifname, mode, role)) in &hooks {
            if attach::ifindex(ifname) != Some(*ifindex) {
                continue; // gone: nothing left to enforce there
            }
            if let Err(e) = attach::attach(
                &mut programs,
                &self.layout,
                ifname,
                *ifindex,
                *mode,
                *role,
                true,
            ) {
                swapped = false;
                failures.push(ObjectError {
                    object: format!("interface {ifname}"),
                    reason: format!(
                        "new program not swapped in (the old one keeps enforcing): {e}"
                    ),
                });
            }
        }
        drop(programs);
        if !swapped {
            self.migration = Some(migration);
            return;
        }
        if let Err(e) = migration.commit(&self.layout) {
            failures.push(ObjectError {
                object: "pinned maps".into(),
                reason: format!("migration not committed (retried at the next start): {e}"),
            });
        }
        // The chain holds the program it was written with: the old one, on the old maps.
        self.ensure_deferred_to_node();
    }

    /// Kernel ids of the two programs (stable across policy changes and restarts).
    pub fn program_ids(&self) -> Result<[u32; 2], DataplaneError> {
        let id = |p: &aya::programs::SchedClassifier| {
            p.info()
                .map(|i| i.id())
                .map_err(|e| DataplaneError::program("program info", e))
        };
        let programs = self.programs.lock().unwrap_or_else(|e| e.into_inner());
        Ok([id(&programs.from_pod)?, id(&programs.to_pod)?])
    }

    /// Packets and bytes of one COUNTERS slot, over every CPU.
    fn counter(&self, index: u32) -> Result<(u64, u64), aya::maps::MapError> {
        let per_cpu = self.maps.counters.get(&index, 0)?;
        Ok(per_cpu
            .iter()
            .fold((0, 0), |(p, b), c| (p + c.packets, b + c.bytes)))
    }

    /// Packets and bytes admitted per rule (summed over CPUs), and the reserved slots
    /// (drops by reason, replies and established flows, non-isolated traffic, flows in the
    /// overflow table, followed fragments, suppressed events).
    pub fn counters(&self) -> Vec<(String, u64, u64)> {
        let mut out = Vec::new();
        let mut read = |name: String, index: u32| {
            if let Ok((p, b)) = self.counter(index) {
                out.push((name, p, b));
            }
        };
        for (index, name) in [
            (weir_common::COUNTER_DEFAULT_DENY, "default-deny-ingress"),
            (
                weir_common::COUNTER_DEFAULT_DENY_EGRESS,
                "default-deny-egress",
            ),
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
            (weir_common::COUNTER_SERVICE_DEFERRED, "service-deferred"),
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
            .ok_or_else(|| DataplaneError::NotAttached(pod.to_owned()))?;
        attach::tcx_program_ids(&r.attachment)
    }

    /// Finds (or keeps) the interface of each endpoint and its endpoint id. An interface
    /// is one pod's only: a bridge (the route to every pod on it) is never attached to,
    /// the pod's own port is found through its namespace (see `pod_ports`), and an
    /// interface two pods lead to is neither's. Unplaced pods are failures (retried at
    /// the next converge); their interfaces stay isolated as new pods.
    fn place_endpoints(
        &self,
        desired: &Desired,
        failures: &mut Vec<ObjectError>,
    ) -> BTreeMap<PodKey, (u32, String, u32)> {
        let mut used: BTreeSet<u32> = self.records.endpoints.values().map(|r| r.id).collect();
        let mut next = 1;
        let mut found: BTreeMap<PodKey, (String, u32)> = BTreeMap::new();
        let mut to_locate: Vec<(PodKey, &Endpoint)> = Vec::new();
        for (pod, ep) in &desired.endpoints {
            match self.records.endpoints.get(pod) {
                // Still the same interface (not deleted and recreated under the name).
                Some(r) if attach::ifindex(&r.attachment.ifname) == Some(r.attachment.ifindex) => {
                    found.insert(
                        pod.clone(),
                        (r.attachment.ifname.clone(), r.attachment.ifindex),
                    );
                }
                _ => to_locate.push((pod.clone(), ep)),
            }
        }
        // Listed when a pod needs placing, and once after start: a record an earlier
        // release made on a bridge is not kept (this one never makes such records).
        let check_records = !self.records_checked_for_bridges.get();
        let links = match to_locate.is_empty() && !check_records {
            true => Ok(pod_ports::NodeLinks::default()),
            false => pod_ports::NodeLinks::read(),
        };
        if let (Ok(links), true) = (&links, check_records) {
            self.records_checked_for_bridges.set(true);
            found.retain(|pod, (ifname, _)| {
                let bridge = links.is_bridge(ifname);
                if bridge {
                    to_locate.push((pod.clone(), &desired.endpoints[pod]));
                }
                !bridge
            });
        }
        let mut bridged: BTreeMap<String, Vec<std::net::IpAddr>> = BTreeMap::new();
        let mut bridge_of: BTreeMap<PodKey, String> = BTreeMap::new();
        for (pod, ep) in to_locate {
            // The reason is the pod's report (ObjectError): text from here on.
            let located = locate(ep)
                .map_err(|e| e.to_string())
                .and_then(|(ifname, ifindex)| match &links {
                    Ok(l) if l.is_bridge(&ifname) => Ok(Err(ifname)),
                    Ok(_) => Ok(Ok((ifname, ifindex))),
                    Err(e) => Err(format!("interfaces not listed: {e}")),
                });
            match located {
                Ok(Ok(iface)) => {
                    found.insert(pod.clone(), iface);
                }
                Ok(Err(bridge)) => {
                    bridged.insert(pod.clone(), endpoint_addrs(ep));
                    bridge_of.insert(pod.clone(), bridge);
                }
                Err(reason) => failures.push(ObjectError {
                    object: pod.clone(),
                    reason,
                }),
            }
        }
        if let Ok(links) = &links {
            for (pod, port) in pod_ports::locate(&self.pod_netns_dir, links, &bridged) {
                match port {
                    Ok(port) => {
                        found.insert(pod, (port.ifname, port.ifindex));
                    }
                    Err(reason) => {
                        let reason = format!(
                            "not attached to bridge {} (the interface of every pod on it); \
                             its port was not found: {reason}",
                            bridge_of.get(&pod).map_or("?", String::as_str)
                        );
                        tracing::warn!(pod, "{reason}");
                        failures.push(ObjectError {
                            object: pod,
                            reason,
                        });
                    }
                }
            }
        }
        // One interface, one pod: an interface two pods lead to is neither's.
        let mut pods_of: BTreeMap<u32, Vec<PodKey>> = BTreeMap::new();
        for (pod, (_, ifindex)) in &found {
            pods_of.entry(*ifindex).or_default().push(pod.clone());
        }
        for shared in pods_of.values().filter(|p| p.len() > 1) {
            for pod in shared {
                if let Some((ifname, _)) = found.remove(pod) {
                    failures.push(ObjectError {
                        object: pod.clone(),
                        reason: format!(
                            "interface {ifname} is the interface of pods {}: not attached",
                            shared.join(", ")
                        ),
                    });
                }
            }
        }
        let mut placed = BTreeMap::new();
        for (pod, (ifname, ifindex)) in found {
            let id = match self.records.endpoints.get(&pod) {
                Some(r) => r.id,
                None => {
                    while used.contains(&next) {
                        next += 1;
                    }
                    used.insert(next);
                    next
                }
            };
            placed.insert(pod, (id, ifname, ifindex));
        }
        placed
    }

    /// One convergence, in the order the module documentation gives: the target map
    /// contents; what is added or changed (policy, identity, endpoint entries); attaches;
    /// detaches; what goes (endpoints, then policy). Each phase is a method below.
    fn write(&mut self, desired: &Desired) -> Result<ApplyReport, DataplaneError> {
        let mut failures = Vec::new();
        let placed = self.place_endpoints(desired, &mut failures);
        let (mut target, owner) = self.target(desired, &placed);
        let services = service_room::fit_frontends(
            desired,
            &self.host,
            self.maps.service_capacity,
            &self.kernel,
            &mut target,
        );
        services.report(&mut failures);
        self.unlisted_frontends = services.unlisted.into_keys().collect();
        self.lingering_unlisted = services.lingering;
        let pending = self.keep_pending(&mut target);
        let name_policy = |e: &policy_map::PolicyEntry| {
            let id = e.1.endpoint_id;
            format!(
                "map {} (pod {})",
                map_names::POLICY,
                owner.get(&id).map_or("?", String::as_str)
            )
        };
        // Each endpoint's namespace: POLICY's room is shared by namespace.
        let namespaces: BTreeMap<u32, String> = owner
            .iter()
            .map(|(id, pod)| {
                (
                    *id,
                    pod.split_once('/')
                        .map_or(pod.as_str(), |(ns, _)| ns)
                        .to_string(),
                )
            })
            .collect();
        let (staged, closed) =
            self.write_additions(&target, &namespaces, &name_policy, &mut failures);
        // What was written: the target, less what IDENTITY's room held back.
        let target = staged.as_ref().unwrap_or(&target);
        let attached = self.attach_placed(&placed, target, &mut failures);
        let left = self.detach_stale(attached, &pending.turned_pending, &mut failures);
        self.converge_leaving(target, &mut failures);
        self.write_removals(target, pending.released, &left, &name_policy, &mut failures);
        // The removals may have made room: closed directions are tried again now, not at
        // the next change. Those still closed are reported.
        let closed = match closed.is_empty() {
            true => closed,
            false => self.kernel.upsert_policy(
                &mut self.maps,
                target,
                &namespaces,
                name_policy,
                &mut failures,
            ),
        };
        if !closed.is_empty() {
            tracing::warn!(
                directions = closed.len(),
                "POLICY entries not written: those pods' directions deny every peer until \
                 they are"
            );
        }
        failures.extend(closed.into_values());
        self.finish_migration(&mut failures);
        if let Err(e) = records::store(&mut self.maps.records, &self.records) {
            failures.push(ObjectError {
                object: format!("map {}", map_names::RECORDS),
                reason: e.to_string(),
            });
        }
        self.counts = (
            self.records.endpoints.len(),
            desired.sets.len(),
            self.records.rules.by_id.len(),
        );
        Ok(ApplyReport {
            failures,
            held_sets: Vec::new(),
        })
    }
}

/// Interfaces isolated as new pods that a convergence keeps isolated or lets go.
struct Pending {
    /// Pending interfaces that are gone or no longer match the settings.
    released: Vec<u32>,
    /// Pod interfaces whose endpoint went while the interface stayed: pending in place,
    /// attachment kept.
    turned_pending: BTreeSet<u32>,
}

impl EbpfDataplane {
    /// The map contents `desired` needs, with each endpoint id's pod (for naming
    /// failures).
    fn target(
        &mut self,
        desired: &Desired,
        placed: &BTreeMap<PodKey, (u32, String, u32)>,
    ) -> (KernelState, BTreeMap<u32, String>) {
        plan_target(
            &mut self.identities,
            &mut self.records.identities,
            &mut self.records.rules,
            desired,
            placed,
            &self.host,
            &self.kernel,
        )
    }

    /// Interfaces isolated as new pods stay isolated until an endpoint is placed there;
    /// those that are gone (or no longer match the settings) are released after the
    /// detaches.
    fn keep_pending(&self, target: &mut KernelState) -> Pending {
        let mut released = Vec::new();
        for (ifindex, info) in &self.kernel.endpoint {
            if info.endpoint_id != PENDING_ENDPOINT_ID || target.endpoint.contains_key(ifindex) {
                continue;
            }
            let keep = self.isolator.as_ref().is_some_and(|i| {
                attach::ifname(*ifindex).is_some_and(|name| i.filter.applies_to(&name))
            });
            if keep {
                target.endpoint.insert(*ifindex, *info);
            } else {
                released.push(*ifindex);
            }
        }
        // A pod interface whose endpoint goes while the interface stays (the pod left the
        // desired state, or moved): it turns pending in place, attachment kept, so it is
        // never open in between.
        let mut turned_pending = BTreeSet::new();
        if let Some(isolator) = &self.isolator {
            for r in self.records.endpoints.values() {
                let a = &r.attachment;
                if target.endpoint.contains_key(&a.ifindex)
                    || attach::ifindex(&a.ifname) != Some(a.ifindex)
                    || !isolator.filter.applies_to(&a.ifname)
                {
                    continue;
                }
                target.endpoint.insert(a.ifindex, link_watch::PENDING);
                turned_pending.insert(a.ifindex);
            }
        }

        Pending {
            released,
            turned_pending,
        }
    }

    /// New and changed entries, before any attach: POLICY, IDENTITY, ENDPOINT and the
    /// maps the Service path reads. IDENTITY's new prefixes are planned against its
    /// room (see `identity_room`): the directions a prefix left out would misjudge are
    /// held closed before anything is written, and those that can open again open only
    /// after their prefixes are written. Returns the target as written (without what is
    /// held) and the pod directions whose POLICY entries did not fit (closed), with
    /// their failures.
    fn write_additions(
        &mut self,
        target: &KernelState,
        namespaces: &BTreeMap<u32, String>,
        name_policy: &dyn Fn(&policy_map::PolicyEntry) -> String,
        errors: &mut Vec<ObjectError>,
    ) -> (
        Option<KernelState>,
        BTreeMap<kernel_state::PolicyGroup, ObjectError>,
    ) {
        // First pass: the prefixes that fit now, every held direction still closed.
        let room = identity_room::plan_identity_room(&self.kernel, target, self.identity_room());
        let mut holding = room.held.keys().copied().collect::<BTreeSet<_>>();
        holding.extend(&self.held_for_identity);
        self.hold(&holding, name_policy, errors);
        let staged = room.staged(target, &holding);
        let mut closed =
            self.kernel
                .upsert_policy(&mut self.maps, &staged, namespaces, name_policy, errors);
        self.kernel.upsert_identity(&mut self.maps, &staged, errors);
        self.kernel.delete_identity(&mut self.maps, &staged, errors);
        // Second pass, with the room the removals made: the prefixes left out are
        // written, then the directions no longer held open.
        let mut room =
            identity_room::plan_identity_room(&self.kernel, target, self.identity_room());
        let mut staged = room.staged(target, &BTreeSet::new());
        let held_now: BTreeSet<_> = room.held.keys().copied().collect();
        self.hold(&held_now, name_policy, errors);
        // (What the kernel refused in the first pass is tried again here.)
        let refused = self.kernel.upsert_identity(&mut self.maps, &staged, errors);
        if !refused.is_empty() {
            // The kernel refused some (not a planned lack of room): their addresses keep
            // what they have, and the directions that judge that differently are held.
            let more = identity_room::refused(target, refused, &self.kernel.identity);
            let more_held: BTreeSet<_> = more.held.keys().copied().collect();
            self.hold(&more_held, name_policy, errors);
            let mut kept = more.staged(&staged, &BTreeSet::new()).into_owned();
            for prefix in more.unwritten.keys() {
                if let Some(id) = self.kernel.identity.get(prefix) {
                    kept.identity.insert(*prefix, *id);
                }
            }
            staged = Cow::Owned(kept);
            room.held.extend(more.held);
        }
        closed.extend(self.kernel.upsert_policy(
            &mut self.maps,
            &staged,
            namespaces,
            name_policy,
            errors,
        ));
        self.report_identity_room(&room, name_policy, errors);
        self.held_for_identity = room.held.keys().copied().collect();
        self.kernel.upsert_endpoint(&mut self.maps, &staged, errors);
        self.kernel.upsert_local(&mut self.maps, &staged, errors);
        // Frontends left out for room go before the others are added (their addresses
        // are marked in IDENTITY by now), so that the map has room for those.
        self.kernel
            .evict_service(&mut self.maps, &self.unlisted_frontends, errors);
        self.kernel.upsert_service(&mut self.maps, &staged, errors);
        // (Only those SERVICE now holds a frontend of: a refused write keeps the mark.)
        let lingering = std::mem::take(&mut self.lingering_unlisted);
        let in_service: BTreeSet<u128> = if lingering.is_empty() {
            BTreeSet::new()
        } else {
            self.kernel
                .service
                .keys()
                .map(|k| u128::from_be_bytes(k.addr))
                .collect()
        };
        let listed_again: Vec<identities::Prefix> = lingering
            .into_iter()
            .filter(|p| in_service.contains(&p.addr))
            .collect();
        self.kernel
            .remove_identity(&mut self.maps, &listed_again, errors);
        self.kernel
            .upsert_endpoint_by_id(&mut self.maps, &staged, errors);
        let staged = match staged {
            Cow::Borrowed(_) => None,
            Cow::Owned(staged) => Some(staged),
        };
        (staged, closed)
    }

    /// The IDENTITY entries new prefixes may take: its capacity less what it holds, less
    /// one, so that the trie is never full: kernels before 6.13 refuse even an in-place
    /// update of a full LPM trie (`None`: unknown).
    fn identity_room(&self) -> Option<usize> {
        self.maps
            .identity_capacity
            .map(|c| (c as usize).saturating_sub(self.kernel.identity.len() + 1))
    }

    /// Closes `groups` (removes their allowing entries) before anything else is written.
    fn hold(
        &mut self,
        groups: &BTreeSet<kernel_state::PolicyGroup>,
        name_policy: &dyn Fn(&policy_map::PolicyEntry) -> String,
        errors: &mut Vec<ObjectError>,
    ) {
        for group in groups {
            self.kernel
                .close_group(&mut self.maps, *group, &name_policy, errors);
        }
    }

    /// Names what `room` left out and what it holds closed, in the apply's failures.
    fn report_identity_room(
        &self,
        room: &identity_room::IdentityRoom,
        name_policy: &dyn Fn(&policy_map::PolicyEntry) -> String,
        errors: &mut Vec<ObjectError>,
    ) {
        if room.unwritten.is_empty() {
            return;
        }
        const SHOWN: usize = 8;
        let shown: Vec<String> = room
            .unwritten
            .keys()
            .take(SHOWN)
            .map(kernel_state::identity_object)
            .collect();
        let more = room.unwritten.len().saturating_sub(SHOWN);
        tracing::warn!(
            unwritten = room.unwritten.len(),
            held = room.held.len(),
            "IDENTITY prefixes not written: the pod directions that would misjudge their \
             addresses deny every peer until they are"
        );
        errors.push(ObjectError {
            object: format!("map {}", map_names::IDENTITY),
            reason: format!(
                "map is full: {} prefixes not written ({}{}; {} new, {} free): their \
                 addresses keep a shorter prefix's identity or the world's until they fit, \
                 and the {} pod directions that would judge them differently deny every \
                 peer meanwhile (raise the map's size, or remove what fills it)",
                room.unwritten.len(),
                shown.join(", "),
                match more {
                    0 => String::new(),
                    n => format!(" and {n} more"),
                },
                room.new,
                room.free,
                room.held.len(),
            ),
        });
        for ((endpoint_id, direction), prefix) in &room.held {
            errors.push(ObjectError {
                object: name_policy(&(
                    0,
                    weir_common::PolicyKey {
                        endpoint_id: *endpoint_id,
                        ..Default::default()
                    },
                )),
                reason: format!(
                    "its {} denies every peer until {} is written (it tells that prefix's \
                     addresses apart from the identity they have meanwhile)",
                    kernel_state::direction_name(*direction),
                    kernel_state::identity_object(prefix),
                ),
            });
        }
    }

    /// Attaches pods whose interface is new; their ENDPOINT entries are in place already.
    /// Returns every pod's attachment record.
    fn attach_placed(
        &mut self,
        placed: &BTreeMap<PodKey, (u32, String, u32)>,
        target: &KernelState,
        errors: &mut Vec<ObjectError>,
    ) -> BTreeMap<PodKey, EndpointRecord> {
        let mut attached = BTreeMap::new();
        for (pod, (id, ifname, ifindex)) in placed {
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
                    &mut self.programs.lock().unwrap_or_else(|e| e.into_inner()),
                    &self.layout,
                    ifname,
                    *ifindex,
                    self.mode,
                    Role::Pod,
                    false,
                ) {
                    Ok(a) => {
                        if a.mode == AttachMode::Tcx {
                            // Its TCX link decides now: the new-pod filter can go.
                            attach::remove_netlink_filters(ifname, *ifindex);
                        }
                        a
                    }
                    Err(e) => {
                        errors.push(ObjectError {
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
        attached
    }

    /// Detaches what is no longer wanted (or moved to another interface); the records
    /// become `attached` plus whatever could not be detached. Returns the endpoint ids
    /// that left their interface (the pod went, or was made again on a new one: a new
    /// sandbox is a new pod), whose flows [`flow_state`] forgets.
    fn detach_stale(
        &mut self,
        mut attached: BTreeMap<PodKey, EndpointRecord>,
        turned_pending: &BTreeSet<u32>,
        errors: &mut Vec<ObjectError>,
    ) -> BTreeSet<u32> {
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
        let left = stale.iter().map(|(_, r)| r.id).collect();
        for (pod, record) in stale {
            if turned_pending.contains(&record.attachment.ifindex) {
                continue;
            }
            if let Err(e) = attach::detach(&self.layout, &record.attachment) {
                errors.push(ObjectError {
                    object: pod.clone(),
                    reason: e.to_string(),
                });
                // Still attached: keep the record so the next reconcile retries.
                attached.entry(pod).or_insert(record);
            }
        }
        self.records.endpoints = attached;
        left
    }

    /// What goes, after the detaches: ENDPOINT and the Service path's entries, released
    /// pending interfaces, then stale POLICY entries.
    fn write_removals(
        &mut self,
        target: &KernelState,
        released: Vec<u32>,
        leaving: &BTreeSet<u32>,
        name_policy: &dyn Fn(&policy_map::PolicyEntry) -> String,
        errors: &mut Vec<ObjectError>,
    ) {
        self.kernel.delete_endpoint(&mut self.maps, target, errors);
        self.kernel.delete_local(&mut self.maps, target, errors);
        self.kernel.delete_service(&mut self.maps, target, errors);
        self.kernel
            .delete_endpoint_by_id(&mut self.maps, target, errors);
        match flow_state::forget_endpoints(&self.layout, leaving) {
            Ok(0) => {}
            Ok(n) => tracing::debug!(
                ?leaving,
                entries = n,
                "flows of departed endpoints forgotten"
            ),
            Err(e) => errors.push(ObjectError {
                object: format!("flows of departed endpoint ids {leaving:?}"),
                reason: format!(
                    "not forgotten ({e}): a new pod given one of these ids at the same \
                     address may pass as their flows until they expire"
                ),
            }),
        }
        for ifindex in released {
            if !self.kernel.endpoint.contains_key(&ifindex) {
                link_watch::release_pins(&self.layout, ifindex);
                if let Some(name) = attach::ifname(ifindex) {
                    // Still there but no longer a pod interface by the settings.
                    attach::remove_netlink_filters(&name, ifindex);
                }
            }
        }
        if let Some(isolator) = &self.isolator {
            for (ifname, reason) in isolator.scan() {
                errors.push(ObjectError {
                    object: format!("interface {ifname}"),
                    reason: format!("new pod interface not isolated: {reason}"),
                });
            }
        }
        self.kernel
            .delete_policy(&mut self.maps, target, name_policy, errors);
    }
}

impl EbpfDataplane {
    /// Puts `weir_to_pod` on the egress of every other interface of the node (uplinks,
    /// tunnels, bridges): a pod's Service traffic whose backend is elsewhere leaves
    /// through one of them and is judged there, after DNAT. Interfaces that went, or
    /// turned out to be pods', lose it.
    fn converge_leaving(&mut self, target: &KernelState, errors: &mut Vec<ObjectError>) {
        let pods: BTreeSet<u32> = self
            .records
            .endpoints
            .values()
            .map(|r| r.attachment.ifindex)
            .chain(target.endpoint.keys().copied())
            .collect();
        let is_pod_interface = |name: &str| {
            self.isolator
                .as_ref()
                .is_some_and(|i| i.filter.applies_to(name))
        };
        let wanted: BTreeMap<u32, String> = link_watch::interfaces()
            .into_iter()
            .filter(|(ifindex, name)| {
                name != "lo" && !pods.contains(ifindex) && !is_pod_interface(name)
            })
            .collect();
        let gone: Vec<u32> = self
            .records
            .leaving
            .iter()
            .filter(|(ifindex, a)| wanted.get(*ifindex) != Some(&a.ifname))
            .map(|(ifindex, _)| *ifindex)
            .collect();
        for ifindex in gone {
            let a = &self.records.leaving[&ifindex];
            // An interface that turned out to be a pod's (its pod became known after the
            // interface appeared) keeps its egress hook: the pod's attachment adopted that
            // link, which carries the same `weir_to_pod`. Detaching it would leave the pod's
            // ingress judged by nothing.
            if pods.contains(&ifindex) && attach::ifindex(&a.ifname) == Some(ifindex) {
                self.records.leaving.remove(&ifindex);
                continue;
            }
            if let Err(e) = attach::detach(&self.layout, a) {
                errors.push(ObjectError {
                    object: format!("interface {}", a.ifname),
                    reason: e.to_string(),
                });
                continue;
            }
            self.records.leaving.remove(&ifindex);
        }
        for (ifindex, ifname) in wanted {
            if self.records.leaving.contains_key(&ifindex) {
                continue;
            }
            let attached = attach::attach(
                &mut self.programs.lock().unwrap_or_else(|e| e.into_inner()),
                &self.layout,
                &ifname,
                ifindex,
                self.mode,
                Role::Leaving,
                false,
            );
            match attached {
                Ok(a) => {
                    if a.mode == AttachMode::Tcx {
                        // Its TCX link decides now: the link watch's filter can go.
                        attach::remove_netlink_filters(&ifname, ifindex);
                    }
                    self.records.leaving.insert(ifindex, a);
                }
                Err(e) => errors.push(ObjectError {
                    object: format!("interface {ifname}"),
                    reason: format!(
                        "pods' Service traffic leaving through it is not judged after DNAT: {e}"
                    ),
                }),
            }
        }
    }
}

/// The identity plan for `sets`, brought up to date by `index` with `table`'s ids. Ids
/// the maps (`kernel`) still hold are not given to new signatures: an id released now
/// keeps its addresses until the IDENTITY writes and its POLICY entries until the
/// removals, both after the new signatures' POLICY entries are written, so a new
/// signature given it would share those entries with the addresses leaving it.
fn plan_identities(
    index: &mut identity_index::IdentityIndex,
    table: &mut identities::IdentityTable,
    sets: &BTreeMap<weir_policy::desired::SetId, weir_policy::desired::AddressSet>,
    kernel: &KernelState,
) -> identities::IdentityPlan {
    let planned = index.update(table, sets, || kernel.held_identities());
    tracing::debug!(?planned, "identities");
    index.plan().clone()
}

/// The map contents `desired` needs after `kernel`, with each endpoint id's pod (for
/// naming failures): identities planned by `index` with `table`'s ids (see
/// [`plan_identities`]), rule ids by `rules`.
fn plan_target(
    index: &mut identity_index::IdentityIndex,
    table: &mut identities::IdentityTable,
    rules: &mut policy_map::RuleTable,
    desired: &Desired,
    placed: &BTreeMap<PodKey, (u32, String, u32)>,
    host: &[identities::Prefix],
    kernel: &KernelState,
) -> (KernelState, BTreeMap<u32, String>) {
    let plan = plan_identities(index, table, &desired.sets, kernel);
    let rule_ids = rules.plan(desired.endpoints.values());
    let target = planned_state(desired, placed, plan, &rule_ids, host);
    // An identity whose addresses and entries both change gets a fresh id (see
    // `KernelState::moved_and_changed`); the others keep theirs, so once is enough.
    let renumber = kernel.moved_and_changed(&target.0);
    if renumber.is_empty() {
        return target;
    }
    let mut held = kernel.held_identities();
    held.extend(&renumber);
    let planned = index.renumber(table, &desired.sets, &held, &renumber);
    tracing::debug!(?planned, ?renumber, "identities renumbered");
    planned_state(desired, placed, index.plan().clone(), &rule_ids, host)
}

/// The map contents `desired` needs, with each endpoint id's pod (for naming failures):
/// `placed` gives each placed pod's (endpoint id, interface name, ifindex), `plan` and
/// `rule_ids` the identities and rule ids, `host` the node's own prefixes.
pub(crate) fn planned_state(
    desired: &Desired,
    placed: &BTreeMap<PodKey, (u32, String, u32)>,
    plan: identities::IdentityPlan,
    rule_ids: &BTreeMap<policy_map::RuleKey<'_>, u32>,
    host: &[identities::Prefix],
) -> (KernelState, BTreeMap<u32, String>) {
    // The node's addresses are one host identity, unless tiers judge some pod's egress
    // to them: then each carries its sets (weir-common's IDENTITY_HOST_BIT).
    let egress_tiered = desired.endpoints.values().any(|e| e.egress.is_tiered());
    let host: Vec<(identities::Prefix, u32)> = host
        .iter()
        .map(|p| match egress_tiered {
            true => (*p, identities::host_identity(&plan.trie, p)),
            false => (*p, weir_common::IDENTITY_HOST),
        })
        .collect();
    let host_identities: BTreeSet<u32> = host.iter().map(|(_, id)| *id).collect();
    let mut target = KernelState {
        identity: plan.trie,
        ..Default::default()
    };
    target.identity.extend(host);
    for f in &desired.frontends {
        target.service.insert(service_key(f), 1);
    }
    let mut owner: BTreeMap<u32, String> = BTreeMap::new();
    for (pod, (id, _, ifindex)) in placed {
        let ep = &desired.endpoints[pod];
        // A direction the tiers judge is looked up too: its entries decide every packet.
        let judged = |p: &weir_policy::desired::DirectionPolicy| p.isolated || p.is_tiered();
        let mut flags = 0;
        if judged(&ep.ingress) {
            flags |= EP_INGRESS_ISOLATED;
        }
        if judged(&ep.egress) {
            flags |= EP_EGRESS_ISOLATED;
        }
        let info = endpoint_info(*id, flags, ep);
        target.endpoint.insert(*ifindex, info);
        target.endpoint_by_id.insert(*id, info);
        for addr in [
            ep.ipv4.map(|a| a.to_ipv6_mapped().octets()),
            ep.ipv6.map(|a| a.octets()),
        ]
        .into_iter()
        .flatten()
        {
            target.local.insert(weir_common::IdentityKey { addr }, *id);
        }
        owner.insert(*id, pod.clone());
        policy_map::endpoint_entries(
            *id,
            ep,
            &plan.identities_of_set,
            &host_identities,
            rule_ids,
            &mut target.policy,
        );
    }

    (target, owner)
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

/// The SERVICE key of a frontend (a nodePort: all-zero address).
fn service_key(f: &Frontend) -> ServiceKey {
    let addr = match f.addr {
        Some(std::net::IpAddr::V4(a)) => a.to_ipv6_mapped().octets(),
        Some(std::net::IpAddr::V6(a)) => a.octets(),
        None => [0; 16],
    };
    ServiceKey {
        addr,
        port: f.port,
        protocol: f.protocol.number(),
        _pad: 0,
    }
}

fn endpoint_addrs(ep: &Endpoint) -> Vec<std::net::IpAddr> {
    let v4 = ep.ipv4.map(std::net::IpAddr::V4);
    let v6 = ep.ipv6.map(std::net::IpAddr::V6);
    v4.into_iter().chain(v6).collect()
}

/// The interface the route to the pod's address leads to: the pod's own veth on a routed
/// node, the bridge on a bridged one.
fn locate(ep: &Endpoint) -> Result<(String, u32), attach::LocateError> {
    let addr = ep
        .ipv4
        .map(std::net::IpAddr::V4)
        .or(ep.ipv6.map(std::net::IpAddr::V6))
        .ok_or(attach::LocateError::NoAddress)?;
    attach::interface_for(addr)
}

impl Dataplane for EbpfDataplane {
    fn verdict_tap(
        &self,
        tx: std::sync::Arc<crate::verdicts::VerdictTx>,
    ) -> Result<crate::verdicts::VerdictTap, DataplaneError> {
        monitor::tap(&self.layout.root, tx)
    }

    fn verdict_counts(&self) -> Result<VerdictCounts, DataplaneError> {
        let packets = |index: u32| {
            self.counter(index).map(|(p, _)| p).map_err(|e| {
                DataplaneError::map(format!("read {} slot {index}", map_names::COUNTERS), e)
            })
        };
        let mut counts = VerdictCounts::default();
        let mut tier_denied: BTreeMap<Direction, u64> = BTreeMap::new();
        for (id, rule) in &self.records.rules.by_id {
            if rule.action == Some(weir_policy::desired::Action::Deny) {
                *tier_denied.entry(rule.direction).or_default() += packets(*id)?;
                continue;
            }
            counts.add_rule(&rule.policy, rule.is_audit(), rule.direction, packets(*id)?);
        }
        for direction in [Direction::Ingress, Direction::Egress] {
            let slot = weir_common::default_deny_counter(policy_map::kernel_direction(direction));
            let tier = tier_denied.get(&direction).copied().unwrap_or_default();
            counts.denied.insert(direction, packets(slot)? + tier);
        }
        for (reason, slot) in [
            (DROP_SPOOFED, weir_common::COUNTER_SPOOFED),
            (DROP_TAGGED, weir_common::COUNTER_TAGGED),
            (DROP_MALFORMED, weir_common::COUNTER_MALFORMED),
        ] {
            counts.drops.insert(reason, packets(slot)?);
        }
        Ok(counts)
    }

    fn kind(&self) -> DataplaneKind {
        DataplaneKind::Ebpf
    }

    fn converge(&mut self, desired: &Desired, scope: Scope) -> Result<ApplyReport, DataplaneError> {
        if scope == Scope::Kernel {
            // Repair drift: trust the kernel's maps, not the mirror.
            self.kernel = KernelState::read(&self.maps);
            match node_prefixes() {
                Ok(host) => self.host = host,
                Err(e) => tracing::warn!("node addresses not refreshed: {e}"),
            }
            self.ensure_deferred_to_node();
        }
        self.write(desired)
    }

    fn status(&self) -> DataplaneStatus {
        let mut details = vec![
            ("pin_root".into(), self.layout.root.display().to_string()),
            (
                "attach_mode".into(),
                format!("{:?}", self.mode).to_lowercase(),
            ),
        ];
        if let Some(why) = &self.no_tcx {
            details.push(("kernel_lacks".into(), why.clone()));
        }
        if let Some(why) = &self.deferred_to_node_error {
            details.push(("service_traffic_to_node_not_judged".into(), why.clone()));
        }
        if !self.unlisted_frontends.is_empty() {
            details.push((
                "service_frontends_unlisted".into(),
                format!(
                    "{} (no room in {}: judged pods are refused at them)",
                    self.unlisted_frontends.len(),
                    map_names::SERVICE
                ),
            ));
        }
        if self.isolator.is_some() {
            let pending = self
                .maps
                .endpoint
                .iter()
                .filter_map(Result::ok)
                .filter(|(_, info)| info.endpoint_id == PENDING_ENDPOINT_ID)
                .count();
            details.push(("pod_interfaces_not_programmed".into(), pending.to_string()));
        }
        if let Some(m) = &self.migration {
            let names: Vec<&str> = m.mismatches.iter().map(|m| m.name.as_str()).collect();
            details.push((
                "map_migration_pending".into(),
                format!("{} (swapped in after the next converge)", names.join(",")),
            ));
        }
        for (name, used) in [
            (map_names::IDENTITY, self.kernel.identity.len()),
            (map_names::ENDPOINT, self.kernel.endpoint.len()),
            (map_names::POLICY, self.kernel.policy.len()),
            (map_names::SERVICE, self.kernel.service.len()),
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
        DataplaneStatus {
            kind: Some(DataplaneKind::Ebpf),
            endpoints: self.counts.0,
            sets: self.counts.1,
            rules: self.counts.2,
            details,
        }
    }
}

/// The node's addresses ([`crate::dataplane::node_addresses`]) as host prefixes.
fn node_prefixes() -> Result<Vec<identities::Prefix>, DataplaneError> {
    Ok(crate::dataplane::node_addresses::read()?
        .into_iter()
        .map(|a| identities::Prefix::from_net(&a.into()))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_policy::desired::{
        AddressSet, DirectionPolicy, Member, Peer, PortRange, Ports, Protocol, Rule, RuleOrigin,
        SetId,
    };

    fn pods(id: u64, addrs: &[&str]) -> AddressSet {
        AddressSet {
            id: SetId(id),
            definition: format!("pods of set {id}"),
            members: addrs
                .iter()
                .map(|a| Member {
                    net: ipnet::IpNet::from(a.parse::<std::net::IpAddr>().unwrap()),
                    except: false,
                })
                .collect(),
        }
    }

    /// x/server (10.0.0.1) admits set 1 on TCP 80 and set 2 on TCP `port2`.
    fn server_world(set1: &[&str], set2: &[&str], port2: u16) -> Desired {
        let rule = |set: u64, port: u16| Rule {
            peer: Peer::Set(SetId(set)),
            ports: Ports::Protocol {
                protocol: Protocol::Tcp,
                range: Some(PortRange {
                    first: port,
                    last: port,
                }),
            },
            origin: RuleOrigin {
                policy: format!("x/from-set-{set}"),
                rule_index: 0,
            },
        };
        let server = Endpoint {
            pod: "x/server".into(),
            ipv4: Some("10.0.0.1".parse().unwrap()),
            ipv6: None,
            ingress: DirectionPolicy {
                isolated: true,
                rules: [rule(1, 80), rule(2, port2)].into_iter().collect(),
                ..DirectionPolicy::default()
            },
            egress: DirectionPolicy::default(),
        };
        Desired {
            sets: [pods(1, set1), pods(2, set2)]
                .into_iter()
                .map(|s| (s.id, s))
                .collect(),
            endpoints: [("x/server".to_string(), server)].into_iter().collect(),
            ..Default::default()
        }
    }

    fn prefix(addr: &str) -> identities::Prefix {
        identities::Prefix::from_net(&addr.parse().unwrap())
    }

    /// Converges from the first of `states` to each next one as the agent plans it, and
    /// replays every write of each convergence through the programs' decision: whatever
    /// any state in between admits (10.0.0.2 to .5 to the server on TCP 80 to 82) must be
    /// admitted by the convergence's old or new state. Returns what was not, and the maps
    /// after each state.
    fn replay(states: &[Desired]) -> (Vec<String>, Vec<KernelState>) {
        let placed: BTreeMap<PodKey, (u32, String, u32)> =
            [("x/server".to_string(), (1, "lxc1".to_string(), 1))].into();
        let ids: BTreeMap<PodKey, u32> = [("x/server".to_string(), 1)].into();
        let mut index = identity_index::IdentityIndex::default();
        let mut table = identities::IdentityTable::default();
        let mut rules = policy_map::RuleTable::default();
        let mut plan = |desired: &Desired, kernel: &KernelState| {
            plan_target(
                &mut index,
                &mut table,
                &mut rules,
                desired,
                &placed,
                &[],
                kernel,
            )
            .0
        };
        let admits = |state: &KernelState, peer: &str, port: u16| {
            decode::Encoded::of_state(state.clone(), ids.clone()).admits(
                "x/server",
                Direction::Ingress,
                peer.parse().unwrap(),
                port,
                Protocol::Tcp,
            )
        };
        let mut kernel = plan(&states[0], &KernelState::default());
        let mut maps = vec![kernel.clone()];
        let mut wrong = Vec::new();
        for (round, desired) in states[1..].iter().enumerate() {
            let want = plan(desired, &kernel);
            let mut state = std::mem::take(&mut kernel);
            let old = state.clone();
            let writes = kernel_state::write_sequence(&old, &want);
            for (step, write) in std::iter::once(None)
                .chain(writes.iter().map(Some))
                .enumerate()
            {
                if let Some(write) = write {
                    state.apply(write);
                }
                for peer in ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"] {
                    for port in [80, 81, 82] {
                        if admits(&state, peer, port)
                            && !admits(&old, peer, port)
                            && !admits(&want, peer, port)
                        {
                            wrong.push(format!(
                                "round {round}, after write {step} ({write:?}): {peer} → \
                                 server:{port} admitted, by neither the old nor the new state"
                            ));
                        }
                    }
                }
            }
            assert_eq!(
                state, want,
                "round {round}: the writes end in the new state"
            );
            maps.push(state.clone());
            kernel = state;
        }
        (wrong, maps)
    }

    /// The hostile tenant's relabel: p (10.0.0.2) leaves set 1, whose signature {1} is then
    /// gone and its identity released, and r (10.0.0.4) joins sets 1 and 2, a signature
    /// new in the same batch; q (10.0.0.3) stays in set 2. Then back, and again.
    #[test]
    fn no_write_of_a_relabel_admits_what_neither_state_does() {
        let before = server_world(&["10.0.0.2"], &["10.0.0.3"], 81);
        let after = server_world(&["10.0.0.4"], &["10.0.0.3", "10.0.0.4"], 81);
        let (wrong, maps) = replay(&[before.clone(), after.clone(), before, after]);
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        // The premise: p's identity was released while r's signature was new; it is
        // given again only once the maps no longer hold it.
        let p_identity = maps[0].identity[&prefix("10.0.0.2/32")];
        assert!(!maps[1].identity.contains_key(&prefix("10.0.0.2/32")));
        assert_ne!(maps[1].identity[&prefix("10.0.0.4/32")], p_identity);
        assert_ne!(maps[3].identity[&prefix("10.0.0.4/32")], p_identity);
    }

    /// A relabel in the batch that changes a policy for the signature it joins: p
    /// (10.0.0.2) moves from set 1 to set 2 while set 2's port goes from 81 to 82; s
    /// (10.0.0.5) stays in set 1 and q (10.0.0.3) in set 2, so both identities stay. p
    /// must never meet set 2's identity with its old port still written.
    #[test]
    fn no_write_of_a_relabel_with_a_policy_change_admits_what_neither_state_does() {
        let before = server_world(&["10.0.0.2", "10.0.0.5"], &["10.0.0.3"], 81);
        let after = server_world(&["10.0.0.5"], &["10.0.0.2", "10.0.0.3"], 82);
        let (wrong, maps) = replay(&[before.clone(), after, before]);
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        // The premise: q's signature is the same across the change, and its identity
        // would have been kept; it is given a fresh id instead, each way.
        let q = |m: &KernelState| m.identity[&prefix("10.0.0.3/32")];
        assert_ne!(q(&maps[0]), q(&maps[1]));
        assert_ne!(q(&maps[1]), q(&maps[2]));
        assert_eq!(maps[1].identity[&prefix("10.0.0.2/32")], q(&maps[1]));
    }

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
