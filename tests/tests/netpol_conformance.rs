//! The upstream e2e NetworkPolicy scenarios (the one table in netpol-scenarios, which the
//! engine harness policy/tests/netpol_e2e.rs also runs) through `weir-lab`, against
//! hand-written truth tables, on a matrix of cells: dataplane {ebpf, iptables} × node
//! topology {routed, bridge} × kube-proxy {none, iptables, nftables, ipvs}, and lab mode
//! (objects from a file, or through the real kube-apiserver with the agent in cluster mode;
//! kube-proxy needs the server). Cells with kube-proxy run with `--services auto` and probe
//! every pod both directly and through its Service's ClusterIP (`--via both`): the verdict
//! through the Service must be the pod's. Every cell must give the same matrices step by
//! step (the differential check: a difference is a bug in one dataplane). Cells that run
//! every scenario directly run them all over IPv6 as well, built from the pods' IPv6
//! addresses so that their ipBlocks are IPv6 ([`Pass::Ipv6`]); every cell probes
//! [`IPV6_TOO`] over IPv6 as the scenarios stand.
//!
//! `cargo xtask test` runs [`CI_CELLS`]: every dataplane, topology and proxy mode that can
//! run on the host kernel at least once, some on a representative subset of scenarios.
//! `WEIR_CONFORMANCE_FULL=1` (`cargo xtask conformance`) runs every scenario in every cell
//! and prints the matrix as a table (`WEIR_CONFORMANCE_CELLS` chooses cells instead, as
//! `cargo xtask kernels` does for each kernel); ipvs cells are listed as not run when the kernel has
//! no IPVS (the host's has none: `CONFIG_IP_VS` is not built).
//!
//! One lab per cell is shared by its scenarios (policies are applied and deleted between
//! them); at most [`PARALLEL_LABS`] labs run at once (see [`parallel_labs`]).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use netpol_scenarios::{compare, scenarios, Addresses, Change, Scenario};
use weir_tests::lab::{manifest, netpol_world, Lab, Matrix};

/// Scenarios probed over IPv6 in every cell, directly and as built for IPv4 (none names an
/// address; the lab's Services are IPv4): one of each kind of peer, port and direction.
/// Cells that run every scenario directly run the rest over IPv6 too ([`Pass::Ipv6`]).
const IPV6_TOO: &[&str] = &[
    "default-deny-all",
    "only from a pod in a different namespace by podSelector and namespaceSelector",
    "ports (SCTP)",
    "ingress on one named port",
    "egress denied on the client even when the server allows",
    "ingress from an updated pod (relabel)",
    "cnp admin pass, then the network policy, then the baseline",
];

/// Every kind of peer, port, direction, update and ipBlock once.
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
    "cnp admin ingress: rule order and ports",
];

/// Through Services: ingress and egress (egress is what DNAT changes), named ports
/// (targetPort by name resolves per pod), namespace selectors, a relabel, SCTP, ipBlock;
/// and every ClusterNetworkPolicy scenario (about 3 s each through Services).
const PROXY_SUBSET: &[&str] = &[
    "default-deny-all",
    "only from a pod in a different namespace by podSelector and namespaceSelector",
    "ingress on one named port",
    "egress on one named port",
    "ingress from an updated pod (relabel)",
    "egress denied on the client even when the server allows",
    "ports (SCTP)",
    "except clause of a CIDR block",
    "cnp admin ingress: rule order and ports",
    "cnp admin egress: rule order and ports",
    "cnp admin pass, then the network policy, then the baseline",
    "cnp priority: the lower number first, and a change re-evaluated",
    "cnp networks as peers match pods too",
    "cnp named ports resolve on the destination",
    "cnp baseline egress: networks and a named port",
    "cnp baseline, and a network policy over it",
    "cnp admin gress: both directions in one policy, every protocol",
    "cnp baseline gress: both directions in one policy, every protocol",
    "cnp tiers of many rules: every rule in order, whatever indexes them",
];

/// Labs running at once: each probes 432 pairs per step with sub-second timeouts, on
/// machines with two cores. `WEIR_CONFORMANCE_LABS_AT_ONCE` sets another number (emulated
/// guests run their API-server cells one at a time: four control planes on two emulated
/// CPUs starved kube-proxy's first sync).
const PARALLEL_LABS: usize = 4;

fn parallel_labs() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| match std::env::var("WEIR_CONFORMANCE_LABS_AT_ONCE") {
        Ok(v) => v.parse().ok().filter(|n| *n > 0).unwrap_or_else(|| {
            panic!("WEIR_CONFORMANCE_LABS_AT_ONCE: {v:?} is not a positive number")
        }),
        Err(_) => PARALLEL_LABS,
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cell {
    dataplane: &'static str,
    /// `--api`: file or server.
    api: &'static str,
    /// `--topology`: routed or bridge.
    topology: &'static str,
    /// `--proxy`: none, iptables, nftables or ipvs (implies server).
    proxy: &'static str,
    /// `None`: every scenario.
    subset: Option<&'static [&'static str]>,
    /// The agent runs from weir's image under runc with the DaemonSet's spec
    /// (`--agent-image`), not as the test's own binary.
    from_image: bool,
    /// A dataplane variant the agent is told to use (`--agent-arg`): `legacy` (the
    /// iptables dataplane on iptables-legacy), `netlink` (eBPF attached with netlink
    /// clsact filters, as on 5.10–6.5 kernels), or "" for what the node chooses.
    variant: &'static str,
}

