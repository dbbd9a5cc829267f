//! ClusterNetworkPolicy in the engine: validation as the CRD does it, the tiers'
//! evaluation order around NetworkPolicies (modelled on network-policy-api v0.2.0's
//! conformance tests), `nodes` and `networks` peers, named ports, failing closed, and
//! exact incremental deltas.

mod support;

use std::net::IpAddr;

use support::{cluster_policy, namespace_yaml, objects, pod_yaml, policy, world_yaml, Harness};
use weir_policy::desired::{Action, Protocol, Tier};
use weir_policy::model::{Kind, Object, ObjectRef};
use weir_policy::{verdict, Engine, Verdict};

/// The world (namespaces x, y, z; pods a, b, c at 10.0.<ns>.<pod>) and `extra`.
fn engine(extra: Vec<Object>) -> Engine {
    let mut engine = Engine::new(None);
    for object in objects(&world_yaml()).into_iter().chain(extra) {
        engine
            .upsert(object)
            .unwrap_or_else(|e| panic!("rejected: {e}"));
    }
    engine
}

fn check(e: &Engine, from: &str, to: &str, port: u16, proto: Protocol) -> Verdict {
    let to: IpAddr = to.parse().unwrap();
    verdict(e.desired(), from, to, port, proto).unwrap()
}

fn allowed(e: &Engine, from: &str, to: &str, port: u16, proto: Protocol) -> bool {
    check(e, from, to, port, proto).allowed
}

const TCP: Protocol = Protocol::Tcp;
const UDP: Protocol = Protocol::Udp;
const SCTP: Protocol = Protocol::Sctp;

/// Subject: namespace x. Ingress from namespace y: rules in the order given, each
/// `(action, protocols)`.
fn ingress_from_y(name: &str, tier: &str, priority: u16, rules: &[(&str, &str)]) -> Object {
    let mut spec = format!(
        "tier: {tier}\npriority: {priority}\nsubject: {{namespaces: {{matchLabels: {{ns: x}}}}}}\ningress:\n"
    );
    for (i, (action, protocols)) in rules.iter().enumerate() {
        spec.push_str(&format!(
            "- name: r{i}\n  action: {action}\n  from: [{{namespaces: {{matchLabels: {{ns: y}}}}}}]\n"
        ));
        if !protocols.is_empty() {
            spec.push_str(&format!("  protocols: {protocols}\n"));
        }
    }
    cluster_policy(name, &spec)
}

#[test]
fn the_first_matching_rule_of_a_tier_decides() {
    let tcp80 = "[{tcp: {destinationPort: {number: 80}}}]";
    // Conformance CNPAdminTierIngressTCP's shape: Accept, Deny, Pass for all of y, then
    // a port Deny, a port Pass.
    for (rules, expect_80, expect_81) in [
        (vec![("Accept", ""), ("Deny", ""), ("Pass", "")], true, true),
        (
            vec![("Deny", ""), ("Accept", ""), ("Pass", "")],
            false,
            false,
        ),
        // Pass first: no NetworkPolicy and no Baseline, so the default allows.
        (vec![("Pass", ""), ("Deny", ""), ("Accept", "")], true, true),
        (vec![("Deny", tcp80), ("Pass", tcp80)], false, true),
        (vec![("Pass", tcp80), ("Deny", tcp80)], true, true),
        // A rule for another port does not match; nothing else does: allowed.
        (
            vec![("Deny", "[{udp: {destinationPort: {number: 80}}}]")],
            true,
            true,
        ),
    ] {
        let e = engine(vec![ingress_from_y("admin", "Admin", 3, &rules)]);
        assert_eq!(
            allowed(&e, "y/a", "10.0.1.1", 80, TCP),
            expect_80,
            "{rules:?}"
        );
        assert_eq!(
            allowed(&e, "y/a", "10.0.1.1", 81, TCP),
            expect_81,
            "{rules:?}"
        );
        // Only namespace y is a peer: z is untouched.
        assert!(allowed(&e, "z/a", "10.0.1.1", 80, TCP), "{rules:?}");
    }
}

