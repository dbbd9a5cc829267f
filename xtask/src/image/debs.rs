//! The Debian packages the image's files come from, pinned in deploy/image/packages.lock
//! (name, version, the .deb's SHA-256), downloaded with `apt-get download` into a cache and
//! unpacked with `dpkg-deb -x`, one directory per package (so every file's package is known).
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::cmd::{exec, output, workspace_root};

/// One locked package.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Locked {
    pub name: String,
    pub version: String,
    pub sha256: String,
}

pub fn lock_path() -> PathBuf {
    workspace_root().join("deploy/image/packages.lock")
}

const LOCK_HEADER: &str = "\
# The Debian (bookworm, amd64) packages whose files make weir's image: name, version and the
# SHA-256 of the .deb. `cargo xtask image` downloads exactly these (cached in
# ~/.cache/weir/image/debs) and fails naming any it cannot get; `cargo xtask image --relock`
# rewrites this file from the apt sources' current versions. Only the files weir runs, their
# libraries and the packages' copyright files are taken from them.
";

pub fn read_lock(path: &Path) -> Result<Vec<Locked>> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse_lock(&text).with_context(|| format!("in {}", path.display()))
}

fn parse_lock(text: &str) -> Result<Vec<Locked>> {
    let mut locked = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [name, version, sha256] = fields[..] else {
            bail!("line {}: {line:?} is not `name version sha256`", i + 1);
        };
        if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            bail!("line {}: {sha256:?} is not a SHA-256", i + 1);
        }
        locked.push(Locked {
            name: name.into(),
            version: version.into(),
            sha256: sha256.to_ascii_lowercase(),
        });
    }
    if locked.is_empty() {
        bail!("no packages");
    }
    Ok(locked)
}

pub fn write_lock(path: &Path, locked: &[Locked]) -> Result<()> {
    let mut text = LOCK_HEADER.to_string();
    for l in locked {
        writeln!(text, "{} {} {}", l.name, l.version, l.sha256).unwrap();
    }
    fs::create_dir_all(path.parent().unwrap())?;
    fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn cache_dir() -> PathBuf {
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    PathBuf::from(home).join(".cache/weir/image/debs")
}

pub fn sha256(path: &Path) -> Result<String> {
    let out = output(Command::new("sha256sum").arg(path))
        .with_context(|| format!("sha256sum {}", path.display()))?;
    out.split_whitespace()
        .next()
        .map(str::to_string)
        .with_context(|| format!("sha256sum {} printed nothing", path.display()))
}

/// The .deb of `name` at `version` (`None`: the apt sources' candidate), from the cache or
/// downloaded into it. A pinned version's digest must match the lock.
pub fn fetch(name: &str, version: Option<&str>, expect: Option<&str>) -> Result<(PathBuf, String)> {
    let cache = cache_dir();
    fs::create_dir_all(&cache)?;
    if let Some(version) = version {
        let cached = cache.join(deb_name(name, version));
        if cached.exists() && expect.is_none_or(|e| sha256(&cached).ok().as_deref() == Some(e)) {
            return Ok((cached, version.to_string()));
        }
    }
    // apt-get download writes into the working directory; a scratch one per package.
    let scratch = cache.join(format!(".download-{name}"));
    let _ = fs::remove_dir_all(&scratch);
    fs::create_dir_all(&scratch)?;
    let spec = match version {
        Some(v) => format!("{name}={v}"),
        None => name.to_string(),
    };
    let out = Command::new("apt-get")
        .args(["download", "-q", &spec])
        .current_dir(&scratch)
        .output()
        .context("running apt-get download")?;
    if !out.status.success() {
        let _ = fs::remove_dir_all(&scratch);
        bail!(
            "apt-get download {spec} failed: {}{}",
            String::from_utf8_lossy(&out.stderr).trim(),
            match version {
                Some(_) =>
                    " (the locked version is gone from the apt sources? \
                            `cargo xtask image --relock` pins what they have now)",
                None => "",
            }
        );
    }
    let deb = fs::read_dir(&scratch)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .with_context(|| format!("apt-get download {spec} wrote no .deb"))?;
    let got_version = output(
        Command::new("dpkg-deb")
            .args(["-f"])
            .arg(&deb)
            .arg("Version"),
    )
    .map(|v| v.trim().to_string())
    .with_context(|| format!("dpkg-deb -f {} Version", deb.display()))?;
    let digest = sha256(&deb)?;
    if let Some(e) = expect {
        if digest != e {
            let _ = fs::remove_dir_all(&scratch);
            bail!("{name} {got_version}: the .deb's SHA-256 is {digest}, the lock says {e}");
        }
    }
    let cached = cache.join(deb_name(name, &got_version));
    fs::rename(&deb, &cached)?;
    let _ = fs::remove_dir_all(&scratch);
    Ok((cached, got_version))
}

fn deb_name(name: &str, version: &str) -> String {
    // Epochs (`1:2.3`) are kept out of file names, as apt does.
    format!("{name}_{}_amd64.deb", version.replace(':', "%3a"))
}

/// Every locked package unpacked under `into/<name>/`; returns name → its directory.
pub fn unpack_locked(locked: &[Locked], into: &Path) -> Result<BTreeMap<String, PathBuf>> {
    let mut dirs = BTreeMap::new();
    for l in locked {
        let (deb, _) = fetch(&l.name, Some(&l.version), Some(&l.sha256))?;
        dirs.insert(l.name.clone(), unpack(&deb, &into.join(&l.name))?);
    }
    Ok(dirs)
}

pub fn unpack(deb: &Path, dir: &Path) -> Result<PathBuf> {
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir)?;
    exec(Command::new("dpkg-deb").arg("-x").arg(deb).arg(dir))?;
    Ok(dir.to_path_buf())
}

/// The installed package that owns a file named `file_name` (a library's soname), as
/// `dpkg -S` says: how `--relock` finds the package of a library the tools need.
pub fn owner_of(file_name: &str) -> Result<String> {
    let out = output(Command::new("dpkg").args(["-S", &format!("*/{file_name}")])).with_context(
        || format!("no installed package has {file_name} (dpkg -S); install the package that does"),
    )?;
    let first = out.lines().next().unwrap_or_default();
    let package = first.split(':').next().unwrap_or_default().trim();
    if package.is_empty() {
        bail!("dpkg -S */{file_name} printed {first:?}");
    }
    // `libc6:amd64, libc6:i386: ...` names more than one; the first is the native one.
    Ok(package.split(',').next().unwrap().trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_round_trips_and_bad_lines_are_named() {
        let locked = vec![Locked {
            name: "ipset".into(),
            version: "7.17-1".into(),
            sha256: "a".repeat(64),
        }];
        let dir = std::env::temp_dir().join(format!("xtask-lock-{}", std::process::id()));
        let path = dir.join("packages.lock");
        write_lock(&path, &locked).unwrap();
        assert_eq!(read_lock(&path).unwrap(), locked);
        let _ = fs::remove_dir_all(&dir);
        let err = parse_lock("ipset 7.17-1\n").unwrap_err().to_string();
        assert!(err.contains("line 1"), "{err}");
        let err = parse_lock("ipset 7.17-1 xyz\n").unwrap_err().to_string();
        assert!(err.contains("not a SHA-256"), "{err}");
    }
}
