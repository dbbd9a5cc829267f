//! What runs on each kernel: integration test binaries (each one group), and the script
//! that runs them in a guest or on the host.
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::cmd::workspace_root;

pub struct Group {
    /// The table's row, and the log's name.
    pub name: &'static str,
    /// The integration test target (tests/tests/<test>.rs).
    pub test: &'static str,
    /// libtest arguments: a filter, `--exact`.
    pub args: &'static [&'static str],
    pub env: &'static [(&'static str, &'static str)],
    /// Guests only: the kernel command line to boot with (a boot of its own).
    pub boot_append: Option<&'static str>,
    /// Host only, and why: it tests nothing of the kernel's, and takes long emulated.
    pub host_only: Option<&'static str>,
    /// Guests only, and why: it needs what Debian's kernels have and the host's may not.
    pub guests_only: Option<&'static str>,
    /// In `--quick` (CI on 5.10).
    pub quick: bool,
    /// Only in `--quick`: a slice of a group the full matrix runs whole.
    pub quick_only: bool,
    /// The group is killed after this long.
    pub timeout_secs: u32,
}

const fn group(name: &'static str, test: &'static str, quick: bool, timeout_secs: u32) -> Group {
    Group {
        name,
        test,
        args: &[],
        env: &[],
        boot_append: None,
        host_only: None,
        guests_only: None,
        quick,
        quick_only: false,
        timeout_secs,
    }
}

/// The conformance cells a kernel run probes: both dataplanes, routed and bridged, from
/// files (the API-server and kube-proxy cells are userspace above the same dataplane and
/// run on the host, `cargo xtask conformance`).
const CONFORMANCE_CELLS: &str = "ebpf/file/routed/none,iptables/file/routed/none,\
                                 ebpf/file/bridge/none/bridge,iptables/file/bridge/none/bridge";
/// The quick run's cells: both dataplanes, routed, a scenario of each kind.
const CONFORMANCE_QUICK_CELLS: &str =
    "ebpf/file/routed/none/bridge,iptables/file/routed/none/bridge";
/// kube-proxy's ipvs mode, which the host kernel cannot run (no `CONFIG_IP_VS`; Debian's
/// kernels build it as a module): both dataplanes, both topologies, every scenario, through
/// Services and directly. The eBPF bridge cell goes first: it is where rules went missing.
const CONFORMANCE_IPVS_CELLS: &str = "ebpf/server/bridge/ipvs,iptables/server/routed/ipvs,\
     ebpf/server/routed/ipvs,iptables/server/bridge/ipvs";
const IPVS_GUESTS_ONLY: &str = "needs IPVS, which Debian's kernels have (the host's may not)";

const CELLS: &str = "WEIR_CONFORMANCE_CELLS";
/// Four control planes at once on two emulated CPUs starved kube-proxy's first sync; two
/// at a time keep both emulated CPUs busy.
const LABS_AT_ONCE: &str = "WEIR_CONFORMANCE_LABS_AT_ONCE";

/// The differential conformance check on the cells `env` names (`CELLS`), its table
/// printed.
const fn conformance(
    name: &'static str,
    env: &'static [(&'static str, &'static str)],
    quick: bool,
    timeout_secs: u32,
) -> Group {
    Group {
        args: &[
            "every_cell_gives_the_same_matrices",
            "--exact",
            "--nocapture",
        ],
        env,
        ..group(name, "netpol_conformance", quick, timeout_secs)
    }
}

