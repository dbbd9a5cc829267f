//! The ipset/iptables dataplane. Address sets become `hash:net` ipsets (one per family,
//! excepts as `nomatch`); each isolated endpoint direction becomes a `WEIR-I-*`/`WEIR-E-*`
//! chain that RETURNs allowed traffic and DROPs the rest; `WEIR-FILTER`, entered first
//! from FORWARD, first drops packets from a pod interface whose source is not the pod's
//! (`WEIR-SPOOF`, see [`spoof`]), then lets packets of known connections through
//! (conntrack ESTABLISHED, and RELATED ICMP errors of an error's size) and dispatches by pod address. Traffic between a pod
//! and its own node (INPUT, OUTPUT) is not policed by NetworkPolicies; where
//! ClusterNetworkPolicy tiers judge a pod's egress, `WEIR-TO-NODE` (entered first from
//! INPUT) sends its packets to the node's addresses (the `weir-node-*` sets: not every
//! local address, see [`crate::dataplane::node_addresses`]) to its egress chain. IPv4
//! through iptables, IPv6 through ip6tables, on the backend (legacy or nft) the node
//! already uses.
//!
//! Writes are batched: one `ipset restore` for additions, one `iptables-restore
//! --noflush` per family (atomic per table), one `ipset restore` for removals. A set the
//! changed rules name has it the other way round: members leave it before the rules and
//! join after them (see `sets_whose_rules_change`). After
//! the first full [`reconcile`](Dataplane::reconcile), changes are applied as deltas
//! against what was programmed: only changed endpoint chains, dispatch rules and set
//! members are written. A failed write forgets what was programmed, so the next call
//! reconciles in full.

mod bridge_netfilter;
mod counters;
mod departed;
pub mod names;
mod nflog;
pub mod rules;
pub mod sets;
pub mod spoof;
mod tables;
mod tier_index;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;
use std::path::Path;

use crate::dataplane::new_pods::NewPodIsolation;
use crate::dataplane::pod_ports;
use crate::dataplane::{
    ApplyReport, Dataplane, DataplaneError, DataplaneKind, DataplaneStatus, Scope, VerdictCounts,
};
use crate::exec;
use crate::reset::{ipset_restore, ipsets};
use weir_policy::desired::{AddressSet, Desired, Direction, Peer, SetId};
use weir_policy::model::ObjectError;

use crate::netfilter::backend::{self, Backend, Family};
use names::ChainNames;
use tables::NodeShape;

/// Up to this many chains rewritten, their counters are read chain by chain (a process
/// each, a few ms); past it, with one save of the whole table.
const CHAINS_READ_ONE_BY_ONE: usize = 16;

#[derive(Clone, Debug)]
pub struct IptablesConfig {
    /// `None`: detect it as kube-proxy's iptables-wrapper does.
    pub backend: Option<Backend>,
    /// Pod interfaces isolated until their endpoint is programmed.
    pub new_pods: NewPodIsolation,
    /// Where pods' network namespaces are: a pod on a bridge is matched to its port
    /// through them (see [`crate::dataplane::pod_ports`]).
    pub pod_netns_dir: std::path::PathBuf,
}

impl Default for IptablesConfig {
    fn default() -> Self {
        IptablesConfig {
            backend: None,
            new_pods: NewPodIsolation::default(),
            pod_netns_dir: crate::dataplane::pod_ports::DEFAULT_POD_NETNS_DIR.into(),
        }
    }
}

