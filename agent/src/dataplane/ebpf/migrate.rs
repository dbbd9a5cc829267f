//! Versioned pins: a pinned map is reused only when its shape (map type, key size, value
//! size, flags, max_entries) is the one the embedded object and the configuration ask for.
//! Any other pinned map is migrated, without a gap in enforcement:
//!
//! 1. the object is loaded again with each mismatched map redirected to a staging pin
//!    (`<root>/migrate/maps/NAME`, created at the new shape) and its programs pinned under
//!    `<root>/migrate/progs/`; the attached (old) programs keep enforcing with the old maps;
//! 2. contents are copied where the layout allows it (same type, key and value sizes: a
//!    new size or new flags); maps whose layout changed start empty: IDENTITY, ENDPOINT,
//!    ENDPOINT_BY_ID, LOCAL, SERVICE and POLICY are recomputed from the desired state by the next converge, the others
//!    (connection table, counters, ...) are logged as not carried over;
//! 3. the first converge writes the desired state into the new maps, then every attached
//!    hook gets the new program swapped in atomically (TCX link update or netlink filter
//!    replace), hash maps are copied once more for entries the old programs made meanwhile
//!    (without overwriting), and the staging pins are renamed over the old ones (programs
//!    first, then maps), so a crash at any point leaves either the old pins or the new
//!    ones, and a restart migrates again.
//!
//! The comparison is generic: it reads the object's map definitions and the kernel's
//! `bpf_map_info` of each pin, so any future change of a key or value type is caught.

use std::{
    collections::BTreeMap,
    io,
    path::{Path, PathBuf},
};

use aya::maps::{MapData, MapError, MapInfo};
use aya_obj::{maps::PinningType, Object};

use super::{config::EbpfConfig, loader, pins::PinLayout};
use crate::dataplane::DataplaneError;
use crate::sys::bpf::RawMap;

/// What the kernel checks a map by, besides its contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub flags: u32,
}

impl Shape {
    /// Same type and key and value sizes: entries can be copied as bytes.
    fn layout_matches(&self, other: &Shape) -> bool {
        self.map_type == other.map_type
            && self.key_size == other.key_size
            && self.value_size == other.value_size
    }

    pub fn of_pin(path: &Path) -> Result<Shape, MapError> {
        let info = MapInfo::from_pin(path)?;
        Ok(Shape {
            map_type: info.map_type()? as u32,
            key_size: info.key_size(),
            value_size: info.value_size(),
            max_entries: info.max_entries(),
            flags: info.map_flags(),
        })
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "type {} key {}B value {}B max_entries {} flags {:#x}",
            self.map_type, self.key_size, self.value_size, self.max_entries, self.flags
        )
    }
}

/// The shape of every pinned map of the embedded object, with the configured sizes.
pub fn expected(config: &EbpfConfig) -> Result<BTreeMap<String, Shape>, DataplaneError> {
    let obj = Object::parse(loader::OBJECT).map_err(|e| DataplaneError::Object(Box::new(e)))?;
    let sizes = loader::max_entries(config);
    Ok(obj
        .maps
        .iter()
        .filter(|(_, m)| m.pinning() == PinningType::ByName)
        .map(|(name, m)| {
            let max_entries = sizes
                .iter()
                .find(|(n, _)| *n == name.as_str())
                .map_or(m.max_entries(), |(_, v)| *v);
            let shape = Shape {
                map_type: m.map_type(),
                key_size: m.key_size(),
                value_size: m.value_size(),
                max_entries,
                flags: m.map_flags(),
            };
            (name.clone(), shape)
        })
        .collect())
}

/// A pinned map whose shape is not the one wanted.
#[derive(Clone, Debug)]
pub struct Mismatch {
    pub name: String,
    pub have: Shape,
    pub want: Shape,
}

impl Mismatch {
    pub fn copyable(&self) -> bool {
        self.have.layout_matches(&self.want) && iterable(self.want.map_type)
    }
}

/// Pinned maps under the pin root whose shape differs from `expected`. A pin that cannot
/// be read at all counts as a mismatch too (it is then rebuilt, never reused blindly).
pub fn mismatches(layout: &PinLayout, expected: &BTreeMap<String, Shape>) -> Vec<Mismatch> {
    let mut out = Vec::new();
    for (name, want) in expected {
        let path = layout.map(name);
        if !path.exists() {
            continue;
        }
        match Shape::of_pin(&path) {
            Ok(have) if have == *want => {}
            Ok(have) => out.push(Mismatch {
                name: name.clone(),
                have,
                want: *want,
            }),
            Err(e) => {
                tracing::warn!(map = %name, "pinned map unreadable ({e}): rebuilding it");
                out.push(Mismatch {
                    name: name.clone(),
                    have: Shape {
                        map_type: 0,
                        key_size: 0,
                        value_size: 0,
                        max_entries: 0,
                        flags: 0,
                    },
                    want: *want,
                });
            }
        }
    }
    out
}