// The quick run (CI, 5.10 in software emulation, 15-35 min) touches each thing only a
// guest shows: eBPF enforcement, both dataplanes through the conformance subset, and
// kube-proxy's ipvs mode. The rest of 5.10's groups are the full matrix's.
pub const GROUPS: &[Group] = &[
    group("kernel_floor", "kernel_floor", false, 600),
    // A node whose kernel cannot load br_netfilter or ip_set: the errors must name them.
    Group {
        args: &["a_module_the_kernel_cannot_load_is_named", "--exact"],
        boot_append: Some("module_blacklist=br_netfilter,ip_set"),
        ..group("missing_modules", "kernel_floor", false, 600)
    },
    group("ebpf_dataplane", "ebpf_dataplane", true, 600),
    group("ebpf_restart", "ebpf_restart", false, 900),
    group("reset_ebpf", "reset_ebpf", false, 600),
    group("iptables_enforcement", "iptables_enforcement", false, 900),
    group("reset", "reset", false, 900),
    group("dataplane_switch", "dataplane_switch", false, 900),
    group("agent_npm_migration", "agent_npm_migration", false, 900),
    group("hostile_packets", "hostile_packets", false, 1200),
    group("hostile_kill", "hostile_kill", false, 1800),
    group("hostile_lifecycle", "hostile_lifecycle", false, 1200),
    group("hostile_timing", "hostile_timing", false, 1200),
    // A tenant using its own flows' state: ICMP errors off their path, reused tuples.
    group("hostile_tenant", "hostile_tenant", false, 1200),
    // A tenant's relabels that release an identity while another signature is new, under
    // a storm of SYNs that must stay denied.
    group("hostile_relabel", "hostile_relabel", false, 900),
    group("lab_world", "lab_world", false, 900),
    // ClusterNetworkPolicy tiers on both dataplanes, with real packets.
    group("cluster_policies", "cluster_policies", false, 900),
    // A tenant filling the node's tables: budgets refuse it, a full POLICY map fails closed.
    group("tenant_tables", "hostile_tenant_tables", false, 1200),
    // The eBPF programs' verdict counters and the iptables rules' counters, read back, and
    // the verdict log (ring buffer, NFLOG) of both.
    group("agent_status", "agent_status", false, 600),
    group("bridge_topology", "bridge_topology", false, 1200),
    // These run the real kube-apiserver (and kube-proxy) per lab: one lab at a time.
    Group {
        args: &["--test-threads=1"],
        ..group("service_paths", "service_paths", false, 1800)
    },
    Group {
        args: &["--test-threads=1"],
        ..group("lab_services", "lab_services", false, 2400)
    },
    // kube-proxy's ipvs mode, both dataplanes (where the host has no IPVS, these check the
    // refusal). Their two labs at once took as long as one after the other (838 s against
    // 777 s): the two emulated CPUs are the limit.
    Group {
        args: &["ipvs", "--test-threads=1"],
        ..group("ipvs_services", "lab_services", false, 1800)
    },
    // The quick run's slice of it: the one proxy mode the host's kernel cannot run, on
    // eBPF (the dataplane whose hooks IPVS's forwarding path tests); iptables meets ipvs
    // in the full matrix.
    Group {
        args: &["ipvs_on_ebpf", "--test-threads=1"],
        quick_only: true,
        ..group("ipvs_services_ebpf", "lab_services", true, 1800)
    },
    Group {
        host_only: Some(
            "the agent against the API server (watches, RBAC, restarts): no kernel code, and \
             an emulated kube-apiserver takes minutes to start",
        ),
        ..group("cluster_mode", "cluster_mode", false, 2400)
    },
    conformance("conformance", &[(CELLS, CONFORMANCE_CELLS)], false, 3600),
    conformance(
        "conformance_quick",
        &[(CELLS, CONFORMANCE_QUICK_CELLS)],
        true,
        1200,
    ),
    // The peers side by side (`cargo xtask peers`): kube-network-policies needs nftables'
    // queue, which Debian's kernels have and the host's lacks. The peers alone, on the bridge
    // subset (weir's columns are every scenario twice, an hour emulated; the conformance
    // groups run weir there).
    Group {
        args: &["the_peers_side_by_side", "--exact", "--nocapture"],
        env: &[
            ("WEIR_PEERS_ENFORCERS", "kube-network-policies,kube-router"),
            (LABS_AT_ONCE, "1"),
        ],
        ..group("peers", "netpol_conformance", false, 3600)
    },
    Group {
        guests_only: Some(IPVS_GUESTS_ONLY),
        ..conformance(
            "conformance_ipvs",
            &[(CELLS, CONFORMANCE_IPVS_CELLS), (LABS_AT_ONCE, "2")],
            false,
            3 * 3600,
        )
    },
];

/// The lab waits this long for the agent to enforce a change in a software-emulated guest
/// (60 s by default; an agent there starts several times slower).
const SLOW_LAB_TIMEOUT_SECS: u32 = 300;
/// A probe there waits this long for its answer (700 ms by default): with a kube-apiserver,
/// etcd and kube-proxy sharing two emulated CPUs, answers took longer and allowed pairs
/// were counted as blocked.
const SLOW_PROBE_TIMEOUT_MS: u32 = 2000;
/// A peer's rules must stand still this long there before the lab takes a change as
/// enforced (1.5 s by default): on 5.10 under TCG, kube-router's first sync after a change
/// came later than that, and probes saw the old verdicts.
const SLOW_PEER_QUIET_MS: u32 = 5000;

/// A POSIX shell script that runs `groups` one after another, each under `timeout`, with
/// its log, its exit code and seconds in `results`, then touches `done` there. `slow`: the
/// machine is emulated, so the lab waits longer.
pub fn script(
    groups: &[&Group],
    binaries: &BTreeMap<String, PathBuf>,
    results: &Path,
    done: &str,
    slow: bool,
    scenarios: &[String],
) -> String {
    let r = results.display();
    let mut s = format!(
        "# Written by `cargo xtask kernels`; runs in a guest (or on the host) as root.\n\
         set -u\n\
         {}\
         export RUST_BACKTRACE=0\n\
         export WEIR_BIN={}\n\
         export WEIR_TEST_KEEP_LOGS={r}/logs\n\
         mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf\n\
         uname -r > {r}/release\n\
         cd {}\n",
        if slow {
            format!(
                "export WEIR_LAB_TIMEOUT_SECS={SLOW_LAB_TIMEOUT_SECS}\n\
                 export WEIR_LAB_PROBE_TIMEOUT_MS={SLOW_PROBE_TIMEOUT_MS}\n\
                 export WEIR_LAB_PEER_QUIET_MS={SLOW_PEER_QUIET_MS}\n"
            )
        } else {
            String::new()
        },
        binaries["weir"].display(),
        workspace_root().join("tests").display()
    );
    if !scenarios.is_empty() {
        // Checked free of quotes and commas (`kernels::run`).
        writeln!(
            s,
            "export WEIR_CONFORMANCE_SCENARIOS='{}'",
            scenarios.join(",")
        )
        .unwrap();
    }
    for g in groups {
        let exe = &binaries[g.test];
        let env: String = g.env.iter().map(|(k, v)| format!("{k}='{v}' ")).collect();
        let args = g.args.join(" ");
        writeln!(
            s,
            "echo '==> {name}'; started=$(date +%s)\n\
             env {env}timeout --kill-after=10 {t} {exe} {args} > {r}/{name}.log 2>&1\n\
             echo \"$? $(( $(date +%s) - started ))\" > {r}/{name}.status\n\
             tail -n 3 {r}/{name}.log",
            name = g.name,
            t = g.timeout_secs,
            exe = exe.display(),
        )
        .unwrap();
    }
    writeln!(s, "touch {r}/{done}").unwrap();
    s
}
