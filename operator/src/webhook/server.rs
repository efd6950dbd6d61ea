//! The HTTPS server: `POST /inject`, `/healthz` (live), `/readyz` (ready:
//! says what is pending), `/metrics`.
//!
//! Memory per review is bounded three ways: the body may not exceed
//! `--max-request-bytes`; the reviews being read and answered at once share
//! a budget (`--review-memory-budget`), charged [`REVIEW_COST`] times the
//! body bytes that have ARRIVED (the body, read into one buffer and freed
//! once parsed; what is kept of the pod; the answer), never its declared
//! size; and one client address may hold at most a quarter of that budget
//! and [`MAX_REVIEWS_PER_CLIENT`] reviews at once. A review waits for the
//! budget at most [`BUDGET_WAIT`] in all, then gets a fast 503 (the API
//! server then applies the webhook's failurePolicy); a client over its own
//! share gets a 503 at once. The API server sends a review at once, so a
//! body must keep arriving ([`Pace`]): a client dribbling it is cut off
//! within about a second, and what it held is freed.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use prometheus_client::registry::Registry;
use remora_serve::readiness::Readiness;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::webhook::handler::{AdmissionOutcome, Injector, Metrics};
use remora_inject::review::{self, unreadable};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Serve(#[from] remora_serve::ServeError),
}

/// The prefix of every metric the operator exports.
pub const METRICS_PREFIX: &str = "remora_operator";

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
/// the pod, the patch and the encoded answer, and the allocator's slack
/// (hostile-bench measures it).
pub const REVIEW_COST: usize = 4;
/// How long a review waits for memory budget, in all, before a 503.
pub const BUDGET_WAIT: Duration = Duration::from_secs(2);
/// The default of `--review-memory-budget`.
pub const DEFAULT_REVIEW_MEMORY_BUDGET: usize = 24 << 20;
/// One client address may hold this fraction of the budget at once. A
/// quarter of the default (6 MiB) covers a review of a 1.5 MiB pod (etcd's
/// default object limit) in full; a single review is never refused for
/// being larger than the share (its charge stops growing there).
pub const CLIENT_SHARE_DIVISOR: u32 = 4;
/// Requests the webhook server handles at once (`max_in_flight` of
/// [`limits`]).
pub const MAX_IN_FLIGHT: usize = 128;
/// Reviews one client address may have in progress at once: half the
/// server's request places, so that one client cannot hold them all. An
/// API server sends one per pod being admitted, a few milliseconds each:
/// 64 at once is a burst of thousands of pods a second per replica.
pub const MAX_REVIEWS_PER_CLIENT: usize = MAX_IN_FLIGHT / 2;

/// How fast a review's body must arrive. The API server writes a review in
/// one go, so anything slower is a client holding a place on purpose (or a
/// broken one): the next bytes must come within `max_gap` of the last ones,
/// and after `grace`, at `min_rate` bytes a second on average. A 10 KiB
/// review must thus be in within about 1.2 s, and a body dribbled a byte at
/// a time is cut off after about a second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    pub grace: Duration,
    /// Bytes per second, on average since the body began (after `grace`).
    pub min_rate: u64,
    pub max_gap: Duration,
}

impl Default for Pace {
    fn default() -> Self {
        Self {
            grace: Duration::from_secs(1),
            min_rate: 64 * 1024,
            max_gap: Duration::from_secs(1),
        }
    }
}

impl Pace {
    /// When more of a body that began at `start`, of which `received`
    /// bytes came, the last at `last`, must have arrived.
    fn due(
        &self,
        start: tokio::time::Instant,
        last: tokio::time::Instant,
        received: usize,
    ) -> tokio::time::Instant {
        let rate = self.min_rate.max(1);
        let received = received as u64;
        let earned = Duration::from_secs(received / rate)
            + Duration::from_nanos((received % rate) * 1_000_000_000 / rate);
        after(start, self.grace.saturating_add(earned)).min(after(last, self.max_gap))
    }
}

