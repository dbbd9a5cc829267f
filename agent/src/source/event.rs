//! What a source hands the run loop: batches of object events. A batch is applied as one
//! unit (the dataplane sees only the state after the whole batch), so a policy replaced
//! by another in one file edit never leaves a pod briefly unprotected.

use std::future::Future;

use weir_policy::model::{Object, ObjectError, ObjectRef};
use weir_policy::{PolicyError, Validated};

#[derive(Clone, Debug)]
pub enum Event {
    /// An object, validated and reduced to what enforcement needs as it arrived: no
    /// source holds a whole Kubernetes object longer than it takes to convert it.
    Upsert(Box<Validated>),
    /// An object that failed validation (the error names it and the field): the engine
    /// keeps its last good version.
    Refused(PolicyError),
    Delete(ObjectRef),
}

impl Event {
    /// The upsert of `object`, validated here.
    pub fn upsert(object: Object) -> Event {
        match Validated::from_object(object) {
            Ok(valid) => Event::Upsert(Box::new(valid)),
            Err(e) => Event::Refused(e),
        }
    }

    /// The object the event is about.
    pub fn key(&self) -> ObjectRef {
        match self {
            Event::Upsert(valid) => valid.key(),
            Event::Refused(e) => e.object().clone(),
            Event::Delete(key) => key.clone(),
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub events: Vec<Event>,
    /// Objects of the source's current state that could not be read. Each batch replaces
    /// the previous batch's list; the objects they name keep their last good version.
    pub rejected: Vec<ObjectError>,
    /// The source's version of the state after this batch (the manifest file's
    /// `# generation: N`), echoed in the status.
    pub generation: Option<u64>,
    /// Cluster mode: the digest of every object applied so far at its resourceVersion
    /// (`source::digest`), echoed in the status.
    pub state_digest: Option<String>,
    /// When the source received the oldest change in this batch (a watch event, the
    /// manifest file's change): where `weir_policy_implementation_delay_seconds` starts.
    pub received: Option<std::time::Instant>,
}

/// A source of cluster state: manifest files (lab) or the Kubernetes API (cluster mode).
pub trait EventSource {
    /// The next batch. The first batch is the full initial state. Waits until there is one;
    /// an error is fatal for the source.
    fn next(&mut self) -> impl Future<Output = Result<Batch, SourceError>> + Send;
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("source closed")]
    Closed,
}

/// How far a source is with its first complete state, shared with the health server:
/// until it is complete nothing on the node is changed, and `/readyz` says what is still
/// missing and the last error the source met.
#[derive(Debug)]
pub struct SyncProgress {
    inner: std::sync::Mutex<Progress>,
}

/// The sources' progress towards their first complete state, as `weir status` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SyncState {
    /// The first complete state arrived; only from then on is the node changed.
    pub complete: bool,
    /// What the first complete state still lacks (`pods`, `the manifest file F`).
    pub waiting: Vec<String>,
    /// The sources' last error (they retry).
    pub last_error: Option<String>,
}

#[derive(Debug, Default)]
struct Progress {
    /// What the first complete state still lacks (`pods`, `the manifest file F`, ...).
    waiting: Vec<String>,
    last_error: Option<String>,
    complete: bool,
}

impl SyncProgress {
    /// A source that still has to read everything in `waiting`.
    pub fn new(waiting: impl IntoIterator<Item = String>) -> Self {
        SyncProgress {
            inner: std::sync::Mutex::new(Progress {
                waiting: waiting.into_iter().collect(),
                ..Default::default()
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Progress> {
        // A panic elsewhere while holding it leaves plain data behind: keep using it.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `what` is read completely.
    pub fn done(&self, what: &str) {
        self.lock().waiting.retain(|w| w != what);
    }

    /// The source met an error (retried by the source); kept for `/readyz`.
    pub fn error(&self, error: impl Into<String>) {
        self.lock().last_error = Some(error.into());
    }

    /// The run loop has the first complete state.
    pub fn complete(&self) {
        let mut p = self.lock();
        p.complete = true;
        p.waiting.clear();
    }

    pub fn is_complete(&self) -> bool {
        self.lock().complete
    }

    pub fn state(&self) -> SyncState {
        let p = self.lock();
        SyncState {
            complete: p.complete,
            waiting: p.waiting.clone(),
            last_error: p.last_error.clone(),
        }
    }

    /// Why the first complete state is not there yet; `None` once it is.
    pub fn reason(&self) -> Option<String> {
        let p = self.lock();
        if p.complete {
            return None;
        }
        let mut reason = if p.waiting.is_empty() {
            "waiting for the first complete state from the source".to_string()
        } else {
            format!(
                "waiting for the first complete list of {}",
                p.waiting.join(", ")
            )
        };
        reason.push_str("; the node's existing enforcement is left untouched until then");
        if let Some(e) = &p.last_error {
            reason.push_str(&format!("; last source error: {e}"));
        }
        Some(reason)
    }
}

impl Default for SyncProgress {
    fn default() -> Self {
        SyncProgress::new(Vec::new())
    }
}
