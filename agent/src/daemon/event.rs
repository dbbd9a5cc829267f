//! What a source hands the run loop: batches of object events. A batch is applied as one
//! unit (the dataplane sees only the state after the whole batch), so a policy replaced
//! by another in one file edit never leaves a pod briefly unprotected.

use std::future::Future;

use crate::model::{Object, ObjectRef};

#[derive(Clone, Debug)]
pub enum Event {
    Upsert(Box<Object>),
    Delete(ObjectRef),
}

/// An object a source could not turn into an event, named so an operator can find it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ObjectError {
    pub object: String,
    pub reason: String,
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
    #[error("kubernetes API: {0}")]
    Kube(String),
    #[error("source closed")]
    Closed,
}
