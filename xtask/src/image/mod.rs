//! `cargo xtask image`: the release binary, then the container image from
//! deploy/Dockerfile, with whichever container engine answers (docker or podman).
use std::process::Command;

use anyhow::{bail, Result};

use crate::cmd::{exec, output, workspace_root};

pub fn run(tag: &str) -> Result<()> {
    let Some(engine) = ["docker", "podman"]
        .into_iter()
        .find(|e| output(Command::new(e).arg("info")).is_some())
    else {
        bail!(
            "no container engine answers (`docker info` and `podman info` failed); \
             the image needs one: build it elsewhere from deploy/Dockerfile"
        );
    };
    crate::build::run(true)?;
    exec(Command::new(engine).current_dir(workspace_root()).args([
        "build",
        "-f",
        "deploy/Dockerfile",
        "-t",
        tag,
        ".",
    ]))
}