pub struct IptablesDataplane {
    backend: Backend,
    new_pods: NewPodIsolation,
    names: ChainNames,
    /// What the kernel holds, as last written; `None` before the first reconcile and
    /// after a failed write.
    programmed: Option<Desired>,
    /// The anti-spoofing rules last written, per family (with `programmed`).
    spoof: BTreeMap<Family, Vec<String>>,
    /// Where pods' network namespaces are: bridge ports are found through them.
    pod_netns_dir: std::path::PathBuf,
    /// Bridge ports found so far, by pod (kept while the port is there).
    bridge_ports: BTreeMap<String, pod_ports::Port>,
    /// The node at the last full write (a bridge: rules match bridge ports with physdev;
    /// IPVS: its hook); a change asks for a full write.
    shape: Option<NodeShape>,
    /// Script lines (ipset and iptables-restore) the last write sent, in `status()`: a
    /// change to one endpoint must cost lines for that endpoint, not for the node.
    last_write_lines: usize,
    /// Chains the last write declared (made or made again) in iptables.
    last_write_chains: usize,
    /// Whether drops and audit verdicts are logged (NFLOG rules); why not when not.
    verdict_log: Result<(), crate::exec::modules::ModuleError>,
    /// What rules counted before a write made their chains again (which restarts their
    /// counters): [`Dataplane::verdict_counts`] adds it, so the counts only grow.
    carried: VerdictCounts,
    /// The node's addresses in the [`names::node_set_name`] sets, read again at each full
    /// write (a repair included, as eBPF reads its host entries again).
    node_addresses: Option<Vec<std::net::IpAddr>>,
    /// Whether those sets are in the kernel: only while a tier judges some pod's egress
    /// (`WEIR-TO-NODE` names them then), so a node without such pods keeps no weir state.
    node_sets_written: bool,
    /// On a node with a bridge, at the last full write: `Some(why)` when bridged packets
    /// do not reach iptables ([`bridge_netfilter`]).
    bridge_netfilter_off: Option<String>,
    /// Each programmed pod's interface and addresses at the last write: whose conntrack
    /// entries go when it departs ([`departed`]).
    placements: BTreeMap<String, departed::Placement>,
}

