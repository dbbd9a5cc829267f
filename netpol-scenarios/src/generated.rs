//! Generated cases: random NetworkPolicies over the netpol world (x/y/z × a/b/c), drawn
//! from a seed, each with the matrix the reference evaluator ([`crate::reference`]) expects
//! for every probe the lab makes. The engine harness runs hundreds of them through weir's
//! verdict; the lab harness runs a few dozen with real packets on both dataplanes.
//!
//! The draws aim at the edges the hand-written table leaves out: ipBlocks sized around the
//! pods' own addresses (host routes, small blocks, /4, the whole space) with excepts that
//! carve pods out, in the probed family and sometimes the other one; port ranges that end
//! on, or one short of, a probed port; named ports with the wrong protocol; several
//! policies and rules that overlap; match expressions of every operator.
//!
//! A run is a seed and a count; every case has its own seed, so one failing case replays
//! alone ([`draw`] with that seed).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::net::IpAddr;

use ipnet::IpNet;

use crate::reference::{
    self, Labels, Ns, Peer, Pod, Policy, Port, PortValue, Protocol, Rule, Sel, World,
};
use crate::{probes, Matrix, Pair, NAMESPACES, PODS, PORTS};

/// The address family a case is probed over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    /// As `weir-lab probe --family` takes it.
    pub fn flag(self) -> &'static str {
        match self {
            Family::V4 => "ipv4",
            Family::V6 => "ipv6",
        }
    }
}

/// `ns/name` → (IPv4, IPv6) of every pod of the world.
pub type DualAddresses = BTreeMap<String, (IpAddr, IpAddr)>;

/// One generated case: policies over the world, and the family it is probed over.
pub struct Case {
    pub seed: u64,
    pub family: Family,
    /// The world with the case's policies, as the reference evaluator reads it.
    pub world: World,
}

impl Case {
    /// The case's policies as one YAML stream (JSON documents, which YAML reads), for
    /// `weir-lab apply` and `delete`.
    pub fn manifests(&self) -> String {
        self.policy_objects()
            .iter()
            .map(|v| format!("---\n{v}\n"))
            .collect()
    }

    /// The case's policies as Kubernetes objects (JSON).
    pub fn policy_objects(&self) -> Vec<serde_json::Value> {
        reference::manifests(&World {
            namespaces: Vec::new(),
            pods: Vec::new(),
            policies: self.world.policies.clone(),
        })
    }

    /// Whether the reference evaluator allows the probe (pods as `ns/name`) over the
    /// case's family.
    pub fn allowed(&self, from: &str, to: &str, port: u16, protocol: &str) -> bool {
        self.allowed_over(self.family, from, to, port, protocol)
    }

    /// The address of pod `ns/name` in `family`.
    pub fn address(&self, family: Family, pod: &str) -> IpAddr {
        let p = self.pod(pod);
        match family {
            Family::V4 => p.v4.expect("world pods have IPv4"),
            Family::V6 => p.v6.expect("world pods have IPv6"),
        }
    }

    fn pod(&self, key: &str) -> &Pod {
        self.world
            .pods
            .iter()
            .find(|p| format!("{}/{}", p.ns, p.name) == key)
            .unwrap_or_else(|| panic!("{key} is not a pod of the world"))
    }

    /// Whether the reference evaluator allows the probe over `family`.
    pub fn allowed_over(
        &self,
        family: Family,
        from: &str,
        to: &str,
        port: u16,
        protocol: &str,
    ) -> bool {
        let protocol = Protocol::parse(protocol).expect("a probed protocol");
        reference::allowed(
            &self.world,
            self.pod(from),
            self.address(family, from),
            self.pod(to),
            self.address(family, to),
            port,
            protocol,
        )
    }

    /// The reference's verdicts as a truth table for [`crate::compare`].
    pub fn truth(&self) -> impl Fn(&Pair) -> bool + '_ {
        move |p| {
            let from = format!("{}/{}", p.from_ns, p.from_pod);
            let to = format!("{}/{}", p.to_ns, p.to_pod);
            self.allowed(&from, &to, p.port, p.protocol)
        }
    }

    /// The expected matrix: every probe the lab makes.
    pub fn expected(&self) -> Matrix {
        probes()
            .into_iter()
            .map(|(from, to, port, protocol)| {
                let allowed = self.allowed(&from, &to, port, protocol);
                ((from, to, port, protocol.to_string()), allowed)
            })
            .collect()
    }

    /// How to name the case in a failure: its seed, family and policies.
    pub fn describe(&self) -> String {
        let mut out = format!(
            "generated case {:#018x} over {} (replay alone: WEIR_GENERATED_CASE={:#018x}):\n",
            self.seed,
            self.family.flag(),
            self.seed
        );
        for policy in self.policy_objects() {
            let _ = writeln!(out, "  {policy}");
        }
        out
    }
}

