//! Shared helpers for the integration tests (network namespaces, prerequisites).
//!
//! **Dependencies:** the `weir`, `weir-lab` and `weir-policy` crates as any user would see
//! them, and the netpol scenarios. Tests drive the real `weir` and `weir-lab` binaries and
//! the real kernel; nothing in the agent or the lab depends on this crate.
pub mod desired;
/// A lab whose pods the hostile tests send hand-made frames between.
pub mod frame_lab;
/// GET from an agent's HTTP server inside a namespace.
pub mod http;
pub mod kernel_state;
pub mod lab;
pub mod netns;
pub mod node_dataplane;
/// Pods wired to a "node" namespace like a CNI would, for the eBPF dataplane tests.
pub mod pods;
/// Socket probes run inside a namespace (a thread that setns()es).
pub mod probe;
/// Hand-made frames (AF_PACKET), a sniffer, TCP from a chosen port: the hostile pod.
pub mod raw;
pub mod weir_bin;

/// Fails (never skips) when a prerequisite is missing, naming it.
pub fn require_root_and_tools() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "prerequisite missing: these tests need root (network namespaces, BPF)"
    );
    let ok = std::process::Command::new("ip")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(ok, "prerequisite missing: `ip` (iproute2)");
}

/// A pin root of its own on bpffs, removed (with everything pinned under it) on drop.
pub struct PinRoot(pub std::path::PathBuf);

impl PinRoot {
    pub fn new(tag: &str) -> PinRoot {
        PinRoot(format!("/sys/fs/bpf/weir-test-{tag}-{}", std::process::id()).into())
    }
}

impl Drop for PinRoot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A test of TCX links on a kernel without TCX (before Linux 6.6) checks the refusal
/// instead: forcing TCX must fail before anything is pinned, naming the missing feature.
/// `true` when the kernel has TCX and the test goes on with it.
pub fn tcx_or_its_refusal(tag: &str) -> bool {
    use weir::dataplane::ebpf::{tcx_missing, AttachMode, EbpfConfig, EbpfDataplane};
    let Some(why) = tcx_missing() else {
        return true;
    };
    let root = PinRoot::new(&format!("{tag}-notcx"));
    let config = EbpfConfig {
        attach_mode: Some(AttachMode::Tcx),
        ..EbpfConfig::with_pin_root(root.0.clone())
    };
    let err = match EbpfDataplane::new(config) {
        Ok(_) => panic!("this kernel lacks {why}, yet forcing TCX was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("attach mode tcx") && err.contains("TCX links"),
        "forcing TCX without TCX must name it: {err}"
    );
    assert!(
        !root.0.exists(),
        "a refused start pinned {}",
        root.0.display()
    );
    eprintln!("this kernel has no TCX: forcing it is refused ({err})");
    false
}

/// Whether this kernel has what kube-proxy's ipvs mode needs (IPVS and dummy devices),
/// probed independently of weir, once per test process (the conformance cells ask from
/// several threads at once). Distribution kernels build both as modules: they are loaded
/// first, as a node that runs kube-proxy in ipvs mode has them.
pub fn kernel_has_ipvs() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        for module in ["ip_vs", "dummy"] {
            let _ = std::process::Command::new("modprobe").arg(module).output();
        }
        let ns = format!("weir-test-dummy-{}", std::process::id());
        let ip = |args: &[&str]| {
            std::process::Command::new("ip")
                .args(args)
                .output()
                .is_ok_and(|o| o.status.success())
        };
        ip(&["netns", "add", &ns]);
        let dummy = ip(&["-n", &ns, "link", "add", "d0", "type", "dummy"]);
        ip(&["netns", "delete", &ns]);
        std::path::Path::new("/proc/net/ip_vs").exists() && dummy
    })
}

/// Whether nftables accepts a `queue` rule here (CONFIG_NFT_QUEUE), which
/// kube-network-policies needs: probed in a scratch namespace.
pub fn kernel_has_nft_queue() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| weir_lab::peers::nft_queue_support().is_ok())
}

/// weir's image as an OCI layout for `weir-lab up --agent-image`: `WEIR_AGENT_IMAGE`, else
/// target/image-dev/oci (`cargo xtask image --dev`, which `cargo xtask test` builds), else
/// target/image/oci (`cargo xtask image`). A test that needs it and finds none fails
/// naming the command.
pub fn agent_image() -> String {
    if let Ok(image) = std::env::var("WEIR_AGENT_IMAGE") {
        return image;
    }
    let target = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target");
    ["image-dev/oci", "image/oci"]
        .iter()
        .map(|d| target.join(d))
        .find(|d| d.join("index.json").exists())
        .map(|d| d.to_string_lossy().into_owned())
        .unwrap_or_else(|| {
            panic!(
                "no image of weir: build it with `cargo xtask image --dev` (or set WEIR_AGENT_IMAGE to an OCI layout)"
            )
        })
}
