//! `weir-lab`: the lab's command line (see [`weir_lab::cli`]).
use clap::Parser;

fn main() -> anyhow::Result<()> {
    weir_lab::cli::run(weir_lab::cli::LabArgs::parse())
}
