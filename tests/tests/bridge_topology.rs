//! Bridged CNIs (issue 12, defect 3) in a `weir lab --topology bridge`, on both
//! dataplanes: every pod's host-side veth is a port of one bridge (cni0), so the route to
//! every pod leads to the bridge. Each pod must still get its own policy and no other's,
//! also after pods are deleted and re-created with each other's addresses on new ports,
//! and a pod on the bridge must not send from another local pod's address, whether the
//! bridge passes the frame to its target directly or the node routes it.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use serde_json::Value;
use weir_tests::lab::{manifest, netpol_world, Lab, Matrix};
use weir_tests::netpol::{compare, Pair};
use weir_tests::raw::{self, Sniffer};

/// x/a admits nothing; y/b sends nothing (but replies).
const POLICIES: &str = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-ingress, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  policyTypes: [Ingress]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-egress, namespace: y}
spec:
  podSelector: {matchLabels: {pod: b}}
  policyTypes: [Egress]
"#;

fn truth(p: &Pair) -> bool {
    !p.to("x", "a") && !p.from("y", "b")
}

struct PodAddrs {
    netns: String,
    v4: IpAddr,
    v6: IpAddr,
}

/// Builds a bridge-topology lab of `manifests` (YAML texts, written into its directory).
fn up(tag: &str, dataplane: &str, manifests: &[(&str, &str)]) -> Lab {
    let lab = Lab::new(&format!("bridge-{tag}-{dataplane}"));
    let files: Vec<String> = manifests
        .iter()
        .map(|(name, yaml)| manifest(&lab, name, yaml).display().to_string())
        .collect();
    let mut args = vec!["up", "--topology", "bridge", "--dataplane", dataplane];
    args.extend(files.iter().map(String::as_str));
    lab.weir(&args)
        .unwrap_or_else(|e| panic!("{dataplane}: weir lab up --topology bridge: {e}"));
    lab
}

/// Pods and the node namespace from the lab's state.json (which records the topology).
fn state(lab: &Lab) -> (String, BTreeMap<String, PodAddrs>) {
    let state: Value =
        serde_json::from_str(&std::fs::read_to_string(lab.dir.join("state.json")).unwrap())
            .unwrap();
    assert_eq!(
        state["topology"], "bridge",
        "state.json records the topology"
    );
    let pods = state["pods"]
        .as_object()
        .expect("state.json pods")
        .iter()
        .map(|(key, p)| {
            let addr = |f: &str| p[f].as_str().expect(f).parse::<IpAddr>().unwrap();
            let info = PodAddrs {
                netns: p["netns"].as_str().unwrap().to_string(),
                v4: addr("ipv4"),
                v6: addr("ipv6"),
            };
            (key.clone(), info)
        })
        .collect();
    (state["node_netns"].as_str().unwrap().to_string(), pods)
}

/// Both families' matrices must match [`truth`], within `settle` (see
/// [`NEIGHBOUR_SETTLE`]; zero: at once).
fn check(lab: &Lab, dataplane: &str, when: &str, settle: Duration) -> Vec<Matrix> {
    let deadline = Instant::now() + settle;
    let mut matrices = Vec::new();
    for family in ["ipv4", "ipv6"] {
        loop {
            let (named, matrix) = lab
                .probe(&["--family", family])
                .unwrap_or_else(|e| panic!("{dataplane} {when}: probe {family}: {e}"));
            assert_eq!(named, dataplane);
            match compare(&matrix, truth) {
                Ok(()) => {
                    matrices.push(matrix);
                    break;
                }
                Err(diff) if Instant::now() > deadline => {
                    panic!("{dataplane} ({family}, {when}): {diff}")
                }
                Err(_) => std::thread::sleep(Duration::from_millis(500)),
            }
        }
    }
    matrices
}

/// How long other pods on the bridge may keep a reused address's old MAC: the gratuitous
/// ARP and unsolicited advertisement of the new pod (as CNI plugins send) are ignored by
/// a neighbour entry updated in the last second (`locktime`), and such an entry is only
/// re-resolved once its unicast probes failed (a few seconds). A dataplane that enforces
/// the wrong pod's policy stays wrong past this.
const NEIGHBOUR_SETTLE: Duration = Duration::from_secs(20);

/// A pod manifest of the netpol world (ports 80/81 × TCP/UDP/SCTP) with given addresses.
fn pod_with_addresses(ns: &str, name: &str, v4: IpAddr, v6: IpAddr) -> String {
    let ports: String = [80, 81]
        .iter()
        .flat_map(|p| {
            ["TCP", "UDP", "SCTP"].map(|proto| {
                format!(
                    "    - {{containerPort: {p}, protocol: {proto}, name: serve-{p}-{}}}\n",
                    proto.to_lowercase()
                )
            })
        })
        .collect();
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels:\n    \
         pod: {name}\nspec:\n  containers:\n  - name: cont-{name}\n    image: agnhost\n    \
         ports:\n{ports}status:\n  podIPs:\n  - ip: {v4}\n  - ip: {v6}\n---\n"
    )
}

