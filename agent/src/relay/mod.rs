//! `weir relay`: one process per cluster that watches every kind weir reads from the API
//! server and writes what enforcement reads of each object into an etcd of its own
//! ([`record`]), from which the agents read (`weir agent --relay`). The API server then
//! serves one watch per kind instead of one per node; its restart costs the relay's
//! relist, not every agent's (the agents' watches are on the relay's etcd, whose revisions
//! do not change); and each agent receives only what weir reads of each object.
//!
//! The relay keeps a hash of each record it holds (read back from the store at its start)
//! and writes only records that changed: a relist after the relay's or the API server's
//! restart, nearly all unchanged, writes (and sends every agent) only the difference.
//! Every update of an object is written, even one that changes nothing weir reads but its
//! resourceVersion: an agent's state digest names the API server's versions, which is how
//! `weir status` and the lab tell that an agent has a given write. A complete list
//! of a kind deletes the records of objects no longer listed, then marks the kind listed
//! (`/weir/v1/listed/<kind>`): agents wait for that mark. Writes go in transactions of
//! up to [`TXN_OPS`] operations; a write that keeps failing, or a store that turns out to
//! be another etcd cluster, ends the process (its Deployment starts it again, which lists
//! everything afresh), so it never serves a store it no longer knows.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use anyhow::Context;
use etcd_client::{KvClient, Txn, TxnOp};
use futures::{FutureExt, StreamExt};
use kube::runtime::watcher;
use weir_policy::model::{Kind, Object};

use crate::source::kube::{api_streams, label, not_served, Lists, PodEncoding, WatchError};
use crate::source::relay::store::{connect, StoreTls};
use crate::source::relay::{record, Pages};

/// etcd's default `--max-txn-ops`.
const TXN_OPS: usize = 128;
/// Bytes of records in one transaction at most: under etcd's default `--max-request-bytes`
/// (1.5 MiB) with room for the keys. A record larger than this goes alone.
const TXN_BYTES: usize = 1024 * 1024;
/// Updates taken into one round of writes at most.
const MAX_ROUND: usize = 5000;
const WRITE_ATTEMPTS: u32 = 5;

/// Run the relay: watch the API server, write the records agents read.
#[derive(clap::Args)]
pub struct RelayArgs {
    /// The relay's etcd: its client endpoints, comma-separated (http://host:port, or
    /// https:// with --relay-ca, --relay-cert and --relay-key).
    #[arg(long, env = "WEIR_RELAY_STORE", value_delimiter = ',', required = true)]
    pub store: Vec<String>,
    #[command(flatten)]
    pub tls: StoreTls,
    /// Objects per list request to the API server (as `weir agent --list-page-size`).
    #[arg(long, env = "WEIR_LIST_PAGE_SIZE", default_value_t = 5000,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub list_page_size: u32,
    /// How each kind's whole state is read from the API server (as `weir agent --lists`).
    #[arg(long, env = "WEIR_LISTS", value_enum, default_value_t = Lists::Pages)]
    pub lists: Lists,
    /// The encoding Pods are asked for in (as `weir agent --pod-encoding`).
    #[arg(long, env = "WEIR_POD_ENCODING", value_enum, default_value_t = PodEncoding::Protobuf)]
    pub pod_encoding: PodEncoding,
    /// Log filter (tracing's EnvFilter syntax).
    #[arg(long, env = "WEIR_LOG_LEVEL", default_value = "info")]
    pub log_level: String,
}

pub fn main(args: RelayArgs) -> anyhow::Result<()> {
    crate::daemon::init_logging(&args.log_level, crate::daemon::LogFormat::Json)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("start the async runtime")?;
    runtime.block_on(run(args))
}

