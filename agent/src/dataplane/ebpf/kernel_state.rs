//! A mirror of what the IDENTITY, ENDPOINT and POLICY maps hold, and the ordered writes
//! that bring them to a target. Each write updates the mirror only when the kernel took
//! it, so a failed write (a full map) is retried by the next apply and named in the report.

use std::collections::{BTreeMap, BTreeSet};

use aya::maps::{lpm_trie::Key, HashMap, MapData, MapError};
use itertools::{EitherOrBoth, Itertools};
use weir_common::{map_names, EndpointInfo, IdentityKey, PolicyKey, ServiceKey};

use super::{identities::Prefix, loader::Maps, policy_map::PolicyEntry};
use weir_policy::model::ObjectError;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelState {
    pub identity: BTreeMap<Prefix, u32>,
    pub endpoint: BTreeMap<u32, EndpointInfo>,
    pub policy: BTreeMap<PolicyEntry, u32>,
    /// Local pods' addresses (IPv4-mapped) → endpoint id.
    pub local: BTreeMap<IdentityKey, u32>,
    /// Service frontends (value 1).
    pub service: BTreeMap<ServiceKey, u32>,
    /// ENDPOINT's records by endpoint id.
    pub endpoint_by_id: BTreeMap<u32, EndpointInfo>,
}

fn failure(object: String, e: MapError) -> ObjectError {
    let reason = match &e {
        // Hash maps report a full map as E2BIG, LPM tries as ENOSPC.
        MapError::SyscallError(s)
            if matches!(s.io_error.raw_os_error(), Some(libc::E2BIG | libc::ENOSPC)) =>
        {
            format!("map is full ({e}); raise its size in the eBPF configuration")
        }
        _ => e.to_string(),
    };
    ObjectError { object, reason }
}

/// What [`KernelState::upsert_policy`] writes: whole groups, in order, while their new
/// entries fit in the room left; the groups closed first to make that room (a
/// namespace's over its share, for one within it); the others, with their new entries
/// and the room there was.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PolicyPlan {
    pub writes: Vec<(PolicyGroup, Vec<(PolicyEntry, u32)>)>,
    pub evicted: Vec<(PolicyGroup, Share)>,
    /// Each with its new entries, the room there was, and its namespace's share when
    /// it is over it.
    pub no_room: Vec<(PolicyGroup, usize, usize, Option<Share>)>,
}

/// Each namespace's share of POLICY: the entries its pods may hold before another
/// namespace's pods, within theirs, may take that room back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Shares {
    /// The entries a namespace may hold and keep when the map is full.
    pub per_namespace: usize,
    /// Each endpoint id's namespace.
    pub namespace: BTreeMap<u32, String>,
}

/// How many entries a namespace's pods want, against its share (for the report).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Share {
    pub namespace: String,
    pub entries: usize,
    pub share: usize,
}

/// POLICY's room a namespace may count on: the map divided among the namespaces whose
/// pods hold entries. One namespace's pods may hold more while no other namespace needs
/// the room; a namespace within its share takes the room back (its own pods' new entries
/// first, then the over-share namespace's directions are closed, largest namespace
/// first). As the shares add up to the map, a namespace within its share always finds
/// room (but for entries that closing does not free: tier denies), so no tenant, filling
/// the map from any number of namespaces, can keep another's policy out.
pub fn policy_share(
    capacity: usize,
    namespaces: &BTreeMap<u32, String>,
    want: &KernelState,
) -> usize {
    let holding: BTreeSet<&str> = want
        .policy
        .keys()
        .filter_map(|(_, key)| namespaces.get(&key.endpoint_id).map(String::as_str))
        .collect();
    capacity / holding.len().max(1)
}

