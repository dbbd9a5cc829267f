//! The stream's plumbing: what the dataplanes' tap threads send into ([`VerdictTx`]), the
//! threads themselves ([`VerdictTap`]), and where the named records go ([`VerdictHub`]):
//! the configured sink and every `GET /verdicts` subscriber.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{broadcast, mpsc};

use super::limit::RateLimiter;
use super::record::VerdictRecord;

/// Where the agent writes the stream (`--verdict-log`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VerdictSink {
    /// Nowhere; `GET /verdicts` (and so `weir monitor`) still serves it.
    Off,
    /// One JSON line per record on stderr, beside the agent's own log.
    Log,
    /// Appended to this file, one JSON line per record.
    File(PathBuf),
}

impl std::str::FromStr for VerdictSink {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(VerdictSink::Off),
            "log" => Ok(VerdictSink::Log),
            "" => Err("give `off`, `log` or a file path".into()),
            path => Ok(VerdictSink::File(PathBuf::from(path))),
        }
    }
}

/// How many records may wait for the run loop; more are dropped and counted.
const QUEUE: usize = 4096;

/// The taps' side: rate-limits each endpoint, then queues for the run loop.
pub struct VerdictTx {
    queue: mpsc::Sender<VerdictRecord>,
    limit: Mutex<RateLimiter>,
    /// Records lost because the queue was full (the run loop busy with a large write).
    overflowed: AtomicU64,
    allow_subscribers: Arc<AtomicUsize>,
}

