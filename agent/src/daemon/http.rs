//! The agent's HTTP endpoints: /metrics (Prometheus text), /healthz (the run loop turned
//! within `--liveness-seconds`), /readyz (the dataplane converged at least once; until
//! then a 503 whose body says why: the source still listing, with its last error, or the
//! dataplane's error), /status (the node report `weir status` reads, JSON), /verdicts
//! (the verdict stream `weir monitor` reads: JSON lines for as long as the client stays;
//! `?allow=true` adds allow verdicts). /verdicts and /status answer only clients on the
//! node's own loopback (`weir monitor` and `weir status` run in the agent's pod), and
//! /verdicts a few at a time: on a host-network agent, any pod could otherwise read every
//! pod's connections and every tenant's refused objects, or ask the programs for allow
//! events and crowd the drops out of the kernel's event budget.
//!
//! The server listens on the node's loopback unless told otherwise (`--listen`), answers
//! one request per connection, gives a client [`HEADER_TIMEOUT`] to send its request, and
//! holds at most [`MAX_CONNECTIONS`] connections at once (more are closed at once): a pod
//! that can reach a non-loopback listener cannot hold the agent's sockets or memory.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

use super::metrics::Metrics;
use super::report::{NodeReport, ReportBoard};
use super::run::Health;
use crate::verdicts::VerdictHub;

/// What the HTTP server answers from.
#[derive(Clone)]
pub struct Served {
    pub metrics: Arc<Metrics>,
    pub health: Arc<Health>,
    pub reports: Arc<ReportBoard>,
    pub verdicts: Arc<VerdictHub>,
}

type Body = UnsyncBoxBody<Bytes, Infallible>;

/// `/verdicts`: each record the hub publishes from now on, as a JSON line. A subscriber
/// too slow for the stream skips what it missed and is told how much.
fn verdict_stream(hub: &VerdictHub, allow: bool) -> Body {
    let subscription = hub.subscribe(allow);
    let lines = futures::stream::unfold(subscription, |mut sub| async move {
        loop {
            let line = match sub.records.recv().await {
                Ok(r) if r.verdict == "allow" && !sub.allow => continue,
                Ok(r) => serde_json::to_string(&*r).expect("a record serializes"),
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                    format!("{{\"verdict\":\"lagged\",\"suppressed\":{n}}}")
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
            };
            return Some((
                Ok::<_, Infallible>(Frame::data(Bytes::from(line + "\n"))),
                sub,
            ));
        }
    });
    StreamBody::new(lines.boxed()).boxed_unsync()
}

/// `/status` before the run loop's first report: only the sources' progress is known.
fn starting_report(health: &Health) -> NodeReport {
    NodeReport {
        sync: health.sync().state(),
        ..Default::default()
    }
}

/// At most this many `/verdicts` subscribers at once.
const MAX_SUBSCRIBERS: usize = 8;