/// Plans the POLICY writes from `have` to `want` with `free` entries of room (`None`:
/// unknown, every group is written and the kernel's refusals decide). A group is
/// written whole or not at all; a changed entry takes no room, a new one takes one.
/// With `shares`, the groups of namespaces within their share go first, and one that
/// does not fit takes the room of groups of namespaces over theirs (they are evicted:
/// closed, their allowing entries removed, before anything is written).
pub fn plan_policy_writes(
    have: &BTreeMap<PolicyEntry, u32>,
    want: &BTreeMap<PolicyEntry, u32>,
    mut free: Option<usize>,
    shares: Option<&Shares>,
) -> PolicyPlan {
    let mut groups: BTreeMap<PolicyGroup, Vec<(PolicyEntry, u32)>> = BTreeMap::new();
    for (k, v) in changed(have, want) {
        groups.entry(group_of(k)).or_default().push((*k, *v));
    }
    // Everything fits (the common case): no share is counted.
    let new_total = groups
        .values()
        .flatten()
        .filter(|(k, _)| !have.contains_key(k))
        .count();
    if free.is_none_or(|free| new_total <= free) {
        return PolicyPlan {
            writes: groups.into_iter().collect(),
            ..Default::default()
        };
    }
    let namespace_of = |group: &PolicyGroup| -> Option<&str> {
        shares
            .and_then(|s| s.namespace.get(&group.0))
            .map(String::as_str)
    };
    // Entries each namespace's pods want, and whether that is within its share.
    let mut wanted: BTreeMap<&str, usize> = BTreeMap::new();
    for entry in want.keys() {
        if let Some(ns) = namespace_of(&group_of(entry)) {
            *wanted.entry(ns).or_default() += 1;
        }
    }
    let within = |group: &PolicyGroup| match (shares, namespace_of(group)) {
        (Some(s), Some(ns)) => wanted.get(ns).copied().unwrap_or(0) <= s.per_namespace,
        _ => true,
    };
    // Groups holding room that a namespace within its share may take back: an
    // over-share namespace's written groups, largest namespace first, then largest
    // group, each with the allowing entries closing it frees.
    let mut evictable: Vec<(PolicyGroup, usize)> = Vec::new();
    if shares.is_some() {
        let mut holding: BTreeMap<PolicyGroup, usize> = BTreeMap::new();
        for (entry, value) in have {
            let group = group_of(entry);
            if allows(*value) && !within(&group) {
                *holding.entry(group).or_default() += 1;
            }
        }
        evictable = holding.into_iter().collect();
        evictable.sort_by_key(|(group, n)| {
            let ns = namespace_of(group).unwrap_or_default();
            (
                std::cmp::Reverse(wanted.get(ns).copied().unwrap_or(0)),
                ns,
                std::cmp::Reverse(*n),
                *group,
            )
        });
        evictable.reverse(); // popped from the end
    }
    let share_of = |group: &PolicyGroup| {
        let ns = namespace_of(group).unwrap_or_default();
        Share {
            entries: wanted.get(ns).copied().unwrap_or(0),
            share: shares.map_or(0, |s| s.per_namespace),
            namespace: ns.to_string(),
        }
    };
    let mut evicted: BTreeSet<PolicyGroup> = BTreeSet::new();
    let mut plan = PolicyPlan::default();
    let mut ordered: Vec<_> = groups.into_iter().collect();
    ordered.sort_by_key(|(group, _)| !within(group)); // stable: key order within each
    for (group, entries) in ordered {
        if evicted.contains(&group) {
            continue;
        }
        let new = entries
            .iter()
            .filter(|(k, _)| !have.contains_key(k))
            .count();
        if let Some(free) = free.as_mut() {
            while new > *free && within(&group) {
                let Some((victim, frees)) = evictable.pop() else {
                    break;
                };
                if victim == group || evicted.contains(&victim) {
                    continue;
                }
                evicted.insert(victim);
                plan.evicted.push((victim, share_of(&victim)));
                *free += frees;
            }
            if new > *free {
                let over = (!within(&group)).then(|| share_of(&group));
                plan.no_room.push((group, new, *free, over));
                continue;
            }
            *free -= new;
        }
        plan.writes.push((group, entries));
    }
    // An evicted group planned for writes before its eviction cannot be: groups within
    // their share are planned first, and only over-share groups are evicted.
    debug_assert!(plan.writes.iter().all(|(g, _)| !evicted.contains(g)));
    plan
}

/// Orders one group's writes: the peers' own identities before the any-peer identity
/// (whose entries a peer without its own falls back to), longer prefixes before
/// shorter ones (a packet's longest match is then its new one, or its old).
pub fn in_write_order(entries: &mut [(PolicyEntry, u32)]) {
    entries.sort_by_key(|((len, key), _)| {
        (
            key.identity == weir_common::IDENTITY_ANY,
            std::cmp::Reverse(*len),
            *key,
        )
    });
}

/// A pod's direction in POLICY: (endpoint id, direction code), the unit entries are
/// written in.
pub type PolicyGroup = (u32, u8);

fn group_of(entry: &PolicyEntry) -> PolicyGroup {
    (entry.1.endpoint_id, entry.1.direction)
}

/// Whether a POLICY value admits a packet, as the programs decide (`allows` in
/// weir-ebpf): a rule matched, and it is no tier's drop.
pub fn allows(value: u32) -> bool {
    value != 0 && value & weir_common::TIER_DENY_BIT == 0
}

/// A closed pod direction's failure, named by its pod.
fn group_failure(
    name: &impl Fn(&PolicyEntry) -> String,
    group: PolicyGroup,
    reason: String,
) -> ObjectError {
    let object = name(&(
        0,
        PolicyKey {
            endpoint_id: group.0,
            ..Default::default()
        },
    ));
    ObjectError { object, reason }
}

fn over_share(share: &Share) -> String {
    format!(
        "namespace {} wants {} entries, more than its share of {}",
        share.namespace, share.entries, share.share
    )
}

pub fn direction_name(code: u8) -> &'static str {
    match code {
        c if c == weir_common::Direction::Egress as u8 => "egress",
        _ => "ingress",
    }
}