impl IptablesDataplane {
    /// Picks the backend and checks that its tools run; writes nothing (the first
    /// [`reconcile`](Dataplane::reconcile) does).
    pub fn new(config: IptablesConfig) -> Result<Self, DataplaneError> {
        let backend = config.backend.unwrap_or_else(backend::detect);
        config.new_pods.validate()?;
        // Loaded by alias on first use, unless the node's modprobe configuration stops
        // that: load it by name, as kube-proxy does its modules.
        if !crate::kernel::module_present("ip_set") {
            crate::exec::modules::load("ip_set")?;
        }
        let tools = Family::ALL
            .iter()
            .flat_map(|f| [backend.save_command(*f), backend.restore_command(*f)]);
        for tool in std::iter::once("ipset").chain(tools) {
            match exec::run(tool, &["--version"], None) {
                Ok(out) if out.success => {}
                // It runs, but the kernel refuses it (stderr names the module when it can).
                Ok(out) => {
                    return Err(DataplaneError::Unsupported(format!(
                        "`{tool} --version` fails: {}",
                        out.stderr.trim()
                    )))
                }
                Err(e) => {
                    return Err(DataplaneError::Unsupported(format!(
                        "`{tool}` does not run (install the ipset and iptables packages): {e}"
                    )))
                }
            }
        }
        Ok(IptablesDataplane {
            backend,
            new_pods: config.new_pods,
            names: ChainNames::default(),
            programmed: None,
            spoof: BTreeMap::new(),
            pod_netns_dir: config.pod_netns_dir,
            bridge_ports: BTreeMap::new(),
            shape: None,
            last_write_lines: 0,
            last_write_chains: 0,
            verdict_log: nflog::available(),
            carried: VerdictCounts::default(),
            node_addresses: None,
            node_sets_written: false,
            bridge_netfilter_off: None,
            placements: BTreeMap::new(),
        })
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    fn write(
        &mut self,
        desired: &Desired,
        full: bool,
        report: &mut ApplyReport,
    ) -> Result<(), DataplaneError> {
        self.last_write_lines = 0;
        self.last_write_chains = 0;
        let links = pod_ports::NodeLinks::read();
        let bridged = match &links {
            Ok(l) => l.has_bridge(),
            Err(_) => self.shape.is_some_and(|s| s.bridged),
        };
        let shape = NodeShape {
            bridged,
            ipvs: crate::kernel::has_ipvs(),
            verdict_log: self.verdict_log.is_ok(),
        };
        if self.shape.is_some_and(|s| s.ipvs != shape.ipvs) {
            tracing::info!(
                ipvs = shape.ipvs,
                "IPVS {} this node: the OUTPUT hook follows",
                if shape.ipvs { "appeared on" } else { "left" }
            );
        }
        if full || self.shape != Some(shape) {
            self.bridge_netfilter_off = bridged
                .then(|| bridge_netfilter::off(Path::new("/proc/sys")))
                .flatten();
            if let Some(why) = &self.bridge_netfilter_off {
                tracing::warn!(%why, "bridged pod traffic is not seen by iptables");
                report.failures.push(ObjectError {
                    object: "bridged pod traffic".into(),
                    reason: why.clone(),
                });
            }
        }
        // A full write of an unchanged node and state: what it writes is drift.
        let repair = full && self.programmed.is_some() && self.shape == Some(shape);
        let full = full || self.shape != Some(shape);
        let old = if full {
            Desired::default()
        } else {
            self.programmed.take().unwrap_or_default()
        };
        self.programmed = None;
        let old_spoof = std::mem::take(&mut self.spoof);
        let mut desired = with_missing_sets(desired, report);
        // Sizes of the sets in the kernel: those an earlier release made are upgraded.
        let existing = if full {
            let listed = exec::run_ok("ipset", &["list", "-t"], None).map_err(other)?;
            sets::maxelems(&listed)
        } else {
            Default::default()
        };
        let routes = match spoof::host_routes() {
            Ok(r) => Some(r),
            Err(e) => {
                report.failures.push(ObjectError {
                    object: "anti-spoofing".into(),
                    reason: format!("pod interfaces not found (rules left as they were): {e}"),
                });
                None
            }
        };

        let mut unplaced = BTreeSet::new();
        if let Ok(links) = &links {
            let failures = self.find_bridge_ports(&desired, links, routes.as_ref());
            unplaced.extend(failures.iter().map(|f| f.object.clone()));
            report.failures.extend(failures);
        }
        // A bridged pod whose port was not found counts as not programmed: its port stays
        // under the new-pod catch-all (fail closed, as on eBPF) until it is found.
        let known = self
            .new_pods
            .enabled()
            .then(|| known_endpoints(&desired, &unplaced));
        let spoof_ports: BTreeMap<String, String> = self
            .bridge_ports
            .iter()
            .map(|(pod, p)| (pod.clone(), p.ifname.clone()))
            .collect();

        // Members are added before the rules and removed after them, so a new set is whole
        // before a rule names it: an address moving between sets is in both meanwhile,
        // judged by rules that all take it as old or new. Except where the rules naming a
        // set change: an address leaving it goes before (it must not meet the new rules),
        // one joining comes after (it must not meet the old ones).
        let rules_change = match full {
            true => BTreeSet::new(),
            false => sets_whose_rules_change(&old, &desired),
        };
        let (mut adds, mut dels, mut joins) = (String::new(), String::new(), String::new());
        for (id, set) in &desired.sets {
            match old.sets.get(id) {
                _ if full => sets::replace_script(set, &existing, &mut adds),
                None => sets::create_script(set, &mut adds),
                // Most sets are unchanged by a change: comparing is cheaper than their
                // kernel entries, which `member_delta` builds for both states.
                Some(before) if before.members == set.members => {}
                Some(before) if rules_change.contains(id) => {
                    sets::member_delta(*id, &before.members, &set.members, &mut joins, &mut adds)
                }
                Some(before) => {
                    sets::member_delta(*id, &before.members, &set.members, &mut adds, &mut dels)
                }
            }
        }
        let judged_to_node = desired.endpoints.values().any(|e| e.egress.is_tiered());
        if judged_to_node {
            // Read at every write: an interface that came up since (a bridge's gateway, an
            // uplink) is the node's at once, as the engine's `nodes` peers already say.
            let rewrite = full || !self.node_sets_written;
            self.node_addresses_script(&existing, rewrite, report, &mut adds)?;
        }
        if let Some(k) = &known {
            // Exists (empty when new) before a rule names it; members come after the rules,
            // so a pod counts as programmed only once its chains are in place. One an
            // earlier release made at another size is swapped for one of this size below.
            for family in Family::ALL {
                let name = names::set_name(k.id, family);
                if existing.get(&name).is_some_and(|m| *m != sets::MAXELEM) {
                    continue;
                }
                let _ = writeln!(
                    adds,
                    "create {} hash:net family {} maxelem {}",
                    name,
                    family.ipset_family(),
                    sets::MAXELEM
                );
            }
        }
        self.run_ipset(&adds)?;

        for family in Family::ALL {
            let saved = if full {
                Some(self.backend.save(family).map_err(other)?)
            } else {
                None
            };
            let spoof_rules = match &routes {
                Some(r) => spoof::rules(
                    &desired,
                    r,
                    &spoof_ports,
                    bridged,
                    family,
                    shape.verdict_log.then_some(&mut self.names),
                    Some(&self.new_pods),
                ),
                None => old_spoof.get(&family).cloned().unwrap_or_default(),
            };
            let changed = full || old_spoof.get(&family) != Some(&spoof_rules);
            let script = tables::script(
                &mut self.names,
                &old,
                &desired,
                family,
                saved.as_deref(),
                &self.new_pods,
                shape,
                changed.then_some(spoof_rules.as_slice()),
            )
            .map_err(|e| DataplaneError::SavedRules {
                family,
                source: Box::new(e),
            })?;
            if let Some(script) = script {
                self.carry_counts(family, &script);
                let declared: Vec<&str> = script
                    .lines()
                    .filter_map(|l| l.strip_prefix(':')?.split_whitespace().next())
                    .collect();
                if repair && !declared.is_empty() {
                    tracing::info!(%family, chains = declared.len(), first = ?&declared[..declared.len().min(5)],
                        "repair: rewrote chains whose rules in the kernel differed (drift, or a change not applied before)");
                }
                self.last_write_lines += script.lines().count();
                self.last_write_chains += declared.len();
                self.backend.restore(family, &script).map_err(|e| {
                    DataplaneError::tool(format!("{} {family} restore", self.backend), e)
                })?;
            }
            self.spoof.insert(family, spoof_rules);
        }

        self.run_ipset(&joins)?;
        if let Some(k) = known {
            let mut script = String::new();
            match old.sets.get(&k.id) {
                Some(before) if !full => {
                    let mut removed = String::new();
                    sets::member_delta(
                        k.id,
                        &before.members,
                        &k.members,
                        &mut script,
                        &mut removed,
                    );
                    script.push_str(&removed);
                }
                _ => sets::replace_script(&k, &existing, &mut script),
            }
            self.run_ipset(&script)?;
            desired.sets.insert(k.id, k);
        }
        self.run_ipset(&dels)?;
        let mut stale: BTreeSet<String> = if full {
            stale_kernel_sets(&desired, judged_to_node)?
        } else {
            old.sets
                .keys()
                .filter(|id| !desired.sets.contains_key(id))
                .flat_map(|id| Family::ALL.map(|f| names::set_name(*id, f)))
                .collect()
        };
        if self.node_sets_written && !judged_to_node {
            stale.extend(Family::ALL.map(names::node_set_name));
        }
        if !stale.is_empty() {
            // Tolerant: a set something else still references is flushed and reported.
            let outcome = ipsets::remove(&|n| stale.contains(n));
            report.held_sets.extend(outcome.undeletable);
            report
                .failures
                .extend(outcome.errors.into_iter().map(|e| ObjectError {
                    object: "ipsets".into(),
                    reason: e,
                }));
        }
        for pod in old.endpoints.keys() {
            if !desired.endpoints.contains_key(pod) {
                self.names.forget(pod);
            }
        }
        if let Some(routes) = &routes {
            let placements = placements(&desired, routes, &spoof_ports);
            for addr in departed::departed(&self.placements, &placements) {
                if let Err(reason) = departed::forget(addr) {
                    report.failures.push(ObjectError {
                        object: format!("connections of departed pod address {addr}"),
                        reason: format!(
                            "not forgotten ({reason}): a new pod at this address may pass \
                             as their packets until conntrack expires them"
                        ),
                    });
                }
            }
            self.placements = placements;
        }
        self.programmed = Some(desired);
        self.shape = Some(shape);
        self.node_sets_written = judged_to_node;
        Ok(())
    }

    /// Keeps [`Self::bridge_ports`] in step: forgets pods that went and ports that are
    /// gone, and looks up the bridge port of each pod without a host route (see
    /// [`pod_ports`]). A pod whose port is not found is a failure (retried at the next
    /// write); its port stays under the new-pod catch-all.
    fn find_bridge_ports(
        &mut self,
        desired: &Desired,
        links: &pod_ports::NodeLinks,
        routes: Option<&BTreeMap<std::net::IpAddr, String>>,
    ) -> Vec<ObjectError> {
        self.bridge_ports
            .retain(|pod, port| desired.endpoints.contains_key(pod) && links.has(port));
        let (Some(routes), true) = (routes, links.has_bridge()) else {
            return Vec::new();
        };
        let mut wanted = BTreeMap::new();
        for (pod, ep) in &desired.endpoints {
            let addrs: Vec<std::net::IpAddr> = [
                ep.ipv4.map(std::net::IpAddr::V4),
                ep.ipv6.map(std::net::IpAddr::V6),
            ]
            .into_iter()
            .flatten()
            .collect();
            let routed = addrs.iter().any(|a| routes.contains_key(a));
            if !routed && !self.bridge_ports.contains_key(pod) {
                wanted.insert(pod.clone(), addrs);
            }
        }
        let mut failures = Vec::new();
        for (pod, port) in pod_ports::locate(&self.pod_netns_dir, links, &wanted) {
            match port {
                Ok(port) => {
                    self.bridge_ports.insert(pod, port);
                }
                Err(reason) => {
                    let reason = format!("no anti-spoofing on a bridge port: {reason}");
                    tracing::warn!(pod, "{reason}");
                    failures.push(ObjectError {
                        object: pod,
                        reason,
                    });
                }
            }
        }
        failures
    }
}

impl Dataplane for IptablesDataplane {
    fn verdict_tap(
        &self,
        tx: std::sync::Arc<crate::verdicts::VerdictTx>,
    ) -> Result<crate::verdicts::VerdictTap, DataplaneError> {
        if let Err(why) = &self.verdict_log {
            return Err(DataplaneError::Unsupported(format!(
                "no verdict log on iptables: {why}"
            )));
        }
        nflog::tap(self.names.pods_by_hash(), tx)
    }

