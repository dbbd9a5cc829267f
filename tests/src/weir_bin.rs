//! The `weir` binary under test: `$WEIR_BIN`, else <workspace>/target/debug/weir (`cargo
//! build -p weir`). `cargo xtask kernels` sets `WEIR_BIN` to its own copy, which a build
//! during a long guest run cannot replace. The lab's binary, `weir-lab`, is
//! `$WEIR_LAB_BIN`, else the one beside that `weir` (`cargo build -p weir-lab`; `cargo xtask
//! kernels` copies it beside its `weir`), and is always told which `weir` to run.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Result};

pub fn path() -> Result<PathBuf> {
    if let Some(bin) = std::env::var_os("WEIR_BIN") {
        return Ok(PathBuf::from(bin));
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let bin = target.join("debug/weir");
    if !bin.exists() {
        bail!(
            "prerequisite missing: {} (build it first: cargo build -p weir -p weir-lab)",
            bin.display()
        );
    }
    Ok(bin)
}

/// The `weir-lab` binary under test.
pub fn lab_path() -> Result<PathBuf> {
    if let Some(bin) = std::env::var_os("WEIR_LAB_BIN") {
        return Ok(PathBuf::from(bin));
    }
    let bin = path()?.with_file_name("weir-lab");
    if !bin.exists() {
        bail!(
            "prerequisite missing: {} (build it first: cargo build -p weir -p weir-lab)",
            bin.display()
        );
    }
    Ok(bin)
}

/// `weir-lab --weir-bin WEIR`, the lab running the `weir` under test; the caller adds the
/// rest (`--state-dir`, the subcommand).
pub fn lab_command() -> Result<Command> {
    let mut command = Command::new(lab_path()?);
    command.arg("--weir-bin").arg(path()?);
    Ok(command)
}
