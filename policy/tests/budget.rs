//! Budgets: a NetworkPolicy that would take more than its share of the node's tables is
//! refused by the engine from its spec, before anything is compiled; the engine keeps its
//! last admitted version and everything else.

mod support;

use support::{engine_with, objects, policy};
use weir_policy::budget::{Budget, DEFAULT_MAX_ENTRIES_PER_POLICY};
use weir_policy::desired::Direction;
use weir_policy::PolicyError;

/// A policy on every pod of `ns` admitting `blocks` single-address ipBlocks on TCP and
/// UDP 1024–65535 (12 port prefixes): `blocks × 12` entries per selected pod.
fn hostile(ns: &str, name: &str, blocks: usize) -> String {
    let mut spec = String::from("podSelector: {}\ningress:\n- from:\n");
    for i in 0..blocks {
        let (a, b) = (i / 250, i % 250 + 1);
        spec.push_str(&format!("  - ipBlock: {{cidr: 172.16.{a}.{b}/32}}\n"));
    }
    spec.push_str(
        "  ports:\n  - {protocol: TCP, port: 1024, endPort: 65535}\n  \
         - {protocol: UDP, port: 1024, endPort: 65535}\n",
    );
    policy(ns, name, &spec)
}

/// An engine of the test world, on the default budget (a new engine's is unlimited).
fn budgeted(policies: &str) -> weir_policy::Engine {
    let mut engine = engine_with(policies);
    engine.set_budget(Budget::default());
    engine
}

#[test]
fn a_new_engine_admits_what_the_api_server_would() {
    let mut engine = engine_with("");
    assert_eq!(engine.budget(), Budget::UNLIMITED);
    engine
        .upsert(objects(&hostile("x", "huge", 2_500)).remove(0))
        .expect("no budget: the API server's validation only");
}

#[test]
fn a_policy_over_budget_is_refused_before_it_is_expanded() {
    let mut engine = budgeted("");
    let before = engine.desired().clone();
    let huge = objects(&hostile("x", "huge", 10_000)).remove(0);
    let e = engine
        .upsert(huge)
        .expect_err("10,000 ipBlocks × 12 prefixes");
    match &e {
        PolicyError::OverBudget {
            object,
            entries,
            budget,
            ..
        } => {
            assert_eq!(object.to_string(), "networkpolicy x/huge");
            assert_eq!(*entries, 120_000);
            assert_eq!(*budget, DEFAULT_MAX_ENTRIES_PER_POLICY);
        }
        other => panic!("not a budget refusal: {other}"),
    }
    let shown = e.to_string();
    assert!(
        shown.starts_with("networkpolicy x/huge: refused: ") && shown.contains("120000"),
        "{shown}"
    );
    // Nothing was compiled: no set, no isolation, no policy kept.
    assert_eq!(
        engine.desired(),
        &before,
        "the refused policy changed the state"
    );
    assert!(engine.policy("x/huge").is_none());
    assert!(engine.desired().sets.is_empty());
    assert!(engine
        .desired()
        .endpoints
        .values()
        .all(|ep| !ep.ingress.isolated));
}