#[test]
fn port_ranges_and_protocols() {
    let e = engine(vec![ingress_from_y(
        "ranges",
        "Admin",
        1,
        &[
            ("Accept", "[{sctp: {destinationPort: {number: 9003}}}, {udp: {destinationPort: {range: {start: 50, end: 60}}}}]"),
            ("Deny", ""),
        ],
    )]);
    assert!(allowed(&e, "y/a", "10.0.1.1", 9003, SCTP));
    assert!(!allowed(&e, "y/a", "10.0.1.1", 9005, SCTP));
    assert!(allowed(&e, "y/a", "10.0.1.1", 50, UDP));
    assert!(allowed(&e, "y/a", "10.0.1.1", 60, UDP));
    assert!(!allowed(&e, "y/a", "10.0.1.1", 61, UDP));
    assert!(!allowed(&e, "y/a", "10.0.1.1", 55, TCP));
}

/// Conformance CNPAdminTierIntegration: Admin Deny beats a NetworkPolicy's allow; an
/// Admin Pass hands the decision to the NetworkPolicy; without one, to the Baseline.
#[test]
fn admin_then_network_policy_then_baseline() {
    let np = objects(&policy(
        "x",
        "allow-from-y",
        "podSelector: {}\npolicyTypes: [Ingress, Egress]\ningress: [{from: [{namespaceSelector: {matchLabels: {ns: y}}}]}]\negress: [{to: [{namespaceSelector: {matchLabels: {ns: y}}}]}]",
    ));
    let baseline = || ingress_from_y("default", "Baseline", 10, &[("Deny", "")]);
    let mut h = Harness::new(None);
    h.upsert(&world_yaml());
    for o in np.clone() {
        h.upsert_object(o).unwrap();
    }
    h.upsert_object(baseline()).unwrap();
    h.upsert_object(ingress_from_y("pass-example", "Admin", 10, &[("Deny", "")]))
        .unwrap();
    let v = check(&h.engine, "y/a", "10.0.1.1", 80, TCP);
    assert!(!v.allowed);
    let decided = v.ingress.decided_by.as_ref().unwrap();
    assert_eq!(
        (decided.tier, decided.rule.action),
        (Tier::Admin, Action::Deny)
    );
    assert_eq!(decided.rule.origin.policy, "pass-example");
    assert_eq!(decided.rule.origin.rule_name.as_deref(), Some("r0"));

    // Admin Pass: the NetworkPolicy allows, and the Baseline Deny is not reached.
    h.upsert_object(ingress_from_y("pass-example", "Admin", 10, &[("Pass", "")]))
        .unwrap();
    let v = check(&h.engine, "y/a", "10.0.1.1", 80, TCP);
    assert!(v.allowed);
    assert_eq!(v.ingress.decided_by, None);
    assert_eq!(v.ingress.passed_by.len(), 1);
    assert!(v.ingress.isolated);

    // No NetworkPolicy: the Baseline Deny decides.
    h.delete(&ObjectRef::new(
        Kind::NetworkPolicy,
        Some("x"),
        "allow-from-y",
    ));
    let v = check(&h.engine, "y/a", "10.0.1.1", 80, TCP);
    assert!(!v.allowed);
    let decided = v.ingress.decided_by.unwrap();
    assert_eq!(
        (decided.tier, decided.rule.action),
        (Tier::Baseline, Action::Deny)
    );

    // A NetworkPolicy that isolates but does not allow: it decides (denied), Baseline
    // Accept is never reached.
    h.upsert(&policy("x", "deny-all", "podSelector: {}"));
    h.upsert_object(ingress_from_y("default", "Baseline", 10, &[("Accept", "")]))
        .unwrap();
    let v = check(&h.engine, "y/a", "10.0.1.1", 80, TCP);
    assert!(!v.allowed);
    assert_eq!(v.ingress.decided_by, None);
}

/// Conformance CNPAdminTierPriorityField: a lower priority is evaluated first, and a
/// priority change is re-evaluated. Equal priorities go by name.
#[test]
fn priority_then_name_orders_policies() {
    let mut h = Harness::new(None);
    h.upsert(&world_yaml());
    h.upsert_object(ingress_from_y("priority-50", "Admin", 50, &[("Deny", "")]))
        .unwrap();
    h.upsert_object(ingress_from_y("priority-60", "Admin", 60, &[("Pass", "")]))
        .unwrap();
    h.upsert_object(ingress_from_y("default", "Baseline", 10, &[("Accept", "")]))
        .unwrap();
    assert!(!allowed(&h.engine, "y/a", "10.0.1.1", 80, TCP));
    h.upsert_object(ingress_from_y("priority-60", "Admin", 40, &[("Pass", "")]))
        .unwrap();
    let v = check(&h.engine, "y/a", "10.0.1.1", 80, TCP);
    assert!(v.allowed);
    assert_eq!(v.ingress.passed_by[0].rule.origin.policy, "priority-60");
    assert_eq!(v.ingress.decided_by.unwrap().tier, Tier::Baseline);

    // Same priority: "a-deny" sorts before "b-accept".
    let e = engine(vec![
        ingress_from_y("b-accept", "Admin", 5, &[("Accept", "")]),
        ingress_from_y("a-deny", "Admin", 5, &[("Deny", "")]),
    ]);
    assert!(!allowed(&e, "y/a", "10.0.1.1", 80, TCP));
}

