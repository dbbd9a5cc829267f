//! The upstream e2e NetworkPolicy scenarios (the one table in netpol-scenarios, which the
//! engine harness agent/tests/netpol_e2e.rs also runs) through `weir lab`, on both dataplanes, in both
//! of the lab's modes (objects from a file; objects through the real kube-apiserver with
//! the agent in cluster mode and the DaemonSet's RBAC), against hand-written truth tables;
//! and the differential check that every dataplane and mode gives the same matrix for every
//! step. One lab per (dataplane, mode) is shared by all scenarios (policies are applied and
//! deleted between them); the labs run at once.
//!
//! Bridged CNIs (`weir lab up --topology bridge`: every pod on one Linux bridge) get one
//! lab per dataplane in file mode, on [`BRIDGE_SUBSET`] (one scenario of each kind) to
//! keep CI short; `WEIR_CONFORMANCE_FULL=1` (`cargo xtask conformance`) runs every
//! scenario there too.

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Instant;

use netpol_scenarios::{compare, scenarios, Addresses, Change};
use weir_tests::lab::{manifest, netpol_world, Lab, Matrix};

/// Scenarios also probed over IPv6 (the ipBlock ones name IPv4 CIDRs, so they are not):
/// one of each kind of peer, port and direction keeps the suite short.
const IPV6_TOO: &[&str] = &[
    "default-deny-all",
    "only from a pod in a different namespace by podSelector and namespaceSelector",
    "ports (SCTP)",
    "ingress on one named port",
    "egress denied on the client even when the server allows",
    "ingress from an updated pod (relabel)",
];

/// Scenarios the bridge-topology labs run, unless `WEIR_CONFORMANCE_FULL=1`: every kind
/// of peer, port, direction, update and ipBlock once.
const BRIDGE_SUBSET: &[&str] = &[
    "default-deny-all",
    "allow from pods within the server namespace by podSelector",
    "podSelector and namespaceSelector",
    "ports (SCTP)",
    "ingress on one named port",
    "ingress from an updated pod (relabel)",
    "egress denied on the client even when the server allows",
    "except clause of a CIDR block",
    "ingress and egress controlled independently",
    "stop enforcing a policy after it is deleted",
];

/// What one dataplane did: every step's matrix, and every mismatch with the truth tables.
struct SuiteRun {
    matrices: BTreeMap<String, Matrix>,
    failures: Vec<String>,
}

/// (dataplane, lab mode `--api file|server`, `--topology routed|bridge`).
type Setup = (&'static str, &'static str, &'static str);

fn run_suite((dataplane, api, topology): Setup) -> SuiteRun {
    let lab = Lab::new(&format!("conf-{dataplane}-{api}-{topology}"));
    let world = netpol_world();
    let started = Instant::now();
    lab.weir(&[
        "up",
        "--dataplane",
        dataplane,
        "--api",
        api,
        "--topology",
        topology,
        world.to_str().unwrap(),
    ])
    .unwrap_or_else(|e| panic!("{dataplane} ({api}, {topology}): {e}"));
    let dataplane_named = dataplane;
    let dataplane = format!("{dataplane} ({api}, {topology})");
    eprintln!("{dataplane}: lab up in {:.1?}", started.elapsed());
    let pods: serde_json::Value =
        serde_json::from_str(&lab.weir(&["pods", "--output", "json"]).unwrap()).unwrap();
    let ips: Addresses = pods
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["pod"].as_str().unwrap().to_string(),
                p["ip"].as_str().unwrap().to_string(),
            )
        })
        .collect();

    let all = scenarios(&ips);
    for name in IPV6_TOO.iter().chain(BRIDGE_SUBSET) {
        assert!(
            all.iter().any(|s| s.name == *name),
            "IPV6_TOO or BRIDGE_SUBSET names no scenario {name:?}"
        );
    }
    let subset = topology == "bridge" && std::env::var_os("WEIR_CONFORMANCE_FULL").is_none();
    let mut run = SuiteRun {
        matrices: BTreeMap::new(),
        failures: Vec::new(),
    };
    for (n, scenario) in all.into_iter().enumerate() {
        if subset && !BRIDGE_SUBSET.contains(&scenario.name) {
            continue;
        }
        let began = Instant::now();
        let mut policies = String::new();
        let mut relabelled = false;
        for (s, step) in scenario.steps.iter().enumerate() {
            let label = format!("{n:02} {} / step {}", scenario.name, s + 1);
            let mut step_ok = true;
            for (c, change) in step.changes.iter().enumerate() {
                let (verb, yaml) = match change {
                    Change::Apply(yaml) => ("apply", yaml),
                    Change::Delete(yaml) => ("delete", yaml),
                };
                if yaml.contains("kind: NetworkPolicy") {
                    policies.push_str(yaml);
                } else {
                    relabelled = true;
                }
                let file = manifest(&lab, &format!("step-{n}-{s}-{c}.yaml"), yaml);
                if let Err(e) = lab.weir(&[verb, file.to_str().unwrap()]) {
                    run.failures.push(format!("{dataplane}: {label}: {e}"));
                    step_ok = false;
                }
            }
            if !step_ok {
                continue;
            }
            let families: &[&str] = if IPV6_TOO.contains(&scenario.name) {
                &["ipv4", "ipv6"]
            } else {
                &["ipv4"]
            };
            for family in families {
                let label = match *family {
                    "ipv4" => label.clone(),
                    _ => format!("{label} ({family})"),
                };
                match lab.probe(&["--family", family]) {
                    Ok((reported, matrix)) => {
                        assert_eq!(
                            reported, dataplane_named,
                            "the agent enforces another dataplane"
                        );
                        if let Err(diff) = compare(&matrix, step.expect) {
                            run.failures.push(format!("{dataplane}: {label}: {diff}"));
                        }
                        run.matrices.insert(label, matrix);
                    }
                    Err(e) => run
                        .failures
                        .push(format!("{dataplane}: {label}: probe: {e}")),
                }
            }
        }
        // Back to the bare world for the next scenario.
        if !policies.is_empty() {
            let file = manifest(&lab, &format!("cleanup-{n}.yaml"), &policies);
            lab.weir(&["delete", file.to_str().unwrap()]).unwrap();
        }
        if relabelled {
            lab.weir(&["apply", world.to_str().unwrap()]).unwrap();
        }
        eprintln!(
            "{dataplane}: {n:02} {} in {:.1?}",
            scenario.name,
            began.elapsed()
        );
    }
    eprintln!("{dataplane}: suite in {:.1?}", started.elapsed());
    run
}

