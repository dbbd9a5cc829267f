//! Drives `weir lab` through its command line, each lab in its own state directory
//! (and so its own namespaces and pins), torn down by a Drop guard even on failure.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// One lab in a private state directory; `down` runs when it is dropped.
pub struct Lab {
    pub dir: PathBuf,
}

impl Lab {
    /// A fresh, empty state directory named after the test and the process.
    pub fn new(tag: &str) -> Lab {
        crate::require_root_and_tools();
        let dir = std::env::temp_dir().join(format!("weir-lab-{tag}-{}", std::process::id()));
        let lab = Lab { dir };
        // A leftover from an earlier crashed run with the same pid would make `up` fail.
        lab.weir(&["down"]).expect("cleaning the state directory");
        lab
    }

    /// Runs `weir lab --state-dir DIR ARGS...`; a non-zero exit is an error with stderr.
    pub fn weir(&self, args: &[&str]) -> Result<String> {
        let out = self.weir_raw(args)?;
        if !out.status.success() {
            bail!(
                "weir lab {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    pub fn weir_raw(&self, args: &[&str]) -> Result<Output> {
        self.weir_env(args, &[])
    }

    /// `weir lab ARGS...` with extra environment variables (which an agent it starts
    /// inherits).
    pub fn weir_env(&self, args: &[&str], env: &[(&str, &str)]) -> Result<Output> {
        Command::new(crate::weir_bin::path()?)
            .envs(env.iter().copied())
            .arg("lab")
            .arg("--state-dir")
            .arg(&self.dir)
            .args(args)
            .output()
            .context("running weir")
    }

    /// Probes and returns (from, to, port, protocol) → connected, and the dataplane named.
    pub fn probe(&self, extra: &[&str]) -> Result<(String, Matrix)> {
        let mut args = vec!["probe", "--output", "json"];
        args.extend_from_slice(extra);
        let json: Value = serde_json::from_str(&self.weir(&args)?)?;
        let mut matrix = Matrix::new();
        for p in json["probes"]
            .as_array()
            .context("probes is not an array")?
        {
            let key = (
                p["from"].as_str().context("from")?.to_string(),
                p["to"].as_str().context("to")?.to_string(),
                p["port"].as_u64().context("port")? as u16,
                p["protocol"].as_str().context("protocol")?.to_string(),
            );
            matrix.insert(key, p["connected"].as_bool().context("connected")?);
        }
        let dataplane = json["dataplane"].as_str().context("dataplane")?.to_string();
        Ok((dataplane, matrix))
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if let Err(e) = self.weir(&["down"]) {
            eprintln!("tearing down the lab in {}: {e}", self.dir.display());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// (from, to, port, protocol) → connected.
pub use netpol_scenarios::Matrix;

/// Writes a manifest into the lab's directory and returns its path.
pub fn manifest(lab: &Lab, name: &str, yaml: &str) -> PathBuf {
    std::fs::create_dir_all(&lab.dir).unwrap();
    let path = lab.dir.join(name);
    std::fs::write(&path, yaml).unwrap();
    path
}

/// The example world of the upstream netpol suite: x/y/z × a/b/c, ports 80/81 × TCP/UDP/SCTP.
pub fn netpol_world() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/netpol-world.yaml")
}
