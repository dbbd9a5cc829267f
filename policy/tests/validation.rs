//! Validation mirrors the API server: each bad policy is rejected with an error naming
//! the policy and the field, and a rejected object leaves the engine unchanged.

mod support;

use support::{engine_with, objects};
use weir_policy::model::Object;
use weir_policy::{validate, PolicyError};

fn policy(spec: &str) -> Object {
    let spec: String = spec.lines().map(|l| format!("  {l}\n")).collect();
    let yaml = format!("apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: p, namespace: x}}\nspec:\n{spec}");
    objects(&yaml).remove(0)
}

fn error_of(spec: &str) -> String {
    let Object::NetworkPolicy(np) = policy(spec) else {
        unreachable!()
    };
    validate(&np).expect_err(spec).to_string()
}

#[test]
fn invalid_policies_are_rejected_naming_policy_and_field() {
    let cases = [
        ("podSelector: {}\ningress:\n- from: [{ipBlock: {cidr: 10.0.0.0/33}}]", "networkpolicy x/p: spec.ingress[0].from[0].ipBlock.cidr: invalid CIDR \"10.0.0.0/33\""),
        ("podSelector: {}\ningress:\n- from: [{ipBlock: {cidr: banana}}]", "networkpolicy x/p: spec.ingress[0].from[0].ipBlock.cidr: invalid CIDR \"banana\""),
        ("podSelector: {}\negress:\n- to: [{ipBlock: {cidr: 10.0.0.0/16, except: [10.1.0.0/24]}}]", "networkpolicy x/p: spec.egress[0].to[0].ipBlock.except[0]: must be a strict subset of `cidr` (10.0.0.0/16)"),
        ("podSelector: {}\negress:\n- to: [{ipBlock: {cidr: 10.0.0.0/16, except: [10.0.0.0/16]}}]", "networkpolicy x/p: spec.egress[0].to[0].ipBlock.except[0]: must be a strict subset of `cidr` (10.0.0.0/16)"),
        ("podSelector: {}\negress:\n- to: [{ipBlock: {cidr: 10.0.0.0/16, except: [\"fd00::/64\"]}}]", "networkpolicy x/p: spec.egress[0].to[0].ipBlock.except[0]: must be a strict subset of `cidr` (10.0.0.0/16)"),
        ("podSelector: {}\ningress:\n- ports: [{port: 80}, {port: 80, endPort: 79}]", "networkpolicy x/p: spec.ingress[0].ports[1].endPort: must be >= port (80)"),
        ("podSelector: {}\ningress:\n- ports: [{endPort: 90}]", "networkpolicy x/p: spec.ingress[0].ports[0].endPort: may not be specified when `port` is not specified"),
        ("podSelector: {}\ningress:\n- ports: [{port: http, endPort: 90}]", "networkpolicy x/p: spec.ingress[0].ports[0].endPort: may not be specified when `port` is non-numeric"),
        ("podSelector: {}\ningress:\n- ports: [{port: 80, endPort: 70000}]", "networkpolicy x/p: spec.ingress[0].ports[0].endPort: must be between 1 and 65535, inclusive (got 70000)"),
        ("podSelector: {}\ningress:\n- ports: [{port: 0}]", "networkpolicy x/p: spec.ingress[0].ports[0].port: must be between 1 and 65535, inclusive (got 0)"),
        ("podSelector: {}\ningress:\n- ports: [{port: \"80\"}]", "networkpolicy x/p: spec.ingress[0].ports[0].port: invalid port name \"80\""),
        ("podSelector: {}\ningress:\n- ports: [{protocol: ICMP}]", "networkpolicy x/p: spec.ingress[0].ports[0].protocol: unsupported value \"ICMP\""),
        ("podSelector: {}\ningress:\n- ports: [{protocol: tcp}]", "networkpolicy x/p: spec.ingress[0].ports[0].protocol: unsupported value \"tcp\""),
        ("podSelector: {matchExpressions: [{key: a, operator: Equals, values: [b]}]}", "networkpolicy x/p: spec.podSelector.matchExpressions[0].operator: unsupported value \"Equals\""),
        ("podSelector: {matchExpressions: [{key: a, operator: In}]}", "networkpolicy x/p: spec.podSelector.matchExpressions[0].values: must be specified when `operator` is 'In' or 'NotIn'"),
        ("podSelector: {matchLabels: {\"bad key!\": b}}", "networkpolicy x/p: spec.podSelector.matchLabels: invalid label key \"bad key!\""),
        ("podSelector: {}\ningress:\n- from: [{namespaceSelector: {matchExpressions: [{key: a, operator: Exists, values: [b]}]}}]", "networkpolicy x/p: spec.ingress[0].from[0].namespaceSelector.matchExpressions[0].values: may not be specified when `operator` is 'Exists' or 'DoesNotExist'"),
        ("podSelector: {}\ningress:\n- from: [{}]", "networkpolicy x/p: spec.ingress[0].from[0]: must specify a peer"),
        ("podSelector: {}\ningress:\n- from: [{podSelector: {}, ipBlock: {cidr: 10.0.0.0/8}}]", "networkpolicy x/p: spec.ingress[0].from[0]: may not specify both ipBlock and another peer"),
        ("podSelector: {}\npolicyTypes: [Ingress, Sideways]", "networkpolicy x/p: spec.policyTypes[1]: unsupported value \"Sideways\""),
        ("podSelector: {}\npolicyTypes: [Ingress, Egress, Ingress]", "networkpolicy x/p: spec.policyTypes: may not specify more than two policyTypes"),
    ];
    for (spec, expected) in cases {
        let message = error_of(spec);
        assert!(
            message.starts_with(expected),
            "{spec}\n  got:      {message}\n  expected: {expected}"
        );
    }
}

