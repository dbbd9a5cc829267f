//! The run loop: source → engine → dataplane. Each batch of events goes through the
//! engine; the dataplane then applies the difference between the desired state before and
//! after the batch. A periodic resync repairs drift and retries pending cleanups.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::enforcer::{Backends, Enforcer, Outcome};
use super::known::KnownObjects;
use super::metrics::Metrics;
use super::report::{Converge, Enforced, MapPressure, NodeReport, ReportBoard};
use super::select::{choice_from_labels, DataplaneChoice};
use super::status::{Startup, Status};
use crate::dataplane::{CountsRead, DataplaneError, VerdictCounts};
use crate::source::event::{Batch, Event, EventSource, SourceError, SyncProgress};
use crate::verdicts::{PolicyNames, VerdictHub, VerdictRecord, VerdictTx};
use weir_policy::model::ObjectError;
use weir_policy::model::{Kind, ObjectRef};
use weir_policy::{Engine, Validated};

pub struct RunOptions {
    /// Used when this node carries no `weir.io/dataplane` label.
    pub default_choice: DataplaneChoice,
    /// This node's name; `None` in file mode with a single Node object (or none).
    pub node_name: Option<String>,
    pub status_file: Option<PathBuf>,
    pub resync: Duration,
    /// What one object may take of the node's tables (`--max-entries-per-policy`).
    pub budget: weir_policy::Budget,
}

/// Shared with the health server: readiness (and why not) and liveness (the run loop's
/// heartbeat).
pub struct Health {
    ready: AtomicBool,
    /// The source's first complete state; nothing is enforced or removed before it.
    sync: Arc<SyncProgress>,
    /// Why the dataplane has not converged yet, once the source is complete.
    not_converged: Mutex<Option<String>>,
    started: Instant,
    /// When the run loop last turned, in milliseconds since `started`.
    heartbeat_ms: AtomicU64,
    /// `/healthz` fails when the run loop has not turned for this long.
    stall_after: Duration,
}

/// How often the dataplane's verdict counters are read into the metrics.
const COUNTS_EVERY: Duration = Duration::from_secs(5);
/// Counter reads in a row that writes may overlap (and so have thrown away) before the
/// next one runs in the loop's own turn: under constant change the counts are at most
/// this many reads old.
const COUNT_READS_THROWN_AWAY_AT_MOST: u32 = 3;

/// The default liveness bound (`--liveness-seconds`).
pub const DEFAULT_STALL: Duration = Duration::from_secs(300);

impl Default for Health {
    fn default() -> Self {
        Health::new(Arc::new(SyncProgress::default()), DEFAULT_STALL)
    }
}

impl Health {
    pub fn new(sync: Arc<SyncProgress>, stall_after: Duration) -> Self {
        Health {
            ready: AtomicBool::new(false),
            sync,
            not_converged: Mutex::new(None),
            started: Instant::now(),
            heartbeat_ms: AtomicU64::new(0),
            stall_after,
        }
    }

    /// The source's progress towards its first complete state (sources report into it).
    pub fn sync(&self) -> &Arc<SyncProgress> {
        &self.sync
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// Ready from the first full convergence on, for good: a later failure shows in the
    /// status and metrics, while the pinned state keeps enforcing.
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Relaxed);
    }

    /// `Ok` when ready, else why not: the source still listing (with its last error), or
    /// the dataplane not converged (with its error).
    pub fn readiness(&self) -> Result<(), NotReady> {
        if self.is_ready() {
            return Ok(());
        }
        if let Some(reason) = self.sync.reason() {
            return Err(NotReady::Syncing(reason));
        }
        let converging = self
            .not_converged
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        Err(match converging {
            Some(e) => NotReady::Failed(e),
            None => NotReady::Converging,
        })
    }

    fn set_not_converged(&self, reason: Option<String>) {
        *self.not_converged.lock().unwrap_or_else(|e| e.into_inner()) = reason;
    }

    /// The run loop turned.
    pub fn beat(&self) {
        self.beat_at(Instant::now());
    }

    pub(crate) fn beat_at(&self, now: Instant) {
        let ms = now.saturating_duration_since(self.started).as_millis() as u64;
        self.heartbeat_ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// `Ok` while the run loop turned within the bound; else how long it has been stuck.
    pub fn liveness(&self) -> Result<(), Stalled> {
        self.liveness_at(Instant::now())
    }

    pub(crate) fn liveness_at(&self, now: Instant) -> Result<(), Stalled> {
        let last = self.started + Duration::from_millis(self.heartbeat_ms.load(Ordering::Relaxed));
        let since = now.saturating_duration_since(last);
        if since > self.stall_after {
            return Err(Stalled {
                since,
                bound: self.stall_after,
            });
        }
        Ok(())
    }
}