/// `have` and `want` side by side, in key order. One walk of both sorted maps, not a
/// lookup per key: every change diffs the whole IDENTITY (a prefix per pod of the
/// cluster), and these walks were most of a change's cost.
fn side_by_side<'a, K: Ord, V>(
    have: &'a BTreeMap<K, V>,
    want: &'a BTreeMap<K, V>,
) -> impl Iterator<Item = EitherOrBoth<(&'a K, &'a V), (&'a K, &'a V)>> {
    have.iter()
        .merge_join_by(want.iter(), |(a, _), (b, _)| a.cmp(b))
}

/// The entries of `want` that `have` lacks or holds with another value.
fn changed<'a, K: Ord, V: PartialEq>(
    have: &'a BTreeMap<K, V>,
    want: &'a BTreeMap<K, V>,
) -> impl Iterator<Item = (&'a K, &'a V)> {
    side_by_side(have, want).filter_map(|e| match e {
        EitherOrBoth::Right(w) => Some(w),
        EitherOrBoth::Both((_, h), w) if h != w.1 => Some(w),
        _ => None,
    })
}

/// The keys of `want` that `have` lacks.
pub(crate) fn added<'a, K: Ord, V>(
    have: &'a BTreeMap<K, V>,
    want: &'a BTreeMap<K, V>,
) -> impl Iterator<Item = (&'a K, &'a V)> {
    side_by_side(have, want).filter_map(|e| match e {
        EitherOrBoth::Right(w) => Some(w),
        _ => None,
    })
}

/// The keys of `have` that `want` lacks.
fn gone<K: Ord + Clone, V>(have: &BTreeMap<K, V>, want: &BTreeMap<K, V>) -> Vec<K> {
    side_by_side(have, want)
        .filter_map(|e| match e {
            EitherOrBoth::Left((k, _)) => Some(k.clone()),
            _ => None,
        })
        .collect()
}

impl KernelState {
    /// The identity ids these maps hold: an address or prefix maps to it, or a POLICY
    /// entry names it (a node address's [`weir_common::IDENTITY_HOST_BIT`] taken off).
    /// None of them may be given to a new signature (see
    /// [`super::identities::IdentityTable::plan_reserving`]).
    pub fn held_identities(&self) -> BTreeSet<u32> {
        self.identity
            .values()
            .copied()
            .chain(self.policy.keys().map(|(_, key)| key.identity))
            .map(|id| id & !weir_common::IDENTITY_HOST_BIT)
            .collect()
    }

    /// The dynamic identities that keep their id from `self` to `want` while both their
    /// addresses and their POLICY entries change. Between the POLICY writes and the
    /// removals such an identity holds some old entries and some new: an address that
    /// joins it then is judged by entries of neither its old signature nor its new
    /// policy, and one that leaves it by its new ones. Given a fresh id instead, its
    /// signature's new entries are whole before any address moves, and its old id keeps
    /// the old entries until every address has left.
    pub fn moved_and_changed(&self, want: &KernelState) -> BTreeSet<u32> {
        let dynamic = |id: &u32| {
            *id >= weir_common::IDENTITY_FIRST_DYNAMIC && id & weir_common::IDENTITY_HOST_BIT == 0
        };
        // Ids some address joins or leaves.
        let mut moved: BTreeSet<u32> = BTreeSet::new();
        for (prefix, id) in changed(&self.identity, &want.identity) {
            moved.insert(*id);
            moved.extend(self.identity.get(prefix));
        }
        for prefix in gone(&self.identity, &want.identity) {
            moved.extend(self.identity.get(&prefix));
        }
        moved.retain(dynamic);
        if moved.is_empty() {
            return moved;
        }
        // Of those, the ones some address holds in both states, whose entries change.
        let held = |state: &KernelState| -> BTreeSet<u32> {
            state
                .identity
                .values()
                .filter(|id| moved.contains(id))
                .copied()
                .collect()
        };
        let (held_before, held_after) = (held(self), held(want));
        moved.retain(|id| held_before.contains(id) && held_after.contains(id));
        let written: BTreeSet<PolicyGroup> = self.policy.keys().map(group_of).collect();
        let rewritten: BTreeSet<u32> = changed(&self.policy, &want.policy)
            .map(|(entry, _)| *entry)
            .chain(gone(&self.policy, &want.policy))
            .filter(|entry| written.contains(&group_of(entry)))
            .map(|(_, key)| key.identity)
            .collect();
        moved.retain(|id| rewritten.contains(id));
        moved
    }

    pub fn read(maps: &Maps) -> KernelState {
        let identity = maps
            .identity
            .iter()
            .filter_map(Result::ok)
            .map(|(k, v)| (Prefix::from_trie_key(&k.data(), k.prefix_len()), v))
            .collect();
        let endpoint = maps.endpoint.iter().filter_map(Result::ok).collect();
        let local = maps.local.iter().filter_map(Result::ok).collect();
        let policy = maps
            .policy
            .iter()
            .filter_map(Result::ok)
            .map(|(k, v)| ((k.prefix_len(), k.data()), v))
            .collect();
        let service = maps.service.iter().filter_map(Result::ok).collect();
        let endpoint_by_id = maps.endpoint_by_id.iter().filter_map(Result::ok).collect();
        KernelState {
            identity,
            endpoint,
            policy,
            local,
            service,
            endpoint_by_id,
        }
    }