#[test]
fn an_egress_accept_still_meets_the_destination_ingress() {
    let e = engine(
        [cluster_policy(
            "egress",
            "tier: Admin\npriority: 1\nsubject: {namespaces: {matchLabels: {ns: y}}}\negress:\n- {action: Accept, to: [{namespaces: {}}]}",
        )]
        .into_iter()
        .chain(objects(&policy("x", "deny-all", "podSelector: {}")))
        .collect(),
    );
    let v = check(&e, "y/a", "10.0.1.1", 80, TCP);
    assert!(v.egress.allowed);
    assert!(!v.ingress.allowed);
    assert!(!v.allowed);
}

/// Conformance CNPAdminTierEgressInlineCIDRPeers: `networks: 0.0.0.0/0` also matches
/// pods; a pods Accept before it exempts one namespace, which follows label changes.
#[test]
fn networks_match_pods_too_and_subjects_follow_namespace_labels() {
    let cnp = || {
        cluster_policy(
            "inline-cidr",
            "tier: Admin\npriority: 85\nsubject: {pods: {namespaceSelector: {matchLabels: {ns: x}}, podSelector: {}}}\negress:\n- {action: Accept, to: [{pods: {namespaceSelector: {matchLabels: {house: y}}, podSelector: {}}}]}\n- {action: Deny, to: [{networks: [0.0.0.0/0, '::/0']}]}",
        )
    };
    let mut h = Harness::new(None);
    h.upsert(&world_yaml());
    h.upsert(&namespace_yaml("y", &[("house", "y")]));
    h.upsert_object(cnp()).unwrap();
    assert!(allowed(&h.engine, "x/a", "10.0.2.1", 80, TCP));
    assert!(allowed(&h.engine, "x/a", "fd00::2:1", 80, TCP));
    assert!(!allowed(&h.engine, "x/a", "10.0.3.1", 80, TCP));
    assert!(!allowed(&h.engine, "x/a", "fd00::3:1", 80, TCP));
    assert!(!allowed(&h.engine, "x/a", "192.0.2.1", 443, TCP));
    // z is no subject.
    assert!(allowed(&h.engine, "z/a", "10.0.3.1", 80, TCP));
    // The peer namespace loses its label: denied; the subject's namespace loses
    // its label: no longer a subject.
    h.upsert(&namespace_yaml("y", &[]));
    assert!(!allowed(&h.engine, "x/a", "10.0.2.1", 80, TCP));
    h.upsert(&namespace_yaml("x", &[("ns", "renamed")]));
    assert!(allowed(&h.engine, "x/a", "10.0.2.1", 80, TCP));
    h.upsert(&namespace_yaml("x", &[]));
    assert!(!allowed(&h.engine, "x/a", "10.0.2.1", 80, TCP));
    h.delete(&ObjectRef::new(
        Kind::ClusterNetworkPolicy,
        None,
        "inline-cidr",
    ));
    assert!(allowed(&h.engine, "x/a", "10.0.2.1", 80, TCP));
    assert!(h.engine.desired().sets.is_empty());
}

