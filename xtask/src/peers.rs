//! `cargo xtask peers`: the other NetworkPolicy agents weir is measured against, built
//! from the Go module proxy (or, for Azure NPM, whose module the proxy refuses, from a
//! source archive) at the versions `deploy/peer-versions` pins and cached beside the
//! Kubernetes components (`$WEIR_COMPONENTS_DIR/<name>-<version>/<name>`, the path
//! `weir-lab up --enforcer` runs them from); then the upstream netpol scenarios on each of
//! them and on weir, printed as one scenario × enforcer table.
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::cmd::{cargo, exec, workspace_root};

/// Marks a finished build, so an interrupted one is redone.
const STAMP: &str = ".complete";

/// The `SOURCE` of a peer built from a source archive rather than the module proxy.
const ARCHIVE_PREFIX: &str = "archive:";

/// One line of `deploy/peer-versions`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub name: String,
    /// A Go package, or `archive:STEM:PACKAGE` (see [`Peer::archive`]).
    pub package: String,
    pub version: String,
}

impl Peer {
    pub fn dir(&self) -> PathBuf {
        crate::components::root().join(format!("{}-{}", self.name, self.version))
    }
    pub fn binary(&self) -> PathBuf {
        self.dir().join(&self.name)
    }
    /// `archive:STEM:PACKAGE`: (STEM, PACKAGE); the archive is `STEM-VERSION.tar.gz`, it
    /// unpacks into `STEM-VERSION/`, and PACKAGE is a path inside it.
    pub fn archive(&self) -> Option<(&str, &str)> {
        self.package.strip_prefix(ARCHIVE_PREFIX)?.split_once(':')
    }
    /// Whether `wanted` names this peer: `NAME` (any pinned version) or `NAME@VERSION`.
    fn is(&self, wanted: &str) -> bool {
        match wanted.split_once('@') {
            Some((name, version)) => name == self.name && version == self.version,
            None => wanted == self.name,
        }
    }
}

/// `--peer-archives` (or `WEIR_PEER_ARCHIVES`), when given.
static ARCHIVES: OnceLock<PathBuf> = OnceLock::new();

pub fn set_archives(dir: Option<PathBuf>) {
    if let Some(dir) = dir {
        let _ = ARCHIVES.set(dir);
    }
}

/// Where the peers' source archives are: `--peer-archives`, `WEIR_PEER_ARCHIVES`, or
/// `../shared/peers` beside the repository.
pub fn archives_dir() -> PathBuf {
    ARCHIVES
        .get()
        .cloned()
        .or_else(|| std::env::var_os("WEIR_PEER_ARCHIVES").map(PathBuf::from))
        .unwrap_or_else(|| workspace_root().join("../shared/peers"))
}

pub fn pinned() -> Result<Vec<Peer>> {
    let path = workspace_root().join("deploy/peer-versions");
    let text = fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    parse(&text).with_context(|| format!("{}", path.display()))
}

/// The flags kube-router runs with, from `deploy/kube-router-flags` (which the lab reads
/// too): one per line, `#` comments.
pub fn kube_router_flags() -> Result<Vec<String>> {
    let path = workspace_root().join("deploy/kube-router-flags");
    let text = fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    Ok(text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect())
}

fn parse(text: &str) -> Result<Vec<Peer>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        .map(
            |(n, l)| match l.split_whitespace().collect::<Vec<_>>()[..] {
                [name, package, version] => {
                    let peer = Peer {
                        name: name.into(),
                        package: package.into(),
                        version: version.into(),
                    };
                    if package.starts_with(ARCHIVE_PREFIX) && peer.archive().is_none() {
                        bail!("line {}: {package:?} is not archive:STEM:PACKAGE", n + 1);
                    }
                    Ok(peer)
                }
                _ => bail!("line {}: {l:?} is not NAME SOURCE VERSION", n + 1),
            },
        )
        .collect()
}

/// The pinned peers' binaries (only those `names` name, as NAME or NAME@VERSION, if
/// given), building those not cached.
pub fn ensure(names: Option<&[&str]>) -> Result<Vec<Peer>> {
    let mut peers = pinned()?;
    if let Some(names) = names {
        peers.retain(|p| names.iter().any(|n| p.is(n)));
    }
    for peer in &peers {
        let stamped = fs::read_to_string(peer.dir().join(STAMP)).ok();
        if stamped.as_deref().map(str::trim) == Some(stamp(peer).as_str())
            && peer.binary().is_file()
        {
            continue;
        }
        match peer.archive() {
            Some((stem, package)) => build_from_archive(peer, stem, package)?,
            None => build(peer)?,
        }
    }
    Ok(peers)
}