    /// Writes the POLICY entries `want` adds or changes, one pod's direction (a
    /// [`PolicyGroup`]) at a time, planned against the map's capacity: a group whose new
    /// entries do not fit is not written at all. A group that is not written whole (no
    /// room, or the kernel refused an entry) is closed: its allowing entries are removed,
    /// so the direction (isolated by its ENDPOINT flags) denies every peer until the
    /// group fits. Never is a group left half-written, where a missing identity entry
    /// would fall back to the any-peer entries and allow what the policy denies. Within
    /// a group, the peers' own identities go before the any-peer identity and longer
    /// prefixes before shorter, so that a closed group being opened again (its
    /// identities published already) never has its any-peer allows before a peer's own
    /// entries. The map's room is shared by namespace (`namespaces`: each endpoint's;
    /// see [`policy_share`]): a namespace within its share takes room back from
    /// one over it, whose directions are closed first. Returns the groups closed, each
    /// with its failure; removals that fail are in `errors`.
    pub fn upsert_policy(
        &mut self,
        maps: &mut Maps,
        want: &KernelState,
        namespaces: &BTreeMap<u32, String>,
        name: impl Fn(&PolicyEntry) -> String,
        errors: &mut Vec<ObjectError>,
    ) -> BTreeMap<PolicyGroup, ObjectError> {
        let free = maps
            .policy_capacity
            .map(|c| (c as usize).saturating_sub(self.policy.len()));
        let shares = |c: u32| Shares {
            per_namespace: policy_share(c as usize, namespaces, want),
            namespace: namespaces.clone(),
        };
        // The shares are counted only when the map is short of room.
        let plan = match plan_policy_writes(&self.policy, &want.policy, free, None) {
            plan if plan.no_room.is_empty() => plan,
            _ => {
                let shares = maps.policy_capacity.map(shares);
                plan_policy_writes(&self.policy, &want.policy, free, shares.as_ref())
            }
        };
        let mut closed = BTreeMap::new();
        // Room taken back from namespaces over their share, before anything is written.
        for (group, share) in plan.evicted {
            self.close_group(maps, group, &name, errors);
            let reason = format!(
                "map is full, and {}; another namespace's pods took the room back: its {} \
                 denies every peer until there is room",
                over_share(&share),
                direction_name(group.1)
            );
            closed.insert(group, group_failure(&name, group, reason));
        }
        for (group, new, free, over) in plan.no_room {
            let reason = format!(
                "map is full: {new} new entries for its {}, {free} free{}; that direction \
                 denies every peer until they fit (raise the map's size, or remove what \
                 fills it)",
                direction_name(group.1),
                over.map_or(String::new(), |s| format!(", and {}", over_share(&s))),
            );
            closed.insert(group, group_failure(&name, group, reason));
        }
        for (group, mut entries) in plan.writes {
            in_write_order(&mut entries);
            for (entry, rule) in entries {
                match maps.policy.insert(&Key::new(entry.0, entry.1), rule, 0) {
                    Ok(()) => {
                        self.policy.insert(entry, rule);
                    }
                    Err(e) => {
                        let mut f = failure(name(&entry), e);
                        f.reason = format!(
                            "{}; its {} denies every peer until its entries are written",
                            f.reason,
                            direction_name(group.1)
                        );
                        closed.insert(group, f);
                        break;
                    }
                }
            }
        }
        for group in closed.keys() {
            self.close_group(maps, *group, &name, errors);
        }
        closed
    }