impl Cell {
    const fn new(
        dataplane: &'static str,
        api: &'static str,
        topology: &'static str,
        proxy: &'static str,
        subset: Option<&'static [&'static str]>,
    ) -> Cell {
        Cell {
            dataplane,
            api,
            topology,
            proxy,
            subset,
            from_image: false,
            variant: "",
        }
    }

    /// The same cell on a dataplane variant (see [`Cell::variant`]).
    const fn with_variant(self, variant: &'static str) -> Cell {
        Cell { variant, ..self }
    }

    /// The agent flag that forces the variant, and how to see that it took.
    fn variant_flag(&self) -> Option<&'static str> {
        match self.variant {
            "" => None,
            "legacy" => Some("--agent-arg=--iptables-backend=legacy"),
            "netlink" => Some("--agent-arg=--ebpf-attach=netlink"),
            other => panic!("unknown variant {other:?}"),
        }
    }

    /// The same cell with the agent in its container.
    const fn in_container(self) -> Cell {
        Cell {
            from_image: true,
            ..self
        }
    }

    fn name(&self) -> String {
        format!(
            "{} ({}, {}, kube-proxy {}{})",
            self.dataplane,
            self.api,
            self.topology,
            self.proxy,
            if self.from_image { ", agent image" } else { "" },
        ) + &match self.variant {
            "" => String::new(),
            v => format!(" [{v}]"),
        }
    }

    fn tag(&self) -> String {
        format!(
            "conf-{}-{}-{}-{}{}",
            self.dataplane,
            self.api,
            self.topology,
            self.proxy,
            if self.from_image { "-image" } else { "" },
        ) + &match self.variant {
            "" => String::new(),
            v => format!("-{v}"),
        }
    }

    fn through_services(&self) -> bool {
        self.proxy != "none"
    }

    /// A peer in weir's place (`weir-lab up --enforcer`, see [`the_peers_side_by_side`]).
    fn is_peer(&self) -> bool {
        PEERS.contains(&self.dataplane)
    }
}

/// The cells `cargo xtask test` runs: the first is the reference of the differential
/// check. Two run the agent from the image, as the DaemonSet does; the last two each
/// dataplane's other variant (iptables-legacy, eBPF's netlink attachment).
const CI_CELLS: [Cell; 12] = [
    Cell::new("ebpf", "file", "routed", "none", None),
    Cell::new("iptables", "file", "routed", "none", None),
    Cell::new("ebpf", "server", "routed", "none", None),
    Cell::new("iptables", "server", "routed", "none", None),
    Cell::new("ebpf", "file", "bridge", "none", Some(BRIDGE_SUBSET)),
    Cell::new("iptables", "file", "bridge", "none", Some(BRIDGE_SUBSET)),
    Cell::new("ebpf", "server", "routed", "iptables", Some(PROXY_SUBSET)),
    Cell::new(
        "iptables",
        "server",
        "bridge",
        "nftables",
        Some(PROXY_SUBSET),
    ),
    Cell::new("ebpf", "file", "routed", "none", Some(BRIDGE_SUBSET)).in_container(),
    Cell::new("iptables", "server", "bridge", "none", Some(BRIDGE_SUBSET)).in_container(),
    Cell::new("iptables", "file", "routed", "none", Some(BRIDGE_SUBSET)).with_variant("legacy"),
    Cell::new("ebpf", "file", "routed", "none", Some(BRIDGE_SUBSET)).with_variant("netlink"),
];

fn full_matrix_requested() -> bool {
    std::env::var_os("WEIR_CONFORMANCE_FULL").is_some()
}

/// The whole matrix, every scenario in every cell.
fn full_cells() -> Vec<Cell> {
    let mut cells = Vec::new();
    for topology in ["routed", "bridge"] {
        for proxy in ["none", "iptables", "nftables", "ipvs"] {
            for dataplane in ["ebpf", "iptables"] {
                let api = if proxy == "none" { "file" } else { "server" };
                cells.push(Cell::new(dataplane, api, topology, proxy, None));
            }
        }
    }
    for dataplane in ["ebpf", "iptables"] {
        cells.push(Cell::new(dataplane, "server", "routed", "none", None));
        cells.push(Cell::new(dataplane, "server", "routed", "none", None).in_container());
    }
    cells.push(Cell::new("iptables", "file", "routed", "none", None).with_variant("legacy"));
    cells.push(Cell::new("ebpf", "file", "routed", "none", None).with_variant("netlink"));
    cells
}

