//! A mirror of what the IDENTITY, ENDPOINT and POLICY maps hold, and the ordered writes
//! that bring them to a target. Each write updates the mirror only when the kernel took
//! it, so a failed write (a full map) is retried by the next apply and named in the report.

use std::collections::BTreeMap;

use aya::maps::{lpm_trie::Key, HashMap, MapData, MapError};
use weir_common::{map_names, EndpointInfo, IdentityKey, ServiceKey};

use super::{identities::Prefix, loader::Maps, policy_map::PolicyEntry};
use weir_policy::model::ObjectError;

#[derive(Debug, Default, PartialEq, Eq)]
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

fn changed<'a, K: Ord, V: PartialEq>(
    have: &'a BTreeMap<K, V>,
    want: &'a BTreeMap<K, V>,
) -> impl Iterator<Item = (&'a K, &'a V)> {
    want.iter().filter(move |(k, v)| have.get(*k) != Some(*v))
}

fn gone<K: Ord + Clone, V>(have: &BTreeMap<K, V>, want: &BTreeMap<K, V>) -> Vec<K> {
    have.keys()
        .filter(|k| !want.contains_key(*k))
        .cloned()
        .collect()
}

impl KernelState {
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

    pub fn upsert_policy(
        &mut self,
        maps: &mut Maps,
        want: &KernelState,
        name: impl Fn(&PolicyEntry) -> String,
        errors: &mut Vec<ObjectError>,
    ) {
        let todo: Vec<_> = changed(&self.policy, &want.policy)
            .map(|(k, v)| (*k, *v))
            .collect();
        for (entry, rule) in todo {
            match maps.policy.insert(&Key::new(entry.0, entry.1), rule, 0) {
                Ok(()) => {
                    self.policy.insert(entry, rule);
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

    pub fn upsert_identity(
        &mut self,
        maps: &mut Maps,
        want: &KernelState,
        errors: &mut Vec<ObjectError>,
    ) {
        let todo: Vec<_> = changed(&self.identity, &want.identity)
            .map(|(k, v)| (*k, *v))
            .collect();
        for (prefix, id) in todo {
            let (key, len) = prefix.trie_key();
            match maps.identity.insert(&Key::new(len, key), id, 0) {
                Ok(()) => {
                    self.identity.insert(prefix, id);
                }
                Err(e) => errors.push(failure(identity_object(&prefix), e)),
            }
        }
    }

    pub fn delete_identity(
        &mut self,
        maps: &mut Maps,
        want: &KernelState,
        errors: &mut Vec<ObjectError>,
    ) {
        for prefix in gone(&self.identity, &want.identity) {
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
        upsert_hash(
            &mut self.service,
            &want.service,
            &mut maps.service,
            service_object,
            errors,
        );
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

fn identity_object(p: &Prefix) -> String {
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