    fn kind(&self) -> DataplaneKind {
        DataplaneKind::Iptables
    }

    fn verdict_counts(&self) -> Result<VerdictCounts, DataplaneError> {
        read_counts(self.backend, self.carried.clone())
    }

    /// The saves of both families' tables (a quarter of a second and more on a node of
    /// thousands of rules) run in the read; what the writes carried is taken now. A read
    /// that a write overlapped (and so may have carried a chain's counts as well as read
    /// them, or neither) is the caller's to throw away.
    fn verdict_counts_read(&self) -> crate::dataplane::CountsRead {
        let (backend, carried) = (self.backend, self.carried.clone());
        Box::new(move || read_counts(backend, carried))
    }

    fn converge(&mut self, desired: &Desired, scope: Scope) -> Result<ApplyReport, DataplaneError> {
        let mut report = ApplyReport::default();
        // Against the mirror, only what differs from what was programmed is written.
        let full = scope == Scope::Kernel || self.programmed.is_none();
        self.write(desired, full, &mut report)?;
        Ok(report)
    }

    fn status(&self) -> DataplaneStatus {
        let programmed = self.programmed.as_ref();
        DataplaneStatus {
            kind: Some(DataplaneKind::Iptables),
            endpoints: programmed.map_or(0, |d| d.endpoints.len()),
            sets: programmed.map_or(0, |d| d.sets.len() * Family::ALL.len()),
            rules: programmed.map_or(0, |d| {
                d.endpoints
                    .values()
                    .map(|e| e.ingress.rules.len() + e.egress.rules.len())
                    .sum()
            }),
            details: vec![
                ("backend".into(), self.backend.to_string()),
                ("in_sync".into(), programmed.is_some().to_string()),
                ("last_write_lines".into(), self.last_write_lines.to_string()),
                (
                    "last_write_chains".into(),
                    self.last_write_chains.to_string(),
                ),
                (
                    // What a hostile pod on a bridge can still claim here (eBPF checks
                    // all of it): iptables sees neither ARP nor an advertisement's target.
                    "neighbour_claims".into(),
                    if self.shape.is_some_and(|s| s.bridged) {
                        "unchecked: ARP senders and IPv6 neighbour advertisement targets \
                         (iptables cannot read them); router advertisements and redirects \
                         from pod ports are dropped"
                    } else {
                        "not on a bridge"
                    }
                    .into(),
                ),
                (
                    "bridge_netfilter".into(),
                    match (&self.shape, &self.bridge_netfilter_off) {
                        (_, Some(why)) => format!("off: {why}"),
                        (Some(s), None) if s.bridged => "on".into(),
                        _ => "no bridge".into(),
                    },
                ),
            ],
        }
    }
}

/// Each endpoint's interface (its bridge port, else the device of its address's host
/// route; empty when none is found) and addresses.
fn placements(
    desired: &Desired,
    routes: &BTreeMap<std::net::IpAddr, String>,
    bridge_ports: &BTreeMap<String, String>,
) -> BTreeMap<String, departed::Placement> {
    desired
        .endpoints
        .values()
        .map(|ep| {
            let addrs: Vec<std::net::IpAddr> = [
                ep.ipv4.map(std::net::IpAddr::V4),
                ep.ipv6.map(std::net::IpAddr::V6),
            ]
            .into_iter()
            .flatten()
            .collect();
            let iface = bridge_ports
                .get(&ep.pod)
                .or_else(|| addrs.iter().find_map(|a| routes.get(a)))
                .cloned()
                .unwrap_or_default();
            (ep.pod.clone(), (iface, addrs))
        })
        .collect()
}

fn other(e: exec::ExecError) -> DataplaneError {
    DataplaneError::tool("iptables dataplane", e)
}

impl IptablesDataplane {
    /// Before `script` runs: what the rules of the chains it makes again, flushes or
    /// deletes have counted is carried. A counter that cannot be read is lost, not fatal.
    fn carry_counts(&mut self, family: Family, script: &str) {
        let rewritten = counters::rewritten_chains(script);
        if rewritten.is_empty() {
            return;
        }
        // A change rewrites a few chains: reading only those keeps the cost of a change
        // from growing with the table (the whole table's save was most of it).
        let saved = match rewritten.len() <= CHAINS_READ_ONE_BY_ONE {
            true => Ok(self.save_chains_counted(family, &rewritten)),
            false => self.backend.save_counted(family, names::TABLE),
        };
        match saved.map(|s| crate::reset::iptables_save::parse(&s).map_err(|e| e.to_string())) {
            Ok(Ok(tables)) => {
                counters::add_chains(&tables, |c| rewritten.contains(c), &mut self.carried)
            }
            Ok(Err(e)) => {
                tracing::warn!(%family, error = %e, "rule counters not carried over a rewrite")
            }
            Err(e) => {
                tracing::warn!(%family, error = %e, "rule counters not carried over a rewrite")
            }
        }
    }

