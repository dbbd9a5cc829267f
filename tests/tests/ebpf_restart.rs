//! kill -9 of the process holding the eBPF dataplane: enforcement continues unchanged
//! while it is down (allowed flows flow, denied stay denied), and a restarted holder
//! adopts the pins (same program ids) and converges without a gap.

use std::{
    io::{BufRead, BufReader},
    net::{Ipv4Addr, SocketAddr},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicU32, Ordering},
        Arc,
    },
    time::Duration,
};

use weir::policy::desired::{Peer, SetId};
use weir_tests::{
    desired::{desired, endpoint, pod_set, tcp_rule},
    pods::{enter, World},
    probe::{tcp_echo, EchoServers},
    require_root_and_tools, PinRoot,
};

const A: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 2);

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

#[derive(Default)]
struct Tally {
    rounds: AtomicU32,
    allowed_failed: AtomicU32,
    denied_passed: AtomicU32,
}

#[test]
fn kill_9_keeps_enforcing_and_restart_adopts_without_a_gap() {
    require_root_and_tools();
    let world = World::new("ebpf2", &[("a", A), ("b", B)]);
    let root = PinRoot::new("ebpf2");
    let _servers = EchoServers::start(&world.pod("b").ns, &[80, 81]);
    let state = desired(
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
    );
    let file = TempFile(format!("/tmp/weir-test-ebpf2-{}.json", std::process::id()).into());
    std::fs::write(&file.0, serde_json::to_vec(&state).unwrap()).unwrap();

    let (first, ids) = Holder::start(&world, &root, &file.0);

    // Probe continuously from a: b:80 must always work, b:81 never.
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let prober = {
        let (tally, stop, ns) = (tally.clone(), stop.clone(), world.pod("a").ns.clone());
        std::thread::spawn(move || {
            enter(&ns);
            let t = Duration::from_millis(300);
            while !stop.load(Ordering::SeqCst) {
                if !tcp_echo(SocketAddr::from((B, 80)), t) {
                    tally.allowed_failed.fetch_add(1, Ordering::SeqCst);
                }
                if tcp_echo(SocketAddr::from((B, 81)), t) {
                    tally.denied_passed.fetch_add(1, Ordering::SeqCst);
                }
                tally.rounds.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    std::thread::sleep(Duration::from_millis(700));
    drop(first); // SIGKILL, then reap
    let rounds_at_kill = tally.rounds.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(1500));
    let rounds_while_down = tally.rounds.load(Ordering::SeqCst) - rounds_at_kill;

    let (_second, ids_after) = Holder::start(&world, &root, &file.0);
    std::thread::sleep(Duration::from_millis(700));
    stop.store(true, Ordering::SeqCst);
    prober.join().unwrap();

    assert!(
        rounds_while_down >= 2,
        "too few probe rounds while the holder was down"
    );
    assert_eq!(
        tally.allowed_failed.load(Ordering::SeqCst),
        0,
        "an allowed flow failed"
    );
    assert_eq!(
        tally.denied_passed.load(Ordering::SeqCst),
        0,
        "a denied flow passed"
    );
    assert_eq!(ids, ids_after, "the restarted holder reloaded the programs");
}