/// Why the agent is not ready (`/readyz`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotReady {
    /// The source has not delivered its first complete state (its progress, in words).
    #[error("{0}")]
    Syncing(String),
    /// The dataplane's last attempt failed (its error, as the status has it).
    #[error("the dataplane has not converged: {0}")]
    Failed(String),
    #[error("the dataplane has not converged yet")]
    Converging,
}

/// The run loop has not turned within the liveness bound (`/healthz`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the run loop has not turned for {:.0}s (bound {}s, --liveness-seconds): a dataplane \
     write or the source is stuck",
    since.as_secs_f64(),
    bound.as_secs()
)]
pub struct Stalled {
    pub since: Duration,
    pub bound: Duration,
}

/// Notified after each status change: cluster mode publishes the node annotation and
/// Events for the objects it refused.
pub trait Publisher: Send {
    fn publish(&mut self, status: &Status, refused: &BTreeMap<ObjectRef, String>);
}

pub struct Daemon<B: Backends> {
    opts: RunOptions,
    engine: Engine,
    backends: Option<B>,
    enforcer: Option<Enforcer<B>>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    publisher: Option<Box<dyn Publisher>>,
    generation: Option<u64>,
    state_digest: Option<String>,
    /// When the source received the last applied batch's first change (CLOCK_MONOTONIC ns).
    change_received_ns: Option<u64>,
    /// The node label's choice; `None` falls back to the default.
    node_choice: Option<DataplaneChoice>,
    node_choice_error: Option<ObjectError>,
    source_errors: Vec<ObjectError>,
    /// Objects the engine refused, with the reason.
    refused: BTreeMap<ObjectRef, String>,
    /// Policies refused for their namespace's budget: admitted again (in name order)
    /// when a policy of their namespace goes or changes, without waiting to be sent again.
    waiting: BTreeMap<ObjectRef, Validated>,
    /// Why the dataplane did not converge (start, apply or reconcile failed).
    dataplane_error: Option<String>,
    known: KnownObjects,
    last_status: Option<Status>,
    /// Where `GET /status` reads the node report (cluster and file mode with --listen).
    reports: Option<Arc<ReportBoard>>,
    last_converge: Option<Converge>,
    /// The first batch: when it arrived (from the agent's start) and how long its compile
    /// took; the first phases of [`Startup`].
    first_batch: Option<(Duration, Duration)>,
    startup: Option<Startup>,
    /// The last failure to read the verdict counters (logged once until it changes).
    counts_error: Option<String>,
    /// Counter reads thrown away in a row because a write overlapped them.
    count_reads_thrown_away: u32,
    /// The verdict stream: where named records go, and the dataplanes' sender.
    verdicts: Option<Verdicts>,
    /// What the dataplanes sent, until [`Daemon::run`] takes it to read.
    verdict_queue: Option<tokio::sync::mpsc::Receiver<VerdictRecord>>,
    /// Reads the node's own interface addresses, which `nodes` peers cover beside its
    /// Node's status ([`Engine::set_own_addresses`]); the last read's error, said once.
    own_addresses: Option<(OwnAddressReader, Option<String>)>,
}

/// What a read of the verdict counters gives.
type CountsResult = Result<VerdictCounts, DataplaneError>;

