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

use weir::{
    dataplane::{
        ebpf::{EbpfConfig, EbpfDataplane},
        Dataplane,
    },
    policy::desired::{Desired, Peer, SetId},
};
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

#[test]
fn new_programs_are_swapped_into_existing_attachments_without_a_gap() {
    require_root_and_tools();
    let world = World::new("ebpf7", &[("a", A), ("b", B)]);
    let root = PinRoot::new("ebpf7");
    let _servers = EchoServers::start(&world.pod("b").ns, &[80, 81]);
    let old = in_node(&world, EbpfConfig::with_pin_root(root.0.clone()), |dp| {
        let report = dp.reconcile(&state()).expect("reconcile");
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        dp.program_ids().unwrap()
    });
    let probe = ContinuousProbe::start(
        &world.pod("a").ns,
        SocketAddr::from((B, 80)),
        SocketAddr::from((B, 81)),
    );
    std::thread::sleep(Duration::from_millis(500));
    // Another events rate is another rodata: the programs must be reloaded.
    let config = EbpfConfig {
        events_per_sec: 999,
        ..EbpfConfig::with_pin_root(root.0.clone())
    };
    let (new, on_hooks) = in_node(&world, config, |dp| {
        let report = dp.reconcile(&state()).expect("reconcile");
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        (
            dp.program_ids().unwrap(),
            dp.tcx_program_ids("x/b").unwrap(),
        )
    });
    std::thread::sleep(Duration::from_millis(500));
    probe.finish();
    assert_ne!(old, new, "the programs were not reloaded");
    assert_eq!(
        on_hooks,
        [vec![new[0]], vec![new[1]]],
        "old programs still attached"
    );
}
