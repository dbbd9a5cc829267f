//! The real Kubernetes components the tests and the lab run: kube-apiserver and kube-proxy
//! of the release pinned in `deploy/kubernetes-version`, and the etcd that release pins,
//! built from the Go module proxy (never downloaded from anywhere else) and cached under
//! `$WEIR_COMPONENTS_DIR` (default `~/.cache/weir/components`), one directory per version.
//! Only a fresh machine pays for the build (shared/docs/real-cluster.md, route A).
//!
//! `go install k8s.io/kubernetes/cmd/...@v` does not work: k8s.io/kubernetes replaces its
//! staging modules (k8s.io/api, client-go, ...) with local paths. So a small build module
//! requires k8s.io/kubernetes and replaces each staging module, read from the downloaded
//! go.mod, with its published v0.Y.Z.
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::cmd::{exec, output, workspace_root};

/// What the components directory holds once built.
pub const BINARIES: &[&str] = &["kube-apiserver", "kube-proxy", "etcd"];
/// Marks a finished build, so an interrupted one is redone.
const STAMP: &str = ".complete";

/// `v1.34.4`: the pinned release.
pub fn kubernetes_version() -> Result<String> {
    let path = workspace_root().join("deploy/kubernetes-version");
    let text = fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    Ok(text.trim().to_string())
}

/// `$WEIR_COMPONENTS_DIR`, default `~/.cache/weir/components`: one directory per
/// component and version (the peers' too); the agent's lab computes the same paths.
pub fn root() -> PathBuf {
    std::env::var_os("WEIR_COMPONENTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
                .join(".cache/weir/components")
        })
}

/// Where the binaries of `version` live.
pub fn bin_dir(version: &str) -> PathBuf {
    root().join(format!("kubernetes-{version}"))
}

/// The binaries' directory, building them first when they are not cached. Also puts
/// network-policy-api's module in the Go module cache ([`ensure_network_policy_api`]).
pub fn ensure() -> Result<PathBuf> {
    ensure_network_policy_api()?;
    let version = kubernetes_version()?;
    let dir = bin_dir(&version);
    if dir.join(STAMP).exists() && BINARIES.iter().all(|b| dir.join(b).is_file()) {
        return Ok(dir);
    }
    build(&version, &dir)?;
    Ok(dir)
}

/// network-policy-api's ClusterNetworkPolicy CRDs, copied out of the Go module cache: the
/// experimental channel at the release whose standard channel deploy/crds/ ships, into
/// [`experimental_crd_path`] (the tests install it where they need `nodes` peers, which
/// the standard schema refuses), and both channels of the release whose conformance suite
/// `cargo xtask conformance --suite npapi` runs (deploy/cluster-versions), beside it (a
/// test installs its standard one to watch v1beta1, which that release added).
pub fn ensure_network_policy_api() -> Result<()> {
    let shipped = network_policy_api_version()?;
    copy_crd(&shipped, "experimental", &experimental_crd_path(&shipped))?;
    let suite = suite_network_policy_api_version()?;
    for channel in ["standard", "experimental"] {
        copy_crd(&suite, channel, &crd_path(&suite, channel))?;
    }
    Ok(())
}

/// The `network-policy-api VERSION` line of deploy/cluster-versions (read here too, so
/// that setup needs nothing of the cluster's module).
fn suite_network_policy_api_version() -> Result<String> {
    let path = workspace_root().join("deploy/cluster-versions");
    let text = fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    text.lines()
        .find_map(|l| l.trim().strip_prefix("network-policy-api "))
        .map(|v| v.trim().to_string())
        .with_context(|| format!("{}: no `network-policy-api VERSION` line", path.display()))
}

