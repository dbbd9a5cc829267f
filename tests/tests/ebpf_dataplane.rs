//! The eBPF dataplane against the real kernel: pods in network namespaces, the real
//! classifiers attached to their host-side veths, Desired states built by hand.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};
use weir::dataplane::Scope;

use weir::dataplane::{
    ebpf::{monitor::Monitor, EbpfConfig, EbpfDataplane},
    Dataplane,
};
use weir_policy::desired::{Desired, Peer, Protocol, SetId};
use weir_tests::{
    desired::{addr_set, desired, endpoint, pod_set, port_rule, tcp_rule, whole_space_except},
    pods::{enter, World},
    probe::{check_whole_space_except, tcp_from, udp_from, EchoServers},
    require_root_and_tools, PinRoot,
};

const A: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 2);
const C: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 3);
const T: Duration = Duration::from_millis(500);

/// b admits TCP `first..=last` from a only; a admits nothing (so replies to a's own
/// connections must come through conntrack).
fn policy(first: u16, last: u16) -> Desired {
    desired(
        vec![pod_set(1, &[A])],
        vec![
            endpoint("x/a", A, Some(vec![]), None),
            endpoint(
                "x/b",
                B,
                Some(vec![tcp_rule(
                    Peer::Set(weir_policy::desired::SetId(1)),
                    first,
                    last,
                    "x/allow-a",
                    0,
                )]),
                None,
            ),
        ],
    )
}

/// Runs `f` with a dataplane created inside the world's node namespace.
fn with_dataplane<T: Send + 'static>(
    world: &World,
    root: &PinRoot,
    f: impl FnOnce(EbpfDataplane) -> T + Send + 'static,
) -> T {
    let node = world.node.clone();
    let root = root.0.clone();
    std::thread::spawn(move || {
        enter(&node);
        let dp = EbpfDataplane::new(EbpfConfig::with_pin_root(root)).expect("load dataplane");
        f(dp)
    })
    .join()
    .expect("dataplane thread panicked")
}

#[test]
fn probe_accepts_this_kernel() {
    require_root_and_tools();
    weir::dataplane::ebpf::probe().expect("verifier and kernel features");
}

#[test]
fn allowed_passes_denied_drops_replies_pass_and_changes_apply_live() {
    require_root_and_tools();
    let world = World::new("ebpf1", &[("a", A), ("b", B)]);
    let root = PinRoot::new("ebpf1");
    // 79 and 82 are one past each end of the range the rule is widened to below.
    let _servers = EchoServers::start(&world.pod("b").ns, &[79, 80, 81, 82]);
    let a_ns = world.pod("a").ns.clone();
    let to_b = |port| SocketAddr::from((B, port));

    // Without the dataplane everything flows (the world itself works).
    assert!(
        tcp_from(&a_ns, to_b(81), T),
        "world broken: a cannot reach b:81 without policy"
    );

    let (dp, ids) = with_dataplane(&world, &root, |mut dp| {
        let report = dp
            .converge(&policy(80, 80), Scope::Kernel)
            .expect("reconcile");
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        let ids = dp.program_ids().unwrap();
        (dp, ids)
    });
    let mut monitor = Monitor::open(&root.0, true).expect("monitor");

    assert!(
        tcp_from(&a_ns, to_b(80), T),
        "allowed a->b:80 (and its replies into isolated a) must pass"
    );
    assert!(!tcp_from(&a_ns, to_b(81), T), "a->b:81 must be dropped");
    assert!(
        !udp_from(&a_ns, to_b(80), T),
        "UDP a->b:80 must be dropped (rule is TCP)"
    );

    let mut events = Vec::new();
    monitor
        .poll(Duration::from_millis(200), |e| events.push(e))
        .unwrap();
    let dropped = events
        .iter()
        .find(|e| e.verdict == "drop" && e.dport == 81 && e.protocol == 6)
        .unwrap_or_else(|| panic!("no drop event for a->b:81 in {events:#?}"));
    assert_eq!((dropped.src, dropped.dst), (A.into(), B.into()));
    assert_eq!(dropped.direction, "ingress");
    assert_eq!(dropped.pod.as_deref(), Some("x/b"));
    assert_eq!(dropped.rule.as_deref(), Some("default deny"));
    let allow = events
        .iter()
        .find(|e| e.verdict == "allow" && e.dport == 80 && e.reason == "policy-allow")
        .unwrap_or_else(|| panic!("no allow event for a->b:80 in {events:#?}"));
    assert_eq!(allow.rule.as_deref(), Some("x/allow-a ingress rule 0"));
    assert_eq!(allow.src, std::net::IpAddr::from(A));
    let counts = dp.verdict_counts().expect("the verdict counters read");
    let denied = counts.denied.get(&weir_policy::desired::Direction::Ingress);
    assert!(
        denied.is_some_and(|n| *n >= 2),
        "the ingress default-deny counter must count the drops above: {counts:?}"
    );
    let allowed = counts.allowed.get(&(
        "x/allow-a".to_string(),
        weir_policy::desired::Direction::Ingress,
    ));
    assert!(
        allowed.is_some_and(|n| *n >= 1),
        "x/allow-a's ingress rule must count the allow above: {counts:?}"
    );

    // Widen the rule to 80-81: map updates only, same programs.
    let node = world.node.clone();
    let (dp, latency) = std::thread::spawn(move || {
        enter(&node);
        let mut dp = dp;
        let after = policy(80, 81);
        let started = Instant::now();
        let report = dp.converge(&after, Scope::Mirror).expect("apply");
        let latency = started.elapsed();
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        (dp, latency)
    })
    .join()
    .unwrap();
    eprintln!("map-update latency for one policy change (port 80 -> 80-81): {latency:?}");
    // The range's edges: its first and last port in, one past each end out.
    for (port, allowed) in [(79, false), (80, true), (81, true), (82, false)] {
        assert_eq!(
            tcp_from(&a_ns, to_b(port), T),
            allowed,
            "a->b:{port} with the rule at 80-81"
        );
    }
    assert_eq!(dp.program_ids().unwrap(), ids, "programs were reloaded");

    // Remove the rule (b stays isolated): new connections to 80 are dropped at once.
    let node = world.node.clone();
    let dp = std::thread::spawn(move || {
        enter(&node);
        let mut dp = dp;
        let after = desired(vec![], vec![endpoint("x/b", B, Some(vec![]), None)]);
        let report = dp.converge(&after, Scope::Mirror).expect("apply");
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        dp
    })
    .join()
    .unwrap();
    assert!(
        !tcp_from(&a_ns, to_b(80), T),
        "a->b:80 must be dropped once the rule is gone"
    );
    assert_eq!(dp.program_ids().unwrap(), ids, "programs were reloaded");
    drop(monitor);
}

