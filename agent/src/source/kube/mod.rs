//! The cluster source: watchers on Pods (ours, [`pod_watcher`], in protobuf), and
//! kube-rs's on Namespaces, NetworkPolicies, Services (all of them: peers resolve from
//! every pod), Nodes (this node's label picks the dataplane; every node's addresses are a
//! ClusterNetworkPolicy `nodes` peer's) and ClusterNetworkPolicies.
//!
//! ClusterNetworkPolicy is a custom resource: where its CRD is not installed, its list
//! fails with 404, which counts as listing none (once logged; the watcher keeps retrying
//! with backoff, so a CRD installed later is picked up without a restart). It is watched at
//! v1beta1 (network-policy-api v0.3.0's storage version) where that is served, else at
//! v1alpha2 (all v0.2.0 serves); both have the same schema.
//!
//! The first batch is the complete initial state of all six kinds. A relist (after a
//! 410 Gone, an API server restart or a watch that could not resume) is buffered until
//! it is complete and then applied as one batch, with deletes for objects that vanished
//! meanwhile, so the dataplane never sees a half-listed cluster; of the objects it lists
//! at the resourceVersion the agent has, only the keys are kept, and only what changed
//! is passed on. Watch errors are retried with backoff and logged; they never end the
//! source.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use futures::stream::{BoxStream, SelectAll};
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::runtime::watcher::{self, watcher};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use weir_policy::cluster_policy::{ClusterNetworkPolicy, ClusterNetworkPolicyV1beta1};

use crate::source::digest::StateDigest;
use crate::source::event::{Batch, Event, EventSource, SourceError, SyncProgress};
pub use crate::source::kinds::{label, KINDS};
use weir_policy::model::{Kind, Object, ObjectRef};

mod pod_proto;
mod pod_watcher;
pub use pod_watcher::PodEncoding;

/// Events drained into one batch at most, so a flood still reaches the dataplane.
const MAX_BATCH: usize = 5000;

/// An error with its chain of causes (`client error (Connect): tcp connect error: ...`).
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let next = c.to_string();
        if !text.ends_with(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        cause = c.source();
    }
    text
}

/// An object as it arrived from a watch, converted at once ([`Event::upsert`]), so that
/// neither a relist's buffer nor a batch holds a whole Kubernetes object.
struct Arrival {
    key: ObjectRef,
    /// The object's entry in the state digest, at its resourceVersion.
    entry: u64,
    event: Event,
}

impl Arrival {
    fn upsert(object: Object) -> Self {
        let key = object.key();
        let entry = digest_entry(&key, &object);
        Arrival {
            key,
            entry,
            event: Event::upsert(object),
        }
    }

    fn delete(object: Object) -> Self {
        let key = object.key();
        Arrival {
            entry: digest_entry(&key, &object),
            event: Event::Delete(key.clone()),
            key,
        }
    }
}

/// One kind's watch event, from the API server or from the relay's store.
pub type Update = (Kind, Result<watcher::Event<Object>, WatchError>);

/// Why a kind's watch failed (it is retried with backoff).
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error(transparent)]
    Kube(#[from] watcher::Error),
    #[error(transparent)]
    Relay(#[from] crate::source::relay::ReadError),
}

/// A list in progress. An object listed at the resourceVersion the agent already has is
/// that object (every write moves it), so only its key is kept: a relist after a 410 or an
/// API server restart, nearly all unchanged, does not hold a second copy of the cluster
/// while the first is enforced, and hands the engine only what changed.
#[derive(Default)]
struct Relist {
    changed: Vec<Arrival>,
    unchanged: Vec<(ObjectRef, u64)>,
}

fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
    kind: Kind,
    wrap: fn(K) -> Object,
) -> BoxStream<'static, Update>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    K::DynamicType: Default,
{
    watcher(api, config)
        .default_backoff()
        .map(move |r| {
            (
                kind,
                r.map(|e| map_event(e, wrap)).map_err(WatchError::from),
            )
        })
        .boxed()
}