    /// The rules of `chains` with their counters, as one saved table. A chain that cannot
    /// be read has nothing carried: most often one the script makes anew (nf_tables'
    /// `-S` says "incompatible" of a chain that does not exist, legacy "No chain").
    fn save_chains_counted(&self, family: Family, chains: &BTreeSet<&str>) -> String {
        let mut saved = String::new();
        for chain in chains {
            match self.backend.save_chain_counted(family, names::TABLE, chain) {
                Ok(text) => saved += &text,
                Err(exec::ExecError::Failed { stderr, .. }) => {
                    tracing::debug!(%family, chain, %stderr, "no counters to carry")
                }
                Err(e) => {
                    tracing::warn!(%family, chain, error = %e, "rule counters not carried over a rewrite")
                }
            }
        }
        saved
    }

    /// Reads the node's addresses again and writes their sets when they changed (or
    /// `rewrite`). Read as they were when that fails, after the first time (a rule names
    /// the sets, so they must exist).
    fn node_addresses_script(
        &mut self,
        existing: &BTreeMap<String, u32>,
        rewrite: bool,
        report: &mut ApplyReport,
        out: &mut String,
    ) -> Result<(), DataplaneError> {
        let mut changed = false;
        match crate::dataplane::node_addresses::read() {
            Ok(addrs) => {
                if self.node_addresses.as_ref().is_some_and(|a| *a != addrs) {
                    tracing::info!(addresses = ?addrs, "the node's addresses changed");
                    changed = true;
                }
                self.node_addresses = Some(addrs);
            }
            Err(e) if self.node_addresses.is_some() => report.failures.push(ObjectError {
                object: "node addresses".into(),
                reason: format!("not read again (the last ones kept): {e}"),
            }),
            Err(e) => return Err(e),
        }
        if !rewrite && !changed {
            return Ok(());
        }
        let addrs = self.node_addresses.as_deref().unwrap_or_default();
        sets::node_script(addrs, existing, out);
        Ok(())
    }

