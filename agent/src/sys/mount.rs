//! Filesystem type and mounting, for the bpffs that holds the pins.

use std::ffi::CString;
use std::io;
use std::path::Path;

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

/// The filesystem type (`f_type`, a magic number) of the filesystem holding `path`.
pub fn statfs_type(path: &Path) -> io::Result<i64> {
    let c = c_path(path)?;
    // SAFETY: statfs is plain data; zero is a valid starting value.
    let mut buf: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid NUL-terminated path and buf a properly sized out-parameter.
    if unsafe { libc::statfs(c.as_ptr(), &mut buf) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(buf.f_type)
}

/// Mounts a bpffs at `at` (an existing directory).
pub fn mount_bpffs(at: &Path) -> io::Result<()> {
    let target = c_path(at)?;
    let fstype = c"bpf";
    // SAFETY: all pointers are valid NUL-terminated strings; data is null.
    let rc = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
