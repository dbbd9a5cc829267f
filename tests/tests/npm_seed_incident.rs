//! The incident weir was written for, on a real Azure NPM: NPM v1.5.36 (built from its
//! source archive by `cargo xtask peers`, run by `weir-lab up --enforcer azure-npm@v1.5.36`
//! as its Linux DaemonSet runs it) enforces the demo world through the lab's API server;
//! then 16 of its hash sets get a kernel reference it cannot remove (a list:set that is not
//! NPM's holds them, one of the kinds the reset tests make), NPM's container crashes, and
//! it is restarted the way kubelet restarts one, with back-off: each start fails at boot
//! with the seed's "Set cannot be destroyed: it is in use by a kernel component" and exits.
//! Then the node is handed to weir (`weir-lab peer handover`: NPM's DaemonSet leaves the
//! node, the Node gets `weir.io/dataplane`, weir's agent starts) while the pods probe.
//!
//! `cargo xtask test` runs this short form. `cargo xtask demo --seed-incident` runs the
//! whole story (WEIR_SEED_INCIDENT_FULL): on the same node, with the same references,
//! v1.5.37 (the fix) and v1.8.12 (the newest release) come up and enforce, and weir takes
//! the node from the running v1.8.12, so that every probe during the handover is judged.
//!
//! What is judged is the matrix NPM v1.5.36 enforced before the references leaked: a probe
//! it denied that connects has leaked, one it allowed that fails has failed; weir must end
//! on the same matrix.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;
use weir_tests::kernel_state::{all_rules, set_names};
use weir_tests::lab::{Lab, Matrix};
use weir_tests::netns::NetNs;

/// The references that crash-loop v1.5.36: it skips at most 11 referenced sets from its
/// boot-time destroy and survives 4 more failed tries (see ../shared/peers/README.md).
const LEAKED: usize = 16;
/// The seed's error, as `ipset restore` prints it.
const SEED_ERROR: &str = "Set cannot be destroyed: it is in use by a kernel component";
/// NPM's own words when its retries run out.
const TRIES_ERROR: &str = "after 5 tries, failed to run command [ipset restore]";
/// What NPM logs once its dataplane has booted and its controllers start.
const NPM_STARTED: &str = "starting NPM - (";
/// The list:set that holds NPM's sets: not NPM's, not weir's.
const HOLDER: &str = "leaked-refs";
/// Crashes the short form waits for before it calls it a crash loop.
const CRASHES: usize = 3;
/// kubelet's back-off after each crash (10 s, doubling, at most 5 min), scaled down by 10
/// so the demo stays under a minute; the order and the doubling are kubelet's.
const BACKOFF: Duration = Duration::from_secs(1);

fn full() -> bool {
    std::env::var_os("WEIR_SEED_INCIDENT_FULL").is_some()
}

fn demo_world() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/demo.yaml")
}

fn say(line: impl AsRef<str>) {
    eprintln!("seed incident: {}", line.as_ref());
}

/// The probes of `got` that differ from `expected`: (denied that connected, allowed that
/// failed), as `from → to port/proto`.
fn wrong(expected: &Matrix, got: &Matrix) -> (Vec<String>, Vec<String>) {
    let (mut leaked, mut failed) = (Vec::new(), Vec::new());
    for (key, connected) in got {
        let shown = format!("{} → {} {}/{}", key.0, key.1, key.2, key.3);
        match (expected.get(key), connected) {
            (Some(false), true) => leaked.push(shown),
            (Some(true), false) => failed.push(shown),
            _ => {}
        }
    }
    (leaked, failed)
}

fn peer_status(lab: &Lab) -> Result<Value> {
    Ok(serde_json::from_str(&lab.weir(&["peer", "status"])?)?)
}

/// NPM's last words in its log: from "after 5 tries" to the seed's error.
fn quoted_error(lab: &Lab) -> Option<String> {
    let log = std::fs::read_to_string(lab.dir.join("peer.log")).ok()?;
    let from = log.find(TRIES_ERROR)?;
    let to = from + log[from..].find(SEED_ERROR)? + SEED_ERROR.len();
    Some(log[from..to].to_string())
}