    /// Removes the allowing POLICY entries of `group`: with none left, the isolated
    /// direction's lookups end in a miss or a deny, whatever identity the peer has.
    pub fn close_group(
        &mut self,
        maps: &mut Maps,
        group: PolicyGroup,
        name: &impl Fn(&PolicyEntry) -> String,
        errors: &mut Vec<ObjectError>,
    ) {
        let allowing: Vec<PolicyEntry> = self
            .policy
            .iter()
            .filter(|(k, v)| group_of(k) == group && allows(**v))
            .map(|(k, _)| *k)
            .collect();
        for entry in allowing {
            match maps.policy.remove(&Key::new(entry.0, entry.1)) {
                Ok(()) => {
                    self.policy.remove(&entry);
                }
                Err(MapError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
                {
                    self.policy.remove(&entry);
                }
                Err(e) => errors.push(failure(name(&entry), e)),
            }
        }
    }

    pub fn delete_policy(
        &mut self,
        maps: &mut Maps,
        want: &KernelState,
        name: impl Fn(&PolicyEntry) -> String,
        errors: &mut Vec<ObjectError>,
    ) {
        for entry in gone(&self.policy, &want.policy) {
            match maps.policy.remove(&Key::new(entry.0, entry.1)) {
                Ok(()) => {
                    self.policy.remove(&entry);
                }
                Err(e) => errors.push(failure(name(&entry), e)),
            }
        }
    }

    /// Writes the IDENTITY prefixes `want` adds or changes; returns those the kernel
    /// refused, with the id each should have (their failures are in `errors`).
    pub fn upsert_identity(
        &mut self,
        maps: &mut Maps,
        want: &KernelState,
        errors: &mut Vec<ObjectError>,
    ) -> BTreeMap<Prefix, u32> {
        let todo: Vec<_> = changed(&self.identity, &want.identity)
            .map(|(k, v)| (*k, *v))
            .collect();
        let mut refused = BTreeMap::new();
        for (prefix, id) in todo {
            let (key, len) = prefix.trie_key();
            match maps.identity.insert(&Key::new(len, key), id, 0) {
                Ok(()) => {
                    self.identity.insert(prefix, id);
                }
                Err(e) => {
                    errors.push(failure(identity_object(&prefix), e));
                    refused.insert(prefix, id);
                }
            }
        }
        refused
    }

    pub fn delete_identity(
        &mut self,
        maps: &mut Maps,
        want: &KernelState,
        errors: &mut Vec<ObjectError>,
    ) {
        let gone = gone(&self.identity, &want.identity);
        self.remove_identity(maps, &gone, errors);
    }

    /// Removes `prefixes` from IDENTITY now.
    pub fn remove_identity<'a>(
        &mut self,
        maps: &mut Maps,
        prefixes: impl IntoIterator<Item = &'a Prefix>,
        errors: &mut Vec<ObjectError>,
    ) {
        for &prefix in prefixes {
            let (key, len) = prefix.trie_key();
            match maps.identity.remove(&Key::new(len, key)) {
                Ok(()) => {
                    self.identity.remove(&prefix);
                }
                Err(e) => errors.push(failure(identity_object(&prefix), e)),
            }
        }
    }

    pub fn upsert_endpoint(
        &mut self,
        maps: &mut Maps,
        want: &KernelState,
        errors: &mut Vec<ObjectError>,
    ) {
        let todo: Vec<_> = changed(&self.endpoint, &want.endpoint)
            .map(|(k, v)| (*k, *v))
            .collect();
        for (ifindex, info) in todo {
            match maps.endpoint.insert(ifindex, info, 0) {
                Ok(()) => {
                    self.endpoint.insert(ifindex, info);
                }
                Err(e) => errors.push(failure(endpoint_object(ifindex), e)),
            }
        }
    }

    pub fn delete_endpoint(
        &mut self,
        maps: &mut Maps,
        want: &KernelState,
        errors: &mut Vec<ObjectError>,
    ) {
        for ifindex in gone(&self.endpoint, &want.endpoint) {
            match maps.endpoint.remove(&ifindex) {
                Ok(()) => {
                    self.endpoint.remove(&ifindex);
                }
                // Gone already: the new-pod watch releases the pending entry of an
                // interface that was deleted (a pod's, after its endpoint went).
                Err(aya::maps::MapError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
                {
                    self.endpoint.remove(&ifindex);
                }
                Err(e) => errors.push(failure(endpoint_object(ifindex), e)),
            }
        }
    }
}

/// Writes the entries of `want` that `have` lacks or holds otherwise, mirroring each write
/// the kernel took.
fn upsert_hash<K: Ord + Copy + aya::Pod, V: PartialEq + Copy + aya::Pod>(
    have: &mut BTreeMap<K, V>,
    want: &BTreeMap<K, V>,
    map: &mut HashMap<MapData, K, V>,
    name: impl Fn(&K) -> String,
    errors: &mut Vec<ObjectError>,
) {
    let todo: Vec<_> = changed(have, want).map(|(k, v)| (*k, *v)).collect();
    for (k, v) in todo {
        match map.insert(k, v, 0) {
            Ok(()) => {
                have.insert(k, v);
            }
            Err(e) => errors.push(failure(name(&k), e)),
        }
    }
}

/// Deletes the entries `want` does not hold.
fn delete_hash<K: Ord + Copy + aya::Pod, V: aya::Pod>(
    have: &mut BTreeMap<K, V>,
    want: &BTreeMap<K, V>,
    map: &mut HashMap<MapData, K, V>,
    name: impl Fn(&K) -> String,
    errors: &mut Vec<ObjectError>,
) {
    for k in gone(have, want) {
        match map.remove(&k) {
            Ok(()) => {
                have.remove(&k);
            }
            Err(e) => errors.push(failure(name(&k), e)),
        }
    }
}

impl KernelState {
    pub fn upsert_local(&mut self, maps: &mut Maps, want: &Self, errors: &mut Vec<ObjectError>) {
        upsert_hash(
            &mut self.local,
            &want.local,
            &mut maps.local,
            local_object,
            errors,
        );
    }

