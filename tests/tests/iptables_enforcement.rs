//! The ipset/iptables dataplane enforcing real traffic between pod network namespaces
//! through a node namespace: the flows of the eBPF dataplane tests with the same
//! verdicts, plus both iptables backends, ipBlock excepts (and /0 blocks), traffic from
//! the node itself (always allowed), deltas and restarts.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};
use weir::dataplane::Scope;

use weir::dataplane::iptables::IptablesConfig;
use weir::dataplane::new_pods::NewPodIsolation;
use weir::netfilter::backend::Backend;
use weir_policy::desired::{Desired, Peer, Protocol, SetId};
use weir_tests::desired::{
    addr_set, desired, endpoint, pod_set, port_rule, tcp_rule, whole_space_except,
};
use weir_tests::node_dataplane::NodeDataplane;
use weir_tests::pods::{run_in, World};
use weir_tests::probe::{check_whole_space_except, tcp_from, udp_from, EchoServers};
use weir_tests::require_root_and_tools;

const A: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 2);
const C: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 3);
const T: Duration = Duration::from_millis(500);

/// b admits TCP `first..=last` from a only; a admits nothing (so replies to a's own
/// connections must come through conntrack). The eBPF tests' policy.
fn policy(first: u16, last: u16) -> Desired {
    desired(
        vec![pod_set(1, &[A])],
        vec![
            endpoint("x/a", A, Some(vec![]), None),
            endpoint(
                "x/b",
                B,
                Some(vec![tcp_rule(
                    Peer::Set(SetId(1)),
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

fn start(world: &World, backend: Option<Backend>) -> NodeDataplane {
    NodeDataplane::start(
        &world.node,
        IptablesConfig {
            backend,
            // These tests leave some pods out of the desired state as pods nobody
            // selects; new-pod isolation (which would isolate them) has its own tests.
            new_pods: NewPodIsolation::off(),
            ..Default::default()
        },
    )
    .expect("start dataplane")
}

fn allowed_denied_and_replies(backend: Backend, tag: &str) {
    require_root_and_tools();
    let world = World::new(tag, &[("a", A), ("b", B), ("c", C)]);
    // 79 and 82 are one past each end of the range the rule is widened to below.
    let _servers = EchoServers::start(&world.pod("b").ns, &[79, 80, 81, 82]);
    let (a_ns, c_ns) = (world.pod("a").ns.clone(), world.pod("c").ns.clone());
    let to_b = |port| SocketAddr::from((B, port));
    assert!(
        tcp_from(&a_ns, to_b(81), T),
        "world broken: a cannot reach b:81"
    );

    let mut dp = start(&world, Some(backend));
    let report = dp
        .converge(&policy(80, 80), Scope::Kernel)
        .expect("reconcile");
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert!(
        tcp_from(&a_ns, to_b(80), T),
        "allowed a->b:80 (and its replies into isolated a) must pass"
    );
    assert!(!tcp_from(&a_ns, to_b(81), T), "a->b:81 must be dropped");
    assert!(
        !udp_from(&a_ns, to_b(80), T),
        "UDP a->b:80 must be dropped (rule is TCP)"
    );
    assert!(
        !tcp_from(&c_ns, to_b(80), T),
        "c is not in a's set: c->b:80 dropped"
    );
    assert!(
        tcp_from(&world.node, to_b(81), T),
        "traffic from b's own node is always allowed"
    );
    let _a_servers = EchoServers::start(&a_ns, &[80]);
    assert!(
        !tcp_from(&c_ns, SocketAddr::from((A, 80)), T),
        "a admits nothing: c->a:80 dropped"
    );

    // Widened to 80-81: the range's first and last port in, one past each end out.
    let report = dp.converge(&policy(80, 81), Scope::Mirror).expect("apply");
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    for (port, allowed) in [(79, false), (80, true), (81, true), (82, false)] {
        assert_eq!(
            tcp_from(&a_ns, to_b(port), T),
            allowed,
            "{backend}: a->b:{port} with the rule at 80-81"
        );
    }
}

#[test]
fn nft_allowed_passes_denied_drops_replies_pass() {
    allowed_denied_and_replies(Backend::Nft, "ipt1");
}

#[test]
fn legacy_allowed_passes_denied_drops_replies_pass() {
    allowed_denied_and_replies(Backend::Legacy, "ipt2");
}

/// A policy change is applied as a delta while traffic flows; a restarted agent adopts
/// the state with a full reconcile; removing everything opens traffic and leaves no
/// endpoint chain or set behind.
#[test]
fn changes_apply_live_and_restarts_adopt_the_state() {
    require_root_and_tools();
    let world = World::new("ipt3", &[("a", A), ("b", B)]);
    let _servers = EchoServers::start(&world.pod("b").ns, &[80, 81]);
    let a_ns = world.pod("a").ns.clone();
    let to_b = |port| SocketAddr::from((B, port));
    let mut dp = start(&world, None);
    let (before, after) = (policy(80, 80), policy(81, 81));
    dp.converge(&before, Scope::Kernel).expect("reconcile");

    let started = Instant::now();
    let report = dp.converge(&after, Scope::Mirror).expect("apply");
    println!(
        "iptables dataplane: one policy change applied in {:.1} ms",
        started.elapsed().as_secs_f64() * 1000.0
    );
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert!(
        tcp_from(&a_ns, to_b(81), T),
        "a->b:81 allowed after the change"
    );
    assert!(
        !tcp_from(&a_ns, to_b(80), T),
        "a->b:80 dropped after the change"
    );

    let mut restarted = start(&world, None);
    restarted
        .converge(&after, Scope::Kernel)
        .expect("reconcile after restart");
    assert!(
        tcp_from(&a_ns, to_b(81), T),
        "after restart a->b:81 allowed"
    );
    assert!(
        !tcp_from(&a_ns, to_b(80), T),
        "after restart a->b:80 dropped"
    );
    let node_cmd = |args: &[&str]| {
        weir_tests::netns::NetNs::attach(&world.node)
            .ok(args[0], &args[1..], None)
            .unwrap_or_else(|e| panic!("{e}"))
    };
    let rules = node_cmd(&["iptables-nft-save", "-t", "mangle"]);
    assert_eq!(
        rules.matches("-A FORWARD -j WEIR-FILTER").count(),
        1,
        "hook must be there once:\n{rules}"
    );

    restarted
        .converge(&Desired::default(), Scope::Mirror)
        .expect("remove everything");
    assert!(tcp_from(&a_ns, to_b(80), T), "no policy: a->b:80 allowed");
    let rules = node_cmd(&["iptables-nft-save", "-t", "mangle"]);
    assert!(
        !rules.contains("WEIR-I-") && !rules.contains("WEIR-E-"),
        "{rules}"
    );
    let sets = node_cmd(&["ipset", "list", "-n"]);
    assert!(!sets.contains("weir-"), "sets left: {sets}");
}

/// Both pods isolated both ways with UDP 80-82 allowed: the echo reply and the ICMP
/// port-unreachable for 82 (nobody listens) must reach a. The eBPF tests' flow.
#[test]
fn udp_replies_and_icmp_errors_of_tracked_flows_pass() {
    require_root_and_tools();
    let world = World::new("ipt4", &[("a", A), ("b", B)]);
    let _servers = EchoServers::start(&world.pod("b").ns, &[80]);
    let udp = |first, last| port_rule(Protocol::Udp, Peer::Any, first, last, "x/udp", 0);
    let state = desired(
        vec![],
        vec![
            endpoint("x/a", A, Some(vec![]), Some(vec![udp(80, 82)])),
            endpoint("x/b", B, Some(vec![udp(80, 82)]), Some(vec![])),
        ],
    );
    let mut dp = start(&world, None);
    let report = dp.converge(&state, Scope::Kernel).expect("reconcile");
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    let a_ns = world.pod("a").ns.clone();
    assert!(
        udp_from(&a_ns, SocketAddr::from((B, 80)), T),
        "UDP echo reply must reach a"
    );
    let refused = run_in(&a_ns, || {
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
}

#[test]
fn ipv6_allowed_passes_denied_drops_replies_pass() {
    require_root_and_tools();
    let world = World::new("ipt5", &[("a", A), ("b", B)]);
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
    let ready = (0..10).any(|_| tcp_from(&a_ns, to_b(81), T));
    assert!(ready, "world broken: no IPv6 a->b:81 without policy");
    let mut dp = start(&world, None);
    let report = dp.converge(&state, Scope::Kernel).expect("reconcile");
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert!(
        tcp_from(&a_ns, to_b(80), T),
        "allowed [a]->[b]:80 over IPv6 must pass"
    );
    assert!(
        !tcp_from(&a_ns, to_b(81), T),
        "[a]->[b]:81 over IPv6 must be dropped"
    );
}

/// ipBlock 0.0.0.0/0 and ::/0 except c: hash:net cannot hold /0, so it is split in
/// halves, and the except is a `nomatch` entry that wins as the longer prefix. The eBPF
/// dataplane's test runs the same state.
#[test]
fn ip_block_excepts_carve_holes_out_of_the_whole_address_space() {
    require_root_and_tools();
    let world = World::new("ipt6", &[("a", A), ("b", B), ("c", C)]);
    let ip = |pod: &str| (world.pod(pod).ip, world.pod(pod).ip6);
    // Bound to [::]: one server for both families.
    let _servers = EchoServers::start_v6(&world.pod("b").ns, &[80]);
    let state = whole_space_except(ip("a"), ip("b"), ip("c"));
    let mut dp = start(&world, None);
    let report = dp.converge(&state, Scope::Kernel).expect("reconcile");
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    check_whole_space_except(&world, B, world.pod("b").ip6);
}

/// A count the iptables dataplane reports among its status details.
fn status_count(dp: &NodeDataplane, key: &str) -> usize {
    let status = dp.status();
    let (_, value) = status
        .details
        .iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("status has {key}"));
    value.parse().expect("a count")
}

/// The node's mangle table, as `iptables-nft-save` prints it.
fn mangle_rules(world: &World) -> String {
    weir_tests::netns::NetNs::attach(&world.node)
        .ok("iptables-nft-save", &["-t", "mangle"], None)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// 1000 isolated endpoints with 4 rules each: the full reconcile writes them all, one
/// policy change rewrites one endpoint chain. Prints both times; checks the change is in
/// the kernel.
#[test]
fn one_change_among_a_thousand_endpoints_is_a_small_delta() {
    require_root_and_tools();
    let world = World::new("ipt7", &[]);
    let endpoints = |port: u16| {
        (0..1000u32)
            .map(|i| {
                let ip = Ipv4Addr::from(0x0a_c8_00_00 + i);
                let rules = (0..4)
                    .map(|r| {
                        tcp_rule(
                            Peer::Set(SetId(u64::from(i % 50))),
                            port + r,
                            port + r,
                            "x/p",
                            0,
                        )
                    })
                    .collect();
                endpoint(&format!("x/p{i}"), ip, Some(rules), None)
            })
            .collect::<Vec<_>>()
    };
    let sets = || {
        (0..50u64)
            .map(|s| pod_set(s, &[Ipv4Addr::new(10, 199, 0, s as u8)]))
            .collect::<Vec<_>>()
    };
    let before = desired(sets(), endpoints(8000));
    let mut after = before.clone();
    let changed = after.endpoints.get_mut("x/p7").expect("p7");
    changed.ingress.rules = [tcp_rule(Peer::Set(SetId(7)), 9999, 9999, "x/p", 0)].into();

    let mut dp = start(&world, None);
    let started = Instant::now();
    dp.converge(&before, Scope::Kernel).expect("reconcile");
    let full = started.elapsed();
    let full_lines = status_count(&dp, "last_write_lines");
    let started = Instant::now();
    dp.converge(&after, Scope::Mirror).expect("apply");
    let delta = started.elapsed();
    let delta_lines = status_count(&dp, "last_write_lines");
    println!(
        "iptables dataplane, 1000 endpoints x 4 rules: full reconcile {:.0} ms ({full_lines} script lines), one policy change {:.1} ms ({delta_lines} lines)",
        full.as_secs_f64() * 1000.0,
        delta.as_secs_f64() * 1000.0
    );
    // The size, not the time, is what the test can hold: the full write has at least
    // every endpoint's 4 rules (7,564 lines on 2026-12-03); the change rewrites one chain
    // (5 lines then).
    assert!(
        full_lines >= 4000,
        "the full write sent only {full_lines} lines"
    );
    assert!(
        (1..=20).contains(&delta_lines),
        "one policy change sent {delta_lines} script lines (the full write sent {full_lines})"
    );
    let rules = mangle_rules(&world);
    assert_eq!(
        rules.matches("--dport 9999").count(),
        1,
        "the change is applied"
    );
    assert_eq!(
        rules.matches("-j WEIR-I-").count(),
        1000,
        "every endpoint dispatched"
    );

    // A repair of a node where nothing drifted makes no chain again: it compares what
    // `iptables-save` prints with what it would write.
    dp.converge(&after, Scope::Kernel).expect("repair");
    assert_eq!(
        status_count(&dp, "last_write_chains"),
        0,
        "a repair with nothing drifted made chains again"
    );
    // One rule deleted by hand: its chain alone is made again, and the rule is back.
    let rule = rules
        .lines()
        .find(|l| l.contains("--dport 9999"))
        .and_then(|l| l.strip_prefix("-A "))
        .expect("the changed rule");
    let delete = format!("*mangle\n-D {rule}\nCOMMIT\n");
    weir_tests::netns::NetNs::attach(&world.node)
        .ok("iptables-nft-restore", &["--noflush"], Some(&delete))
        .unwrap_or_else(|e| panic!("{e}"));
    dp.converge(&after, Scope::Kernel).expect("repair");
    assert_eq!(
        status_count(&dp, "last_write_chains"),
        1,
        "the repair of one drifted chain"
    );
    let repaired = mangle_rules(&world);
    assert_eq!(
        repaired.matches("--dport 9999").count(),
        1,
        "the rule is back"
    );
}