/// Waits for the peer started last to exit; `None` when it is still up after `within`.
fn wait_exit(lab: &Lab, within: Duration) -> Result<Option<Duration>> {
    let started = Instant::now();
    while started.elapsed() < within {
        if peer_status(lab)?["running"] == false {
            return Ok(Some(started.elapsed()));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(None)
}

/// Waits until the peer started last has booted its dataplane (NPM's log says so; it
/// starts afresh with each start): the old one's rules, which stay behind, prove nothing.
fn wait_booted(lab: &Lab, within: Duration) -> Result<Duration> {
    let started = Instant::now();
    loop {
        let log = std::fs::read_to_string(lab.dir.join("peer.log")).unwrap_or_default();
        if log.contains(NPM_STARTED) {
            return Ok(started.elapsed());
        }
        if peer_status(lab)?["running"] == false || started.elapsed() > within {
            bail!("NPM did not boot; log:\n{log}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Probes until the lab's matrix is `expected` (the peer programs in the background).
fn wait_enforcing(lab: &Lab, expected: &Matrix, within: Duration) -> Result<Duration> {
    let started = Instant::now();
    loop {
        let (_, got) = lab.probe(&[])?;
        let (leaked, failed) = wrong(expected, &got);
        if leaked.is_empty() && failed.is_empty() {
            return Ok(started.elapsed());
        }
        if started.elapsed() > within {
            bail!(
                "not enforcing after {within:?}: leaked {leaked:?}, failed {failed:?}; peer: {}",
                peer_status(lab)?
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Holds `LEAKED` of NPM's hash sets in a list:set of someone else's: each gets a kernel
/// reference NPM does not own. Returns their names.
fn leak_references(node: &NetNs) -> Result<BTreeSet<String>> {
    let saved = node.ok("ipset", &["save"], None)?;
    let hashes: Vec<&str> = saved
        .lines()
        .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            ["create", name, kind, ..]
                if name.starts_with("azure-npm-") && kind.starts_with("hash:") =>
            {
                Some(name)
            }
            _ => None,
        })
        .collect();
    ensure!(
        hashes.len() >= LEAKED,
        "NPM made {} hash sets for the demo world, fewer than the {LEAKED} to leak:\n{saved}",
        hashes.len()
    );
    let mut script = format!("create {HOLDER} list:set size 64\n");
    let leaked: BTreeSet<String> = hashes[..LEAKED].iter().map(|s| s.to_string()).collect();
    for name in &leaked {
        script.push_str(&format!("add {HOLDER} {name}\n"));
    }
    node.ok("ipset", &["restore"], Some(&script))?;
    Ok(leaked)
}

/// Restarts the crashed peer as kubelet does (back-off doubling after each crash) until
/// it has crashed `CRASHES` more times; fails if a start stays up.
fn crash_loop(lab: &Lab) -> Result<()> {
    let mut backoff = BACKOFF;
    for restart in 1..=CRASHES {
        say(format!("back-off {backoff:?}, then restart {restart}"));
        std::thread::sleep(backoff);
        backoff *= 2;
        lab.weir(&["peer", "start"])?;
        let Some(after) = wait_exit(lab, Duration::from_secs(60))? else {
            bail!(
                "restart {restart}: NPM is still up after 60 s; log:\n{}",
                std::fs::read_to_string(lab.dir.join("peer.log")).unwrap_or_default()
            );
        };
        let log = std::fs::read_to_string(lab.dir.join("peer.log")).unwrap_or_default();
        ensure!(
            log.contains(SEED_ERROR) && log.contains(TRIES_ERROR),
            "restart {restart}: NPM exited without the seed's error; log:\n{log}"
        );
        say(format!(
            "restart {restart}: exited {:.1} s after its start (CrashLoopBackOff)",
            after.as_secs_f64()
        ));
    }
    if let Some(error) = quoted_error(lab) {
        say(format!("its error: {error}"));
    }
    Ok(())
}

/// Hands the node to weir while a thread probes without pause. Returns the wrong probes
/// (leaked, failed) of the rounds before weir enforced and of those after.
fn handover_while_probing(
    lab: &Lab,
    expected: &Matrix,
    dataplane: &str,
) -> Result<[(Vec<String>, Vec<String>); 2]> {
    while_probing(lab, expected, "the handover", || {
        lab.weir(&["peer", "handover", "--dataplane", dataplane])
    })
}

/// Runs `act` (a lab command that returns once the change is enforced) while a thread
/// probes without pause. Returns the wrong probes (leaked, failed) of the rounds that
/// started after `act` began and before it returned, and of those after. The rounds
/// before it began, under the old enforcer alone (a crash-looping NPM's restarts drop
/// what they like), judge nothing of the change.
fn while_probing(
    lab: &Lab,
    expected: &Matrix,
    what: &str,
    act: impl FnOnce() -> Result<String>,
) -> Result<[(Vec<String>, Vec<String>); 2]> {
    let rounds: Mutex<Vec<(Instant, Matrix)>> = Mutex::new(Vec::new());
    let stop = AtomicBool::new(false);
    let (asked, enforced) = std::thread::scope(|s| -> Result<(Instant, Instant)> {
        let prober = s.spawn(|| -> Result<()> {
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                let (_, got) = lab.probe(&[])?;
                rounds.lock().unwrap().push((started, got));
            }
            Ok(())
        });
        // A round or two under the old enforcer first.
        while rounds.lock().unwrap().len() < 2 && !prober.is_finished() {
            std::thread::sleep(Duration::from_millis(20));
        }
        let asked = Instant::now();
        let handed = act();
        let enforced = Instant::now();
        say(format!(
            "weir enforced {:.1} s after {what} began",
            (enforced - asked).as_secs_f64()
        ));
        // Rounds that start once weir enforces.
        while handed.is_ok()
            && !prober.is_finished()
            && rounds
                .lock()
                .unwrap()
                .iter()
                .filter(|(t, _)| *t >= enforced)
                .count()
                < 3
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, Ordering::Relaxed);
        prober.join().expect("the prober panicked")?;
        handed?;
        Ok((asked, enforced))
    })?;
    let rounds = rounds.into_inner().unwrap();
    let mut out: [(Vec<String>, Vec<String>); 2] = Default::default();
    for (started, got) in rounds.iter().filter(|(t, _)| *t >= asked) {
        let (leaked, failed) = wrong(expected, got);
        let phase = &mut out[usize::from(*started >= enforced)];
        phase.0.extend(leaked);
        phase.1.extend(failed);
    }
    say(format!(
        "{} probe rounds during {what}, {} of them after weir enforced ({} before it began, not judged)",
        rounds.iter().filter(|(t, _)| *t >= asked).count(),
        rounds.iter().filter(|(t, _)| *t >= enforced).count(),
        rounds.iter().filter(|(t, _)| *t < asked).count()
    ));
    Ok(out)
}

/// What weir leaves of NPM once it has cleaned up: no AZURE-NPM chain in either iptables
/// backend, and of NPM's sets only those still referenced, which its status names.
fn check_npm_gone(lab: &Lab, node: &NetNs, leaked: &BTreeSet<String>) -> Result<()> {
    let started = Instant::now();
    loop {
        let rules = all_rules(node)?;
        let sets: BTreeSet<String> = set_names(node)?
            .into_iter()
            .filter(|s| s.starts_with("azure-npm-"))
            .collect();
        let status: Value = serde_json::from_str(&lab.weir(&["status", "--output", "json"])?)?;
        let undeletable: BTreeSet<String> = status["undeletable_sets"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect();
        let chains: Vec<&str> = rules
            .lines()
            .filter(|l| l.starts_with(":AZURE-NPM"))
            .collect();
        if chains.is_empty() && &sets == leaked && &undeletable == leaked {
            say(match leaked.len() {
                0 => "NPM's chains and sets are all gone".to_string(),
                n => format!(
                    "NPM's chains are gone, and every set of NPM's but the {n} still referenced; weir's status names them: {}",
                    undeletable.iter().cloned().collect::<Vec<_>>().join(" ")
                ),
            });
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!(
                "NPM's state not cleaned up after 60 s: chains {chains:?}, sets {sets:?} (referenced: {leaked:?}), weir's undeletable sets {undeletable:?}"
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn npm_v1_5_36_crash_loops_on_16_leaked_references_and_weir_takes_the_node_over() -> Result<()> {
    let lab = Lab::new("npm-seed");
    let world = demo_world();
    let started = Instant::now();
    lab.weir(&[
        "up",
        "--enforcer",
        "azure-npm@v1.5.36",
        world.to_str().context("path")?,
    ])?;
    let node = NetNs::attach(&lab.node_netns());
    let (enforcer, expected) = lab.probe(&[])?;
    ensure!(enforcer == "azure-npm", "the lab runs {enforcer}, not NPM");
    let denied = expected.values().filter(|c| !**c).count();
    ensure!(
        denied > 0 && denied < expected.len(),
        "NPM v1.5.36 enforced nothing sensible on the demo world: {expected:?}"
    );
    say(format!(
        "NPM v1.5.36 enforces the demo world ({} probes, {denied} denied), up in {:.1} s",
        expected.len(),
        started.elapsed().as_secs_f64()
    ));

    let leaked = leak_references(&node)?;
    say(format!(
        "{LEAKED} of NPM's sets now have a kernel reference it does not own (list:set {HOLDER})"
    ));
    // The container crashes (any reason: an OOM kill, a node hiccup); kubelet restarts it.
    lab.weir(&["peer", "signal", "kill"])?;
    wait_exit(&lab, Duration::from_secs(10))?.context("NPM survived SIGKILL")?;
    crash_loop(&lab)?;
    let (_, during) = lab.probe(&[])?;
    let (open, _) = wrong(&expected, &during);
    say(format!(
        "while it crash-loops, {} of the {denied} probes the policies deny connect: each start reset NPM's chains before it failed",
        open.len()
    ));

    let dataplane = "ebpf";
    if full() {
        for version in ["v1.5.37", "v1.8.12"] {
            lab.weir(&["peer", "start", "--version", version])?;
            let booted = wait_booted(&lab, Duration::from_secs(60))?;
            let took = booted + wait_enforcing(&lab, &expected, Duration::from_secs(60))?;
            std::thread::sleep(Duration::from_secs(2));
            let status = peer_status(&lab)?;
            ensure!(
                status["running"] == true && status["version"] == version,
                "{version} did not stay up: {status}; log:\n{}",
                std::fs::read_to_string(lab.dir.join("peer.log")).unwrap_or_default()
            );
            say(format!(
                "NPM {version} on the same node, same {LEAKED} references: up and enforcing in {:.1} s, still running",
                took.as_secs_f64()
            ));
        }
    }

    let from = peer_status(&lab)?;
    say(format!(
        "handing the node to weir ({dataplane}) from NPM {} ({}) while the pods probe",
        from["version"].as_str().unwrap_or("?"),
        if from["running"] == true {
            "running"
        } else {
            "crash-looping"
        }
    ));
    let [(leaked_before, failed_before), (leaked_after, failed_after)] =
        handover_while_probing(&lab, &expected, dataplane)?;
    say(format!(
        "before weir enforced: {} denied probes connected, {} allowed probes failed",
        leaked_before.len(),
        failed_before.len()
    ));
    say(format!(
        "once weir enforced: {} denied probes connected, {} allowed probes failed",
        leaked_after.len(),
        failed_after.len()
    ));
    ensure!(
        leaked_after.is_empty() && failed_after.is_empty(),
        "weir enforces a different matrix than NPM did: leaked {leaked_after:?}, failed {failed_after:?}"
    );
    ensure!(
        failed_before.is_empty(),
        "allowed probes failed during the handover: {failed_before:?}"
    );
    if from["running"] == true {
        // From a running NPM nothing is unprotected: its rules stand until weir's do.
        ensure!(
            leaked_before.is_empty(),
            "denied probes connected during the handover from a running NPM: {leaked_before:?}"
        );
    }
    check_npm_gone(&lab, &node, &leaked)?;
    say(format!("done in {:.1} s", started.elapsed().as_secs_f64()));
    Ok(())
}

/// Built only with the feature `npm-migration` (`cargo xtask demo --npm-migration` sets it):
/// it needs NPM v1.8.12, which `cargo xtask test` does not build, and CI refuses ignored tests.
#[cfg(feature = "npm-migration")]
mod migration {
    use super::*;

    /// The migration off a running NPM (not off its leftovers): NPM v1.8.12 enforces 100
    /// policies on the upstream netpol world; its DaemonSet stops selecting the node and weir's
    /// label takes it, onto eBPF; then the label moves it onto iptables. Every pod probes all
    /// along; per step, the denied probes that connected and the allowed ones that failed,
    /// judged against the matrix NPM enforced. Needs NPM v1.8.12 (5 min to build cold), so
    /// `cargo xtask demo --npm-migration` runs it (feature `npm-migration`), not `cargo xtask test`.
    #[test]
    fn npm_v1_8_12_running_100_policies_migrates_onto_both_weir_dataplanes() -> Result<()> {
        let lab = Lab::new("npm-migrate");
        let mut world = std::fs::read_to_string(weir_tests::lab::netpol_world())?;
        world.push_str(&format!("\n---\n{}", node(None)));
        for i in 0..POLICIES {
            world.push_str(&format!("\n---\n{}", migration_policy(i)));
        }
        let world = weir_tests::lab::manifest(&lab, "world.yaml", &world);
        let started = Instant::now();
        lab.weir(&[
            "up",
            "--enforcer",
            "azure-npm@v1.8.12",
            world.to_str().context("path")?,
        ])?;
        let (_, expected) = lab.probe(&[])?;
        let denied = expected.values().filter(|c| !**c).count();
        ensure!(
            denied > 0 && denied < expected.len(),
            "NPM v1.8.12 enforced nothing sensible: {denied} of {} denied",
            expected.len()
        );
        say(format!(
            "migration: NPM v1.8.12 enforces {POLICIES} policies on the netpol world ({} probes, {denied} denied), up in {:.1} s",
            expected.len(),
            started.elapsed().as_secs_f64()
        ));
        let mut wrong_steps = Vec::new();
        let steps: [(&str, &str); 2] = [
            ("NPM → weir eBPF (peer handover)", "ebpf"),
            ("weir eBPF → weir iptables (the label)", "iptables"),
        ];
        for (step, dataplane) in steps {
            let phases = match dataplane {
                "ebpf" => handover_while_probing(&lab, &expected, dataplane)?,
                _ => {
                    let flip = weir_tests::lab::manifest(&lab, "node.yaml", &node(Some(dataplane)));
                    while_probing(&lab, &expected, "the switch", || {
                        lab.weir(&["apply", flip.to_str().context("path")?])
                    })?
                }
            };
            for (when, (leaked, failed)) in ["during", "after"].iter().zip(phases) {
                say(format!(
                    "migration: {step}, {when}: {} denied probes connected, {} allowed probes failed",
                    leaked.len(),
                    failed.len()
                ));
                if !leaked.is_empty() || !failed.is_empty() {
                    wrong_steps.push(format!(
                        "{step}, {when}: leaked {leaked:?}, failed {failed:?}"
                    ));
                }
            }
            let status: Value = serde_json::from_str(&lab.weir(&["status", "--output", "json"])?)?;
            ensure!(
                status["dataplane"] == dataplane,
                "{step}: weir reports {}",
                status["dataplane"]
            );
            if dataplane == "ebpf" {
                check_npm_gone(&lab, &NetNs::attach(&lab.node_netns()), &BTreeSet::new())?;
            }
        }
        ensure!(wrong_steps.is_empty(), "{}", wrong_steps.join("\n"));
        say(format!(
            "migration: done in {:.1} s",
            started.elapsed().as_secs_f64()
        ));
        Ok(())
    }

    /// The policies of the migration world.
    const POLICIES: usize = 100;

    /// The lab's Node, with weir's label when given.
    fn node(dataplane: Option<&str>) -> String {
        let labels = dataplane
            .map(|d| format!("\n  labels: {{weir.io/dataplane: {d}}}"))
            .unwrap_or_default();
        format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: lab-node{labels}\n")
    }

    /// Policy `i` of 100 over the netpol world: each selects one pod of one namespace and
    /// admits one pod of one namespace on TCP 80 or 81; together they isolate every pod
    /// and allow a spread of pairs.
    fn migration_policy(i: usize) -> String {
        let names = ["a", "b", "c"];
        let namespaces = ["x", "y", "z"];
        format!(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: p{i}, namespace: {}}}\nspec:\n  podSelector: {{matchLabels: {{pod: {}}}}}\n  policyTypes: [Ingress]\n  ingress:\n  - from:\n    - namespaceSelector: {{matchLabels: {{ns: {}}}}}\n      podSelector: {{matchLabels: {{pod: {}}}}}\n    ports: [{{protocol: TCP, port: {}}}]\n",
            namespaces[i % 3],
            names[(i / 3) % 3],
            namespaces[(i / 9) % 3],
            names[(i / 27) % 3],
            80 + (i % 2),
        )
    }
}