/// Conformance CNPAdminTier{Egress,Ingress}NamedPort: the name resolves on the
/// destination pod, with the protocol its containerPort has.
#[test]
fn named_ports_resolve_on_the_destination() {
    let e = engine(vec![
        cluster_policy(
            "egress-named",
            "tier: Admin\npriority: 6\nsubject: {namespaces: {matchLabels: {ns: x}}}\negress:\n- {action: Accept, to: [{namespaces: {matchLabels: {ns: y}}}], protocols: [{destinationNamedPort: serve-80-udp}]}\n- {action: Deny, to: [{namespaces: {matchLabels: {ns: y}}}]}",
        ),
        cluster_policy(
            "ingress-named",
            "tier: Baseline\npriority: 6\nsubject: {namespaces: {matchLabels: {ns: z}}}\ningress:\n- {action: Accept, from: [{namespaces: {matchLabels: {ns: y}}}], protocols: [{destinationNamedPort: serve-81-tcp}]}\n- {action: Deny, from: [{namespaces: {matchLabels: {ns: y}}}]}",
        ),
    ]);
    assert!(allowed(&e, "x/a", "10.0.2.1", 80, UDP));
    assert!(!allowed(&e, "x/a", "10.0.2.1", 80, TCP));
    assert!(!allowed(&e, "x/a", "10.0.2.1", 81, UDP));
    assert!(allowed(&e, "y/a", "10.0.3.1", 81, TCP));
    assert!(!allowed(&e, "y/a", "10.0.3.1", 81, UDP));
    assert!(!allowed(&e, "y/a", "10.0.3.1", 80, TCP));
}

fn node_yaml(name: &str, os: &str, address: &str) -> String {
    format!("apiVersion: v1\nkind: Node\nmetadata: {{name: {name}, labels: {{kubernetes.io/os: {os}}}}}\nstatus: {{addresses: [{{type: InternalIP, address: \"{address}\"}}, {{type: Hostname, address: {name}}}]}}\n")
}

/// Conformance CNPAdminTierEgressNodePeers: `nodes` matches the selected Nodes'
/// addresses, and follows Node changes.
#[test]
fn node_peers_follow_nodes() {
    let mut h = Harness::new(None);
    h.upsert(&world_yaml());
    h.upsert(&node_yaml("node-1", "linux", "192.168.0.1"));
    h.upsert(&node_yaml("node-2", "windows", "192.168.0.2"));
    h.upsert_object(cluster_policy(
        "nodes",
        "tier: Admin\npriority: 75\nsubject: {pods: {namespaceSelector: {matchLabels: {ns: x}}, podSelector: {}}}\negress:\n- {action: Accept, to: [{nodes: {matchLabels: {kubernetes.io/os: linux}}}], protocols: [{tcp: {destinationPort: {number: 10250}}}]}\n- {action: Pass, to: [{nodes: {matchLabels: {kubernetes.io/os: linux}}}], protocols: [{udp: {destinationPort: {number: 53}}}]}\n- {action: Deny, to: [{nodes: {matchLabels: {kubernetes.io/os: linux}}}, {networks: [0.0.0.0/0]}]}",
    ))
    .unwrap();
    assert!(allowed(&h.engine, "x/a", "192.168.0.1", 10250, TCP));
    assert!(allowed(&h.engine, "x/a", "192.168.0.1", 53, UDP));
    assert!(!allowed(&h.engine, "x/a", "192.168.0.1", 22, TCP));
    assert!(!allowed(&h.engine, "x/a", "192.168.0.2", 10250, TCP));
    h.upsert(&node_yaml("node-2", "linux", "192.168.0.2"));
    assert!(allowed(&h.engine, "x/a", "192.168.0.2", 10250, TCP));
    h.upsert(&node_yaml("node-2", "linux", "192.168.0.3"));
    assert!(!allowed(&h.engine, "x/a", "192.168.0.2", 10250, TCP));
    assert!(allowed(&h.engine, "x/a", "192.168.0.3", 10250, TCP));
    h.delete(&ObjectRef::new(Kind::Node, None, "node-2"));
    assert!(!allowed(&h.engine, "x/a", "192.168.0.3", 10250, TCP));
}

