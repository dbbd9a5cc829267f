//! Bridged CNIs in a `weir-lab --topology bridge`, on both
//! dataplanes: every pod's host-side veth is a port of one bridge (cni0), so the route to
//! every pod leads to the bridge. Each pod must still get its own policy and no other's,
//! also after pods are deleted and re-created with each other's addresses on new ports
//! (checked on routed pods too),
//! and a pod on the bridge must not send from another local pod's address, whether the
//! bridge passes the frame to its target directly or the node routes it.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};
use weir::dataplane::Scope;

use netpol_scenarios::{compare, Pair};
use serde_json::Value;
use weir::dataplane::ebpf::{EbpfConfig, EbpfDataplane};
use weir::dataplane::iptables::IptablesConfig;
use weir::dataplane::new_pods::NewPodIsolation;
use weir::dataplane::Dataplane;
use weir_tests::desired::{desired, endpoint};
use weir_tests::lab::{manifest, netpol_world, Lab, Matrix};
use weir_tests::node_dataplane::NodeDataplane;
use weir_tests::pods::{ip, run_in};
use weir_tests::probe::{udp_echo, EchoServers};
use weir_tests::raw::{self, Sniffer};
use weir_tests::PinRoot;

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

/// Builds a lab of `manifests` (YAML texts, written into its directory) on `topology`.
fn up(tag: &str, dataplane: &str, topology: &str, manifests: &[(&str, &str)]) -> Lab {
    let lab = Lab::new(&format!("{topology}-{tag}-{dataplane}"));
    let files: Vec<String> = manifests
        .iter()
        .map(|(name, yaml)| manifest(&lab, name, yaml).display().to_string())
        .collect();
    let mut args = vec!["up", "--topology", topology, "--dataplane", dataplane];
    args.extend(files.iter().map(String::as_str));
    lab.weir(&args)
        .unwrap_or_else(|e| panic!("{dataplane}: weir-lab up --topology {topology}: {e}"));
    lab
}