/// The seeds of `count` cases of the run `run_seed`.
pub fn case_seeds(run_seed: u64, count: usize) -> Vec<u64> {
    let mut rng = Rng::Seeded(run_seed);
    (0..count).map(|_| rng.next()).collect()
}

/// Reads a seed as given to the harnesses: decimal or `0x` hexadecimal.
pub fn parse_seed(text: &str) -> Result<u64, String> {
    let text = text.trim();
    match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse(),
    }
    .map_err(|e| format!("{text:?} is not a seed (decimal or 0x hex): {e}"))
}

/// The addresses the lab's IPAM gives the world's pods, in world order: 10.244.0.2.. and
/// fd00:10:244::2.. (.1 is the gateway). Harnesses without a lab use them.
pub fn lab_addresses() -> DualAddresses {
    crate::world_pods()
        .into_iter()
        .zip(2u8..)
        .map(|(pod, host)| {
            let v4 = IpAddr::from([10, 244, 0, host]);
            let v6 = IpAddr::from([0xfd00, 0x10, 0x244, 0, 0, 0, 0, u16::from(host)]);
            (pod, (v4, v6))
        })
        .collect()
}

/// The world's namespaces and pods with their addresses and ports, as in
/// deploy/examples/netpol-world.yaml.
pub fn world(addresses: &DualAddresses) -> World {
    let namespaces = NAMESPACES
        .iter()
        .map(|ns| Ns {
            name: ns.to_string(),
            labels: Labels::from([("ns".to_string(), ns.to_string())]),
        })
        .collect();
    let ports: Vec<(String, u16, Protocol)> = PORTS
        .iter()
        .flat_map(|port| {
            Protocol::ALL.into_iter().map(move |p| {
                let name = format!("serve-{port}-{}", p.name().to_lowercase());
                (name, *port, p)
            })
        })
        .collect();
    let pods = NAMESPACES
        .iter()
        .flat_map(|ns| PODS.iter().map(move |pod| (*ns, *pod)))
        .map(|(ns, name)| {
            let key = format!("{ns}/{name}");
            let (v4, v6) = addresses
                .get(&key)
                .unwrap_or_else(|| panic!("no addresses for {key}"));
            Pod {
                ns: ns.to_string(),
                name: name.to_string(),
                labels: Labels::from([("pod".to_string(), name.to_string())]),
                v4: Some(*v4),
                v6: Some(*v6),
                host: false,
                ports: ports.clone(),
            }
        })
        .collect();
    World {
        namespaces,
        pods,
        policies: Vec::new(),
    }
}

/// The case of `seed` over the world with `addresses`.
pub fn draw(seed: u64, addresses: &DualAddresses) -> Case {
    draw_with(Rng::Seeded(seed), seed, addresses)
}

/// A case whose every choice is read from `bytes` (zeros once they run out): for a
/// fuzzer, whose mutations of the bytes then steer the choices. Its seed is a hash of the
/// bytes, for naming only.
pub fn draw_from_bytes(bytes: &[u8], addresses: &DualAddresses) -> Case {
    let name = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    });
    draw_with(Rng::Bytes(bytes, 0), name, addresses)
}

fn draw_with(mut rng: Rng, seed: u64, addresses: &DualAddresses) -> Case {
    let family = if rng.chance(50) {
        Family::V4
    } else {
        Family::V6
    };
    let mut world = world(addresses);
    let count = 1 + rng.below(3);
    let policies = (0..count)
        .map(|i| draw_policy(&mut rng, &world, family, i))
        .collect();
    world.policies = policies;
    Case {
        seed,
        family,
        world,
    }
}

