//! `cargo xtask conformance`: every upstream netpol scenario in every cell of the matrix
//! dataplane × topology × kube-proxy mode (× lab mode), through Services where kube-proxy
//! runs, printed as a table. `cargo xtask test` runs a subset of cells that touches every
//! dataplane, topology and proxy mode the host kernel can run.
use anyhow::{bail, Result};

use crate::cmd::{cargo, exec};

/// `scenarios`: name prefixes (`cnp` for the ClusterNetworkPolicy ones); every scenario
/// when empty. `cells`: `WEIR_CONFORMANCE_CELLS`' syntax; the whole matrix when `None`.
pub fn run(scenarios: &[String], cells: Option<&str>) -> Result<()> {
    if !crate::cmd::is_root() {
        bail!("the conformance suite builds network namespaces and loads BPF programs: run it as root");
    }
    crate::build::run(false)?;
    let mut command = cargo();
    command.env("WEIR_CONFORMANCE_FULL", "1");
    if !scenarios.is_empty() {
        command.env("WEIR_CONFORMANCE_SCENARIOS", scenarios.join(","));
    }
    if let Some(cells) = cells {
        command.env("WEIR_CONFORMANCE_CELLS", cells);
    }
    exec(command.args([
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
