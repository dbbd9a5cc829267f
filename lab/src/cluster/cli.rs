//! `weir-lab cluster ...`: JSON on stdout, as the lab's other commands.
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Subcommand;

use super::{Cni, UpOptions, DEFAULT_NAME};

#[derive(Subcommand)]
pub enum ClusterAction {
    /// Start the control plane and N nodes; print the cluster as JSON once every node is
    /// Ready. On failure, everything built so far is torn down.
    Up {
        #[arg(long, default_value_t = 2)]
        nodes: usize,
        #[arg(long, value_enum, default_value_t = Cni::Ptp)]
        cni: Cni,
        /// Prefix of the cluster's namespaces, node names and interfaces (1 to 8 lowercase
        /// letters or digits).
        #[arg(long, default_value = DEFAULT_NAME)]
        name: String,
        /// An image archive (docker-archive or oci-archive) to import into every node
        /// besides pause and agnhost, e.g. target/image/weir-VERSION.oci.tar (repeatable).
        #[arg(long = "image", value_name = "ARCHIVE")]
        images: Vec<PathBuf>,
        /// Seconds the nodes get to become Ready.
        #[arg(long, default_value_t = 180)]
        timeout_secs: u64,
    },
    /// The cluster as JSON: control plane pids, each node's processes and readiness.
    Status,
    /// Run the cluster's kubectl as its admin (inside the control plane's namespace, where
    /// the API server is reachable), e.g. `weir-lab cluster kubectl -- get pods -A`.
    Kubectl {
        /// Seconds before kubectl is killed.
        #[arg(long, default_value_t = 300)]
        timeout_secs: u64,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Import image archives into every node's containerd.
    Import {
        #[arg(required = true)]
        archives: Vec<PathBuf>,
    },
    /// The nodes' runc (containerd runs it): drops from a container's spec the
    /// capabilities this host's bounding set lacks, then runs /usr/sbin/runc.
    #[command(hide = true)]
    Runc {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Stop everything and remove the namespaces, cgroups, mounts and files; prints what
    /// was removed and what is left (nothing, normally) as JSON. Safe to run twice.
    Down,
}

pub fn run(dir: &Path, action: ClusterAction) -> anyhow::Result<()> {
    let text = match action {
        ClusterAction::Up {
            nodes,
            cni,
            name,
            images,
            timeout_secs,
        } => {
            let opts = UpOptions {
                dir: dir.to_path_buf(),
                name,
                nodes,
                cni,
                images,
                timeout: Duration::from_secs(timeout_secs),
            };
            serde_json::to_string_pretty(&super::up(&opts).context("weir-lab cluster up")?)?
        }
        ClusterAction::Status => {
            let state = super::ClusterState::load(dir)?;
            serde_json::to_string_pretty(&super::status(&state)?)?
        }
        ClusterAction::Kubectl { timeout_secs, args } => {
            let out = super::kubectl(dir, &args, Duration::from_secs(timeout_secs))
                .context("weir-lab cluster kubectl")?;
            return Ok(weir::stdout::print(&out)?);
        }
        ClusterAction::Import { archives } => {
            super::import(dir, &archives).context("weir-lab cluster import")?;
            serde_json::to_string_pretty(&serde_json::json!({ "imported": archives }))?
        }
        ClusterAction::Runc { args } => return super::runc::run(args),
        ClusterAction::Down => {
            let report = super::down(dir).context("weir-lab cluster down")?;
            let left = !report.left.is_empty();
            let text = serde_json::to_string_pretty(&report)?;
            weir::stdout::print(&(text + "\n"))?;
            if left {
                anyhow::bail!("weir-lab cluster down: some of the cluster is left (see \"left\")");
            }
            return Ok(());
        }
    };
    Ok(weir::stdout::print(&(text + "\n"))?)
}
