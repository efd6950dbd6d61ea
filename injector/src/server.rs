//! The HTTPS server: `POST /inject`, `/healthz` (live), `/readyz` (ready:
//! says what is pending), `/metrics`.
//!
//! Memory per review is bounded twice: the body may not exceed
//! `--max-request-bytes`, and the reviews being read and answered at once
//! share a budget (`--review-memory-budget`) counted as [`REVIEW_COST`]
//! times their body size (the body, read into one buffer and freed once
//! parsed; what is kept of the pod; the answer). A review waits for budget at most [`BUDGET_WAIT`], then
//! gets a fast 503 (the API server then applies the webhook's failurePolicy).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use prometheus_client::registry::Registry;
use remora_serve::readiness::Readiness;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::webhook::{AdmissionOutcome, Injector, Metrics, encode_review, unreadable};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Serve(#[from] remora_serve::ServeError),
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
    /// What `/readyz` reports.
    pub readiness: Readiness,
    /// Memory of the reviews in progress, in KiB.
    pub budget: ReviewBudget,
}

/// How many times its body size a review costs while it is handled: the
/// body (read into one buffer, freed once parsed), the one partial parse of
/// the pod, the patch and the encoded answer, and the allocator's slack. Since the
/// review is parsed once and what is never read is skipped, one 4 MiB
/// review grows the injector by about 13 MiB (hostile-bench; 49 MiB before).
pub const REVIEW_COST: usize = 4;
/// How long a review waits for memory budget before a 503.
pub const BUDGET_WAIT: Duration = Duration::from_secs(2);
/// The default of `--review-memory-budget`.
pub const DEFAULT_REVIEW_MEMORY_BUDGET: usize = 24 << 20;

/// The memory the reviews in progress may hold, shared by all of them.
#[derive(Clone)]
pub struct ReviewBudget {
    kib: Arc<Semaphore>,
    total_kib: u32,
}

impl ReviewBudget {
    pub fn new(bytes: usize) -> Self {
        let total_kib = u32::try_from(bytes.div_ceil(1024))
            .unwrap_or(u32::MAX)
            .clamp(1, Semaphore::MAX_PERMITS as u32);
        Self {
            kib: Arc::new(Semaphore::new(total_kib as usize)),
            total_kib,
        }
    }

    /// The share of a review of `body_bytes`, waited for up to `wait`; a
    /// review larger than the whole budget takes all of it.
    async fn acquire(
        &self,
        body_bytes: usize,
        wait: Duration,
    ) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let kib = u32::try_from(body_bytes.saturating_mul(REVIEW_COST).div_ceil(1024))
            .unwrap_or(u32::MAX)
            .clamp(1, self.total_kib);
        tokio::time::timeout(wait, Arc::clone(&self.kib).acquire_many_owned(kib))
            .await
            .ok()?
            .ok()
    }
}

impl AppState {
    /// A webhook server alone (tests, the benchmark): its registry holds
    /// the webhook's metrics only; ready at once.
    pub fn new(injector: Injector, max_body_bytes: usize) -> Self {
        let mut registry = Registry::with_prefix(METRICS_PREFIX);
        Self {
            injector,
            metrics: Metrics::register(&mut registry),
            registry,
            max_body_bytes,
            readiness: Readiness::new(),
            budget: ReviewBudget::new(DEFAULT_REVIEW_MEMORY_BUDGET),
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
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let pending = state.readiness.pending();
    if pending.is_empty() {
        return (StatusCode::OK, "ready\n").into_response();
    }
    let mut body = String::from("not ready:\n");
    for (name, reason) in pending {
        body.push_str(&format!("  {name}: {reason}\n"));
    }
    (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
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
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    // Chunked: it may be as large as allowed.
    let size = declared.unwrap_or(state.max_body_bytes);
    if size > state.max_body_bytes {
        // Refused before a byte of it is read.
        let review = unreadable(
            String::new(),
            &format!(
                "request body of {size} bytes is over the limit of {} bytes",
                state.max_body_bytes
            ),
        );
        return json_review(review, &state, AdmissionOutcome::Invalid, start);
    }
    let Some(_budget) = state.budget.acquire(size, BUDGET_WAIT).await else {
        state
            .metrics
            .observe(AdmissionOutcome::Overloaded, start.elapsed());
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::CONNECTION, "close")],
            "remora-injector: over its memory budget for reviews in progress; try again\n",
        )
            .into_response();
    };
    let (review, outcome) = match read_body(req.into_body(), declared, state.max_body_bytes).await {
        Ok(body) => {
            // The body is freed as soon as it is parsed, before the answer
            // (which may wait for a namespace lookup) is worked out. Parsing
            // megabytes takes milliseconds of CPU: off the runtime's
            // workers, so probes and other reviews are not held up.
            let parsed = tokio::task::spawn_blocking(move || {
                let parsed = Injector::parse(&body);
                drop(body);
                parsed
            })
            .await
            .unwrap_or_else(|e| {
                Err(Box::new((
                    unreadable(String::new(), &format!("parsing the review failed: {e}")),
                    AdmissionOutcome::Invalid,
                )))
            });
            match parsed {
                Ok(req) => state.injector.answer(req).await,
                Err(answer) => *answer,
            }
        }
        Err(e) => (
            unreadable(String::new(), &format!("request body {e}")),
            AdmissionOutcome::Invalid,
        ),
    };
    json_review(review, &state, outcome, start)
}

