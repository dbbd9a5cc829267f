//! Table-driven tests of the compiled model for each NetworkPolicy rule that the e2e
//! scenarios do not pin down on their own.

mod support;

use std::net::IpAddr;

use support::{engine_with, objects, pod_yaml, policy, world_yaml};
use weir_policy::desired::{Direction, Peer, PortRange, Ports, Protocol};
use weir_policy::{verdict, Engine, VerdictError};

fn allowed(e: &Engine, from: &str, to: &str, port: u16, proto: Protocol) -> bool {
    let to: IpAddr = to.parse().unwrap();
    verdict(e.desired(), from, to, port, proto).unwrap().allowed
}

#[test]
fn policy_types_defaulting() {
    // (spec, ingress isolated, egress isolated) for x/a
    let cases = [
        ("podSelector: {}", true, false),
        ("podSelector: {}\negress: []", true, false),
        ("podSelector: {}\negress: [{}]", true, true),
        (
            "podSelector: {}\npolicyTypes: [Egress]\ningress: [{}]",
            false,
            true,
        ),
        (
            "podSelector: {}\npolicyTypes: [Ingress]\negress: [{}]",
            true,
            false,
        ),
        (
            "podSelector: {}\npolicyTypes: [Ingress, Egress]",
            true,
            true,
        ),
        ("podSelector: {matchLabels: {pod: b}}", false, false),
    ];
    for (spec, ingress, egress) in cases {
        let e = engine_with(&policy("x", "p", spec));
        let ep = &e.desired().endpoints["x/a"];
        assert_eq!(
            (ep.ingress.isolated, ep.egress.isolated),
            (ingress, egress),
            "{spec}"
        );
    }
}

#[test]
fn ports_compile_to_protocol_and_range() {
    let range = |first, last| Some(PortRange { first, last });
    let cases: &[(&str, Ports)] = &[
        ("", Ports::All),
        ("ports: []", Ports::All),
        (
            "ports: [{port: 80}]",
            Ports::Protocol {
                protocol: Protocol::Tcp,
                range: range(80, 80),
            },
        ),
        (
            "ports: [{protocol: UDP}]",
            Ports::Protocol {
                protocol: Protocol::Udp,
                range: None,
            },
        ),
        (
            "ports: [{protocol: SCTP, port: 81, endPort: 90}]",
            Ports::Protocol {
                protocol: Protocol::Sctp,
                range: range(81, 90),
            },
        ),
        (
            "ports: [{port: serve-81-udp, protocol: UDP}]",
            Ports::Protocol {
                protocol: Protocol::Udp,
                range: range(81, 81),
            },
        ),
    ];
    for (ports, expected) in cases {
        let e = engine_with(&policy("x", "p", &format!("podSelector: {{matchLabels: {{pod: a}}}}\ningress:\n- from: [{{podSelector: {{}}}}]\n  {ports}")));
        let rules: Vec<Ports> = e.desired().endpoints["x/a"]
            .ingress
            .rules
            .iter()
            .map(|r| r.ports)
            .collect();
        assert_eq!(rules, vec![*expected], "{ports}");
    }
}

#[test]
fn unresolved_named_ingress_port_isolates_and_admits_nothing() {
    let e = engine_with(&policy("x", "p", "podSelector: {matchLabels: {pod: a}}\ningress:\n- ports: [{port: no-such-port}, {port: serve-80-tcp, protocol: UDP}]"));
    let ep = &e.desired().endpoints["x/a"];
    assert!(ep.ingress.isolated);
    assert!(ep.ingress.rules.is_empty());
}

