//! What weir says and does about the kernel it runs on, on whichever kernel
//! runs the tests: the host's, or Debian's 5.10 and 6.1 under `cargo xtask kernels`.
//! Each test asserts the behaviour its kernel must show; none is skipped on any kernel.

use std::process::Command;

use weir_tests::lab::{manifest, Lab};

/// The running kernel's (major, minor), read from uname independently of weir's probes.
fn kernel_version() -> (u32, u32) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("osrelease");
    let mut parts = release
        .trim()
        .split(['.', '-'])
        .map(|p| p.parse().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// `weir version` names the programs' floor and, before 6.6, the missing TCX links with
/// the fallback taken; on 6.6 and later nothing is missing.
#[test]
fn weir_version_names_what_this_kernel_lacks() {
    weir_tests::require_root_and_tools();
    let out = Command::new(weir_tests::weir_bin::path().unwrap())
        .arg("version")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("built for Linux 5.10 or later"),
        "no floor: {text}"
    );
    let size = std::fs::metadata(weir_tests::weir_bin::path().unwrap())
        .unwrap()
        .len();
    assert!(
        text.contains(&format!(
            "binary: {:.1} MiB ({size} bytes)",
            size as f64 / 1048576.0
        )),
        "version gives the binary's size: {text}"
    );
    if kernel_version() < (6, 6) {
        assert!(
            text.contains("it lacks TCX links") && text.contains("clsact filters over netlink"),
            "a kernel before 6.6 lacks TCX, and version must say so: {text}"
        );
    } else {
        assert!(text.contains("it lacks nothing weir uses"), "{text}");
    }
}

const ONE_POD_DENIED: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: x}
---
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: x, labels: {pod: a}}
spec: {containers: [{name: c, ports: [{containerPort: 80}]}]}
status: {podIP: 10.244.0.2}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: x, labels: {pod: b}}
spec: {containers: [{name: c, ports: [{containerPort: 80}]}]}
status: {podIP: 10.244.0.3}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: b-closed, namespace: x}
spec:
  podSelector: {matchLabels: {pod: b}}
  policyTypes: [Ingress]
"#;

/// A load failure forced with a real kernel: the agent runs with RLIMIT_MEMLOCK at 64 KiB
/// and without CAP_SYS_RESOURCE, so it cannot lift the limit. Kernels before 5.11 charge
/// BPF maps to that limit and refuse them: the agent asked for eBPF must fall back to
/// iptables, say why, and enforce. Kernels from 5.11 charge the memory cgroup instead,
/// and the same agent must run eBPF.
#[test]
fn a_kernel_that_refuses_the_maps_gets_iptables_and_the_reason() {
    let lab = Lab::new("floor-memlock");
    let world = manifest(&lab, "world.yaml", ONE_POD_DENIED);
    let weir = weir_tests::weir_bin::path().unwrap();
    let out = Command::new("prlimit")
        .args(["--memlock=65536:65536", "--"])
        .args([
            "setpriv",
            "--bounding-set=-sys_resource",
            "--inh-caps=-sys_resource",
        ])
        .arg(weir_tests::weir_bin::lab_path().unwrap())
        .arg("--weir-bin")
        .arg(&weir)
        .arg("--state-dir")
        .arg(&lab.dir)
        .args(["up", "--dataplane", "ebpf", world.to_str().unwrap()])
        .output()
        .expect("prerequisite missing: prlimit and setpriv (util-linux)");
    assert!(
        out.status.success(),
        "lab up: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(lab.dir.join("status.json")).unwrap())
            .unwrap();
    let (dataplane, matrix) = lab.probe(&[]).unwrap();
    if kernel_version() < (5, 11) {
        assert_eq!(dataplane, "iptables", "{status}");
        let reason = status["fallback_reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains("ebpf: eBPF dataplane failed to start")
                && reason.contains("Operation not permitted")
                && reason.contains("RLIMIT_MEMLOCK"),
            "the fallback must carry the kernel's refusal: {status}"
        );
    } else {
        assert_eq!(dataplane, "ebpf", "{status}");
        assert!(status["fallback_reason"].is_null(), "{status}");
    }
    for ((from, to, port, protocol), connected) in &matrix {
        let want = to != "x/b";
        assert_eq!(
            *connected, want,
            "{from} -> {to} {port}/{protocol} on {dataplane}"
        );
    }
}

/// Modules the kernel refuses to load (`module_blacklist=` on its command line, as `cargo
/// xtask kernels` boots a guest to stand for a node whose modules are missing; unlike
/// modprobe.blacklist, which only stops loading by alias, the kernel refuses them).
fn blacklisted_modules() -> Vec<String> {
    let cmdline = std::fs::read_to_string("/proc/cmdline").expect("/proc/cmdline");
    cmdline
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("module_blacklist="))
        .flat_map(|list| list.split(','))
        .map(str::to_string)
        .collect()
}

/// A module the kernel cannot load is named in `weir-lab up`'s error with why (the tools
/// themselves say "Cannot open session to kernel" or nothing); where it can be loaded,
/// the same commands work. A guest booted with br_netfilter and ip_set blacklisted runs
/// the first half; every other kernel the second.
#[test]
fn a_module_the_kernel_cannot_load_is_named() {
    let blacklisted = blacklisted_modules();
    let world = weir_tests::lab::netpol_world();
    let world = world.to_str().unwrap();
    let missing = |module: &str, sysfs: &str| {
        blacklisted.iter().any(|m| m == module) && !std::path::Path::new(sysfs).exists()
    };

    let up_names = |tag: &str, args: &[&str], module: &str, sysfs: &str| {
        let lab = Lab::new(tag);
        let args: Vec<&str> = ["up"].iter().chain(args).chain(&[world]).copied().collect();
        let out = lab.weir_raw(&args).unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        if missing(module, sysfs) {
            assert!(!out.status.success(), "{args:?} without {module}");
            assert!(
                stderr.contains(&format!("kernel module {module} cannot be loaded")),
                "the error must name {module}: {stderr}"
            );
        } else {
            assert!(out.status.success(), "{args:?}: {stderr}");
        }
    };
    up_names(
        "floor-bridge",
        &["--without-agent", "--topology", "bridge"],
        "br_netfilter",
        "/proc/sys/net/bridge",
    );
    up_names(
        "floor-ipset",
        &["--dataplane", "iptables"],
        "ip_set",
        "/sys/module/ip_set",
    );
}
