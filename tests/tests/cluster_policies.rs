//! ClusterNetworkPolicy's Admin and Baseline tiers, enforced with real packets by the lab's
//! agent on both dataplanes: every probe of the netpol world, over IPv4 and IPv6, must
//! connect exactly when weir's verdict on the lab's objects allows it, through a change of
//! action and a policy's removal, and the two dataplanes' matrices must be identical.

use std::collections::BTreeMap;
use std::net::IpAddr;

use weir_policy::desired::Protocol;
use weir_policy::{manifest, verdict, Engine};
use weir_tests::lab::{manifest as write_manifest, netpol_world, Lab, Matrix};

/// Admin for x's pods (ingress: a port Deny, a Pass, an Accept over a NetworkPolicy, a
/// Deny over ranges; egress: a named-port Deny), a NetworkPolicy on x/b behind the Pass,
/// and a Baseline for every pod c (a Pass, a Deny by port; egress Denies over a port range
/// and over blocks).
const TIERS: &str = r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: admin-x}
spec:
  tier: Admin
  priority: 10
  subject: {namespaces: {matchLabels: {ns: x}}}
  ingress:
  - {name: deny-y-web, action: Deny, from: [{namespaces: {matchLabels: {ns: y}}}], protocols: [{tcp: {destinationPort: {number: 80}}}]}
  - {name: pass-y, action: Pass, from: [{namespaces: {matchLabels: {ns: y}}}]}
  - {name: accept-z-a, action: Accept, from: [{pods: {namespaceSelector: {matchLabels: {ns: z}}, podSelector: {matchLabels: {pod: a}}}}]}
  - {name: deny-z, action: Deny, from: [{namespaces: {matchLabels: {ns: z}}}], protocols: [{udp: {destinationPort: {range: {start: 80, end: 81}}}}, {sctp: {destinationPort: {number: 81}}}]}
  egress:
  - {name: deny-z-named, action: Deny, to: [{namespaces: {matchLabels: {ns: z}}}], protocols: [{destinationNamedPort: serve-81-tcp}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: b-from-y, namespace: x}
spec:
  podSelector: {matchLabels: {pod: b}}
  ingress: [{from: [{namespaceSelector: {matchLabels: {ns: y}}}], ports: [{port: 81}]}]
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: baseline-c}
spec:
  tier: Baseline
  priority: 5
  subject: {pods: {namespaceSelector: {}, podSelector: {matchLabels: {pod: c}}}}
  ingress:
  - {action: Pass, from: [{namespaces: {matchLabels: {ns: y}}}]}
  - {action: Deny, from: [{namespaces: {}}], protocols: [{sctp: {destinationPort: {number: 80}}}, {udp: {destinationPort: {number: 81}}}]}
  egress:
  - {action: Deny, to: [{pods: {namespaceSelector: {matchLabels: {ns: y}}, podSelector: {matchLabels: {pod: a}}}}], protocols: [{tcp: {destinationPort: {range: {start: 80, end: 81}}}}]}
  - {action: Deny, to: [{networks: [10.244.0.0/16, "fd00:10:244::/64"]}], protocols: [{udp: {destinationPort: {number: 80}}}]}
"#;

fn protocol(name: &str) -> Protocol {
    match name {
        "TCP" => Protocol::Tcp,
        "UDP" => Protocol::Udp,
        "SCTP" => Protocol::Sctp,
        other => panic!("probe protocol {other}"),
    }
}