    pub fn delete_local(&mut self, maps: &mut Maps, want: &Self, errors: &mut Vec<ObjectError>) {
        delete_hash(
            &mut self.local,
            &want.local,
            &mut maps.local,
            local_object,
            errors,
        );
    }

    pub fn upsert_service(&mut self, maps: &mut Maps, want: &Self, errors: &mut Vec<ObjectError>) {
        let before = errors.len();
        upsert_hash(
            &mut self.service,
            &want.service,
            &mut maps.service,
            service_object,
            errors,
        );
        // A refusal despite `service_room`'s planning (SERVICE's size unreadable, or
        // another kernel error): the frontend is neither deferred nor marked.
        for e in &mut errors[before..] {
            e.reason.push_str(
                "; pods' traffic to it is judged before kube-proxy picks a backend, on the \
                 frontend's address: egress rules naming the backends (an Admin Deny by their \
                 labels too) do not hold through it",
            );
        }
    }

    /// Removes `keys` from SERVICE now (frontends left out for room).
    pub fn evict_service(
        &mut self,
        maps: &mut Maps,
        keys: &BTreeSet<ServiceKey>,
        errors: &mut Vec<ObjectError>,
    ) {
        for key in keys {
            if !self.service.contains_key(key) {
                continue;
            }
            match maps.service.remove(key) {
                Ok(()) => {
                    self.service.remove(key);
                }
                Err(e) => errors.push(failure(service_object(key), e)),
            }
        }
    }

    pub fn delete_service(&mut self, maps: &mut Maps, want: &Self, errors: &mut Vec<ObjectError>) {
        delete_hash(
            &mut self.service,
            &want.service,
            &mut maps.service,
            service_object,
            errors,
        );
    }

    pub fn upsert_endpoint_by_id(
        &mut self,
        maps: &mut Maps,
        want: &Self,
        errors: &mut Vec<ObjectError>,
    ) {
        upsert_hash(
            &mut self.endpoint_by_id,
            &want.endpoint_by_id,
            &mut maps.endpoint_by_id,
            endpoint_by_id_object,
            errors,
        );
    }

    pub fn delete_endpoint_by_id(
        &mut self,
        maps: &mut Maps,
        want: &Self,
        errors: &mut Vec<ObjectError>,
    ) {
        delete_hash(
            &mut self.endpoint_by_id,
            &want.endpoint_by_id,
            &mut maps.endpoint_by_id,
            endpoint_by_id_object,
            errors,
        );
    }
}

/// One map write of a convergence, for [`write_sequence`]: an entry set to a value, or
/// removed (`None`).
#[cfg(test)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write {
    Policy(PolicyEntry, Option<u32>),
    Identity(Prefix, Option<u32>),
    EndpointById(u32, Option<EndpointInfo>),
}

/// The writes `EbpfDataplane::write` makes from `have` to `want`, entry by entry in its
/// order, on the maps the programs' decision reads (POLICY, IDENTITY, ENDPOINT by id),
/// every POLICY group having room: new and changed POLICY entries (group by group, each
/// in [`in_write_order`]), IDENTITY changes then removals, ENDPOINT records; after the
/// attaches and detaches, ENDPOINT removals, then POLICY removals. A unit test replays
/// them through the programs' decision (`decode`).
#[cfg(test)]
pub fn write_sequence(have: &KernelState, want: &KernelState) -> Vec<Write> {
    let mut out = Vec::new();
    for (_, mut entries) in plan_policy_writes(&have.policy, &want.policy, None, None).writes {
        in_write_order(&mut entries);
        out.extend(entries.into_iter().map(|(e, v)| Write::Policy(e, Some(v))));
    }
    out.extend(changed(&have.identity, &want.identity).map(|(p, v)| Write::Identity(*p, Some(*v))));
    out.extend(
        gone(&have.identity, &want.identity)
            .into_iter()
            .map(|p| Write::Identity(p, None)),
    );
    out.extend(
        changed(&have.endpoint_by_id, &want.endpoint_by_id)
            .map(|(id, info)| Write::EndpointById(*id, Some(*info))),
    );
    out.extend(
        gone(&have.endpoint_by_id, &want.endpoint_by_id)
            .into_iter()
            .map(|id| Write::EndpointById(id, None)),
    );
    out.extend(
        gone(&have.policy, &want.policy)
            .into_iter()
            .map(|e| Write::Policy(e, None)),
    );
    out
}

#[cfg(test)]
impl KernelState {
    /// The maps after `write`, as the kernel would hold them.
    pub fn apply(&mut self, write: &Write) {
        fn set<K: Ord + Copy, V: Copy>(map: &mut BTreeMap<K, V>, k: &K, v: &Option<V>) {
            match v {
                Some(v) => map.insert(*k, *v),
                None => map.remove(k),
            };
        }
        match write {
            Write::Policy(e, v) => set(&mut self.policy, e, v),
            Write::Identity(p, v) => set(&mut self.identity, p, v),
            Write::EndpointById(id, v) => set(&mut self.endpoint_by_id, id, v),
        }
    }
}