/// ClusterNetworkPolicies at v1beta1, or at v1alpha2 while v1beta1 is not served (a 404
/// from one version switches to the other); a 404 from both is passed on, as the CRD's
/// absence, and the next attempt starts again at v1beta1.
fn cluster_policies(client: Client, config: watcher::Config) -> BoxStream<'static, Update> {
    let versions = [
        watch(
            Api::<ClusterNetworkPolicyV1beta1>::all(client.clone()),
            config.clone(),
            Kind::ClusterNetworkPolicy,
            |p| Object::ClusterNetworkPolicy(p.0),
        ),
        watch(
            Api::<ClusterNetworkPolicy>::all(client),
            config,
            Kind::ClusterNetworkPolicy,
            Object::ClusterNetworkPolicy,
        ),
    ];
    const NAMES: [&str; 2] = ["v1beta1", "v1alpha2"];
    futures::stream::unfold((versions, 0), |(mut versions, mut active)| async move {
        loop {
            let update = versions[active].next().await?;
            match &update.1 {
                Err(WatchError::Kube(e)) if not_served(e) => {
                    active = (active + 1) % versions.len();
                    if active != 0 {
                        continue;
                    }
                }
                Ok(watcher::Event::InitDone) => {
                    tracing::info!(version = NAMES[active], "listed ClusterNetworkPolicies")
                }
                _ => {}
            }
            return Some((update, (versions, active)));
        }
    })
    .boxed()
}