#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("is over the limit of {limit} bytes")]
    TooLarge { limit: usize },
    #[error("could not be read: {0}")]
    Read(#[source] axum::Error),
}

/// The body, copied chunk by chunk into one buffer of the declared size
/// (at most `limit`), each chunk freed as soon as it is copied: a review
/// holds its body once. Collecting the chunks and then joining them held
/// it twice, and every chunk kept alive the whole read buffer it was cut
/// from (under 64 concurrent 4 MiB reviews: 2.25x the idle RSS).
pub async fn read_body(
    body: Body,
    declared: Option<usize>,
    limit: usize,
) -> Result<Vec<u8>, BodyError> {
    use futures::StreamExt;
    let mut out = Vec::with_capacity(declared.unwrap_or(0).min(limit));
    let mut chunks = body.into_data_stream();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(BodyError::Read)?;
        if out.len().saturating_add(chunk.len()) > limit {
            return Err(BodyError::TooLarge { limit });
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// Encode the answer to a review, counting it under `outcome`.
fn json_review(
    review: kube::core::admission::AdmissionReview<kube::core::DynamicObject>,
    state: &AppState,
    outcome: AdmissionOutcome,
    start: Instant,
) -> Response {
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

/// The webhook port's bounds. Its clients are the API servers (a few
/// keep-alive connections each, requests of at most `--max-request-bytes`
/// that they give up on after the webhook's timeout, 10 s by default) and
/// the kubelet's probes; anyone on the pod network can reach it too.
/// How long a draining webhook server keeps its open connections serving,
/// each answer closing its connection.
pub const DRAIN_LINGER: Duration = Duration::from_secs(2);

pub fn limits(grace: Duration) -> remora_serve::Limits {
    remora_serve::Limits {
        max_connections: 256,
        evict_after: Duration::from_secs(1),
        max_parked: 4096,
        max_in_flight: 128,
        // API servers keep idle connections for 90 s; closing ours after 30 s
        // costs them a new handshake now and then, not an error.
        header_read_timeout: Duration::from_secs(30),
        body_read_timeout: Duration::from_secs(10),
        max_header_bytes: 64 * 1024,
        tls_handshake_timeout: Duration::from_secs(10),
        // The API server reuses idle keep-alive connections: a drain that
        // closed them at once failed a webhook call now and then during a
        // rollout of the injector ("write: broken pipe", not retried).
        drain_linger: DRAIN_LINGER.min(grace),
        drain_grace: grace,
    }
}

/// The webhook server, counting into `registry` when given one.
pub fn webhook_server(
    tls: Arc<rustls::ServerConfig>,
    grace: Duration,
    registry: Option<&mut Registry>,
) -> Result<remora_serve::Server, ServerError> {
    let mut server = remora_serve::Server::new("webhook", limits(grace))?.with_tls(tls);
    if let Some(registry) = registry {
        server = server.with_metrics(remora_serve::Metrics::register(
            registry.sub_registry_with_label(("server".into(), "webhook".into())),
        ));
    }
    Ok(server)
}

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

pub use remora_serve::Drained;

/// Serve `app` over TLS on `listener`, bounded by [`limits`], until
/// `shutdown` resolves. Then stop accepting, let every connection finish
/// the request it is in (idle keep-alive connections close at once), and
/// after `grace` close whatever is left.
pub async fn serve_tls_draining(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    app: Router,
    shutdown: impl std::future::Future<Output = ()>,
    grace: Duration,
) -> Result<Drained, ServerError> {
    Ok(webhook_server(tls, grace, None)?
        .serve(listener, app, shutdown)
        .await?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::webhook::StaticView;
    use tower::ServiceExt;

    fn state(max_body_bytes: usize, budget: usize) -> AppState {
        let injector = Injector {
            chart: Default::default(),
            operator_namespace: "remora-system".into(),
            view: Arc::new(StaticView::default()),
        };
        AppState {
            budget: ReviewBudget::new(budget),
            ..AppState::new(injector, max_body_bytes)
        }
    }

    async fn call(state: &Arc<AppState>, req: Request) -> (StatusCode, String) {
        let res = router(Arc::clone(state))
            .oneshot(req)
            .await
            .unwrap_or_else(|never| match never {});
        let status = res.status();
        let body = axum::body::to_bytes(res.into_body(), 1 << 20)
            .await
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        (status, body)
    }

    fn inject_request(body: Body, content_length: Option<usize>) -> Request {
        let mut b = Request::post("/inject").header(header::CONTENT_TYPE, "application/json");
        if let Some(n) = content_length {
            b = b.header(header::CONTENT_LENGTH, n);
        }
        b.body(body).unwrap_or_else(|e| panic!("request: {e}"))
    }

    #[tokio::test]
    async fn readyz_names_what_is_pending_and_healthz_stays_live() {
        let state = Arc::new(state(1 << 20, 1 << 20));
        let guard = state
            .readiness
            .register("cluster-view", "listing SidecarLifecycles and namespaces");
        let get = |p: &str| {
            Request::get(p)
                .body(Body::empty())
                .unwrap_or_else(|e| panic!("{e}"))
        };
        let (status, body) = call(&state, get("/readyz")).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("cluster-view: listing"), "{body}");
        assert_eq!(call(&state, get("/healthz")).await.0, StatusCode::OK);
        guard.ready();
        assert_eq!(call(&state, get("/readyz")).await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn a_declared_body_over_the_limit_is_answered_without_reading_it() {
        let state = Arc::new(state(1024, 1 << 20));
        // A body that never comes: only the header is looked at.
        let (_tx, rx) = tokio::sync::mpsc::channel::<Result<axum::body::Bytes, std::io::Error>>(1);
        let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
        let (status, text) = call(&state, inject_request(body, Some(4096))).await;
        assert_eq!(status, StatusCode::OK);
        let v: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(v["kind"], "AdmissionReview");
        assert!(
            v["response"]["status"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("over the limit of 1024 bytes")),
            "{v}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn reviews_over_the_memory_budget_wait_then_get_a_503() {
        // Room for one review of 1 KiB (REVIEW_COST KiB of budget), not two.
        let state = Arc::new(state(1 << 20, REVIEW_COST * 1024 * 3 / 2));
        let held = state.budget.acquire(1024, BUDGET_WAIT).await;
        assert!(held.is_some());
        let t = tokio::time::Instant::now();
        let (status, body) = call(
            &state,
            inject_request(Body::from(vec![b'{'; 1024]), Some(1024)),
        )
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(body.contains("memory budget"), "{body}");
        assert_eq!(t.elapsed(), BUDGET_WAIT);
        // Once the first is done, the next gets its turn (an unreadable
        // body still gets a valid AdmissionReview back).
        drop(held);
        let (status, body) = call(
            &state,
            inject_request(Body::from(vec![b'{'; 1024]), Some(1024)),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(body.contains("AdmissionReview"), "{body}");
    }

    /// A chunk that counts its own drop, the way a chunk of hyper's keeps
    /// its read buffer alive until dropped.
    struct Counted(Vec<u8>, Arc<std::sync::atomic::AtomicUsize>);
    impl AsRef<[u8]> for Counted {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }
    impl Drop for Counted {
        fn drop(&mut self) {
            self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn the_body_is_read_into_one_buffer_freeing_each_chunk_once_copied() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        const CHUNKS: usize = 64;
        const CHUNK: usize = 16 << 10;
        let dropped = Arc::new(AtomicUsize::new(0));
        // Before handing out chunk i, the most chunks still alive.
        let held_most = Arc::new(AtomicUsize::new(0));
        let stream = {
            let (dropped, held_most) = (Arc::clone(&dropped), Arc::clone(&held_most));
            futures::stream::iter(0..CHUNKS).map(move |i| {
                let alive = i - dropped.load(Ordering::SeqCst);
                held_most.fetch_max(alive, Ordering::SeqCst);
                let c = Counted(vec![b'a' + (i % 26) as u8; CHUNK], Arc::clone(&dropped));
                Ok::<_, std::io::Error>(axum::body::Bytes::from_owner(c))
            })
        };
        use futures::StreamExt;
        let body = read_body(
            Body::from_stream(stream),
            Some(CHUNKS * CHUNK),
            CHUNKS * CHUNK,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(body.len(), CHUNKS * CHUNK);
        assert_eq!(
            body.capacity(),
            CHUNKS * CHUNK,
            "one buffer of the declared size"
        );
        assert!(body[..CHUNK].iter().all(|&b| b == b'a'));
        assert!(body[CHUNK..2 * CHUNK].iter().all(|&b| b == b'b'));
        assert_eq!(
            held_most.load(Ordering::SeqCst),
            0,
            "a chunk was kept while the next was read"
        );
    }

    #[tokio::test]
    async fn a_chunked_body_over_the_limit_is_refused_while_read() {
        let chunks = futures::stream::iter(
            (0..4).map(|_| Ok::<_, std::io::Error>(axum::body::Bytes::from(vec![b'x'; 512]))),
        );
        let r = read_body(Body::from_stream(chunks), None, 1024).await;
        assert!(
            matches!(r, Err(BodyError::TooLarge { limit: 1024 })),
            "{r:?}"
        );
    }

    #[test]
    fn a_review_larger_than_the_budget_takes_all_of_it_not_more() {
        let b = ReviewBudget::new(10 << 10);
        assert_eq!(b.total_kib, 10);
        let b = ReviewBudget::new(0);
        assert_eq!(
            b.total_kib, 1,
            "a zero budget still lets one review through"
        );
    }
}
