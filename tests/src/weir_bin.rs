//! The `weir` binary under test: <workspace>/target/debug/weir (`cargo build -p weir`).

use std::path::PathBuf;

use anyhow::{bail, Result};

pub fn path() -> Result<PathBuf> {
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
