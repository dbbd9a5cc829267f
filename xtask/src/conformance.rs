//! `cargo xtask conformance`: every upstream netpol scenario on every dataplane, lab mode
//! and topology. `cargo xtask test` runs the same suite with the bridge topology on a
//! representative subset only; this also runs the rest there (about a minute more).
use anyhow::{bail, Result};

use crate::cmd::{cargo, exec};

pub fn run() -> Result<()> {
    if !crate::cmd::is_root() {
        bail!("the conformance suite builds network namespaces and loads BPF programs: run it as root");
    }
    crate::build::run(false)?;
    exec(cargo().env("WEIR_CONFORMANCE_FULL", "1").args([
        "test",
        "--package",
        "weir-tests",
        "--test",
        "netpol_conformance",
    ]))
}
