//! `cargo xtask cluster --build-only`: what `weir-lab cluster` runs besides the lab's control
//! plane, built from pinned versions and cached beside the other components
//! (`$WEIR_COMPONENTS_DIR`, see `components`), so only a fresh machine pays for it:
//! - kubelet, kube-controller-manager, kube-scheduler, kubectl and agnhost of the release in
//!   `deploy/kubernetes-version`, from the same kind of build module as kube-apiserver, linked
//!   with the release's version strings (without them kubectl cannot parse the server's);
//! - containerd, its runc v2 shim and ctr from the Go module proxy (`deploy/cluster-versions`);
//! - the pause and agnhost images, built without an engine (umoci, skopeo) as
//!   docker-archives that `ctr images import` takes;
//! - runc and the CNI plugins from Debian.
//!
//! The directory names here are the ones `weir-lab cluster` reads (lab/src/cluster/).
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::cmd::{exec, is_root, output, workspace_root};
use crate::components;

const STAMP: &str = ".complete";
/// Built from the Kubernetes release.
pub const NODE_BINARIES: &[&str] = &[
    "kubelet",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "agnhost",
];
const NODE_PACKAGES: &[&str] = &[
    "k8s.io/kubernetes/cmd/kubelet",
    "k8s.io/kubernetes/cmd/kube-controller-manager",
    "k8s.io/kubernetes/cmd/kube-scheduler",
    "k8s.io/kubernetes/cmd/kubectl",
    "k8s.io/kubernetes/test/images/agnhost",
];
const CONTAINERD_BINARIES: &[&str] = &["containerd", "containerd-shim-runc-v2", "ctr"];
/// Debian packages the nodes run or the image build needs: runc and the CNI plugins run
/// on the nodes; bash-static is agnhost's /bin/bash (network-policy-api's suite execs it);
/// gcc and libc6-dev link the static pause binary.
const PACKAGES: &[&str] = &[
    "runc",
    "containernetworking-plugins",
    "bash-static",
    "busybox-static",
    "gcc",
    "libc6-dev",
    "umoci",
    "skopeo",
    "conntrack",
];

/// `deploy/cluster-versions`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versions {
    pub containerd: String,
    pub pause: String,
    pub agnhost: Vec<String>,
    /// The network-policy-api release whose conformance suite `cargo xtask conformance
    /// --suite npapi` runs.
    pub network_policy_api: String,
    /// The cyclonus release `cargo xtask conformance --suite cyclonus` runs.
    pub cyclonus: String,
}

pub fn versions() -> Result<Versions> {
    let path = workspace_root().join("deploy/cluster-versions");
    let text = fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    parse_versions(&text).with_context(|| path.display().to_string())
}

fn parse_versions(text: &str) -> Result<Versions> {
    let get = |name: &str| -> Result<String> {
        text.lines()
            .map(str::trim)
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let (n, v) = l.split_once(char::is_whitespace)?;
                (n == name).then(|| v.trim().to_string())
            })
            .with_context(|| format!("no `{name} VERSION` line"))
    };
    let agnhost: Vec<String> = get("agnhost")?.split(',').map(str::to_string).collect();
    Ok(Versions {
        containerd: get("containerd")?,
        pause: get("pause")?,
        agnhost,
        network_policy_api: get("network-policy-api")?,
        cyclonus: get("cyclonus")?,
    })
}

pub fn node_dir(k8s: &str) -> PathBuf {
    components::root().join(format!("kubernetes-node-{k8s}"))
}
pub fn containerd_dir(v: &Versions) -> PathBuf {
    components::root().join(format!("containerd-{}", v.containerd))
}
pub fn images_dir(k8s: &str, v: &Versions) -> PathBuf {
    components::root().join(format!(
        "cluster-images-{k8s}-pause-{}-agnhost-{}",
        v.pause, v.agnhost[0]
    ))
}

/// The names agnhost is tagged under: the lab's, and the e2e images' that Kubernetes' e2e
/// framework and network-policy-api's manifests ask for.
const AGNHOST_REPOS: &[&str] = &[
    "registry.k8s.io/agnhost",
    "registry.k8s.io/e2e-test-images/agnhost",
];

fn images_stamp(k8s: &str, v: &Versions) -> String {
    format!(
        "{k8s} pause {} agnhost {} as {}, cmd pause",
        v.pause,
        v.agnhost.join(","),
        AGNHOST_REPOS.join(",")
    )
}

