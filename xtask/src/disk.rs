//! Disk room for a build: `cargo xtask test` checks it before it starts, so a full disk is
//! named up front rather than by rustc or the linker half-way through.
use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

const GIB: u64 = 1 << 30;

/// Bytes free to an unprivileged writer on the filesystem holding `path` (or its nearest
/// existing ancestor).
pub fn free_bytes(path: &Path) -> Result<u64> {
    let existing = path
        .ancestors()
        .find(|p| p.exists())
        .context("no ancestor of the path exists")?;
    let c_path = std::ffi::CString::new(existing.as_os_str().as_encoded_bytes())
        .context("a path with a NUL byte")?;
    // SAFETY: statvfs only writes the struct it is given; the path is NUL-terminated.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut stat) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("statvfs {}", existing.display()));
    }
    Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
}

/// Bytes the files under `dirs` occupy on disk, each file once (cargo hard-links its
/// binaries under two names). A directory that does not exist holds nothing.
pub fn used_bytes(dirs: &[&Path]) -> u64 {
    let mut seen = HashSet::new();
    let mut total = 0u64;
    let mut pending: Vec<PathBuf> = dirs.iter().map(|d| d.to_path_buf()).collect();
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            if meta.is_dir() {
                pending.push(entry.path());
            } else if seen.insert((meta.dev(), meta.ino())) {
                total = total.saturating_add(meta.blocks().saturating_mul(512));
            }
        }
    }
    total
}

/// Fails, naming the figures, when the filesystem holding `dirs` has less than `need`
/// bytes free. What the directories hold already is not subtracted: after a toolchain or
/// profile change most of it is stale and rebuilt beside itself, so only the cold figure
/// is safe.
pub fn check_room(dirs: &[&Path], need: u64, what: &str) -> Result<()> {
    let first = dirs.first().context("no directory to check")?;
    let free = free_bytes(first)?;
    let held = used_bytes(dirs);
    let names = dirs
        .iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(" and ");
    println!(
        "disk: {} free; {what} needs about {}; {names} hold {}",
        gib(free),
        gib(need),
        gib(held),
    );
    if free < need {
        bail!(
            "not enough disk for {what}: {} free, about {} needed; {names} hold {} \
             (`cargo clean` empties a target directory)",
            gib(free),
            gib(need),
            gib(held),
        );
    }
    Ok(())
}

pub fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / GIB as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_is_measured_on_the_nearest_existing_ancestor() {
        let missing = std::env::temp_dir().join("weir-disk-test/not/there");
        assert!(free_bytes(&missing).unwrap() > 0);
        assert_eq!(used_bytes(&[missing.as_path()]), 0);
        let err = check_room(&[missing.as_path()], u64::MAX, "a run").unwrap_err();
        assert!(
            err.to_string().contains("not enough disk for a run"),
            "{err}"
        );
    }
}
