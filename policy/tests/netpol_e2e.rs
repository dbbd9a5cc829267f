//! The upstream Kubernetes e2e netpol scenarios (test/e2e/network/netpol) against the
//! compiled model. The scenarios are the one table in netpol-scenarios, which the lab
//! harness (tests/tests/netpol_conformance.rs) also runs with real packets on both
//! dataplanes: the same world, the same steps (policy creates, updates and deletes,
//! namespace and pod relabels) and the same truth tables. Each step's changes go through
//! the engine, checked event by event (the delta applied to the previous state gives the
//! new one, and equals a cold compile); then every probe the lab makes (each pair of pods
//! × 80/81 × TCP/UDP/SCTP) is decided by weir's verdict evaluator and compared with the
//! step's truth table, every difference reported.
//!
//! Addresses: the pods get the ones the lab's IPAM gives them (10.244.0.2.. and
//! fd00:10:244::2.., in world order). The whole table runs twice, once per family: the
//! ipBlock scenarios are handed that family's addresses and every probe goes to the
//! destination pod's address of that family.

mod support;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PodIP, PodStatus};
use netpol_scenarios::generated::{self, Family};
use netpol_scenarios::{compare, probes, scenarios, Addresses, Change, Matrix, Scenario, WORLD};
use support::{objects, Harness};
use weir_policy::desired::Protocol;
use weir_policy::model::Object;
use weir_policy::verdict;

/// The lab's one node; the harness's engine is that node's agent.
const NODE: &str = "node-1";

/// `ns/name` → (IPv4, IPv6), as the lab's IPAM allocates them for the world.
fn world_addresses() -> BTreeMap<String, (String, String)> {
    generated::lab_addresses()
        .into_iter()
        .map(|(pod, (v4, v6))| (pod, (v4.to_string(), v6.to_string())))
        .collect()
}

/// A pod as the cluster has it once scheduled: on the node, with its addresses. A relabel
/// re-applies a pod's manifest, which (like any manifest) has neither; its addresses stay.
fn scheduled(object: Object, addresses: &BTreeMap<String, (String, String)>) -> Object {
    let Object::Pod(mut pod) = object else {
        return object;
    };
    let key = format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or_default()
    );
    let (v4, v6) = addresses
        .get(&key)
        .unwrap_or_else(|| panic!("pod {key} is not in the world"));
    pod.spec
        .get_or_insert_with(Default::default)
        .node_name
        .get_or_insert_with(|| NODE.to_string());
    let status = pod.status.get_or_insert_with(PodStatus::default);
    if status.pod_ips.is_none() {
        status.pod_ip = Some(v4.clone());
        status.pod_ips = Some(vec![PodIP { ip: v4.clone() }, PodIP { ip: v6.clone() }]);
    }
    Object::Pod(pod)
}

fn protocol(name: &str) -> Protocol {
    match name {
        "TCP" => Protocol::Tcp,
        "UDP" => Protocol::Udp,
        "SCTP" => Protocol::Sctp,
        other => panic!("unknown protocol {other}"),
    }
}

/// The compiled model's matrix over `family`: every probe the lab makes.
fn matrix(
    harness: &Harness,
    addresses: &BTreeMap<String, (String, String)>,
    family: Family,
) -> Result<Matrix, String> {
    let mut matrix = Matrix::new();
    for (from, to, port, proto) in probes() {
        let (v4, v6) = &addresses[&to];
        let addr = match family {
            Family::V4 => v4,
            Family::V6 => v6,
        };
        let decided = verdict(
            harness.engine.desired(),
            &from,
            addr.parse().unwrap(),
            port,
            protocol(proto),
        )
        .map_err(|e| format!("{from} -> {to} {port}/{proto}: {e}"))?;
        matrix.insert((from, to, port, proto.to_string()), decided.allowed);
    }
    Ok(matrix)
}

