//! The relay's store as a source: every kind read from the etcd `weir relay` writes
//! ([`record`]) instead of from the API server. The API server then has one watch per
//! kind (the relay's) however many nodes there are; its restart costs one relist (the
//! relay's) instead of one per agent, and an agent receives only what weir reads of each
//! change.
//!
//! Each kind is one task: a range of the kind's prefix, in pages, at one revision (only
//! once the relay's `listed` key for the kind is there at that revision), then a watch
//! of the prefix from the next revision. The events are the same as an API server watch's
//! ([`Update`]), so [`KubeSource`](crate::source::kube::KubeSource) applies them, relists
//! included, as it does the API server's. A watch that breaks resumes from the last
//! revision it had; one whose revision was compacted away, or a store that is another
//! etcd cluster than the one listed (a relay's etcd started afresh), lists again. A record
//! that cannot be read is an error for its kind, which keeps its last good state and
//! lists again after a backoff: a bad record never drops an object from enforcement.

pub mod record;
pub mod store;

use std::time::Duration;

use etcd_client::{EventType, GetOptions, KvClient, WatchClient, WatchOptions};
use futures::stream::BoxStream;
use futures::StreamExt;
use kube::runtime::watcher;
use tokio::sync::mpsc;
use weir_policy::model::Kind;

use crate::source::kinds::label;
use weir_policy::model::Object;

/// One kind's event from the relay's store, as an API server watch gives it.
pub type Update = (Kind, Result<watcher::Event<Object>, ReadError>);

/// Why reading the relay's store failed.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("the relay's store: {0}")]
    Etcd(#[from] etcd_client::Error),
    #[error(transparent)]
    Record(#[from] record::RecordError),
    #[error("the relay has not written a complete list of {0} yet (no {1})")]
    NotListed(&'static str, String),
    #[error("the relay's store answered without a header")]
    NoHeader,
    #[error("the relay's store is another etcd cluster ({now:x}, was {was:x}): listing again")]
    OtherCluster { was: u64, now: u64 },
    #[error("the relay's store compacted the watch's revision away (to {0}): listing again")]
    Compacted(i64),
    #[error("the relay's store ended the watch: {0}")]
    Ended(String),
}

/// Every kind's events from the relay's store, one stream per kind, ranges of `page_size`
/// records.
pub fn streams(store: etcd_client::Client, page_size: u32) -> Vec<BoxStream<'static, Update>> {
    record::ALL
        .map(|kind| kind_stream(store.clone(), kind, page_size))
        .into()
}

/// Ends the task when the stream is dropped.
struct Task<T> {
    events: mpsc::Receiver<T>,
    task: tokio::task::JoinHandle<()>,
}

impl<T> Drop for Task<T> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn kind_stream(
    store: etcd_client::Client,
    kind: Kind,
    page_size: u32,
) -> BoxStream<'static, Update> {
    // Bounded: a slow engine holds the reader back rather than letting it queue a cluster.
    let (tx, rx) = mpsc::channel(1024);
    let task = tokio::spawn(read_kind(store, kind, page_size.max(1) as i64, tx));
    futures::stream::unfold(Task { events: rx, task }, move |mut t| async move {
        let e = t.events.recv().await?;
        Some(((kind, e), t))
    })
    .boxed()
}

type Sender = mpsc::Sender<Result<watcher::Event<Object>, ReadError>>;

const BACKOFF_FIRST: Duration = Duration::from_millis(500);
const BACKOFF_MOST: Duration = Duration::from_secs(30);

/// Lists and watches `kind` until the stream is dropped.
async fn read_kind(store: etcd_client::Client, kind: Kind, page_size: i64, tx: Sender) {
    let mut kv = store.kv_client();
    let mut watches = store.watch_client();
    let mut backoff = BACKOFF_FIRST;
    loop {
        let listed = list(&mut kv, kind, page_size, &tx).await;
        let (revision, cluster) = match listed {
            Ok(at) => at,
            Err(e) => {
                if tx.send(Err(e)).await.is_err() {
                    return;
                }
                tokio::time::sleep(jitter(backoff)).await;
                backoff = (backoff * 2).min(BACKOFF_MOST);
                continue;
            }
        };
        backoff = BACKOFF_FIRST;
        let e = watch(&mut watches, kind, revision + 1, cluster, &tx).await;
        if tx.send(Err(e)).await.is_err() {
            return;
        }
        tokio::time::sleep(jitter(BACKOFF_FIRST)).await;
    }
}

/// Up to half as long again, so that agents cut off together do not come back together.
fn jitter(d: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.subsec_nanos())
        .unwrap_or(0);
    d + d.mul_f64(f64::from(nanos % 1000) / 2000.0)
}

/// One complete list of `kind` at one revision, sent as `Init`, `InitApply`..., `InitDone`,
/// each page's records as they are read (a list that fails half-way is ended by the next
/// one's `Init`, as an API server watch's is); returns the revision and the store's
/// cluster.
async fn list(
    kv: &mut KvClient,
    kind: Kind,
    page_size: i64,
    tx: &Sender,
) -> Result<(i64, u64), ReadError> {
    let marker = record::listed_key(kind);
    let first = kv.get(marker.as_str(), None).await?;
    let header = first.header().ok_or(ReadError::NoHeader)?;
    let (revision, cluster) = (header.revision(), header.cluster_id());
    if first.kvs().is_empty() {
        return Err(ReadError::NotListed(label(kind), marker));
    }
    // A dropped stream: nothing reads any more, and the task is ending.
    let dropped = |_| ReadError::Ended("the source was dropped".into());
    tx.send(Ok(watcher::Event::Init)).await.map_err(dropped)?;
    let mut pages = Pages::new(kind, Some(revision), page_size);
    while let Some(page) = pages.next(kv).await? {
        for r in page {
            let object = record::decode(kind, r.key(), r.value())?;
            tx.send(Ok(watcher::Event::InitApply(object)))
                .await
                .map_err(dropped)?;
        }
    }
    tx.send(Ok(watcher::Event::InitDone))
        .await
        .map_err(dropped)?;
    Ok((revision, cluster))
}