fn copy_crd(version: &str, channel: &str, dest: &Path) -> Result<()> {
    if dest.is_file() {
        return Ok(());
    }
    let module = format!("sigs.k8s.io/network-policy-api@{version}");
    let out = output(
        Command::new(go()?)
            .args(["mod", "download", "-json", &module])
            .env("GOFLAGS", "-mod=mod")
            .current_dir(std::env::temp_dir()),
    )
    .with_context(|| format!("download {module} from the Go module proxy"))?;
    let dir: serde_json::Value =
        serde_json::from_str(&out).with_context(|| format!("go mod download -json {module}"))?;
    let dir = dir["Dir"]
        .as_str()
        .with_context(|| format!("go mod download -json {module}: no Dir"))?;
    let crd = Path::new(dir).join(format!(
        "config/crd/{channel}/policy.networking.k8s.io_clusternetworkpolicies.yaml"
    ));
    fs::create_dir_all(dest.parent().expect("a file under the components root"))?;
    fs::copy(&crd, dest)
        .with_context(|| format!("copy {} to {}", crd.display(), dest.display()))?;
    Ok(())
}

/// Where [`ensure_network_policy_api`] keeps the CRD of `version`'s `channel`.
pub fn crd_path(version: &str, channel: &str) -> PathBuf {
    root()
        .join(format!("network-policy-api-{version}"))
        .join(format!(
            "policy.networking.k8s.io_clusternetworkpolicies.{channel}.yaml"
        ))
}

/// The `policy.networking.k8s.io/bundle-version` of deploy/crds/'s CRD.
fn network_policy_api_version() -> Result<String> {
    let crd =
        workspace_root().join("deploy/crds/policy.networking.k8s.io_clusternetworkpolicies.yaml");
    let text = fs::read_to_string(&crd).with_context(|| format!("read {}", crd.display()))?;
    text.lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("policy.networking.k8s.io/bundle-version:")
        })
        .map(|v| v.trim().to_string())
        .with_context(|| format!("{}: no bundle-version annotation", crd.display()))
}

/// Where [`ensure_network_policy_api`] keeps the experimental CRD of `version`.
pub fn experimental_crd_path(version: &str) -> PathBuf {
    crd_path(version, "experimental")
}

pub fn go() -> Result<PathBuf> {
    for candidate in ["go", "/usr/local/go/bin/go", "/usr/lib/go/bin/go"] {
        if output(Command::new(candidate).arg("version")).is_some() {
            return Ok(PathBuf::from(candidate));
        }
    }
    bail!(
        "building kube-apiserver, kube-proxy and etcd needs Go (1.24 or later) and the Go module \
         proxy: no `go` on PATH, in /usr/local/go/bin or /usr/lib/go/bin. Install Go, or put \
         prebuilt {} of Kubernetes {} in {} and create the file {STAMP} there",
        BINARIES.join(", "),
        kubernetes_version().unwrap_or_default(),
        bin_dir(&kubernetes_version().unwrap_or_default()).display()
    )
}

