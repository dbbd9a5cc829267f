//! The agent as nodes run it: from weir's image (`cargo xtask image --dev`, built by `cargo
//! xtask test`), under runc, with the runtime spec derived from deploy/daemonset.yaml
//! (`weir-lab up --agent-image`). The conformance suite runs two cells that way; these
//! tests check what only the image decides: that the image's own iptables tools write
//! into the backend the node already uses, legacy or nft, as kube-proxy's wrapper picks.

use std::time::{Duration, Instant};

use serde_json::Value;
use weir_tests::lab::Lab;
use weir_tests::netns::NetNs;

/// Waits until the agent reports a converged dataplane in the lab's status file.
fn converged(lab: &Lab) -> Value {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(text) = std::fs::read_to_string(lab.dir.join("status.json")) {
            if let Ok(status) = serde_json::from_str::<Value>(&text) {
                if status["converged"] == true {
                    return status;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "the agent from the image did not converge in 120 s; its log:\n{}",
            std::fs::read_to_string(lab.dir.join("agent.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A lab node whose agent (from the image) is not started yet, so that the test can give
/// the node some state first (`weir-lab agent start` starts it).
fn prepared_node(tag: &str, dataplane: &str) -> (Lab, NetNs) {
    let lab = Lab::new(tag);
    lab.weir(&[
        "up",
        "--dataplane",
        dataplane,
        "--without-agent",
        "--agent-image",
        &weir_tests::agent_image(),
        weir_tests::lab::netpol_world().to_str().unwrap(),
    ])
    .expect("lab up without its agent");
    let node = NetNs::attach(&lab.node_netns());
    (lab, node)
}

/// A node whose existing rules are in `backend` (kubelet's hint chain, as kube-proxy
/// finds it), then the agent from the image: weir's chains must land in that backend only.
fn follows_the_node(backend: &str) {
    let (lab, node) = prepared_node(&format!("image-backend-{backend}"), "iptables");
    let run = |program: String, args: &[&str]| {
        node.ok(&program, args, None)
            .unwrap_or_else(|e| panic!("{program} {args:?} in the node: {e}"))
    };
    let other = if backend == "legacy" { "nft" } else { "legacy" };
    // kubelet's hint chain, and a rule of the node's own, in the node's backend.
    run(
        format!("iptables-{backend}"),
        &["-t", "mangle", "-N", "KUBE-IPTABLES-HINT"],
    );
    run(
        format!("iptables-{backend}"),
        &[
            "-A", "INPUT", "-p", "tcp", "--dport", "10250", "-j", "ACCEPT",
        ],
    );
    lab.weir(&["agent", "start"])
        .expect("starting the agent from the image");
    let status = converged(&lab);
    assert_eq!(status["dataplane"], "iptables", "{status}");
    let ours = run(format!("iptables-{backend}-save"), &[]);
    let theirs = run(format!("iptables-{other}-save"), &[]);
    assert!(
        ours.contains(":WEIR-FILTER"),
        "the node's rules are {backend}, but weir's chains are not there:\n{ours}"
    );
    assert!(
        !theirs.contains("WEIR"),
        "weir wrote into the {other} backend of a {backend} node:\n{theirs}"
    );
}

#[test]
fn on_a_legacy_node_the_image_writes_legacy_rules() {
    follows_the_node("legacy");
}

#[test]
fn on_an_nft_node_the_image_writes_nft_rules() {
    follows_the_node("nft");
}

/// The seed's incident under the DaemonSet's spec: 20 leaked weir sets that rules weir
/// does not own still reference (Azure NPM crash-looped at 16), and 10 that nothing holds.
/// The agent from the image starts, its boot reset removes what it can, reports the
/// rest, and it enforces.
#[test]
fn the_image_boots_through_leaked_sets_it_cannot_delete_on_iptables() {
    boots_through_leaked_sets("iptables");
}

#[test]
fn the_image_boots_through_leaked_sets_it_cannot_delete_on_ebpf() {
    boots_through_leaked_sets("ebpf");
}

fn boots_through_leaked_sets(dataplane: &str) {
    let (lab, node) = prepared_node(&format!("image-leaked-sets-{dataplane}"), dataplane);
    let mut sets = String::new();
    let mut rules = String::from("*filter\n");
    for i in 0..20 {
        sets.push_str(&format!("create weir-leak{i} hash:net family inet\n"));
        rules.push_str(&format!(
            "-A INPUT -m set --match-set weir-leak{i} src -j ACCEPT\n"
        ));
    }
    for i in 0..10 {
        sets.push_str(&format!("create weir-free{i} hash:net family inet\n"));
    }
    rules.push_str("COMMIT\n");
    node.ok("ipset", &["restore"], Some(&sets))
        .expect("ipset restore");
    node.ok("iptables-legacy-restore", &["--noflush"], Some(&rules))
        .expect("the foreign rules");
    lab.weir(&["agent", "start"])
        .expect("starting the agent from the image");
    // It converges; the sets it cannot delete are not object errors (they enforce
    // nothing), on either dataplane: each is named in its log, with why, and counted.
    let status = converged(&lab);
    assert_eq!(status["dataplane"], dataplane, "{status}");
    assert_eq!(status["errors"], serde_json::json!([]), "{status}");
    let log = std::fs::read_to_string(lab.dir.join("agent.log")).unwrap_or_default();
    for i in 0..20 {
        let set = format!("weir-leak{i}");
        assert!(
            log.lines()
                .any(|l| l.contains("could not destroy") && l.contains(&format!("{set} "))),
            "the agent's log does not name {set} as held:\n{log}"
        );
    }
    let left = node.ok("ipset", &["list", "-n"], None).expect("ipset list");
    let left: Vec<&str> = left.lines().collect();
    assert!(
        !left.iter().any(|s| s.starts_with("weir-free")),
        "the boot reset left sets nothing held: {left:?}"
    );
    let leaked = left.iter().filter(|s| s.starts_with("weir-leak")).count();
    assert_eq!(leaked, 20, "the referenced sets cannot go: {left:?}");
    // And it enforces: a default deny in x isolates x/a.
    let deny = weir_tests::lab::manifest(
        &lab,
        "deny.yaml",
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: deny, namespace: x}\nspec: {podSelector: {}, policyTypes: [Ingress]}\n",
    );
    lab.weir(&["apply", "--no-wait", deny.to_str().unwrap()])
        .expect("apply");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, matrix) = lab.probe(&[]).expect("probe");
        let into_x = matrix
            .iter()
            .filter(|((from, to, _, _), connected)| {
                to.starts_with("x/") && !from.starts_with("x/") && **connected
            })
            .count();
        if into_x == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{into_x} connections into x still pass a default deny"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
