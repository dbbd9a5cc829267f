//! When the SERVICE map has no room for every frontend.
//!
//! A frontend in SERVICE is deferred: a pod's packet to it is judged after kube-proxy's
//! DNAT, against the backend it reaches. A frontend left out would be judged on its own
//! address, before DNAT, so an egress rule or an Admin Deny naming the backends would not
//! hold through it. So the frontends are planned against the map's room:
//! - nodePorts and frontends on the node's own addresses first (a nodePort's key has no
//!   address to mark, and the node's addresses must stay the node's);
//! - then each namespace's frontends, up to an equal share of the room left;
//! - then the rest while room remains, the namespaces wanting least first.
//!
//! The addresses of the frontends left out take [`IDENTITY_UNLISTED_FRONTEND`] in
//! IDENTITY, which a judged direction drops (fails closed) and an unjudged one ignores.
//! One tenant's many Services cost its own frontends, never another namespace's.
//! Other ports of such an address that are listed stay deferred: the programs look up
//! SERVICE before the peer's identity.

use std::collections::{BTreeMap, BTreeSet};

use weir_common::{map_names, ServiceKey, IDENTITY_UNLISTED_FRONTEND};
use weir_policy::desired::Desired;

use super::identities::Prefix;
use super::kernel_state::KernelState;
use crate::dataplane::ObjectError;

/// How a convergence fits the frontends in SERVICE.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ServiceRoom {
    /// Frontends left out, each with its Service's namespace.
    pub unlisted: BTreeMap<ServiceKey, String>,
    /// SERVICE's capacity, the frontends wanted, and each namespace's share of the room
    /// the nodePorts and node addresses left (only when short of room).
    pub capacity: usize,
    pub wanted: usize,
    pub share: usize,
    /// Marks IDENTITY holds for addresses whose frontends are all listed now: kept in
    /// the target until SERVICE holds those, then removed (no instant without both).
    pub lingering: BTreeSet<Prefix>,
}

/// Plans `want` (each frontend with its namespace) against `capacity` entries (`None`:
/// unknown, every frontend is listed and the kernel's refusals decide); `first` says
/// which go before any namespace's.
pub fn plan_service_room(
    want: &BTreeMap<ServiceKey, String>,
    first: impl Fn(&ServiceKey) -> bool,
    capacity: Option<usize>,
) -> ServiceRoom {
    let Some(capacity) = capacity.filter(|c| want.len() > *c) else {
        return ServiceRoom::default();
    };
    let (firsts, rest): (Vec<_>, Vec<_>) = want.iter().partition(|(k, _)| first(k));
    let mut listed: BTreeSet<ServiceKey> = firsts.iter().take(capacity).map(|(k, _)| **k).collect();
    let mut by_namespace: BTreeMap<&str, Vec<ServiceKey>> = BTreeMap::new();
    for (key, ns) in rest {
        by_namespace.entry(ns.as_str()).or_default().push(*key);
    }
    let room = capacity - listed.len();
    let share = room / by_namespace.len().max(1);
    for keys in by_namespace.values() {
        listed.extend(keys.iter().take(share));
    }
    // What the shares left, to the namespaces wanting least first.
    let mut namespaces: Vec<&Vec<ServiceKey>> = by_namespace.values().collect();
    namespaces.sort_by_key(|keys| keys.len());
    let mut left = capacity - listed.len();
    for keys in namespaces {
        for key in keys.iter().skip(share) {
            if left == 0 {
                break;
            }
            listed.insert(*key);
            left -= 1;
        }
    }
    ServiceRoom {
        unlisted: want
            .iter()
            .filter(|(k, _)| !listed.contains(k))
            .map(|(k, ns)| (*k, ns.clone()))
            .collect(),
        capacity,
        wanted: want.len(),
        share,
        lingering: BTreeSet::new(),
    }
}

