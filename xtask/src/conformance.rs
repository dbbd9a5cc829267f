//! `cargo xtask conformance`: every upstream netpol scenario in every cell of the matrix
//! dataplane × topology × kube-proxy mode (× lab mode), through Services where kube-proxy
//! runs, printed as a table. `cargo xtask test` runs a subset of cells that touches every
//! dataplane, topology and proxy mode the host kernel can run.
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
        "every_cell_gives_the_same_matrices",
        "--",
        "--nocapture",
    ]))
}