/// A `nodes` peer covers the addresses the agent reads from its own node's interfaces
/// (a bridge's gateway, a link-local one), not only its Node's `status.addresses`; another
/// node's own addresses are not known, and a node the selector leaves out gains nothing.
#[test]
fn node_peers_cover_the_own_nodes_interface_addresses() {
    let mut h = Harness::new(None);
    h.upsert(&world_yaml());
    h.upsert(&node_yaml("node-1", "linux", "192.168.0.1"));
    h.upsert(&node_yaml("node-2", "windows", "192.168.0.2"));
    h.upsert_object(cluster_policy(
        "nodes",
        "tier: Admin\npriority: 75\nsubject: {pods: {namespaceSelector: {matchLabels: {ns: x}}, podSelector: {}}}\negress:\n- {action: Deny, to: [{nodes: {matchLabels: {kubernetes.io/os: linux}}}]}",
    ))
    .unwrap();
    assert!(h.engine.has_node_peers());
    let gateway = "10.244.0.1".parse::<IpAddr>().unwrap();
    let link_local = "fe80::1".parse::<IpAddr>().unwrap();
    assert!(allowed(&h.engine, "x/a", "10.244.0.1", 80, TCP));
    assert!(h
        .engine
        .set_own_addresses("node-1", [gateway, link_local].into()));
    assert!(!allowed(&h.engine, "x/a", "10.244.0.1", 80, TCP));
    assert!(!allowed(&h.engine, "x/a", "fe80::1", 80, TCP));
    assert!(!allowed(&h.engine, "x/a", "192.168.0.1", 80, TCP));
    // The same addresses again change nothing.
    assert!(!h
        .engine
        .set_own_addresses("node-1", [gateway, link_local].into()));
    // Known as node-2's (not selected): not denied.
    h.engine.set_own_addresses("node-2", [gateway].into());
    assert!(allowed(&h.engine, "x/a", "10.244.0.1", 80, TCP));
    assert!(!allowed(&h.engine, "x/a", "192.168.0.1", 80, TCP));
}

/// A peer or protocol with no field weir knows fails closed: an Accept matches nothing,
/// a Deny or Pass denies everything.
#[test]
fn an_unknown_peer_fails_closed() {
    for (action, expect) in [("Accept", false), ("Deny", false), ("Pass", false)] {
        let e = engine(vec![
            cluster_policy(
                "future",
                &format!("tier: Admin\npriority: 1\nsubject: {{namespaces: {{matchLabels: {{ns: x}}}}}}\ningress:\n- {{action: {action}, from: [{{futureField: {{}}}}]}}"),
            ),
            ingress_from_y("default", "Baseline", 1, &[("Deny", "")]),
        ]);
        assert_eq!(allowed(&e, "y/a", "10.0.1.1", 80, TCP), expect, "{action}");
        // Accept matching nothing leaves z allowed; Deny and Pass deny it too.
        assert_eq!(
            allowed(&e, "z/a", "10.0.1.1", 80, TCP),
            action == "Accept",
            "{action}"
        );
    }
    let e = engine(vec![cluster_policy(
        "future-protocol",
        "tier: Admin\npriority: 1\nsubject: {namespaces: {matchLabels: {ns: x}}}\ningress:\n- {action: Pass, from: [{namespaces: {}}], protocols: [{icmp: {}}]}",
    )]);
    let v = check(&e, "y/a", "10.0.1.1", 80, TCP);
    assert!(!v.allowed);
    assert_eq!(v.ingress.decided_by.unwrap().rule.action, Action::Deny);
}

#[test]
fn host_network_pods_are_never_subjects() {
    let host = "apiVersion: v1\nkind: Pod\nmetadata: {name: h, namespace: x}\nspec: {nodeName: node-1, hostNetwork: true}\nstatus: {podIP: 192.168.0.1}\n";
    let e = engine(
        objects(host)
            .into_iter()
            .chain([ingress_from_y("admin", "Admin", 1, &[("Deny", "")])])
            .collect(),
    );
    assert!(!e.desired().endpoints.contains_key("x/h"));
    assert!(!e.desired().endpoints["x/a"].ingress.admin.is_empty());
}