fn respond(
    shared: &Served,
    path: &str,
    query: Option<&str>,
    peer: std::net::IpAddr,
) -> Response<Body> {
    let Served {
        metrics,
        health,
        reports,
        verdicts,
    } = shared;
    let refuse = |code: StatusCode, why: &str| {
        let mut r = Response::new(Full::new(Bytes::from(format!("{why}\n"))).boxed_unsync());
        *r.status_mut() = code;
        r
    };
    if path == "/status" && !peer.is_loopback() {
        return refuse(
            StatusCode::FORBIDDEN,
            "the node report is served on the node's loopback only: run `weir status` in the agent's pod",
        );
    }
    if path == "/verdicts" {
        if !peer.is_loopback() {
            return refuse(
                StatusCode::FORBIDDEN,
                "the verdict stream is served on the node's loopback only: run `weir monitor` in the agent's pod",
            );
        }
        if verdicts.subscribers() >= MAX_SUBSCRIBERS {
            return refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("{MAX_SUBSCRIBERS} verdict streams are open already"),
            );
        }
        let allow = query.is_some_and(|q| q.split('&').any(|kv| kv == "allow=true"));
        let mut response = Response::new(verdict_stream(verdicts, allow));
        if let Ok(v) = "application/jsonl".parse() {
            response
                .headers_mut()
                .insert(hyper::header::CONTENT_TYPE, v);
        }
        return response;
    }
    let (code, content_type, body) = match path {
        "/metrics" => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.encode(),
        ),
        "/healthz" => health_text(health.liveness(), "ok"),
        "/readyz" => health_text(health.readiness(), "ready"),
        "/status" => {
            let report = reports.latest().unwrap_or_else(|| starting_report(health));
            match serde_json::to_string_pretty(&report) {
                Ok(json) => (StatusCode::OK, "application/json", json + "\n"),
                Err(e) => (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain",
                    format!("encode the status: {e}\n"),
                ),
            }
        }
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found\n".to_string(),
        ),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)).boxed_unsync());
    *response.status_mut() = code;
    if let Ok(v) = content_type.parse() {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, v);
    }
    response
}

/// How long a bind to an address in use is retried: the agent this one replaces (a
/// restarted host-network pod, or a killed process whose other threads are still exiting)
/// may hold the port for a moment after it is gone.
const ADDR_IN_USE_RETRY: Duration = Duration::from_secs(15);

/// How long a client has to send its request's head before its connection is closed.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once; more are closed as they are accepted. Probes, a scraper
/// and a few `weir` commands need a handful; /verdicts has its own, lower limit.
pub const MAX_CONNECTIONS: usize = 64;

/// Binds `addr` and serves until the process ends. Returns the bound address (port 0
/// picks a free one).
pub async fn serve(addr: SocketAddr, shared: Served) -> std::io::Result<SocketAddr> {
    let listener = bind(addr).await?;
    let bound = listener.local_addr()?;
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        let mut refused: u64 = 0;
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                refused += 1;
                // Once, then every 1,000th: a flood must not flood the log too.
                if refused % 1000 == 1 {
                    tracing::warn!(%peer, refused, "{MAX_CONNECTIONS} HTTP connections open already: closing new ones");
                }
                drop(stream);
                continue;
            };
            let shared = shared.clone();
            tokio::spawn(async move {
                let _slot = slot;
                let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let r = respond(&shared, req.uri().path(), req.uri().query(), peer.ip());
                    async move { Ok::<_, Infallible>(r) }
                });
                if let Err(e) = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .keep_alive(false)
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                {
                    tracing::debug!(error = %e, "metrics connection ended with an error");
                }
            });
        }
    });
    Ok(bound)
}