#[test]
fn missing_ports_admit_every_protocol() {
    let e = engine_with(&policy("x", "p", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{podSelector: {matchLabels: {pod: b}}}]"));
    for proto in [Protocol::Tcp, Protocol::Udp, Protocol::Sctp] {
        assert!(allowed(&e, "x/b", "10.0.1.1", 1234, proto));
        assert!(!allowed(&e, "x/c", "10.0.1.1", 1234, proto));
    }
}

#[test]
fn ip_block_applies_to_pod_addresses_in_both_directions_and_families() {
    let e = engine_with(&[
        policy("x", "in", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{ipBlock: {cidr: 10.0.2.0/24, except: [10.0.2.3/32]}}, {ipBlock: {cidr: \"fd00::2:0/112\"}}]"),
    ].join("---\n"));
    let cases = [
        ("y/a", "10.0.1.1", true),
        ("y/b", "10.0.1.1", true),
        ("y/c", "10.0.1.1", false),
        ("y/c", "fd00::1:1", true),
        ("z/a", "10.0.1.1", false),
        ("z/a", "fd00::1:1", false),
    ];
    for (from, to, expected) in cases {
        assert_eq!(
            allowed(&e, from, to, 80, Protocol::Tcp),
            expected,
            "{from} -> {to}"
        );
    }
}

#[test]
fn traffic_to_self_is_always_allowed() {
    let e = engine_with(&policy(
        "x",
        "deny",
        "podSelector: {}\npolicyTypes: [Ingress, Egress]",
    ));
    let v = verdict(
        e.desired(),
        "x/a",
        "10.0.1.1".parse().unwrap(),
        80,
        Protocol::Tcp,
    )
    .unwrap();
    assert!(v.allowed && v.to_self);
    assert!(!allowed(&e, "x/a", "10.0.1.2", 80, Protocol::Tcp));
}

#[test]
fn host_network_pods_and_pods_without_addresses_are_never_selected() {
    let mut yaml = world_yaml();
    yaml.push_str("---\napiVersion: v1\nkind: Pod\nmetadata: {name: host, namespace: x, labels: {pod: b}}\nspec: {hostNetwork: true, nodeName: node-1, containers: [{name: c}]}\nstatus: {podIP: 192.168.0.10}\n");
    yaml.push_str("---\napiVersion: v1\nkind: Pod\nmetadata: {name: pending, namespace: x, labels: {pod: b}}\nspec: {containers: [{name: c}]}\n");
    yaml.push_str("---\napiVersion: v1\nkind: Pod\nmetadata: {name: done, namespace: x, labels: {pod: b}}\nspec: {containers: [{name: c}]}\nstatus: {phase: Succeeded, podIP: 10.0.1.99}\n");
    yaml.push_str("---\n");
    yaml.push_str(&policy(
        "x",
        "p",
        "podSelector: {}\ningress:\n- from: [{podSelector: {matchLabels: {pod: b}}}]",
    ));
    let mut e = Engine::new(None);
    let (_, errors) = e.load(objects(&yaml));
    assert!(errors.is_empty(), "{errors:?}");
    let d = e.desired();
    for pod in ["x/host", "x/pending", "x/done"] {
        assert!(
            !d.endpoints.contains_key(pod),
            "{pod} must not be an endpoint"
        );
    }
    let set = d.sets.values().next().unwrap();
    let members: Vec<String> = set.members.iter().map(|m| m.net.to_string()).collect();
    assert_eq!(members, ["10.0.1.2/32", "fd00::1:2/128"]);
    assert!(matches!(
        verdict(d, "x/host", "10.0.1.1".parse().unwrap(), 80, Protocol::Tcp),
        Err(VerdictError::NotAnEndpoint(_))
    ));
}

#[test]
fn only_local_pods_are_endpoints_but_all_pods_are_peers() {
    let mut e = Engine::new(Some("node-2".into()));
    let mut yaml = world_yaml();
    yaml.push_str("---\n");
    yaml.push_str(&pod_yaml("x", "c", &[]).replace("node-1", "node-2"));
    yaml.push_str("---\n");
    yaml.push_str(&policy(
        "x",
        "p",
        "podSelector: {}\ningress:\n- from: [{podSelector: {matchLabels: {pod: b}}}]",
    ));
    e.load(objects(&yaml));
    let d = e.desired();
    assert_eq!(d.endpoints.keys().collect::<Vec<_>>(), ["x/c"]);
    assert_eq!(
        d.sets.values().next().unwrap().members.len(),
        2,
        "x/b (on node-1) is a peer"
    );
}

#[test]
fn ipv6_only_pods() {
    let yaml = "apiVersion: v1\nkind: Pod\nmetadata: {name: six, namespace: x, labels: {pod: six}}\nspec: {containers: [{name: c}]}\nstatus: {podIPs: [{ip: \"fd00::99\"}]}\n";
    let mut e = engine_with(yaml);
    for o in objects(&policy("x", "p", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{podSelector: {matchLabels: {pod: six}}}]")) {
        e.upsert(o).unwrap();
    }
    assert!(allowed(&e, "x/six", "fd00::1:1", 80, Protocol::Tcp));
    assert!(!allowed(&e, "x/b", "fd00::1:1", 80, Protocol::Tcp));
    assert!(matches!(
        verdict(
            e.desired(),
            "x/six",
            "10.0.1.1".parse().unwrap(),
            80,
            Protocol::Tcp
        ),
        Err(VerdictError::NoAddressFamily { .. })
    ));
}

#[test]
fn set_definitions_include_namespace_scoping() {
    let spec = "podSelector: {}\ningress:\n- from: [{podSelector: {matchLabels: {pod: b}}}]";
    let e = engine_with(&[policy("x", "p", spec), policy("y", "p", spec), policy("z", "p", "podSelector: {}\ningress:\n- from: [{namespaceSelector: {matchLabels: {ns: z}}, podSelector: {matchLabels: {pod: b}}}]")].join("---\n"));
    let mut definitions: Vec<&str> = e
        .desired()
        .sets
        .values()
        .map(|s| s.definition.as_str())
        .collect();
    definitions.sort();
    assert_eq!(
        definitions,
        [
            "pods(namespace=x; pods={pod in (b)})",
            "pods(namespace=y; pods={pod in (b)})",
            "pods(namespaces={ns in (z)}; pods={pod in (b)})"
        ]
    );
    let ep = &e.desired().endpoints["z/a"];
    assert!(ep
        .direction(Direction::Ingress)
        .rules
        .iter()
        .all(|r| matches!(r.peer, Peer::Set(_))));
}

/// `policy.weir.io/mode: audit` (or `enforce`, or a typo) on policy `name`.
fn with_mode(manifest: String, mode: &str) -> String {
    manifest.replacen(
        "metadata: {",
        &format!("metadata: {{annotations: {{policy.weir.io/mode: {mode}}}, "),
        1,
    )
}

#[test]
fn an_audit_policy_alone_isolates_with_an_audit_rule_that_allows_the_rest() {
    let only_b = "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{podSelector: {matchLabels: {pod: b}}}]\n  ports: [{port: 80}]";
    let e = engine_with(&with_mode(policy("x", "p", only_b), "audit"));
    let ingress = &e.desired().endpoints["x/a"].ingress;
    assert!(ingress.isolated);
    let audit: Vec<_> = ingress
        .rules
        .iter()
        .filter(|r| r.origin.is_audit())
        .collect();
    assert_eq!(audit.len(), 1, "{ingress:?}");
    assert_eq!((audit[0].peer, audit[0].ports), (Peer::Any, Ports::All));
    assert_eq!(audit[0].origin.audited_policies(), ["x/p"]);
    assert!(
        ingress
            .rules
            .iter()
            .any(|r| r.origin.policy == "x/p" && r.origin.rule_index == 0),
        "the audit policy's own rule is compiled: {ingress:?}"
    );
    // Nothing is denied: x/c passes (through the audit rule), x/b through x/p's rule.
    let (a4, _) = support::pod_ips("x", "a");
    for from in ["x/b", "x/c"] {
        assert!(allowed(&e, from, &a4, 80, Protocol::Tcp), "{from}");
        assert!(allowed(&e, from, &a4, 81, Protocol::Tcp), "{from}");
    }
    let explained =
        weir_policy::explain::explain(&e, "x/c", &a4.parse().unwrap(), "81".parse().unwrap())
            .unwrap();
    assert!(explained.allowed);
    assert!(!explained.ingress.isolated);
    assert_eq!(explained.ingress.audit_by, ["x/p"]);
    assert!(explained.ingress.audit_would_deny);
    let text = explained.to_string();
    assert!(text.contains("audit mode: x/p would DENY it"), "{text}");
    let from_b =
        weir_policy::explain::explain(&e, "x/b", &a4.parse().unwrap(), "80".parse().unwrap())
            .unwrap();
    assert!(!from_b.ingress.audit_would_deny);
    assert_eq!(from_b.ingress.allowed_by[0].policy, "x/p");
}

#[test]
fn an_audit_policy_beside_an_enforced_one_changes_nothing() {
    let deny_all = policy(
        "x",
        "deny",
        "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Ingress]",
    );
    let allow_b = "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{podSelector: {matchLabels: {pod: b}}}]";
    let e = engine_with(&format!(
        "{deny_all}---\n{}",
        with_mode(policy("x", "p", allow_b), "audit")
    ));
    let ingress = &e.desired().endpoints["x/a"].ingress;
    assert!(ingress.isolated);
    assert!(
        ingress.rules.is_empty(),
        "neither x/p's rules nor an audit rule: {ingress:?}"
    );
    let (a4, _) = support::pod_ips("x", "a");
    assert!(!allowed(&e, "x/b", &a4, 80, Protocol::Tcp));
}

#[test]
fn an_unknown_mode_enforces_the_policy() {
    for mode in ["enforce", "Audit", "dry-run"] {
        let e = engine_with(&with_mode(
            policy(
                "x",
                "p",
                "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Ingress]",
            ),
            mode,
        ));
        let ingress = &e.desired().endpoints["x/a"].ingress;
        assert!(
            ingress.isolated && ingress.rules.is_empty(),
            "{mode}: {ingress:?}"
        );
    }
}
