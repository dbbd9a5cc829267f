//! `cargo xtask peers`: the other NetworkPolicy agents weir is measured against, built
//! from the Go module proxy at the versions `deploy/peer-versions` pins and cached beside
//! the Kubernetes components (`$WEIR_COMPONENTS_DIR/<name>-<version>/<name>`, the path
//! `weir-lab up --enforcer` runs them from); then the upstream netpol scenarios on each of
//! them and on weir, printed as one scenario × enforcer table.
use std::fs;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::cmd::{cargo, exec, workspace_root};

/// Marks a finished build, so an interrupted one is redone.
const STAMP: &str = ".complete";

/// One line of `deploy/peer-versions`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub name: String,
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
                [name, package, version] => Ok(Peer {
                    name: name.into(),
                    package: package.into(),
                    version: version.into(),
                }),
                _ => bail!("line {}: {l:?} is not NAME GO-PACKAGE VERSION", n + 1),
            },
        )
        .collect()
}

/// The pinned peers' binaries (only those `names`, if given), building those not cached.
pub fn ensure(names: Option<&[&str]>) -> Result<Vec<Peer>> {
    let mut peers = pinned()?;
    if let Some(names) = names {
        peers.retain(|p| names.contains(&p.name.as_str()));
    }
    for peer in &peers {
        if peer.dir().join(STAMP).exists() && peer.binary().is_file() {
            continue;
        }
        build(peer)?;
    }
    Ok(peers)
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
pub fn run(build_only: bool) -> Result<()> {
    ensure(None)?;
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
        assert!(pinned().is_ok_and(|p| !p.is_empty()));
    }
}