/// The cells of this run: those `WEIR_CONFORMANCE_CELLS` names, the CI set, or the whole
/// matrix with every scenario.
fn cells() -> Vec<Cell> {
    if let Some(chosen) = chosen_cells() {
        return chosen;
    }
    match full_matrix_requested() {
        true => full_cells(),
        false => CI_CELLS.to_vec(),
    }
}

/// `WEIR_CONFORMANCE_CELLS=dataplane/api/topology/proxy[/subset][/image][/variant],...`
/// (`cargo xtask kernels` chooses what each kernel runs); subset is `bridge` or `proxy`,
/// every scenario without it; `image` runs the agent from weir's image; variant is
/// `legacy` or `netlink` (see [`Cell::variant`]). The first is the reference of the
/// differential check.
fn chosen_cells() -> Option<Vec<Cell>> {
    let spec = std::env::var("WEIR_CONFORMANCE_CELLS").ok()?;
    let pick = |value: &str, allowed: &[&'static str]| -> &'static str {
        allowed.iter().find(|a| **a == value).unwrap_or_else(|| {
            panic!("WEIR_CONFORMANCE_CELLS: {value:?} is not one of {allowed:?}")
        })
    };
    let cells = spec
        .split(',')
        .map(|c| {
            let mut parts: Vec<&str> = c.trim().split('/').collect();
            let variant = match parts.last() {
                Some(&"legacy") => "legacy",
                Some(&"netlink") => "netlink",
                _ => "",
            };
            if !variant.is_empty() {
                parts.pop();
            }
            let from_image = parts.last() == Some(&"image");
            if from_image {
                parts.pop();
            }
            assert!(
                (4..=5).contains(&parts.len()),
                "WEIR_CONFORMANCE_CELLS: {c:?} is not dataplane/api/topology/proxy[/subset][/image][/variant]"
            );
            let subset = parts.get(4).map(|s| match *s {
                "bridge" => BRIDGE_SUBSET,
                "proxy" => PROXY_SUBSET,
                other => panic!("WEIR_CONFORMANCE_CELLS: subset {other:?} is not bridge or proxy"),
            });
            let cell = Cell::new(
                pick(parts[0], &["ebpf", "iptables"]),
                pick(parts[1], &["file", "server"]),
                pick(parts[2], &["routed", "bridge"]),
                pick(parts[3], &["none", "iptables", "nftables", "ipvs"]),
                subset,
            );
            match from_image {
                true => cell.in_container(),
                false => cell,
            }
            .with_variant(variant)
        })
        .collect();
    Some(cells)
}

/// `WEIR_CONFORMANCE_SCENARIOS=PREFIX,...` (`cargo xtask conformance --scenarios`): only
/// the scenarios whose names start with one of them, in every cell of the run; all without
/// it. A prefix that names no scenario is an error, not an empty run.
fn chosen_scenarios(all: &[Scenario]) -> impl Fn(&str) -> bool {
    let prefixes: Vec<String> = std::env::var("WEIR_CONFORMANCE_SCENARIOS")
        .map(|v| v.split(',').map(|p| p.trim().to_string()).collect())
        .unwrap_or_default();
    for prefix in &prefixes {
        assert!(
            all.iter().any(|s| s.name.starts_with(prefix.as_str())),
            "WEIR_CONFORMANCE_SCENARIOS: no scenario's name starts with {prefix:?}"
        );
    }
    move |name: &str| prefixes.is_empty() || prefixes.iter().any(|p| name.starts_with(p.as_str()))
}

/// A CI cell as this run runs it (in the full matrix, with every scenario).
fn cell(dataplane: &str, api: &str, topology: &str, proxy: &str) -> Cell {
    let matches = |c: &Cell| {
        (c.dataplane, c.api, c.topology, c.proxy) == (dataplane, api, topology, proxy)
            && !c.from_image
            && c.variant.is_empty()
    };
    cells()
        .into_iter()
        .find(matches)
        .or_else(|| CI_CELLS.into_iter().find(matches))
        .expect("a CI cell")
}

/// That the agent runs the cell's variant, as the node shows it: weir's chains in
/// iptables-legacy and none in nft, or weir's programs as netlink filters on the pods'
/// interfaces (TCX links show no filter).
fn variant_took(lab: &Lab, cell: Cell) -> Result<(), String> {
    let node = weir_tests::netns::NetNs::attach(&lab.node_netns());
    let run =
        |program: &str, args: &[&str]| node.ok(program, args, None).map_err(|e| e.to_string());
    match cell.variant {
        "" => Ok(()),
        "legacy" => {
            let legacy = run("iptables-legacy-save", &[])?;
            let nft = run("iptables-nft-save", &[])?;
            match (legacy.contains(":WEIR-"), nft.contains(":WEIR-")) {
                (true, false) => Ok(()),
                (l, n) => Err(format!("weir's chains in legacy: {l}, in nft: {n}")),
            }
        }
        "netlink" => {
            let links = run("ip", &["-o", "link", "show"])?;
            let pods: Vec<&str> = links
                .lines()
                .filter_map(|l| l.split(": ").nth(1)?.split('@').next())
                .filter(|n| n.starts_with("lxc"))
                .collect();
            let with_filter = pods
                .iter()
                .filter(|dev| {
                    run("tc", &["filter", "show", "dev", dev, "ingress"])
                        .is_ok_and(|f| f.contains("weir_from_pod"))
                })
                .count();
            match (pods.len(), with_filter) {
                (0, _) => Err(format!("no pod interfaces in the node: {links}")),
                (n, f) if n == f => Ok(()),
                (n, f) => Err(format!("{f} of {n} pod interfaces carry a netlink filter")),
            }
        }
        other => Err(format!("unknown variant {other:?}")),
    }
}

/// What one cell did: every step's matrix (labelled `NN scenario / step S`, with ` (ipv6)`
/// or ` via service`), every mismatch with the truth tables, or why it could not run.
struct SuiteRun {
    matrices: BTreeMap<String, Matrix>,
    /// Every scenario was also run over IPv6 (see [`Pass::Ipv6`]).
    ipv6_pass: bool,
    failures: Vec<String>,
    scenarios: usize,
    elapsed: Duration,
    not_run: Option<String>,
}

fn run_suite(cell: Cell) -> SuiteRun {
    let _slot = LabSlots::take();
    let name = cell.name();
    let started = Instant::now();
    let not_run = |why: &str| SuiteRun {
        matrices: BTreeMap::new(),
        ipv6_pass: false,
        failures: Vec::new(),
        scenarios: 0,
        elapsed: started.elapsed(),
        not_run: Some(why.into()),
    };
    if cell.proxy == "ipvs" && !weir_tests::kernel_has_ipvs() {
        return not_run("this kernel has no IPVS (CONFIG_IP_VS): kube-proxy's ipvs mode needs a kernel that has it");
    }
    if cell.proxy == "nftables" && !weir_lab::proxy::kernel_runs_nftables_mode() {
        return not_run(&format!(
            "kube-proxy's nftables mode needs Linux 5.13 or later; this kernel is {}",
            weir::kernel::release()
        ));
    }
    if cell.dataplane == "kube-network-policies" && !weir_tests::kernel_has_nft_queue() {
        return not_run("this kernel refuses nftables' queue statement (CONFIG_NFT_QUEUE), which kube-network-policies needs");
    }
    let lab = Lab::new(&cell.tag());
    let world = netpol_world();
    let enforcer = match cell.is_peer() {
        true => ["--enforcer", cell.dataplane],
        false => ["--dataplane", cell.dataplane],
    };
    let mut up = vec![
        "up",
        enforcer[0],
        enforcer[1],
        "--api",
        cell.api,
        "--topology",
        cell.topology,
    ];
    if cell.through_services() {
        up.extend(["--proxy", cell.proxy, "--services", "auto"]);
    }
    let image = cell.from_image.then(weir_tests::agent_image);
    if let Some(image) = &image {
        up.extend(["--agent-image", image.as_str()]);
    }
    up.extend(cell.variant_flag());
    up.push(world.to_str().unwrap());
    // A cell that cannot come up fails on its own: the others' results still get printed.
    if let Err(e) = lab.weir(&up) {
        eprintln!("{name}: lab up failed: {e}");
        return SuiteRun {
            matrices: BTreeMap::new(),
            ipv6_pass: false,
            failures: vec![format!("{name}: lab up: {e}")],
            scenarios: 0,
            elapsed: started.elapsed(),
            not_run: None,
        };
    }
    eprintln!("{name}: lab up in {:.1?}", started.elapsed());
    let mut variant_failures = Vec::new();
    if let Err(e) = variant_took(&lab, cell) {
        variant_failures.push(format!("{name}: variant {}: {e}", cell.variant));
    }
    let pods = lab.pod_addresses();
    let addresses = |v6: bool| -> Addresses {
        pods.iter()
            .map(|(pod, (v4, ip6))| (pod.clone(), if v6 { ip6 } else { v4 }.to_string()))
            .collect()
    };
    let (ips, ips6) = (addresses(false), addresses(true));

    let all = scenarios(&ips);
    for name in IPV6_TOO.iter().chain(BRIDGE_SUBSET).chain(PROXY_SUBSET) {
        assert!(
            all.iter().any(|s| s.name == *name),
            "a subset names no scenario {name:?}"
        );
    }
    for scenario in all.iter().filter(|s| s.name.starts_with("cnp")) {
        assert!(
            PROXY_SUBSET.contains(&scenario.name),
            "every ClusterNetworkPolicy scenario runs through Services: PROXY_SUBSET lacks {:?}",
            scenario.name
        );
    }
    let mut run = SuiteRun {
        matrices: BTreeMap::new(),
        // The lab runs the peers on IPv4 alone (kube-router needs an IPv6 Node address).
        ipv6_pass: cell.subset.is_none() && !cell.through_services() && !cell.is_peer(),
        failures: variant_failures,
        scenarios: 0,
        elapsed: Duration::ZERO,
        not_run: None,
    };
    let chosen = chosen_scenarios(&all);
    for (n, scenario) in all.iter().enumerate() {
        if cell.subset.is_some_and(|s| !s.contains(&scenario.name)) || !chosen(scenario.name) {
            continue;
        }
        run.scenarios += 1;
        if !run_scenario(&lab, cell, &world, n, scenario, Pass::Cell, &mut run) {
            break;
        }
    }
    // Every other scenario over IPv6 too, its ipBlocks from the pods' IPv6 addresses, in
    // the cells that run them all directly (the lab's Services are IPv4).
    if run.ipv6_pass {
        for (n, scenario) in scenarios(&ips6).iter().enumerate() {
            if IPV6_TOO.contains(&scenario.name) || !chosen(scenario.name) {
                continue;
            }
            if !run_scenario(&lab, cell, &world, n, scenario, Pass::Ipv6, &mut run) {
                break;
            }
        }
    }
    run.elapsed = started.elapsed();
    eprintln!("{name}: suite in {:.1?}", run.elapsed);
    run
}

/// Which probes a scenario's steps get: the cell's (IPv4, through Services where the cell
/// has them, and IPv6 too for [`IPV6_TOO`]), or IPv6 alone (the scenario built from the
/// pods' IPv6 addresses, so its ipBlocks are IPv6).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    Cell,
    Ipv6,
}

