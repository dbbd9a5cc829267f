//! Debian's generic amd64 kernels, fetched as packages with apt (a private sources list and
//! state directory under the cache, so the system's apt lists are never touched), and
//! installed as distro kernels so that `vng -r <release>` boots them with their modules:
//! vmlinuz and config into /boot, the modules into /lib/modules, then `depmod`
//! (shared/docs/kernels.md). The generic flavour, not cloud-amd64: the cloud kernels lack
//! 9p, which virtme-ng needs here (there is no virtiofsd).
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::cmd::{exec, output};

/// A kernel series Debian ships, and where.
pub struct Series {
    /// `5.10`, `6.1`: what `--kernel` takes.
    pub name: &'static str,
    /// The Debian suite whose own kernel it is.
    suite: &'static str,
    /// The generic image package's name is `linux-image-<prefix><ABI>-amd64-unsigned`.
    prefix: &'static str,
}

pub const SERIES: &[Series] = &[
    Series {
        name: "5.10",
        suite: "bullseye",
        prefix: "5.10.0-",
    },
    Series {
        name: "6.1",
        suite: "bookworm",
        prefix: "6.1.0-",
    },
];

pub fn series(name: &str) -> Option<&'static Series> {
    SERIES.iter().find(|s| s.name == name)
}

fn cache_dir() -> PathBuf {
    PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
        .join(".cache/weir/kernels")
}

/// The kernel release (`5.10.0-46-amd64`) of `series`, installed and ready to boot. The
/// newest ABI the mirror serves is taken the first time, then kept: the cache's package is
/// reused while it is there, so runs compare like with like.
pub fn ensure(series: &Series) -> Result<String> {
    let dir = cache_dir().join(series.name);
    fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let deb = match cached_deb(&dir)? {
        Some(deb) => deb,
        None => download(series, &dir)?,
    };
    let release = release_of(&deb)?;
    install(&deb, &release)?;
    Ok(release)
}

fn cached_deb(dir: &Path) -> Result<Option<PathBuf>> {
    Ok(fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb")))
}

/// apt with the cache's own sources list and lists, reading the system's keyring.
fn apt(program: &str, state: &Path) -> Command {
    let mut c = Command::new(program);
    for (k, v) in [
        ("Dir::Etc::sourcelist", state.join("sources.list")),
        ("Dir::Etc::sourceparts", PathBuf::from("-")),
        ("Dir::State::Lists", state.join("lists")),
        ("Dir::Cache", state.join("cache")),
    ] {
        c.arg("-o").arg(format!("{k}={}", v.display()));
    }
    // The cache is root's; apt's _apt sandbox user could not write it.
    c.args([
        "-o",
        "APT::Get::List-Cleanup=0",
        "-o",
        "APT::Sandbox::User=root",
        "-q",
    ]);
    c
}

fn download(series: &Series, dir: &Path) -> Result<PathBuf> {
    let state = cache_dir().join("apt");
    fs::create_dir_all(state.join("lists/partial"))?;
    fs::create_dir_all(state.join("cache/archives/partial"))?;
    let keyring = "/usr/share/keyrings/debian-archive-keyring.gpg";
    if !Path::new(keyring).exists() {
        bail!("{keyring} is missing (package debian-archive-keyring): apt cannot check Debian's kernels");
    }
    let mut sources = String::new();
    for s in SERIES {
        sources.push_str(&format!(
            "deb [signed-by={keyring}] http://deb.debian.org/debian {suite} main\n\
             deb [signed-by={keyring}] http://deb.debian.org/debian-security {suite}-security main\n",
            suite = s.suite
        ));
    }
    fs::write(state.join("sources.list"), sources)?;
    exec(apt("apt-get", &state).arg("update")).context("apt-get update (Debian kernel lists)")?;
    let package = newest_package(series, &state)?;
    println!("kernels: downloading {package}");
    exec(
        apt("apt-get", &state)
            .current_dir(dir)
            .args(["download", &package]),
    )
    .with_context(|| format!("apt-get download {package}"))?;
    cached_deb(dir)?.with_context(|| {
        format!(
            "apt-get download {package} left no .deb in {}",
            dir.display()
        )
    })
}

/// The highest-ABI generic image package of the series in its own suite.
fn newest_package(series: &Series, state: &Path) -> Result<String> {
    let pattern = format!(
        "^linux-image-{}[0-9]+-amd64-unsigned$",
        regex_escape(series.prefix)
    );
    let listed = output(apt("apt-cache", state).args(["search", "--names-only", &pattern]))
        .context("apt-cache search for Debian's kernel packages failed")?;
    let abi = |name: &str| -> Option<u32> {
        name.strip_prefix("linux-image-")?
            .strip_prefix(series.prefix)?
            .strip_suffix("-amd64-unsigned")?
            .parse()
            .ok()
    };
    listed
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|n| abi(n).map(|a| (a, n.to_string())))
        .max()
        .map(|(_, n)| n)
        .with_context(|| {
            format!(
                "no linux-image-{}N-amd64-unsigned package in Debian {}",
                series.prefix, series.suite
            )
        })
}

fn regex_escape(s: &str) -> String {
    s.replace('.', "\\.")
}

/// `5.10.0-46-amd64`, the directory under lib/modules in the package.
fn release_of(deb: &Path) -> Result<String> {
    let listing = output(Command::new("dpkg-deb").arg("--contents").arg(deb))
        .with_context(|| format!("dpkg-deb --contents {}", deb.display()))?;
    listing
        .lines()
        .find_map(|l| {
            let path = l.split_whitespace().last()?;
            let rest = path.strip_prefix("./boot/vmlinuz-")?;
            Some(rest.to_string())
        })
        .with_context(|| format!("{} holds no boot/vmlinuz-*", deb.display()))
}

/// Installs the image and its modules where `vng -r` looks, unless they are already there.
fn install(deb: &Path, release: &str) -> Result<()> {
    let modules = PathBuf::from("/lib/modules").join(release);
    let vmlinuz = PathBuf::from("/boot").join(format!("vmlinuz-{release}"));
    if vmlinuz.exists() && modules.join("modules.dep").exists() {
        return Ok(());
    }
    println!("kernels: installing {release} into /boot and /lib/modules");
    let tmp = cache_dir().join(format!("extract-{release}"));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)?;
    exec(Command::new("dpkg-deb").arg("-x").arg(deb).arg(&tmp))?;
    fs::create_dir_all("/boot")?;
    for f in ["vmlinuz", "config", "System.map"] {
        let name = format!("{f}-{release}");
        let from = tmp.join("boot").join(&name);
        if from.exists() {
            fs::copy(&from, PathBuf::from("/boot").join(&name))
                .with_context(|| format!("copy {} into /boot", from.display()))?;
        }
    }
    fs::create_dir_all("/lib/modules")?;
    let _ = fs::remove_dir_all(&modules);
    exec(
        Command::new("cp")
            .arg("-a")
            .arg(tmp.join("lib/modules").join(release))
            .arg("/lib/modules/"),
    )?;
    // dpkg-deb -x does not run the package's scripts, and modprobe needs modules.dep.
    exec(Command::new("depmod").args(["-a", release]))?;
    fs::remove_dir_all(&tmp)?;
    Ok(())
}