fn done(dir: &Path, files: &[&str]) -> bool {
    dir.join(STAMP).exists() && files.iter().all(|f| dir.join(f).is_file())
}

/// `cargo xtask cluster [--build-only]`: everything, each piece timed; then, unless
/// `build_only`, weir's dev image and the real-cluster test (weir's DaemonSet on a 2-node
/// kubelet cluster, both dataplanes), which `cargo xtask test` does not run.
pub fn run(build_only: bool) -> Result<()> {
    ensure()?;
    if build_only {
        return Ok(());
    }
    if !is_root() {
        bail!("the real-cluster test builds namespaces, mounts and cgroups: run it as root");
    }
    crate::image::for_tests()?;
    exec(crate::cmd::cargo().args(["build", "--package", "weir-lab"]))?;
    exec(crate::cmd::cargo().args([
        "test",
        "--package",
        "weir-tests",
        "--features",
        "real-cluster",
        "--test",
        "real_cluster",
        "--",
        "--nocapture",
    ]))
}

/// Builds whatever is not cached; returns the three directories.
pub fn ensure() -> Result<(PathBuf, PathBuf, PathBuf)> {
    packages()?;
    let k8s = components::kubernetes_version()?;
    let v = versions()?;
    let node = node_dir(&k8s);
    if !done(&node, NODE_BINARIES) {
        timed(
            &format!("kubelet, kube-controller-manager, kube-scheduler, kubectl and agnhost {k8s}"),
            || build_node(&k8s, &node),
        )?;
    }
    let containerd = containerd_dir(&v);
    if !done(&containerd, CONTAINERD_BINARIES) {
        timed(&format!("containerd {}", v.containerd), || {
            build_containerd(&v.containerd, &containerd)
        })?;
    }
    let images = images_dir(&k8s, &v);
    // The stamp names every repository, so images built with fewer names are built again.
    let stamp = fs::read_to_string(images.join(STAMP)).unwrap_or_default();
    if !done(&images, &["pause.tar", "agnhost.tar"]) || stamp != images_stamp(&k8s, &v) {
        timed("the pause and agnhost images", || {
            build_images(&k8s, &v, &node, &images)
        })?;
    }
    // kube-apiserver, etcd and kube-proxy run the control plane and each node.
    components::ensure()?;
    println!(
        "cluster: components in {}, {} and {}",
        node.display(),
        containerd.display(),
        images.display()
    );
    Ok((node, containerd, images))
}

fn timed(what: &str, f: impl FnOnce() -> Result<()>) -> Result<()> {
    println!("cluster: building {what} (a fresh machine pays this once)");
    let started = Instant::now();
    f()?;
    println!(
        "cluster: built {what} in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn deb_installed(pkg: &str) -> bool {
    output(Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]))
        .is_some_and(|s| s.ends_with(" installed"))
}

