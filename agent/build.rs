//! Builds the kernel programs (ebpf/weir-ebpf, its own workspace, Debian's rustc for
//! bpfel-unknown-none) and hands the object to the agent, which embeds it, so the one
//! `weir` binary is all a node needs. Cargo reruns this only when ebpf/ changes.
use std::{env, path::PathBuf, process::Command};

fn main() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let ebpf_dir = manifest_dir.join("../ebpf");
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let dest = out_dir.join("weir-ebpf.o");

    println!("cargo:rerun-if-env-changed=WEIR_EBPF_OBJECT");
    for p in [
        "weir-ebpf/src",
        "weir-ebpf/Cargo.toml",
        "weir-ebpf/Cargo.lock",
        "weir-common/src",
        "weir-common/Cargo.toml",
    ] {
        println!("cargo:rerun-if-changed={}", ebpf_dir.join(p).display());
    }

    // A prebuilt object (for example from `cargo xtask build`) short-circuits the nested build.
    if let Ok(prebuilt) = env::var("WEIR_EBPF_OBJECT") {
        std::fs::copy(&prebuilt, &dest)
            .unwrap_or_else(|e| panic!("copy WEIR_EBPF_OBJECT={prebuilt}: {e}"));
        return;
    }

    let program_dir = ebpf_dir.join("weir-ebpf");
    let target_dir = program_dir.join("target");
    let mut cmd = Command::new("/usr/bin/cargo");
    cmd.current_dir(&program_dir)
        .args(["build", "--release", "--target-dir"])
        .arg(&target_dir);
    // The outer cargo's settings (rustc, flags, target) must not leak into the BPF build.
    for (key, _) in env::vars() {
        if key.starts_with("CARGO")
            || key.starts_with("RUSTC")
            || key.starts_with("RUSTFLAGS")
            || key == "RUSTDOC"
        {
            cmd.env_remove(&key);
        }
    }
    let home = env::var("HOME").unwrap_or_else(|_| "/root".into());
    let path = format!("{home}/.cargo/bin:{}", env::var("PATH").unwrap_or_default());
    cmd.env("PATH", path);

    let status = cmd.status().unwrap_or_else(|e| {
        panic!(
            "cannot run /usr/bin/cargo for the eBPF programs ({e}); run `cargo xtask setup` first"
        )
    });
    if !status.success() {
        panic!(
            "building the eBPF programs in {} failed ({status}); `cargo xtask setup` installs rustc-web, \
             libstd-rust-web-dev-bpf and bpf-linker",
            program_dir.display()
        );
    }
    let built = target_dir.join("bpfel-unknown-none/release/weir-ebpf");
    std::fs::copy(&built, &dest).unwrap_or_else(|e| panic!("copy {}: {e}", built.display()));
}
