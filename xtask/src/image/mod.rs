//! `cargo xtask image`: the image deploy/daemonset.yaml runs, built with no container
//! engine: the stripped release binary and the tools it runs, taken from Debian packages
//! pinned in deploy/image/packages.lock, made into an OCI layout by umoci and into
//! oci-archive and docker-archive tarballs by skopeo (target/image/). Timestamps come from
//! SOURCE_DATE_EPOCH (default: the last commit's time), so the same inputs give the same
//! digest. `--engine docker|podman` builds deploy/Dockerfile with that engine instead.
mod debs;
mod oci;
mod rootfs;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::cmd::{exec, output, workspace_root};

/// The image's PATH (weir finds ipset, iptables and ip through it).
pub const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The packages of the tools weir runs and of its own libraries; `--relock` adds those the
/// tools' libraries come from.
const ROOTS: &[&str] = &[
    "conntrack",
    "ipset",
    "iptables",
    "iproute2",
    "kmod",
    "netbase",
    "libc6",
    "libgcc-s1",
];
/// Where the bill of materials is in the image.
const SBOM_IN_IMAGE: &str = "usr/share/weir/packages.txt";

pub struct Options {
    /// `name:tag`.
    pub reference: String,
    /// Build from the unoptimised (dev) binary, into target/image-dev/: what
    /// `cargo xtask test` runs its container tests on, without a release build.
    pub dev: bool,
    pub relock: bool,
    pub engine: Option<String>,
}

/// The image from the dev binary (target/image-dev/oci), which the integration tests run
/// the agent from (`weir-lab up --agent-image`).
pub fn for_tests() -> Result<()> {
    run(&Options {
        reference: format!("weir:{}", env!("CARGO_PKG_VERSION")),
        relock: false,
        dev: true,
        engine: None,
    })
}