/// Reads this node's interface addresses ([`crate::dataplane::node_addresses::read`]).
pub type OwnAddressReader = Box<dyn FnMut() -> Result<BTreeSet<IpAddr>, String> + Send>;

struct Verdicts {
    hub: Arc<VerdictHub>,
    tx: Arc<VerdictTx>,
    names: PolicyNames,
}

impl<B: Backends> Daemon<B> {
    pub fn new(opts: RunOptions, backends: B, metrics: Arc<Metrics>, health: Arc<Health>) -> Self {
        let mut engine = Engine::new(opts.node_name.clone());
        engine.set_budget(opts.budget);
        Daemon {
            opts,
            engine,
            backends: Some(backends),
            enforcer: None,
            metrics,
            health,
            publisher: None,
            generation: None,
            state_digest: None,
            change_received_ns: None,
            node_choice: None,
            node_choice_error: None,
            source_errors: Vec::new(),
            refused: BTreeMap::new(),
            waiting: BTreeMap::new(),
            dataplane_error: None,
            known: KnownObjects::default(),
            last_status: None,
            reports: None,
            last_converge: None,
            first_batch: None,
            startup: None,
            counts_error: None,
            count_reads_thrown_away: 0,
            verdicts: None,
            verdict_queue: None,
            own_addresses: None,
        }
    }

    /// Gives `nodes` peers that select this node its interface addresses, read by
    /// `reader` at every batch and resync while a `nodes` peer exists.
    pub fn with_own_addresses(mut self, reader: OwnAddressReader) -> Self {
        self.own_addresses = Some((reader, None));
        self
    }

    /// Reads the node's own addresses again when a `nodes` peer may cover them; whether
    /// the desired state changed. A failed read keeps the last addresses and says why.
    fn refresh_own_addresses(&mut self) -> bool {
        let (Some(node), Some((read, last_error))) =
            (self.opts.node_name.as_deref(), self.own_addresses.as_mut())
        else {
            return false;
        };
        if !self.engine.has_node_peers() {
            return false;
        }
        match read() {
            Ok(addresses) => {
                *last_error = None;
                let changed = self.engine.set_own_addresses(node, addresses);
                if changed {
                    tracing::info!(
                        node,
                        "the node's own addresses changed; `nodes` peers follow"
                    );
                }
                changed
            }
            Err(e) => {
                if last_error.as_ref() != Some(&e) {
                    tracing::warn!(error = %e, "the node's own addresses not read; `nodes` peers keep the last ones");
                }
                *last_error = Some(e);
                false
            }
        }
    }

    /// Streams the dataplanes' verdicts to `hub`, each pod limited to `per_second` records
    /// (bursts of `burst`).
    pub fn with_verdicts(mut self, hub: Arc<VerdictHub>, per_second: u32, burst: u32) -> Self {
        let (tx, queue) = hub.channel(per_second, burst);
        self.verdicts = Some(Verdicts {
            hub,
            tx: Arc::new(tx),
            names: PolicyNames::default(),
        });
        self.verdict_queue = Some(queue);
        self
    }

    /// Names one record from the engine and publishes it.
    fn verdict(&mut self, mut record: VerdictRecord) {
        if let Some(v) = &mut self.verdicts {
            crate::verdicts::name(&mut record, &self.engine, &mut v.names);
            v.hub.publish(record);
        }
    }

    pub fn with_reports(mut self, board: Arc<ReportBoard>) -> Self {
        self.reports = Some(board);
        self
    }

    /// Notes a converge that left the dataplane without error.
    fn converged(&mut self, trigger: &str, started: Instant) {
        if self.enforcer.is_some() && self.dataplane_error.is_none() {
            self.last_converge = Some(Converge {
                finished_at: k8s_openapi::jiff::Timestamp::now().to_string(),
                duration_ms: started.elapsed().as_secs_f64() * 1000.0,
                trigger: trigger.to_string(),
            });
        }
    }

    pub fn with_publisher(mut self, p: Box<dyn Publisher>) -> Self {
        self.publisher = Some(p);
        self
    }