/// Nine pods on one bridge, two policies; then the two policed pods are deleted and
/// re-created with each other's addresses (new ports, reused addresses): each must get
/// its own policy again.
fn reused_addresses(dataplane: &str) -> Vec<Matrix> {
    let world = std::fs::read_to_string(netpol_world()).unwrap();
    let lab = up(
        "reuse",
        dataplane,
        &[("world.yaml", &world), ("policies.yaml", POLICIES)],
    );
    let mut matrices = check(&lab, dataplane, "at first", Duration::ZERO);
    let (_, pods) = state(&lab);
    let (a, b) = (&pods["x/a"], &pods["y/b"]);
    let both = pod_with_addresses("x", "a", a.v4, a.v6) + &pod_with_addresses("y", "b", b.v4, b.v6);
    let gone = manifest(&lab, "gone.yaml", &both);
    lab.weir(&["delete", gone.to_str().unwrap()]).unwrap();
    let swapped =
        pod_with_addresses("x", "a", b.v4, b.v6) + &pod_with_addresses("y", "b", a.v4, a.v6);
    let back = manifest(&lab, "swapped.yaml", &swapped);
    lab.weir(&["apply", back.to_str().unwrap()]).unwrap();
    let (_, after) = state(&lab);
    assert_eq!(after["x/a"].v4, b.v4, "x/a reuses y/b's old address");
    assert_eq!(after["y/b"].v4, a.v4, "y/b reuses x/a's old address");
    matrices.extend(check(
        &lab,
        dataplane,
        "after re-creation with swapped addresses",
        NEIGHBOUR_SETTLE,
    ));
    matrices
}

#[test]
fn reused_addresses_on_a_bridge_get_their_own_policy() {
    let runs: Vec<Vec<Matrix>> = std::thread::scope(|s| {
        let handles: Vec<_> = ["ebpf", "iptables"]
            .map(|d| s.spawn(move || reused_addresses(d)))
            .into_iter()
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        runs[0], runs[1],
        "eBPF and iptables give different matrices"
    );
}

const SPOOF_WORLD: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: red, labels: {ns: red}}
---
apiVersion: v1
kind: Pod
metadata: {name: cli, namespace: red, labels: {app: cli}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 8080, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: db, namespace: red, labels: {app: db}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 5432, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: red, labels: {app: web}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 5353, protocol: UDP}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: web-allow-db, namespace: red}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Ingress]
  ingress:
  - from: [{podSelector: {matchLabels: {app: db}}}]
"#;

const LINGER: Duration = Duration::from_millis(300);

/// cli sends UDP datagrams to web (which admits only db) from its own address, from
/// db's and from an off-cluster one, framed to web's MAC (the bridge passes it) or to the
/// bridge's (the node routes it). Returns case → whether a datagram reached web.
fn spoofing(dataplane: &str) -> BTreeMap<String, bool> {
    let lab = up("spoof", dataplane, &[("world.yaml", SPOOF_WORLD)]);
    let (node, pods) = state(&lab);
    let (cli, db, web) = (&pods["red/cli"], &pods["red/db"], &pods["red/web"]);
    let cli_mac = raw::mac(&cli.netns, "eth0");
    let web_mac = raw::mac(&web.netns, "eth0");
    let bridge_mac = raw::mac(&node, "cni0");
    let mut out = BTreeMap::new();
    for v6 in [false, true] {
        let pick = |p: &PodAddrs| if v6 { p.v6 } else { p.v4 };
        let foreign: IpAddr = if v6 {
            "2001:db8::66".parse().unwrap()
        } else {
            "192.0.2.66".parse().unwrap()
        };
        let family = if v6 { "v6" } else { "v4" };
        for (path, dst_mac) in [("bridged", web_mac), ("routed", bridge_mac)] {
            for (i, (name, src)) in [
                ("own address, not allowed by web", pick(cli)),
                ("db's address", pick(db)),
                ("an off-cluster address", foreign),
            ]
            .into_iter()
            .enumerate()
            {
                let marker = format!("weir-bridge-spoof-{family}-{path}-{i}");
                let dst = pick(web);
                let seg = raw::udp(
                    SocketAddr::new(src, 33000),
                    SocketAddr::new(dst, 5353),
                    marker.as_bytes(),
                );
                let packet = raw::ip(src, dst, raw::IPPROTO_UDP, &seg);
                let frame = raw::ethernet(dst_mac, cli_mac, &[], &packet);
                let sniffer = Sniffer::start(&web.netns, "eth0", marker.as_bytes());
                raw::send_frames(&cli.netns, "eth0", vec![frame.clone(), frame]);
                let through = sniffer.stop(LINGER) > 0;
                out.insert(format!("{family} {path}: cli → web from {name}"), through);
            }
        }
    }
    // The control: db's own datagrams are admitted, so a drop above is the spoofing's.
    for v6 in [false, true] {
        let pick = |p: &PodAddrs| if v6 { p.v6 } else { p.v4 };
        let family = if v6 { "v6" } else { "v4" };
        let marker = format!("weir-bridge-control-{family}");
        let (src, dst) = (pick(db), pick(web));
        let seg = raw::udp(
            SocketAddr::new(src, 33000),
            SocketAddr::new(dst, 5353),
            marker.as_bytes(),
        );
        let packet = raw::ip(src, dst, raw::IPPROTO_UDP, &seg);
        let frame = raw::ethernet(web_mac, raw::mac(&db.netns, "eth0"), &[], &packet);
        let sniffer = Sniffer::start(&web.netns, "eth0", marker.as_bytes());
        raw::send_frames(&db.netns, "eth0", vec![frame.clone(), frame]);
        out.insert(
            format!("{family} bridged: db → web from its own address"),
            sniffer.stop(LINGER) > 0,
        );
    }
    out
}

#[test]
fn a_pod_on_a_bridge_cannot_spoof_another_local_pods_address() {
    let mut wrong = Vec::new();
    for dataplane in ["ebpf", "iptables"] {
        let out = spoofing(dataplane);
        assert_eq!(out.len(), 14, "{dataplane}: {out:?}");
        for (case, through) in out {
            if through != case.contains("db → web") {
                let got = if through { "THROUGH" } else { "blocked" };
                wrong.push(format!("  {dataplane} {case}: {got}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "on a bridge, spoofed or denied datagrams got through (or the control did not):\n{}",
        wrong.join("\n")
    );
}
