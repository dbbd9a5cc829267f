//! The upstream e2e NetworkPolicy scenarios through `weir lab`, on both dataplanes, against
//! hand-written truth tables; and the differential check that both dataplanes give the
//! same matrix for every step. One lab per dataplane is shared by all scenarios (policies
//! are applied and deleted between them); the two labs run at once.

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Instant;

use weir_tests::lab::{manifest, netpol_world, Lab, Matrix};
use weir_tests::netpol::{compare, scenarios, Addresses, Change};

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

/// What one dataplane did: every step's matrix, and every mismatch with the truth tables.
struct SuiteRun {
    matrices: BTreeMap<String, Matrix>,
    failures: Vec<String>,
}

fn run_suite(dataplane: &'static str) -> SuiteRun {
    let lab = Lab::new(&format!("conf-{dataplane}"));
    let world = netpol_world();
    let started = Instant::now();
    lab.weir(&["up", "--dataplane", dataplane, world.to_str().unwrap()])
        .unwrap_or_else(|e| panic!("{dataplane}: {e}"));
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
    for name in IPV6_TOO {
        assert!(
            all.iter().any(|s| s.name == *name),
            "IPV6_TOO names no scenario {name:?}"
        );
    }
    let mut run = SuiteRun {
        matrices: BTreeMap::new(),
        failures: Vec::new(),
    };
    for (n, scenario) in all.into_iter().enumerate() {
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
            match lab.probe(&[]) {
                Ok((reported, matrix)) => {
                    assert_eq!(reported, dataplane, "the agent enforces another dataplane");
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

fn suite(dataplane: &'static str) -> &'static SuiteRun {
    static EBPF: OnceLock<SuiteRun> = OnceLock::new();
    static IPTABLES: OnceLock<SuiteRun> = OnceLock::new();
    let cell = match dataplane {
        "ebpf" => &EBPF,
        _ => &IPTABLES,
    };
    cell.get_or_init(|| run_suite(dataplane))
}

fn assert_conforms(dataplane: &'static str) {
    let run = suite(dataplane);
    assert!(
        !run.matrices.is_empty(),
        "{dataplane}: no scenario was probed"
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
    assert_conforms("ebpf");
}

#[test]
fn iptables_dataplane_passes_the_upstream_netpol_scenarios() {
    assert_conforms("iptables");
}

#[test]
fn ebpf_and_iptables_give_the_same_matrices() {
    let (ebpf, iptables) = std::thread::scope(|s| {
        let e = s.spawn(|| suite("ebpf"));
        let i = s.spawn(|| suite("iptables"));
        (e.join().unwrap(), i.join().unwrap())
    });
    assert!(!ebpf.matrices.is_empty() && !iptables.matrices.is_empty());
    let mut differences = Vec::new();
    for (step, e) in &ebpf.matrices {
        let Some(i) = iptables.matrices.get(step) else {
            differences.push(format!("{step}: probed on ebpf only"));
            continue;
        };
        for (probe, connected) in e {
            if i.get(probe) != Some(connected) {
                differences.push(format!(
                    "{step}: {} -> {} {}/{}: ebpf {connected}, iptables {:?}",
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
        differences.push(format!("{step}: probed on iptables only"));
    }
    assert!(differences.is_empty(), "{}", differences.join("\n"));
}
