//! The agent as nodes run it: from weir's image (`cargo xtask image --dev`, built by `cargo
//! xtask test`), under runc, with the runtime spec derived from deploy/daemonset.yaml
//! (`weir lab up --agent-image`). The conformance suite runs two cells that way; these
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

/// A node whose existing rules are in `backend` (kubelet's hint chain, as kube-proxy
/// finds it), then the agent from the image: weir's chains must land in that backend only.
fn follows_the_node(backend: &str) {
    let lab = Lab::new(&format!("image-backend-{backend}"));
    let image = weir_tests::agent_image();
    lab.weir(&[
        "up",
        "--dataplane",
        "iptables",
        "--without-agent",
        "--agent-image",
        &image,
        weir_tests::lab::netpol_world().to_str().unwrap(),
    ])
    .expect("lab up without its agent");
    let node = NetNs::attach(&lab.node_netns());
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