/// Every record of a kind, read a range of `page_size` at a time, all at one revision.
pub(crate) struct Pages {
    from: Option<Vec<u8>>,
    end: Vec<u8>,
    revision: Option<i64>,
    page_size: i64,
    /// The revision and cluster of the store the first page was read from.
    pub read_at: Option<(i64, u64)>,
}

impl Pages {
    /// From `revision`, or the newest.
    pub(crate) fn new(kind: Kind, revision: Option<i64>, page_size: i64) -> Self {
        let prefix = record::kind_prefix(kind);
        Pages {
            end: prefix_end(&prefix),
            from: Some(prefix.into_bytes()),
            revision,
            page_size,
            read_at: None,
        }
    }

    /// The next page, or None after the last.
    pub(crate) async fn next(
        &mut self,
        kv: &mut KvClient,
    ) -> Result<Option<Vec<etcd_client::KeyValue>>, ReadError> {
        let Some(from) = self.from.take() else {
            return Ok(None);
        };
        let mut options = GetOptions::new()
            .with_range(self.end.clone())
            .with_limit(self.page_size);
        if let Some(r) = self.revision {
            options = options.with_revision(r);
        }
        let mut page = match kv.get(from.clone(), Some(options)).await {
            Ok(page) => page,
            // A page larger than the client takes in one message (4 MiB: policies can be
            // large): the same page again, half as many records, down to one (which
            // etcd's own request limit keeps smaller).
            Err(etcd_client::Error::GRpcStatus(s))
                if s.code() == tonic::Code::OutOfRange && self.page_size > 1 =>
            {
                self.page_size /= 2;
                self.from = Some(from);
                return Box::pin(self.next(kv)).await;
            }
            Err(e) => return Err(e.into()),
        };
        let header = page.header().ok_or(ReadError::NoHeader)?;
        let at = (header.revision(), header.cluster_id());
        self.read_at.get_or_insert(at);
        // Every later page at the first one's revision: one snapshot.
        self.revision = Some(at.0);
        let more = page.more();
        let records = page.take_kvs();
        if more {
            if let Some(last) = records.last() {
                let mut next = last.key().to_vec();
                next.push(0);
                self.from = Some(next);
            }
        }
        Ok(Some(records))
    }
}

/// The smallest key after every key that starts with `prefix`.
pub(crate) fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    // The prefixes end in '/', never 0xff.
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    end
}

/// Watches `kind` from `revision` until the watch cannot go on; returns why. A watch that
/// breaks (the store restarting, a network cut) resumes from the last revision it had
/// events of, in the same cluster.
async fn watch(
    watches: &mut WatchClient,
    kind: Kind,
    mut revision: i64,
    cluster: u64,
    tx: &Sender,
) -> ReadError {
    let prefix = record::kind_prefix(kind);
    let mut backoff = BACKOFF_FIRST;
    loop {
        // Fragments: a revision's events larger than etcd's request limit come in several
        // responses, each within the client's 4 MiB.
        let options = WatchOptions::new()
            .with_range(prefix_end(&prefix))
            .with_start_revision(revision)
            .with_progress_notify()
            .with_fragment();
        let error = match watches.watch(prefix.as_str(), Some(options)).await {
            Ok(mut stream) => loop {
                let response = match stream.message().await {
                    Ok(Some(r)) => r,
                    Ok(None) => break ReadError::Ended("closed by the store".into()),
                    Err(e) => break ReadError::Etcd(e),
                };
                if let Some(h) = response.header() {
                    if h.cluster_id() != cluster {
                        return ReadError::OtherCluster {
                            was: cluster,
                            now: h.cluster_id(),
                        };
                    }
                }
                if response.compact_revision() > 0 {
                    return ReadError::Compacted(response.compact_revision());
                }
                if response.canceled() {
                    return ReadError::Ended(response.cancel_reason().to_owned());
                }
                backoff = BACKOFF_FIRST;
                for event in response.events() {
                    let Some(kv) = event.kv() else { continue };
                    let sent = match event.event_type() {
                        EventType::Put => match record::decode(kind, kv.key(), kv.value()) {
                            Ok(o) => watcher::Event::Apply(o),
                            Err(e) => return e.into(),
                        },
                        EventType::Delete => match record::parse_key(kind, kv.key()) {
                            Ok(r) => watcher::Event::Delete(record::named(&r)),
                            Err(e) => return e.into(),
                        },
                    };
                    // Resumed from this revision, not the next: the rest of its events
                    // may be in a later fragment. Its events again are harmless (the
                    // same object, the same delete).
                    revision = kv.mod_revision();
                    if tx.send(Ok(sent)).await.is_err() {
                        return ReadError::Ended("the source was dropped".into());
                    }
                }
            },
            Err(e) => ReadError::Etcd(e),
        };
        // Said, then retried from where it was.
        if tx.send(Err(error)).await.is_err() {
            return ReadError::Ended("the source was dropped".into());
        }
        tokio::time::sleep(jitter(backoff)).await;
        backoff = (backoff * 2).min(BACKOFF_MOST);
    }
}
