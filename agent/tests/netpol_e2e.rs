//! One test per upstream Kubernetes e2e netpol scenario (test/e2e/network/netpol), run
//! against the compiled model on the x/y/z × a/b/c world with weir's verdict evaluator.

mod support;

use support::{check, engine_with, namespace_yaml, objects, pod_yaml, policy, Reachability};
use weir::model::{Kind, ObjectRef};
use weir::policy::desired::Protocol::{self, Sctp, Tcp, Udp};

fn deny(to: &str) -> Reachability {
    let mut r = Reachability::all(true);
    r.expect("*", to, false);
    r
}

const ALL_PROTOCOLS: [Protocol; 3] = [Tcp, Udp, Sctp];

#[test]
fn default_deny_ingress() {
    let e = engine_with(&policy(
        "x",
        "deny-ingress",
        "podSelector: {}\npolicyTypes: [Ingress]",
    ));
    for proto in ALL_PROTOCOLS {
        check(&e, 80, proto, &deny("x/*"));
        check(&e, 81, proto, &deny("x/*"));
    }
}

#[test]
fn default_deny_all() {
    let e = engine_with(&policy(
        "x",
        "deny-all",
        "podSelector: {}\npolicyTypes: [Ingress, Egress]",
    ));
    let mut expected = deny("x/*");
    expected.expect("x/*", "*", false);
    check(&e, 80, Tcp, &expected);
    check(&e, 81, Udp, &expected);
}

