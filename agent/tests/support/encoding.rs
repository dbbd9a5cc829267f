//! The eBPF encoding check shared by agent/tests/ebpf_encoding.rs and the `ebpf_encoding`
//! fuzz target: a generated case through the engine, the planned maps decided as the
//! programs decide (`dataplane::ebpf::decode`), weir's verdict and the reference
//! evaluator, on every probe the lab makes over IPv4 and IPv6.

use netpol_scenarios::generated::{self, Case, DualAddresses, Family};
use netpol_scenarios::{probes, reference};
use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::OnceLock;
use weir::dataplane::ebpf::decode;
use weir_policy::desired::{Direction, Protocol};

use serde_json::Value;
use weir_policy::model::Object;
use weir_policy::{verdict, Engine};

/// The node's own addresses in [`verdict_disagreements`]: two in blocks its cases name
/// (10.0.0.0/8, fd00::/8), one in neither.
#[allow(dead_code)] // agent/tests/ebpf_encoding.rs's; the fuzz target shares the file
pub const NODE_ADDRESSES: [&str; 3] = ["10.9.0.1", "fd00:9::1", "192.0.2.1"];

/// Every (node address, port, protocol) the node checks probe: the lab's ports.
#[allow(dead_code)] // as above
fn node_probes(node: &[IpAddr]) -> impl Iterator<Item = (&IpAddr, u16, Protocol)> {
    node.iter().flat_map(|a| {
        [80, 81].into_iter().flat_map(move |port| {
            [Protocol::Tcp, Protocol::Udp, Protocol::Sctp]
                .into_iter()
                .map(move |p| (a, port, p))
        })
    })
}

/// The addresses the lab gives the world.
pub fn addresses() -> DualAddresses {
    generated::lab_addresses()
}

fn protocol(name: &str) -> Protocol {
    match name {
        "TCP" => Protocol::Tcp,
        "UDP" => Protocol::Udp,
        _ => Protocol::Sctp,
    }
}

/// A rendered object as weir's (JSON straight to the API types: no YAML on this path,
/// which a fuzzer runs as often as it can).
fn object(v: Value) -> Object {
    match v["kind"].as_str() {
        Some("Namespace") => Object::Namespace(serde_json::from_value(v).expect("a Namespace")),
        Some("Pod") => Object::Pod(serde_json::from_value(v).expect("a Pod")),
        _ => Object::NetworkPolicy(serde_json::from_value(v).expect("a NetworkPolicy")),
    }
}

/// The world's namespaces and pods at [`addresses`], converted once.
fn world_objects() -> &'static [Object] {
    static OBJECTS: OnceLock<Vec<Object>> = OnceLock::new();
    OBJECTS.get_or_init(|| {
        let world = generated::world(&addresses());
        reference::manifests(&world)
            .into_iter()
            .map(object)
            .collect()
    })
}

/// Every disagreement of the case (the reference, weir's verdict, the decoded maps) on
/// the probes whose index (over both families) `keep` takes.
pub fn disagreements(case: &Case, keep: impl Fn(usize) -> bool) -> Vec<String> {
    let objects = world_objects()
        .iter()
        .cloned()
        .chain(case.policy_objects().into_iter().map(object));
    // One cold compile: the fuzzer's inputs a second are what it explores with.
    let mut engine = Engine::new(None);
    let (_, refused) = engine.load(objects);
    if !refused.is_empty() {
        return refused.iter().map(|e| format!("refused: {e}")).collect();
    }
    let desired = engine.desired();
    let encoded = decode::encode(desired);
    let mut out = Vec::new();
    let all = [Family::V4, Family::V6]
        .into_iter()
        .flat_map(|family| probes().into_iter().map(move |p| (family, p)));
    for (_, (family, (from, to, port, proto))) in all.enumerate().filter(|(i, _)| keep(*i)) {
        {
            let expected = case.allowed_over(family, &from, &to, port, proto);
            let (from_addr, to_addr) = (case.address(family, &from), case.address(family, &to));
            let compiled = verdict(desired, &from, to_addr, port, protocol(proto))
                .map(|v| v.allowed)
                .map_err(|e| e.to_string());
            let maps =
                encoded.connection_allowed(&from, from_addr, &to, to_addr, port, protocol(proto));
            if compiled != Ok(expected) || maps != expected {
                out.push(format!(
                    "{from} -> {to} {port}/{proto} over {}: reference {expected}, verdict {compiled:?}, maps {maps}",
                    family.flag()
                ));
            }
        }
    }
    out
}

/// Every disagreement between weir's verdict and the decoded maps on the world with
/// `extra` objects (ClusterNetworkPolicies, NetworkPolicies), on every probe over IPv4 and
/// IPv6. The reference evaluator knows no tiers: weir's verdict is the oracle here.
#[allow(dead_code)] // agent/tests/ebpf_encoding.rs's; the fuzz target shares the file
pub fn verdict_disagreements(extra: Vec<Object>) -> Vec<String> {
    let mut engine = Engine::new(None);
    let (_, refused) = engine.load(world_objects().iter().cloned().chain(extra));
    if !refused.is_empty() {
        return refused.iter().map(|e| format!("refused: {e}")).collect();
    }
    let desired = engine.desired();
    let node: Vec<IpAddr> = NODE_ADDRESSES.iter().map(|a| a.parse().unwrap()).collect();
    let encoded = decode::encode_on_node(desired, &node);
    let addresses = addresses();
    let mut out = Vec::new();
    // The pods' traffic with their node: egress as the tiers around the NetworkPolicies
    // say; from the node, always allowed.
    let froms: BTreeSet<String> = probes().into_iter().map(|(from, ..)| from).collect();
    for from in &froms {
        for (&addr, port, proto) in node_probes(&node) {
            let compiled = verdict::egress_to_node(desired, from, addr, port, proto)
                .map(|v| v.allowed)
                .map_err(|e| e.to_string());
            let maps = encoded.admits(from, Direction::Egress, addr, port, proto);
            if compiled != Ok(maps) {
                out.push(format!(
                    "{from} -> node {addr} {port}/{proto:?}: weir {compiled:?}, maps {maps}"
                ));
            }
            if !encoded.admits(from, Direction::Ingress, addr, port, proto) {
                out.push(format!("node {addr} -> {from} {port}/{proto:?}: maps deny"));
            }
        }
    }
    for (from, to, port, proto) in probes() {
        for family in [Family::V4, Family::V6] {
            let address = |pod: &str| match family {
                Family::V4 => addresses[pod].0,
                Family::V6 => addresses[pod].1,
            };
            let (from_addr, to_addr) = (address(&from), address(&to));
            let compiled = verdict(desired, &from, to_addr, port, protocol(proto))
                .map(|v| v.allowed)
                .map_err(|e| e.to_string());
            let maps =
                encoded.connection_allowed(&from, from_addr, &to, to_addr, port, protocol(proto));
            if compiled != Ok(maps) {
                out.push(format!(
                    "{from} -> {to} {port}/{proto} {family:?}: weir {compiled:?}, maps {maps}"
                ));
            }
        }
    }
    out
}