async fn run(args: RelayArgs) -> anyhow::Result<()> {
    let store = connect(&args.store, &args.tls).await?;
    // Its etcd may start after it (two containers of one Pod): retried until it answers.
    let mut backoff = Duration::from_millis(250);
    let mut writer = loop {
        match Writer::load(store.kv_client()).await {
            Ok(w) => break w,
            Err(e) => {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "reading the store failed; retrying"
                );
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
    };
    tracing::info!(records = writer.held.len(), "read the store");
    let client = kube::Client::try_default()
        .await
        .context("connect to the Kubernetes API (in-cluster config or KUBECONFIG)")?;
    let mut streams = api_streams(client, args.list_page_size, args.lists, args.pod_encoding);
    let mut round = Vec::new();
    loop {
        let first = streams
            .next()
            .await
            .context("the API server's watches ended")?;
        round.push(first);
        while round.len() < MAX_ROUND {
            match streams.next().now_or_never() {
                Some(Some(update)) => round.push(update),
                _ => break,
            }
        }
        for (kind, update) in round.drain(..) {
            writer.take(kind, update)?;
        }
        writer.flush().await?;
    }
}

/// What the store holds, and the writes that bring it to the API server's state.
struct Writer {
    kv: KvClient,
    /// Each record's key and the hash of the record.
    held: BTreeMap<String, u64>,
    cluster: u64,
    /// Keys of a list in progress, by kind.
    listing: HashMap<Kind, BTreeSet<String>>,
    /// Kinds whose `listed` mark is in the store.
    marked: BTreeSet<Kind>,
    /// The writes taken, each with its record's size.
    ops: Vec<(TxnOp, usize)>,
    /// Whether a change was taken since the last flush (for the log).
    changed: usize,
    since: Option<Instant>,
}

/// `ops` in order, in transactions of at most [`TXN_OPS`] operations and (but for a record
/// larger on its own) [`TXN_BYTES`].
fn transactions(ops: Vec<(TxnOp, usize)>) -> Vec<Vec<TxnOp>> {
    let mut all = Vec::new();
    let (mut txn, mut bytes) = (Vec::new(), 0);
    for (op, size) in ops {
        if !txn.is_empty() && (txn.len() == TXN_OPS || bytes + size > TXN_BYTES) {
            all.push(std::mem::take(&mut txn));
            bytes = 0;
        }
        txn.push(op);
        bytes += size;
    }
    if !txn.is_empty() {
        all.push(txn);
    }
    all
}

/// The hash of a record as stored.
fn record_hash(record: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    record.hash(&mut h);
    h.finish()
}

impl Writer {
    /// Reads every record the store holds.
    async fn load(mut kv: KvClient) -> anyhow::Result<Writer> {
        let mut held = BTreeMap::new();
        let mut marked = BTreeSet::new();
        let mut cluster = 0;
        for kind in record::ALL {
            let mut pages = Pages::new(kind, None, 5000);
            while let Some(page) = pages
                .next(&mut kv)
                .await
                .with_context(|| format!("reading the store's {}", label(kind)))?
            {
                for r in page {
                    held.insert(
                        String::from_utf8_lossy(r.key()).into_owned(),
                        record_hash(r.value()),
                    );
                }
            }
            cluster = pages.read_at.map_or(cluster, |(_, c)| c);
            let mark = kv
                .get(record::listed_key(kind), None)
                .await
                .context("reading the store's marks")?;
            if !mark.kvs().is_empty() {
                marked.insert(kind);
            }
        }
        Ok(Writer {
            kv,
            held,
            cluster,
            listing: HashMap::new(),
            marked,
            ops: Vec::new(),
            changed: 0,
            since: None,
        })
    }

    fn put(&mut self, object: Object) -> anyhow::Result<()> {
        let key = record::key(&object.key());
        if let Some(listing) = self.listing.get_mut(&object.kind()) {
            listing.insert(key.clone());
        }
        let value = record::encode(object)?;
        let hash = record_hash(&value);
        if self.held.get(&key) == Some(&hash) {
            return Ok(());
        }
        self.held.insert(key.clone(), hash);
        let size = key.len() + value.len();
        self.ops.push((TxnOp::put(key, value, None), size));
        self.changed += 1;
        Ok(())
    }

    fn delete(&mut self, key: String) {
        if self.held.remove(&key).is_some() {
            let size = key.len();
            self.ops.push((TxnOp::delete(key, None), size));
            self.changed += 1;
        }
    }

    /// One update of `kind` from the API server.
    fn take(
        &mut self,
        kind: Kind,
        update: Result<watcher::Event<Object>, WatchError>,
    ) -> anyhow::Result<()> {
        self.since.get_or_insert_with(Instant::now);
        match update {
            Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => self.put(o)?,
            Ok(watcher::Event::Delete(o)) => self.delete(record::key(&o.key())),
            Ok(watcher::Event::Init) => {
                tracing::info!(kind = kind.name(), "listing");
                self.listing.insert(kind, BTreeSet::new());
            }
            Ok(watcher::Event::InitDone) => {
                let listed = self.listing.remove(&kind).unwrap_or_default();
                tracing::info!(kind = kind.name(), objects = listed.len(), "listed");
                self.listed(kind, listed);
            }
            Err(WatchError::Kube(e)) if kind == Kind::ClusterNetworkPolicy && not_served(&e) => {
                // No CRD: no ClusterNetworkPolicies, a complete (empty) list of them.
                self.listed(kind, BTreeSet::new());
            }
            Err(e) => {
                tracing::warn!(kind = kind.name(), error = %e, "watch failed; retrying with backoff")
            }
        }
        Ok(())
    }

    /// A complete list of `kind`, whose records are `listed`: the others are deleted.
    fn listed(&mut self, kind: Kind, listed: BTreeSet<String>) {
        let prefix = record::kind_prefix(kind);
        let gone: Vec<String> = self
            .held
            .range(prefix.clone()..)
            .take_while(|(k, _)| k.starts_with(&prefix))
            .filter(|(k, _)| !listed.contains(*k))
            .map(|(k, _)| k.clone())
            .collect();
        for key in gone {
            self.delete(key);
        }
        if !self.marked.contains(&kind) {
            // After the list's records and deletes, in the same or a later
            // transaction: an agent that sees the mark sees the whole list.
            let key = record::listed_key(kind);
            let size = key.len();
            self.ops.push((TxnOp::put(key, "", None), size));
            self.marked.insert(kind);
        }
    }

    /// Writes what was taken, in order ([`transactions`]).
    async fn flush(&mut self) -> anyhow::Result<()> {
        let ops = std::mem::take(&mut self.ops);
        for chunk in transactions(ops) {
            let mut attempt = 0;
            loop {
                attempt += 1;
                match self.kv.txn(Txn::new().and_then(chunk.clone())).await {
                    Ok(r) => {
                        let now = r.header().map(|h| h.cluster_id()).unwrap_or(self.cluster);
                        if self.cluster != 0 && now != self.cluster {
                            anyhow::bail!("the store is another etcd cluster ({now:x}, was {:x}): its records are not the ones this relay read; starting again", self.cluster);
                        }
                        self.cluster = now;
                        break;
                    }
                    Err(e) if attempt < WRITE_ATTEMPTS => {
                        tracing::warn!(error = %e, attempt, "writing to the store failed; retrying");
                        tokio::time::sleep(Duration::from_millis(200) * 2u32.pow(attempt)).await;
                    }
                    Err(e) => {
                        return Err(e).context(format!(
                            "writing to the store failed {WRITE_ATTEMPTS} times; starting again"
                        ))
                    }
                }
            }
        }
        if self.changed > 0 {
            tracing::debug!(
                records = self.changed,
                ms = self.since.map(|s| s.elapsed().as_millis() as u64),
                "wrote"
            );
        }
        self.changed = 0;
        self.since = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Transactions keep the writes' order and stay within etcd's limits, a record larger
    /// than the byte bound alone in its own.
    #[test]
    fn transactions_stay_within_etcd_limits() {
        let op = |n: usize| (TxnOp::delete(format!("k{n}"), None), n);
        let sizes = [10, 20, TXN_BYTES - 25, 30, TXN_BYTES + 5, 1];
        let txns = transactions(sizes.iter().map(|&n| op(n)).collect());
        let lens: Vec<usize> = txns.iter().map(Vec::len).collect();
        assert_eq!(lens, [2, 1, 1, 1, 1]);
        let many = transactions((0..300).map(|_| op(1)).collect());
        let lens: Vec<usize> = many.iter().map(Vec::len).collect();
        assert_eq!(lens, [TXN_OPS, TXN_OPS, 300 - 2 * TXN_OPS]);
    }
}