#[test]
fn every_event_gives_an_exact_delta() {
    for local in [None, Some("node-1"), Some("node-2")] {
        let mut h = Harness::new(local);
        h.upsert(&world_yaml());
        h.upsert(&node_yaml("node-1", "linux", "192.168.0.1"));
        h.upsert_object(ingress_from_y(
            "a",
            "Admin",
            1,
            &[
                ("Deny", "[{tcp: {destinationPort: {number: 80}}}]"),
                ("Pass", ""),
            ],
        ))
        .unwrap();
        h.upsert_object(cluster_policy(
            "b",
            "tier: Baseline\npriority: 1\nsubject: {pods: {namespaceSelector: {}, podSelector: {matchLabels: {pod: a}}}}\negress:\n- {action: Deny, to: [{nodes: {}}, {networks: [10.0.3.0/24]}]}\n- {action: Accept, to: [{pods: {namespaceSelector: {}, podSelector: {}}}], protocols: [{destinationNamedPort: serve-81-sctp}]}",
        ))
        .unwrap();
        h.upsert(&policy("y", "deny", "podSelector: {}"));
        h.upsert(&pod_yaml("x", "b", &[("pod", "a")]));
        // A subject pod that moves to another node and back: only the local node's pods
        // are the policies' endpoints, on every change of either.
        let moved = pod_yaml("y", "a", &[]).replace("nodeName: node-1", "nodeName: node-2");
        h.upsert(&moved);
        h.upsert_object(cluster_policy(
            "c",
            "tier: Admin\npriority: 3\nsubject: {namespaces: {}}\ningress:\n- {action: Deny, from: [{namespaces: {matchLabels: {ns: z}}}]}",
        ))
        .unwrap();
        h.upsert(&pod_yaml("y", "a", &[]));
        h.delete(&ObjectRef::new(Kind::ClusterNetworkPolicy, None, "c"));
        h.upsert(&moved);
        h.upsert(&namespace_yaml("x", &[("ns", "other")]));
        h.upsert(&node_yaml("node-1", "linux", "192.168.0.9"));
        h.upsert_object(ingress_from_y("a", "Baseline", 7, &[("Accept", "")]))
            .unwrap();
        h.delete(&ObjectRef::new(Kind::ClusterNetworkPolicy, None, "b"));
        h.delete(&ObjectRef::new(Kind::ClusterNetworkPolicy, None, "unknown"));
        for key in h.object_keys() {
            h.delete(&key);
        }
        assert!(h.engine.desired().sets.is_empty());
        assert!(h.engine.desired().endpoints.is_empty());
    }
}

#[test]
fn refusals_name_the_policy_and_the_field() {
    let base = "tier: Admin\npriority: 1\nsubject: {namespaces: {}}\n";
    for (spec, message) in [
        ("priority: 1\nsubject: {namespaces: {}}", "spec.tier: required"),
        ("tier: Top\npriority: 1\nsubject: {namespaces: {}}", "spec.tier: unsupported value \"Top\": supported values \"Admin\", \"Baseline\""),
        ("tier: Admin\nsubject: {namespaces: {}}", "spec.priority: required"),
        ("tier: Admin\npriority: 1001\nsubject: {namespaces: {}}", "spec.priority: must be between 0 and 1000, inclusive (got 1001)"),
        ("tier: Admin\npriority: 1", "spec.subject: required"),
        ("tier: Admin\npriority: 1\nsubject: {}", "spec.subject: must set exactly one of namespaces, pods"),
        ("tier: Admin\npriority: 1\nsubject: {namespaces: {}, pods: {podSelector: {}}}", "spec.subject: must set exactly one of namespaces, pods (has 2)"),
        ("tier: Admin\npriority: 1\nsubject: {pods: {namespaceSelector: {}}}", "spec.subject.pods.podSelector: required"),
        (&format!("{base}ingress: [{{action: Allow, from: [{{namespaces: {{}}}}]}}]"), "spec.ingress[0].action: unsupported value \"Allow\": supported values \"Accept\", \"Deny\", \"Pass\""),
        (&format!("{base}ingress: [{{action: Deny}}]"), "spec.ingress[0].from: required"),
        (&format!("{base}egress: [{{action: Deny, to: []}}]"), "spec.egress[0].to: must have at least 1 item"),
        (&format!("{base}ingress: [{{action: Deny, from: [{{networks: [10.0.0.0/8]}}]}}]"), "spec.ingress[0].from[0].networks: not allowed in an ingress peer"),
        (&format!("{base}egress: [{{action: Deny, to: [{{}}]}}]"), "spec.egress[0].to[0]: must set exactly one of namespaces, pods, nodes, networks, domainNames (has 0)"),
        (&format!("{base}egress: [{{action: Deny, to: [{{namespaces: {{}}}}], protocols: [{{}}]}}]"), "spec.egress[0].protocols[0]: must set exactly one of tcp, udp, sctp, destinationNamedPort (has 0)"),
        (&format!("{base}egress: [{{action: Deny, to: [{{networks: [10.0.0.0/33]}}]}}]"), "spec.egress[0].to[0].networks[0]: invalid CIDR \"10.0.0.0/33\""),
        (&format!("{base}egress: [{{action: Deny, to: [{{networks: [10.0.0.0/8, 10.0.0.0/8]}}]}}]"), "spec.egress[0].to[0].networks[1]: duplicate value \"10.0.0.0/8\""),
        (&format!("{base}egress: [{{action: Accept, to: [{{domainNames: [example.com]}}]}}]"), "spec.egress[0].to[0].domainNames: not supported"),
        (&format!("{base}egress: [{{action: Deny, to: [{{nodes: {{}}, networks: [10.0.0.0/8]}}]}}]"), "spec.egress[0].to[0]: must set exactly one of namespaces, pods, nodes, networks, domainNames (has 2)"),
        (&format!("{base}ingress: [{{action: Deny, from: [{{namespaces: {{}}}}], protocols: [{{tcp: {{}}}}]}}]"), "spec.ingress[0].protocols[0].tcp: must have at least 1 property (destinationPort)"),
        (&format!("{base}ingress: [{{action: Deny, from: [{{namespaces: {{}}}}], protocols: [{{tcp: {{destinationPort: {{number: 0}}}}}}]}}]"), "spec.ingress[0].protocols[0].tcp.destinationPort.number: must be between 1 and 65535, inclusive (got 0)"),
        (&format!("{base}ingress: [{{action: Deny, from: [{{namespaces: {{}}}}], protocols: [{{udp: {{destinationPort: {{range: {{start: 80, end: 80}}}}}}}}]}}]"), "spec.ingress[0].protocols[0].udp.destinationPort.range: Start port must be less than End port (start 80, end 80)"),
        (&format!("{base}ingress: [{{action: Deny, from: [{{namespaces: {{}}}}], protocols: []}}]"), "spec.ingress[0].protocols: must have at least 1 item"),
        (&format!("{base}ingress: [{{name: {}, action: Deny, from: [{{namespaces: {{}}}}]}}]", "n".repeat(101)), "spec.ingress[0].name: may not be longer than 100 characters (has 101)"),
        (&format!("{base}ingress: [{{action: Deny, from: [{{namespaces: {{matchLabels: {{'a b': c}}}}}}]}}]"), "spec.ingress[0].from[0].namespaces.matchLabels:"),
    ] {
        let object = cluster_policy("guard", spec);
        let e = Engine::new(None).upsert(object).unwrap_err().to_string();
        let expected = format!("clusternetworkpolicy guard: {message}");
        assert!(e.starts_with(&expected), "{spec}\n got: {e}\nwant: {expected}");
    }
    let rules: String = (0..26)
        .map(|_| "- {action: Deny, from: [{namespaces: {}}]}\n")
        .collect();
    let e = Engine::new(None)
        .upsert(cluster_policy("many", &format!("{base}ingress:\n{rules}")))
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "clusternetworkpolicy many: spec.ingress: must have at most 25 items (has 26)"
    );
}