    /// Runs until the source fails or a shutdown signal arrives.
    pub async fn run<S: EventSource>(mut self, mut source: S) -> Result<(), SourceError> {
        let mut resync = tokio::time::interval(self.opts.resync);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        resync.tick().await;
        let mut counts = tokio::time::interval(COUNTS_EVERY);
        counts.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The heartbeat: /healthz fails when this loop stops turning (a handler stuck).
        let mut heartbeat = tokio::time::interval(Duration::from_secs(1));
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut terminate = tokio::signal::unix::signal(
            tokio::signal::unix::SignalKind::terminate(),
        )
        .map_err(|e| SourceError::Io {
            context: "install SIGTERM handler".into(),
            source: e,
        })?;
        let mut queue = self.verdict_queue.take();
        // The verdict counters' read in flight, on a blocking thread (iptables saves whole
        // tables for it), with the writes there were when it started.
        let mut counts_read: Option<(u64, tokio::task::JoinHandle<CountsResult>)> = None;
        loop {
            let next_verdict = async {
                match queue.as_mut() {
                    Some(q) => q.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                // The sink may block (a full stderr pipe, a slow disk).
                Some(record) = next_verdict => tokio::task::block_in_place(|| self.verdict(record)),
                batch = source.next() => {
                    let batch = batch?;
                    tokio::task::block_in_place(|| self.handle(batch));
                }
                _ = resync.tick() => tokio::task::block_in_place(|| self.resync()),
                (writes_before, read) = async {
                    match counts_read.as_mut() {
                        Some((writes, read)) => (*writes, read.await),
                        None => std::future::pending().await,
                    }
                } => {
                    counts_read = None;
                    match read {
                        Ok(counts) => tokio::task::block_in_place(|| {
                            self.counts_read_done(writes_before, counts)
                        }),
                        Err(e) => tracing::warn!(error = %e, "the verdict counters' read did not finish; the metrics keep their last values"),
                    }
                }
                _ = counts.tick() => {
                    if let Some(v) = &self.verdicts {
                        v.tx.flush();
                    }
                    if counts_read.is_none() {
                        counts_read = self
                            .counts_read()
                            .map(|(writes, read)| (writes, tokio::task::spawn_blocking(read)));
                    }
                }
                _ = heartbeat.tick() => {}
                _ = tokio::signal::ctrl_c() => break,
                _ = terminate.recv() => break,
            }
            self.health.beat();
        }
        // The dataplane keeps enforcing after the agent exits: nothing is torn down here.
        tracing::info!("shutting down; enforcement stays in place");
        Ok(())
    }

    /// Applies one batch: events into the engine, then one dataplane update.
    pub fn handle(&mut self, batch: Batch) {
        let started = Instant::now();
        // The first batch is the source's complete state: only from now on may the node
        // be changed.
        self.health.sync().complete();
        self.source_errors = batch.rejected;
        let received = batch.received.filter(|_| !batch.events.is_empty());
        if let Some(received) = received {
            let ago = u64::try_from(received.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.change_received_ns = Some(crate::kernel::monotonic_ns().saturating_sub(ago));
        }
        if batch.generation.is_some() {
            self.generation = batch.generation;
        }
        if batch.state_digest.is_some() {
            self.state_digest = batch.state_digest;
        }
        // The engine says what each event changed; the dataplanes converge on the whole
        // state (level-triggered), so only whether anything changed matters here.
        let first =
            self.known.is_empty() && !batch.events.iter().any(|e| matches!(e, Event::Delete(_)));
        let changed = if first {
            self.load(batch.events)
        } else {
            batch
                .events
                .into_iter()
                .fold(false, |changed, e| self.feed(e) | changed)
        };
        let changed = self.refresh_own_addresses() | changed;
        if self.first_batch.is_none() {
            let arrived = started.saturating_duration_since(self.health.started);
            self.first_batch = Some((arrived, started.elapsed()));
        }
        let choice = self.node_choice.unwrap_or(self.opts.default_choice);
        let desired = self.engine.desired();
        let trigger = if self.enforcer.is_none() {
            "start"
        } else {
            "batch"
        };
        match &mut self.enforcer {
            None => self.start(choice),
            Some(enforcer) => {
                let mut outcome = enforcer.choose(choice, desired);
                let result = if outcome.switched.is_some() {
                    Ok(())
                } else if self.dataplane_error.is_some() {
                    // An earlier change did not apply: converge on the whole state.
                    enforcer
                        .reconcile(desired)
                        .map(|o| outcome.cleanups.extend(o.cleanups))
                } else if changed {
                    enforcer.apply(desired)
                } else {
                    Ok(())
                };
                self.dataplane_error = result.err().map(|e| e.to_string());
                self.account(&outcome);
            }
        }
        self.metrics.observe_apply(started.elapsed().as_secs_f64());
        if let (Some(received), None) = (received, &self.dataplane_error) {
            self.metrics
                .observe_implementation_delay(received.elapsed().as_secs_f64());
        }
        self.converged(trigger, started);
        self.report();
        if trigger == "start" {
            // Serve the verdict families from readiness on, not from the first tick; read
            // after the report, so a cold start's converge is not delayed by it.
            self.read_counts();
        }
    }

    /// Reads the dataplane's verdict counters into the metrics, in this turn.
    pub fn read_counts(&mut self) {
        let Some(enforcer) = &self.enforcer else {
            return;
        };
        let counts = enforcer.verdict_counts();
        self.take_counts(counts);
    }

    /// A read of the verdict counters to run off the loop, with the dataplane's writes so
    /// far.
    pub fn counts_read(&self) -> Option<(u64, CountsRead)> {
        Some(self.enforcer.as_ref()?.verdict_counts_read())
    }

    /// Takes a [`Daemon::counts_read`]'s counts into the metrics, unless a write came
    /// while it ran: that write may have carried a rewritten chain's counts that the read
    /// also saw (or neither), and the metrics must not jump. After
    /// [`COUNT_READS_THROWN_AWAY_AT_MOST`] such reads in a row, reads again in this turn.
    pub fn counts_read_done(&mut self, writes_before: u64, counts: CountsResult) {
        let writes = self.enforcer.as_ref().map(|e| e.writes());
        if writes == Some(writes_before) {
            self.take_counts(counts);
            return;
        }
        self.count_reads_thrown_away += 1;
        tracing::debug!(
            in_a_row = self.count_reads_thrown_away,
            "a write overlapped the verdict counters' read; thrown away"
        );
        if self.count_reads_thrown_away >= COUNT_READS_THROWN_AWAY_AT_MOST {
            self.read_counts();
        }
    }

    fn take_counts(&mut self, counts: CountsResult) {
        self.count_reads_thrown_away = 0;
        match counts {
            Ok(counts) => {
                self.metrics.set_verdict_counts(&counts);
                self.counts_error = None;
            }
            Err(e) => {
                let e = e.to_string();
                if self.counts_error.as_ref() != Some(&e) {
                    tracing::warn!(error = %e, "verdict counters not read; the metrics keep their last values");
                }
                self.counts_error = Some(e);
            }
        }
    }

    /// Periodic repair. Also retries a start that failed. Before the source's first
    /// complete state it does nothing: an empty or partial state would remove what the
    /// previous run (pins, chains) or Azure NPM still enforce.
    pub fn resync(&mut self) {
        let started = Instant::now();
        if !self.health.sync().is_complete() {
            if let Some(reason) = self.health.sync().reason() {
                tracing::warn!(%reason, "not starting the dataplane yet");
            }
            return;
        }
        // The converge below is on the whole state: whether this changed it does not matter.
        self.refresh_own_addresses();
        let choice = self.node_choice.unwrap_or(self.opts.default_choice);
        match &mut self.enforcer {
            None => self.start(choice),
            Some(enforcer) => {
                let desired = self.engine.desired();
                let switched = enforcer.choose(choice, desired);
                let repaired = enforcer.reconcile(desired);
                self.account(&switched);
                match repaired {
                    Ok(outcome) => {
                        self.dataplane_error = None;
                        self.account(&outcome);
                    }
                    Err(e) => self.dataplane_error = Some(e.to_string()),
                }
            }
        }
        self.converged("resync", started);
        self.report();
    }

    /// The first state, compiled once ([`Engine::stage`], then [`Engine::rebuild`])
    /// rather than once per object: the cold start's path. Whether it changed the
    /// desired state. The other events go first, as they always have; each object is
    /// admitted against those staged before it, as events would be (a namespace's
    /// budget counts its policies so far).
    fn load(&mut self, events: Vec<Event>) -> bool {
        let mut upserts = Vec::with_capacity(events.len());
        for event in events {
            match event {
                Event::Upsert(object) => upserts.push(object),
                other => {
                    self.feed(other);
                }
            }
        }
        for object in upserts {
            match self.engine.admit(&object) {
                Ok(()) => {
                    self.note_upsert(&object);
                    self.engine.stage(*object);
                }
                Err(e) => {
                    self.refuse(*object, e);
                }
            }
        }
        !self.engine.rebuild().is_empty()
    }

    /// One event into the engine; whether it changed the desired state.
    fn feed(&mut self, event: Event) -> bool {
        match event {
            Event::Upsert(object) => {
                // Over its budget: refused like an invalid object, before it is compiled.
                if let Err(e) = self.engine.admit(&object) {
                    self.refuse(*object, e);
                    return false;
                }
                let policy_namespace = policy_namespace(&object.key());
                self.note_upsert(&object);
                let changed = self.engine.upsert_validated_changed(*object);
                // A smaller version may make room for its namespace's waiting policies.
                changed | self.admit_waiting(policy_namespace.as_deref())
            }
            Event::Refused(e) => {
                let key = e.object().clone();
                tracing::warn!(object = %key, error = %e, "object refused; everything else stays enforced");
                self.known.insert(key.clone());
                self.refused.insert(key, e.to_string());
                false
            }
            Event::Delete(key) => {
                if key.kind == Kind::Node {
                    self.observe_node(Some(&key.name), None);
                }
                self.known.remove(&key);
                // A deleted object is no longer refused.
                self.refused.remove(&key);
                self.waiting.remove(&key);
                let changed = self.engine.delete_changed(&key);
                changed | self.admit_waiting(policy_namespace(&key).as_deref())
            }
        }
    }

    /// Records a refusal; a policy refused for its namespace's budget waits for room.
    fn refuse(&mut self, object: Validated, e: weir_policy::PolicyError) {
        if matches!(e, weir_policy::PolicyError::NamespaceOverBudget { .. }) {
            self.waiting.insert(object.key(), object);
        }
        self.feed(Event::Refused(e));
    }

    /// Admits the policies of `namespace` that wait for room, in name order, while they
    /// fit; whether the desired state changed.
    fn admit_waiting(&mut self, namespace: Option<&str>) -> bool {
        let Some(namespace) = namespace else {
            return false;
        };
        let keys: Vec<ObjectRef> = self
            .waiting
            .keys()
            .filter(|k| k.namespace.as_deref() == Some(namespace))
            .cloned()
            .collect();
        let mut changed = false;
        for key in keys {
            if self.engine.admit(&self.waiting[&key]).is_err() {
                continue;
            }
            if let Some(object) = self.waiting.remove(&key) {
                tracing::info!(object = %key, "policy admitted: its namespace has room for it now");
                self.note_upsert(&object);
                changed |= self.engine.upsert_validated_changed(object);
            }
        }
        changed
    }

    fn note_upsert(&mut self, object: &Validated) {
        let key = object.key();
        self.waiting.remove(&key);
        if let Validated::Node(node) = object {
            self.observe_node(Some(&node.name), Some(&node.labels));
        }
        self.refused.remove(&key);
        self.known.insert(key);
    }

    fn is_this_node(&self, name: Option<&str>) -> bool {
        match &self.opts.node_name {
            Some(mine) => name == Some(mine.as_str()),
            None => true,
        }
    }

    fn observe_node(&mut self, name: Option<&str>, labels: Option<&weir_policy::model::Labels>) {
        // A benchmark's agent (--dataplane none) stays one: no label makes it program
        // the machine it shares with the others.
        if !self.is_this_node(name) || self.opts.default_choice == DataplaneChoice::None {
            return;
        }
        self.node_choice_error = None;
        self.node_choice = match choice_from_labels(labels) {
            None => None,
            Some(Ok(choice)) => Some(choice),
            Some(Err(reason)) => {
                self.node_choice_error = Some(ObjectError {
                    object: format!("Node {}", name.unwrap_or_default()),
                    reason: format!("{reason}; using {}", self.opts.default_choice),
                });
                None
            }
        };
    }

    fn start(&mut self, choice: DataplaneChoice) {
        let Some(backends) = self.backends.take() else {
            return;
        };
        match Enforcer::start(backends, choice, self.engine.desired()) {
            Ok((mut enforcer, outcome, phases)) => {
                if let Some((listed, compiled)) = self.first_batch {
                    let ms = |d: Duration| d.as_millis() as u64;
                    let startup = Startup {
                        listed_ms: ms(listed),
                        compiled_ms: ms(compiled),
                        loaded_ms: ms(phases.load),
                        programmed_ms: ms(phases.converge),
                        cleaned_ms: ms(phases.cleanup),
                    };
                    tracing::info!(
                        listed_ms = startup.listed_ms,
                        compiled_ms = startup.compiled_ms,
                        loaded_ms = startup.loaded_ms,
                        programmed_ms = startup.programmed_ms,
                        cleaned_ms = startup.cleaned_ms,
                        "cold start: listed, compiled, loaded, programmed, cleaned"
                    );
                    self.startup = Some(startup);
                }
                if let Some(v) = &self.verdicts {
                    enforcer.tap_verdicts(v.tx.clone());
                }
                let e = enforcer.effective();
                tracing::info!(dataplane = %e.kind, fallback_reason = e.fallback_reason().unwrap_or(""),
                    "dataplane converged");
                self.enforcer = Some(enforcer);
                self.dataplane_error = None;
                self.account(&outcome);
            }
            Err((backends, e)) => {
                tracing::error!(error = %e, "no dataplane could start; retrying at the next resync");
                self.backends = Some(backends);
                self.dataplane_error = Some(format!("start: {e}"));
            }
        }
    }

    fn account(&self, outcome: &Outcome) {
        for report in &outcome.cleanups {
            tracing::info!(
                removed = report.removed,
                undeletable = report.undeletable.len(),
                duration_ms = report.duration.as_millis() as u64,
                "cleanup done"
            );
            self.metrics.record_cleanup(report);
        }
        if let Some((from, to)) = outcome.switched {
            tracing::info!(%from, %to, "dataplane switched");
            self.metrics.record_switch();
        }
    }

    fn status(&self) -> Status {
        let mut errors = self.source_errors.clone();
        errors.extend(self.refused.iter().map(|(object, reason)| ObjectError {
            object: object.to_string(),
            reason: reason.clone(),
        }));
        errors.extend(self.node_choice_error.clone());
        if let Some(e) = &self.dataplane_error {
            errors.push(ObjectError {
                object: "dataplane".into(),
                reason: e.clone(),
            });
        }
        if let Some(enforcer) = &self.enforcer {
            errors.extend(enforcer.failures().iter().map(|f| ObjectError {
                object: f.object.clone(),
                reason: f.reason.clone(),
            }));
            if let Some(e) = enforcer.switch_error() {
                errors.push(ObjectError {
                    object: "dataplane switch".into(),
                    reason: e.to_string(),
                });
            }
        }
        let effective = self.enforcer.as_ref().map(|e| e.effective());
        Status {
            generation: self.generation.unwrap_or(0),
            converged: self.enforcer.is_some() && self.dataplane_error.is_none(),
            dataplane: effective.map(|e| e.kind),
            fallback_reason: effective
                .and_then(|e| e.fallback_reason())
                .map(str::to_string),
            errors,
            state_digest: self.state_digest.clone(),
            change_received_monotonic_ns: self.change_received_ns,
            startup: self.startup,
        }
    }

    fn node_report(
        &self,
        status: &Status,
        dataplane: crate::dataplane::DataplaneStatus,
        undeletable_sets: Vec<String>,
    ) -> NodeReport {
        // Every refused object is known too.
        let refused_policies = self
            .refused
            .keys()
            .filter(|k| k.kind == Kind::NetworkPolicy)
            .count();
        let policies = self
            .known
            .count(Kind::NetworkPolicy)
            .saturating_sub(refused_policies);
        NodeReport {
            node: self.opts.node_name.clone(),
            requested: Some(self.node_choice.unwrap_or(self.opts.default_choice)),
            dataplane: status.dataplane,
            fallback_reason: status.fallback_reason.clone(),
            converged: status.converged,
            sync: self.health.sync().state(),
            enforced: Enforced {
                endpoints: dataplane.endpoints,
                policies,
                sets: dataplane.sets,
                rules: dataplane.rules,
            },
            refused: status.errors.clone(),
            map_pressure: dataplane
                .details
                .iter()
                .filter_map(|(k, v)| MapPressure::from_detail(k, v))
                .collect(),
            undeletable_sets,
            last_converge: self.last_converge.clone(),
            details: dataplane
                .details
                .into_iter()
                .chain(
                    self.enforcer
                        .as_ref()
                        .and_then(|e| e.verdict_tap_error())
                        .map(|e| ("verdict_log".to_string(), format!("not read: {e}"))),
                )
                .collect(),
        }
    }

    /// Metrics, readiness, the status file and the publisher, after every change.
    fn report(&mut self) {
        let status = self.status();
        for kind in [
            Kind::Namespace,
            Kind::Pod,
            Kind::NetworkPolicy,
            Kind::Node,
            Kind::Service,
        ] {
            self.metrics
                .set_objects(kind.name(), self.known.count(kind));
        }
        self.metrics.set_object_errors(status.errors.len());
        let dataplane = self.enforcer.as_ref().map(|e| e.status());
        let undeletable = self
            .enforcer
            .as_ref()
            .map(|e| e.undeletable_sets())
            .unwrap_or_default();
        if let (Some(enforcer), Some(dataplane)) = (&self.enforcer, &dataplane) {
            self.metrics.set_effective(enforcer.effective());
            self.metrics.set_undeletable_sets(undeletable.len());
            self.metrics.set_dataplane_status(dataplane);
        }
        if let Some(board) = &self.reports {
            board.publish(self.node_report(&status, dataplane.unwrap_or_default(), undeletable));
        }
        if status.converged {
            self.health.set_ready();
        } else {
            self.health.set_not_converged(self.dataplane_error.clone());
        }
        if self.last_status.as_ref() == Some(&status) {
            return;
        }
        if let Some(path) = &self.opts.status_file {
            if let Err(e) = status.write_atomically(path) {
                tracing::error!(path = %path.display(), error = %e, "cannot write the status file");
            }
        }
        if let Some(p) = &mut self.publisher {
            // An unusable weir.io/dataplane label is reported on the Node, like a refused
            // policy on the policy.
            let mut refused = self.refused.clone();
            if let (Some(e), Some(node)) = (&self.node_choice_error, &self.opts.node_name) {
                refused.insert(ObjectRef::new(Kind::Node, None, node), e.reason.clone());
            }
            p.publish(&status, &refused);
        }
        self.last_status = Some(status);
    }
}

/// The namespace of `key` when it is a NetworkPolicy (whose namespace budget it counts
/// against).
fn policy_namespace(key: &ObjectRef) -> Option<String> {
    match key.kind {
        Kind::NetworkPolicy => key.namespace.clone(),
        _ => None,
    }
}
