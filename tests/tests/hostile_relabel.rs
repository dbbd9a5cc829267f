//! The hostile tenant times its relabels against the agent's writes, with real frames in a
//! `weir lab`, on both dataplanes. `server` admits pods labelled `a` on TCP 80 and pods
//! labelled `b` on TCP 81. `p` (label `a`) must never reach server:81, and sends SYNs
//! there without pause while the tenant changes things back and forth:
//!
//! - **A released identity.** `p` loses `a` while `r` gains `a` and `b` in the same batch,
//!   so on eBPF the identity of the signature {a} is released as the signature {a, b} is
//!   new (an id given again within one convergence would hand `p`'s old id the entries
//!   of {a, b}); on iptables `p` leaves set a's ipsets while `r` joins both.
//! - **A relabel with a policy change.** `p` moves from `a` to `b` in the batch that moves
//!   `b`'s port from 81 to 82, so `p` is denied server:81 before and after; on eBPF `b`'s
//!   identity (`q` stays in it) gains `p` while its entries change, and `p` must never
//!   meet it with port 81 still written.
//!
//! Not one SYN may arrive, in any order of the writes. Controls show the probes would
//! arrive where allowed, and that each change took effect.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use weir_tests::frame_lab::{FrameLab, LINGER};
use weir_tests::lab::manifest;
use weir_tests::raw::{self, Sniffer};

const MANIFEST: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: t, labels: {ns: t}}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: t, labels: {app: server}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 80, protocol: TCP}, {containerPort: 81, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: p, namespace: t, labels: {a: "yes"}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 8080, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: q, namespace: t, labels: {b: "yes"}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 8080, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: r, namespace: t, labels: {other: "yes"}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 8080, protocol: TCP}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: server-ingress, namespace: t}
spec:
  podSelector: {matchLabels: {app: server}}
  policyTypes: [Ingress]
  ingress:
  - from: [{podSelector: {matchLabels: {a: "yes"}}}]
    ports: [{port: 80, protocol: TCP}]
  - from: [{podSelector: {matchLabels: {b: "yes"}}}]
    ports: [{port: 81, protocol: TCP}]
"#;