#[test]
fn a_refused_policy_leaves_the_other_namespaces_policies_and_its_last_version() {
    let mut engine = budgeted(&policy(
        "y",
        "db",
        "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{podSelector: {matchLabels: {pod: b}}}]\n  ports: [{port: 80}]",
    ));
    // The tenant's first version fits, its next one does not: the first stays.
    engine
        .upsert(objects(&hostile("x", "huge", 10)).remove(0))
        .expect("120 entries fit");
    let admitted = engine.desired().clone();
    let e = engine
        .upsert(objects(&hostile("x", "huge", 2_500)).remove(0))
        .unwrap_err();
    assert!(
        matches!(
            e,
            PolicyError::OverBudget {
                entries: 30_000,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(engine.desired(), &admitted, "the refusal changed the state");
    let x_a = &engine.desired().endpoints["x/a"];
    // The admitted version's rules: 10 peers × 2 ports, not 2,500 × 2.
    let rules = &x_a.direction(Direction::Ingress).rules;
    assert_eq!(rules.len(), 20);
    assert!(rules.iter().all(|r| r.origin.policy == "x/huge"));
    let y_a = &engine.desired().endpoints["y/a"];
    assert!(y_a.ingress.isolated, "y's policy is enforced");
}

#[test]
fn load_refuses_over_budget_policies_and_keeps_the_rest() {
    let mut engine = budgeted("");
    let mut objs = objects(&hostile("x", "huge", 2_500));
    objs.extend(objects(&policy(
        "y",
        "deny",
        "podSelector: {}\npolicyTypes: [Ingress]",
    )));
    let (_, errors) = engine.load(objs);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].object().to_string(), "networkpolicy x/huge");
    assert!(engine.policy("y/deny").is_some());
    assert!(engine.desired().endpoints["y/a"].ingress.isolated);
    assert!(!engine.desired().endpoints["x/a"].ingress.isolated);
}

#[test]
fn the_budget_is_the_engines_setting() {
    let mut engine = engine_with("");
    engine.set_budget(Budget {
        max_entries_per_policy: 100,
        ..Budget::default()
    });
    let e = engine
        .upsert(objects(&hostile("x", "ten", 10)).remove(0))
        .unwrap_err();
    assert!(
        e.to_string().contains("(--max-entries-per-policy 100)"),
        "{e}"
    );
    engine.set_budget(Budget {
        max_entries_per_policy: 120,
        ..Budget::default()
    });
    engine
        .upsert(objects(&hostile("x", "ten", 10)).remove(0))
        .expect("120 entries at a budget of 120");
}

#[test]
fn a_service_with_more_frontends_than_the_budget_is_refused() {
    let mut engine = budgeted("");
    engine.set_budget(Budget {
        max_entries_per_policy: 8,
        ..Budget::default()
    });
    let service = |ports: usize| {
        let ports: Vec<String> = (0..ports)
            .map(|p| format!("{{name: p{p}, port: {}}}", 1000 + p))
            .collect();
        objects(&format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: wide, namespace: x}}\n\
             spec: {{clusterIP: 10.96.0.10, externalIPs: [192.0.2.1, 192.0.2.2], ports: [{}]}}\n",
            ports.join(", ")
        ))
        .remove(0)
    };
    // 3 addresses × 3 ports: 9 frontends.
    let e = engine.upsert(service(3)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "service x/wide: refused: 9 frontends (addresses × ports), more than one object may \
         (--max-entries-per-policy 8)"
    );
    assert!(engine.desired().frontends.is_empty());
    engine.upsert(service(2)).expect("6 frontends fit");
    assert_eq!(engine.desired().frontends.len(), 6);
}

#[test]
fn a_namespaces_policies_together_are_bounded() {
    let mut engine = engine_with("");
    // Each policy of 10 blocks takes 120 entries; a namespace may take 250.
    engine.set_budget(Budget {
        max_entries_per_policy: 200,
        max_entries_per_namespace: 250,
    });
    let upsert = |engine: &mut weir_policy::Engine, ns: &str, name: &str, blocks: usize| {
        engine.upsert(objects(&hostile(ns, name, blocks)).remove(0))
    };
    upsert(&mut engine, "x", "one", 10).expect("120 of 250");
    upsert(&mut engine, "x", "two", 10).expect("240 of 250");
    let e = upsert(&mut engine, "x", "three", 10).unwrap_err();
    assert_eq!(
        e.to_string(),
        "networkpolicy x/three: refused: its rules would take an estimated 120 table entries \
         per selected pod, and namespace x's other policies take 240: more than one \
         namespace's policies may together (--max-entries-per-namespace 250)"
    );
    assert_eq!(e.object().to_string(), "networkpolicy x/three");
    assert!(engine.policy("x/three").is_none());
    // Another namespace has its own share.
    upsert(&mut engine, "y", "one", 10).expect("y's first");
    // A policy's own earlier version does not count against it.
    upsert(&mut engine, "x", "two", 10).expect("x/two again, the same size");
    // A larger version that would take the namespace over is refused; the old stays.
    assert!(upsert(&mut engine, "x", "two", 11).is_err());
    assert!(engine.policy("x/two").is_some());
    // Room comes back when a policy goes.
    engine.delete(&weir_policy::model::ObjectRef::new(
        weir_policy::model::Kind::NetworkPolicy,
        Some("x"),
        "one",
    ));
    upsert(&mut engine, "x", "three", 10).expect("240 of 250 again");
    // A cold start admits them in order too: the third of a namespace's is refused.
    let mut cold = engine_with("");
    cold.set_budget(engine.budget());
    let all: Vec<_> = ["one", "two", "three"]
        .iter()
        .flat_map(|name| objects(&hostile("x", name, 10)))
        .collect();
    let (_, errors) = cold.load(all);
    let refused: Vec<String> = errors.iter().map(|e| e.object().to_string()).collect();
    assert_eq!(refused, ["networkpolicy x/three"]);
}