/// [`plan_service_room`] for `desired`'s frontends in `target` (the keys `target`'s
/// SERVICE holds), with the node's own prefixes `host` first; then `target` as it is
/// written: the frontends left out taken from SERVICE, and their addresses (not the
/// node's) marked in IDENTITY, over any prefix of the same length. The marks `kernel`
/// holds for addresses with frontends listed again stay, as [`ServiceRoom::lingering`].
pub fn fit_frontends(
    desired: &Desired,
    host: &[Prefix],
    capacity: Option<u32>,
    kernel: &KernelState,
    target: &mut KernelState,
) -> ServiceRoom {
    let want: BTreeMap<ServiceKey, String> = desired
        .frontends
        .iter()
        .map(|f| {
            let ns = desired
                .frontend_namespaces
                .get(f)
                .cloned()
                .unwrap_or_default();
            (super::service_key(f), ns)
        })
        .collect();
    let host: BTreeSet<u128> = host
        .iter()
        .filter(|p| p.len == 128)
        .map(|p| p.addr)
        .collect();
    let on_node = |k: &ServiceKey| k.addr == [0; 16] || host.contains(&u128::from_be_bytes(k.addr));
    let mut room = plan_service_room(&want, on_node, capacity.map(|c| c as usize));
    for key in room.unlisted.keys() {
        target.service.remove(key);
        if !on_node(key) {
            let prefix = Prefix {
                addr: u128::from_be_bytes(key.addr),
                len: 128,
            };
            target.identity.insert(prefix, IDENTITY_UNLISTED_FRONTEND);
        }
    }
    // Looked up by the listed frontends' addresses, not by a walk of IDENTITY (which may
    // hold a million prefixes): this runs at every convergence.
    let listed: BTreeSet<Prefix> = target
        .service
        .keys()
        .filter(|k| k.addr != [0; 16])
        .map(|k| Prefix {
            addr: u128::from_be_bytes(k.addr),
            len: 128,
        })
        .collect();
    for prefix in listed {
        if kernel.identity.get(&prefix) == Some(&IDENTITY_UNLISTED_FRONTEND)
            && !target.identity.contains_key(&prefix)
        {
            target.identity.insert(prefix, IDENTITY_UNLISTED_FRONTEND);
            room.lingering.insert(prefix);
        }
    }
    room
}