fn draw_policy(rng: &mut Rng, world: &World, family: Family, i: usize) -> Policy {
    let ns = rng.pick(&NAMESPACES).to_string();
    let types = match rng.below(5) {
        0 | 1 => None,
        2 => Some(vec!["Ingress"]),
        3 => Some(vec!["Egress"]),
        _ => Some(vec!["Ingress", "Egress"]),
    };
    let rules = |rng: &mut Rng| {
        (0..rng.below(3))
            .map(|_| draw_rule(rng, world, family))
            .collect::<Vec<_>>()
    };
    let ingress = rules(rng);
    let egress = rules(rng);
    Policy {
        ns,
        name: format!("generated-{i}"),
        selector: pod_selector(rng),
        types,
        ingress,
        egress,
    }
}

fn draw_rule(rng: &mut Rng, world: &World, family: Family) -> Rule {
    let peers = (0..rng.below(3))
        .map(|_| match rng.below(3) {
            0 => ip_block(rng, world, family),
            _ => {
                let ns = match rng.below(4) {
                    0 => None,
                    _ => Some(namespace_selector(rng)),
                };
                let pod = match (rng.below(3), &ns) {
                    (0, Some(_)) => None,
                    _ => Some(pod_selector(rng)),
                };
                Peer::Pods { ns, pod }
            }
        })
        .collect();
    let ports = (0..rng.below(3)).map(|_| port(rng)).collect();
    Rule { peers, ports }
}