fn build(version: &str, dir: &Path) -> Result<()> {
    let go = go()?;
    let started = Instant::now();
    println!(
        "setup: building kube-apiserver, kube-proxy and etcd of Kubernetes {version} from the Go module proxy into {} (a fresh machine pays this once)",
        dir.display()
    );
    let module = dir.join("build");
    fs::create_dir_all(module.join("cmd/etcd"))
        .with_context(|| format!("create {}", module.display()))?;
    let go_cmd = |args: &[&str]| {
        let mut c = Command::new(&go);
        c.current_dir(&module)
            .args(args)
            .env("GOFLAGS", "-mod=mod")
            .env("GOTOOLCHAIN", "local")
            .env("CGO_ENABLED", "0");
        c
    };
    // The staging modules to replace, from k8s.io/kubernetes's own go.mod.
    let json = Command::new(&go)
        .args([
            "mod",
            "download",
            "-json",
            &format!("k8s.io/kubernetes@{version}"),
        ])
        .env("GOFLAGS", "-mod=mod")
        .env("GOTOOLCHAIN", "local")
        .current_dir(std::env::temp_dir())
        .output()
        .context("go mod download k8s.io/kubernetes")?;
    let info: serde_json::Value = serde_json::from_slice(&json.stdout).with_context(|| {
        format!(
            "go mod download k8s.io/kubernetes@{version} printed no JSON: {}",
            String::from_utf8_lossy(&json.stderr)
        )
    })?;
    if let Some(err) = info["Error"].as_str() {
        bail!("go mod download k8s.io/kubernetes@{version}: {err}");
    }
    let gomod_path = info["GoMod"]
        .as_str()
        .context("go mod download named no GoMod file")?;
    let upstream = fs::read_to_string(gomod_path).with_context(|| format!("read {gomod_path}"))?;
    fs::write(module.join("go.mod"), build_module(version, &upstream)?)?;
    fs::write(
        module.join("tools.go"),
        "//go:build tools\n\npackage build\n\nimport (\n\t_ \"k8s.io/kubernetes/cmd/kube-apiserver\"\n\t_ \"k8s.io/kubernetes/cmd/kube-proxy\"\n)\n",
    )?;
    fs::write(
        module.join("cmd/etcd/main.go"),
        "// etcd at the version Kubernetes pins (its root module has replace directives, so\n// it is built from go.etcd.io/etcd/server/v3 here).\npackage main\n\nimport (\n\t\"os\"\n\n\t\"go.etcd.io/etcd/server/v3/etcdmain\"\n)\n\nfunc main() { etcdmain.Main(os.Args) }\n",
    )?;
    exec(&mut go_cmd(&["mod", "tidy"]))?;
    let out = format!("{}/", dir.display());
    exec(&mut go_cmd(&[
        "build",
        "-trimpath",
        "-ldflags=-s -w",
        "-o",
        &out,
        "k8s.io/kubernetes/cmd/kube-apiserver",
        "k8s.io/kubernetes/cmd/kube-proxy",
        "./cmd/etcd",
    ]))?;
    for b in BINARIES {
        if !dir.join(b).is_file() {
            bail!("go build finished but {} is missing", dir.join(b).display());
        }
    }
    fs::write(dir.join(STAMP), version)?;
    println!(
        "setup: Kubernetes {version} components built in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The build module's go.mod: k8s.io/kubernetes at `version`, and every staging module
/// its go.mod replaces with a local path replaced by the published `v0.Y.Z` instead.
pub fn build_module(version: &str, upstream: &str) -> Result<String> {
    let staging_version = version
        .strip_prefix("v1.")
        .map(|rest| format!("v0.{rest}"))
        .with_context(|| format!("Kubernetes version {version} is not v1.Y.Z"))?;
    let staging: Vec<&str> = upstream
        .lines()
        .filter_map(|l| {
            let (name, target) = l.trim().trim_start_matches("replace ").split_once("=>")?;
            target.trim().starts_with("./staging/").then(|| name.trim())
        })
        .collect();
    if staging.is_empty() {
        bail!("k8s.io/kubernetes {version}'s go.mod replaces no staging module; the build recipe no longer applies");
    }
    let mut m = format!(
        "module weir.local/components\n\ngo 1.24.0\n\nrequire k8s.io/kubernetes {version}\n\n"
    );
    for name in staging {
        m.push_str(&format!("replace {name} => {name} {staging_version}\n"));
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_modules_are_replaced_by_their_published_versions() {
        let upstream = "module k8s.io/kubernetes\n\nreplace (\n\tk8s.io/api => ./staging/src/k8s.io/api\n\tgithub.com/x/y => github.com/x/y v1.0.0\n)\nreplace k8s.io/kubelet => ./staging/src/k8s.io/kubelet\n";
        let m = build_module("v1.34.4", upstream).unwrap();
        assert!(m.contains("replace k8s.io/api => k8s.io/api v0.34.4\n"));
        assert!(m.contains("replace k8s.io/kubelet => k8s.io/kubelet v0.34.4\n"));
        assert!(!m.contains("github.com/x/y"));
        assert!(build_module("1.34", upstream).is_err());
        assert!(build_module("v1.34.4", "module x\n").is_err());
    }
}
