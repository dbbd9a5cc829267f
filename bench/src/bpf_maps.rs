//! The BPF maps an agent holds, without bpftool: each map fd of the process is duplicated
//! with pidfd_getfd, its size read from /proc/self/fdinfo (memlock, max_entries), its name
//! from BPF_OBJ_GET_INFO_BY_FD, and its entries counted with BPF_MAP_GET_NEXT_KEY.
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use anyhow::{Context, Result};

const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
/// Map types whose keys cannot be iterated (perf event array, ring buffer, user ring
/// buffer) or whose every key always exists (array, per-CPU array).
const UNCOUNTED_TYPES: &[u32] = &[2, 4, 6, 27, 31];

#[derive(Clone, Debug)]
pub struct MapInfo {
    pub id: u32,
    pub name: String,
    pub max_entries: u64,
    pub memlock: u64,
    /// Entries present, for maps whose keys can be counted.
    pub entries: Option<u64>,
}

/// The maps that process `pid` holds open, by map id.
pub fn maps_of(pid: u32) -> Result<Vec<MapInfo>> {
    let pidfd = pidfd_open(pid)?;
    let dir = format!("/proc/{pid}/fd");
    let mut maps = BTreeMap::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("listing {dir}"))? {
        let entry = entry?;
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue; // closed meanwhile
        };
        if target.to_string_lossy() != "anon_inode:bpf-map" {
            continue;
        }
        let Some(remote_fd) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        let fd = pidfd_getfd(&pidfd, remote_fd)
            .with_context(|| format!("duplicating fd {remote_fd} of pid {pid}"))?;
        let info = map_info(&fd)?;
        maps.insert(info.id, info);
    }
    Ok(maps.into_values().collect())
}

fn map_info(fd: &OwnedFd) -> Result<MapInfo> {
    let path = format!("/proc/self/fdinfo/{}", fd.as_raw_fd());
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let field = |key: &str| -> Result<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .with_context(|| format!("{path} has no {key}"))?
            .trim()
            .parse()
            .with_context(|| format!("{path}: {key}"))
    };
    let map_type = field("map_type")? as u32;
    let key_size = field("key_size")? as usize;
    let (name, id) = name_and_id(fd)?;
    let entries = if UNCOUNTED_TYPES.contains(&map_type) {
        None
    } else {
        count_entries(fd, key_size)
    };
    Ok(MapInfo {
        id,
        name,
        max_entries: field("max_entries")?,
        memlock: field("memlock")?,
        entries,
    })
}

/// `union bpf_attr` is at most this big for the map commands used here; the rest stays zero.
type Attr = [u64; 8];

/// The bpf(2) system call on `attr`, a zero-padded `union bpf_attr` (of the size passed);
/// returns its non-negative result (an fd, for the commands that make one).
pub fn bpf(cmd: libc::c_long, attr: &mut [u64]) -> std::io::Result<i64> {
    // SAFETY: attr is a zero-padded bpf_attr of the size passed; the kernel reads and
    // writes only within it and the buffers it points to, which the caller keeps alive.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_mut_ptr(),
            std::mem::size_of_val(attr),
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(rc)
}

/// struct bpf_map_info: type, id, key_size, value_size, max_entries, map_flags (u32
/// each), then name[16].
fn name_and_id(fd: &OwnedFd) -> Result<(String, u32)> {
    let mut info = [0u8; 256];
    let mut attr: Attr = [0; 8];
    attr[0] = fd.as_raw_fd() as u64 | ((info.len() as u64) << 32);
    attr[1] = info.as_mut_ptr() as u64;
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).context("BPF_OBJ_GET_INFO_BY_FD")?;
    let id = u32::from_ne_bytes(info[4..8].try_into().expect("4 bytes"));
    let name = &info[24..40];
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    Ok((String::from_utf8_lossy(&name[..end]).into_owned(), id))
}

/// Walks the keys; `None` when the map cannot be iterated.
fn count_entries(fd: &OwnedFd, key_size: usize) -> Option<u64> {
    let mut key = vec![0u8; key_size.max(1)];
    let mut next = vec![0u8; key_size.max(1)];
    let mut count = 0u64;
    let mut first = true;
    loop {
        let mut attr: Attr = [0; 8];
        attr[0] = fd.as_raw_fd() as u64;
        attr[1] = if first { 0 } else { key.as_ptr() as u64 };
        attr[2] = next.as_mut_ptr() as u64;
        match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
            Ok(_) => {
                count += 1;
                first = false;
                std::mem::swap(&mut key, &mut next);
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Some(count),
            Err(_) => return None,
        }
    }
}

fn pidfd_open(pid: u32) -> Result<OwnedFd> {
    // SAFETY: pidfd_open has no memory arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("pidfd_open({pid})"));
    }
    // SAFETY: the kernel returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn pidfd_getfd(pidfd: &OwnedFd, remote: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd has no memory arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), remote, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}
