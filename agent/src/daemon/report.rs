//! What the running agent says about its node: `GET /status` on the agent's HTTP port,
//! read by `weir status` and `weir-lab status`. Unlike the status file (the outcome the
//! lab waits for, rewritten only when it changes), this is refreshed after every batch and
//! resync and carries what an operator asks first: which dataplane and why, whether the
//! sources are synced, what is enforced and refused, map pressure, undeletable sets, and
//! the last converge.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::select::DataplaneChoice;
use crate::dataplane::DataplaneKind;
use crate::source::event::SyncState;
use weir_policy::model::ObjectError;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeReport {
    /// This node's name; `None` in file mode without one.
    pub node: Option<String>,
    /// What the node's `weir.io/dataplane` label (or `--dataplane`) asks for.
    pub requested: Option<DataplaneChoice>,
    /// The dataplane enforcing; `None` before one started.
    pub dataplane: Option<DataplaneKind>,
    /// Why `dataplane` is not what was requested, when it is not.
    pub fallback_reason: Option<String>,
    /// The dataplane enforces the source's current state, less the refused objects.
    pub converged: bool,
    pub sync: SyncState,
    pub enforced: Enforced,
    /// Objects not enforced, and why (invalid, refused by the dataplane, a dataplane
    /// error, an unusable node label).
    pub refused: Vec<ObjectError>,
    pub map_pressure: Vec<MapPressure>,
    /// Sets weir could not destroy because something else still references them; retried
    /// at every resync.
    pub undeletable_sets: Vec<String>,
    pub last_converge: Option<Converge>,
    /// The dataplane's own facts (pin root, attach mode, iptables backend, ...).
    pub details: std::collections::BTreeMap<String, String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Enforced {
    /// Local pods the dataplane enforces for.
    pub endpoints: usize,
    /// NetworkPolicies known and not refused.
    pub policies: usize,
    /// Address sets (eBPF identities' sets, or ipsets) and rules programmed.
    pub sets: usize,
    pub rules: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MapPressure {
    pub map: String,
    pub used: u64,
    pub capacity: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Converge {
    /// When it finished (RFC 3339, UTC).
    pub finished_at: String,
    pub duration_ms: f64,
    /// `batch` (source events), `resync` (the periodic repair) or `start`.
    pub trigger: String,
}

impl MapPressure {
    /// A dataplane detail `map_pressure.<map>` = `used/capacity ...`.
    pub fn from_detail(key: &str, value: &str) -> Option<MapPressure> {
        let map = key.strip_prefix("map_pressure.")?;
        let head = value.split_whitespace().next()?;
        let (used, capacity) = head.split_once('/')?;
        Some(MapPressure {
            map: map.to_string(),
            used: used.parse().ok()?,
            capacity: capacity.parse().ok()?,
        })
    }

    pub fn ratio(&self) -> f64 {
        if self.capacity == 0 {
            0.0
        } else {
            self.used as f64 / self.capacity as f64
        }
    }
}

/// The latest report, shared between the run loop (which writes it after every batch and
/// resync) and the HTTP server (which serves it).
#[derive(Debug, Default)]
pub struct ReportBoard(std::sync::Mutex<Option<NodeReport>>);

impl ReportBoard {
    pub fn publish(&self, report: NodeReport) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(report);
    }

    /// The last report; `None` before the run loop had its first complete state.
    pub fn latest(&self) -> Option<NodeReport> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The report as aligned text, for a terminal.
pub fn render_table(r: &NodeReport) -> String {
    let or_none = |v: Option<String>| v.unwrap_or_else(|| "-".to_string());
    let mut rows: Vec<(String, String)> = vec![
        ("node".into(), or_none(r.node.clone())),
        (
            "requested".into(),
            or_none(r.requested.map(|c| c.to_string())),
        ),
        (
            "dataplane".into(),
            or_none(r.dataplane.map(|k| k.to_string())),
        ),
    ];
    if let Some(why) = &r.fallback_reason {
        rows.push(("fallback reason".into(), why.clone()));
    }
    rows.push(("converged".into(), r.converged.to_string()));
    let sync = if r.sync.complete {
        "complete".to_string()
    } else if r.sync.waiting.is_empty() {
        "waiting for the first complete state".to_string()
    } else {
        format!("waiting for {}", r.sync.waiting.join(", "))
    };
    rows.push(("sync".into(), sync));
    if let Some(e) = &r.sync.last_error {
        rows.push(("last source error".into(), e.clone()));
    }
    rows.push((
        "enforced".into(),
        format!(
            "{} endpoints, {} policies, {} sets, {} rules",
            r.enforced.endpoints, r.enforced.policies, r.enforced.sets, r.enforced.rules
        ),
    ));
    if let Some(c) = &r.last_converge {
        rows.push((
            "last converge".into(),
            format!("{} ({}, {:.1} ms)", c.finished_at, c.trigger, c.duration_ms),
        ));
    }
    for m in &r.map_pressure {
        rows.push((
            format!("map {}", m.map),
            format!("{}/{} ({:.1}%)", m.used, m.capacity, m.ratio() * 100.0),
        ));
    }
    rows.push((
        "undeletable sets".into(),
        r.undeletable_sets.len().to_string(),
    ));
    for s in &r.undeletable_sets {
        rows.push(("  set".into(), s.clone()));
    }
    rows.push(("refused".into(), r.refused.len().to_string()));
    for e in &r.refused {
        rows.push((format!("  {}", e.object), e.reason.clone()));
    }
    for (k, v) in &r.details {
        if !k.starts_with("map_pressure.") {
            rows.push((k.clone(), v.clone()));
        }
    }
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    rows.iter()
        .map(|(k, v)| format!("{k:<width$}  {v}\n"))
        .collect()
}

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(
        "no agent answers at {addr} (is `weir agent` running, with --listen there?): {source}"
    )]
    Connect {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("reading {addr}/status: {source}")]
    Io {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{addr}/status answered `{status_line}`, not 200")]
    Status {
        addr: SocketAddr,
        status_line: String,
    },
    #[error("{addr}/status answered something that is not an HTTP response")]
    NotHttp { addr: SocketAddr },
    #[error("{addr}/status answered a document weir cannot read: {source}")]
    Document {
        addr: SocketAddr,
        #[source]
        source: serde_json::Error,
    },
}

/// How long `weir status` waits for the agent.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// `GET /status` from the agent at `addr` (blocking; the CLI has no runtime).
pub fn fetch(addr: SocketAddr) -> Result<NodeReport, FetchError> {
    let io = |source| FetchError::Io { addr, source };
    let mut stream = TcpStream::connect_timeout(&addr, FETCH_TIMEOUT)
        .map_err(|source| FetchError::Connect { addr, source })?;
    stream.set_read_timeout(Some(FETCH_TIMEOUT)).map_err(io)?;
    stream.set_write_timeout(Some(FETCH_TIMEOUT)).map_err(io)?;
    stream
        .write_all(b"GET /status HTTP/1.1\r\nHost: weir\r\nAccept: application/json\r\nConnection: close\r\n\r\n")
        .map_err(io)?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).map_err(io)?;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or(FetchError::NotHttp { addr })?;
    let status_line = head.lines().next().unwrap_or_default();
    if !status_line.starts_with("HTTP/1.") {
        return Err(FetchError::NotHttp { addr });
    }
    if status_line.split_whitespace().nth(1) != Some("200") {
        return Err(FetchError::Status {
            addr,
            status_line: status_line.to_string(),
        });
    }
    serde_json::from_str(body).map_err(|source| FetchError::Document { addr, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_pressure_is_read_from_the_dataplane_detail() {
        let m = MapPressure::from_detail("map_pressure.WEIR_POLICY", "4096/16384 (25.0%)").unwrap();
        assert_eq!(m.map, "WEIR_POLICY");
        assert_eq!((m.used, m.capacity), (4096, 16384));
        assert_eq!(m.ratio(), 0.25);
        assert!(MapPressure::from_detail("drops.policy", "7").is_none());
        assert!(MapPressure::from_detail("map_pressure.X", "garbage").is_none());
    }

    #[test]
    fn the_table_names_the_dataplane_the_refused_objects_and_the_sets() {
        let report = NodeReport {
            node: Some("node-a".into()),
            requested: Some(DataplaneChoice::Ebpf),
            dataplane: Some(DataplaneKind::Iptables),
            fallback_reason: Some("eBPF unavailable: no BTF".into()),
            converged: true,
            sync: SyncState {
                complete: true,
                ..Default::default()
            },
            enforced: Enforced {
                endpoints: 3,
                policies: 2,
                sets: 4,
                rules: 9,
            },
            refused: vec![ObjectError {
                object: "NetworkPolicy x/bad".into(),
                reason: "spec.ingress[0].ports[0].port: 0 is not a port".into(),
            }],
            undeletable_sets: vec!["azure-npm-123".into()],
            ..Default::default()
        };
        let table = render_table(&report);
        for (key, value) in [
            ("requested", "ebpf"),
            ("dataplane", "iptables"),
            ("fallback reason", "eBPF unavailable: no BTF"),
            ("enforced", "3 endpoints, 2 policies, 4 sets, 9 rules"),
            (
                "  NetworkPolicy x/bad",
                "spec.ingress[0].ports[0].port: 0 is not a port",
            ),
            ("undeletable sets", "1"),
            ("  set", "azure-npm-123"),
        ] {
            assert!(
                table
                    .lines()
                    .any(|l| l.starts_with(key) && l.ends_with(&format!("  {value}"))),
                "{key:?} = {value:?} not in\n{table}"
            );
        }
    }
}