/// Binds `addr`, retrying for [`ADDR_IN_USE_RETRY`] while it is in use.
async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let deadline = tokio::time::Instant::now() + ADDR_IN_USE_RETRY;
    let mut logged = false;
    loop {
        match TcpListener::bind(addr).await {
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse
                    && tokio::time::Instant::now() < deadline =>
            {
                if !logged {
                    tracing::warn!(%addr, "address in use (the agent before this one still exiting?); retrying for {}s", ADDR_IN_USE_RETRY.as_secs());
                    logged = true;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => return other,
        }
    }
}

/// A health endpoint's answer: `ok` with 200, or why not with 503.
fn health_text(
    result: Result<(), impl std::fmt::Display>,
    ok: &str,
) -> (StatusCode, &'static str, String) {
    match result {
        Ok(()) => (StatusCode::OK, "text/plain", format!("{ok}\n")),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            format!("{reason}\n"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: weir\r\nConnection: close\r\n\r\n");
        s.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        s.read_to_string(&mut response).await.unwrap();
        response
    }

    fn served(health: Health, reports: Arc<ReportBoard>) -> Served {
        Served {
            metrics: Arc::new(Metrics::new()),
            health: Arc::new(health),
            reports,
            verdicts: Arc::new(VerdictHub::new(&crate::verdicts::VerdictSink::Off).unwrap()),
        }
    }

    #[tokio::test]
    async fn verdicts_stream_to_a_client_as_json_lines() {
        let shared = served(Health::default(), Arc::default());
        let hub = shared.verdicts.clone();
        let addr = serve("127.0.0.1:0".parse().unwrap(), shared).await.unwrap();
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        // As weir monitor asks: HTTP/1.0, so the body is not chunked.
        s.write_all(b"GET /verdicts HTTP/1.0\r\nHost: weir\r\n\r\n")
            .await
            .unwrap();
        let a = std::net::IpAddr::from([10, 0, 0, 1]);
        let record = |verdict: &str| {
            crate::verdicts::VerdictRecord::packet(
                verdict,
                "policy-deny",
                "ingress",
                6,
                (a, 1),
                (a, 80),
            )
        };
        let mut text = String::new();
        let mut buf = [0u8; 4096];
        while !text.contains("\"verdict\":\"drop\"") {
            // Published until the subscriber (made when the request arrives) sees one.
            hub.publish(record("allow"));
            hub.publish(record("drop"));
            if let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_millis(100), s.read(&mut buf)).await
            {
                assert!(n > 0, "the stream ended: {text}");
                text.push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        }
        assert!(
            text.starts_with("HTTP/1.0 200") || text.starts_with("HTTP/1.1 200"),
            "{text}"
        );
        assert!(!text.contains("chunked"), "{text}");
        assert!(
            !text.contains("\"allow\""),
            "allows only with ?allow=true: {text}"
        );
        let line = text.lines().find(|l| l.contains("\"drop\"")).unwrap();
        let parsed: crate::verdicts::VerdictRecord = serde_json::from_str(line).unwrap();
        assert_eq!(parsed.dport, 80);
    }

    #[tokio::test]
    async fn verdicts_are_for_the_node_only_and_a_few_at_a_time() {
        let shared = served(Health::default(), Arc::default());
        let pod: std::net::IpAddr = "10.244.0.7".parse().unwrap();
        let refused = respond(&shared, "/verdicts", Some("allow=true"), pod);
        assert_eq!(refused.status(), StatusCode::FORBIDDEN);
        assert_eq!(
            shared.verdicts.subscribers(),
            0,
            "a refused client subscribes to nothing"
        );
        let local = std::net::IpAddr::from([127, 0, 0, 1]);
        let open: Vec<_> = (0..MAX_SUBSCRIBERS)
            .map(|_| respond(&shared, "/verdicts", None, local))
            .collect();
        assert!(open.iter().all(|r| r.status() == StatusCode::OK));
        let one_more = respond(&shared, "/verdicts", None, local);
        assert_eq!(one_more.status(), StatusCode::SERVICE_UNAVAILABLE);
        drop(open);
        assert_eq!(
            respond(&shared, "/verdicts", None, local).status(),
            StatusCode::OK,
            "a closed stream frees its place"
        );
        // The node report names every tenant's refused objects: the node's only.
        assert_eq!(
            respond(&shared, "/status", None, pod).status(),
            StatusCode::FORBIDDEN
        );
        assert_eq!(
            respond(&shared, "/status", None, local).status(),
            StatusCode::OK
        );
        // Health and metrics answer anyone who reaches the port (probes, scrapers).
        assert_eq!(
            respond(&shared, "/healthz", None, pod).status(),
            StatusCode::OK
        );
    }

    /// A connection over [`MAX_CONNECTIONS`] is closed without an answer, even to a whole
    /// request; a slot comes back when a connection closes; a client that says nothing is
    /// closed once its [`HEADER_TIMEOUT`] is up (the test's own bound is only there so
    /// that a server without the timeout fails rather than hangs).
    #[tokio::test]
    async fn idle_and_excess_connections_are_closed() {
        let addr = serve(
            "127.0.0.1:0".parse().unwrap(),
            served(Health::default(), Arc::default()),
        )
        .await
        .unwrap();
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        // Accepted in order: once the server has answered a request on the last idle
        // connection, every slot is taken.
        let probe = idle.last_mut().unwrap();
        probe
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: weir\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        probe.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        // That connection is closed now (one request per connection): take its slot
        // again, waiting for the server to see the close.
        idle.pop();
        let mut refused_answer = String::new();
        for _ in 0..50 {
            let mut held = tokio::net::TcpStream::connect(addr).await.unwrap();
            held.write_all(b"GET /healthz HTTP/1.1\r\nHost: weir\r\n\r\n")
                .await
                .unwrap();
            let mut buf = String::new();
            let _ = held.read_to_string(&mut buf).await;
            if buf.is_empty() {
                refused_answer = "closed".into();
                break;
            }
            // Served: the slot was free; hold a connection in it and try the next.
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            refused_answer, "closed",
            "a connection beyond {MAX_CONNECTIONS} was answered"
        );
        drop(idle);
        let mut served_again = false;
        for _ in 0..50 {
            if get(addr, "/healthz").await.starts_with("HTTP/1.1 200") {
                served_again = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            served_again,
            "the slots of closed connections are not given back"
        );
        // A client that sends nothing is closed by the server.
        let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(HEADER_TIMEOUT * 4, silent.read(&mut buf))
            .await
            .expect("a silent client's connection was never closed");
        assert!(
            matches!(read, Ok(0) | Err(_)),
            "a silent client got {read:?}"
        );
    }

    #[tokio::test]
    async fn a_port_still_held_by_the_agent_before_is_waited_for() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = held.local_addr().unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(600));
            drop(held);
        });
        let bound = serve(addr, served(Health::default(), Arc::default()))
            .await
            .expect("bound once the port was free");
        release.join().unwrap();
        assert_eq!(bound, addr);
        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
    }

    #[tokio::test]
    async fn health_readiness_and_metrics_are_served() {
        let shared = served(Health::default(), Arc::default());
        let health = shared.health.clone();
        let addr = serve("127.0.0.1:0".parse().unwrap(), shared).await.unwrap();
        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
        let not_ready = get(addr, "/readyz").await;
        assert!(not_ready.starts_with("HTTP/1.1 503"), "{not_ready}");
        assert!(
            not_ready.contains("waiting for the first complete state"),
            "{not_ready}"
        );
        health.set_ready();
        assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 200"));
        let text = get(addr, "/metrics").await;
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(
            text.contains("# TYPE weir_apply_duration_seconds histogram"),
            "{text}"
        );
        assert!(get(addr, "/nope").await.starts_with("HTTP/1.1 404"));
    }

    #[tokio::test]
    async fn status_is_served_before_and_after_the_first_report() {
        let health = Arc::new(Health::new(
            Arc::new(crate::source::event::SyncProgress::new(
                ["pods".to_string()],
            )),
            crate::daemon::run::DEFAULT_STALL,
        ));
        let reports = Arc::new(ReportBoard::default());
        let mut shared = served(Health::default(), reports.clone());
        shared.health = health;
        let addr = serve("127.0.0.1:0".parse().unwrap(), shared).await.unwrap();
        let fetch = move || tokio::task::spawn_blocking(move || super::super::report::fetch(addr));
        let early = fetch()
            .await
            .unwrap()
            .expect("a report before the first batch");
        assert!(!early.sync.complete);
        assert_eq!(early.sync.waiting, ["pods"]);
        assert_eq!(early.dataplane, None);
        reports.publish(NodeReport {
            node: Some("node-a".into()),
            dataplane: Some(crate::dataplane::DataplaneKind::Ebpf),
            converged: true,
            ..Default::default()
        });
        let later = fetch().await.unwrap().unwrap();
        assert_eq!(later.node.as_deref(), Some("node-a"));
        assert!(later.converged);
    }
}
