//! Incremental compilation: every event's delta is exact (applied to the previous state
//! it gives the new one) and the incremental state equals a cold compile; events touch
//! only what they affect.

mod support;

use std::net::IpAddr;

use support::{namespace_yaml, pod_yaml, policy, world_yaml, Harness};
use weir_policy::desired::{Peer, Ports, Protocol};
use weir_policy::model::{Kind, ObjectRef};
use weir_policy::verdict;

const POLICIES: &[(&str, &str, &str)] = &[
    ("x", "from-y", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{namespaceSelector: {matchLabels: {ns: y}}}]\n  ports: [{port: 80}, {port: serve-81-udp, protocol: UDP}]"),
    ("x", "from-b", "podSelector: {}\ningress:\n- from: [{podSelector: {matchLabels: {pod: b}}}, {ipBlock: {cidr: 10.0.3.0/24, except: [10.0.3.3/32]}}]"),
    ("y", "egress-named", "podSelector: {matchExpressions: [{key: pod, operator: NotIn, values: [c]}]}\negress:\n- to: [{namespaceSelector: {}, podSelector: {matchLabels: {pod: a}}}]\n  ports: [{port: serve-80-tcp}]"),
    ("z", "deny-all", "podSelector: {}\npolicyTypes: [Ingress, Egress]"),
];

fn world(harness: &mut Harness) {
    harness.upsert(&world_yaml());
    for (ns, name, spec) in POLICIES {
        harness.upsert(&policy(ns, name, spec));
    }
}

#[test]
fn every_event_gives_an_exact_delta_and_matches_a_cold_compile() {
    for local in [None, Some("node-1"), Some("node-2")] {
        let mut h = Harness::new(local);
        world(&mut h);
        h.upsert(&pod_yaml("x", "b", &[("pod2", "new")]));
        h.upsert(&pod_yaml("y", "a", &[("pod", "c")]));
        h.upsert(&namespace_yaml("y", &[("ns", "changed")]));
        h.upsert(&namespace_yaml("y", &[]));
        h.upsert(&policy(
            "x",
            "from-b",
            "podSelector: {matchLabels: {pod: c}}\ningress: []",
        ));
        h.delete(&ObjectRef::new(Kind::Pod, Some("z"), "a"));
        h.delete(&ObjectRef::new(Kind::Namespace, None, "y"));
        h.upsert(&pod_yaml("z", "a", &[]));
        h.delete(&ObjectRef::new(
            Kind::NetworkPolicy,
            Some("y"),
            "egress-named",
        ));
        h.delete(&ObjectRef::new(
            Kind::NetworkPolicy,
            Some("x"),
            "nonexistent",
        ));
        for key in h.object_keys() {
            h.delete(&key);
        }
        assert!(h.engine.desired().sets.is_empty());
        assert!(h.engine.desired().endpoints.is_empty());
    }
}

#[test]
fn a_pod_label_change_touches_only_that_pod() {
    let mut h = Harness::new(None);
    world(&mut h);
    let delta = h.upsert(&pod_yaml("x", "c", &[("extra", "label")]));
    assert!(
        delta.is_empty(),
        "an unselected label changes nothing: {delta:?}"
    );
    let delta = h.upsert(&pod_yaml("x", "c", &[("pod", "b")]));
    let changed: Vec<&str> = delta
        .endpoints_changed
        .iter()
        .map(|c| c.pod.as_str())
        .collect();
    assert_eq!(
        changed,
        Vec::<&str>::new(),
        "x/c's own rules do not depend on its labels here"
    );
    assert!(delta.endpoints_added.is_empty() && delta.endpoints_removed.is_empty());
    assert!(delta.sets_added.is_empty() && delta.sets_removed.is_empty());
    let members: Vec<String> = delta
        .members_added
        .iter()
        .map(|(_, m)| m.net.to_string())
        .collect();
    assert_eq!(
        members,
        ["10.0.1.3/32", "fd00::1:3/128"],
        "x/c joins the pod=b set"
    );
    // x/a now selects x/c as a peer; no other endpoint was recompiled.
    let v = verdict(
        h.engine.desired(),
        "x/c",
        "10.0.1.1".parse().unwrap(),
        9999,
        Protocol::Tcp,
    )
    .unwrap();
    assert!(v.allowed);
}

#[test]
fn a_namespace_label_change_updates_members_only() {
    let mut h = Harness::new(None);
    world(&mut h);
    let delta = h.upsert(&namespace_yaml("z", &[("ns", "y")]));
    assert!(delta.endpoints_changed.is_empty() && delta.sets_added.is_empty());
    assert!(!delta.members_added.is_empty());
}

