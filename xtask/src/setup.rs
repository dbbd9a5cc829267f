//! `cargo xtask setup`: installs everything weir needs on a Debian-like host, idempotently.
//! Follows the recipe measured in shared/docs/ebpf-toolchain.md:
//! - Debian's rustc-web/cargo-web (with a prebuilt core for bpfel-unknown-none in
//!   libstd-rust-web-dev-bpf) build the kernel programs;
//! - bpf-linker, built against the same LLVM major as that rustc (llvm-<N>-dev);
//! - the tools the dataplanes and tests drive: ipset, iptables, iproute2, ping, conntrack, iperf3;
//! - qemu and virtme-ng (PyPI), which `cargo xtask kernels` boots Debian's kernels with;
//! - kube-apiserver, kube-proxy and etcd, built with Go from the module proxy (`components`).
use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::cmd::{exec, is_root, output};

/// Debian packages needed besides the LLVM dev package (whose name depends on rustc-web).
const PACKAGES: &[&str] = &[
    "ipset",
    "iptables",
    "iproute2",
    "iputils-ping",
    "conntrack",
    // `nft`, which kube-proxy's nftables mode runs (`weir-lab up --proxy nftables`).
    "nftables",
    // Keys for the loopback kube-apiserver (service account signing).
    "openssl",
    "iperf3",
    // `cargo xtask kernels` boots Debian's 5.10 and 6.1 under virtme-ng (shared/docs/kernels.md).
    "qemu-system-x86",
    "kmod",
    "busybox-static",
    // `cargo xtask image`: the OCI layout, its archives, and the runtime that runs it.
    "umoci",
    "skopeo",
    "runc",
    // `protoc`, which etcd-client's build runs (the relay's etcd API).
    "protobuf-compiler",
    "rustc-web",
    "cargo-web",
    "libstd-rust-web-dev-bpf",
];
/// Provides `kubectl` when the host has none (the deploy/ manifests test renders them).
const KUBECTL_PACKAGE: &str = "kubernetes-client";
const BPF_LINKER_VERSION: &str = "0.13.0";
const CARGO_FUZZ_VERSION: &str = "0.13.1";
/// virtme-ng, from PyPI: boots an installed kernel with the host's userspace.
const VIRTME_NG_VERSION: &str = "1.42";
/// The oldest rustc-web whose LLVM and prebuilt BPF core are known to work.
const MIN_RUSTC_WEB: (u32, u32) = (1, 96);

pub fn run() -> Result<()> {
    let missing = missing()?;
    if missing.is_empty() {
        let dir = crate::components::ensure()?;
        println!(
            "setup: everything is installed (Kubernetes components in {})",
            dir.display()
        );
        return Ok(());
    }
    println!("setup: installing {}", missing.join(", "));
    install(&missing)?;
    let still = missing_after_install()?;
    if !still.is_empty() {
        bail!(
            "setup finished but these are still missing: {}",
            still.join(", ")
        );
    }
    crate::components::ensure()?;
    println!("setup: done");
    Ok(())
}

/// Runs setup when anything is missing; silent otherwise.
pub fn ensure() -> Result<()> {
    if missing()?.is_empty() {
        crate::components::ensure()?;
        return Ok(());
    }
    run()
}

fn missing() -> Result<Vec<String>> {
    let mut missing: Vec<String> = PACKAGES
        .iter()
        .filter(|p| deb_version(p).is_none())
        .map(|p| p.to_string())
        .collect();
    if let Some(major) = rustc_web_llvm_major() {
        let llvm = format!("llvm-{major}-dev");
        if deb_version(&llvm).is_none() {
            missing.push(llvm);
        }
    }
    // Any kubectl renders deploy/ (`kubectl kustomize`); Debian's package is the fallback.
    if output(Command::new("kubectl").args(["version", "--client"])).is_none() {
        missing.push(KUBECTL_PACKAGE.to_string());
    }
    if tool_version("bpf-linker").as_deref() != Some(BPF_LINKER_VERSION) {
        missing.push(format!("bpf-linker {BPF_LINKER_VERSION}"));
    }
    if tool_version("cargo-fuzz").as_deref() != Some(CARGO_FUZZ_VERSION) {
        missing.push(format!("cargo-fuzz {CARGO_FUZZ_VERSION}"));
    }
    if tool_version("vng").as_deref() != Some(VIRTME_NG_VERSION) {
        missing.push(format!("virtme-ng {VIRTME_NG_VERSION}"));
    }
    Ok(missing)
}

fn missing_after_install() -> Result<Vec<String>> {
    check_rustc_web()?;
    missing()
}