/// A migration under way: new maps and programs pinned under the staging directory, the
/// old maps still held open for the second copy.
pub struct Migration {
    pub mismatches: Vec<Mismatch>,
    staging: PathBuf,
    old: BTreeMap<String, MapData>,
    copied: BTreeMap<String, usize>,
}

const STAGING: &str = "migrate";

impl Migration {
    pub fn staging_root(layout: &PinLayout) -> PathBuf {
        layout.root.join(STAGING)
    }

    pub fn map_path(&self, layout: &PinLayout, name: &str) -> PathBuf {
        if self.mismatches.iter().any(|m| m.name == name) {
            self.staging.join("maps").join(name)
        } else {
            layout.map(name)
        }
    }

    pub fn progs_dir(&self) -> PathBuf {
        self.staging.join("progs")
    }

    /// Loads the object into staging pins and copies what can be copied. `None` when every
    /// pinned map has the wanted shape.
    pub fn prepare(
        layout: &PinLayout,
        config: &EbpfConfig,
    ) -> Result<Option<Migration>, DataplaneError> {
        let expected = expected(config)?;
        let mismatches = mismatches(layout, &expected);
        if mismatches.is_empty() {
            // Leftovers of a migration that completed its renames but not its cleanup.
            let _ = std::fs::remove_dir_all(Self::staging_root(layout));
            return Ok(None);
        }
        let staging = Self::staging_root(layout);
        // A crash in an earlier migration: start it over (its maps are referenced by
        // programs only if the swap happened; removing the pins frees nothing in use).
        let _ = std::fs::remove_dir_all(&staging);
        for dir in [staging.join("maps"), staging.join("progs")] {
            std::fs::create_dir_all(&dir).map_err(|source| DataplaneError::Io {
                context: format!("create {}", dir.display()),
                source,
            })?;
        }
        for m in &mismatches {
            tracing::info!(
                map = %m.name,
                from = %m.have,
                to = %m.want,
                "pinned map has another shape than this build wants: migrating it"
            );
        }
        let mut old = BTreeMap::new();
        for m in &mismatches {
            match MapData::from_pin(layout.map(&m.name)) {
                Ok(data) => {
                    old.insert(m.name.clone(), data);
                }
                Err(e) => tracing::warn!(map = %m.name, "old map not readable: {e}"),
            }
        }
        let overrides: Vec<(String, PathBuf)> = mismatches
            .iter()
            .map(|m| (m.name.clone(), staging.join("maps").join(&m.name)))
            .collect();
        loader::load_and_pin_into(layout, config, &overrides, &staging.join("progs"))?;
        let mut migration = Migration {
            mismatches,
            staging,
            old,
            copied: BTreeMap::new(),
        };
        migration.copy(layout, 0, false);
        Ok(Some(migration))
    }

    /// Copies every copyable old map into its new one; `flags` is BPF_ANY or BPF_NOEXIST.
    /// With `kernel_written_only`, only maps the programs write (the connection table,
    /// rate state, ...): the agent's own maps hold the desired state by then, and a copy
    /// would bring back entries the converge removed.
    fn copy(&mut self, layout: &PinLayout, flags: u64, kernel_written_only: bool) {
        for m in &self.mismatches {
            let Some(old) = self.old.get(&m.name) else {
                continue;
            };
            if !m.copyable() || (kernel_written_only && AGENT_WRITTEN.contains(&m.name.as_str())) {
                continue;
            }
            let new = match MapData::from_pin(self.map_path(layout, &m.name)) {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(map = %m.name, "new map not readable: {e}");
                    continue;
                }
            };
            match copy_entries(old, &new, flags) {
                Ok((n, lost)) => {
                    *self.copied.entry(m.name.clone()).or_default() += n;
                    if lost > 0 {
                        tracing::warn!(map = %m.name, lost, "entries did not fit the new map");
                    }
                }
                Err(e) => tracing::warn!(map = %m.name, "copy failed: {e}"),
            }
        }
    }

    /// Just before the swap: brings the programs' own maps (connection table) up to date
    /// with what the old programs did since the migration began.
    pub fn refresh(&mut self, layout: &PinLayout) {
        self.copy(layout, 0, true);
    }

    /// After the new programs are on every hook: copies entries the old programs created
    /// meanwhile (without overwriting), then renames the staging pins over the old ones.
    pub fn commit(mut self, layout: &PinLayout) -> Result<(), DataplaneError> {
        self.copy(layout, BPF_NOEXIST, true);
        let rename = |from: PathBuf, to: PathBuf| {
            std::fs::rename(&from, &to).map_err(|source| DataplaneError::Io {
                context: format!("rename {} to {}", from.display(), to.display()),
                source,
            })
        };
        for name in weir_common::program_names::ALL {
            rename(self.progs_dir().join(name), layout.prog(name))?;
        }
        for m in &self.mismatches {
            rename(self.staging.join("maps").join(&m.name), layout.map(&m.name))?;
            let how = if m.copyable() {
                format!(
                    "copied {} entries",
                    self.copied.get(&m.name).copied().unwrap_or(0)
                )
            } else if RECOMPUTED.contains(&m.name.as_str()) {
                "layout changed: recomputed from the desired state".to_string()
            } else {
                "layout changed: contents not carried over".to_string()
            };
            tracing::info!(
                map = %m.name,
                from = %m.have,
                to = %m.want,
                "migrated pinned map ({how})"
            );
        }
        let _ = std::fs::remove_dir_all(&self.staging);
        Ok(())
    }
}