impl Pass {
    /// Told apart in the lab's manifest file names.
    fn tag(self) -> &'static str {
        match self {
            Pass::Cell => "",
            Pass::Ipv6 => "-v6",
        }
    }
}

/// Runs scenario `n`'s steps on the lab with `pass`'s probes, recording matrices and
/// failures in `run`, then takes the lab back to the bare world (`world`). False when it
/// cannot get back there: the cell's other scenarios cannot run.
fn run_scenario(
    lab: &Lab,
    cell: Cell,
    world: &std::path::Path,
    n: usize,
    scenario: &Scenario,
    pass: Pass,
    run: &mut SuiteRun,
) -> bool {
    let name = cell.name();
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
            if yaml.contains("kind: NetworkPolicy") || yaml.contains("kind: ClusterNetworkPolicy") {
                policies.push_str(yaml);
            } else {
                relabelled = true;
            }
            let file = manifest(lab, &format!("step{}-{n}-{s}-{c}.yaml", pass.tag()), yaml);
            if let Err(e) = lab.weir(&[verb, file.to_str().unwrap()]) {
                run.failures.push(format!("{name}: {label}: {e}"));
                step_ok = false;
            }
        }
        if !step_ok {
            continue;
        }
        let mut probed: Vec<(String, Result<Matrix, String>)> = Vec::new();
        if pass == Pass::Ipv6 {
            probed.push((format!("{label} (ipv6)"), probe(lab, cell, "ipv6")));
        } else if cell.through_services() {
            match lab.probe_routes("both") {
                Ok(routes) => {
                    assert_eq!(
                        routes.dataplane, cell.dataplane,
                        "{name}: another dataplane"
                    );
                    if !routes.skipped.is_empty() {
                        run.failures.push(format!(
                            "{name}: {label}: no Service for {:?}",
                            routes.skipped
                        ));
                    }
                    probed.push((label.clone(), Ok(routes.pod)));
                    probed.push((format!("{label} via service"), Ok(routes.service)));
                }
                Err(e) => probed.push((label.clone(), Err(e.to_string()))),
            }
        } else {
            probed.push((label.clone(), probe(lab, cell, "ipv4")));
        }
        if pass == Pass::Cell && IPV6_TOO.contains(&scenario.name) && !cell.is_peer() {
            probed.push((format!("{label} (ipv6)"), probe(lab, cell, "ipv6")));
        }
        for (label, matrix) in probed {
            match matrix {
                Ok(matrix) => {
                    if let Err(diff) = compare(&matrix, step.expect) {
                        run.failures.push(format!("{name}: {label}: {diff}"));
                    }
                    run.matrices.insert(label, matrix);
                }
                Err(e) => run.failures.push(format!("{name}: {label}: probe: {e}")),
            }
        }
    }
    // Back to the bare world for the next scenario.
    // A lab that cannot get back to it fails this cell, not the whole run.
    if !policies.is_empty() {
        let file = manifest(lab, &format!("cleanup{}-{n}.yaml", pass.tag()), &policies);
        if let Err(e) = lab.weir(&["delete", file.to_str().unwrap()]) {
            run.failures
                .push(format!("{name}: back to the bare world: {e}"));
            return false;
        }
    }
    if relabelled {
        if let Err(e) = lab.weir(&["apply", world.to_str().unwrap()]) {
            run.failures
                .push(format!("{name}: back to the bare world: {e}"));
            return false;
        }
    }
    eprintln!(
        "{name}: {n:02} {}{} in {:.1?}",
        scenario.name,
        if pass == Pass::Ipv6 { " (ipv6)" } else { "" },
        began.elapsed()
    );
    true
}

