//! The agent's HTTP endpoints: /metrics (Prometheus text), /healthz (the process
//! serves), /readyz (the dataplane converged at least once).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use super::metrics::Metrics;
use super::run::Health;

fn respond(metrics: &Metrics, health: &Health, path: &str) -> Response<Full<Bytes>> {
    let (code, content_type, body) = match path {
        "/metrics" => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.encode(),
        ),
        "/healthz" => (StatusCode::OK, "text/plain", "ok\n".to_string()),
        "/readyz" if health.is_ready() => (StatusCode::OK, "text/plain", "ready\n".to_string()),
        "/readyz" => (
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "not converged yet\n".to_string(),
        ),
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

/// Binds `addr` and serves until the process ends. Returns the bound address (port 0
/// picks a free one).
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
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
            let (metrics, health) = (metrics.clone(), health.clone());
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let r = respond(&metrics, &health, req.uri().path());
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
