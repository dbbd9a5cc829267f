//! The agent's HTTP endpoints: /metrics (Prometheus text), /healthz (the run loop turned
//! within `--liveness-seconds`), /readyz (the dataplane converged at least once; until
//! then a 503 whose body says why: the source still listing, with its last error, or the
//! dataplane's error), /status (the node report `weir status` reads, JSON).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use super::metrics::Metrics;
use super::report::{NodeReport, ReportBoard};
use super::run::Health;

/// What the HTTP server answers from.
#[derive(Clone)]
struct Shared {
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    reports: Arc<ReportBoard>,
}

/// `/status` before the run loop's first report: only the sources' progress is known.
fn starting_report(health: &Health) -> NodeReport {
    NodeReport {
        sync: health.sync().state(),
        ..Default::default()
    }
}

fn respond(shared: &Shared, path: &str) -> Response<Full<Bytes>> {
    let Shared {
        metrics,
        health,
        reports,
    } = shared;
    let text = |result: Result<(), String>, ok: &str| match result {
        Ok(()) => (StatusCode::OK, "text/plain", format!("{ok}\n")),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            format!("{reason}\n"),
        ),
    };
    let (code, content_type, body) = match path {
        "/metrics" => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.encode(),
        ),
        "/healthz" => text(health.liveness(), "ok"),
        "/readyz" => text(health.readiness(), "ready"),
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
    let mut response = Response::new(Full::new(Bytes::from(body)));
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

/// Binds `addr` and serves until the process ends. Returns the bound address (port 0
/// picks a free one).
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    reports: Arc<ReportBoard>,
) -> std::io::Result<SocketAddr> {
    let shared = Shared {
        metrics,
        health,
        reports,
    };
    let listener = bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            };
            let shared = shared.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let r = respond(&shared, req.uri().path());
                    async move { Ok::<_, Infallible>(r) }
                });
                if let Err(e) = http1::Builder::new()
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

    #[tokio::test]
    async fn a_port_still_held_by_the_agent_before_is_waited_for() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = held.local_addr().unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(600));
            drop(held);
        });
        let metrics = Arc::new(Metrics::new());
        let bound = serve(
            addr,
            metrics,
            Arc::new(Health::default()),
            Arc::new(ReportBoard::default()),
        )
        .await
        .expect("bound once the port was free");
        release.join().unwrap();
        assert_eq!(bound, addr);
        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
    }

    #[tokio::test]
    async fn health_readiness_and_metrics_are_served() {
        let metrics = Arc::new(Metrics::new());
        let health = Arc::new(Health::default());
        let reports = Arc::new(ReportBoard::default());
        let addr = serve(
            "127.0.0.1:0".parse().unwrap(),
            metrics,
            health.clone(),
            reports.clone(),
        )
        .await
        .unwrap();
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
        let addr = serve(
            "127.0.0.1:0".parse().unwrap(),
            Arc::new(Metrics::new()),
            health,
            reports.clone(),
        )
        .await
        .unwrap();
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
