//! The eBPF encoding check shared by agent/tests/ebpf_encoding.rs and the `ebpf_encoding`
//! fuzz target: a generated case through the engine, the planned maps decided as the
//! programs decide (`dataplane::ebpf::decode`), weir's verdict and the reference
//! evaluator, on every probe the lab makes over IPv4 and IPv6.

use netpol_scenarios::generated::{Case, DualAddresses, Family};
use netpol_scenarios::{probes, reference};
use weir::dataplane::ebpf::decode;
use weir_policy::desired::Protocol;
use weir_policy::manifest::parse_str;
use weir_policy::{verdict, Engine};

/// The addresses the lab gives the world (10.244.0.2.., fd00:10:244::2.., in world order).
pub fn addresses() -> DualAddresses {
    netpol_scenarios::world_pods()
        .into_iter()
        .enumerate()
        .map(|(i, pod)| {
            let host = i + 2;
            let v4 = format!("10.244.0.{host}").parse().unwrap();
            let v6 = format!("fd00:10:244::{host:x}").parse().unwrap();
            (pod, (v4, v6))
        })
        .collect()
}

fn protocol(name: &str) -> Protocol {
    match name {
        "TCP" => Protocol::Tcp,
        "UDP" => Protocol::Udp,
        _ => Protocol::Sctp,
    }
}

/// Every disagreement of the case (the reference, weir's verdict, the decoded maps).
pub fn disagreements(case: &Case) -> Vec<String> {
    let text: String = reference::manifests(&case.world)
        .iter()
        .map(|v| format!("---\n{v}\n"))
        .collect();
    let mut engine = Engine::new(None);
    for object in parse_str(&text).expect("generated objects parse") {
        if let Err(e) = engine.upsert(object) {
            return vec![format!("refused: {e}")];
        }
    }
    let desired = engine.desired();
    let encoded = decode::encode(desired);
    let mut out = Vec::new();
    for family in [Family::V4, Family::V6] {
        for (from, to, port, proto) in probes() {
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
