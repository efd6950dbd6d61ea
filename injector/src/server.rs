//! The HTTPS server: `POST /inject`, `/healthz`, `/metrics`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::webhook::{AdmissionOutcome, Injector, Metrics, encode_review, unreadable};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("accept: {0}")]
    Accept(#[source] std::io::Error),
}

/// The prefix of every metric the injector exports.
pub const METRICS_PREFIX: &str = "remora_injector";

pub struct AppState {
    pub injector: Injector,
    /// The webhook's own, kept by `/inject`.
    pub metrics: Metrics,
    /// Every component's metrics: what `/metrics` encodes.
    pub registry: Registry,
    pub max_body_bytes: usize,
}

impl AppState {
    /// A webhook server alone (tests, the benchmark): its registry holds
    /// the webhook's metrics only.
    pub fn new(injector: Injector, max_body_bytes: usize) -> Self {
        let mut registry = Registry::with_prefix(METRICS_PREFIX);
        Self {
            injector,
            metrics: Metrics::register(&mut registry),
            registry,
            max_body_bytes,
        }
    }

    fn encode_metrics(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/inject", post(inject))
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.encode_metrics(),
    )
        .into_response()
}

async fn inject(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let start = Instant::now();
    let _in_flight = state.metrics.in_flight();
    let (review, outcome) = match axum::body::to_bytes(req.into_body(), state.max_body_bytes).await
    {
        Ok(body) => state.injector.review(&body),
        Err(e) => (
            unreadable(
                String::new(),
                &format!(
                    "request body unreadable or over {} bytes: {e}",
                    state.max_body_bytes
                ),
            ),
            AdmissionOutcome::Invalid,
        ),
    };
    let body = match encode_review(review) {
        Ok(b) => b,
        Err(e) => {
            state
                .metrics
                .observe(AdmissionOutcome::Error, start.elapsed());
            return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response();
        }
    };
    state.metrics.observe(outcome, start.elapsed());
    if outcome != AdmissionOutcome::Injected {
        tracing::debug!(outcome = outcome.as_str(), "admission answered");
    }
    (
        [(header::CONTENT_TYPE, "application/json")],
        Body::from(body),
    )
        .into_response()
}

/// How long in-flight requests get by default once shutdown begins.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Serve `app` over TLS on `listener` until `shutdown` resolves, then drain
/// for up to [`DEFAULT_SHUTDOWN_GRACE`]; see [`serve_tls_draining`].
pub async fn serve_tls(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    app: Router,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), ServerError> {
    serve_tls_draining(listener, tls, app, shutdown, DEFAULT_SHUTDOWN_GRACE)
        .await
        .map(|_| ())
}

/// How a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    /// Connections still open at the deadline, closed by force.
    pub forced: usize,
}

/// Serve `app` over TLS on `listener` until `shutdown` resolves. Then stop
/// accepting (the listener is closed), let every connection finish the
/// request it is in (idle keep-alive connections close at once), and after
/// `grace` close whatever is left.
pub async fn serve_tls_draining(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    app: Router,
    shutdown: impl std::future::Future<Output = ()>,
    grace: Duration,
) -> Result<Drained, ServerError> {
    let acceptor = TlsAcceptor::from(tls);
    // Tells the connections to finish their request and close.
    let draining = CancellationToken::new();
    let mut conns = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            biased;
            () = &mut shutdown => break,
            // Reap finished connections as we go.
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            r = listener.accept() => r.map_err(ServerError::Accept)?,
        };
        let _ = stream.set_nodelay(true);
        let acceptor = acceptor.clone();
        let app = app.clone();
        let draining = draining.clone();
        conns.spawn(async move {
            let handshake = tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream));
            let tls = tokio::select! {
                // A handshake not done when draining starts carries no request yet.
                () = draining.cancelled() => return,
                r = handshake => match r {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, error = %e, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "TLS handshake timed out");
                        return;
                    }
                },
            };
            let svc = TowerToHyperService::new(app);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(30))
                .keep_alive(true)
                .serve_connection(TokioIo::new(tls), svc);
            tokio::pin!(conn);
            let r = tokio::select! {
                r = conn.as_mut() => r,
                () = draining.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = r {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    draining.cancel();
    let open = conns.len();
    tracing::info!(connections = open, ?grace, "webhook server draining");
    let drained =
        tokio::time::timeout(grace, async { while conns.join_next().await.is_some() {} }).await;
    let forced = if drained.is_err() {
        let n = conns.len();
        tracing::warn!(
            connections = n,
            ?grace,
            "shutdown grace over; closing connections"
        );
        conns.shutdown().await;
        n
    } else {
        0
    };
    Ok(Drained { forced })
}