#[test]
fn valid_edge_cases_are_accepted() {
    let cases = [
        "podSelector: {}",
        "podSelector: {}\ningress:\n- ports: [{port: 80, endPort: 80}]",
        "podSelector: {}\ningress:\n- from: [{ipBlock: {cidr: 10.0.0.1/8, except: [10.0.0.0/9]}}]",
        "podSelector: {}\ningress:\n- from: [{ipBlock: {cidr: \"::/0\", except: [\"fd00::/8\"]}}]",
        "podSelector: {}\ningress:\n- ports: [{port: serve-80-sctp, protocol: SCTP}]",
        "podSelector: {matchExpressions: [{key: kubernetes.io/metadata.name, operator: DoesNotExist}]}",
        "podSelector: {}\npolicyTypes: [Egress]",
    ];
    for spec in cases {
        let Object::NetworkPolicy(np) = policy(spec) else {
            unreachable!()
        };
        validate(&np).unwrap_or_else(|e| panic!("{spec}: {e}"));
    }
}

#[test]
fn a_rejected_policy_leaves_the_engine_unchanged() {
    let mut engine = engine_with(&objects_yaml(
        "deny",
        "podSelector: {}\npolicyTypes: [Ingress]",
    ));
    let before = engine.desired().clone();
    // Replacing a good policy with a bad one keeps the good one in force.
    let bad = objects(&objects_yaml(
        "deny",
        "podSelector: {}\ningress:\n- ports: [{endPort: 5}]",
    ))
    .remove(0);
    let err = engine.upsert(bad).unwrap_err();
    assert!(
        matches!(&err, PolicyError::Invalid { field, .. } if field == "spec.ingress[0].ports[0].endPort")
    );
    assert_eq!(err.object().to_string(), "networkpolicy x/deny");
    assert_eq!(engine.desired(), &before);
}

#[test]
fn bad_pods_are_rejected_with_the_field() {
    let mut engine = engine_with("");
    let pod = objects("apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: x}\nstatus: {podIPs: [{ip: 10.0.0.300}]}").remove(0);
    let err = engine.upsert(pod).unwrap_err().to_string();
    assert_eq!(
        err,
        "pod x/p: status.podIPs[0].ip: invalid IP address \"10.0.0.300\""
    );
    let pod = objects("apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: x}\nspec: {containers: [{name: c, ports: [{containerPort: 80, protocol: ICMP}]}]}").remove(0);
    let err = engine.upsert(pod).unwrap_err().to_string();
    assert!(
        err.starts_with(
            "pod x/p: spec.containers[0].ports[0].protocol: unsupported value \"ICMP\""
        ),
        "{err}"
    );
    let nameless = objects("apiVersion: v1\nkind: Namespace\nmetadata: {labels: {a: b}}").remove(0);
    assert_eq!(
        engine.upsert(nameless).unwrap_err().to_string(),
        "namespace <unnamed>: metadata.name: required"
    );
}

fn objects_yaml(name: &str, spec: &str) -> String {
    let spec: String = spec.lines().map(|l| format!("  {l}\n")).collect();
    format!("apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: {name}, namespace: x}}\nspec:\n{spec}")
}