/// Builds PACKAGE of `STEM-VERSION.tar.gz` (from [`archives_dir`]) unpacked under
/// `~/.cache/weir/peer-src`, with its dependencies from the module proxy, as its release
/// image does (`-X main.version`); and keeps beside the binary the config its Linux
/// DaemonSet mounts (the ConfigMap in the archive's `npm/azure-npm.yaml`), which the lab
/// runs it with. The source never enters the repository.
fn build_from_archive(peer: &Peer, stem: &str, package: &str) -> Result<()> {
    let started = Instant::now();
    let archives = archives_dir();
    let archive = archives.join(format!("{stem}-{}.tar.gz", peer.version));
    if !archive.is_file() {
        bail!(
            "{} {} is built from its source archive, and {} does not exist: put \
             {stem}-{}.tar.gz (`git archive --prefix={stem}-{}/` of that tag) in {}, or \
             name its directory with `cargo xtask --peer-archives DIR` or WEIR_PEER_ARCHIVES",
            peer.name,
            peer.version,
            archive.display(),
            peer.version,
            peer.version,
            archives.display()
        );
    }
    let src_root = crate::components::root()
        .parent()
        .map_or_else(|| PathBuf::from("/tmp"), Path::to_path_buf)
        .join("peer-src");
    let src = src_root.join(format!("{stem}-{}", peer.version));
    println!(
        "peers: building {} {} ({package} of {}) into {}",
        peer.name,
        peer.version,
        archive.display(),
        peer.dir().display()
    );
    // Unpacked afresh: a half-unpacked tree from an interrupted run would build wrong.
    let _ = fs::remove_dir_all(&src);
    fs::create_dir_all(&src_root).with_context(|| format!("create {}", src_root.display()))?;
    exec(
        Command::new("tar")
            .arg("-xzf")
            .arg(&archive)
            .arg("-C")
            .arg(&src_root),
    )
    .with_context(|| format!("unpacking {}", archive.display()))?;
    if !src.is_dir() {
        bail!(
            "{} did not unpack into {}",
            archive.display(),
            src.display()
        );
    }
    let dir = peer.dir();
    fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    exec(
        Command::new(crate::components::go()?)
            .args([
                "build",
                "-trimpath",
                &format!(
                    "-ldflags=-s -w -X main.version={} -X {NPM_AI_KEY_VAR}={NPM_AI_KEY}",
                    peer.version
                ),
                "-o",
            ])
            .arg(peer.binary())
            .arg(package)
            .env("GOFLAGS", "-mod=mod")
            .env("GOTOOLCHAIN", "local")
            .env("CGO_ENABLED", "0")
            .current_dir(&src),
    )
    .with_context(|| format!("building {} {}", peer.name, peer.version))?;
    if peer.name == "azure-npm" {
        let manifest = src.join("npm/azure-npm.yaml");
        let yaml = fs::read_to_string(&manifest)
            .with_context(|| format!("read {}", manifest.display()))?;
        let config = npm_config(&yaml).with_context(|| {
            format!("{}: no azure-npm.json in its ConfigMap", manifest.display())
        })?;
        fs::write(dir.join("azure-npm.json"), config)?;
    }
    fs::remove_dir_all(&src)?;
    fs::write(dir.join(STAMP), stamp(peer))?;
    println!(
        "peers: {} {} built in {:.0}s",
        peer.name,
        peer.version,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Where NPM's release builds put their Application Insights key (its Makefile's
/// NPM_AI_PATH). Without a key NPM waits 3 × 1 min for telemetry before it starts its
/// controllers (v1.8.12: before it even resets its dataplane); with one it goes on at once
/// when the instance metadata service says Azure's public cloud, which the lab's stub does.
/// The key is a placeholder: nothing is sent, the lab's node has no route out.
const NPM_AI_KEY_VAR: &str = "github.com/Azure/azure-container-networking/npm.aiMetadata";
const NPM_AI_KEY: &str = "00000000-0000-0000-0000-000000000000";

/// What a finished build's stamp holds: the version, and for a build from an archive
/// how it was built, so that a build made another way is redone.
fn stamp(peer: &Peer) -> String {
    match peer.archive() {
        Some(_) => format!("{} ai-key={NPM_AI_KEY}", peer.version),
        None => peer.version.clone(),
    }
}

/// The `azure-npm.json: |` block of NPM's ConfigMap, unindented.
fn npm_config(yaml: &str) -> Option<String> {
    let mut lines = yaml.lines().skip_while(|l| l.trim() != "azure-npm.json: |");
    let key_indent = indent(lines.next()?);
    let block: Vec<&str> = lines
        .take_while(|l| l.trim().is_empty() || indent(l) > key_indent)
        .collect();
    let inner = block
        .iter()
        .filter(|l| !l.trim().is_empty())
        .map(|l| indent(l))
        .min()?;
    let text: String = block
        .iter()
        .map(|l| format!("{}\n", l.get(inner..).unwrap_or("").trim_end()))
        .collect();
    Some(text.trim_end().to_string() + "\n")
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

fn build(peer: &Peer) -> Result<()> {
    let started = Instant::now();
    let dir = peer.dir();
    println!(
        "peers: building {} {} ({}) from the Go module proxy into {}",
        peer.name,
        peer.version,
        peer.package,
        dir.display()
    );
    // `go install` names the binary after the package's last element ("cmd" for
    // kube-network-policies): install into a scratch GOBIN, then rename.
    let gobin = dir.join("gobin");
    let _ = fs::remove_dir_all(&gobin);
    fs::create_dir_all(&gobin).with_context(|| format!("create {}", gobin.display()))?;
    exec(
        Command::new(crate::components::go()?)
            .args([
                "install",
                "-trimpath",
                "-ldflags=-s -w",
                &format!("{}@{}", peer.package, peer.version),
            ])
            .env("GOBIN", &gobin)
            .env("GOTOOLCHAIN", "local")
            .env("CGO_ENABLED", "0")
            .current_dir(std::env::temp_dir()),
    )
    .with_context(|| format!("building {} {}", peer.name, peer.version))?;
    let built = peer
        .package
        .rsplit('/')
        .next()
        .map(|b| gobin.join(b))
        .filter(|b| b.is_file())
        .with_context(|| format!("go install left no binary in {}", gobin.display()))?;
    fs::rename(&built, peer.binary())?;
    fs::remove_dir_all(&gobin)?;
    fs::write(dir.join(STAMP), &peer.version)?;
    println!(
        "peers: {} {} built in {:.0}s",
        peer.name,
        peer.version,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `cargo xtask peers`: build them, then (unless `build_only`) run the scenario table on
/// each enforcer the host kernel can run.
pub fn run(build_only: bool, only: &[String]) -> Result<()> {
    let only: Vec<&str> = only.iter().map(String::as_str).collect();
    let built = ensure((!only.is_empty()).then_some(&only[..]))?;
    if let Some(unknown) = only.iter().find(|o| !built.iter().any(|p| p.is(o))) {
        bail!("--only {unknown}: deploy/peer-versions pins no such peer");
    }
    if build_only {
        return Ok(());
    }
    if !crate::cmd::is_root() {
        bail!("the peers' conformance run builds network namespaces and loads BPF programs: run it as root");
    }
    crate::build::run(false)?;
    exec(cargo().env("WEIR_PEERS_FULL", "1").args([
        "test",
        "--package",
        "weir-tests",
        "--test",
        "netpol_conformance",
        "the_peers_side_by_side",
        "--",
        "--nocapture",
    ]))
    .map(drop)
    .context("the peers' conformance run")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_versions_parse() {
        let peers = parse("# comment\n\nkube-router example.org/x/cmd/kube-router v1.0.0\n")
            .expect("parses");
        assert_eq!(
            peers,
            vec![Peer {
                name: "kube-router".into(),
                package: "example.org/x/cmd/kube-router".into(),
                version: "v1.0.0".into(),
            }]
        );
        assert!(parse("kube-router v1.0.0\n").is_err());
        assert!(parse("azure-npm archive:no-package v1\n").is_err());
        let pinned = pinned().expect("deploy/peer-versions parses");
        let npm: Vec<&Peer> = pinned.iter().filter(|p| p.name == "azure-npm").collect();
        assert!(npm.iter().any(|p| p.is("azure-npm@v1.5.36")), "{npm:?}");
        assert!(npm
            .iter()
            .all(|p| p.archive() == Some(("azure-container-networking", "./npm/cmd"))));
    }

    #[test]
    fn npm_config_is_read_from_its_config_map() {
        let yaml = "data:\n  azure-npm.json: |\n    {\n        \"A\": 1,\n\n        \"T\": {}\n    }\n---\nkind: X\n";
        assert_eq!(
            npm_config(yaml).as_deref(),
            Some("{\n    \"A\": 1,\n\n    \"T\": {}\n}\n")
        );
        assert_eq!(npm_config("kind: X\n"), None);
    }
}