fn probe(lab: &Lab, cell: Cell, family: &str) -> Result<Matrix, String> {
    let (reported, matrix) = lab
        .probe(&["--family", family])
        .map_err(|e| e.to_string())?;
    assert_eq!(
        reported,
        cell.dataplane,
        "{}: the agent enforces another dataplane",
        cell.name()
    );
    Ok(matrix)
}

/// A counting semaphore over the labs of this process.
struct LabSlots;

static SLOTS: (Mutex<usize>, Condvar) = (Mutex::new(0), Condvar::new());

impl LabSlots {
    fn take() -> LabSlots {
        let (count, freed) = &SLOTS;
        let mut n = count.lock().unwrap_or_else(|e| e.into_inner());
        while *n >= parallel_labs() {
            n = freed.wait(n).unwrap_or_else(|e| e.into_inner());
        }
        *n += 1;
        LabSlots
    }
}

impl Drop for LabSlots {
    fn drop(&mut self) {
        let (count, freed) = &SLOTS;
        *count.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        freed.notify_one();
    }
}

type Runs = Mutex<BTreeMap<String, Arc<OnceLock<SuiteRun>>>>;

/// Each cell's run, once per process, shared by the tests that need it.
fn suite(cell: Cell) -> Arc<OnceLock<SuiteRun>> {
    static RUNS: OnceLock<Runs> = OnceLock::new();
    let runs = RUNS.get_or_init(Default::default);
    let once = runs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(cell.name())
        .or_default()
        .clone();
    once.get_or_init(|| run_suite(cell));
    once
}