/// server's policy, admitting `b` on `b_port`.
fn server_ingress(b_port: u16) -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: \
         server-ingress, namespace: t}}\nspec:\n  podSelector: {{matchLabels: {{app: \
         server}}}}\n  policyTypes: [Ingress]\n  ingress:\n  - from: [{{podSelector: \
         {{matchLabels: {{a: \"yes\"}}}}}}]\n    ports: [{{port: 80, protocol: TCP}}]\n  \
         - from: [{{podSelector: {{matchLabels: {{b: \"yes\"}}}}}}]\n    ports: [{{port: \
         {b_port}, protocol: TCP}}]\n"
    )
}

/// `p` and `r` with the labels of one side of the relabel.
fn relabel(p_labels: &str, r_labels: &str) -> String {
    let pod = |name: &str, labels: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: t, labels: \
             {{{labels}}}}}\nspec:\n  containers:\n  - name: c\n    ports: [{{containerPort: \
             8080, protocol: TCP}}]\n"
        )
    };
    format!("{}---\n{}", pod("p", p_labels), pod("r", r_labels))
}

/// Relabels, each way, while p's SYNs fly.
const ROUNDS: usize = 6;

/// One lab at a time: the probes share the machine.
static SERIAL: Mutex<()> = Mutex::new(());

/// A SYN from `from`:`port` to server:`dst_port` carrying `marker`.
fn syn(w: &FrameLab, from: &str, port: u16, dst_port: u16, marker: &[u8]) -> Vec<u8> {
    let src = SocketAddr::new(w.pod(from).v4, port);
    let dst = SocketAddr::new(w.pod("server").v4, dst_port);
    let seg = raw::tcp(src, dst, raw::TCP_SYN, marker);
    raw::ip(src.ip(), dst.ip(), raw::IPPROTO_TCP, &seg)
}

fn reaches(w: &FrameLab, from: &str, dst_port: u16, marker: &str) -> bool {
    let packet = syn(w, from, 41000, dst_port, marker.as_bytes());
    w.reaches(from, "server", &[], &packet, marker.as_bytes())
}

fn apply(w: &FrameLab, name: &str, yaml: &str) {
    let file = manifest(&w.lab, name, yaml);
    w.lab
        .weir(&["apply", file.to_str().unwrap()])
        .unwrap_or_else(|e| panic!("weir lab apply {name}: {e}"));
}

/// Applies `changes` in turn, [`ROUNDS`] times, while p sends SYNs to server:81 (from a
/// cycle of source ports, as fast as one socket sends them); not one may arrive.
fn storm(w: &FrameLab, dataplane: &str, what: &str, changes: &[&String]) {
    let marker = b"weir-relabel-storm";
    let frames: Vec<Vec<u8>> = (0..32)
        .map(|i| {
            let (dst_mac, src_mac) = w.macs("p");
            raw::ethernet(dst_mac, src_mac, &[], &syn(w, "p", 42000 + i, 81, marker))
        })
        .collect();
    let sniffer = Sniffer::start(&w.pod("server").netns, "eth0", marker);
    let stop = Arc::new(AtomicBool::new(false));
    let sender = {
        let (stop, netns) = (stop.clone(), w.pod("p").netns.clone());
        std::thread::spawn(move || {
            let mut sent = 0usize;
            while !stop.load(Ordering::SeqCst) {
                let frames = frames.clone();
                raw::flood(&netns, "eth0", 4096, move |i| {
                    frames[i as usize % frames.len()].clone()
                });
                sent += 4096;
            }
            sent
        })
    };
    for round in 0..ROUNDS {
        for (i, change) in changes.iter().enumerate() {
            apply(w, &format!("storm-{round}-{i}.yaml"), change);
        }
    }
    stop.store(true, Ordering::SeqCst);
    let sent = sender.join().expect("sender thread");
    let arrived = sniffer.stop(LINGER);
    eprintln!(
        "{dataplane}, {what}: {sent} SYNs from p to server:81 over {ROUNDS} rounds, {arrived} \
         arrived"
    );
    assert!(sent > 0, "{dataplane}: no SYN was sent");
    assert_eq!(
        arrived, 0,
        "{dataplane}, {what}: p reached server:81, which neither the old nor the new state \
         allows, while the changes were written"
    );
}

fn run(dataplane: &str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    weir_tests::require_root_and_tools();
    let w = FrameLab::up("relabel", dataplane, "t", MANIFEST);
    let forward = relabel("other: \"yes\"", "a: \"yes\", b: \"yes\"");
    let back = relabel("a: \"yes\"", "other: \"yes\"");

    // Controls, so that no arrival below is a silent pass: allowed SYNs arrive, and each
    // relabel takes effect.
    assert!(
        reaches(&w, "q", 81, "weir-relabel-q81"),
        "{dataplane}: q → server:81"
    );
    assert!(
        reaches(&w, "p", 80, "weir-relabel-p80"),
        "{dataplane}: p → server:80"
    );
    assert!(
        !reaches(&w, "p", 81, "weir-relabel-p81"),
        "{dataplane}: p → server:81 before"
    );
    apply(&w, "forward.yaml", &forward);
    assert!(
        reaches(&w, "r", 81, "weir-relabel-r81"),
        "{dataplane}: r → server:81 once relabelled"
    );
    assert!(
        !reaches(&w, "p", 80, "weir-relabel-p80-gone"),
        "{dataplane}: p → server:80 once relabelled"
    );
    apply(&w, "back.yaml", &back);
    assert!(
        reaches(&w, "p", 80, "weir-relabel-p80-back"),
        "{dataplane}: p → server:80 back"
    );

    storm(&w, dataplane, "relabels", &[&forward, &back]);

    // The relabel with a policy change, and back.
    let moved = format!(
        "{}---\n{}",
        relabel("b: \"yes\"", "other: \"yes\""),
        server_ingress(82)
    );
    let restored = format!("{back}---\n{}", server_ingress(81));
    apply(&w, "moved.yaml", &moved);
    assert!(
        reaches(&w, "q", 82, "weir-relabel-q82"),
        "{dataplane}: q → server:82 once the policy changed"
    );
    assert!(
        reaches(&w, "p", 82, "weir-relabel-p82"),
        "{dataplane}: p → server:82 once relabelled"
    );
    apply(&w, "restored.yaml", &restored);
    storm(
        &w,
        dataplane,
        "relabels with a policy change",
        &[&moved, &restored],
    );

    // Still enforced as the labels say.
    assert!(
        reaches(&w, "q", 81, "weir-relabel-q81-after"),
        "{dataplane}: q → server:81 after"
    );
    assert!(
        !reaches(&w, "p", 81, "weir-relabel-p81-after"),
        "{dataplane}: p → server:81 after"
    );
}

#[test]
fn hostile_relabel_ebpf() {
    run("ebpf");
}

#[test]
fn hostile_relabel_iptables() {
    run("iptables");
}