    fn run_ipset(&mut self, script: &str) -> Result<(), DataplaneError> {
        if script.is_empty() {
            return Ok(());
        }
        self.last_write_lines += script.lines().count();
        Ok(ipset_restore::run(script, true)?)
    }
}

/// The sets some rule of `old` or `new` names (a NetworkPolicy's or a tier's peer) whose
/// naming endpoints are not all the same in both: an endpoint started or stopped naming
/// it, or changed anything (rules, tiers, isolation, addresses). Coarse on purpose: a set
/// counted here only has its joiners wait for the rules.
fn sets_whose_rules_change(old: &Desired, new: &Desired) -> BTreeSet<SetId> {
    fn naming(d: &Desired) -> BTreeMap<SetId, BTreeMap<&str, &weir_policy::desired::Endpoint>> {
        let mut of: BTreeMap<SetId, BTreeMap<&str, _>> = BTreeMap::new();
        for (pod, ep) in &d.endpoints {
            for dir in [&ep.ingress, &ep.egress] {
                let peers = dir.rules.iter().map(|r| &r.peer);
                let tiers = dir.admin.iter().chain(&dir.baseline).map(|r| &r.peer);
                for peer in peers.chain(tiers) {
                    if let Peer::Set(id) = peer {
                        of.entry(*id).or_default().insert(pod.as_str(), ep);
                    }
                }
            }
        }
        of
    }
    let (before, after) = (naming(old), naming(new));
    before
        .keys()
        .chain(after.keys())
        .filter(|id| before.get(*id) != after.get(*id))
        .copied()
        .collect()
}

/// A rule that names a set the desired state lacks would make the whole table's restore
/// fail; such a set is created empty instead (the rule then matches nothing: fail
/// closed) and reported.
fn with_missing_sets(desired: &Desired, report: &mut ApplyReport) -> Desired {
    let mut fixed = desired.clone();
    for ep in desired.endpoints.values() {
        for d in [Direction::Ingress, Direction::Egress] {
            for rule in &ep.direction(d).rules {
                let Peer::Set(id) = rule.peer else { continue };
                if fixed.sets.contains_key(&id) {
                    continue;
                }
                report.failures.push(ObjectError {
                    object: ep.pod.clone(),
                    reason: format!(
                        "rule from {} names address set {id}, which the desired state \
                         lacks; it matches nothing",
                        rule.origin.policy
                    ),
                });
                fixed.sets.insert(id, empty_set(id));
            }
        }
    }
    fixed
}

/// The addresses of every endpoint the desired state programs.
fn known_endpoints(desired: &Desired, except: &BTreeSet<String>) -> AddressSet {
    let members = desired
        .endpoints
        .values()
        .filter(|ep| !except.contains(&ep.pod))
        .flat_map(|ep| {
            let v4 = ep.ipv4.map(|a| ipnet::IpNet::from(std::net::IpAddr::V4(a)));
            let v6 = ep.ipv6.map(|a| ipnet::IpNet::from(std::net::IpAddr::V6(a)));
            v4.into_iter().chain(v6)
        })
        .map(|net| weir_policy::desired::Member { net, except: false })
        .collect();
    AddressSet {
        id: names::KNOWN_ENDPOINTS_SET,
        definition: "programmed endpoints".into(),
        members,
    }
}

fn empty_set(id: SetId) -> AddressSet {
    AddressSet {
        id,
        definition: "missing".into(),
        members: BTreeSet::new(),
    }
}

/// weir's sets in the kernel that the desired state does not name (nor the node's
/// addresses', when `node_sets` are kept).
fn stale_kernel_sets(
    desired: &Desired,
    node_sets: bool,
) -> Result<BTreeSet<String>, DataplaneError> {
    let node = node_sets.then_some(Family::ALL.map(names::node_set_name));
    let wanted: BTreeSet<String> = desired
        .sets
        .keys()
        .flat_map(|id| Family::ALL.map(|f| names::set_name(*id, f)))
        .chain(node.into_iter().flatten())
        .collect();
    let listed = exec::run_ok("ipset", &["list", "-n"], None).map_err(other)?;
    Ok(listed
        .lines()
        .filter(|n| n.starts_with(crate::netfilter::WEIR_SET_PREFIX) && !wanted.contains(*n))
        .map(str::to_string)
        .collect())
}

/// The rules' counters of both families' tables, on top of what the writes `carried`.
fn read_counts(backend: Backend, carried: VerdictCounts) -> Result<VerdictCounts, DataplaneError> {
    let mut counts = carried;
    for family in Family::ALL {
        let saved = backend
            .save_counted(family, names::TABLE)
            .map_err(|e| DataplaneError::tool("read the rules' counters", e))?;
        let tables =
            crate::reset::iptables_save::parse(&saved).map_err(|e| DataplaneError::SavedRules {
                family,
                source: Box::new(e),
            })?;
        counters::add(&tables, &mut counts);
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_policy::desired::{
        DirectionPolicy, Endpoint, Ports, Protocol, Rule, RuleOrigin, TierOrigin, TierRule,
    };

    fn server(ingress: &[(u64, u16)], admin: &[u64]) -> Desired {
        let ports = |port: u16| Ports::Protocol {
            protocol: Protocol::Tcp,
            range: Some(weir_policy::desired::PortRange {
                first: port,
                last: port,
            }),
        };
        let ep = Endpoint {
            pod: "x/server".into(),
            ipv4: Some("10.0.0.1".parse().unwrap()),
            ipv6: None,
            ingress: DirectionPolicy {
                isolated: true,
                rules: ingress
                    .iter()
                    .map(|(set, port)| Rule {
                        peer: Peer::Set(SetId(*set)),
                        ports: ports(*port),
                        origin: RuleOrigin {
                            policy: "x/p".into(),
                            rule_index: 0,
                        },
                    })
                    .collect(),
                admin: admin
                    .iter()
                    .map(|set| TierRule {
                        peer: Peer::Set(SetId(*set)),
                        ports: Ports::All,
                        action: weir_policy::desired::Action::Deny,
                        origin: TierOrigin {
                            policy: "deny-set".into(),
                            priority: 1,
                            rule_index: 0,
                            rule_name: None,
                        },
                    })
                    .collect(),
                ..DirectionPolicy::default()
            },
            egress: DirectionPolicy::default(),
        };
        Desired {
            endpoints: [("x/server".to_string(), ep)].into_iter().collect(),
            ..Desired::default()
        }
    }

    #[test]
    fn the_sets_whose_rules_change_are_those_a_changed_endpoint_names() {
        let old = server(&[(1, 80), (2, 81)], &[]);
        assert!(sets_whose_rules_change(&old, &old).is_empty());
        // Set 2's port changes: the server names both sets, both count.
        let new = server(&[(1, 80), (2, 82)], &[]);
        assert_eq!(
            sets_whose_rules_change(&old, &new),
            [SetId(1), SetId(2)].into()
        );
        // A tier's peer counts, and a set no longer named.
        let new = server(&[(1, 80)], &[3]);
        assert_eq!(
            sets_whose_rules_change(&old, &new),
            [SetId(1), SetId(2), SetId(3)].into()
        );
        // No endpoint: nothing names anything.
        assert!(sets_whose_rules_change(&Desired::default(), &Desired::default()).is_empty());
    }
}
