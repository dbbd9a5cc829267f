//! The `weir` binary under test: `$WEIR_BIN`, else <workspace>/target/debug/weir (`cargo
//! build -p weir`). `cargo xtask kernels` sets `WEIR_BIN` to its own copy, which a build
//! during a long guest run cannot replace.

use std::path::PathBuf;

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
            "prerequisite missing: {} (build it first: cargo build -p weir)",
            bin.display()
        );
    }
    Ok(bin)
}