/// Pods and the node namespace from the lab's state.json (which records the topology).
fn state(lab: &Lab, topology: &str) -> (String, BTreeMap<String, PodAddrs>) {
    let state: Value =
        serde_json::from_str(&std::fs::read_to_string(lab.dir.join("state.json")).unwrap())
            .unwrap();
    assert_eq!(
        state["topology"], topology,
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

/// Nine pods (on one bridge, or routed), two policies; then the two policed pods are
/// deleted and re-created with each other's addresses (new ports, reused addresses):
/// each must get its own policy again.
fn reused_addresses(dataplane: &str, topology: &str) -> Vec<Matrix> {
    let world = std::fs::read_to_string(netpol_world()).unwrap();
    let lab = up(
        "reuse",
        dataplane,
        topology,
        &[("world.yaml", &world), ("policies.yaml", POLICIES)],
    );
    let mut matrices = check(&lab, dataplane, "at first", Duration::ZERO);
    let (_, pods) = state(&lab, topology);
    let (a, b) = (&pods["x/a"], &pods["y/b"]);
    let both = pod_with_addresses("x", "a", a.v4, a.v6) + &pod_with_addresses("y", "b", b.v4, b.v6);
    let gone = manifest(&lab, "gone.yaml", &both);
    lab.weir(&["delete", gone.to_str().unwrap()]).unwrap();
    let swapped =
        pod_with_addresses("x", "a", b.v4, b.v6) + &pod_with_addresses("y", "b", a.v4, a.v6);
    let back = manifest(&lab, "swapped.yaml", &swapped);
    lab.weir(&["apply", back.to_str().unwrap()]).unwrap();
    let (_, after) = state(&lab, topology);
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

/// Address reuse on both dataplanes; their matrices must be the same.
fn reused_addresses_on(topology: &str) {
    let runs: Vec<Vec<Matrix>> = std::thread::scope(|s| {
        let handles: Vec<_> = ["ebpf", "iptables"]
            .map(|d| s.spawn(move || reused_addresses(d, topology)))
            .into_iter()
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        runs[0], runs[1],
        "{topology}: eBPF and iptables give different matrices"
    );
}

#[test]
fn reused_addresses_on_a_bridge_get_their_own_policy() {
    reused_addresses_on("bridge");
}

/// The same on routed pods (each pod's own route and veth), the other topology.
#[test]
fn reused_addresses_on_routed_pods_get_their_own_policy() {
    reused_addresses_on("routed");
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
    let lab = up("spoof", dataplane, "bridge", &[("world.yaml", SPOOF_WORLD)]);
    let (node, pods) = state(&lab, "bridge");
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

/// A node namespace with the bridge br0 (10.216.0.1/24, bridged packets to iptables) and
/// pods whose host-side veths are its ports; all deleted on drop.
struct BridgedNode {
    node: String,
    pods: Vec<String>,
}

const GATEWAY: &str = "10.216.0.1";
const A: Ipv4Addr = Ipv4Addr::new(10, 216, 0, 2);
const N: Ipv4Addr = Ipv4Addr::new(10, 216, 0, 9);

impl BridgedNode {
    fn new(tag: &str) -> BridgedNode {
        weir_tests::require_root_and_tools();
        let node = format!("wbr{tag}-{}-node", std::process::id());
        ip(&["netns", "add", &node]);
        let this = BridgedNode {
            node: node.clone(),
            pods: Vec::new(),
        };
        ip(&["-n", &node, "link", "set", "lo", "up"]);
        ip(&["-n", &node, "link", "add", "br0", "type", "bridge"]);
        ip(&[
            "-n",
            &node,
            "addr",
            "add",
            &format!("{GATEWAY}/24"),
            "dev",
            "br0",
        ]);
        ip(&["-n", &node, "link", "set", "br0", "up"]);
        // A module on distribution kernels (Debian's 5.10 and 6.1), built in on the host's.
        if !std::path::Path::new("/proc/sys/net/bridge").exists() {
            weir::exec::modules::load("br_netfilter")
                .unwrap_or_else(|why| panic!("prerequisite missing: br_netfilter: {why}"));
        }
        for key in ["bridge/bridge-nf-call-iptables", "ipv4/ip_forward"] {
            let path = format!("/proc/sys/net/{key}");
            run_in(&node, move || std::fs::write(&path, "1")).expect("sysctl");
        }
        this
    }

    /// CNI ADD on a bridge: the veth, its host end a port of br0, the pod's address.
    fn plug(&mut self, name: &str, host_if: &str, addr: Ipv4Addr) -> String {
        let ns = format!("{}-{name}", self.node.trim_end_matches("-node"));
        ip(&["netns", "add", &ns]);
        self.pods.push(ns.clone());
        let node = self.node.as_str();
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        ip(&[
            "-n", node, "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns",
            &ns,
        ]);
        ip(&["-n", node, "link", "set", host_if, "master", "br0"]);
        ip(&["-n", node, "link", "set", host_if, "up"]);
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            "eth0",
        ]);
        ip(&["-n", &ns, "link", "set", "eth0", "up"]);
        ip(&["-n", &ns, "route", "add", "default", "via", GATEWAY]);
        ns
    }
}

impl Drop for BridgedNode {
    fn drop(&mut self) {
        for ns in self.pods.iter().chain([&self.node]) {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", ns])
                .status();
        }
    }
}

fn pod_interfaces() -> NewPodIsolation {
    NewPodIsolation {
        prefixes: vec!["lxc".into()],
        exempt: Vec::new(),
    }
}

/// Whether UDP echoes pass between pods `x` and `y`, each way.
fn echoes(x: &str, x_addr: Ipv4Addr, y: &str, y_addr: Ipv4Addr) -> (bool, bool) {
    let (to_y, to_x) = (
        SocketAddr::from((y_addr, 80)),
        SocketAddr::from((x_addr, 80)),
    );
    let t = Duration::from_millis(400);
    (
        run_in(x, move || udp_echo(to_y, t)),
        run_in(y, move || udp_echo(to_x, t)),
    )
}

/// Waits until both ways pass (the dataplane just programmed the pod).
fn echoes_within(x: &str, x_addr: Ipv4Addr, y: &str, y_addr: Ipv4Addr) -> (bool, bool) {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let got = echoes(x, x_addr, y, y_addr);
        if got == (true, true) || Instant::now() > deadline {
            return got;
        }
    }
}

/// A new pod's bridge port is isolated from its first packet until its endpoint is
/// programmed, then gets its own attachment (eBPF: the port, never the bridge).
#[test]
fn a_new_pod_on_a_bridge_is_isolated_until_programmed_on_ebpf() {
    let mut world = BridgedNode::new("np-ebpf");
    let root = PinRoot::new("bridge-np");
    let a = world.plug("a", "lxcbra", A);
    let _servers = EchoServers::start(&a, &[80]);
    let known = desired(vec![], vec![endpoint("x/a", A, None, None)]);
    let config = EbpfConfig {
        new_pods: pod_interfaces(),
        ..EbpfConfig::with_pin_root(root.0.clone())
    };
    let node = world.node.clone();
    let dp = run_in(&node, move || {
        let mut dp = EbpfDataplane::new(config).expect("load dataplane");
        let report = dp.converge(&known, Scope::Kernel).expect("reconcile");
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        dp
    });
    let n = world.plug("n", "lxcbrn", N);
    let _n_servers = EchoServers::start(&n, &[80]);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        echoes(&n, N, &a, A),
        (false, false),
        "ebpf: a new pod on the bridge passed before it was programmed"
    );
    let both = desired(
        vec![],
        vec![
            endpoint("x/a", A, None, None),
            endpoint("x/n", N, None, None),
        ],
    );
    let dp = run_in(&node, move || {
        let mut dp = dp;
        let report = dp.converge(&both, Scope::Kernel).expect("reconcile");
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        dp
    });
    assert_eq!(
        echoes_within(&n, N, &a, A),
        (true, true),
        "ebpf: the new pod stayed isolated once programmed"
    );
    for (pod, port) in [("x/a", "lxcbra"), ("x/n", "lxcbrn")] {
        let (ifname, _, _) = dp.attachment(pod).expect("attached");
        assert_eq!(ifname, port, "{pod} is attached to its own bridge port");
    }
    run_in(&node, move || drop(dp));
}

#[test]
fn a_new_pod_on_a_bridge_is_isolated_until_programmed_on_iptables() {
    let mut world = BridgedNode::new("np-ipt");
    let a = world.plug("a", "lxcbra", A);
    let _servers = EchoServers::start(&a, &[80]);
    let known = desired(vec![], vec![endpoint("x/a", A, None, None)]);
    let mut dp = NodeDataplane::start(
        &world.node,
        IptablesConfig {
            new_pods: pod_interfaces(),
            ..Default::default()
        },
    )
    .expect("prerequisite missing: ipset and iptables");
    let report = dp.converge(&known, Scope::Kernel).expect("reconcile");
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    let n = world.plug("n", "lxcbrn", N);
    let _n_servers = EchoServers::start(&n, &[80]);
    assert_eq!(
        echoes(&n, N, &a, A),
        (false, false),
        "iptables: a new pod on the bridge passed before it was programmed"
    );
    let both = desired(
        vec![],
        vec![
            endpoint("x/a", A, None, None),
            endpoint("x/n", N, None, None),
        ],
    );
    let report = dp.converge(&both, Scope::Mirror).expect("apply");
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert_eq!(
        echoes_within(&n, N, &a, A),
        (true, true),
        "iptables: the new pod stayed isolated once programmed"
    );
    let rules = weir_tests::netns::NetNs::attach(&world.node)
        .ok("iptables-save", &[], None)
        .unwrap_or_else(|e| panic!("{e}"));
    for (pod, port) in [(A, "lxcbra"), (N, "lxcbrn")] {
        let rule = format!("! -s {pod}/32 -m physdev --physdev-in {port}");
        assert!(
            rules.contains(&rule),
            "no anti-spoofing rule {rule:?} in\n{rules}"
        );
    }
}

/// Fail closed: a pod whose bridge port cannot be found (here: its namespace is not in
/// the directory the agent reads) is not attached anywhere, the failure names the pod and
/// the bridge, and its port stays isolated as a new pod; the other pods are unaffected.
#[test]
fn a_pod_whose_bridge_port_is_not_found_stays_isolated_on_ebpf() {
    let mut world = BridgedNode::new("nf-ebpf");
    let root = PinRoot::new("bridge-nf");
    let empty = std::env::temp_dir().join(format!("weir-empty-netns-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let a = world.plug("a", "lxcbra", A);
    let n = world.plug("n", "lxcbrn", N);
    let _servers = EchoServers::start(&a, &[80]);
    let _n_servers = EchoServers::start(&n, &[80]);
    let config = EbpfConfig {
        new_pods: pod_interfaces(),
        pod_netns_dir: empty.clone(),
        ..EbpfConfig::with_pin_root(root.0.clone())
    };
    let both = desired(
        vec![],
        vec![
            endpoint("x/a", A, None, None),
            endpoint("x/n", N, None, None),
        ],
    );
    let node = world.node.clone();
    let (dp, failures) = run_in(&node, move || {
        let mut dp = EbpfDataplane::new(config).expect("load dataplane");
        let report = dp.converge(&both, Scope::Kernel).expect("reconcile");
        (dp, report.failures)
    });
    let _ = std::fs::remove_dir_all(&empty);
    assert_eq!(failures.len(), 2, "{failures:?}");
    for f in &failures {
        assert!(
            (f.object == "x/a" || f.object == "x/n") && f.reason.contains("br0"),
            "the failure names the pod and the bridge: {f:?}"
        );
    }
    assert_eq!(dp.attachment("x/a"), None, "attached to the bridge?");
    assert_eq!(
        echoes(&n, N, &a, A),
        (false, false),
        "pods whose ports were not found must stay isolated"
    );
    run_in(&node, move || drop(dp));
}

/// The same on iptables: without its port, a bridged pod has no anti-spoofing rule, so
/// it counts as not programmed and its port stays under the new-pod catch-all.
#[test]
fn a_pod_whose_bridge_port_is_not_found_stays_isolated_on_iptables() {
    let mut world = BridgedNode::new("nf-ipt");
    let empty = std::env::temp_dir().join(format!("weir-empty-netns-ipt-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let a = world.plug("a", "lxcbra", A);
    let n = world.plug("n", "lxcbrn", N);
    let _servers = EchoServers::start(&a, &[80]);
    let _n_servers = EchoServers::start(&n, &[80]);
    let both = desired(
        vec![],
        vec![
            endpoint("x/a", A, None, None),
            endpoint("x/n", N, None, None),
        ],
    );
    let mut dp = NodeDataplane::start(
        &world.node,
        IptablesConfig {
            new_pods: pod_interfaces(),
            pod_netns_dir: empty.clone(),
            ..Default::default()
        },
    )
    .expect("prerequisite missing: ipset and iptables");
    let report = dp.converge(&both, Scope::Kernel).expect("reconcile");
    let _ = std::fs::remove_dir_all(&empty);
    assert_eq!(report.failures.len(), 2, "{:?}", report.failures);
    assert!(
        report
            .failures
            .iter()
            .all(|f| (f.object == "x/a" || f.object == "x/n") && f.reason.contains("anti-spoofing")),
        "{:?}",
        report.failures
    );
    assert_eq!(
        echoes(&n, N, &a, A),
        (false, false),
        "pods whose ports were not found must stay isolated"
    );
    // Found once the namespaces are where the agent looks (the next write).
    let mut dp2 = NodeDataplane::start(
        &world.node,
        IptablesConfig {
            new_pods: pod_interfaces(),
            ..Default::default()
        },
    )
    .expect("iptables");
    let report = dp2.converge(&both, Scope::Kernel).expect("reconcile");
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert_eq!(echoes_within(&n, N, &a, A), (true, true));
    drop(dp);
}

/// A bridged node whose bridge-nf-call-iptables is off passes packets between the
/// bridge's pods without iptables: the iptables dataplane says so, naming the sysctl, in
/// its apply report and status, and says nothing once it is on.
#[test]
fn iptables_says_when_bridged_packets_bypass_it() {
    let mut world = BridgedNode::new("nf-off");
    world.plug("a", "lxcbra", A);
    let set = |v: &'static str| {
        let path = "/proc/sys/net/bridge/bridge-nf-call-iptables";
        run_in(&world.node, move || std::fs::write(path, v)).expect("sysctl");
    };
    set("0");
    let known = desired(vec![], vec![endpoint("x/a", A, None, None)]);
    let mut dp = NodeDataplane::start(
        &world.node,
        IptablesConfig {
            new_pods: pod_interfaces(),
            ..Default::default()
        },
    )
    .expect("prerequisite missing: ipset and iptables");
    let report = dp.converge(&known, Scope::Kernel).expect("reconcile");
    let named = report.failures.iter().any(|f| {
        f.object == "bridged pod traffic"
            && f.reason.contains("net.bridge.bridge-nf-call-iptables is 0")
    });
    assert!(named, "the sysctl is not named: {:?}", report.failures);
    let status = |dp: &NodeDataplane| {
        dp.status()
            .details
            .into_iter()
            .find(|(k, _)| k == "bridge_netfilter")
            .map(|(_, v)| v)
    };
    assert!(
        status(&dp).is_some_and(|v| v.starts_with("off: ")),
        "{:?}",
        status(&dp)
    );
    set("1");
    let report = dp.converge(&known, Scope::Kernel).expect("reconcile");
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert_eq!(status(&dp).as_deref(), Some("on"));
}

/// On a bridge, cli claims addresses that are not its own to its neighbours: an ARP reply
/// and an IPv6 neighbour advertisement naming db's address with cli's MAC (which would
/// take db's traffic), and a router advertisement (which would take everyone's). The
/// claims of its own addresses are the controls. Returns case → whether web received it.
fn neighbour_claims(dataplane: &str) -> BTreeMap<String, bool> {
    let lab = up(
        "claims",
        dataplane,
        "bridge",
        &[("world.yaml", SPOOF_WORLD)],
    );
    let (_node, pods) = state(&lab, "bridge");
    let (cli, db, web) = (&pods["red/cli"], &pods["red/db"], &pods["red/web"]);
    let cli_mac = raw::mac(&cli.netns, "eth0");
    let web_mac = raw::mac(&web.netns, "eth0");
    let v4 = |a: IpAddr| match a {
        IpAddr::V4(a) => a,
        IpAddr::V6(_) => panic!("{a} is not IPv4"),
    };
    let v6 = |a: IpAddr| match a {
        IpAddr::V6(a) => a,
        IpAddr::V4(_) => panic!("{a} is not IPv6"),
    };
    let link_local: std::net::Ipv6Addr = "fe80::c1".parse().unwrap();
    let mut frames: Vec<(String, Vec<u8>, String)> = Vec::new();
    for (whose, claimed4, claimed6) in [("db's", db.v4, db.v6), ("its own", cli.v4, cli.v6)] {
        let marker = format!("weir-claim-arp-{whose}");
        let arp = raw::arp_reply(
            cli_mac,
            v4(claimed4),
            web_mac,
            v4(web.v4),
            marker.as_bytes(),
        );
        frames.push((format!("ARP reply claiming {whose} address"), arp, marker));
        let marker = format!("weir-claim-na-{whose}");
        // After the header's 4 flag bytes (none set): the target, then the marker as an
        // option's bytes.
        let mut body = v6(claimed6).octets().to_vec();
        body.extend_from_slice(marker.as_bytes());
        let na = raw::icmp(cli.v6, web.v6, 136, 0, &body);
        let packet = raw::ipv6(v6(cli.v6), v6(web.v6), raw::IPPROTO_ICMPV6, 255, &na);
        frames.push((
            format!("neighbour advertisement of {whose} address"),
            raw::ethernet(web_mac, cli_mac, &[], &packet),
            marker,
        ));
    }
    let marker = "weir-claim-ra".to_string();
    // After the header's hop limit, flags and router lifetime (zero): the reachable and
    // retransmit times, then the marker as an option's bytes.
    let mut body = vec![0u8; 8];
    body.extend_from_slice(marker.as_bytes());
    let all_nodes: std::net::Ipv6Addr = "ff02::1".parse().unwrap();
    let ra = raw::icmp(link_local.into(), all_nodes.into(), 134, 0, &body);
    let packet = raw::ipv6(link_local, all_nodes, raw::IPPROTO_ICMPV6, 255, &ra);
    let all_nodes_mac = [0x33, 0x33, 0, 0, 0, 1];
    frames.push((
        "router advertisement".to_string(),
        raw::ethernet(all_nodes_mac, cli_mac, &[], &packet),
        marker,
    ));
    let mut out = BTreeMap::new();
    for (case, frame, marker) in frames {
        let sniffer = Sniffer::start(&web.netns, "eth0", marker.as_bytes());
        raw::send_frames(&cli.netns, "eth0", vec![frame.clone(), frame]);
        out.insert(case, sniffer.stop(LINGER) > 0);
    }
    out
}

/// eBPF closes every claim; iptables cannot see ARP, nor a neighbour advertisement's
/// target (no match reads it): those two pass there, as ARCHITECTURE.md and its
/// status (`neighbour_claims`) say, and are asserted so that a change is seen.
#[test]
fn a_pod_on_a_bridge_claims_only_its_own_addresses() {
    let mut wrong = Vec::new();
    for dataplane in ["ebpf", "iptables"] {
        let out = neighbour_claims(dataplane);
        assert_eq!(out.len(), 5, "{dataplane}: {out:?}");
        for (case, through) in out {
            let unchecked_on_iptables = case == "ARP reply claiming db's address"
                || case == "neighbour advertisement of db's address";
            let expected =
                case.contains("its own") || (dataplane == "iptables" && unchecked_on_iptables);
            if through != expected {
                let got = if through { "THROUGH" } else { "blocked" };
                wrong.push(format!("  {dataplane} {case}: {got}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "on a bridge, a pod's claims to addresses went otherwise than expected:\n{}",
        wrong.join("\n")
    );
}
