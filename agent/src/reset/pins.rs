//! Removing BPF objects pinned under a pin root: links first (unpinning the last
//! reference detaches them), then programs, then maps, then the directories.
//! The kind of each pin is read from the kernel (`/proc/self/fdinfo` of the object).

use std::fs;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum PinKind {
    Link,
    Program,
    Map,
    /// Not a BPF object the kernel would open (or unknown to this parser).
    Other,
}

/// What is pinned under a root, in removal order.
#[derive(Debug, Default)]
pub struct PinInventory {
    /// Links, then programs, then maps, then anything else.
    pub files: Vec<(PathBuf, PinKind)>,
    /// Deepest first, the root last.
    pub dirs: Vec<PathBuf>,
}

pub fn inventory(root: &Path) -> std::io::Result<PinInventory> {
    let mut files = Vec::new();
    let mut dirs = Vec::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in fs::read_dir(&dir)? {
            let entry = entry?;
            let path = entry.path();
            if entry.file_type()?.is_dir() {
                pending.push(path);
            } else {
                let kind = kind_of(&path);
                files.push((path, kind));
            }
        }
        dirs.push(dir);
    }
    files.sort_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
    dirs.reverse();
    Ok(PinInventory { files, dirs })
}

/// Opens the pinned object (BPF_OBJ_GET) and reads its kind from fdinfo.
fn kind_of(path: &Path) -> PinKind {
    let Ok(fd) = crate::sys::bpf::obj_get(path) else {
        return PinKind::Other;
    };
    let info = fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd()));
    info.map_or(PinKind::Other, |text| parse_fdinfo_kind(&text))
}

pub fn parse_fdinfo_kind(text: &str) -> PinKind {
    let has = |key: &str| text.lines().any(|l| l.starts_with(key));
    if has("link_type:") {
        PinKind::Link
    } else if has("prog_type:") {
        PinKind::Program
    } else if has("map_type:") {
        PinKind::Map
    } else {
        PinKind::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_kinds_from_fdinfo() {
        assert_eq!(
            parse_fdinfo_kind("pos:\t0\nflags:\t02000002\nlink_type:\ttcx\nlink_id:\t4\n"),
            PinKind::Link
        );
        assert_eq!(
            parse_fdinfo_kind("pos:\t0\nprog_type:\t3\nprog_jited:\t1\n"),
            PinKind::Program
        );
        assert_eq!(
            parse_fdinfo_kind("pos:\t0\nmap_type:\t1\nkey_size:\t4\n"),
            PinKind::Map
        );
        assert_eq!(parse_fdinfo_kind("pos:\t0\n"), PinKind::Other);
    }
}