/// `weir explain` names the tier, policy, priority and rule that decided, and the Pass
/// that handed the decision down.
#[test]
fn explain_names_the_deciding_and_passing_rules() {
    use weir_policy::explain::{explain, PortProtocol, Target};
    let e = engine(vec![
        ingress_from_y("hand-down", "Admin", 10, &[("Pass", "")]),
        ingress_from_y(
            "default",
            "Baseline",
            20,
            &[(
                "Deny",
                "[{tcp: {destinationPort: {range: {start: 80, end: 90}}}}]",
            )],
        ),
    ]);
    let port = PortProtocol {
        port: 80,
        protocol: TCP,
    };
    let x = explain(&e, "y/a", &Target::Pod("x/a".into()), port).unwrap();
    assert!(!x.allowed);
    let decided = x.ingress.decided_by.as_ref().unwrap();
    assert_eq!(
        (decided.tier, decided.action, decided.priority),
        (Tier::Baseline, Action::Deny, 20)
    );
    assert_eq!(decided.rule, "ingress[0]");
    let text = x.to_string();
    assert!(
        text.contains("  ingress of x/a: DENIED\n    passed on by: Admin tier: clusternetworkpolicy hand-down (priority 10) ingress[0] \"r0\": Pass peer pods(namespaces={ns in (y)}; pods={}) on all\n    decided by: Baseline tier: clusternetworkpolicy default (priority 20) ingress[0] \"r0\": Deny peer pods(namespaces={ns in (y)}; pods={}) on TCP/80-90\n"),
        "{text}"
    );
    let json = serde_json::to_value(&x).unwrap();
    assert_eq!(json["ingress"]["decided_by"]["policy"], "default");
    assert_eq!(json["ingress"]["passed_by"][0]["action"], "Pass");
    // Nothing of the tiers where none applies: the JSON stays as it was.
    assert!(json["egress"].get("decided_by").is_none());
    assert!(json["egress"].get("passed_by").is_none());
}
