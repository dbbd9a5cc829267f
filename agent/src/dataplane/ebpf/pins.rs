//! The pin root's layout on bpffs, and mounting bpffs where it is absent.
//!
//! ```text
//! <root>/maps/WEIR_*           maps (aya pins them by name; reused on restart)
//! <root>/progs/weir_from_pod   programs (reused on restart, so their ids stay)
//! <root>/progs/weir_to_pod
//! <root>/links/<ifindex>-<hook> TCX links (kernel >= 6.6); netlink filters are found by
//!                               their program name weir_* instead
//! ```

use std::{
    ffi::CString,
    io,
    path::{Path, PathBuf},
};

use crate::dataplane::DataplaneError;

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

#[derive(Clone, Debug)]
pub struct PinLayout {
    pub root: PathBuf,
}

impl PinLayout {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        PinLayout { root: root.into() }
    }
    pub fn maps(&self) -> PathBuf {
        self.root.join("maps")
    }
    pub fn map(&self, name: &str) -> PathBuf {
        self.maps().join(name)
    }
    pub fn progs(&self) -> PathBuf {
        self.root.join("progs")
    }
    pub fn prog(&self, name: &str) -> PathBuf {
        self.progs().join(name)
    }
    pub fn links(&self) -> PathBuf {
        self.root.join("links")
    }
    pub fn link(&self, ifindex: u32, hook: &str) -> PathBuf {
        self.links().join(format!("{ifindex}-{hook}"))
    }

    /// Creates the directories, mounting bpffs on the nearest /sys/fs/bpf when the pin
    /// root is not on bpffs yet.
    pub fn prepare(&self) -> Result<(), DataplaneError> {
        let mount_point = bpffs_mount_point(&self.root);
        if !is_bpffs(mount_point)? {
            mount_bpffs(mount_point)?;
        }
        for dir in [self.maps(), self.progs(), self.links()] {
            std::fs::create_dir_all(&dir).map_err(|source| DataplaneError::Io {
                context: format!("create pin directory {}", dir.display()),
                source,
            })?;
        }
        Ok(())
    }
}

/// /sys/fs/bpf for roots below it, else the root's parent.
fn bpffs_mount_point(root: &Path) -> &Path {
    let sys = Path::new("/sys/fs/bpf");
    if root.starts_with(sys) {
        sys
    } else {
        root.parent().unwrap_or(root)
    }
}

fn statfs_type(path: &Path) -> io::Result<i64> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut buf: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid NUL-terminated path and buf a properly sized out-parameter.
    if unsafe { libc::statfs(c.as_ptr(), &mut buf) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(buf.f_type)
}

pub fn is_bpffs(path: &Path) -> Result<bool, DataplaneError> {
    match statfs_type(path) {
        Ok(t) => Ok(t == BPF_FS_MAGIC),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(DataplaneError::Io {
            context: format!("statfs {}", path.display()),
            source,
        }),
    }
}

fn mount_bpffs(at: &Path) -> Result<(), DataplaneError> {
    std::fs::create_dir_all(at).map_err(|source| DataplaneError::Io {
        context: format!("create {}", at.display()),
        source,
    })?;
    let target =
        CString::new(at.as_os_str().as_encoded_bytes()).map_err(|e| DataplaneError::Io {
            context: format!("mount bpffs at {}", at.display()),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
        })?;
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
        return Err(DataplaneError::Io {
            context: format!("mount bpffs at {}", at.display()),
            source: io::Error::last_os_error(),
        });
    }
    tracing::info!(at = %at.display(), "mounted bpffs");
    Ok(())
}
