//! Generated cases with real packets: random NetworkPolicies over the netpol world
//! (netpol-scenarios' `generated`), each applied to a lab, probed over its family (IPv4 or
//! IPv6, with ipBlocks in that family and sometimes the other), and deleted, on both
//! dataplanes. Every matrix must equal the reference evaluator's, so the two dataplanes
//! also agree with each other. The engine harness runs the same generator over hundreds of
//! cases (policy/tests/netpol_e2e.rs); this is where the kernel is asked.
//!
//! - `WEIR_GENERATED_SEED`: the run's seed (decimal or 0x hex); without it, one from the
//!   clock, printed, and named in any failure.
//! - `WEIR_GENERATED_CASES`: how many cases (default [`CASES`]).
//! - `WEIR_GENERATED_CASE`: one case's seed, run alone (a failure names it).

use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use netpol_scenarios::compare;
use netpol_scenarios::generated::{self, DualAddresses};
use weir_tests::lab::{manifest, netpol_world, Lab};

/// Cases a run draws: each is an apply, 432 probes and a delete, about two seconds.
const CASES: usize = 30;

/// The seeds of this run's cases (the same for both dataplanes), and how to name the run.
fn seeds() -> &'static (Vec<u64>, String) {
    static SEEDS: OnceLock<(Vec<u64>, String)> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let env = |name: &str| {
            std::env::var(name)
                .ok()
                .map(|v| generated::parse_seed(&v).unwrap_or_else(|e| panic!("{name}: {e}")))
        };
        if let Some(case) = env("WEIR_GENERATED_CASE") {
            return (vec![case], format!("the one case {case:#018x}"));
        }
        let count = env("WEIR_GENERATED_CASES").map_or(CASES, |n| n as usize);
        let run = env("WEIR_GENERATED_SEED").unwrap_or_else(|| {
            let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
            now.as_secs() ^ u64::from(now.subsec_nanos())
        });
        (
            generated::case_seeds(run, count),
            format!("run seed {run:#018x} ({count} cases; replay: WEIR_GENERATED_SEED={run:#x})"),
        )
    })
}

fn generated_cases_hold_on(dataplane: &str) {
    let (seeds, run) = seeds();
    eprintln!("{dataplane}: {run}");
    let lab = Lab::new(&format!("gen-{dataplane}"));
    let world = netpol_world();
    lab.weir(&["up", "--dataplane", dataplane, world.to_str().unwrap()])
        .unwrap_or_else(|e| panic!("{dataplane}: lab up: {e}"));
    let addresses: DualAddresses = lab.pod_addresses();

    let started = Instant::now();
    let mut failures = Vec::new();
    let (mut allowed, mut denied) = (0, 0);
    for (n, &seed) in seeds.iter().enumerate() {
        let case = generated::draw(seed, &addresses);
        let file = manifest(&lab, &format!("case-{n}.yaml"), &case.manifests());
        let file = file.to_str().unwrap();
        let applied = lab.weir(&["apply", file]);
        match applied.and_then(|_| lab.probe(&["--family", case.family.flag()])) {
            Ok((reported, matrix)) => {
                assert_eq!(reported, dataplane, "the agent enforces another dataplane");
                allowed += matrix.values().filter(|v| **v).count();
                denied += matrix.values().filter(|v| !**v).count();
                if let Err(diff) = compare(&matrix, case.truth()) {
                    failures.push(format!("{}{diff}", case.describe()));
                }
            }
            Err(e) => failures.push(format!("{}apply or probe: {e}", case.describe())),
        }
        // Back to the bare world (also after a failed apply, which may have applied some of
        // the policies); a lab that cannot get there cannot judge the next case.
        if let Err(e) = lab.weir(&["delete", file]) {
            failures.push(format!("{}delete: {e}", case.describe()));
            break;
        }
    }
    eprintln!(
        "{dataplane}: {} generated cases in {:.1?}: {allowed} probes connected, {denied} blocked",
        seeds.len(),
        started.elapsed()
    );
    // A run of many cases that never blocks (or never connects) tests nothing.
    assert!(
        seeds.len() == 1 || (allowed > 0 && denied > 0),
        "{dataplane}: the cases did not both allow and deny: {allowed} connected, {denied} blocked"
    );
    assert!(
        failures.is_empty(),
        "{dataplane}, {run}: {} of {} cases failed:\n{}",
        failures.len(),
        seeds.len(),
        failures.join("\n")
    );
}

#[test]
fn generated_cases_hold_on_ebpf() {
    generated_cases_hold_on("ebpf");
}

#[test]
fn generated_cases_hold_on_iptables() {
    generated_cases_hold_on("iptables");
}