fn assert_conforms(cell: Cell) {
    let once = suite(cell);
    let run = once.get().expect("run");
    if let Some(why) = &run.not_run {
        panic!("{}: not run: {why}", cell.name());
    }
    assert!(
        !run.matrices.is_empty(),
        "{}: no scenario was probed",
        cell.name()
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
    assert_conforms(cell("ebpf", "file", "routed", "none"));
}

#[test]
fn iptables_dataplane_passes_the_upstream_netpol_scenarios() {
    assert_conforms(cell("iptables", "file", "routed", "none"));
}

#[test]
fn ebpf_dataplane_passes_them_through_the_real_api_server() {
    assert_conforms(cell("ebpf", "server", "routed", "none"));
}

#[test]
fn iptables_dataplane_passes_them_through_the_real_api_server() {
    assert_conforms(cell("iptables", "server", "routed", "none"));
}

#[test]
fn ebpf_dataplane_on_a_bridge_passes_them() {
    assert_conforms(cell("ebpf", "file", "bridge", "none"));
}

#[test]
fn iptables_dataplane_on_a_bridge_passes_them() {
    assert_conforms(cell("iptables", "file", "bridge", "none"));
}

#[test]
fn ebpf_dataplane_passes_them_through_kube_proxy_iptables_via_services() {
    assert_conforms(cell("ebpf", "server", "routed", "iptables"));
}

#[test]
fn iptables_dataplane_on_a_bridge_passes_them_through_kube_proxy_nftables_via_services() {
    assert_conforms(cell("iptables", "server", "bridge", "nftables"));
}

/// Every cell gives the reference cell's matrices on the steps it runs (a step probed
/// through Services against the same step probed directly), and full cells run every step
/// the reference runs. With `WEIR_CONFORMANCE_FULL=1`, over the whole matrix, printed as a
/// table.
#[test]
fn every_cell_gives_the_same_matrices() {
    let cells = cells();
    let runs: Vec<(Cell, Arc<OnceLock<SuiteRun>>)> = std::thread::scope(|s| {
        let handles: Vec<_> = cells
            .iter()
            .map(|cell| s.spawn(move || (*cell, suite(*cell))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let get = |i: usize| runs[i].1.get().expect("run");
    let reference = get(0);
    let mut differences = Vec::new();
    for (i, (cell, _)) in runs.iter().enumerate().skip(1) {
        let run = get(i);
        if run.not_run.is_some() {
            continue;
        }
        differences.extend(differ(
            &runs[0].0.name(),
            reference,
            &cell.name(),
            run,
            cell.subset.is_none(),
        ));
    }
    let table = table(
        &runs
            .iter()
            .map(|(c, r)| (*c, r.get().expect("run")))
            .collect::<Vec<_>>(),
    );
    eprintln!("{table}");
    keep_table("latest.txt", &table);
    assert!(
        differences.is_empty(),
        "{} differences:\n{}",
        differences.len(),
        differences.join("\n")
    );
    let failed: Vec<String> = runs
        .iter()
        .filter_map(|(c, r)| {
            let r = r.get().expect("run");
            (!r.failures.is_empty()).then(|| format!("{}: {} failures", c.name(), r.failures.len()))
        })
        .collect();
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// The differences between `run`'s matrices and the reference's on the same steps.
/// Keeps a printed table in target/conformance/`name`, where `cargo xtask test` prints it:
/// what ran where, even when every cell passes and the test's output is captured. (A
/// read-only tree, as in `cargo xtask kernels`' guests, keeps it in the log only.)
fn keep_table(name: &str, table: &str) {
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/conformance");
    if let Err(e) =
        std::fs::create_dir_all(&out).and_then(|()| std::fs::write(out.join(name), table))
    {
        eprintln!("{name} not kept in {}: {e}", out.display());
    }
}

fn differ(
    reference_name: &str,
    reference: &SuiteRun,
    name: &str,
    run: &SuiteRun,
    every_step: bool,
) -> Vec<String> {
    let mut differences = Vec::new();
    for (step, matrix) in &run.matrices {
        let direct = step.strip_suffix(" via service").unwrap_or(step);
        let Some(expected) = reference.matrices.get(direct) else {
            differences.push(format!("{step}: probed on {name}, not on {reference_name}"));
            continue;
        };
        for (probe, connected) in expected {
            if matrix.get(probe) != Some(connected) {
                differences.push(format!(
                    "{step}: {} -> {} {}/{}: {reference_name} {connected}, {name} {:?}",
                    probe.0,
                    probe.1,
                    probe.2,
                    probe.3,
                    matrix.get(probe)
                ));
            }
        }
    }
    if every_step {
        // A cell without the IPv6 pass (through Services) runs only IPV6_TOO over IPv6.
        let runs_it = |s: &str| {
            run.ipv6_pass || !s.ends_with("(ipv6)") || IPV6_TOO.iter().any(|n| s.contains(n))
        };
        for step in reference
            .matrices
            .keys()
            .filter(|s| !run.matrices.contains_key(*s) && runs_it(s))
        {
            differences.push(format!("{step}: probed on {reference_name}, not on {name}"));
        }
    }
    differences
}

/// The matrix as a table: one row per cell.
fn table(runs: &[(Cell, &SuiteRun)]) -> String {
    let mut out = String::from(
        "\nconformance matrix (upstream netpol scenarios, truth tables and the differential check)\n",
    );
    let _ = writeln!(
        out,
        "{:<9} {:<7} {:<8} {:<9} {:<6} {:<8} {:>9} {:>6} {:>5} {:>8} {:>8} {:>8}  result",
        "dataplane",
        "api",
        "topology",
        "proxy",
        "agent",
        "variant",
        "scenarios",
        "steps",
        "ipv6",
        "probes",
        "failures",
        "time"
    );
    for (cell, run) in runs {
        let probes: usize = run.matrices.values().map(|m| m.len()).sum();
        let result = match &run.not_run {
            Some(why) => format!("NOT RUN: {why}"),
            None if run.failures.is_empty() => "pass".to_string(),
            None => "FAIL".to_string(),
        };
        let _ = writeln!(
            out,
            "{:<9} {:<7} {:<8} {:<9} {:<6} {:<8} {:>9} {:>6} {:>5} {:>8} {:>8} {:>7.0}s  {result}",
            cell.dataplane,
            cell.api,
            cell.topology,
            cell.proxy,
            if cell.from_image { "image" } else { "binary" },
            match cell.variant {
                "" => "auto",
                v => v,
            },
            run.scenarios,
            run.matrices.len(),
            run.matrices.keys().filter(|k| k.contains("(ipv6)")).count(),
            probes,
            run.failures.len(),
            run.elapsed.as_secs_f64(),
        );
    }
    out
}

/// The peers `cargo xtask peers` builds (deploy/peer-versions), by their `--enforcer` name
/// (azure-npm: its default version, the newest release).
const PEERS: &[&str] = &["kube-router", "kube-network-policies", "azure-npm"];
/// Peers only `cargo xtask peers` runs by default: Azure NPM v1.8.12 takes 5 min to build
/// cold, which `cargo xtask test` does not pay.
const FULL_ONLY: &[&str] = &["azure-npm"];

/// weir and its peers on the same scenario table, through the lab's API server:
/// `cargo xtask peers` (`WEIR_PEERS_FULL=1`) runs every scenario on the peers,
/// `cargo xtask test` the bridge subset (weir's columns are always the whole table). weir must pass; a peer's wrong verdicts are findings, printed in the
/// table with the probes it got wrong, and do not fail the test. A peer that could not
/// come up fails it (a missing binary names `cargo xtask peers --build-only`), and one the
/// kernel cannot run is listed as not run, with the reason. `WEIR_PEERS_ENFORCERS` names
/// the columns (default: both dataplanes and every peer, but Azure NPM only with
/// `WEIR_PEERS_FULL`; `cargo xtask kernels` runs fewer).
#[test]
fn the_peers_side_by_side() {
    let full = std::env::var_os("WEIR_PEERS_FULL").is_some();
    let subset = match full {
        true => None,
        false => Some(BRIDGE_SUBSET),
    };
    let known: Vec<&'static str> = ["ebpf", "iptables"]
        .into_iter()
        .chain(PEERS.iter().copied())
        .collect();
    let default: Vec<&str> = known
        .iter()
        .copied()
        .filter(|k| full || !FULL_ONLY.contains(k))
        .collect();
    let chosen = std::env::var("WEIR_PEERS_ENFORCERS").unwrap_or_else(|_| default.join(","));
    let cells: Vec<Cell> = chosen
        .split(',')
        .map(|name| {
            let enforcer = known
                .iter()
                .find(|k| **k == name.trim())
                .unwrap_or_else(|| {
                    panic!("WEIR_PEERS_ENFORCERS: {name:?} is not one of {known:?}")
                });
            // weir's cells are the CI's own (every scenario), run once for both tests: a
            // second run of the same cell would collide with it (one lab per cell name).
            let subset = if PEERS.contains(enforcer) {
                subset
            } else {
                None
            };
            Cell::new(enforcer, "server", "routed", "none", subset)
        })
        .collect();
    let runs: Vec<(Cell, Arc<OnceLock<SuiteRun>>)> = std::thread::scope(|s| {
        let handles: Vec<_> = cells
            .iter()
            .map(|cell| s.spawn(move || (*cell, suite(*cell))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let runs: Vec<(Cell, &SuiteRun)> = runs
        .iter()
        .map(|(c, r)| (*c, r.get().expect("run")))
        .collect();
    let table = peers_table(&runs);
    eprintln!("{table}");
    keep_table("peers.txt", &table);
    let mut broken = Vec::new();
    for (cell, run) in &runs {
        let lab_failures: Vec<&String> = run
            .failures
            .iter()
            .filter(|f| !cell.is_peer() || !f.contains(" / step "))
            .collect();
        if !lab_failures.is_empty() {
            broken.push(format!(
                "{}:\n{}",
                cell.name(),
                lab_failures
                    .iter()
                    .map(|f| f.as_str())
                    .collect::<Vec<_>>()
                    .join("\n")
            ));
        }
        if run.not_run.is_none() && run.matrices.is_empty() {
            broken.push(format!("{}: no scenario was probed", cell.name()));
        }
    }
    assert!(
        runs.iter().any(|(c, r)| c.is_peer() && r.not_run.is_none()),
        "no peer ran"
    );
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// What a scenario is built on that no peer implements: ClusterNetworkPolicy, and weir's
/// own audit mode (an annotation).
fn peer_lacks(scenario: &Scenario) -> Option<&'static str> {
    if scenario.name.starts_with("cnp ") {
        Some("CNP")
    } else if scenario.name.contains("audit-mode") {
        Some("weir's audit mode")
    } else {
        None
    }
}

/// One row per scenario, one column per enforcer: pass, FAIL (with the number of wrong
/// probes), `unsupported` where a peer fails a scenario built on what it does not
/// implement ([`peer_lacks`]), or not run; then each failure's probes.
fn peers_table(runs: &[(Cell, &SuiteRun)]) -> String {
    // Only the names are needed; the ipBlock scenarios want an address for each pod.
    let placeholders: Addresses = ["x", "y", "z"]
        .iter()
        .flat_map(|ns| ["a", "b", "c"].map(|pod| format!("{ns}/{pod}")))
        .enumerate()
        .map(|(i, pod)| (pod, format!("10.0.0.{}", i + 1)))
        .collect();
    let all = scenarios(&placeholders);
    let mut out = String::from("\npeers side by side (upstream netpol scenarios through the lab's API server, routed, IPv4)\n");
    let _ = write!(out, "{:<78}", "scenario");
    for (cell, _) in runs {
        let _ = write!(out, " {:<22}", cell.dataplane);
    }
    out.push('\n');
    let mut details = String::new();
    for (n, scenario) in all.iter().enumerate() {
        if runs.iter().all(|(_, r)| {
            r.not_run.is_some()
                || !r
                    .matrices
                    .keys()
                    .any(|k| k.starts_with(&format!("{n:02} ")))
        }) {
            continue;
        }
        let _ = write!(out, "{:<78}", format!("{n:02} {}", scenario.name));
        for (cell, run) in runs {
            let prefix = format!(": {n:02} {} / step ", scenario.name);
            let wrong: Vec<&String> = run
                .failures
                .iter()
                .filter(|f| f.contains(&prefix))
                .collect();
            let probed = run
                .matrices
                .keys()
                .any(|k| k.starts_with(&format!("{n:02} ")));
            let verdict = match (&run.not_run, probed, wrong.len()) {
                (Some(_), _, _) => "not run".to_string(),
                (None, false, _) => "-".to_string(),
                (None, true, 0) => "pass".to_string(),
                (None, true, _) if cell.is_peer() && peer_lacks(scenario).is_some() => {
                    format!("unsupported ({})", peer_lacks(scenario).unwrap_or_default())
                }
                (None, true, k) => format!("FAIL ({k} steps)"),
            };
            let _ = write!(out, " {verdict:<22}");
            if verdict.starts_with("FAIL") {
                for f in wrong {
                    let _ = writeln!(details, "  {f}");
                }
            }
        }
        out.push('\n');
    }
    for (cell, run) in runs {
        if let Some(why) = &run.not_run {
            let _ = writeln!(out, "{}: not run: {why}", cell.dataplane);
        }
    }
    if !details.is_empty() {
        out.push_str("\nwrong probes:\n");
        out.push_str(&details);
    }
    out
}