const SETUPS: [Setup; 4] = [
    ("ebpf", "file", "routed"),
    ("iptables", "file", "routed"),
    ("ebpf", "server", "routed"),
    ("iptables", "server", "routed"),
];

/// Labs on a bridge, compared with the routed ones on the steps they run.
const BRIDGE_SETUPS: [Setup; 2] = [("ebpf", "file", "bridge"), ("iptables", "file", "bridge")];

fn suite(setup: Setup) -> &'static SuiteRun {
    static RUNS: [OnceLock<SuiteRun>; 6] = [const { OnceLock::new() }; 6];
    let i = SETUPS
        .iter()
        .chain(&BRIDGE_SETUPS)
        .position(|s| *s == setup)
        .expect("a known setup");
    RUNS[i].get_or_init(|| run_suite(setup))
}

fn assert_conforms(setup: Setup) {
    let run = suite(setup);
    assert!(
        !run.matrices.is_empty(),
        "{setup:?}: no scenario was probed"
    );
    assert!(
        run.failures.is_empty(),
        "{} failures:\n{}",
        run.failures.len(),
        run.failures.join("\n")
    );
}

#[test]
fn ebpf_dataplane_passes_the_upstream_netpol_scenarios() {
    assert_conforms(("ebpf", "file", "routed"));
}

#[test]
fn iptables_dataplane_passes_the_upstream_netpol_scenarios() {
    assert_conforms(("iptables", "file", "routed"));
}

#[test]
fn ebpf_dataplane_passes_them_through_the_real_api_server() {
    assert_conforms(("ebpf", "server", "routed"));
}

#[test]
fn iptables_dataplane_passes_them_through_the_real_api_server() {
    assert_conforms(("iptables", "server", "routed"));
}

#[test]
fn ebpf_dataplane_on_a_bridge_passes_them() {
    assert_conforms(BRIDGE_SETUPS[0]);
}

#[test]
fn iptables_dataplane_on_a_bridge_passes_them() {
    assert_conforms(BRIDGE_SETUPS[1]);
}

/// Each pod's own policy on a bridge: the same matrices as on routed pods, step by step.
#[test]
fn a_bridge_gives_the_same_matrices_as_routed_pods() {
    let runs: Vec<&SuiteRun> = std::thread::scope(|s| {
        let handles: Vec<_> = std::iter::once(SETUPS[0])
            .chain(BRIDGE_SETUPS)
            .map(|setup| s.spawn(move || suite(setup)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (setup, run) in BRIDGE_SETUPS.iter().zip(&runs[1..]) {
        let routed = SuiteRun {
            matrices: runs[0]
                .matrices
                .iter()
                .filter(|(step, _)| run.matrices.contains_key(*step))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            failures: Vec::new(),
        };
        same_matrices(
            &format!("{:?}", SETUPS[0]),
            &routed,
            &format!("{setup:?}"),
            run,
        );
    }
}

#[test]
fn every_dataplane_and_mode_gives_the_same_matrices() {
    let runs: Vec<&SuiteRun> = std::thread::scope(|s| {
        let handles: Vec<_> = SETUPS
            .iter()
            .map(|setup| s.spawn(move || suite(*setup)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (setup, run) in SETUPS.iter().zip(&runs).skip(1) {
        same_matrices(
            &format!("{:?}", SETUPS[0]),
            runs[0],
            &format!("{setup:?}"),
            run,
        );
    }
}

fn same_matrices(ebpf_name: &str, ebpf: &SuiteRun, iptables_name: &str, iptables: &SuiteRun) {
    assert!(!ebpf.matrices.is_empty() && !iptables.matrices.is_empty());
    let mut differences = Vec::new();
    for (step, e) in &ebpf.matrices {
        let Some(i) = iptables.matrices.get(step) else {
            differences.push(format!("{step}: probed on {ebpf_name} only"));
            continue;
        };
        for (probe, connected) in e {
            if i.get(probe) != Some(connected) {
                differences.push(format!(
                    "{step}: {} -> {} {}/{}: {ebpf_name} {connected}, {iptables_name} {:?}",
                    probe.0,
                    probe.1,
                    probe.2,
                    probe.3,
                    i.get(probe)
                ));
            }
        }
    }
    for step in iptables
        .matrices
        .keys()
        .filter(|s| !ebpf.matrices.contains_key(*s))
    {
        differences.push(format!("{step}: probed on {iptables_name} only"));
    }
    assert!(differences.is_empty(), "{}", differences.join("\n"));
}