pub fn run(o: &Options) -> Result<()> {
    if let Some(engine) = &o.engine {
        return with_engine(engine, &o.reference);
    }
    crate::build::agent(!o.dev)?;
    let (profile, out) = match o.dev {
        true => ("debug", workspace_root().join("target/image-dev")),
        false => ("release", workspace_root().join("target/image")),
    };
    fs::create_dir_all(&out)?;
    let weir = strip(
        &workspace_root().join("target").join(profile).join("weir"),
        &out.join("weir"),
    )?;
    let epoch = source_date_epoch();
    let debs_dir = out.join("debs");
    let lock = match o.relock {
        true => relock(&debs_dir, &weir)?,
        false => debs::read_lock(&debs::lock_path())?,
    };
    let dirs = debs::unpack_locked(&lock, &debs_dir)?;
    let mut selection = rootfs::select(&dirs, &weir)?;
    if !selection.missing.is_empty() {
        bail!(
            "libraries in none of the locked packages: {} (`cargo xtask image --relock` adds \
             their packages)",
            selection
                .missing
                .iter()
                .map(|m| format!("{} (needed by /{})", m.soname, m.needed_by))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let used = selection.packages();
    let unused: Vec<&str> = lock
        .iter()
        .map(|l| l.name.as_str())
        .filter(|n| !used.contains_key(*n))
        .collect();
    if !unused.is_empty() {
        bail!(
            "locked packages that give the image nothing: {} (`cargo xtask image --relock` \
             drops them)",
            unused.join(", ")
        );
    }
    let sbom = sbom(&lock, &used, &weir)?;
    let sbom_file = out.join("sbom-file");
    fs::write(&sbom_file, &sbom)?;
    selection.entries.insert(
        SBOM_IN_IMAGE.into(),
        rootfs::Entry::File {
            package: "weir".into(),
            from: sbom_file.clone(),
        },
    );
    let root = out.join("rootfs");
    rootfs::write(&selection, &root, epoch)?;
    rootfs::check(&root)?;
    let built = oci::build(&root, &out, &o.reference, epoch)?;
    fs::write(out.join("packages.txt"), &sbom)?;
    fs::write(out.join("digest"), format!("{}\n", built.digest))?;
    let _ = fs::remove_file(&sbom_file);
    let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    let size = |p: &Path| fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    println!("image: {} {}", o.reference, built.digest);
    let debug = weir.with_extension("debug");
    println!(
        "image: weir's debug info split off into {} ({:.1} MiB), not in the image",
        debug.display(),
        mib(size(&debug))
    );
    println!(
        "image: {:.1} MiB compressed (one layer), {:.1} MiB unpacked, weir ({profile}) {:.1} MiB \
         stripped; {} paths from {} Debian packages ({}/packages.txt)",
        mib(built.compressed_bytes),
        mib(dir_size(&root)),
        mib(size(&weir)),
        selection.entries.len(),
        used.len() - 1,
        out.display(),
    );
    for archive in [&built.oci_archive, &built.docker_archive] {
        println!(
            "image: {} ({:.1} MiB)",
            archive.display(),
            mib(size(archive))
        );
    }
    println!(
        "image: pin it in deploy/ once pushed: (cd deploy && kustomize edit set image \
         weir=REGISTRY/weir@{})",
        built.digest
    );
    println!(
        "image: digest in {}/digest; load with `ctr images import {}` or `docker load -i {}`",
        out.display(),
        built.docker_archive.display(),
        built.docker_archive.display()
    );
    Ok(())
}

/// Pins the candidate versions of [`ROOTS`] and of every package a needed library comes
/// from (as `dpkg -S` names it on this host), and writes the lock.
fn relock(debs_dir: &Path, weir: &Path) -> Result<Vec<debs::Locked>> {
    let mut locked: BTreeMap<String, debs::Locked> = BTreeMap::new();
    let mut wanted: Vec<String> = ROOTS.iter().map(|s| s.to_string()).collect();
    loop {
        for name in wanted.drain(..) {
            let (deb, version) = debs::fetch(&name, None, None)?;
            let sha256 = debs::sha256(&deb)?;
            locked.insert(
                name.clone(),
                debs::Locked {
                    name,
                    version,
                    sha256,
                },
            );
        }
        let all: Vec<debs::Locked> = locked.values().cloned().collect();
        let dirs = debs::unpack_locked(&all, debs_dir)?;
        let selection = rootfs::select(&dirs, weir)?;
        if selection.missing.is_empty() {
            let used = selection.packages();
            let kept: Vec<debs::Locked> = all
                .into_iter()
                .filter(|l| used.contains_key(l.name.as_str()))
                .collect();
            debs::write_lock(&debs::lock_path(), &kept)?;
            println!(
                "image: locked {} packages in deploy/image/packages.lock",
                kept.len()
            );
            return Ok(kept);
        }
        for m in selection.missing {
            let owner = debs::owner_of(&m.soname)?;
            if locked.contains_key(&owner) || wanted.contains(&owner) {
                bail!(
                    "{} (needed by /{}) is in package {owner}, but not where the loader looks",
                    m.soname,
                    m.needed_by
                );
            }
            wanted.push(owner);
        }
    }
}

/// The bill of materials: each package with its version, the .deb's digest and how many
/// of the image's paths it gave; then weir itself.
fn sbom(lock: &[debs::Locked], used: &BTreeMap<String, usize>, weir: &Path) -> Result<String> {
    let mut text = String::from(
        "# weir's image: the Debian packages its files come from \
         (name version sha256-of-.deb paths), then weir\n",
    );
    for l in lock {
        writeln!(
            text,
            "{} {} {} {}",
            l.name, l.version, l.sha256, used[&l.name]
        )
        .unwrap();
    }
    writeln!(
        text,
        "weir {} {} 1",
        env!("CARGO_PKG_VERSION"),
        debs::sha256(weir)?
    )
    .unwrap();
    Ok(text)
}

/// The release binary without debug info or symbols (backtraces lose function names; the
/// binary is 20.8 MiB instead of 26, and the image fits in 15 MB compressed). The debug
/// info is split off first into `weir.debug` beside it, kept as a build artifact (not in
/// the image), and the stripped binary names it (`.gnu_debuglink`), so gdb and
/// addr2line resolve a crash of the shipped binary with it.
fn strip(binary: &Path, to: &Path) -> Result<PathBuf> {
    let debug = to.with_extension("debug");
    exec(
        Command::new("objcopy")
            .arg("--only-keep-debug")
            .arg(binary)
            .arg(&debug),
    )?;
    exec(
        Command::new("objcopy")
            .arg("--strip-all")
            .arg(format!("--add-gnu-debuglink={}", debug.display()))
            .arg(binary)
            .arg(to),
    )?;
    Ok(to.to_path_buf())
}

/// SOURCE_DATE_EPOCH, else the last commit's time, else 0.
fn source_date_epoch() -> u64 {
    std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .or_else(|| {
            output(Command::new("git").current_dir(workspace_root()).args([
                "log",
                "-1",
                "--format=%ct",
            ]))
        })
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

fn dir_size(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_size(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map(|m| m.len()).unwrap_or(0),
            _ => 0,
        })
        .sum()
}

/// deploy/Dockerfile with a container engine, when one answers.
fn with_engine(engine: &str, reference: &str) -> Result<()> {
    if output(Command::new(engine).arg("info")).is_none() {
        bail!("`{engine} info` failed: the engine does not answer (without --engine the image is built with no engine)");
    }
    crate::build::agent(true)?;
    exec(Command::new(engine).current_dir(workspace_root()).args([
        "build",
        "-f",
        "deploy/Dockerfile",
        "-t",
        reference,
        ".",
    ]))
    .context("building deploy/Dockerfile")
}