fn install(missing: &[String]) -> Result<()> {
    let needs_apt = missing.iter().any(|m| {
        !["bpf-linker", "cargo-fuzz", "virtme-ng"]
            .iter()
            .any(|t| m.starts_with(t))
    }) || rustc_web_llvm_major().is_none();
    if needs_apt {
        if !is_root() {
            bail!(
                "setup must install Debian packages ({}) and needs root; run it as root",
                missing.join(", ")
            );
        }
        if output(Command::new("apt-get").arg("--version")).is_none() {
            bail!(
                "setup needs apt-get (a Debian-like host); install these by hand: {}",
                missing.join(", ")
            );
        }
        exec(Command::new("apt-get").args(["update", "-q"]))?;
        apt_install(PACKAGES.iter().copied())?;
        if missing.iter().any(|m| m == KUBECTL_PACKAGE) {
            apt_install([KUBECTL_PACKAGE])?;
        }
        check_rustc_web()?;
        let major = rustc_web_llvm_major()
            .context("rustc-web is installed but /usr/bin/rustc -vV names no LLVM version")?;
        apt_install([format!("llvm-{major}-dev").as_str()])?;
    }
    check_rustc_web()?;
    if tool_version("bpf-linker").as_deref() != Some(BPF_LINKER_VERSION) {
        let major =
            rustc_web_llvm_major().context("cannot tell the LLVM major of /usr/bin/rustc")?;
        // Without LLVM_PREFIX its build finds /usr/bin/llvm-config (an older LLVM) and fails.
        exec(
            Command::new(cargo_bin())
                .args([
                    "install",
                    "bpf-linker",
                    "--locked",
                    "--version",
                    BPF_LINKER_VERSION,
                    "--no-default-features",
                ])
                .args(["--features", &format!("llvm-{major}")])
                .env("LLVM_PREFIX", format!("/usr/lib/llvm-{major}")),
        )?;
    }
    if tool_version("cargo-fuzz").as_deref() != Some(CARGO_FUZZ_VERSION) {
        exec(Command::new(cargo_bin()).args([
            "install",
            "cargo-fuzz",
            "--locked",
            "--version",
            CARGO_FUZZ_VERSION,
        ]))?;
    }
    if tool_version("vng").as_deref() != Some(VIRTME_NG_VERSION) {
        exec(Command::new("python3").args([
            "-m",
            "pip",
            "install",
            "--quiet",
            &format!("virtme-ng=={VIRTME_NG_VERSION}"),
        ]))
        .context("pip install virtme-ng (needs Python 3 with pip)")?;
    }
    Ok(())
}

fn apt_install<'a>(pkgs: impl IntoIterator<Item = &'a str>) -> Result<()> {
    exec(
        Command::new("apt-get")
            .args(["install", "-y", "-q"])
            .args(pkgs)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

/// rustc-web and its prebuilt BPF core must be the same build, and new enough.
fn check_rustc_web() -> Result<()> {
    let rustc = deb_version("rustc-web").context("rustc-web is not installed")?;
    let core = deb_version("libstd-rust-web-dev-bpf")
        .context("libstd-rust-web-dev-bpf is not installed")?;
    if rustc != core {
        bail!("version mismatch: rustc-web {rustc} but libstd-rust-web-dev-bpf {core}; they must be equal (apt-get install both from the same suite)");
    }
    let mut parts = rustc
        .split(['.', '+', '~', '-'])
        .filter_map(|p| p.parse::<u32>().ok());
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    if (major, minor) < MIN_RUSTC_WEB {
        bail!(
            "rustc-web {rustc} is too old; {}.{} or later is needed (Debian bookworm-security has it: check that debian-security is in the apt sources)",
            MIN_RUSTC_WEB.0,
            MIN_RUSTC_WEB.1
        );
    }
    Ok(())
}

fn deb_version(pkg: &str) -> Option<String> {
    let out = output(Command::new("dpkg-query").args(["-W", "-f=${Status}|${Version}", pkg]))?;
    let (status, version) = out.split_once('|')?;
    status.ends_with(" installed").then(|| version.to_string())
}

fn rustc_web_llvm_major() -> Option<String> {
    let out = output(Command::new("/usr/bin/rustc").arg("-vV"))?;
    let version = out.lines().find_map(|l| l.strip_prefix("LLVM version: "))?;
    Some(version.split('.').next()?.to_string())
}

fn cargo_bin() -> PathBuf {
    PathBuf::from(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

/// `X.Y.Z` printed by `<tool> --version` from ~/.cargo/bin or PATH.
fn tool_version(tool: &str) -> Option<String> {
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let path = PathBuf::from(home).join(".cargo/bin").join(tool);
    let out = output(Command::new(&path).arg("--version"))
        .or_else(|| output(Command::new(tool).arg("--version")))?;
    out.split_whitespace().nth(1).map(|v| v.trim().to_string())
}