impl ServiceRoom {
    /// One failure per namespace with frontends left out, naming the figures.
    pub fn report(&self, errors: &mut Vec<ObjectError>) {
        let mut by_namespace: BTreeMap<&str, usize> = BTreeMap::new();
        for ns in self.unlisted.values() {
            *by_namespace.entry(ns.as_str()).or_default() += 1;
        }
        if by_namespace.is_empty() {
            return;
        }
        tracing::warn!(
            unlisted = self.unlisted.len(),
            wanted = self.wanted,
            capacity = self.capacity,
            "Service frontends left out of SERVICE: judged pods are refused at them"
        );
        for (ns, n) in by_namespace {
            let namespace = match ns {
                "" => "(no namespace)".to_string(),
                ns => format!("namespace {ns}"),
            };
            errors.push(ObjectError {
                object: format!("map {} ({namespace})", map_names::SERVICE),
                reason: format!(
                    "map is full: {n} Service frontends of {namespace} not written ({} \
                     frontends wanted, {} entries, a namespace's share {}): a pod whose \
                     traffic is judged (isolated, or under ClusterNetworkPolicy tiers) is \
                     refused at them until they fit, since the backend that decides is \
                     unknown before kube-proxy's DNAT (raise --ebpf-service-entries, or \
                     remove Services)",
                    self.wanted, self.capacity, self.share,
                ),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(addr: u8, port: u16) -> ServiceKey {
        let mut a = [0; 16];
        a[15] = addr;
        ServiceKey {
            addr: a,
            port,
            protocol: 6,
            _pad: 0,
        }
    }

    fn want(entries: &[(u8, u16, &str)]) -> BTreeMap<ServiceKey, String> {
        entries
            .iter()
            .map(|(a, p, ns)| (key(*a, *p), ns.to_string()))
            .collect()
    }

    #[test]
    fn everything_fits_or_the_capacity_is_unknown() {
        let w = want(&[(1, 80, "a"), (2, 80, "b")]);
        assert_eq!(
            plan_service_room(&w, |_| false, Some(2)),
            ServiceRoom::default()
        );
        assert_eq!(
            plan_service_room(&w, |_| false, None),
            ServiceRoom::default()
        );
    }

    #[test]
    fn the_namespace_over_its_share_loses_its_frontends_not_the_others() {
        // "evil" wants 10 of 8 entries; "shop" wants 1 and comes later by address.
        let mut entries: Vec<(u8, u16, &str)> = (1..=10).map(|p| (1, p, "evil")).collect();
        entries.push((9, 80, "shop"));
        let room = plan_service_room(&want(&entries), |_| false, Some(8));
        assert_eq!(room.share, 4);
        assert_eq!(room.unlisted.len(), 3);
        assert!(room.unlisted.values().all(|ns| ns == "evil"));
        assert!(!room.unlisted.contains_key(&key(9, 80)));
    }

    #[test]
    fn node_ports_and_node_addresses_go_first() {
        let mut entries: Vec<(u8, u16, &str)> = (1..=6).map(|p| (1, p, "evil")).collect();
        entries.push((0, 30080, "evil"));
        let room = plan_service_room(&want(&entries), |k| k.addr == [0; 16], Some(4));
        assert!(!room.unlisted.contains_key(&key(0, 30080)));
        assert_eq!(room.unlisted.len(), 3);
    }

    #[test]
    fn unlisted_addresses_are_marked_in_identity_and_node_ones_are_not() {
        use std::net::{IpAddr, Ipv4Addr};
        use weir_policy::desired::{Frontend, Protocol};
        let mut desired = Desired::default();
        let front = |a: Option<[u8; 4]>, port: u16| Frontend {
            addr: a.map(|a| IpAddr::V4(Ipv4Addr::from(a))),
            protocol: Protocol::Tcp,
            port,
        };
        for port in 1..=20 {
            let f = front(Some([10, 96, 0, 1]), port);
            desired.frontends.insert(f);
            desired.frontend_namespaces.insert(f, "evil".into());
        }
        let shop = front(Some([10, 96, 0, 2]), 80);
        desired.frontends.insert(shop);
        desired.frontend_namespaces.insert(shop, "shop".into());
        let node = front(Some([169, 254, 1, 1]), 8080);
        desired.frontends.insert(node);
        let mut target = KernelState::default();
        for f in &desired.frontends {
            target.service.insert(super::super::service_key(f), 1);
        }
        let node_prefix = Prefix {
            addr: u128::from_be_bytes(Ipv4Addr::new(169, 254, 1, 1).to_ipv6_mapped().octets()),
            len: 128,
        };
        let mut planned = target.clone();
        let room = fit_frontends(
            &desired,
            &[node_prefix],
            Some(16),
            &KernelState::default(),
            &mut planned,
        );
        let target = planned;
        assert_eq!(target.service.len(), 16);
        assert_eq!(room.unlisted.len(), 6);
        assert!(target
            .service
            .contains_key(&super::super::service_key(&shop)));
        assert!(target
            .service
            .contains_key(&super::super::service_key(&node)));
        let evil = Prefix {
            addr: u128::from_be_bytes(Ipv4Addr::new(10, 96, 0, 1).to_ipv6_mapped().octets()),
            len: 128,
        };
        assert_eq!(
            target.identity.get(&evil),
            Some(&IDENTITY_UNLISTED_FRONTEND)
        );
        assert_eq!(target.identity.len(), 1);
        let mut errors = Vec::new();
        room.report(&mut errors);
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].object.contains("namespace evil"),
            "{:?}",
            errors[0]
        );
        assert!(
            errors[0].reason.contains("6 Service frontends"),
            "{:?}",
            errors[0]
        );
    }

    #[test]
    fn a_mark_whose_frontend_is_listed_again_lingers_until_service_holds_it() {
        use std::net::{IpAddr, Ipv4Addr};
        use weir_policy::desired::{Frontend, Protocol};
        let f = Frontend {
            addr: Some(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 1))),
            protocol: Protocol::Tcp,
            port: 80,
        };
        let mut desired = Desired::default();
        desired.frontends.insert(f);
        let mut target = KernelState::default();
        target.service.insert(super::super::service_key(&f), 1);
        let mark = Prefix {
            addr: u128::from_be_bytes(Ipv4Addr::new(10, 96, 0, 1).to_ipv6_mapped().octets()),
            len: 128,
        };
        let mut kernel = KernelState::default();
        kernel.identity.insert(mark, IDENTITY_UNLISTED_FRONTEND);
        let room = fit_frontends(&desired, &[], Some(16), &kernel, &mut target);
        assert!(room.unlisted.is_empty());
        assert_eq!(room.lingering, BTreeSet::from([mark]));
        assert_eq!(
            target.identity.get(&mark),
            Some(&IDENTITY_UNLISTED_FRONTEND)
        );
    }
}
