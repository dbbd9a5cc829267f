//! Where `cargo xtask cluster --build-only` and `cargo xtask setup` put what the cluster
//! runs (the same paths xtask computes), checked before anything is built.
use std::path::PathBuf;

use super::super::control_plane::{components_dir, components_root, kubernetes_version};
use super::super::LabError;

const VERSIONS: &str = include_str!("../../../deploy/cluster-versions");

fn pinned(name: &str) -> String {
    VERSIONS
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (n, v) = l.split_once(char::is_whitespace)?;
            (n == name).then(|| v.trim().to_string())
        })
        .unwrap_or_default()
}

#[derive(Clone, Debug)]
pub struct Components {
    /// kube-apiserver, kube-proxy, etcd.
    pub kubernetes: PathBuf,
    /// kubelet, kube-controller-manager, kube-scheduler, kubectl, agnhost.
    pub node: PathBuf,
    /// containerd, containerd-shim-runc-v2, ctr.
    pub containerd: PathBuf,
    /// pause.tar, agnhost.tar (docker-archives).
    pub images: PathBuf,
    /// The sandbox image containerd pins: `registry.k8s.io/pause:VERSION`.
    pub pause_image: String,
}

impl Components {
    pub fn find() -> Result<Components, LabError> {
        let k8s = kubernetes_version();
        let agnhost = pinned("agnhost");
        let agnhost = agnhost.split(',').next().unwrap_or_default();
        let root = components_root();
        let c = Components {
            kubernetes: components_dir(),
            node: root.join(format!("kubernetes-node-{k8s}")),
            containerd: root.join(format!("containerd-{}", pinned("containerd"))),
            images: root.join(format!(
                "cluster-images-{k8s}-pause-{}-agnhost-{agnhost}",
                pinned("pause")
            )),
            pause_image: format!("registry.k8s.io/pause:{}", pinned("pause")),
        };
        let needed = [
            (&c.kubernetes, "etcd", "cargo xtask setup"),
            (&c.kubernetes, "kube-apiserver", "cargo xtask setup"),
            (&c.kubernetes, "kube-proxy", "cargo xtask setup"),
            (&c.node, "kubelet", "cargo xtask cluster --build-only"),
            (
                &c.node,
                "kube-controller-manager",
                "cargo xtask cluster --build-only",
            ),
            (
                &c.node,
                "kube-scheduler",
                "cargo xtask cluster --build-only",
            ),
            (&c.node, "kubectl", "cargo xtask cluster --build-only"),
            (
                &c.containerd,
                "containerd",
                "cargo xtask cluster --build-only",
            ),
            (
                &c.containerd,
                "containerd-shim-runc-v2",
                "cargo xtask cluster --build-only",
            ),
            (&c.containerd, "ctr", "cargo xtask cluster --build-only"),
            (&c.images, "pause.tar", "cargo xtask cluster --build-only"),
            (&c.images, "agnhost.tar", "cargo xtask cluster --build-only"),
        ];
        for (dir, file, builder) in needed {
            if !dir.join(file).is_file() {
                return Err(LabError::invalid(
                    "weir-lab cluster",
                    format!(
                        "{} not found: `{builder}` builds it (or set WEIR_COMPONENTS_DIR)",
                        dir.join(file).display()
                    ),
                ));
            }
        }
        for (program, package) in [
            ("/usr/sbin/runc", "runc"),
            ("/usr/lib/cni/ptp", "containernetworking-plugins"),
            ("/usr/lib/cni/host-local", "containernetworking-plugins"),
            ("/usr/bin/nsenter", "util-linux"),
            ("/usr/bin/unshare", "util-linux"),
        ] {
            if !std::path::Path::new(program).is_file() {
                return Err(LabError::invalid(
                    "weir-lab cluster",
                    format!("{program} not found: install the Debian package {package} (`cargo xtask cluster --build-only` does)"),
                ));
            }
        }
        Ok(c)
    }
}