fn packages() -> Result<()> {
    let missing: Vec<&str> = PACKAGES
        .iter()
        .copied()
        .filter(|p| !deb_installed(p))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        bail!(
            "the cluster needs these Debian packages, and installing them needs root: {}",
            missing.join(", ")
        );
    }
    println!("cluster: installing {}", missing.join(", "));
    exec(Command::new("apt-get").args(["update", "-q"]))?;
    exec(
        Command::new("apt-get")
            .args(["install", "-y", "-q"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

pub fn go_cmd(go: &Path, dir: &Path) -> Command {
    let mut c = Command::new(go);
    c.current_dir(dir)
        .env("GOFLAGS", "-mod=mod")
        .env("GOTOOLCHAIN", "local")
        .env("CGO_ENABLED", "0");
    c
}

/// `go mod download -json MODULE@VERSION`'s answer.
pub fn download(go: &Path, module: &str) -> Result<serde_json::Value> {
    let out = Command::new(go)
        .args(["mod", "download", "-json", module])
        .env("GOFLAGS", "-mod=mod")
        .env("GOTOOLCHAIN", "local")
        .current_dir(std::env::temp_dir())
        .output()
        .with_context(|| format!("go mod download {module}"))?;
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "go mod download {module} printed no JSON: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    if let Some(err) = info["Error"].as_str() {
        bail!("go mod download {module}: {err}");
    }
    Ok(info)
}

/// `-X` flags that make the binaries report the release instead of
/// `v0.0.0-master+$Format:%H$`.
fn version_ldflags(k8s: &str) -> Result<String> {
    let mut parts = k8s.trim_start_matches('v').split('.');
    let (major, minor) = (
        parts.next().context("no major version")?,
        parts.next().context("no minor version")?,
    );
    let mut flags = String::from("-s -w");
    for pkg in [
        "k8s.io/component-base/version",
        "k8s.io/client-go/pkg/version",
    ] {
        flags.push_str(&format!(
            " -X {pkg}.gitVersion={k8s} -X {pkg}.gitMajor={major} -X {pkg}.gitMinor={minor} -X {pkg}.gitTreeState=clean"
        ));
    }
    Ok(flags)
}

fn build_node(k8s: &str, dir: &Path) -> Result<()> {
    let go = components::go()?;
    let module = dir.join("build");
    fs::create_dir_all(&module).with_context(|| format!("create {}", module.display()))?;
    let info = download(&go, &format!("k8s.io/kubernetes@{k8s}"))?;
    let gomod = info["GoMod"].as_str().context("no GoMod file named")?;
    let upstream = fs::read_to_string(gomod).with_context(|| format!("read {gomod}"))?;
    fs::write(
        module.join("go.mod"),
        components::build_module(k8s, &upstream)?,
    )?;
    let imports: String = NODE_PACKAGES
        .iter()
        .map(|p| format!("\t_ \"{p}\"\n"))
        .collect();
    fs::write(
        module.join("tools.go"),
        format!("//go:build tools\n\npackage build\n\nimport (\n{imports})\n"),
    )?;
    exec(go_cmd(&go, &module).args(["mod", "tidy"]))?;
    exec(
        go_cmd(&go, &module)
            .args(["build", "-trimpath"])
            .arg(format!("-ldflags={}", version_ldflags(k8s)?))
            .arg("-o")
            .arg(format!("{}/", dir.display()))
            .args(NODE_PACKAGES),
    )?;
    finish(dir, NODE_BINARIES, k8s)
}

fn build_containerd(version: &str, dir: &Path) -> Result<()> {
    let go = components::go()?;
    fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    // containerd's root module has no replace directives, so `go install` builds it.
    let pkg = "github.com/containerd/containerd/v2";
    exec(
        go_cmd(&go, &std::env::temp_dir())
            .env("GOBIN", dir)
            .args(["install", "-trimpath"])
            .arg(format!(
                "-ldflags=-s -w -X {pkg}/version.Version={version} -X {pkg}/version.Revision=module-proxy"
            ))
            .args(
                CONTAINERD_BINARIES
                    .iter()
                    .map(|b| format!("{pkg}/cmd/{b}@{version}")),
            ),
    )?;
    finish(dir, CONTAINERD_BINARIES, version)
}

fn finish(dir: &Path, files: &[&str], version: &str) -> Result<()> {
    for f in files {
        if !dir.join(f).is_file() {
            bail!(
                "the build finished but {} is missing",
                dir.join(f).display()
            );
        }
    }
    fs::write(dir.join(STAMP), version)?;
    Ok(())
}

fn build_images(k8s: &str, v: &Versions, node: &Path, dir: &Path) -> Result<()> {
    let go = components::go()?;
    let info = download(&go, &format!("k8s.io/kubernetes@{k8s}"))?;
    let source = PathBuf::from(info["Dir"].as_str().context("no module Dir named")?);
    let work = dir.join("work");
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).with_context(|| format!("create {}", work.display()))?;

    // pause: the release's pause.c, static, run as 65535 like the upstream image.
    let pause_root = work.join("pause-root");
    fs::create_dir_all(&pause_root)?;
    exec(
        Command::new("gcc")
            .args(["-Os", "-static", "-Wall", "-Werror"])
            .arg(format!("-DVERSION=v{}-weir", v.pause))
            .arg("-o")
            .arg(pause_root.join("pause"))
            .arg(source.join("build/pause/linux/pause.c")),
    )?;
    image(
        &work,
        &pause_root,
        &["registry.k8s.io/pause"],
        std::slice::from_ref(&v.pause),
        &[
            "--config.entrypoint",
            "/pause",
            "--config.user",
            "65535:65535",
        ],
        &dir.join("pause.tar"),
    )?;

    // agnhost: the binary, a static bash, busybox's tools, and the passwd/group files its
    // commands and the suites' exec'd shells expect.
    let root = work.join("agnhost-root");
    for d in ["bin", "etc", "tmp"] {
        fs::create_dir_all(root.join(d))?;
    }
    fs::copy(node.join("agnhost"), root.join("agnhost"))?;
    fs::copy("/bin/bash-static", root.join("bin/bash"))
        .context("copy /bin/bash-static (Debian's bash-static)")?;
    fs::copy("/bin/busybox", root.join("bin/busybox"))
        .context("copy /bin/busybox (Debian's busybox-static)")?;
    let applets =
        output(Command::new("/bin/busybox").arg("--list")).context("/bin/busybox --list")?;
    for applet in applets.lines().map(str::trim) {
        if applet.is_empty() || applet == "busybox" || applet == "bash" {
            continue;
        }
        let link = root.join("bin").join(applet);
        if !link.exists() {
            std::os::unix::fs::symlink("busybox", &link)
                .with_context(|| format!("symlink {}", link.display()))?;
        }
    }
    fs::write(
        root.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
    )?;
    fs::write(root.join("etc/group"), "root:x:0:\nnogroup:x:65534:\n")?;
    image(
        &work,
        &root,
        AGNHOST_REPOS,
        &v.agnhost,
        &[
            "--config.entrypoint",
            "/agnhost",
            // As the upstream image: a container given no command or args pauses
            // (network-policy-api's client containers).
            "--config.cmd",
            "pause",
            "--config.env",
            "PATH=/bin:/usr/bin:/sbin:/usr/sbin",
        ],
        &dir.join("agnhost.tar"),
    )?;
    fs::remove_dir_all(&work)?;
    fs::write(dir.join(STAMP), images_stamp(k8s, v))?;
    Ok(())
}

/// One OCI layout from `root`, written as a docker-archive tagged `REPO:TAG` for every
/// repository and tag.
fn image(
    work: &Path,
    root: &Path,
    repos: &[&str],
    tags: &[String],
    config: &[&str],
    archive: &Path,
) -> Result<()> {
    let name = repos[0].rsplit('/').next().unwrap_or(repos[0]);
    let layout = work.join(format!("{name}-oci"));
    let image = format!("{}:{}", layout.display(), tags[0]);
    exec(
        Command::new("umoci")
            .args(["init", "--layout"])
            .arg(&layout),
    )?;
    exec(Command::new("umoci").args(["new", "--image", &image]))?;
    exec(
        Command::new("umoci")
            .args(["insert", "--image", &image])
            .arg(root)
            .arg("/"),
    )?;
    exec(
        Command::new("umoci")
            .args(["config", "--image", &image])
            .args(["--architecture", "amd64", "--os", "linux"])
            .args(config),
    )?;
    let _ = fs::remove_file(archive);
    let mut copy = Command::new("skopeo");
    copy.args(["copy", "--quiet"]);
    let mut references = repos
        .iter()
        .flat_map(|repo| tags.iter().map(move |tag| format!("{repo}:{tag}")));
    let first = references.next().context("an image with no name")?;
    for reference in references {
        copy.arg(format!("--additional-tag={reference}"));
    }
    exec(
        copy.arg(format!("oci:{image}"))
            .arg(format!("docker-archive:{}:{first}", archive.display())),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_from_the_pins() {
        let v = parse_versions(
            "# c\ncontainerd v2.2.10\npause 3.10.1\nagnhost 2.56,2.45\nnetwork-policy-api v0.3.0\ncyclonus v0.5.6\n",
        )
        .unwrap();
        assert_eq!(v.containerd, "v2.2.10");
        assert_eq!(v.pause, "3.10.1");
        assert_eq!(v.agnhost, vec!["2.56", "2.45"]);
        assert_eq!(v.network_policy_api, "v0.3.0");
        assert_eq!(v.cyclonus, "v0.5.6");
        assert!(parse_versions("pause 3.10.1\n").is_err());
    }

    #[test]
    fn the_pinned_file_parses() {
        versions().unwrap();
    }

    #[test]
    fn version_flags_name_the_release() {
        let f = version_ldflags("v1.34.4").unwrap();
        assert!(f.contains("k8s.io/component-base/version.gitVersion=v1.34.4"));
        assert!(f.contains("gitMinor=34"));
    }
}