/// Runs one scenario on a fresh engine holding the world, probing over `family`; returns
/// every failure.
fn run(
    n: usize,
    scenario: &Scenario,
    family: Family,
    world: &[Object],
    addresses: &BTreeMap<String, (String, String)>,
) -> Vec<String> {
    let mut failures = Vec::new();
    let mut harness = Harness::new(Some(NODE));
    for object in world {
        if let Err(e) = harness.upsert_object(object.clone()) {
            return vec![format!(
                "{n:02} {}: the world was rejected: {e}",
                scenario.name
            )];
        }
    }
    for (s, step) in scenario.steps.iter().enumerate() {
        let label = format!("{n:02} {} / step {} ({family:?})", scenario.name, s + 1);
        let mut step_ok = true;
        for change in &step.changes {
            match change {
                Change::Apply(yaml) => {
                    for object in objects(yaml) {
                        let key = object.key();
                        if let Err(e) = harness.upsert_object(scheduled(object, addresses)) {
                            failures.push(format!("{label}: apply {key}: {e}"));
                            step_ok = false;
                        }
                    }
                }
                Change::Delete(yaml) => {
                    for object in objects(yaml) {
                        harness.delete(&object.key());
                    }
                }
            }
        }
        if !step_ok {
            continue;
        }
        match matrix(&harness, addresses, family) {
            Ok(m) => {
                if let Err(diff) = compare(&m, step.expect) {
                    failures.push(format!("{label}: {diff}"));
                }
            }
            Err(e) => failures.push(format!("{label}: verdict: {e}")),
        }
    }
    failures
}

/// The scenarios' pod addresses of one family (`ns/name` → address).
fn addresses_of(addresses: &BTreeMap<String, (String, String)>, family: Family) -> Addresses {
    addresses
        .iter()
        .map(|(pod, (v4, v6))| {
            let ip = if family == Family::V4 { v4 } else { v6 };
            (pod.clone(), ip.clone())
        })
        .collect()
}

#[test]
fn every_upstream_scenario_holds_on_the_compiled_model() {
    let addresses = world_addresses();
    let world: Vec<Object> = objects(WORLD)
        .into_iter()
        .map(|o| scheduled(o, &addresses))
        .collect();
    let mut failures = Vec::new();
    let mut steps = 0;
    for family in [Family::V4, Family::V6] {
        let all = scenarios(&addresses_of(&addresses, family));
        assert!(!all.is_empty(), "the scenario table is empty");
        for (n, scenario) in all.iter().enumerate() {
            steps += scenario.steps.len();
            failures.extend(run(n, scenario, family, &world, &addresses));
        }
    }
    eprintln!(
        "{steps} steps over IPv4 and IPv6, {} probes a step",
        probes().len()
    );
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn scenario_names_are_unique() {
    let all = scenarios(&addresses_of(&world_addresses(), Family::V4));
    let mut seen = std::collections::BTreeSet::new();
    for s in &all {
        assert!(seen.insert(s.name), "two scenarios named {:?}", s.name);
        assert!(!s.steps.is_empty(), "{:?} has no step", s.name);
    }
}

/// Generated cases (netpol-scenarios' `generated`, the lab's world with random policies):
/// weir's verdict on the compiled model against the reference evaluator, on every probe the
/// lab makes. `WEIR_GENERATED_SEED` runs another seed than the fixed one.
#[test]
fn generated_cases_agree_with_the_reference_evaluator() {
    let addresses = world_addresses();
    let dual = generated::lab_addresses();
    let world: Vec<Object> = objects(WORLD)
        .into_iter()
        .map(|o| scheduled(o, &addresses))
        .collect();
    let run_seed = std::env::var("WEIR_GENERATED_SEED")
        .map(|s| generated::parse_seed(&s).unwrap())
        .unwrap_or(0x5eed);
    let mut failures = Vec::new();
    let seeds = generated::case_seeds(run_seed, 400);
    for &seed in &seeds {
        let case = generated::draw(seed, &dual);
        let mut harness = Harness::new(Some(NODE));
        for object in &world {
            harness.upsert_object(object.clone()).expect("the world");
        }
        let refused: Vec<String> = objects(&case.manifests())
            .into_iter()
            .filter_map(|object| harness.upsert_object(object).err())
            .map(|e| e.to_string())
            .collect();
        if !refused.is_empty() {
            failures.push(format!("{}refused: {refused:?}", case.describe()));
            continue;
        }
        match matrix(&harness, &addresses, case.family) {
            Ok(m) => {
                if let Err(diff) = compare(&m, case.truth()) {
                    failures.push(format!("{}{diff}", case.describe()));
                }
            }
            Err(e) => failures.push(format!("{}verdict: {e}", case.describe())),
        }
    }
    eprintln!(
        "{} generated cases of run seed {run_seed:#x}, {} probes each",
        seeds.len(),
        probes().len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        seeds.len(),
        failures.join("\n")
    );
}