fn endpoint_by_id_object(id: &u32) -> String {
    format!("map {} (endpoint id {id})", map_names::ENDPOINT_BY_ID)
}

fn service_object(key: &ServiceKey) -> String {
    let protocol = match key.protocol {
        6 => "TCP",
        17 => "UDP",
        132 => "SCTP",
        _ => "?",
    };
    if key.addr == [0; 16] {
        return format!(
            "map {} (nodePort {}/{protocol})",
            map_names::SERVICE,
            key.port
        );
    }
    format!(
        "map {} (frontend {}:{}/{protocol})",
        map_names::SERVICE,
        shown_addr(&key.addr),
        key.port
    )
}

fn shown_addr(addr: &[u8; 16]) -> String {
    let a = std::net::Ipv6Addr::from(*addr);
    a.to_ipv4_mapped()
        .map_or(a.to_string(), |v4| v4.to_string())
}

fn local_object(key: &IdentityKey) -> String {
    format!(
        "map {} (address {})",
        map_names::LOCAL,
        shown_addr(&key.addr)
    )
}

pub fn identity_object(p: &Prefix) -> String {
    let addr = std::net::Ipv6Addr::from(p.addr);
    let shown = match addr.to_ipv4_mapped() {
        Some(v4) if p.len >= 96 => format!("{v4}/{}", p.len - 96),
        _ => format!("{addr}/{}", p.len),
    };
    format!("map {} (prefix {shown})", map_names::IDENTITY)
}