/// a may send UDP to b on 80 and 82 (egress-isolated a, ingress-isolated a and b): the
/// echo reply and the ICMP port-unreachable for 82 (nobody listens) must reach a.
#[test]
fn udp_replies_and_icmp_errors_of_tracked_flows_pass() {
    require_root_and_tools();
    let world = World::new("ebpf3", &[("a", A), ("b", B)]);
    let root = PinRoot::new("ebpf3");
    let _servers = EchoServers::start(&world.pod("b").ns, &[80]);
    let udp = |first, last| port_rule(Protocol::Udp, Peer::Any, first, last, "x/udp", 0);
    let state = desired(
        vec![],
        vec![
            endpoint("x/a", A, Some(vec![]), Some(vec![udp(80, 82)])),
            endpoint("x/b", B, Some(vec![udp(80, 82)]), Some(vec![])),
        ],
    );
    let _dp = with_dataplane(&world, &root, move |mut dp| {
        let report = dp.converge(&state, Scope::Kernel).expect("reconcile");
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        dp
    });
    let a_ns = world.pod("a").ns.clone();
    assert!(
        udp_from(&a_ns, SocketAddr::from((B, 80)), T),
        "UDP echo reply must reach a"
    );
    let refused = weir_tests::pods::run_in(&a_ns, || {
        let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        s.connect((B, 82)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        s.send(b"weir").unwrap();
        let mut buf = [0u8; 4];
        s.recv(&mut buf).map_err(|e| e.kind())
    });
    assert_eq!(
        refused,
        Err(std::io::ErrorKind::ConnectionRefused),
        "the ICMP port unreachable of a tracked flow must reach a"
    );
    assert!(
        !tcp_from(&a_ns, SocketAddr::from((B, 80)), T),
        "TCP is not allowed"
    );
    assert!(
        tcp_from(&world.node, SocketAddr::from((B, 80)), T),
        "the node itself may always reach its pods"
    );
}

/// A POLICY map too small for the rules: the failure names the map and the pod, the
/// pod's direction is written whole or not at all (closed: it denies every peer until
/// its entries fit), and the status shows the pressure.
#[test]
fn a_full_map_is_a_named_failure() {
    require_root_and_tools();
    let world = World::new("ebpf4", &[("a", A), ("b", B)]);
    let root = PinRoot::new("ebpf4");
    let _servers = EchoServers::start(&world.pod("b").ns, &[80, 40000]);
    let node = world.node.clone();
    let config = EbpfConfig {
        policy_entries: 4,
        ..EbpfConfig::with_pin_root(root.0.clone())
    };
    let (report, status) = std::thread::spawn(move || {
        enter(&node);
        let mut dp = EbpfDataplane::new(config).expect("load dataplane");
        // 1-65535 is 16 prefixes: more than 4 entries.
        let state = desired(
            vec![],
            vec![
                endpoint("x/a", A, None, None),
                endpoint(
                    "x/b",
                    B,
                    Some(vec![tcp_rule(Peer::Any, 1, 65535, "x/wide", 0)]),
                    None,
                ),
            ],
        );
        (
            dp.converge(&state, Scope::Kernel).expect("reconcile"),
            dp.status(),
        )
    })
    .join()
    .unwrap();
    let failure = report
        .failures
        .iter()
        .find(|f| f.object == "map WEIR_POLICY (pod x/b)")
        .unwrap_or_else(|| panic!("no failure naming the map: {:?}", report.failures));
    assert!(failure.reason.contains("map is full"), "{}", failure.reason);
    assert!(
        failure.reason.contains("16 new entries") && failure.reason.contains("denies every peer"),
        "{}",
        failure.reason
    );
    assert_eq!(report.failures.len(), 1, "one failure, not one per entry");
    let pressure = status
        .details
        .iter()
        .find(|(k, _)| k == "map_pressure.WEIR_POLICY")
        .map(|(_, v)| v.as_str());
    assert_eq!(
        pressure,
        Some("0/4 (0.0%)"),
        "nothing of b's ingress is written"
    );
    // b's ingress is isolated with none of its entries: closed, not half open (the four
    // widest prefixes, 4096-65535, would have fitted).
    let a_ns = world.pod("a").ns.clone();
    for port in [80, 40000] {
        assert!(
            !tcp_from(&a_ns, SocketAddr::from((B, port)), T),
            "b's closed ingress admits TCP {port}"
        );
    }
}

/// The same enforcement over IPv6 (neighbor discovery keeps working for isolated pods).
#[test]
fn ipv6_allowed_passes_denied_drops_replies_pass() {
    require_root_and_tools();
    let world = World::new("ebpf5", &[("a", A), ("b", B)]);
    let root = PinRoot::new("ebpf5");
    let _servers = EchoServers::start_v6(&world.pod("b").ns, &[80, 81]);
    let (a6, b6) = (world.pod("a").ip6, world.pod("b").ip6);
    let mut a = endpoint("x/a", A, Some(vec![]), None);
    let mut b = endpoint(
        "x/b",
        B,
        Some(vec![tcp_rule(Peer::Set(SetId(6)), 80, 80, "x/allow-a6", 0)]),
        None,
    );
    (a.ipv6, b.ipv6) = (Some(a6), Some(b6));
    let state = desired(vec![addr_set(6, [IpAddr::V6(a6)])], vec![a, b]);
    let a_ns = world.pod("a").ns.clone();
    let to_b = |port| SocketAddr::from((b6, port));
    // Neighbor discovery settles within a few tries.
    let ready = (0..10).any(|_| tcp_from(&a_ns, to_b(81), T));
    assert!(ready, "world broken: no IPv6 a->b:81 without policy");
    let _dp = with_dataplane(&world, &root, move |mut dp| {
        let report = dp.converge(&state, Scope::Kernel).expect("reconcile");
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        dp
    });
    assert!(
        tcp_from(&a_ns, to_b(80), T),
        "allowed [a]->[b]:80 over IPv6 must pass"
    );
    assert!(
        !tcp_from(&a_ns, to_b(81), T),
        "[a]->[b]:81 over IPv6 must be dropped"
    );
}

/// `weir monitor --output json` (the real binary) streams a flood of drops, rate-limited
/// per CPU; the rest are only counted.
#[test]
fn weir_monitor_streams_rate_limited_drop_events_as_json() {
    require_root_and_tools();
    let weir = weir_tests::weir_bin::path().expect("weir binary");
    let world = World::new("ebpf6", &[("a", A), ("b", B)]);
    let root = PinRoot::new("ebpf6");
    let node = world.node.clone();
    let config = EbpfConfig {
        events_per_sec: 5,
        ..EbpfConfig::with_pin_root(root.0.clone())
    };
    let dp = std::thread::spawn(move || {
        enter(&node);
        let mut dp = EbpfDataplane::new(config).expect("load dataplane");
        // a is known (not isolated): an unknown pod interface would be isolated itself.
        let state = desired(
            vec![],
            vec![
                endpoint("x/a", A, None, None),
                endpoint("x/b", B, Some(vec![]), None),
            ],
        );
        let report = dp.converge(&state, Scope::Kernel).expect("reconcile");
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        dp
    })
    .join()
    .unwrap();
    let mut monitor = std::process::Command::new(weir)
        .args(["monitor", "--output", "json", "--bpf-root"])
        .arg(&root.0)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start weir monitor");
    // Its ready line comes once the ring buffer is open and SIGTERM is handled; a fixed
    // sleep was too short on a software-emulated kernel (the kernel matrix).
    let mut ready = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(monitor.stderr.take().unwrap()),
        &mut ready,
    )
    .unwrap();
    assert!(
        ready.starts_with("weir monitor: streaming"),
        "weir monitor did not start: {ready:?}"
    );
    weir_tests::pods::run_in(&world.pod("a").ns, || {
        let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..100 {
            s.send_to(b"flood", (B, 81)).unwrap();
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(monitor.id() as i32, libc::SIGTERM) };
    let out = monitor.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "weir monitor failed: {:?}",
        out.status
    );
    let events: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
        .collect();
    let drops: Vec<_> = events
        .iter()
        .filter(|e| e["verdict"] == "drop" && e["dport"] == 81)
        .collect();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(!drops.is_empty(), "no drop event in {events:?}");
    assert!(
        drops.len() <= 10 * cpus,
        "rate limit not applied: {} events",
        drops.len()
    );
    let e = drops[0];
    assert_eq!(e["src"], A.to_string());
    assert_eq!(e["dst"], B.to_string());
    assert_eq!(e["protocol"], 17);
    assert_eq!(e["direction"], "ingress");
    assert_eq!(e["pod"], "x/b");
    let suppressed = dp
        .counters()
        .into_iter()
        .find(|(name, _, _)| name == "events-suppressed")
        .map(|(_, packets, _)| packets);
    assert!(
        suppressed.unwrap_or(0) > 0,
        "a flood must be counted, not all sent"
    );
}

/// ipBlock 0.0.0.0/0 and ::/0 except c, as the iptables dataplane's test runs it: the
/// IPv4 block is the trie's IPv4-mapped /96, IPv6's the /0, and each except a longer
/// prefix that maps to no set.
#[test]
fn ip_block_excepts_carve_holes_out_of_the_whole_address_space() {
    require_root_and_tools();
    let world = World::new("ebpf6", &[("a", A), ("b", B), ("c", C)]);
    let root = PinRoot::new("ebpf6");
    let ip = |pod: &str| (world.pod(pod).ip, world.pod(pod).ip6);
    // Bound to [::]: one server for both families.
    let _servers = EchoServers::start_v6(&world.pod("b").ns, &[80]);
    let state = whole_space_except(ip("a"), ip("b"), ip("c"));
    assert!(
        tcp_from(&world.pod("a").ns, SocketAddr::from((B, 80)), T),
        "world broken: a cannot reach b:80 without policy"
    );
    let _dp = with_dataplane(&world, &root, move |mut dp| {
        let report = dp.converge(&state, Scope::Kernel).expect("reconcile");
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        dp
    });
    check_whole_space_except(&world, B, world.pod("b").ip6);
}

/// An interface that is there before its pod is known, under a name the new-pod isolation
/// does not cover (the reference CNI plugins' `veth…`), first carries `weir_to_pod` on its
/// egress as every other interface of the node does; when its pod is then placed there,
/// the pod keeps that hook. Before: the same converge detached it as the interface's old
/// role, and the pod's ingress policy judged nothing (a real kubelet cluster with the ptp
/// plugin showed it: denied pods connected while the agent reported itself converged).
#[test]
fn a_pod_placed_on_an_interface_seen_before_it_keeps_its_ingress_hook() {
    require_root_and_tools();
    let world = World::new("ebpfseen", &[("a", A), ("b", B)]);
    let root = PinRoot::new("ebpfseen");
    let _servers = EchoServers::start(&world.pod("b").ns, &[80, 81]);
    let a_ns = world.pod("a").ns.clone();
    let node = world.node.clone();
    let pin_root = root.0.clone();
    let dp = std::thread::spawn(move || {
        enter(&node);
        let config = EbpfConfig {
            new_pods: weir::dataplane::new_pods::NewPodIsolation::off(),
            ..EbpfConfig::with_pin_root(pin_root)
        };
        let mut dp = EbpfDataplane::new(config).expect("load dataplane");
        // b's interface exists, b is not known yet: the interface is the node's.
        let only_a = desired(vec![], vec![endpoint("x/a", A, None, None)]);
        for state in [&only_a, &policy(80, 80), &policy(80, 80)] {
            let report = dp.converge(state, Scope::Kernel).expect("converge");
            assert!(report.failures.is_empty(), "{:?}", report.failures);
        }
        dp
    })
    .join()
    .expect("dataplane thread panicked");
    let to_b = |port| SocketAddr::from((B, port));
    assert!(tcp_from(&a_ns, to_b(80), T), "allowed a->b:80 must pass");
    assert!(
        !tcp_from(&a_ns, to_b(81), T),
        "b's ingress policy must judge a->b:81 (dropped)"
    );
    drop(dp);
}
