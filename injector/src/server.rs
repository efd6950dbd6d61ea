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
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::leader::LeaderMetrics;
use crate::webhook::{AdmissionOutcome, Injector, encode_review, unreadable};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("accept: {0}")]
    Accept(#[source] std::io::Error),
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

/// The injector's own metrics registry.
pub struct Metrics {
    registry: Registry,
    admissions: Family<OutcomeLabels, Counter>,
    latency: Histogram,
    /// Handed to the SidecarLifecycle controller.
    pub controller: crate::controller::ControllerMetrics,
    /// Handed to the Jobs controller.
    pub jobs: crate::jobs::JobsMetrics,
    in_flight: Gauge,
    /// Leader election state, kept by the elector.
    pub leader: LeaderMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("remora_injector");
        let admissions = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "admissions",
            "Admission reviews answered, by outcome",
            admissions.clone(),
        );
        // 50µs .. ~1.6s
        let latency = Histogram::new(exponential_buckets(0.00005, 2.0, 16));
        registry.register(
            "admission_duration_seconds",
            "Time to answer one admission review, body read included",
            latency.clone(),
        );
        let controller = crate::controller::ControllerMetrics::register(&mut registry);
        let jobs = crate::jobs::JobsMetrics::register(&mut registry);
        let in_flight = Gauge::default();
        registry.register(
            "admissions_in_flight",
            "Admission reviews being read or answered now",
            in_flight.clone(),
        );
        let leader = LeaderMetrics::default();
        leader.register(&mut registry);
        Self {
            registry,
            admissions,
            latency,
            controller,
            jobs,
            in_flight,
            leader,
        }
    }

    pub fn observe(&self, outcome: AdmissionOutcome, took: Duration) {
        self.admissions
            .get_or_create(&OutcomeLabels {
                outcome: outcome.as_str(),
            })
            .inc();
        self.latency.observe(took.as_secs_f64());
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

pub struct AppState {
    pub injector: Injector,
    pub metrics: Metrics,
    pub max_body_bytes: usize,
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
        state.metrics.encode(),
    )
        .into_response()
}

/// Counts a request in flight until dropped (answered or cut off).
struct InFlight(Gauge);

impl InFlight {
    fn new(g: &Gauge) -> Self {
        g.inc();
        Self(g.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

async fn inject(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let start = Instant::now();
    let _in_flight = InFlight::new(&state.metrics.in_flight);
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