fn endpoint_object(ifindex: u32) -> String {
    format!("map {} (ifindex {ifindex})", map_names::ENDPOINT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_common::{COUNTER_NOT_ISOLATED, IDENTITY_ANY, TIER_DENY_BIT};

    fn entry(endpoint_id: u32, identity: u32, direction: u8, port: u16) -> PolicyEntry {
        let key = PolicyKey {
            endpoint_id,
            identity,
            direction,
            protocol: 6,
            port: port.to_be_bytes(),
        };
        (weir_common::POLICY_PREFIX_ANY_PORT + 16, key)
    }

    #[test]
    fn a_group_is_written_whole_or_not_at_all() {
        let mut have = BTreeMap::new();
        have.insert(entry(1, IDENTITY_ANY, 0, 80), 20);
        let mut want = have.clone();
        // Endpoint 1's ingress: one changed value (no room needed), one new entry.
        want.insert(entry(1, IDENTITY_ANY, 0, 80), 21);
        want.insert(entry(1, 7, 0, 80), 22);
        // Endpoint 2's ingress: three new entries, endpoint 3's egress one.
        for port in [1, 2, 3] {
            want.insert(entry(2, 7, 0, port), 23);
        }
        want.insert(entry(3, 7, 1, 53), 24);
        let plan = plan_policy_writes(&have, &want, Some(2), None);
        let written: Vec<PolicyGroup> = plan.writes.iter().map(|(g, _)| *g).collect();
        assert_eq!(written, vec![(1, 0), (3, 1)], "{plan:?}");
        assert_eq!(
            plan.writes[0].1.len(),
            2,
            "the changed entry is written too"
        );
        assert_eq!(plan.no_room, vec![((2, 0), 3, 1, None)]);
        // Unknown room: everything is tried.
        let plan = plan_policy_writes(&have, &want, None, None);
        assert_eq!(plan.writes.len(), 3);
        assert!(plan.no_room.is_empty());
        // Nothing changed: nothing to write, whatever the room.
        let plan = plan_policy_writes(&want, &want, Some(0), None);
        assert_eq!(plan, PolicyPlan::default());
    }

    #[test]
    fn a_namespace_within_its_share_takes_room_back_from_one_over_it() {
        // Blue's pods 1 and 2 hold 6 entries (4 allowing on pod 1's ingress, 2 on pod
        // 2's) in a map of 8 with a share of 4, a departing pod 1; green's pod 3 wants 3
        // new ones.
        let mut have = BTreeMap::new();
        for port in 1..=4 {
            have.insert(entry(1, 7, 0, port), 20);
        }
        have.insert(entry(2, 7, 0, 1), 21);
        have.insert(entry(2, 8, 0, 1), TIER_DENY_BIT | 22);
        let mut want = have.clone();
        for port in 1..=3 {
            want.insert(entry(3, 9, 0, port), 23);
        }
        // A departing pod's entries, in no namespace's wants.
        have.insert(entry(4, 7, 0, 1), 24);
        let shares = Shares {
            per_namespace: 4,
            namespace: [(1, "blue"), (2, "blue"), (3, "green"), (4, "gone")]
                .map(|(id, ns)| (id, ns.to_string()))
                .into(),
        };
        let plan = plan_policy_writes(&have, &want, Some(1), Some(&shares));
        // Blue's largest direction is closed (its 4 allowing entries), and green's fits.
        let blue = Share {
            namespace: "blue".into(),
            entries: 6,
            share: 4,
        };
        assert_eq!(plan.evicted, vec![((1, 0), blue)]);
        assert_eq!(plan.writes.len(), 1);
        assert_eq!(plan.writes[0].0, (3, 0));
        assert!(plan.no_room.is_empty());
        // Without shares, first come: green's direction does not fit.
        let plan = plan_policy_writes(&have, &want, Some(1), None);
        assert_eq!(plan.no_room, vec![((3, 0), 3, 1, None)]);
        // A namespace over its share takes nothing back.
        let mut greedy = shares.clone();
        greedy.per_namespace = 2;
        let plan = plan_policy_writes(&have, &want, Some(1), Some(&greedy));
        assert!(plan.evicted.is_empty());
        let green = Share {
            namespace: "green".into(),
            entries: 3,
            share: 2,
        };
        assert_eq!(plan.no_room, vec![((3, 0), 3, 1, Some(green))]);
    }

    #[test]
    fn the_map_is_shared_among_the_namespaces_holding_entries() {
        let namespaces: BTreeMap<u32, String> =
            [(1, "blue"), (2, "blue"), (3, "green"), (4, "idle")]
                .map(|(id, ns)| (id, ns.to_string()))
                .into();
        let mut want = KernelState::default();
        assert_eq!(policy_share(100, &namespaces, &want), 100);
        want.policy.insert(entry(1, 7, 0, 80), 20);
        want.policy.insert(entry(2, 7, 0, 80), 20);
        assert_eq!(policy_share(100, &namespaces, &want), 100, "blue alone");
        want.policy.insert(entry(3, 7, 0, 80), 20);
        assert_eq!(
            policy_share(100, &namespaces, &want),
            50,
            "blue and green; idle holds none"
        );
    }

    #[test]
    fn a_peers_own_entries_and_longer_prefixes_are_written_first() {
        let any_all = (
            (
                weir_common::POLICY_PREFIX_ANY_PROTOCOL,
                entry(1, IDENTITY_ANY, 0, 0).1,
            ),
            COUNTER_NOT_ISOLATED,
        );
        let any_80 = (entry(1, IDENTITY_ANY, 0, 80), 20);
        let own_all = (
            (weir_common::POLICY_PREFIX_ANY_PROTOCOL, entry(1, 7, 0, 0).1),
            TIER_DENY_BIT | 21,
        );
        let own_80 = (entry(1, 7, 0, 80), 22);
        let mut entries = vec![any_all, any_80, own_all, own_80];
        in_write_order(&mut entries);
        assert_eq!(entries, vec![own_80, own_all, any_80, any_all]);
    }

    #[test]
    fn an_identity_is_renumbered_only_where_addresses_and_entries_both_change() {
        let host = |last: u8| Prefix {
            addr: (0xffffu128 << 32) | u128::from(u32::from_be_bytes([10, 0, 0, last])),
            len: 128,
        };
        let mut have = KernelState::default();
        have.identity.insert(host(2), 16);
        have.identity.insert(host(3), 17);
        have.policy.insert(entry(1, 17, 0, 81), 5);
        // p (.2) joins q's identity 17 while endpoint 1's entry for it moves to port 82.
        let mut want = have.clone();
        want.identity.insert(host(2), 17);
        want.policy.remove(&entry(1, 17, 0, 81));
        want.policy.insert(entry(1, 17, 0, 82), 5);
        assert_eq!(have.moved_and_changed(&want), [17].into());
        // The same move with the entries unchanged: nothing.
        let mut moved_only = have.clone();
        moved_only.identity.insert(host(2), 17);
        assert!(have.moved_and_changed(&moved_only).is_empty());
        // Entries of a direction new to POLICY (endpoint 2's) do not count.
        let mut new_direction = moved_only.clone();
        new_direction.policy.insert(entry(2, 17, 0, 80), 6);
        assert!(have.moved_and_changed(&new_direction).is_empty());
        // Entries changed without a move: nothing; a released identity: nothing.
        let mut changed_only = want.clone();
        changed_only.identity = have.identity.clone();
        assert!(have.moved_and_changed(&changed_only).is_empty());
        let mut released = want.clone();
        released.identity.remove(&host(3));
        released.identity.insert(host(2), 18);
        assert!(have.moved_and_changed(&released).is_empty());
    }

    #[test]
    fn allows_is_the_programs_reading_of_a_value() {
        assert!(!allows(0), "a miss denies");
        assert!(allows(COUNTER_NOT_ISOLATED));
        assert!(allows(20));
        assert!(!allows(20 | TIER_DENY_BIT));
        assert!(
            !allows(TIER_DENY_BIT),
            "the NetworkPolicies' default deny in a tier"
        );
    }
}