#[test]
fn egress_named_ports_resolve_per_destination_pod() {
    let mut h = Harness::new(None);
    let pod = |name: &str, number: u16| {
        format!("apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: s, labels: {{app: web}}}}\nspec: {{containers: [{{name: c, ports: [{{name: http, containerPort: {number}}}]}}]}}\nstatus: {{podIP: 10.9.0.{}}}\n", number % 250)
    };
    h.upsert(&pod("d", 8080));
    h.upsert(&pod("e", 9090));
    h.upsert(&pod_yaml("x", "a", &[]));
    h.upsert(&policy("x", "to-http", "podSelector: {}\npolicyTypes: [Egress]\negress:\n- to: [{namespaceSelector: {}, podSelector: {matchLabels: {app: web}}}]\n  ports: [{port: http}]"));
    let allowed = |h: &Harness, to: &str, port: u16| {
        let to: IpAddr = to.parse().unwrap();
        verdict(h.engine.desired(), "x/a", to, port, Protocol::Tcp)
            .unwrap()
            .allowed
    };
    let (d, e) = ("10.9.0.80", "10.9.0.90");
    assert!(allowed(&h, d, 8080) && allowed(&h, e, 9090));
    assert!(
        !allowed(&h, d, 9090) && !allowed(&h, e, 8080),
        "a number valid on one pod is not valid on the other"
    );
    let rules = &h.engine.desired().endpoints["x/a"].egress.rules;
    let ports: Vec<Ports> = rules.iter().map(|r| r.ports).collect();
    assert_eq!(ports.len(), 2, "{rules:?}");
    assert!(rules.iter().all(|r| matches!(r.peer, Peer::Set(_))));

    // A pod with a new number for the name adds a set and a rule.
    let delta = h.upsert(&pod("f", 7070));
    assert_eq!(delta.sets_added.len(), 1, "{delta:?}");
    assert_eq!(delta.endpoints_changed.len(), 1);
    assert!(allowed(&h, "10.9.0.70", 7070));
    // Its removal takes them away again.
    let delta = h.delete(&ObjectRef::new(Kind::Pod, Some("s"), "f"));
    assert_eq!(delta.sets_removed.len(), 1);
    // A second pod with an existing number only joins that number's set.
    let delta = h.upsert(&pod("g", 8080).replace("10.9.0.80", "10.9.0.81"));
    assert!(delta.sets_added.is_empty() && delta.endpoints_changed.is_empty());
    assert_eq!(delta.members_added.len(), 1);
}

#[test]
fn identical_peers_share_one_set_until_the_last_user_goes() {
    let mut h = Harness::new(None);
    h.upsert(&world_yaml());
    let spec = "podSelector: {}\ningress:\n- from: [{podSelector: {matchLabels: {pod: b}}}]";
    h.upsert(&policy("x", "one", spec));
    h.upsert(&policy("x", "two", spec));
    assert_eq!(h.engine.desired().sets.len(), 1);
    h.delete(&ObjectRef::new(Kind::NetworkPolicy, Some("x"), "one"));
    assert_eq!(h.engine.desired().sets.len(), 1);
    // The same selector in another namespace selects other pods: another set.
    h.upsert(&policy("y", "three", spec));
    assert_eq!(h.engine.desired().sets.len(), 2);
    let delta = h.delete(&ObjectRef::new(Kind::NetworkPolicy, Some("x"), "two"));
    assert_eq!(delta.sets_removed.len(), 1);
}

#[test]
fn a_named_port_to_any_peer_and_to_every_namespace_share_one_set() {
    // Both select every pod: one definition, one set (found by the property test: two
    // spellings of the same selection once collided on one id).
    let mut h = Harness::new(None);
    h.upsert(&world_yaml());
    h.upsert(&policy(
        "x",
        "any",
        "podSelector: {}\npolicyTypes: [Egress]\negress:\n- ports: [{port: serve-80-tcp}]",
    ));
    h.upsert(&policy("x", "all-ns", "podSelector: {}\npolicyTypes: [Egress]\negress:\n- to: [{namespaceSelector: {}}]\n  ports: [{port: serve-80-tcp}]"));
    let definitions: Vec<&str> = h
        .engine
        .desired()
        .sets
        .values()
        .map(|s| s.definition.as_str())
        .collect();
    assert_eq!(
        definitions,
        ["pods(namespaces={}; pods={}) port(serve-80-tcp/TCP=80)"]
    );
    h.delete(&ObjectRef::new(Kind::NetworkPolicy, Some("x"), "any"));
    assert_eq!(h.engine.desired().sets.len(), 1);
}
