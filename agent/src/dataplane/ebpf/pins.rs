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

pub fn is_bpffs(path: &Path) -> Result<bool, DataplaneError> {
    match crate::sys::mount::statfs_type(path) {
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
    crate::sys::mount::mount_bpffs(at).map_err(|source| DataplaneError::Io {
        context: format!("mount bpffs at {}", at.display()),
        source,
    })?;
    tracing::info!(at = %at.display(), "mounted bpffs");
    Ok(())
}