/// What weir's verdict on the lab's current objects says of each probe of `matrix`.
fn expected(lab: &Lab, matrix: &Matrix, v6: bool) -> Matrix {
    let path = lab.dir.join("objects.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let objects = manifest::parse_named(&path.display().to_string(), &text).unwrap();
    let mut engine = Engine::new(None);
    let (_, refused) = engine.load(objects);
    assert!(refused.is_empty(), "{refused:?}");
    let addresses: BTreeMap<String, (IpAddr, IpAddr)> = lab.pod_addresses();
    matrix
        .keys()
        .map(|key @ (from, to, port, proto)| {
            let to = if v6 { addresses[to].1 } else { addresses[to].0 };
            let v = verdict(engine.desired(), from, to, *port, protocol(proto)).unwrap();
            (key.clone(), v.allowed)
        })
        .collect()
}

/// Probes both families; returns the matrices and every probe that disagrees with weir's
/// verdict.
fn probe(lab: &Lab, dataplane: &str, step: &str) -> (Vec<Matrix>, Vec<String>) {
    let mut matrices = Vec::new();
    let mut wrong = Vec::new();
    for (family, v6) in [("ipv4", false), ("ipv6", true)] {
        let (running, matrix) = lab.probe(&["--family", family]).unwrap();
        assert_eq!(running, dataplane);
        let want = expected(lab, &matrix, v6);
        for (key, connected) in &matrix {
            if want[key] != *connected {
                wrong.push(format!(
                    "{dataplane} {step} {family}: {key:?} connected {connected}, weir's verdict {}",
                    want[key]
                ));
            }
        }
        matrices.push(matrix);
    }
    (matrices, wrong)
}

fn tiers_on(dataplane: &str) -> Vec<Vec<Matrix>> {
    let lab = Lab::new(&format!("cnp-{dataplane}"));
    let tiers = write_manifest(&lab, "tiers.yaml", TIERS);
    lab.weir(&[
        "up",
        "--dataplane",
        dataplane,
        netpol_world().to_str().unwrap(),
        tiers.to_str().unwrap(),
    ])
    .unwrap();
    let mut steps = Vec::new();
    let mut wrong = Vec::new();
    let (matrices, w) = probe(&lab, dataplane, "tiers");
    // The tiers decide, and not all the same way.
    let ipv4 = &matrices[0];
    let at = |from: &str, to: &str, port: u16, proto: &str| {
        ipv4[&(from.to_string(), to.to_string(), port, proto.to_string())]
    };
    assert!(!at("y/a", "x/a", 80, "TCP"), "Admin Deny");
    assert!(at("y/a", "x/a", 81, "TCP"), "Admin Pass, nothing else");
    assert!(
        at("y/a", "x/b", 81, "TCP"),
        "Admin Pass, the NetworkPolicy allows"
    );
    assert!(
        !at("y/a", "x/b", 81, "UDP"),
        "Admin Pass, the NetworkPolicy denies"
    );
    assert!(
        at("z/a", "x/b", 80, "UDP"),
        "Admin Accept over the NetworkPolicy"
    );
    assert!(!at("z/b", "x/a", 81, "SCTP"), "Admin Deny");
    assert!(
        !at("x/a", "z/b", 81, "TCP"),
        "Admin egress Deny by named port"
    );
    assert!(!at("z/a", "y/c", 80, "SCTP"), "Baseline Deny");
    assert!(!at("x/c", "y/a", 81, "TCP"), "Baseline egress Deny");
    wrong.extend(w);
    steps.push(matrices);
    // The verdict stream names the Deny rule that dropped, on both dataplanes.
    let named = "Admin tier clusternetworkpolicy admin-x ingress rule 0 (Deny)";
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let log = std::fs::read_to_string(lab.dir.join("agent.log")).unwrap_or_default();
        let found = log
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .any(|r| {
                r["verdict"] == "drop"
                    && r["pod"] == "x/a"
                    && r["dport"] == 80
                    && r["rule"] == named
            });
        if found {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{dataplane}: no drop record names {named:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }

    // Pass becomes Deny: y loses x entirely.
    let changed = write_manifest(
        &lab,
        "tiers.yaml",
        &TIERS.replace("name: pass-y, action: Pass", "name: pass-y, action: Deny"),
    );
    lab.weir(&["apply", changed.to_str().unwrap()]).unwrap();
    let (matrices, w) = probe(&lab, dataplane, "pass-to-deny");
    assert!(!matrices[0][&("y/a".to_string(), "x/b".to_string(), 81, "TCP".to_string())]);
    wrong.extend(w);
    steps.push(matrices);

    // The Admin policy goes: the NetworkPolicy and the Baseline remain.
    let admin = write_manifest(&lab, "admin.yaml", TIERS.split("---").next().unwrap());
    lab.weir(&["delete", admin.to_str().unwrap()]).unwrap();
    let (matrices, w) = probe(&lab, dataplane, "admin-deleted");
    wrong.extend(w);
    steps.push(matrices);

    if dataplane == "iptables" {
        // The tiers again, an Admin Pass among them, then reset under them.
        let again = write_manifest(&lab, "again.yaml", TIERS);
        lab.weir(&["apply", again.to_str().unwrap()]).unwrap();
        reset_leaves_nothing(&lab);
    }
    lab.weir(&["down"]).unwrap();
    assert!(
        wrong.is_empty(),
        "{} probes disagree:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    steps
}

/// The agent frozen, `weir reset` in the node removes every chain and set, the tiers'
/// passed chains (`-g` targets) included.
fn reset_leaves_nothing(lab: &Lab) {
    let node = lab.node_netns();
    let in_node = |program: &str, args: &[&str]| {
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", &node, program])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("prerequisite missing: {program}: {e}"));
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let weir_state = || {
        let mut found = Vec::new();
        for save in [
            "iptables-legacy-save",
            "iptables-nft-save",
            "ip6tables-legacy-save",
            "ip6tables-nft-save",
        ] {
            found.extend(
                in_node(save, &[])
                    .1
                    .lines()
                    .filter(|l| l.contains("WEIR"))
                    .map(str::to_string),
            );
        }
        found.extend(
            in_node("ipset", &["list", "-n"])
                .1
                .lines()
                .filter(|l| l.starts_with("weir"))
                .map(str::to_string),
        );
        found
    };
    assert!(
        weir_state().iter().any(|l| l.starts_with(":WEIR-IP-")),
        "the Admin Pass made no passed chain: {:#?}",
        weir_state()
    );
    lab.weir(&["agent", "signal", "stop"]).unwrap();
    let weir = weir_tests::weir_bin::path().unwrap();
    let (ok, report) = in_node(weir.to_str().unwrap(), &["reset", "--output", "json"]);
    assert!(ok, "weir reset failed: {report}");
    let left = weir_state();
    lab.weir(&["agent", "signal", "cont"]).unwrap();
    assert!(left.is_empty(), "weir reset left: {left:#?}");
}

#[test]
fn both_dataplanes_enforce_the_tiers_as_weir_decides() {
    let iptables = tiers_on("iptables");
    let ebpf = tiers_on("ebpf");
    assert!(iptables == ebpf, "the dataplanes' matrices differ");
}

/// Guards on the node, after upstream's CNP{Admin,Baseline}TierEgressNodePeers: Admin, for
/// x: Deny port 80 (a `nodes` peer for TCP, a `networks` one for UDP), Accept 81/TCP and
/// Pass 81/UDP (`nodes`); Baseline, for every pod: Deny 81/TCP (`nodes`) and 81/UDP
/// (`networks`). And a NetworkPolicy isolating y/a's egress, which lets y/a reach its node
/// whatever it allows.
const NODE_GUARDS: &str = r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: node-guard}
spec:
  tier: Admin
  priority: 1
  subject: {namespaces: {matchLabels: {ns: x}}}
  egress:
  - {name: no-node-web, action: Deny, to: [{nodes: {matchLabels: {guarded: "yes"}}}], protocols: [{tcp: {destinationPort: {number: 80}}}]}
  - {name: no-node-dns, action: Deny, to: [{networks: [GW4/32, "GW6/128"]}], protocols: [{udp: {destinationPort: {number: 80}}}]}
  - {name: node-metrics, action: Accept, to: [{nodes: {matchLabels: {guarded: "yes"}}}], protocols: [{tcp: {destinationPort: {number: 81}}}]}
  - {name: node-floor-decides, action: Pass, to: [{nodes: {matchLabels: {guarded: "yes"}}}], protocols: [{udp: {destinationPort: {number: 81}}}]}
---
apiVersion: v1
kind: Node
metadata: {name: guarded, labels: {guarded: "yes"}}
status: {addresses: [{type: InternalIP, address: GW4}, {type: InternalIP, address: "GW6"}]}
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: node-floor}
spec:
  tier: Baseline
  priority: 1
  subject: {namespaces: {}}
  egress:
  - {action: Deny, to: [{nodes: {matchLabels: {guarded: "yes"}}}], protocols: [{tcp: {destinationPort: {number: 81}}}]}
  - {action: Deny, to: [{networks: [0.0.0.0/0, "::/0"]}], protocols: [{udp: {destinationPort: {number: 81}}}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-out, namespace: y}
spec:
  podSelector: {matchLabels: {pod: a}}
  policyTypes: [Egress]
  egress: [{ports: [{port: 80, protocol: TCP}]}]
"#;

/// The node's global addresses on its bridge (the pods' gateways): IPv4, IPv6.
fn bridge_addresses(node: &str) -> (IpAddr, IpAddr) {
    let out = std::process::Command::new("ip")
        .args(["-n", node, "-j", "addr", "show", "dev", "cni0"])
        .output()
        .expect("prerequisite missing: ip (apt-get install iproute2)");
    let links: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ip -j addr");
    let addrs: Vec<IpAddr> = links[0]["addr_info"]
        .as_array()
        .expect("cni0's addresses")
        .iter()
        .filter(|a| a["scope"] == "global")
        .filter_map(|a| a["local"].as_str()?.parse().ok())
        .collect();
    let v4 = addrs.iter().find(|a| a.is_ipv4()).expect("an IPv4 gateway");
    let v6 = addrs.iter().find(|a| a.is_ipv6()).expect("an IPv6 gateway");
    (*v4, *v6)
}

/// Every pod to each of its node's bridge addresses, TCP (and UDP over IPv4) to ports 80
/// and 81: (pod, address, port, protocol) → connected; and every one that disagrees with
/// weir's verdict (`egress_to_node`).
fn node_matrix(dataplane: &str) -> (BTreeMap<String, bool>, Vec<String>) {
    let lab = Lab::new(&format!("cnp-node-{dataplane}"));
    lab.weir(&[
        "up",
        "--dataplane",
        dataplane,
        "--topology",
        "bridge",
        netpol_world().to_str().unwrap(),
    ])
    .unwrap();
    let node = lab.node_netns();
    let (gw4, gw6) = bridge_addresses(&node);
    // kube-proxy's ipvs mode puts Service addresses on kube-ipvs0: local, not the node's.
    let service: IpAddr = "10.96.0.10".parse().unwrap();
    // A dummy device as kube-proxy makes it, or an ifb where the kernel has no dummy
    // (the host's): the name is what tells it apart.
    let node_ns = weir_tests::netns::NetNs::attach(&node);
    let refused: Vec<String> = ["dummy", "ifb"]
        .iter()
        .map_while(|kind| {
            let add = ["link", "add", "kube-ipvs0", "type", kind];
            node_ns.ok("ip", &add, None).err().map(|e| e.to_string())
        })
        .collect();
    assert!(
        refused.len() < 2,
        "prerequisite missing: a dummy or ifb device in the kernel: {refused:?}"
    );
    node_ns
        .ok(
            "ip",
            &["addr", "add", "10.96.0.10/32", "dev", "kube-ipvs0"],
            None,
        )
        .unwrap();
    let guards = write_manifest(
        &lab,
        "guards.yaml",
        &NODE_GUARDS
            .replace("GW4", &gw4.to_string())
            .replace("GW6", &gw6.to_string()),
    );
    lab.weir(&["apply", guards.to_str().unwrap()]).unwrap();
    if dataplane == "iptables" {
        // WEIR-TO-NODE sends to the tiers only what goes to these sets (see
        // node_addresses; a Service address is judged after IPVS, by its backend).
        let member = |set: &str, a: IpAddr| {
            let test = node_ns.run("ipset", &["test", set, &a.to_string()], None);
            test.expect("prerequisite missing: ipset (apt-get install ipset)")
                .success
        };
        assert!(member("weir-node-4", gw4), "the node's address {gw4}");
        assert!(member("weir-node-6", gw6), "the node's address {gw6}");
        assert!(!member("weir-node-4", service), "kube-ipvs0's {service}");
    }
    let path = lab.dir.join("objects.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut engine = Engine::new(None);
    let (_, refused) = engine.load(manifest::parse_named("objects.yaml", &text).unwrap());
    assert!(refused.is_empty(), "{refused:?}");
    // Dual-stack listeners ([::] takes IPv4 too).
    let _listeners = weir_tests::probe::EchoServers::start_v6(&node, &[80, 81]);
    let timeout = std::time::Duration::from_millis(700);
    let mut matrix = BTreeMap::new();
    let mut wrong = Vec::new();
    for pod in lab.pod_addresses().keys() {
        let (ns, _) = lab.pod(pod);
        for (addr, port, proto) in [gw4, gw6]
            .into_iter()
            .flat_map(|a| [80, 81].map(|p| (a, p)))
            .flat_map(|(a, p)| [(a, p, "TCP"), (a, p, "UDP")])
            .filter(|(a, _, proto)| a.is_ipv4() || *proto == "TCP")
        {
            let to = std::net::SocketAddr::new(addr, port);
            let got = match proto {
                "TCP" => weir_tests::probe::tcp_from(&ns, to, timeout),
                _ => weir_tests::probe::udp_from(&ns, to, timeout),
            };
            let want = verdict::egress_to_node(engine.desired(), pod, addr, port, protocol(proto))
                .unwrap()
                .allowed;
            if got != want {
                wrong.push(format!(
                    "{dataplane}: {pod} -> node {to} {proto}: connected {got}, weir's verdict {want}"
                ));
            }
            matrix.insert(format!("{pod} -> {addr} {port}/{proto}"), got);
        }
    }
    let at = |pod: &str, port: u16, proto: &str| matrix[&format!("{pod} -> {gw4} {port}/{proto}")];
    assert!(
        !at("x/a", 80, "TCP"),
        "{dataplane}: Admin Deny to the node (nodes)"
    );
    assert!(
        !at("x/a", 80, "UDP"),
        "{dataplane}: Admin Deny to the node (networks)"
    );
    assert!(
        !at("x/a", 81, "UDP"),
        "{dataplane}: Admin Pass, then Baseline Deny to the node (networks)"
    );
    assert!(
        at("x/a", 81, "TCP"),
        "{dataplane}: Admin Accept to the node over a Baseline Deny (nodes)"
    );
    assert!(
        !at("z/a", 81, "TCP"),
        "{dataplane}: Baseline Deny to the node (nodes)"
    );
    assert!(at("z/a", 80, "TCP"), "{dataplane}: nothing stops z/a on 80");
    assert!(
        at("y/a", 81, "TCP"),
        "{dataplane}: a NetworkPolicy never stops a pod reaching its node"
    );
    lab.weir(&["down"]).unwrap();
    (matrix, wrong)
}

/// A pod's traffic to its own node: the tiers judge it (a `networks` Deny on the node's
/// addresses holds), the NetworkPolicies never stop it, on both dataplanes alike.
#[test]
fn the_tiers_judge_a_pods_traffic_to_its_node_on_both_dataplanes() {
    let (iptables, mut wrong) = node_matrix("iptables");
    let (ebpf, w) = node_matrix("ebpf");
    wrong.extend(w);
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert_eq!(iptables, ebpf, "the dataplanes' matrices differ");
}

/// `kubectl` as the lab's admin, inside the node namespace where the API server listens.
fn kubectl(lab: &Lab, args: &[&str]) {
    let kubeconfig = lab.dir.join("api/kubeconfig-admin");
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.node_netns(),
            "kubectl",
            "--kubeconfig",
        ])
        .arg(&kubeconfig)
        .args(args)
        .output()
        .expect(
            "prerequisite missing: ip and kubectl (apt-get install iproute2 kubernetes-client)",
        );
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Waits until the CRD `crd` is Established (`kubectl wait` fails at once while the new
/// CRD has no conditions yet).
fn wait_established(lab: &Lab, crd: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let kubeconfig = lab.dir.join("api/kubeconfig-admin");
    loop {
        let out = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &lab.node_netns(),
                "kubectl",
                "--kubeconfig",
            ])
            .arg(&kubeconfig)
            .args([
                "wait",
                "--for=condition=Established",
                "--timeout=10s",
                &format!("crd/{crd}"),
            ])
            .output()
            .expect("prerequisite missing: ip and kubectl");
        if out.status.success() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "crd/{crd} not Established: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
}

fn connected(lab: &Lab, from: &str, to: &str, port: u16, proto: &str) -> bool {
    let (_, matrix) = lab.probe(&["--family", "ipv4"]).unwrap();
    matrix[&(from.to_string(), to.to_string(), port, proto.to_string())]
}

/// Against the real kube-apiserver: the lab installs deploy/crds/'s CRD, the agent lists
/// and watches the policies and enforces them as weir decides. Without the CRD the agent
/// says so once and goes on enforcing the rest; installed again, it is picked up. Replaced
/// by the pinned network-policy-api release's CRD (v1beta1 stored, v1alpha2 served), the
/// agent watches v1beta1 and enforces the policies stored there.
#[test]
fn in_cluster_mode_they_are_watched_and_a_missing_crd_is_no_failure() {
    let lab = Lab::new("cnp-api");
    let tiers = write_manifest(&lab, "tiers.yaml", TIERS);
    lab.weir(&[
        "up",
        "--api",
        "server",
        "--dataplane",
        "ebpf",
        netpol_world().to_str().unwrap(),
        tiers.to_str().unwrap(),
    ])
    .unwrap();
    let (matrices, wrong) = probe(&lab, "ebpf", "cluster");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    let key = |from: &str, to: &str, port, proto: &str| {
        (from.to_string(), to.to_string(), port, proto.to_string())
    };
    assert!(!matrices[0][&key("y/a", "x/a", 80, "TCP")], "Admin Deny");

    let crd = "clusternetworkpolicies.policy.networking.k8s.io";
    kubectl(&lab, &["delete", "crd", crd, "--wait=true"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !connected(&lab, "y/a", "x/a", 80, "TCP") {
        assert!(
            std::time::Instant::now() < deadline,
            "the tiers outlived their CRD"
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    // The NetworkPolicy stays enforced: x/b takes only TCP 81 from y.
    assert!(!connected(&lab, "y/a", "x/b", 81, "UDP"));
    assert!(connected(&lab, "y/a", "x/b", 81, "TCP"));
    let log = std::fs::read_to_string(lab.dir.join("agent.log")).unwrap();
    assert_eq!(
        log.matches("ClusterNetworkPolicy CRD (clusternetworkpolicies.policy.networking.k8s.io, v1beta1 or v1alpha2) is not installed").count(),
        1,
        "said once: {log}"
    );

    // Installed again, and the policies written again (changed, so the lab writes them).
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/crds/policy.networking.k8s.io_clusternetworkpolicies.yaml");
    kubectl(&lab, &["apply", "-f", shipped.to_str().unwrap()]);
    wait_established(&lab, crd);
    let again = write_manifest(
        &lab,
        "tiers.yaml",
        &TIERS
            .replace("priority: 10", "priority: 11")
            .replace("priority: 5", "priority: 6"),
    );
    lab.weir(&["apply", again.to_str().unwrap()]).unwrap();
    let (matrices, wrong) = probe(&lab, "ebpf", "reinstalled");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(
        !matrices[0][&key("y/a", "x/a", 80, "TCP")],
        "Admin Deny again"
    );

    // A release that serves v1beta1 only (the pinned one's CRD, experimental channel as
    // v0.3.0 moved destinationNamedPort there, with v1alpha2 no longer served): the agent
    // watches v1beta1, and enforces the policies kubectl writes there.
    kubectl(&lab, &["delete", "crd", crd, "--wait=true"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !connected(&lab, "y/a", "x/a", 80, "TCP") {
        assert!(
            std::time::Instant::now() < deadline,
            "the tiers outlived their CRD"
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    let pinned =
        std::fs::read_to_string(weir_tests::lab::pinned_cluster_policy_crd("experimental"))
            .unwrap();
    let alpha = pinned.find("name: v1alpha2").expect("the CRD has v1alpha2");
    let served = alpha
        + pinned[alpha..]
            .find("served: true")
            .expect("v1alpha2 is served");
    let beta_only = format!(
        "{}served: false{}",
        &pinned[..served],
        &pinned[served + "served: true".len()..]
    );
    let beta_only_crd = write_manifest(&lab, "crd-v1beta1-only.yaml", &beta_only);
    kubectl(&lab, &["apply", "-f", beta_only_crd.to_str().unwrap()]);
    wait_established(&lab, crd);
    // What the lab last wrote (its objects.yaml, which the verdicts are made from), at
    // v1beta1.
    let cluster_policies: Vec<String> = TIERS
        .replace("priority: 10", "priority: 11")
        .replace("priority: 5", "priority: 6")
        .replace(
            "policy.networking.k8s.io/v1alpha2",
            "policy.networking.k8s.io/v1beta1",
        )
        // kubectl reads YAML 1.1, where a bare y is a boolean.
        .replace("ns: y}", "ns: \"y\"}")
        .split("\n---\n")
        .filter(|d| d.contains("kind: ClusterNetworkPolicy"))
        .map(str::to_string)
        .collect();
    let beta = write_manifest(
        &lab,
        "tiers-v1beta1.yaml",
        &cluster_policies.join("\n---\n"),
    );
    kubectl(&lab, &["apply", "-f", beta.to_str().unwrap()]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while connected(&lab, "y/a", "x/a", 80, "TCP") {
        assert!(
            std::time::Instant::now() < deadline,
            "the policies at v1beta1 were not enforced"
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    let (_, wrong) = probe(&lab, "ebpf", "v1beta1");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    let log = std::fs::read_to_string(lab.dir.join("agent.log")).unwrap();
    let listed: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("listed ClusterNetworkPolicies"))
        .collect();
    assert!(
        listed.first().is_some_and(|l| l.contains("v1alpha2"))
            && listed.last().is_some_and(|l| l.contains("v1beta1")),
        "v1alpha2 while only that was served, then v1beta1: {listed:?}"
    );
    lab.weir(&["down"]).unwrap();
}
