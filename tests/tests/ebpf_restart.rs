//! Restarts of the process holding the eBPF dataplane. kill -9: enforcement continues
//! unchanged while it is down, and a restarted holder adopts the pins (same program ids)
//! and converges without a gap. New programs (an upgrade, new load-time settings): they
//! are swapped into the existing attachments, again without a gap.

use std::{
    io::{BufRead, BufReader},
    net::{Ipv4Addr, SocketAddr},
    process::{Child, Command, Stdio},
    time::Duration,
};
use weir::dataplane::Scope;

use weir::dataplane::{
    ebpf::{AttachMode, EbpfConfig, EbpfDataplane},
    Dataplane,
};
use weir_policy::desired::{Desired, Peer, SetId};
use weir_tests::{
    desired::{desired, endpoint, pod_set, tcp_rule},
    pods::{enter, World},
    probe::{ContinuousProbe, EchoServers},
    require_root_and_tools, PinRoot,
};

const A: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 2);

fn state() -> Desired {
    desired(
        vec![pod_set(1, &[A])],
        vec![
            endpoint("x/a", A, Some(vec![]), None),
            endpoint(
                "x/b",
                B,
                Some(vec![tcp_rule(Peer::Set(SetId(1)), 80, 80, "x/allow-a", 0)]),
                None,
            ),
        ],
    )
}

struct Holder(Child);

impl Holder {
    /// Starts the holder and waits for its `ready` line; returns it with the program ids.
    fn start(world: &World, root: &PinRoot, desired: &std::path::Path) -> (Holder, String) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_weir-ebpf-holder"))
            .args([
                world.node.as_str(),
                root.0.to_str().unwrap(),
                desired.to_str().unwrap(),
            ])
            .stdout(Stdio::piped())
            .spawn()
            .expect("start weir-ebpf-holder");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let holder = Holder(child);
        let ids = line
            .strip_prefix("ready ")
            .unwrap_or_else(|| panic!("holder did not get ready: {line:?}"))
            .trim()
            .to_string();
        (holder, ids)
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct TempFile(std::path::PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn kill_9_keeps_enforcing_and_restart_adopts_without_a_gap() {
    require_root_and_tools();
    let world = World::new("ebpf2", &[("a", A), ("b", B)]);
    let root = PinRoot::new("ebpf2");
    let _servers = EchoServers::start(&world.pod("b").ns, &[80, 81]);
    let file = TempFile(format!("/tmp/weir-test-ebpf2-{}.json", std::process::id()).into());
    std::fs::write(&file.0, serde_json::to_vec(&state()).unwrap()).unwrap();

    let (first, ids) = Holder::start(&world, &root, &file.0);
    let probe = ContinuousProbe::start(
        &world.pod("a").ns,
        SocketAddr::from((B, 80)),
        SocketAddr::from((B, 81)),
    );
    std::thread::sleep(Duration::from_millis(700));
    drop(first); // SIGKILL, then reap
    let rounds_at_kill = probe.rounds();
    std::thread::sleep(Duration::from_millis(1500));
    let rounds_while_down = probe.rounds() - rounds_at_kill;

    let (_second, ids_after) = Holder::start(&world, &root, &file.0);
    std::thread::sleep(Duration::from_millis(700));
    probe.finish();
    assert!(
        rounds_while_down >= 2,
        "too few probe rounds while the holder was down"
    );
    assert_eq!(ids, ids_after, "the restarted holder reloaded the programs");
}

/// Runs `f` with a dataplane (made from `config`) inside the node namespace.
fn in_node<T: Send + 'static>(
    world: &World,
    config: EbpfConfig,
    f: impl FnOnce(&mut EbpfDataplane) -> T + Send + 'static,
) -> T {
    let node = world.node.clone();
    std::thread::spawn(move || {
        enter(&node);
        let mut dp = EbpfDataplane::new(config).expect("load dataplane");
        f(&mut dp)
    })
    .join()
    .expect("dataplane thread panicked")
}

/// Program ids of the `tc` filters on `dev`'s `hook` (ingress or egress) in `ns`.
fn tc_filter_ids(ns: &str, dev: &str, hook: &str) -> Vec<u32> {
    let out = Command::new("tc")
        .args(["-n", ns, "filter", "show", "dev", dev, hook])
        .output()
        .expect("prerequisite missing: tc (iproute2)");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .filter(|l| l.contains(" bpf "))
        .filter_map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let at = words.iter().position(|w| *w == "id")?;
            words.get(at + 1)?.parse().ok()
        })
        .collect()
}

/// Loads with the default settings, then starts again with another events rate (another
/// rodata, so the programs must be reloaded) while probing; returns old and new ids.
fn swap_programs(world: &World, root: &PinRoot, mode: Option<AttachMode>) -> ([u32; 2], [u32; 2]) {
    let _servers = EchoServers::start(&world.pod("b").ns, &[80, 81]);
    let config = |rate| EbpfConfig {
        events_per_sec: rate,
        attach_mode: mode,
        ..EbpfConfig::with_pin_root(root.0.clone())
    };
    let old = in_node(world, config(1000), |dp| {
        let report = dp.converge(&state(), Scope::Kernel).expect("reconcile");
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        dp.program_ids().unwrap()
    });
    let probe = ContinuousProbe::start(
        &world.pod("a").ns,
        SocketAddr::from((B, 80)),
        SocketAddr::from((B, 81)),
    );
    std::thread::sleep(Duration::from_millis(500));
    let new = in_node(world, config(999), |dp| {
        let report = dp.converge(&state(), Scope::Kernel).expect("reconcile");
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        dp.program_ids().unwrap()
    });
    std::thread::sleep(Duration::from_millis(500));
    probe.finish();
    assert_ne!(old, new, "the programs were not reloaded");
    (old, new)
}

#[test]
fn new_programs_are_swapped_into_tcx_links_without_a_gap() {
    require_root_and_tools();
    if !weir_tests::tcx_or_its_refusal("ebpf7") {
        return;
    }
    let world = World::new("ebpf7", &[("a", A), ("b", B)]);
    let root = PinRoot::new("ebpf7");
    let (_, new) = swap_programs(&world, &root, Some(AttachMode::Tcx));
    // Same settings as the second start: an adoption, not another reload.
    let config = EbpfConfig {
        events_per_sec: 999,
        attach_mode: Some(AttachMode::Tcx),
        ..EbpfConfig::with_pin_root(root.0.clone())
    };
    let on_hooks = in_node(&world, config, |dp| dp.tcx_program_ids("x/b").unwrap());
    assert_eq!(
        on_hooks,
        [vec![new[0]], vec![new[1]]],
        "old programs still attached"
    );
}

/// The path for kernels without TCX (5.10 to 6.5): clsact filters over netlink.
#[test]
fn new_programs_replace_netlink_filters_in_place_without_a_gap() {
    require_root_and_tools();
    let world = World::new("ebpf8", &[("a", A), ("b", B)]);
    let root = PinRoot::new("ebpf8");
    let (_, new) = swap_programs(&world, &root, Some(AttachMode::Netlink));
    let host_if = &world.pod("b").host_if;
    assert_eq!(tc_filter_ids(&world.node, host_if, "ingress"), vec![new[0]]);
    assert_eq!(tc_filter_ids(&world.node, host_if, "egress"), vec![new[1]]);
}