/// Maps whose whole contents the agent writes from the desired state.
const RECOMPUTED: [&str; 6] = [
    weir_common::map_names::IDENTITY,
    weir_common::map_names::ENDPOINT,
    weir_common::map_names::ENDPOINT_BY_ID,
    weir_common::map_names::LOCAL,
    weir_common::map_names::SERVICE,
    weir_common::map_names::POLICY,
];

/// Maps only the agent writes (the programs read them, or never touch them).
const AGENT_WRITTEN: [&str; 8] = [
    weir_common::map_names::IDENTITY,
    weir_common::map_names::ENDPOINT,
    weir_common::map_names::ENDPOINT_BY_ID,
    weir_common::map_names::LOCAL,
    weir_common::map_names::SERVICE,
    weir_common::map_names::POLICY,
    weir_common::map_names::RECORDS,
    weir_common::map_names::SETTINGS,
];

// bpf(2) flags and map types used here (stable kernel ABI).
const BPF_NOEXIST: u64 = 1;
const HASH: u32 = 1;
const ARRAY: u32 = 2;
const PERCPU_HASH: u32 = 5;
const PERCPU_ARRAY: u32 = 6;
const LRU_HASH: u32 = 9;
const LRU_PERCPU_HASH: u32 = 10;
const LPM_TRIE: u32 = 11;

fn iterable(map_type: u32) -> bool {
    matches!(
        map_type,
        HASH | ARRAY | PERCPU_HASH | PERCPU_ARRAY | LRU_HASH | LRU_PERCPU_HASH | LPM_TRIE
    )
}

/// Copies all entries of `old` into `new` (of one layout: same type, key and value
/// sizes); returns how many were written and how many the new map refused (full, or an
/// index past its end).
fn copy_entries(old: &MapData, new: &MapData, flags: u64) -> io::Result<(usize, usize)> {
    let old = RawMap::new(old)?;
    let new = RawMap::new(new)?;
    if (old.map_type(), old.key_size(), old.value_size())
        != (new.map_type(), new.key_size(), new.value_size())
    {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the old and new maps' layouts differ",
        ));
    }
    let mut key = vec![0u8; old.key_size().max(1)];
    let mut next = vec![0u8; old.key_size().max(1)];
    let mut value = vec![0u8; old.value_size().max(1)];
    let (mut written, mut lost) = (0, 0);
    let mut first = true;
    loop {
        if !old.next_key((!first).then_some(&key[..]), &mut next)? {
            break;
        }
        first = false;
        std::mem::swap(&mut key, &mut next);
        // Deleted meanwhile (an LRU eviction): skip it.
        if old.lookup(&key, &mut value).is_err() {
            continue;
        }
        match new.update(&key, &value, flags) {
            Ok(()) => written += 1,
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(_) => lost += 1,
        }
    }
    Ok((written, lost))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_shapes_follow_the_configuration() {
        let config = EbpfConfig {
            policy_entries: 1234,
            ..Default::default()
        };
        let shapes = expected(&config).unwrap();
        let policy = shapes[weir_common::map_names::POLICY];
        assert_eq!(policy.max_entries, 1234);
        assert_eq!(
            policy.key_size as usize,
            std::mem::size_of::<weir_common::PolicyKey>() + 4
        );
        assert!(shapes.contains_key(weir_common::map_names::CT));
        assert!(
            !shapes.contains_key("SCRATCH"),
            "unpinned maps are not compared"
        );
    }
}