impl VerdictTx {
    /// Offers one record from a dataplane. Allow verdicts only flow while a subscriber
    /// asked for them.
    pub fn offer(&self, mut record: VerdictRecord) {
        if record.verdict == "allow" && !self.wants_allows() {
            return;
        }
        let key = endpoint_key(&record);
        let admitted = self
            .limit
            .lock()
            .map(|mut l| l.admit(&key, Instant::now()))
            .unwrap_or(Some(0));
        let Some(suppressed) = admitted else {
            return;
        };
        record.suppressed = suppressed;
        if self.queue.try_send(record).is_err() {
            self.overflowed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Whether a `weir monitor --allow` is listening (the eBPF tap then asks the programs
    /// for allow events).
    pub fn wants_allows(&self) -> bool {
        self.allow_subscribers.load(Ordering::Relaxed) > 0
    }

    /// Summaries of what the limit held back with no record after it, and of what the
    /// full queue lost.
    pub fn flush(&self) {
        let held = self
            .limit
            .lock()
            .map(|mut l| l.drain_suppressed(Instant::now()))
            .unwrap_or_default();
        for (pod, count) in held {
            let unspecified = std::net::IpAddr::from([0u8; 4]);
            let mut r = VerdictRecord::packet(
                "suppressed",
                "rate-limit",
                "",
                0,
                (unspecified, 0),
                (unspecified, 0),
            );
            r.pod = Some(pod);
            r.suppressed = count;
            let _ = self.queue.try_send(r);
        }
        let lost = self.overflowed.swap(0, Ordering::Relaxed);
        if lost > 0 {
            tracing::warn!(
                lost,
                "verdict records dropped: the run loop did not keep up (queue of {QUEUE})"
            );
        }
    }
}

/// The bucket a record is limited under: its pod, else the pod-side address; allows (only
/// while `weir monitor --allow` runs) in a bucket of their own, so they never crowd out the
/// pod's drops.
fn endpoint_key(r: &VerdictRecord) -> String {
    let endpoint = match &r.pod {
        Some(pod) => pod.clone(),
        None if r.direction == "ingress" => r.dst.to_string(),
        None => r.src.to_string(),
    };
    if r.verdict == "allow" {
        format!("{endpoint} (allows)")
    } else {
        endpoint
    }
}

/// A dataplane's reader thread; stopped and joined when dropped (a dataplane switch, the
/// agent exiting).
pub struct VerdictTap {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl VerdictTap {
    /// Runs `read` on its own thread; it must return soon after `stop` turns true.
    pub fn spawn(
        name: &str,
        read: impl FnOnce(Arc<AtomicBool>) + Send + 'static,
    ) -> std::io::Result<VerdictTap> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || read(flag))?;
        Ok(VerdictTap {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for VerdictTap {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

enum Writer {
    Off,
    Log,
    File { path: PathBuf, file: std::fs::File },
}

/// The run loop's side: writes named records to the sink and to every subscriber.
pub struct VerdictHub {
    writer: Mutex<Writer>,
    subscribers: broadcast::Sender<Arc<VerdictRecord>>,
    allow_subscribers: Arc<AtomicUsize>,
    /// The last write error (logged once until the writes work again).
    write_error: Mutex<Option<String>>,
}

/// A `GET /verdicts` subscriber: its records, and (while it lives) its wish for allows.
pub struct Subscription {
    pub records: broadcast::Receiver<Arc<VerdictRecord>>,
    pub allow: bool,
    counter: Arc<AtomicUsize>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if self.allow {
            self.counter.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl VerdictHub {
    pub fn new(sink: &VerdictSink) -> std::io::Result<VerdictHub> {
        let writer = match sink {
            VerdictSink::Off => Writer::Off,
            VerdictSink::Log => Writer::Log,
            VerdictSink::File(path) => Writer::File {
                path: path.clone(),
                file: std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)?,
            },
        };
        Ok(VerdictHub {
            writer: Mutex::new(writer),
            subscribers: broadcast::channel(1024).0,
            allow_subscribers: Arc::new(AtomicUsize::new(0)),
            write_error: Mutex::new(None),
        })
    }

    /// The taps' sender, limiting each endpoint to `per_second` records (bursts of
    /// `burst`), and the queue the run loop reads.
    pub fn channel(
        &self,
        per_second: u32,
        burst: u32,
    ) -> (VerdictTx, mpsc::Receiver<VerdictRecord>) {
        let (queue, rx) = mpsc::channel(QUEUE);
        let tx = VerdictTx {
            queue,
            limit: Mutex::new(RateLimiter::new(per_second, burst)),
            overflowed: AtomicU64::new(0),
            allow_subscribers: self.allow_subscribers.clone(),
        };
        (tx, rx)
    }

    /// `GET /verdicts` subscribers now.
    pub fn subscribers(&self) -> usize {
        self.subscribers.receiver_count()
    }

    pub fn subscribe(&self, allow: bool) -> Subscription {
        if allow {
            self.allow_subscribers.fetch_add(1, Ordering::Relaxed);
        }
        Subscription {
            records: self.subscribers.subscribe(),
            allow,
            counter: self.allow_subscribers.clone(),
        }
    }

    /// One named record: to the sink (allow verdicts only go to the subscribers that
    /// asked for them) and to the subscribers.
    pub fn publish(&self, record: VerdictRecord) {
        if record.verdict != "allow" {
            self.write(&record);
        }
        if self.subscribers.receiver_count() > 0 {
            let _ = self.subscribers.send(Arc::new(record));
        }
    }

    fn write(&self, record: &VerdictRecord) {
        let Ok(mut writer) = self.writer.lock() else {
            return;
        };
        if matches!(*writer, Writer::Off) {
            return;
        }
        let line = serde_json::to_string(record).expect("a record serializes") + "\n";
        let result = match &mut *writer {
            Writer::Off => return,
            Writer::Log => std::io::stderr().lock().write_all(line.as_bytes()),
            Writer::File { file, .. } => file.write_all(line.as_bytes()),
        };
        let Ok(mut last) = self.write_error.lock() else {
            return;
        };
        match result {
            Ok(()) => *last = None,
            Err(e) => {
                let target = match &*writer {
                    Writer::File { path, .. } => path.display().to_string(),
                    _ => "stderr".to_string(),
                };
                let e = format!("write the verdict log to {target}: {e}");
                if last.as_ref() != Some(&e) {
                    tracing::warn!(error = %e, "verdict records are being lost");
                }
                *last = Some(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(verdict: &str, pod: &str) -> VerdictRecord {
        let a = std::net::IpAddr::from([10, 0, 0, 1]);
        let mut r = VerdictRecord::packet(verdict, "policy-deny", "ingress", 6, (a, 1), (a, 2));
        r.pod = Some(pod.into());
        r
    }

    #[test]
    fn a_file_sink_gets_drops_and_subscribers_get_allows_only_when_asked() {
        let dir = std::env::temp_dir().join(format!("weir-verdicts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("verdicts.jsonl");
        let hub = VerdictHub::new(&VerdictSink::File(path.clone())).unwrap();
        let (tx, mut rx) = hub.channel(100, 2);
        // No subscriber wants allows: they are not even queued.
        tx.offer(record("allow", "x/a"));
        for _ in 0..5 {
            tx.offer(record("drop", "x/a"));
        }
        let mut queued = Vec::new();
        while let Ok(r) = rx.try_recv() {
            queued.push(r);
        }
        assert_eq!(queued.len(), 2, "the burst of two; three held back");
        tx.flush();
        let summary = rx.try_recv().expect("a summary of what was held back");
        assert_eq!(
            (summary.verdict.as_str(), summary.suppressed),
            ("suppressed", 3)
        );
        let mut sub = hub.subscribe(true);
        assert!(tx.wants_allows());
        for r in queued.into_iter().chain([summary]) {
            hub.publish(r);
        }
        hub.publish(record("allow", "x/b"));
        let mut seen = Vec::new();
        while let Ok(r) = sub.records.try_recv() {
            seen.push(r.verdict.clone());
        }
        assert_eq!(seen, ["drop", "drop", "suppressed", "allow"]);
        drop(sub);
        assert!(!tx.wants_allows());
        let text = std::fs::read_to_string(&path).unwrap();
        let verdicts: Vec<String> = text
            .lines()
            .map(|l| serde_json::from_str::<VerdictRecord>(l).unwrap().verdict)
            .collect();
        assert_eq!(
            verdicts,
            ["drop", "drop", "suppressed"],
            "allows stay out of the log"
        );
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!("off".parse::<VerdictSink>(), Ok(VerdictSink::Off));
        assert!("".parse::<VerdictSink>().is_err());
    }
}