#[test]
fn allow_from_pods_within_server_namespace_by_pod_selector() {
    let e = engine_with(&policy("x", "allow-b", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{podSelector: {matchLabels: {pod: b}}}]"));
    let mut expected = deny("x/a");
    expected.expect("x/b", "x/a", true);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn allow_ingress_for_a_target() {
    let e = engine_with(&[
        policy("x", "deny-all", "podSelector: {}\npolicyTypes: [Ingress]"),
        policy("x", "allow-all-to-a", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{podSelector: {}, namespaceSelector: {}}]"),
    ].join("---\n"));
    let mut expected = deny("x/b");
    expected.expect("*", "x/c", false);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn allow_ingress_from_pods_in_all_namespaces() {
    let e = engine_with(&policy(
        "x",
        "allow-all-ns",
        "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{namespaceSelector: {}}]",
    ));
    check(&e, 80, Tcp, &Reachability::all(true));
}

#[test]
fn allow_only_from_a_different_namespace_by_namespace_selector() {
    let e = engine_with(&policy("x", "allow-y", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{namespaceSelector: {matchLabels: {ns: y}}}]"));
    let mut expected = deny("x/a");
    expected.expect("y/*", "x/a", true);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn pod_selector_with_match_expressions() {
    let e = engine_with(&policy("x", "expr", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{podSelector: {matchExpressions: [{key: pod, operator: In, values: [b]}]}}]"));
    let mut expected = deny("x/a");
    expected.expect("x/b", "x/a", true);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn namespace_selector_with_match_expressions() {
    let e = engine_with(&policy("x", "expr", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{namespaceSelector: {matchExpressions: [{key: ns, operator: In, values: [y]}]}}]"));
    let mut expected = deny("x/a");
    expected.expect("y/*", "x/a", true);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn pod_selector_or_namespace_selector() {
    let e = engine_with(&policy("x", "or", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from:\n  - namespaceSelector: {matchExpressions: [{key: ns, operator: NotIn, values: [x]}]}\n  - podSelector: {matchLabels: {pod: b}}"));
    let mut expected = deny("x/a");
    expected
        .expect("y/*", "x/a", true)
        .expect("z/*", "x/a", true)
        .expect("x/b", "x/a", true);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn pod_selector_and_namespace_selector() {
    let e = engine_with(&policy("x", "and", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from:\n  - namespaceSelector: {matchExpressions: [{key: ns, operator: NotIn, values: [x]}]}\n    podSelector: {matchLabels: {pod: b}}"));
    let mut expected = deny("x/a");
    expected
        .expect("y/b", "x/a", true)
        .expect("z/b", "x/a", true);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn multiple_pod_selectors_and_namespace_selectors() {
    let e = engine_with(&policy("x", "multi", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from:\n  - namespaceSelector: {matchExpressions: [{key: ns, operator: NotIn, values: [x]}]}\n    podSelector: {matchExpressions: [{key: pod, operator: In, values: [b, c]}]}"));
    let mut expected = deny("x/a");
    for from in ["y/b", "y/c", "z/b", "z/c"] {
        expected.expect(from, "x/a", true);
    }
    check(&e, 80, Tcp, &expected);
}

#[test]
fn any_of_several_pod_selectors() {
    let e = engine_with(&policy("x", "any", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{podSelector: {matchLabels: {pod: b}}}, {podSelector: {matchLabels: {pod: c}}}]"));
    let mut expected = deny("x/a");
    expected
        .expect("x/b", "x/a", true)
        .expect("x/c", "x/a", true);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn pod_in_a_different_namespace_by_pod_and_namespace_selector() {
    for proto in ALL_PROTOCOLS {
        let e = engine_with(&policy("x", "y-b", &format!("podSelector: {{matchLabels: {{pod: a}}}}\ningress:\n- from: [{{namespaceSelector: {{matchLabels: {{ns: y}}}}, podSelector: {{matchLabels: {{pod: b}}}}}}]\n  ports: [{{port: 80, protocol: {}}}]", proto.name())));
        let mut expected = deny("x/a");
        expected.expect("y/b", "x/a", true);
        check(&e, 80, proto, &expected);
    }
}

#[test]
fn ports() {
    for proto in ALL_PROTOCOLS {
        let e = engine_with(&policy("x", "port-81", &format!("podSelector: {{matchLabels: {{pod: a}}}}\ningress:\n- from: [{{namespaceSelector: {{matchLabels: {{ns: y}}}}}}]\n  ports: [{{port: 81, protocol: {}}}]", proto.name())));
        check(&e, 80, proto, &deny("x/a"));
        let mut expected = deny("x/a");
        expected.expect("y/*", "x/a", true);
        check(&e, 81, proto, &expected);
    }
}

#[test]
fn multiple_stacked_policies_with_overlapping_pod_selectors() {
    let e = engine_with(&[
        policy("x", "allow-81", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{namespaceSelector: {matchLabels: {ns: y}}}]\n  ports: [{port: 81}]"),
        policy("x", "allow-80", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{namespaceSelector: {matchLabels: {ns: y}}}]\n  ports: [{port: 80}]"),
    ].join("---\n"));
    let mut expected = deny("x/a");
    expected.expect("y/*", "x/a", true);
    check(&e, 80, Tcp, &expected);
    check(&e, 81, Tcp, &expected);
}

#[test]
fn allow_all() {
    let e = engine_with(&policy("x", "allow-all", "podSelector: {}\ningress: [{}]"));
    check(&e, 80, Tcp, &Reachability::all(true));
    check(&e, 81, Sctp, &Reachability::all(true));
}

#[test]
fn ingress_on_one_named_port() {
    let e = engine_with(&policy(
        "x",
        "named",
        "podSelector: {}\ningress:\n- ports: [{port: serve-81-tcp}]",
    ));
    check(&e, 81, Tcp, &Reachability::all(true));
    check(&e, 80, Tcp, &deny("x/*"));
    check(&e, 81, Udp, &deny("x/*"));
}

#[test]
fn ingress_from_namespace_on_one_named_port() {
    let e = engine_with(&policy("x", "named", "podSelector: {}\ningress:\n- from: [{namespaceSelector: {matchLabels: {ns: y}}}]\n  ports: [{port: serve-80-tcp}]"));
    let mut expected = deny("x/*");
    expected.expect("y/*", "x/*", true);
    check(&e, 80, Tcp, &expected);
    check(&e, 81, Tcp, &deny("x/*"));
}

#[test]
fn egress_on_one_named_port() {
    let e = engine_with(&policy("x", "named", "podSelector: {}\npolicyTypes: [Egress]\negress:\n- ports: [{port: serve-80-udp, protocol: UDP}]"));
    check(&e, 80, Udp, &Reachability::all(true));
    let mut expected = Reachability::all(true);
    expected.expect("x/*", "*", false);
    check(&e, 81, Udp, &expected);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn updated_policy_is_enforced() {
    let mut e = engine_with(&policy("x", "mutate", "podSelector: {}\ningress: [{}]"));
    check(&e, 80, Tcp, &Reachability::all(true));
    for o in objects(&policy("x", "mutate", "podSelector: {}\ningress: []")) {
        e.upsert(o).unwrap();
    }
    check(&e, 80, Tcp, &deny("x/*"));
}

#[test]
fn ingress_from_updated_namespace() {
    let mut e = engine_with(&policy("x", "ns2", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{namespaceSelector: {matchLabels: {ns2: updated}}}]"));
    check(&e, 80, Tcp, &deny("x/a"));
    for o in objects(&namespace_yaml("y", &[("ns2", "updated")])) {
        e.upsert(o).unwrap();
    }
    let mut expected = deny("x/a");
    expected.expect("y/*", "x/a", true);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn ingress_from_updated_pod() {
    let mut e = engine_with(&policy("x", "pod2", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{podSelector: {matchLabels: {pod2: updated}}}]"));
    check(&e, 80, Tcp, &deny("x/a"));
    for o in objects(&pod_yaml("x", "b", &[("pod2", "updated")])) {
        e.upsert(o).unwrap();
    }
    let mut expected = deny("x/a");
    expected.expect("x/b", "x/a", true);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn deny_ingress_from_pods_in_other_namespaces() {
    let e = engine_with(&policy(
        "x",
        "same-ns",
        "podSelector: {}\ningress:\n- from: [{podSelector: {}}]",
    ));
    let mut expected = deny("x/*");
    expected.expect("x/*", "x/*", true);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn deny_ingress_to_updated_pod() {
    let mut e = engine_with(&policy(
        "x",
        "isolate",
        "podSelector: {matchLabels: {target: isolated}}\npolicyTypes: [Ingress]",
    ));
    check(&e, 80, Tcp, &Reachability::all(true));
    for o in objects(&pod_yaml("x", "a", &[("target", "isolated")])) {
        e.upsert(o).unwrap();
    }
    check(&e, 80, Tcp, &deny("x/a"));
}

#[test]
fn deny_egress_by_pod_selector() {
    let e = engine_with(&policy(
        "x",
        "deny-egress-a",
        "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Egress]",
    ));
    let mut expected = Reachability::all(true);
    expected.expect("x/a", "*", false);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn deny_egress_from_all_pods_in_a_namespace() {
    let e = engine_with(&policy(
        "x",
        "deny-egress",
        "podSelector: {}\npolicyTypes: [Egress]\negress: []",
    ));
    let mut expected = Reachability::all(true);
    expected.expect("x/*", "*", false);
    check(&e, 80, Tcp, &expected);
    check(&e, 81, Sctp, &expected);
}

#[test]
fn ingress_and_egress_specified_together() {
    let e = engine_with(&policy("x", "both", "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Ingress, Egress]\ningress:\n- from: [{podSelector: {matchLabels: {pod: b}}}]\negress:\n- ports: [{port: 80}]"));
    let mut expected = deny("x/a");
    expected.expect("x/b", "x/a", true);
    check(&e, 80, Tcp, &expected);
    expected.expect("x/a", "*", false);
    check(&e, 81, Tcp, &expected);
}

#[test]
fn egress_denied_on_the_client_even_when_the_server_allows() {
    let e = engine_with(&[
        policy("x", "deny-egress-a", "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Egress]\negress: []"),
        policy("y", "allow-x-a", "podSelector: {matchLabels: {pod: b}}\ningress:\n- from: [{namespaceSelector: {matchLabels: {ns: x}}, podSelector: {matchLabels: {pod: a}}}]"),
    ].join("---\n"));
    let mut expected = deny("y/b");
    expected.expect("x/a", "*", false);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn egress_to_a_server_in_a_different_namespace_by_pod_and_namespace_selector() {
    let e = engine_with(&policy("x", "to-y-b", "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Egress]\negress:\n- to: [{namespaceSelector: {matchLabels: {ns: y}}, podSelector: {matchLabels: {pod: b}}}]"));
    let mut expected = Reachability::all(true);
    expected
        .expect("x/a", "*", false)
        .expect("x/a", "y/b", true);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn ingress_any_port_on_a_specific_protocol() {
    let e = engine_with(&policy(
        "x",
        "udp-any",
        "podSelector: {matchLabels: {pod: a}}\ningress:\n- ports: [{protocol: UDP}]",
    ));
    check(&e, 80, Udp, &Reachability::all(true));
    check(&e, 81, Udp, &Reachability::all(true));
    check(&e, 80, Tcp, &deny("x/a"));
    check(&e, 80, Sctp, &deny("x/a"));
}

#[test]
fn multiple_ingress_policies_with_allow_all_taking_precedence() {
    let mut e = engine_with(&policy(
        "x",
        "allow-80",
        "podSelector: {matchLabels: {pod: a}}\ningress:\n- ports: [{port: 80}]",
    ));
    check(&e, 80, Tcp, &Reachability::all(true));
    check(&e, 81, Tcp, &deny("x/a"));
    for o in objects(&policy(
        "x",
        "allow-all",
        "podSelector: {matchLabels: {pod: a}}\ningress: [{}]",
    )) {
        e.upsert(o).unwrap();
    }
    check(&e, 81, Tcp, &Reachability::all(true));
}

#[test]
fn multiple_egress_policies_with_allow_all_taking_precedence() {
    let mut e = engine_with(&policy("x", "allow-80", "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Egress]\negress:\n- ports: [{port: 80}]"));
    let mut expected = Reachability::all(true);
    expected.expect("x/a", "*", false);
    check(&e, 80, Tcp, &Reachability::all(true));
    check(&e, 81, Tcp, &expected);
    for o in objects(&policy(
        "x",
        "allow-all",
        "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Egress]\negress: [{}]",
    )) {
        e.upsert(o).unwrap();
    }
    check(&e, 81, Tcp, &Reachability::all(true));
}

#[test]
fn policies_stop_being_enforced_after_deletion() {
    let mut e = engine_with(&policy(
        "x",
        "deny-all",
        "podSelector: {}\npolicyTypes: [Ingress, Egress]",
    ));
    let mut expected = deny("x/*");
    expected.expect("x/*", "*", false);
    check(&e, 80, Tcp, &expected);
    e.delete(&ObjectRef::new(Kind::NetworkPolicy, Some("x"), "deny-all"))
        .unwrap();
    check(&e, 80, Tcp, &Reachability::all(true));
    assert!(e.desired().sets.is_empty());
}

#[test]
fn egress_to_a_server_in_a_cidr_block() {
    let e = engine_with(&policy("x", "cidr", "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Egress]\negress:\n- to: [{ipBlock: {cidr: 10.0.2.2/32}}, {ipBlock: {cidr: \"fd00::2:2/128\"}}]"));
    let mut expected = Reachability::all(true);
    expected
        .expect("x/a", "*", false)
        .expect("x/a", "y/b", true);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn egress_cidr_except_clause() {
    let e = engine_with(&policy("x", "except", "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Egress]\negress:\n- to:\n  - ipBlock: {cidr: 10.0.0.0/16, except: [10.0.2.2/32]}\n  - ipBlock: {cidr: \"fd00::/64\", except: [\"fd00::2:2/128\"]}"));
    let mut expected = Reachability::all(true);
    expected.expect("x/a", "y/b", false);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn address_in_both_a_cidr_and_another_rules_except_is_allowed() {
    let e = engine_with(&[
        policy("x", "except-b", "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Egress]\negress:\n- to:\n  - ipBlock: {cidr: 10.0.0.0/16, except: [10.0.2.2/32]}\n  - ipBlock: {cidr: \"fd00::/64\", except: [\"fd00::2:2/128\"]}"),
        policy("x", "allow-b", "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Egress]\negress:\n- to: [{ipBlock: {cidr: 10.0.2.2/32}}, {ipBlock: {cidr: \"fd00::2:2/128\"}}]"),
    ].join("---\n"));
    check(&e, 80, Tcp, &Reachability::all(true));
}

#[test]
fn ingress_and_egress_controlled_independently() {
    let e = engine_with(
        &[
            policy(
                "x",
                "deny-ingress-a",
                "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Ingress]",
            ),
            policy(
                "x",
                "allow-egress-a",
                "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Egress]\negress: [{}]",
            ),
        ]
        .join("---\n"),
    );
    check(&e, 80, Tcp, &deny("x/a"));
}

#[test]
fn sctp_is_not_treated_as_tcp() {
    let e = engine_with(&policy(
        "x",
        "sctp",
        "podSelector: {}\ningress:\n- ports: [{protocol: SCTP, port: 80}]",
    ));
    check(&e, 80, Sctp, &Reachability::all(true));
    check(&e, 80, Tcp, &deny("x/*"));
    check(&e, 80, Udp, &deny("x/*"));
}

#[test]
fn policy_allowing_sctp_isolates_its_pods() {
    let e = engine_with(&policy(
        "x",
        "sctp",
        "podSelector: {matchLabels: {pod: a}}\ningress:\n- ports: [{protocol: SCTP, port: 81}]",
    ));
    check(&e, 81, Sctp, &Reachability::all(true));
    check(&e, 80, Sctp, &deny("x/a"));
    check(&e, 81, Tcp, &deny("x/a"));
}

#[test]
fn udp_only_policy_does_not_allow_tcp() {
    let e = engine_with(&policy(
        "x",
        "udp",
        "podSelector: {}\ningress:\n- ports: [{protocol: UDP, port: 81}]",
    ));
    check(&e, 81, Udp, &Reachability::all(true));
    check(&e, 81, Tcp, &deny("x/*"));
}

#[test]
fn namespace_selector_on_the_default_namespace_label() {
    let e = engine_with(&policy("x", "meta", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}}]"));
    let mut expected = deny("x/a");
    expected.expect("y/*", "x/a", true);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn namespace_selector_expressions_on_the_default_namespace_label() {
    let e = engine_with(&policy("x", "meta", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{namespaceSelector: {matchExpressions: [{key: kubernetes.io/metadata.name, operator: NotIn, values: [y]}]}}]"));
    let mut expected = Reachability::all(true);
    expected.expect("y/*", "x/a", false);
    check(&e, 80, Tcp, &expected);
}

#[test]
fn end_port_range() {
    let e = engine_with(&policy("x", "range", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{namespaceSelector: {matchLabels: {ns: y}}}]\n  ports: [{port: 81, endPort: 82}]"));
    let mut expected = deny("x/a");
    expected.expect("y/*", "x/a", true);
    check(&e, 81, Tcp, &expected);
    check(&e, 80, Tcp, &deny("x/a"));
}

#[test]
fn multiple_end_port_ranges() {
    let e = engine_with(&policy("x", "ranges", "podSelector: {matchLabels: {pod: a}}\ningress:\n- ports: [{port: 70, endPort: 80}, {port: 81, endPort: 81, protocol: UDP}]"));
    check(&e, 80, Tcp, &Reachability::all(true));
    check(&e, 81, Tcp, &deny("x/a"));
    check(&e, 81, Udp, &Reachability::all(true));
    check(&e, 80, Udp, &deny("x/a"));
}