/// `t + d`, or about 30 years on when that overflows: a huge configured
/// pace must not panic.
fn after(t: tokio::time::Instant, d: Duration) -> tokio::time::Instant {
    t.checked_add(d)
        .or_else(|| t.checked_add(Duration::from_secs(86_400 * 365 * 30)))
        .unwrap_or(t)
}

/// Why a review gets no (more) memory budget.
#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    #[error("{client} has {MAX_REVIEWS_PER_CLIENT} reviews in progress already")]
    ClientReviews { client: IpAddr },
    #[error("{client} holds its share of the memory budget for reviews ({share_kib} KiB)")]
    ClientShare { client: IpAddr, share_kib: u32 },
    #[error("over its memory budget for reviews in progress")]
    Exhausted,
}

/// The memory the reviews in progress may hold, shared by all of them, and
/// what each client address holds of it.
#[derive(Clone)]
pub struct ReviewBudget {
    kib: Arc<Semaphore>,
    total_kib: u32,
    share_kib: u32,
    pace: Pace,
    clients: Arc<Mutex<HashMap<IpAddr, Held>>>,
}

/// What one client holds: reviews in progress, KiB of budget.
#[derive(Default)]
struct Held {
    reviews: usize,
    kib: u32,
}

impl ReviewBudget {
    pub fn new(bytes: usize) -> Self {
        let total_kib = u32::try_from(bytes.div_ceil(1024))
            .unwrap_or(u32::MAX)
            .clamp(1, Semaphore::MAX_PERMITS as u32);
        Self {
            kib: Arc::new(Semaphore::new(total_kib as usize)),
            total_kib,
            share_kib: (total_kib / CLIENT_SHARE_DIVISOR).max(1),
            pace: Pace::default(),
            clients: Arc::default(),
        }
    }

    /// The same budget, with bodies held to `pace`.
    pub fn with_pace(mut self, pace: Pace) -> Self {
        self.pace = pace;
        self
    }

    pub fn total_kib(&self) -> u32 {
        self.total_kib
    }

    /// What one client address may hold at once.
    pub fn share_kib(&self) -> u32 {
        self.share_kib
    }

    /// KiB of the budget free now.
    pub fn available_kib(&self) -> usize {
        self.kib.available_permits()
    }

