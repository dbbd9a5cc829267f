//! kill -9 in the middle of a converge, on both dataplanes, through the real kube-apiserver
//! (`weir-lab up --api server`): while a change of 201 policies is being written and
//! applied, the agent is killed at several offsets. Whatever the instant, no flow that the
//! old and the new state both deny gets through, no flow that both allow is cut, and a new
//! agent converges on the new state.

use std::time::Duration;

use weir_tests::lab::{manifest, netpol_world, Lab, Matrix};

/// Policies that do not change any lab pod's verdict but make each change long: every one
/// selects the x pods and allows one address outside the lab on port 81.
const FILLERS: usize = 200;

/// State `A` lets namespace y into x, state `B` namespace z; both deny x to x.
fn state(peer_ns: &str, filler_net: &str) -> String {
    let mut text = format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: deny, namespace: x}}\nspec:\n  podSelector: {{}}\n  policyTypes: [Ingress]\n---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: allow-peer, namespace: x}}\nspec:\n  podSelector: {{}}\n  ingress:\n  - from:\n    - namespaceSelector: {{matchLabels: {{ns: {peer_ns}}}}}\n"
    );
    for i in 0..FILLERS {
        text.push_str(&format!(
            "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: filler-{i}, namespace: x}}\nspec:\n  podSelector: {{}}\n  ingress:\n  - from:\n    - ipBlock: {{cidr: {filler_net}.{}/32}}\n    ports:\n    - {{port: 81}}\n",
            i + 1
        ));
    }
    text
}

/// Flows whose verdict is the same in A and B must have it; the others may have either.
fn check_invariants(matrix: &Matrix, context: &str) {
    let mut wrong = Vec::new();
    for ((from, to, port, proto), connected) in matrix {
        let (from_ns, to_ns) = (ns(from), ns(to));
        let expect = match (from_ns, to_ns) {
            // Nothing selects y or z: always open.
            (_, "y") | (_, "z") => Some(true),
            // Denied by `deny` in both states.
            ("x", "x") => Some(false),
            // y → x (A) or z → x (B): either, mid-change.
            _ => None,
        };
        if let Some(e) = expect {
            if e != *connected {
                wrong.push(format!("{from} -> {to} {port}/{proto}: {connected}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "{context}: verdicts that both states agree on were broken: {wrong:?}"
    );
}

fn ns(pod: &str) -> &str {
    pod.split('/').next().unwrap_or_default()
}

/// Whether every y → x (A) or z → x (B) probe is open, and the other closed.
fn in_state(matrix: &Matrix, open_from: &str) -> bool {
    matrix
        .iter()
        .filter(|((from, to, _, _), _)| ns(to) == "x" && ns(from) != "x")
        .all(|((from, _, _, _), connected)| *connected == (ns(from) == open_from))
}

fn killed_mid_converge(dataplane: &str) {
    let lab = Lab::new(&format!("kill-{dataplane}"));
    let a = manifest(&lab, "a.yaml", &state("y", "192.0.2"));
    let b = manifest(&lab, "b.yaml", &state("z", "198.51.100"));
    let world = netpol_world();
    lab.weir(&[
        "up",
        "--api",
        "server",
        "--dataplane",
        dataplane,
        world.to_str().unwrap(),
        a.to_str().unwrap(),
    ])
    .unwrap_or_else(|e| panic!("{dataplane}: lab up: {e}"));
    let (_, m) = lab.probe(&[]).unwrap();
    assert!(in_state(&m, "y"), "{dataplane}: state A before any kill");
    check_invariants(&m, dataplane);

    let mut target = (&b, "z");
    let mut other = (&a, "y");
    for delay_ms in [0u64, 30, 100, 300, 1000] {
        let file = target.0.to_str().unwrap().to_string();
        let writer = {
            let dir = lab.dir.clone();
            std::thread::spawn(move || {
                let out = weir_tests::weir_bin::lab_command()
                    .unwrap()
                    .arg("--state-dir")
                    .arg(dir)
                    .args(["apply", "--no-wait", &file])
                    .output()
                    .unwrap();
                assert!(out.status.success(), "apply --no-wait: {out:?}");
            })
        };
        std::thread::sleep(Duration::from_millis(delay_ms));
        lab.weir(&["agent", "signal", "kill"]).unwrap();
        writer.join().unwrap();
        let context = format!("{dataplane}: killed {delay_ms} ms into a change");
        let (_, m) = lab.probe(&[]).unwrap();
        check_invariants(&m, &context);
        // A new agent converges on the state the server holds.
        lab.weir(&["agent", "start"]).unwrap();
        lab.weir(&["apply", target.0.to_str().unwrap()])
            .unwrap_or_else(|e| panic!("{context}: the restarted agent: {e}"));
        let (_, m) = lab.probe(&[]).unwrap();
        check_invariants(&m, &context);
        assert!(
            in_state(&m, target.1),
            "{context}: the restarted agent does not enforce the new state"
        );
        std::mem::swap(&mut target, &mut other);
    }
}

#[test]
fn ebpf_killed_mid_converge_breaks_nothing_both_states_agree_on() {
    killed_mid_converge("ebpf");
}

#[test]
fn iptables_killed_mid_converge_breaks_nothing_both_states_agree_on() {
    killed_mid_converge("iptables");
}
