//! The status file of file mode: what the lab waits for. Written atomically (temporary
//! file in the same directory, then rename), so a reader never sees half a document.

use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::dataplane::DataplaneKind;
use weir_policy::model::ObjectError;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// The manifest generation this status describes (0 when the source has none).
    pub generation: u64,
    /// The dataplane enforces the state of `generation` (less the objects in `errors`).
    pub converged: bool,
    pub dataplane: Option<DataplaneKind>,
    /// Why the effective dataplane differs from the requested one, if it does.
    pub fallback_reason: Option<String>,
    pub errors: Vec<ObjectError>,
    /// Cluster mode: the digest of the objects (kind, name, resourceVersion) this status
    /// describes (`source::digest`); the lab compares it with the API server's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_digest: Option<String>,
    /// When the source received the change that the last applied batch began with (a
    /// watch event; the manifest file's change), in CLOCK_MONOTONIC nanoseconds: with the
    /// time of the API write, it gives the watch delay apart from the agent's own share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub change_received_monotonic_ns: Option<u64>,
    /// How the cold start spent its time, once the dataplane first started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup: Option<Startup>,
}

/// The cold start's phases, each in milliseconds, in the order they happen: where the time
/// from starting `weir agent` to its first convergence went (`cargo xtask bench` reports
/// them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Startup {
    /// From the agent's start to the source's first complete state (cluster mode: every
    /// kind listed; file mode: the manifest read).
    pub listed_ms: u64,
    /// The engine's compile of that state.
    pub compiled_ms: u64,
    /// Probing the kernel and building the dataplane (eBPF: loading and attaching the
    /// programs).
    pub loaded_ms: u64,
    /// Writing the desired state into the kernel (maps, or sets and rules).
    pub programmed_ms: u64,
    /// Removing the other dataplane's and Azure NPM's leftovers.
    pub cleaned_ms: u64,
}

impl Status {
    pub fn write_atomically(&self, path: &Path) -> std::io::Result<()> {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let name = path.file_name().ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "status path has no file name",
            )
        })?;
        let tmp = dir.join(format!(
            ".{}.tmp-{}",
            name.to_string_lossy(),
            std::process::id()
        ));
        let mut f = std::fs::File::create(&tmp)?;
        serde_json::to_writer_pretty(&mut f, self)?;
        f.write_all(b"\n")?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_is_written_whole_in_the_agreed_shape() {
        let dir = std::env::temp_dir().join(format!("weir-status-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("status.json");
        let status = Status {
            generation: 3,
            converged: true,
            dataplane: Some(DataplaneKind::Ebpf),
            fallback_reason: None,
            errors: vec![ObjectError {
                object: "NetworkPolicy x/bad".into(),
                reason: "spec.ingress[0]: bad".into(),
            }],
            state_digest: None,
            change_received_monotonic_ns: None,
            startup: None,
        };
        status.write_atomically(&path).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(v["generation"], 3);
        assert_eq!(v["converged"], true);
        assert_eq!(v["dataplane"], "ebpf");
        assert!(v["fallback_reason"].is_null());
        assert_eq!(v["errors"][0]["object"], "NetworkPolicy x/bad");
        let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temporary file left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