    /// KiB `client` holds now.
    pub fn held_by(&self, client: IpAddr) -> u32 {
        self.lock().get(&client).map_or(0, |h| h.kib)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, Held>> {
        self.clients.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Opens the account of one review from `client`, holding nothing yet;
    /// refused when the client has [`MAX_REVIEWS_PER_CLIENT`] in progress.
    pub fn open(&self, client: IpAddr) -> Result<Charge, BudgetError> {
        let mut clients = self.lock();
        let held = clients.entry(client).or_default();
        if held.reviews >= MAX_REVIEWS_PER_CLIENT {
            return Err(BudgetError::ClientReviews { client });
        }
        held.reviews += 1;
        Ok(Charge {
            budget: self.clone(),
            client,
            permit: None,
            kib: 0,
            waited: Duration::ZERO,
        })
    }
}

/// What one review holds of the budget; given back when dropped.
pub struct Charge {
    budget: ReviewBudget,
    client: IpAddr,
    permit: Option<OwnedSemaphorePermit>,
    /// Held, of the budget and of the client's share alike.
    kib: u32,
    /// Time spent waiting for the budget so far.
    waited: Duration,
}

impl Charge {
    /// KiB held now.
    pub fn kib(&self) -> u32 {
        self.kib
    }

    /// Grow what this review holds to cover `body_bytes` of body (at most
    /// the client's share): from the client's share at once or not at all,
    /// then from the budget, waiting at most `wait` over the review's life.
    pub async fn cover(&mut self, body_bytes: usize, wait: Duration) -> Result<(), BudgetError> {
        let want = u32::try_from(body_bytes.saturating_mul(REVIEW_COST).div_ceil(1024))
            .unwrap_or(u32::MAX)
            .clamp(1, self.budget.share_kib);
        let Some(more) = want.checked_sub(self.kib).filter(|m| *m > 0) else {
            return Ok(());
        };
        {
            let mut clients = self.budget.lock();
            let held = clients.entry(self.client).or_default();
            if held.kib.saturating_add(more) > self.budget.share_kib {
                return Err(BudgetError::ClientShare {
                    client: self.client,
                    share_kib: self.budget.share_kib,
                });
            }
            held.kib += more;
        }
        let left = wait.saturating_sub(self.waited);
        let t = tokio::time::Instant::now();
        let got =
            tokio::time::timeout(left, Arc::clone(&self.budget.kib).acquire_many_owned(more)).await;
        self.waited += t.elapsed();
        match got {
            Ok(Ok(permit)) => {
                match &mut self.permit {
                    Some(p) => p.merge(permit),
                    None => self.permit = Some(permit),
                }
                self.kib = want;
                Ok(())
            }
            // Timed out (the semaphore is never closed).
            _ => {
                if let Some(held) = self.budget.lock().get_mut(&self.client) {
                    held.kib = held.kib.saturating_sub(more);
                }
                Err(BudgetError::Exhausted)
            }
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        drop(self.permit.take());
        let mut clients = self.budget.lock();
        if let Some(held) = clients.get_mut(&self.client) {
            held.kib = held.kib.saturating_sub(self.kib);
            held.reviews = held.reviews.saturating_sub(1);
            if held.reviews == 0 {
                clients.remove(&self.client);
            }
        }
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
    // Without an address (the router called directly): one shared account.
    let client = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |c| c.0.ip());
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if let Some(size) = declared.filter(|d| *d > state.max_body_bytes) {
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
    let mut charge = match state.budget.open(client) {
        Ok(charge) => charge,
        Err(e) => return overloaded(&state, &e, start),
    };
    let body = read_body(req.into_body(), declared, state.max_body_bytes, &mut charge).await;
    let (review, outcome) = match body {
        Ok(body) => {
            // The body is freed as soon as it is parsed, before the answer
            // (which may wait for a namespace lookup) is worked out. Parsing
            // megabytes takes milliseconds of CPU: off the runtime's
            // workers, so probes and other reviews are not held up.
            let parsed = tokio::task::spawn_blocking(move || {
                let parsed = review::parse(&body);
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
        Err(BodyError::Budget(e)) => return overloaded(&state, &e, start),
        Err(e @ BodyError::TooSlow { .. }) => {
            state
                .metrics
                .observe(AdmissionOutcome::Invalid, start.elapsed());
            tracing::debug!(%client, error = %e, "review body cut off");
            return (
                StatusCode::REQUEST_TIMEOUT,
                [(header::CONNECTION, "close")],
                format!("remora-operator: request body {e}\n"),
            )
                .into_response();
        }
        Err(e) => (
            unreadable(String::new(), &format!("request body {e}")),
            AdmissionOutcome::Invalid,
        ),
    };
    let res = json_review(review, &state, outcome, start);
    drop(charge);
    res
}

/// A fast 503 (the API server applies the webhook's failurePolicy), and
/// the connection closed: its client should not go on sending on it.
fn overloaded(state: &AppState, e: &BudgetError, start: Instant) -> Response {
    state
        .metrics
        .observe(AdmissionOutcome::Overloaded, start.elapsed());
    tracing::debug!(error = %e, "review refused");
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::CONNECTION, "close")],
        format!("remora-operator: {e}; try again\n"),
    )
        .into_response()
}

#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("is over the limit of {limit} bytes")]
    TooLarge { limit: usize },
    #[error("could not be read: {0}")]
    Read(#[source] axum::Error),
    #[error("arrived too slowly ({received} bytes in {elapsed:?}; a review must be sent at once)")]
    TooSlow { received: usize, elapsed: Duration },
    #[error(transparent)]
    Budget(#[from] BudgetError),
}

/// The body, copied chunk by chunk into one buffer of the declared size
/// (at most `limit`; allocated once the first bytes are in), each chunk
/// freed as soon as it is copied: a review holds its body once, and no
/// chunk keeps alive the read buffer it was cut from. `charge` grows with
/// every chunk, before it is copied; a body slower than the budget's
/// [`Pace`] is cut off (time spent waiting for the budget is not the
/// client's).
pub async fn read_body(
    body: Body,
    declared: Option<usize>,
    limit: usize,
    charge: &mut Charge,
) -> Result<Vec<u8>, BodyError> {
    use futures::StreamExt;
    let pace = charge.budget.pace;
    let began = tokio::time::Instant::now();
    // The body's clock: began, moved on by each wait for the budget.
    let mut start = began;
    let mut last = began;
    let mut out = Vec::new();
    let mut chunks = body.into_data_stream();
    loop {
        let due = pace.due(start, last, out.len());
        let Ok(next) = tokio::time::timeout_at(due, chunks.next()).await else {
            return Err(BodyError::TooSlow {
                received: out.len(),
                elapsed: began.elapsed(),
            });
        };
        let Some(chunk) = next else { break };
        let chunk = chunk.map_err(BodyError::Read)?;
        if chunk.is_empty() {
            continue;
        }
        let len = out.len().saturating_add(chunk.len());
        if len > limit {
            return Err(BodyError::TooLarge { limit });
        }
        let t = tokio::time::Instant::now();
        charge.cover(len, BUDGET_WAIT).await?;
        let now = tokio::time::Instant::now();
        start += now - t;
        last = now;
        if out.capacity() == 0 {
            out.reserve_exact(declared.unwrap_or(0).min(limit).max(len));
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
    let body = match review::encode(review) {
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
        max_in_flight: MAX_IN_FLIGHT,
        // API servers keep idle connections for 90 s; closing ours after 30 s
        // costs them a new handshake now and then, not an error.
        header_read_timeout: Duration::from_secs(30),
        body_read_timeout: Duration::from_secs(10),
        max_header_bytes: 64 * 1024,
        tls_handshake_timeout: Duration::from_secs(10),
        // The API server reuses idle keep-alive connections: a drain that
        // closed them at once failed a webhook call now and then during a
        // rollout of the operator ("write: broken pipe", not retried).
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
    use crate::webhook::view::StaticView;
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

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
    }

    /// Holds `kib` of the budget for `client`, as a review whose body came.
    async fn hold(budget: &ReviewBudget, client: IpAddr, kib: u32) -> Charge {
        let mut charge = budget.open(client).unwrap_or_else(|e| panic!("open: {e}"));
        charge
            .cover(kib as usize * 1024 / REVIEW_COST, BUDGET_WAIT)
            .await
            .unwrap_or_else(|e| panic!("cover: {e}"));
        assert_eq!(charge.kib(), kib);
        charge
    }

    #[tokio::test(start_paused = true)]
    async fn reviews_over_the_memory_budget_wait_then_get_a_503() {
        // 16 KiB, 4 KiB a client: four other clients hold all of it.
        let state = Arc::new(state(1 << 20, 16 << 10));
        assert_eq!(state.budget.share_kib(), 4);
        let mut held = Vec::new();
        for i in 2..6 {
            held.push(hold(&state.budget, ip(i), 4).await);
        }
        let t = tokio::time::Instant::now();
        let (status, body) = call(
            &state,
            inject_request(Body::from(vec![b'{'; 1024]), Some(1024)),
        )
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(body.contains("memory budget"), "{body}");
        assert_eq!(t.elapsed(), BUDGET_WAIT);
        // Once one is done, the next gets its turn (an unreadable body
        // still gets a valid AdmissionReview back).
        held.pop();
        let (status, body) = call(
            &state,
            inject_request(Body::from(vec![b'{'; 1024]), Some(1024)),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(body.contains("AdmissionReview"), "{body}");
        assert_eq!(
            state.budget.available_kib(),
            4,
            "the refused and the answered review gave back what they held"
        );
        drop(held);
        assert_eq!(state.budget.available_kib(), 16);
        assert!(
            state.budget.lock().is_empty(),
            "no client is remembered once done"
        );
    }

    /// A body fed by the test, chunk by chunk.
    fn fed_body() -> (
        tokio::sync::mpsc::Sender<Result<axum::body::Bytes, std::io::Error>>,
        Body,
    ) {
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        (
            tx,
            Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)),
        )
    }

    /// Yields until `f` holds, for at most a (paused) second.
    async fn until(what: &str, f: impl Fn() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        while !f() {
            assert!(tokio::time::Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_review_is_charged_for_the_bytes_that_came_not_the_size_it_declares() {
        let state = Arc::new(state(4 << 20, 24 << 20));
        let client = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
        let (tx, body) = fed_body();
        let review = {
            let state = Arc::clone(&state);
            tokio::spawn(async move { call(&state, inject_request(body, Some(4 << 20))).await })
        };
        // A 4 MiB declaration: nothing is held before the body comes.
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(state.budget.held_by(client), 0);
        let send = |n: usize| {
            let tx = tx.clone();
            async move {
                tx.send(Ok(axum::body::Bytes::from(vec![b' '; n])))
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
            }
        };
        send(1024).await;
        until("1 KiB charged", || state.budget.held_by(client) == 4).await;
        send(255 * 1024).await;
        until("256 KiB charged", || state.budget.held_by(client) == 1024).await;
        assert_eq!(state.budget.available_kib(), (24 << 10) - 1024);
        // Then it stops: cut off by the pace, and what it held freed.
        let (status, text) = review.await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(status, StatusCode::REQUEST_TIMEOUT, "{text}");
        assert_eq!(state.budget.available_kib(), 24 << 10);
        assert_eq!(state.budget.held_by(client), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dribbled_body_is_cut_off_after_about_a_second() {
        let state = Arc::new(state(4 << 20, 24 << 20));
        let (tx, body) = fed_body();
        let t = tokio::time::Instant::now();
        let review = {
            let state = Arc::clone(&state);
            tokio::spawn(async move { call(&state, inject_request(body, Some(4 << 20))).await })
        };
        // Two bytes a second: never a gap of a second, far under the rate.
        let dribble = tokio::spawn(async move {
            loop {
                if tx
                    .send(Ok(axum::body::Bytes::from_static(b" ")))
                    .await
                    .is_err()
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        let (status, text) = review.await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(status, StatusCode::REQUEST_TIMEOUT, "{text}");
        assert!(text.contains("too slowly"), "{text}");
        // 1 s of grace plus what 3 bytes earn at 64 KiB/s (and the timer's
        // millisecond).
        let took = t.elapsed();
        assert!(
            took >= Duration::from_secs(1) && took < Duration::from_millis(1010),
            "{took:?}"
        );
        dribble.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stops_for_a_second_is_cut_off_and_one_sent_at_once_is_not() {
        let state = Arc::new(state(4 << 20, 24 << 20));
        let (tx, body) = fed_body();
        let t = tokio::time::Instant::now();
        let review = {
            let state = Arc::clone(&state);
            tokio::spawn(async move { call(&state, inject_request(body, Some(4 << 20))).await })
        };
        // 1 MiB at once earns 16 s by the rate; the gap still ends it.
        tx.send(Ok(axum::body::Bytes::from(vec![b' '; 1 << 20])))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let (status, _) = review.await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(status, StatusCode::REQUEST_TIMEOUT);
        assert_eq!(t.elapsed(), Pace::default().max_gap);
        drop(tx);
        // The same megabyte sent whole is read (and found not to be a review).
        let (status, text) = call(
            &state,
            inject_request(Body::from(vec![b' '; 1 << 20]), Some(1 << 20)),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{text}");
        assert!(text.contains("AdmissionReview"), "{text}");
    }

    #[tokio::test(start_paused = true)]
    async fn time_spent_waiting_for_the_budget_is_not_held_against_the_body() {
        let state = Arc::new(state(1 << 20, 16 << 10));
        let mut held = Vec::new();
        for i in 2..6 {
            held.push(hold(&state.budget, ip(i), 4).await);
        }
        let (tx, body) = fed_body();
        let review = {
            let state = Arc::clone(&state);
            tokio::spawn(async move { call(&state, inject_request(body, Some(2048))).await })
        };
        tx.send(Ok(axum::body::Bytes::from(vec![b' '; 1024])))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        // The first KiB waits 1.5 s for room, past the 1 s of grace.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        held.pop();
        tokio::time::sleep(Duration::from_millis(400)).await;
        tx.send(Ok(axum::body::Bytes::from(vec![b' '; 1024])))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        drop(tx);
        let (status, text) = review.await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(status, StatusCode::OK, "{text}");
        assert!(text.contains("AdmissionReview"), "{text}");
    }

    #[tokio::test]
    async fn a_client_holds_at_most_its_share_and_its_reviews_and_others_are_unaffected() {
        let budget = ReviewBudget::new(16 << 10);
        // One review alone may grow to the share (no further), however big.
        let mut big = budget.open(ip(2)).unwrap_or_else(|e| panic!("{e}"));
        big.cover(1 << 20, BUDGET_WAIT)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(big.kib(), budget.share_kib());
        // A second review of the same client gets nothing, at once.
        let mut second = budget.open(ip(2)).unwrap_or_else(|e| panic!("{e}"));
        let r = second.cover(1, BUDGET_WAIT).await;
        assert!(
            matches!(r, Err(BudgetError::ClientShare { share_kib: 4, .. })),
            "{r:?}"
        );
        // Another client is unaffected.
        let _other = hold(&budget, ip(3), 4).await;
        drop((big, second));
        assert_eq!(budget.held_by(ip(2)), 0);

        // Reviews in progress: at most MAX_REVIEWS_PER_CLIENT a client.
        let open: Vec<Charge> = (0..MAX_REVIEWS_PER_CLIENT)
            .map(|_| budget.open(ip(4)).unwrap_or_else(|e| panic!("{e}")))
            .collect();
        let r = budget.open(ip(4));
        assert!(
            matches!(r, Err(BudgetError::ClientReviews { .. })),
            "{:?}",
            r.err()
        );
        assert!(budget.open(ip(5)).is_ok(), "another client still gets in");
        drop(open);
        assert!(budget.open(ip(4)).is_ok());
    }

    #[tokio::test]
    async fn the_client_address_comes_from_the_connection() {
        let state = Arc::new(state(1 << 20, 16 << 10));
        // ip(2) holds its share: its next review is refused, with a reason.
        let _held = hold(&state.budget, ip(2), 4).await;
        let mut req = inject_request(Body::from(vec![b'{'; 10]), Some(10));
        req.extensions_mut()
            .insert(ConnectInfo(SocketAddr::new(ip(2), 40000)));
        let (status, text) = call(&state, req).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
        assert!(text.contains("127.0.0.2 holds its share"), "{text}");
        let mut req = inject_request(Body::from(vec![b'{'; 10]), Some(10));
        req.extensions_mut()
            .insert(ConnectInfo(SocketAddr::new(ip(3), 40000)));
        assert_eq!(call(&state, req).await.0, StatusCode::OK);
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
        let budget = ReviewBudget::new(24 << 20);
        let mut charge = budget.open(ip(2)).unwrap_or_else(|e| panic!("{e}"));
        let body = read_body(
            Body::from_stream(stream),
            Some(CHUNKS * CHUNK),
            CHUNKS * CHUNK,
            &mut charge,
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
        let budget = ReviewBudget::new(24 << 20);
        let mut charge = budget.open(ip(2)).unwrap_or_else(|e| panic!("{e}"));
        let r = read_body(Body::from_stream(chunks), None, 1024, &mut charge).await;
        assert!(
            matches!(r, Err(BodyError::TooLarge { limit: 1024 })),
            "{r:?}"
        );
    }

    #[test]
    fn the_budget_and_the_share_of_a_client_are_never_zero() {
        let b = ReviewBudget::new(10 << 10);
        assert_eq!((b.total_kib(), b.share_kib()), (10, 2));
        let b = ReviewBudget::new(0);
        assert_eq!(
            (b.total_kib(), b.share_kib()),
            (1, 1),
            "a zero budget still lets one review through"
        );
    }
}
