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
        let refused = apply_changes(&mut harness, &step.changes, addresses);
        if !refused.is_empty() {
            failures.extend(refused.into_iter().map(|e| format!("{label}: {e}")));
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

/// Applies a step's changes to the harness; returns each object the engine refused.
fn apply_changes(
    harness: &mut Harness,
    changes: &[Change],
    addresses: &BTreeMap<String, (String, String)>,
) -> Vec<String> {
    let mut refused = Vec::new();
    for change in changes {
        match change {
            Change::Apply(yaml) => {
                for object in objects(yaml) {
                    let key = object.key();
                    if let Err(e) = harness.upsert_object(scheduled(object, addresses)) {
                        refused.push(format!("apply {key}: {e}"));
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
    refused
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

/// What `weir explain` says decided each side, in the words of the table below: `"<side>
/// decided <tier> <policy> <rule> <action>"` and `"<side> passed <tier> <policy> <rule>"`.
fn tier_words(x: &weir_policy::explain::Explanation) -> Vec<String> {
    let mut words = Vec::new();
    for (side, s) in [("egress", &x.egress), ("ingress", &x.ingress)] {
        for p in &s.passed_by {
            words.push(format!("{side} passed {} {} {}", p.tier, p.policy, p.rule));
        }
        if let Some(d) = &s.decided_by {
            words.push(format!(
                "{side} decided {} {} {} {}",
                d.tier, d.policy, d.rule, d.action
            ));
        }
    }
    words
}

/// `weir explain` names the right tier, policy and rule on every ClusterNetworkPolicy
/// scenario of the table: hand-written deciders for probes of each scenario, after the
/// step given (1-based), over IPv4.
#[test]
fn explain_names_the_deciding_rule_on_every_cluster_policy_scenario() {
    use weir_policy::explain::{explain, PortProtocol, Target};
    /// (scenario, step, from, to, port, protocol, allowed, what decided)
    type Case = (
        &'static str,
        usize,
        &'static str,
        &'static str,
        u16,
        &'static str,
        bool,
        &'static [&'static str],
    );
    #[rustfmt::skip]
    let table: &[Case] = &[
        ("cnp admin ingress: rule order and ports", 1, "y/a", "x/a", 80, "TCP", true, &["ingress decided Admin ingress-rules ingress[0] Accept"]),
        ("cnp admin ingress: rule order and ports", 1, "z/a", "x/a", 80, "TCP", false, &["ingress decided Admin ingress-rules ingress[3] Deny"]),
        ("cnp admin ingress: rule order and ports", 1, "z/b", "x/b", 81, "UDP", false, &["ingress decided Admin ingress-rules ingress[6] Deny"]),
        ("cnp admin ingress: rule order and ports", 3, "y/a", "x/a", 80, "TCP", true, &["ingress passed Admin ingress-rules ingress[0]"]),
        ("cnp admin ingress: rule order and ports", 3, "z/a", "x/c", 80, "TCP", true, &["ingress passed Admin ingress-rules ingress[3]"]),
        ("cnp admin egress: rule order and ports", 2, "x/a", "y/b", 81, "SCTP", false, &["egress decided Admin egress-rules egress[0] Deny"]),
        ("cnp admin egress: rule order and ports", 2, "x/a", "z/b", 81, "SCTP", true, &["egress decided Admin egress-rules egress[5] Accept"]),
        ("cnp admin egress: rule order and ports", 2, "x/a", "z/a", 80, "UDP", true, &["egress passed Admin egress-rules egress[3]"]),
        ("cnp admin pass, then the network policy, then the baseline", 2, "y/a", "x/a", 80, "TCP", true, &["ingress passed Admin pass-example ingress[0]"]),
        ("cnp admin pass, then the network policy, then the baseline", 2, "x/a", "y/a", 80, "TCP", false, &["egress decided Admin pass-example egress[0] Deny"]),
        ("cnp admin pass, then the network policy, then the baseline", 4, "y/a", "x/a", 80, "TCP", false, &["ingress passed Admin pass-example ingress[0]", "ingress decided Baseline default ingress[0] Deny"]),
        ("cnp priority: the lower number first, and a change re-evaluated", 1, "y/a", "x/a", 80, "TCP", false, &["ingress decided Admin priority-50 ingress[0] Deny"]),
        ("cnp priority: the lower number first, and a change re-evaluated", 2, "y/a", "x/a", 80, "TCP", true, &["ingress passed Admin priority-60 ingress[0]", "ingress decided Baseline default ingress[0] Accept"]),
        ("cnp networks as peers match pods too", 1, "x/a", "y/a", 80, "TCP", true, &["egress decided Admin inline-cidr egress[0] Accept"]),
        ("cnp networks as peers match pods too", 1, "x/a", "z/a", 80, "TCP", false, &["egress decided Admin inline-cidr egress[1] Deny"]),
        ("cnp networks as peers match pods too", 3, "x/a", "z/a", 80, "TCP", true, &["egress decided Admin inline-cidr egress[0] Accept"]),
        ("cnp named ports resolve on the destination", 1, "x/a", "z/a", 80, "UDP", true, &["egress decided Admin named-ports egress[0] Accept"]),
        ("cnp named ports resolve on the destination", 1, "x/a", "z/a", 80, "TCP", false, &["egress decided Admin named-ports egress[1] Deny"]),
        ("cnp named ports resolve on the destination", 1, "y/a", "x/a", 81, "SCTP", true, &["ingress decided Admin named-ports ingress[0] Accept"]),
        ("cnp baseline egress: networks and a named port", 1, "x/a", "z/a", 81, "TCP", true, &["egress decided Baseline default-egress egress[0] Accept"]),
        ("cnp baseline egress: networks and a named port", 1, "x/a", "y/a", 80, "TCP", false, &["egress decided Baseline default-egress egress[1] Deny"]),
        ("cnp baseline egress: networks and a named port", 2, "x/b", "y/a", 80, "TCP", true, &[]),
        ("cnp baseline, and a network policy over it", 1, "y/a", "x/b", 81, "TCP", false, &["ingress decided Baseline default ingress[1] Deny"]),
        ("cnp baseline, and a network policy over it", 3, "y/a", "x/b", 81, "TCP", true, &["ingress passed Baseline default ingress[1]"]),
        ("cnp admin gress: both directions in one policy, every protocol", 1, "x/a", "z/a", 81, "UDP", false, &["egress decided Admin gress-rules egress[3] Deny"]),
        ("cnp admin gress: both directions in one policy, every protocol", 1, "z/a", "x/a", 80, "UDP", false, &["ingress decided Admin gress-rules ingress[3] Deny"]),
        ("cnp admin gress: both directions in one policy, every protocol", 1, "x/a", "y/a", 80, "SCTP", true, &["egress decided Admin gress-rules egress[0] Accept"]),
        ("cnp admin gress: both directions in one policy, every protocol", 2, "x/a", "z/a", 80, "SCTP", true, &["egress passed Admin gress-rules egress[3]"]),
        ("cnp admin gress: both directions in one policy, every protocol", 2, "y/a", "x/a", 80, "SCTP", false, &["ingress decided Admin gress-rules ingress[0] Deny"]),
        ("cnp baseline gress: both directions in one policy, every protocol", 1, "z/a", "x/a", 80, "TCP", true, &["ingress decided Baseline default-gress ingress[3] Accept"]),
        ("cnp baseline gress: both directions in one policy, every protocol", 1, "z/a", "x/a", 80, "UDP", true, &["ingress decided Baseline default-gress ingress[2] Accept"]),
        ("cnp baseline gress: both directions in one policy, every protocol", 1, "z/a", "x/a", 81, "UDP", false, &["ingress decided Baseline default-gress ingress[4] Deny"]),
        ("cnp baseline gress: both directions in one policy, every protocol", 1, "x/a", "z/b", 80, "SCTP", false, &["egress decided Baseline default-gress egress[2] Deny"]),
        ("cnp baseline gress: both directions in one policy, every protocol", 2, "x/b", "y/c", 81, "TCP", false, &["egress decided Baseline default-gress egress[0] Deny"]),
        ("cnp baseline gress: both directions in one policy, every protocol", 3, "z/a", "x/a", 81, "UDP", true, &[]),
        ("cnp baseline gress: both directions in one policy, every protocol", 3, "x/a", "y/a", 80, "TCP", false, &["egress decided Baseline default-gress egress[0] Deny"]),
        ("cnp baseline gress: both directions in one policy, every protocol", 3, "y/a", "x/a", 80, "TCP", false, &[]),
        ("cnp tiers of many rules: every rule in order, whatever indexes them", 1, "z/a", "x/a", 80, "TCP", true, &["ingress decided Admin many-admin ingress[16] Accept"]),
        ("cnp tiers of many rules: every rule in order, whatever indexes them", 1, "y/a", "x/a", 80, "TCP", false, &["ingress decided Admin many-admin ingress[17] Deny"]),
        ("cnp tiers of many rules: every rule in order, whatever indexes them", 1, "y/a", "x/a", 81, "UDP", true, &["ingress passed Admin many-admin ingress[18]"]),
        ("cnp tiers of many rules: every rule in order, whatever indexes them", 1, "z/a", "x/a", 81, "UDP", false, &["ingress decided Admin many-admin ingress[19] Deny"]),
        ("cnp tiers of many rules: every rule in order, whatever indexes them", 1, "y/a", "x/b", 81, "TCP", false, &["egress decided Baseline many-baseline egress[16] Deny"]),
    ];
    let addresses = world_addresses();
    let world: Vec<Object> = objects(WORLD)
        .into_iter()
        .map(|o| scheduled(o, &addresses))
        .collect();
    let all = scenarios(&addresses_of(&addresses, Family::V4));
    let cluster_scenarios: Vec<&Scenario> =
        all.iter().filter(|s| s.name.starts_with("cnp")).collect();
    let mut failures = Vec::new();
    for scenario in &cluster_scenarios {
        assert!(
            table.iter().any(|row| row.0 == scenario.name),
            "no explain case for {:?}",
            scenario.name
        );
    }
    for &(name, step, from, to, port, proto, allowed, words) in table {
        let scenario = cluster_scenarios
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no scenario {name:?}"));
        let mut harness = Harness::new(Some(NODE));
        for object in &world {
            harness.upsert_object(object.clone()).unwrap();
        }
        for s in &scenario.steps[..step] {
            let refused = apply_changes(&mut harness, &s.changes, &addresses);
            assert!(refused.is_empty(), "{name}: {refused:?}");
        }
        let at = PortProtocol {
            port,
            protocol: protocol(proto),
        };
        let x = explain(&harness.engine, from, &Target::Pod(to.into()), at).unwrap();
        let got = tier_words(&x);
        if x.allowed != allowed || got != words {
            failures.push(format!(
                "{name} / step {step}: {from} -> {to} {port}/{proto}: allowed {} by {got:?}, expected {allowed} by {words:?}",
                x.allowed
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
