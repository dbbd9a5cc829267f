//! The OCI image from a root filesystem, with no container engine: umoci writes the OCI
//! layout (one layer), skopeo the oci-archive and docker-archive tarballs.
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::cmd::exec;

pub struct Built {
    /// The manifest's digest (`sha256:…`): what deploy/ pins.
    pub digest: String,
    /// The compressed layer's size, as a registry would store it.
    pub compressed_bytes: u64,
    pub oci_archive: PathBuf,
    pub docker_archive: PathBuf,
}

/// `reference` is `name:tag`; the layout is `out/oci`, the archives `out/<name>-<tag>.*.tar`.
pub fn build(root: &Path, out: &Path, reference: &str, epoch: u64) -> Result<Built> {
    let (name, tag) = reference
        .rsplit_once(':')
        .with_context(|| format!("image reference {reference:?} is not name:tag"))?;
    let layout = out.join("oci");
    let _ = fs::remove_dir_all(&layout);
    let image = format!("{}:{tag}", layout.display());
    let created = rfc3339(epoch)?;
    exec(
        Command::new("umoci")
            .args(["init", "--layout"])
            .arg(&layout),
    )?;
    exec(Command::new("umoci").args(["new", "--image", &image]))?;
    // One layer holding the whole root, its history entry dated like its files.
    exec(
        Command::new("umoci")
            .args(["insert", "--image", &image])
            .args(["--history.created", &created])
            .args(["--history.created_by", "cargo xtask image"])
            .arg(root)
            .arg("/"),
    )?;
    exec(Command::new("umoci").args([
        "config",
        "--no-history",
        "--image",
        &image,
        "--created",
        &created,
        "--architecture",
        "amd64",
        "--os",
        "linux",
        "--config.entrypoint",
        &format!("/{}", super::rootfs::WEIR_PATH),
        "--config.cmd",
        "agent",
        "--config.env",
        &format!("PATH={}", super::PATH),
        "--config.label",
        &format!("org.opencontainers.image.version={tag}"),
        "--config.label",
        "org.opencontainers.image.title=weir",
    ]))?;
    exec(Command::new("umoci").args(["gc", "--layout"]).arg(&layout))?;
    let oci_archive = out.join(format!("{name}-{tag}.oci.tar"));
    let docker_archive = out.join(format!("{name}-{tag}.docker.tar"));
    for (transport, file) in [
        ("oci-archive", &oci_archive),
        ("docker-archive", &docker_archive),
    ] {
        let _ = fs::remove_file(file);
        exec(Command::new("skopeo").args([
            "copy",
            "--quiet",
            &format!("oci:{image}"),
            &format!("{transport}:{}:{reference}", file.display()),
        ]))?;
    }
    let (digest, compressed_bytes) = manifest(&layout, tag)?;
    Ok(Built {
        digest,
        compressed_bytes,
        oci_archive,
        docker_archive,
    })
}

/// The tagged manifest's digest and the total size of its layers.
fn manifest(layout: &Path, tag: &str) -> Result<(String, u64)> {
    let read = |path: PathBuf| -> Result<Value> {
        let text =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    };
    let index = read(layout.join("index.json"))?;
    let digest = index["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == tag)
        .and_then(|m| m["digest"].as_str())
        .with_context(|| format!("no manifest tagged {tag} in {}", layout.display()))?
        .to_string();
    let Some(hex) = digest.strip_prefix("sha256:") else {
        bail!("manifest digest {digest} is not sha256");
    };
    let manifest = read(layout.join("blobs/sha256").join(hex))?;
    let size = manifest["layers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| l["size"].as_u64())
        .sum();
    Ok((digest, size))
}

fn rfc3339(epoch: u64) -> Result<String> {
    let out = Command::new("date")
        .args(["-u", "-d", &format!("@{epoch}"), "+%Y-%m-%dT%H:%M:%SZ"])
        .output()
        .context("running date")?;
    if !out.status.success() {
        bail!("date -d @{epoch} failed");
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}