fn selector(labels: &[(&str, &str)], exprs: Vec<(&str, &'static str, &[&str])>) -> Sel {
    Sel {
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        exprs: exprs
            .into_iter()
            .map(|(k, op, values)| {
                (
                    k.to_string(),
                    op,
                    values.iter().map(|v| v.to_string()).collect(),
                )
            })
            .collect(),
    }
}

fn pod_selector(rng: &mut Rng) -> Sel {
    let pod = *rng.pick(&PODS);
    let other = *rng.pick(&PODS);
    match rng.below(8) {
        0 => selector(&[], vec![]),
        1 | 2 => selector(&[("pod", pod)], vec![]),
        3 => selector(&[], vec![("pod", "In", &[pod, other])]),
        4 => selector(&[], vec![("pod", "NotIn", &[pod])]),
        5 => selector(&[], vec![("pod", "Exists", &[])]),
        6 => selector(&[], vec![("app", "DoesNotExist", &[])]),
        // Labels and expressions together must both hold.
        _ => selector(&[("pod", pod)], vec![("pod", "In", &[other])]),
    }
}

fn namespace_selector(rng: &mut Rng) -> Sel {
    let ns = *rng.pick(&NAMESPACES);
    let other = *rng.pick(&NAMESPACES);
    match rng.below(7) {
        0 => selector(&[], vec![]),
        1 | 2 => selector(&[("ns", ns)], vec![]),
        3 => selector(
            &[],
            vec![("kubernetes.io/metadata.name", "In", &[ns, other])],
        ),
        4 => selector(&[], vec![("ns", "NotIn", &[ns])]),
        5 => selector(&[], vec![("ns", "Exists", &[])]),
        _ => selector(&[("ns", ns)], vec![("env", "DoesNotExist", &[])]),
    }
}

/// A block sized around one pod's address (host, a few neighbours, /4, everything), in the
/// probed family five times in six, with up to two pods' addresses excepted.
fn ip_block(rng: &mut Rng, world: &World, family: Family) -> Peer {
    let v4 = match family {
        Family::V4 => !rng.chance(17),
        Family::V6 => rng.chance(17),
    };
    let address = |pod: &Pod| match v4 {
        true => pod.v4.expect("world pods have IPv4"),
        false => pod.v6.expect("world pods have IPv6"),
    };
    let bits = if v4 { 32 } else { 128 };
    let around = address(rng.pick(&world.pods));
    let prefix = match rng.below(8) {
        0 => bits,
        1 => bits - 2,
        2 => bits - 3,
        3 => bits - 4,
        4 if v4 => 24,
        4 => 64,
        5 => 4,
        6 if !v4 => return ipv4_in_ipv6(rng, world),
        _ => 0,
    };
    let cidr = IpNet::new(around, prefix)
        .expect("a prefix within the family")
        .trunc();
    let except = (0..rng.below(3))
        .map(|_| {
            let carved = match rng.below(4) {
                0 | 1 => rng.below(2) as u8,
                2 => 4,
                _ => 8,
            };
            IpNet::new(address(rng.pick(&world.pods)), bits - carved)
                .expect("a prefix within the family")
                .trunc()
        })
        // The API takes only strict subsets of the block.
        .filter(|e| cidr.contains(e) && e.prefix_len() > cidr.prefix_len())
        .collect();
    Peer::Block { cidr, except }
}

/// An IPv6 block where IPv4 meets IPv6: one that covers the IPv4-mapped range
/// ::ffff:0:0/96 (::/80, or that range itself), or a pod's IPv4 address written
/// IPv4-mapped. None holds an IPv4 peer, nor any pod's IPv6 address.
fn ipv4_in_ipv6(rng: &mut Rng, world: &World) -> Peer {
    let cidr = match rng.below(3) {
        0 => "::/80".parse().expect("a CIDR"),
        1 => "::ffff:0:0/96".parse().expect("a CIDR"),
        _ => match rng.pick(&world.pods).v4 {
            Some(IpAddr::V4(v4)) => {
                IpNet::new(IpAddr::V6(v4.to_ipv6_mapped()), 128).expect("a host prefix")
            }
            other => panic!("a world pod's IPv4 address is {other:?}"),
        },
    };
    Peer::Block {
        cidr,
        except: Vec::new(),
    }
}

fn port(rng: &mut Rng) -> Port {
    let protocol = match rng.below(5) {
        0 | 1 => None,
        2 => Some(Protocol::Tcp),
        3 => Some(Protocol::Udp),
        _ => Some(Protocol::Sctp),
    };
    let (port, end) = match rng.below(8) {
        0 => (None, None),
        1 | 2 => (Some(PortValue::Number(*rng.pick(&PORTS))), None),
        // Ranges that end on a probed port, start on one, hold both, or stop one short.
        3 => (Some(PortValue::Number(79)), Some(80)),
        4 => (Some(PortValue::Number(81)), Some(82)),
        5 => (Some(PortValue::Number(80)), Some(81)),
        6 => (Some(PortValue::Number(70)), Some(79)),
        // A named port, with the protocol it is served on or another, or that no pod has.
        _ => {
            let served = match protocol {
                Some(p) if rng.chance(75) => p,
                _ => *rng.pick(&Protocol::ALL),
            };
            let name = match rng.chance(10) {
                true => "no-such-port".to_string(),
                false => format!(
                    "serve-{}-{}",
                    rng.pick(&PORTS),
                    served.name().to_lowercase()
                ),
            };
            (Some(PortValue::Name(name)), None)
        }
    };
    Port {
        protocol,
        port,
        end,
    }
}

/// Where the choices come from: splitmix64 (small, fast and the same everywhere, so a
/// seed replays on any machine), or a fuzzer's bytes.
enum Rng<'a> {
    Seeded(u64),
    Bytes(&'a [u8], usize),
}

impl Rng<'_> {
    fn next(&mut self) -> u64 {
        match self {
            Rng::Seeded(state) => {
                *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = *state;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^ (z >> 31)
            }
            // One byte a choice: every choice is below 256.
            Rng::Bytes(bytes, at) => {
                let b = bytes.get(*at).copied().unwrap_or(0);
                *at += 1;
                u64::from(b)
            }
        }
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn pick<'b, T>(&mut self, items: &'b [T]) -> &'b T {
        &items[self.below(items.len())]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addresses() -> DualAddresses {
        lab_addresses()
    }

    #[test]
    fn a_seed_draws_the_same_case_and_seeds_differ() {
        let a = draw(7, &addresses());
        let b = draw(7, &addresses());
        assert_eq!(a.manifests(), b.manifests());
        assert_eq!(a.expected(), b.expected());
        let seeds = case_seeds(1, 50);
        let distinct: std::collections::BTreeSet<String> = seeds
            .iter()
            .map(|s| draw(*s, &addresses()).manifests())
            .collect();
        assert!(distinct.len() > 45, "{} distinct of 50", distinct.len());
    }

    #[test]
    fn cases_are_neither_all_open_nor_all_closed() {
        let mut mixed = 0;
        for seed in case_seeds(2, 100) {
            let expected = draw(seed, &addresses()).expected();
            let open = expected.values().filter(|v| **v).count();
            if open > 0 && open < expected.len() {
                mixed += 1;
            }
        }
        assert!(mixed > 50, "only {mixed} of 100 cases both allow and deny");
    }

    #[test]
    fn seeds_parse_in_decimal_and_hex() {
        assert_eq!(parse_seed("42"), Ok(42));
        assert_eq!(parse_seed("0x2a"), Ok(42));
        assert!(parse_seed("x").unwrap_err().contains("not a seed"));
    }
}
