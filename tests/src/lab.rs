//! Drives `weir-lab` through its command line, each lab in its own state directory
//! (and so its own namespaces and pins), torn down by a Drop guard even on failure.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Output;

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// `normal`, or in an emulated guest (`cargo xtask kernels` sets the lab's slow timeout,
/// WEIR_LAB_TIMEOUT_SECS) up to `slow`: there an agent starts and answers several times
/// slower.
pub fn guest_timeout(
    normal: std::time::Duration,
    slow: std::time::Duration,
) -> std::time::Duration {
    let emulated = std::env::var("WEIR_LAB_TIMEOUT_SECS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map(std::time::Duration::from_secs);
    emulated.map_or(normal, |e| e.clamp(normal, slow.max(normal)))
}

/// One lab in a private state directory; `down` runs when it is dropped.
pub struct Lab {
    pub dir: PathBuf,
}

impl Lab {
    /// The lab's state.json.
    pub fn state(&self) -> Value {
        let text = std::fs::read_to_string(self.dir.join("state.json")).expect("lab state.json");
        serde_json::from_str(&text).expect("lab state.json is JSON")
    }

    /// The node's network namespace.
    pub fn node_netns(&self) -> String {
        self.state()["node_netns"]
            .as_str()
            .expect("node_netns in state.json")
            .to_string()
    }

    /// The network namespace and IPv4 address of pod `NAMESPACE/NAME`.
    pub fn pod(&self, key: &str) -> (String, std::net::Ipv4Addr) {
        let state = self.state();
        let pod = state["pods"]
            .as_object()
            .and_then(|pods| {
                pods.values().find(|p| {
                    format!(
                        "{}/{}",
                        p["namespace"].as_str().unwrap_or(""),
                        p["name"].as_str().unwrap_or("")
                    ) == key
                })
            })
            .unwrap_or_else(|| panic!("pod {key} not in the lab"));
        let netns = pod["netns"].as_str().expect("netns").to_string();
        let ip = pod["ipv4"]
            .as_str()
            .expect("ipv4")
            .parse()
            .expect("an IPv4 address");
        (netns, ip)
    }

    /// Every pod's `NAMESPACE/NAME` → (IPv4, IPv6), from `weir-lab pods --output json`.
    pub fn pod_addresses(&self) -> std::collections::BTreeMap<String, (IpAddr, IpAddr)> {
        let pods: Value = serde_json::from_str(
            &self
                .weir(&["pods", "--output", "json"])
                .expect("weir-lab pods"),
        )
        .expect("weir-lab pods prints JSON");
        pods.as_array()
            .expect("pods as a list")
            .iter()
            .map(|p| {
                let ip = |field: &str| {
                    p[field]
                        .as_str()
                        .and_then(|ip| ip.parse().ok())
                        .unwrap_or_else(|| panic!("pod {}: no {field} in {p}", p["pod"]))
                };
                let key = p["pod"].as_str().expect("pod").to_string();
                (key, (ip("ip"), ip("ipv6")))
            })
            .collect()
    }

    /// A fresh, empty state directory named after the test and the process.
    pub fn new(tag: &str) -> Lab {
        crate::require_root_and_tools();
        let dir = std::env::temp_dir().join(format!("weir-lab-{tag}-{}", std::process::id()));
        let lab = Lab { dir };
        // A leftover from an earlier crashed run with the same pid would make `up` fail.
        lab.weir(&["down"]).expect("cleaning the state directory");
        lab
    }

    /// Runs `weir-lab --weir-bin WEIR --state-dir DIR ARGS...` (WEIR: the `weir` under
    /// test); a non-zero exit is an error with stderr.
    pub fn weir(&self, args: &[&str]) -> Result<String> {
        let out = self.weir_raw(args)?;
        if !out.status.success() {
            bail!(
                "weir-lab {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    pub fn weir_raw(&self, args: &[&str]) -> Result<Output> {
        self.weir_env(args, &[])
    }

    /// `weir-lab ARGS...` with extra environment variables (which an agent it starts
    /// inherits).
    pub fn weir_env(&self, args: &[&str], env: &[(&str, &str)]) -> Result<Output> {
        crate::weir_bin::lab_command()?
            .envs(env.iter().copied())
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
            if p["via"] != "pod" {
                bail!("probe() reads probes via pod only; use probe_routes for {p}");
            }
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

/// One `weir-lab probe --via both` (or service): the matrices by route, and the targets
/// whose service probes were skipped (`NS/NAME PORT/PROTOCOL`).
pub struct Routes {
    pub dataplane: String,
    pub pod: Matrix,
    pub service: Matrix,
    pub skipped: Vec<String>,
}

impl Lab {
    /// Probes with `--via VIA` and splits the result by route.
    pub fn probe_routes(&self, via: &str) -> Result<Routes> {
        let out = self.weir(&["probe", "--output", "json", "--via", via])?;
        let json: Value = serde_json::from_str(&out)?;
        let (mut pod, mut service) = (Matrix::new(), Matrix::new());
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
            let connected = p["connected"].as_bool().context("connected")?;
            match p["via"].as_str() {
                Some("pod") => pod.insert(key, connected),
                Some("service") => service.insert(key, connected),
                other => bail!("probe with via {other:?}: {p}"),
            };
        }
        let skipped = json["skipped"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| {
                format!(
                    "{} {}/{}",
                    s["to"].as_str().unwrap_or("?"),
                    s["port"],
                    s["protocol"].as_str().unwrap_or("?")
                )
            })
            .collect();
        Ok(Routes {
            dataplane: json["dataplane"].as_str().context("dataplane")?.to_string(),
            pod,
            service,
            skipped,
        })
    }
}

/// Set to a directory, every lab's logs (kube-proxy, kube-apiserver, etcd, the agent) are
/// copied there, under the lab's own name, before it is torn down: a guest's state
/// directories vanish with it, and a failure under emulation is rarely repeated on demand.
pub const KEEP_LOGS_ENV: &str = "WEIR_TEST_KEEP_LOGS";

impl Lab {
    fn keep_logs(&self) {
        let Some(keep) = std::env::var_os(KEEP_LOGS_ENV) else {
            return;
        };
        let Some(name) = self.dir.file_name() else {
            return;
        };
        let to = Path::new(&keep).join(name);
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "log") {
                let copied = std::fs::create_dir_all(&to)
                    .and_then(|()| std::fs::copy(&path, to.join(entry.file_name())));
                if let Err(e) = copied {
                    eprintln!("keeping {}: {e}", path.display());
                }
            }
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.keep_logs();
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

/// network-policy-api's ClusterNetworkPolicy CRD of `channel` (standard or experimental)
/// of the release pinned in deploy/cluster-versions (the conformance suite's, v0.3.0 on):
/// it stores v1beta1 and still serves v1alpha2. `cargo xtask setup` copies it beside the
/// Kubernetes components.
pub fn pinned_cluster_policy_crd(channel: &str) -> PathBuf {
    let pins = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/cluster-versions");
    let text = std::fs::read_to_string(&pins).expect("deploy/cluster-versions");
    let version = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("network-policy-api "))
        .map(str::trim)
        .expect("deploy/cluster-versions pins network-policy-api");
    let path = weir_lab::control_plane::components_root()
        .join(format!("network-policy-api-{version}"))
        .join(format!(
            "policy.networking.k8s.io_clusternetworkpolicies.{channel}.yaml"
        ));
    assert!(
        path.is_file(),
        "prerequisite missing: {} (network-policy-api's CRD; run `cargo xtask setup`)",
        path.display()
    );
    path
}

/// The example world of the upstream netpol suite: x/y/z × a/b/c, ports 80/81 × TCP/UDP/SCTP.
pub fn netpol_world() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/netpol-world.yaml")
}

/// network-policy-api's experimental-channel ClusterNetworkPolicy CRD, at the release whose
/// standard channel deploy/crds/ ships and the lab installs: it adds the `nodes` peer,
/// which the standard schema refuses (`weir-lab up --cluster-policy-crd`: the API server
/// prunes fields of a replaced schema from watches already open). `cargo xtask setup`
/// copies it beside the Kubernetes components; a test that cannot find it fails naming
/// the command.
pub fn experimental_cluster_policy_crd() -> PathBuf {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/crds/policy.networking.k8s.io_clusternetworkpolicies.yaml");
    let text = std::fs::read_to_string(&shipped).expect("deploy/crds/ ships the CRD");
    let version = text
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("policy.networking.k8s.io/bundle-version:")
        })
        .map(str::trim)
        .expect("the shipped CRD names its bundle-version");
    let path = weir_lab::control_plane::components_root()
        .join(format!("network-policy-api-{version}"))
        .join("policy.networking.k8s.io_clusternetworkpolicies.experimental.yaml");
    assert!(
        path.is_file(),
        "prerequisite missing: {} (network-policy-api's experimental CRD; run `cargo xtask setup`)",
        path.display()
    );
    path
}