/// `e` with its object converted by `f`.
pub(crate) fn map_event<K, T>(e: watcher::Event<K>, f: impl FnOnce(K) -> T) -> watcher::Event<T> {
    match e {
        watcher::Event::Apply(k) => watcher::Event::Apply(f(k)),
        watcher::Event::Delete(k) => watcher::Event::Delete(f(k)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(k) => watcher::Event::InitApply(f(k)),
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

/// `e` converted as it arrives ([`Arrival`]).
fn arrive(e: watcher::Event<Object>) -> watcher::Event<Arrival> {
    match e {
        watcher::Event::Delete(o) => watcher::Event::Delete(Arrival::delete(o)),
        e => map_event(e, Arrival::upsert),
    }
}

/// How the source reads a kind's whole state, at the start and on a relist
/// (`weir agent --lists`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Lists {
    /// LIST requests of `--list-page-size` objects each, then a watch from their version.
    #[default]
    Pages,
    /// One watch that first sends every object, then a bookmark (the API server's
    /// WatchList, `sendInitialEvents`; beta and on by default from Kubernetes 1.32): the
    /// server streams them from its watch cache, one event at a time, instead of building
    /// whole pages.
    Stream,
}

pub struct KubeSource {
    streams: SelectAll<BoxStream<'static, Update>>,
    /// Every object handed out and not deleted since, by kind (for relist deletes), with
    /// its entry in `digest`.
    known: BTreeMap<Kind, BTreeMap<ObjectRef, u64>>,
    /// Of every object in `known`, at its resourceVersion.
    digest: StateDigest,
    /// Objects of a relist in progress, by kind.
    relisting: BTreeMap<Kind, Relist>,
    synced: BTreeSet<Kind>,
    first_sent: bool,
    pending: Vec<Event>,
    /// When the oldest of `pending` arrived.
    pending_since: Option<std::time::Instant>,
    progress: Option<Arc<SyncProgress>>,
    /// The ClusterNetworkPolicy CRD was found missing (said once, until it appears).
    cluster_policies_absent: bool,
}

/// The API server's watches of every kind weir reads, with lists of `page_size` objects a
/// request or (`lists` [`Lists::Stream`]) streamed; Pods in `pod_encoding`. The agent reads
/// them (cluster mode without a relay), and so does `weir relay`.
pub fn api_streams(
    client: Client,
    page_size: u32,
    lists: Lists,
    pod_encoding: PodEncoding,
) -> SelectAll<BoxStream<'static, Update>> {
    let all = match lists {
        Lists::Pages => watcher::Config::default().page_size(page_size),
        Lists::Stream => watcher::Config::default().streaming_lists(),
    };
    futures::stream::select_all([
        watch(
            Api::<Namespace>::all(client.clone()),
            all.clone(),
            Kind::Namespace,
            Object::Namespace,
        ),
        watch(
            Api::<Node>::all(client.clone()),
            all.clone(),
            Kind::Node,
            Object::Node,
        ),
        cluster_policies(client.clone(), all.clone()),
        // Pods are the many: asked for in protobuf, decoded lean, without the fields
        // enforcement never reads.
        pod_watcher::pod_watcher(client.clone(), lists, page_size, pod_encoding)
            .default_backoff()
            .map(|r| {
                (
                    Kind::Pod,
                    r.map(|e| map_event(e, Object::Pod))
                        .map_err(WatchError::from),
                )
            })
            .boxed(),
        watch(
            Api::<NetworkPolicy>::all(client.clone()),
            all.clone(),
            Kind::NetworkPolicy,
            Object::NetworkPolicy,
        ),
        // Frontends only: traffic to a Service address is judged after DNAT.
        watch(
            Api::<Service>::all(client),
            all,
            Kind::Service,
            Object::Service,
        ),
    ])
}

/// Whether `e` is a list or watch of a resource the API server does not serve (404): its
/// CRD is not installed, or was deleted while watched.
pub(crate) fn not_served(e: &watcher::Error) -> bool {
    matches!(
        e,
        watcher::Error::InitialListFailed(kube::Error::Api(s))
            | watcher::Error::WatchStartFailed(kube::Error::Api(s)) if s.code == 404
    )
}

impl KubeSource {
    /// Watches with lists of `page_size` objects a request, or (`lists` [`Lists::Stream`])
    /// with the API server's streaming lists; Pods in `pod_encoding`.
    pub fn new(client: Client, page_size: u32, lists: Lists, pod_encoding: PodEncoding) -> Self {
        Self::from_streams(api_streams(client, page_size, lists, pod_encoding))
    }

    /// Reads every kind from the relay's store (`weir relay`) instead of the API server,
    /// in ranges of `page_size` records.
    pub fn from_relay(store: etcd_client::Client, page_size: u32) -> Self {
        let streams = crate::source::relay::streams(store, page_size)
            .into_iter()
            .map(|s| {
                s.map(|(kind, r)| (kind, r.map_err(WatchError::from)))
                    .boxed()
            });
        Self::from_streams(futures::stream::select_all(streams))
    }

    fn from_streams(streams: SelectAll<BoxStream<'static, Update>>) -> Self {
        KubeSource {
            streams,
            known: BTreeMap::new(),
            digest: StateDigest::default(),
            relisting: BTreeMap::new(),
            synced: BTreeSet::new(),
            first_sent: false,
            pending: Vec::new(),
            pending_since: None,
            progress: None,
            cluster_policies_absent: false,
        }
    }

    /// Reports each kind's first complete list, and watch errors, into `progress`.
    pub fn with_progress(mut self, progress: Arc<SyncProgress>) -> Self {
        self.progress = Some(progress);
        self
    }

    fn process(&mut self, (kind, update): Update) {
        let event = match update {
            Ok(e) => arrive(e),
            // No CRD: there are none, and the tiers stay empty.
            Err(WatchError::Kube(e)) if kind == Kind::ClusterNetworkPolicy && not_served(&e) => {
                if !self.cluster_policies_absent {
                    tracing::warn!(
                        "the ClusterNetworkPolicy CRD (clusternetworkpolicies.policy.networking.k8s.io, v1beta1 or v1alpha2) is not installed: no Admin or Baseline tier is enforced; it is picked up once installed (deploy/crds/)"
                    );
                    self.cluster_policies_absent = true;
                }
                self.listed(kind, Relist::default());
                return;
            }
            Err(e) => {
                tracing::warn!(kind = kind.name(), error = %e, "watch failed; retrying with backoff");
                if let Some(p) = &self.progress {
                    p.error(format!("{}: {}", label(kind), with_causes(&e)));
                }
                return;
            }
        };
        let known = self.known.entry(kind).or_default();
        let digest = &mut self.digest;
        match event {
            watcher::Event::Apply(a) => {
                if let Some(old) = known.insert(a.key, a.entry) {
                    digest.toggle(old);
                }
                digest.toggle(a.entry);
                self.pending.push(a.event);
            }
            watcher::Event::Delete(a) => {
                if let Some(old) = known.remove(&a.key) {
                    digest.toggle(old);
                }
                self.pending.push(a.event);
            }
            watcher::Event::Init => {
                tracing::info!(kind = kind.name(), "listing");
                self.relisting.insert(kind, Relist::default());
            }
            watcher::Event::InitApply(a) => {
                // The entry hashes key and resourceVersion: equal entries, the same object.
                let unchanged = known.get(&a.key) == Some(&a.entry);
                let relist = self.relisting.entry(kind).or_default();
                if unchanged {
                    relist.unchanged.push((a.key, a.entry));
                } else {
                    relist.changed.push(a);
                }
            }
            watcher::Event::InitDone => {
                let listed = self.relisting.remove(&kind).unwrap_or_default();
                if kind == Kind::ClusterNetworkPolicy && self.cluster_policies_absent {
                    tracing::info!("the ClusterNetworkPolicy CRD is installed now");
                    self.cluster_policies_absent = false;
                }
                self.listed(kind, listed);
            }
        }
    }

    /// A complete list of `kind`: what vanished since the last one is deleted, what changed
    /// is upserted.
    fn listed(&mut self, kind: Kind, listed: Relist) {
        let known = self.known.entry(kind).or_default();
        let digest = &mut self.digest;
        let objects = listed.changed.len() + listed.unchanged.len();
        let mut seen: BTreeMap<ObjectRef, u64> = listed.unchanged.into_iter().collect();
        let mut events = Vec::with_capacity(listed.changed.len());
        for a in listed.changed {
            seen.insert(a.key, a.entry);
            events.push(a.event);
        }
        for (gone, _) in known.iter().filter(|(k, _)| !seen.contains_key(*k)) {
            self.pending.push(Event::Delete(gone.clone()));
        }
        for old in known.values() {
            digest.toggle(*old);
        }
        for new in seen.values() {
            digest.toggle(*new);
        }
        *known = seen;
        // A missing CRD "lists" at every retry: said once, where it was found missing.
        let quiet = kind == Kind::ClusterNetworkPolicy && self.cluster_policies_absent;
        if !quiet {
            tracing::info!(
                kind = kind.name(),
                objects,
                changed = events.len(),
                "listed"
            );
        }
        self.pending.extend(events);
        self.synced.insert(kind);
        if let Some(p) = &self.progress {
            p.done(label(kind));
        }
    }

    fn ready(&self) -> bool {
        // Until every kind is listed once, the state is incomplete: a pod without its
        // policies would be enforced as unisolated.
        self.synced.len() == KINDS.len() && (!self.first_sent || !self.pending.is_empty())
    }
}

impl EventSource for KubeSource {
    async fn next(&mut self) -> Result<Batch, SourceError> {
        loop {
            let update = self.streams.next().await.ok_or(SourceError::Closed)?;
            self.pending_since
                .get_or_insert_with(std::time::Instant::now);
            self.process(update);
            while self.pending.len() < MAX_BATCH {
                match self.streams.next().now_or_never() {
                    Some(Some(update)) => self.process(update),
                    Some(None) => return Err(SourceError::Closed),
                    None => break,
                }
            }
            if self.ready() {
                self.first_sent = true;
                return Ok(Batch {
                    events: std::mem::take(&mut self.pending),
                    state_digest: Some(self.digest.to_string()),
                    received: self.pending_since.take(),
                    ..Default::default()
                });
            }
        }
    }
}

fn digest_entry(key: &ObjectRef, o: &Object) -> u64 {
    StateDigest::entry(key, o.metadata().resource_version.as_deref().unwrap_or(""))
}

/// The in-test API server, for the daemon's tests of this source.
#[cfg(test)]
pub(crate) mod mock_api;

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;

    fn pod(name: &str, version: &str) -> Object {
        let mut pod = Pod::default();
        pod.metadata.namespace = Some("x".into());
        pod.metadata.name = Some(name.into());
        pod.metadata.resource_version = Some(version.into());
        Object::Pod(pod)
    }

    fn list(source: &mut KubeSource, pods: Vec<Object>) -> Vec<String> {
        source.process((Kind::Pod, Ok(watcher::Event::Init)));
        for p in pods {
            source.process((Kind::Pod, Ok(watcher::Event::InitApply(p))));
        }
        source.process((Kind::Pod, Ok(watcher::Event::InitDone)));
        std::mem::take(&mut source.pending)
            .iter()
            .map(|e| match e {
                Event::Delete(key) => format!("-{}", key.name),
                other => format!("+{}", other.key().name),
            })
            .collect()
    }

    /// A relist hands on only what changed and what vanished, and ends in the state (and
    /// digest) a first list of the same objects gives.
    #[tokio::test]
    async fn a_relist_passes_on_only_what_changed() {
        let client =
            || Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap();
        let mut source = KubeSource::new(client(), 500, Lists::Pages, PodEncoding::Json);
        let first = list(
            &mut source,
            vec![pod("a", "1"), pod("b", "2"), pod("c", "3")],
        );
        assert_eq!(first, ["+a", "+b", "+c"]);
        let relisted = list(
            &mut source,
            vec![pod("a", "1"), pod("b", "7"), pod("d", "8")],
        );
        assert_eq!(relisted, ["-c", "+b", "+d"]);

        let mut fresh = KubeSource::new(client(), 500, Lists::Pages, PodEncoding::Json);
        list(
            &mut fresh,
            vec![pod("a", "1"), pod("b", "7"), pod("d", "8")],
        );
        assert_eq!(source.known, fresh.known);
        assert_eq!(source.digest.to_string(), fresh.digest.to_string());
        assert!(source.relisting.is_empty());
    }
}
