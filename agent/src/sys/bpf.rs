//! `bpf(2)` commands aya does not offer: element access on a map as bytes, whatever its
//! key and value types (the versioned-pin migration copies maps it has no Rust type for),
//! and opening any pinned object by path to learn what it is (reset).

use std::io;
use std::mem::{offset_of, size_of};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use aya::maps::MapData;

// bpf(2) commands (stable kernel ABI).
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_GET: libc::c_long = 7;

// Map types whose values the kernel copies once per possible CPU, each padded to 8 bytes.
const PERCPU_HASH: u32 = 5;
const PERCPU_ARRAY: u32 = 6;
const LRU_PERCPU_HASH: u32 = 10;
const PERCPU_CGROUP_STORAGE: u32 = 21;

/// The `bpf_attr` of the element commands: map_fd, (padding), key, value or next_key,
/// flags.
#[repr(C)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

const _: () = {
    assert!(size_of::<ElemAttr>() == 32);
    assert!(offset_of!(ElemAttr, map_fd) == 0);
    assert!(offset_of!(ElemAttr, key) == 8);
    assert!(offset_of!(ElemAttr, value) == 16);
    assert!(offset_of!(ElemAttr, flags) == 24);
};

/// The `bpf_attr` of BPF_OBJ_GET: pathname, bpf_fd, file_flags, path_fd (and padding to
/// 8 bytes, zero, which the kernel accepts).
#[repr(C)]
struct ObjGetAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
    path_fd: i32,
    _pad: u32,
}

const _: () = {
    assert!(size_of::<ObjGetAttr>() == 24);
    assert!(offset_of!(ObjGetAttr, pathname) == 0);
    assert!(offset_of!(ObjGetAttr, bpf_fd) == 8);
    assert!(offset_of!(ObjGetAttr, file_flags) == 12);
    assert!(offset_of!(ObjGetAttr, path_fd) == 16);
};

/// A map's elements as bytes. The key and value sizes are the kernel's own (`bpf_map_info`
/// of the map), so every buffer handed to it is checked to be large enough.
pub struct RawMap<'a> {
    fd: BorrowedFd<'a>,
    map_type: u32,
    key_size: usize,
    value_size: usize,
}

impl<'a> RawMap<'a> {
    /// `map`, with the sizes the kernel gives it; a per-CPU map's value is one padded
    /// value per possible CPU.
    pub fn new(map: &'a MapData) -> io::Result<Self> {
        let info = map.info().map_err(io::Error::other)?;
        let map_type = info.map_type().map_err(io::Error::other)? as u32;
        let mut value_size = info.value_size() as usize;
        if matches!(
            map_type,
            PERCPU_HASH | PERCPU_ARRAY | LRU_PERCPU_HASH | PERCPU_CGROUP_STORAGE
        ) {
            let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)?;
            value_size = value_size.div_ceil(8) * 8 * cpus;
        }
        Ok(RawMap {
            fd: map.fd().as_fd(),
            map_type,
            key_size: info.key_size() as usize,
            value_size,
        })
    }

    /// The kernel's `bpf_map_type` of the map.
    pub fn map_type(&self) -> u32 {
        self.map_type
    }

    /// The bytes of a key.
    pub fn key_size(&self) -> usize {
        self.key_size
    }

    /// The bytes of a value as lookups and updates copy it (all CPUs' for a per-CPU map).
    pub fn value_size(&self) -> usize {
        self.value_size
    }

    /// Writes the key after `key` (the first key for `None`) into `next`; `false` when
    /// there is none (ENOENT).
    pub fn next_key(&self, key: Option<&[u8]>, next: &mut [u8]) -> io::Result<bool> {
        if let Some(key) = key {
            self.check(key.len(), self.key_size)?;
        }
        self.check(next.len(), self.key_size)?;
        let mut attr = self.attr(key.map_or(0, |k| k.as_ptr() as u64), next.as_mut_ptr(), 0);
        match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
            Ok(()) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Reads the value of `key` into `value`.
    pub fn lookup(&self, key: &[u8], value: &mut [u8]) -> io::Result<()> {
        self.check(key.len(), self.key_size)?;
        self.check(value.len(), self.value_size)?;
        let mut attr = self.attr(key.as_ptr() as u64, value.as_mut_ptr(), 0);
        bpf(BPF_MAP_LOOKUP_ELEM, &mut attr)
    }

    /// Writes `value` under `key` with the update `flags` (BPF_ANY, BPF_NOEXIST, ...).
    pub fn update(&self, key: &[u8], value: &[u8], flags: u64) -> io::Result<()> {
        self.check(key.len(), self.key_size)?;
        self.check(value.len(), self.value_size)?;
        let mut attr = self.attr(key.as_ptr() as u64, value.as_ptr().cast_mut(), flags);
        bpf(BPF_MAP_UPDATE_ELEM, &mut attr)
    }

    fn attr(&self, key: u64, value: *mut u8, flags: u64) -> ElemAttr {
        ElemAttr {
            map_fd: self.fd.as_raw_fd() as u32,
            _pad: 0,
            key,
            value: value as u64,
            flags,
        }
    }

    fn check(&self, have: usize, need: usize) -> io::Result<()> {
        if have < need {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a buffer of {have} bytes for a map element of {need}"),
            ));
        }
        Ok(())
    }
}

fn bpf(cmd: libc::c_long, attr: &mut ElemAttr) -> io::Result<()> {
    // SAFETY: attr is a valid, initialised bpf_attr prefix for the element commands; the
    // buffers it points to were checked (RawMap::check) to hold the map's key and value
    // sizes as the kernel reports them, and outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut ElemAttr,
            size_of::<ElemAttr>() as u32,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Opens the BPF object (map, program or link) pinned at `path` (BPF_OBJ_GET).
pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let mut c_path = path.as_os_str().as_bytes().to_vec();
    c_path.push(0);
    let attr = ObjGetAttr {
        pathname: c_path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
        path_fd: 0,
        _pad: 0,
    };
    // SAFETY: `attr` is a valid, fully initialised bpf_attr prefix that outlives the
    // call, and `c_path` is NUL-terminated; the kernel only reads them.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET,
            &attr as *const ObjGetAttr,
            size_of::<ObjGetAttr>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a non-negative return of BPF_OBJ_GET is a new fd that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// A `T` read from the start of `bytes` (a ring buffer record, say), or `None` when
/// there are too few bytes.
pub fn read_pod<T: aya::Pod>(bytes: &[u8]) -> Option<T> {
    if bytes.len() < size_of::<T>() {
        return None;
    }
    // SAFETY: bytes holds at least size_of::<T>() bytes, read unaligned, and T: Pod has no
    // invalid bit patterns.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_are_read_from_records_long_enough() {
        let event = weir_common::Counter {
            packets: 7,
            bytes: 1500,
        };
        let mut bytes = vec![0u8];
        bytes.extend_from_slice(&7u64.to_ne_bytes());
        bytes.extend_from_slice(&1500u64.to_ne_bytes());
        // Unaligned on purpose: the record starts at an odd offset.
        assert_eq!(read_pod::<weir_common::Counter>(&bytes[1..]), Some(event));
        assert!(read_pod::<weir_common::Counter>(&bytes[1..16]).is_none());
    }
}
