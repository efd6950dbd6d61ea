//! The agent's HTTP servers: health (pod-facing) and admin (loopback only).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use prometheus_client::registry::Registry;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use remora_contract::pod;

use crate::config::RunConfig;
use crate::hook::Secret;
use crate::lifecycle::LiveSettings;
use crate::metrics::Metrics;
use crate::readiness::Readiness;
use crate::supervisor::{Control, DrainOrigin, SupervisorHandle};
use crate::telemetry::LogLevelHandle;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {what} port {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Bind now (so a port in use is reported before Envoy starts), serve later.
pub async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, ServerError> {
    remora_serve::bind(addr).map_err(|source| ServerError::Bind { what, addr, source })
}

#[derive(Clone)]
struct HealthState {
    readiness: Readiness,
    metrics: Metrics,
}

/// What the app containers' preStop hook needs (see [`app_prestop`]).
#[derive(Clone)]
pub struct AppPrestop {
    /// None: there is no hook (no --hook-dir), and the endpoint refuses all.
    token: Option<Secret>,
    supervisor: SupervisorHandle,
    live: LiveSettings,
}

impl AppPrestop {
    pub fn new(token: Option<Secret>, supervisor: SupervisorHandle) -> Self {
        Self {
            token,
            live: supervisor.live.clone(),
            supervisor,
        }
    }
}

/// The pod-facing port: probes only. Nothing on it changes the agent's state.
pub fn health_router(readiness: Readiness, metrics: Metrics) -> Router {
    Router::new()
        .route("/healthz/ready", get(health_ready))
        .route("/healthz/live", get(|| async { "live\n" }))
        .with_state(HealthState { readiness, metrics })
}

/// The app containers' preStop hook (`remora-prestop`, exec'd by the kubelet
/// inside the pod, presenting the hook token from the hook volume): start
/// the drain if it has not started, and answer once the app may stop —
/// inbound traffic quiet, or at once for a fixed drain — bounded by the
/// drain deadline. A drain started this way that no SIGTERM follows is
/// undone by the supervisor.
async fn app_prestop(State(s): State<AdminState>, headers: HeaderMap) -> Response {
    let p = &s.prestop;
    let Some(token) = &p.token else {
        return (StatusCode::NOT_FOUND, "no app hook configured\n").into_response();
    };
    if !token.authorizes(bearer(&headers)) {
        return unauthorized("the hook token");
    }
    let mut quiet = p.supervisor.inbound_quiet.clone();
    if !*quiet.borrow()
        && p.supervisor
            .control
            .send(Control::Drain(DrainOrigin::AppHook))
            .await
            .is_err()
    {
        return (StatusCode::SERVICE_UNAVAILABLE, "the agent is stopping\n").into_response();
    }
    let bound = p.live.current().drain_deadline;
    match tokio::time::timeout(bound, quiet.wait_for(|q| *q)).await {
        Ok(Ok(_)) => (StatusCode::OK, "the app may stop\n").into_response(),
        Ok(Err(_)) => (StatusCode::OK, "the agent stopped\n").into_response(),
        Err(_) => (StatusCode::OK, "drain deadline reached\n").into_response(),
    }
}

fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    headers.get(header::AUTHORIZATION).map(|v| v.as_bytes())
}

fn unauthorized(what: &str) -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        format!("this action needs {what} as a bearer token\n"),
    )
        .into_response()
}

async fn health_ready(State(s): State<HealthState>) -> Response {
    let (ready, answer) = readiness_answer(&s.readiness);
    s.metrics.ready.set(i64::from(ready));
    answer
}

/// 200 when no guard is pending, else 503 listing every pending guard.
fn readiness_answer(readiness: &Readiness) -> (bool, Response) {
    let pending = readiness.pending();
    if pending.is_empty() {
        return (true, (StatusCode::OK, "ready\n").into_response());
    }
    let body: String = pending
        .iter()
        .map(|(name, reason)| format!("{name}: {reason}\n"))
        .collect();
    (
        false,
        (StatusCode::SERVICE_UNAVAILABLE, body).into_response(),
    )
}

/// The readiness the startup hold asks (`remora-agent wait`).
pub const HOLD_READY_PATH: &str = "/ready";
/// The longest [`HOLD_READY_PATH`] holds a request.
pub const HOLD_READY_MAX: Duration = Duration::from_secs(5);
/// Requests [`HOLD_READY_PATH`] holds at once; more are answered at once.
/// The port's reads are open to the app (an SSRF too): a few held requests
/// can never take the in-flight slots the app hooks need.
pub const HOLD_READY_SLOTS: usize = 4;

#[derive(Deserialize)]
struct HoldQuery {
    wait: Option<String>,
}

/// Readiness as `/healthz/ready` answers it; with `?wait=DURATION` the
/// answer comes as soon as the agent is ready, the request held up to that
/// long (at most [`HOLD_READY_MAX`]), so the startup hold lets the app start
/// the moment Envoy is ready, not at its next poll. On the loopback admin
/// port only: requests held open on the pod-facing health port would take
/// in-flight slots from the kubelet's probes; and at most
/// [`HOLD_READY_SLOTS`] at once.
async fn hold_ready(
    State(s): State<AdminState>,
    q: Result<Query<HoldQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let usage = || {
        (
            StatusCode::BAD_REQUEST,
            format!("usage: GET {HOLD_READY_PATH}[?wait=<duration, e.g. 1s>]\n"),
        )
            .into_response()
    };
    let wait = match q {
        Ok(Query(HoldQuery { wait: None })) => Duration::ZERO,
        Ok(Query(HoldQuery { wait: Some(w) })) => match remora_contract::duration::parse(&w) {
            Ok(d) => d.min(HOLD_READY_MAX),
            Err(_) => return usage(),
        },
        Err(_) => return usage(),
    };
    hold(&s.readiness, &s.holds, wait).await.1
}

/// Wait up to `wait` for readiness, if one of `holds` is free, and answer.
async fn hold(
    readiness: &Readiness,
    holds: &tokio::sync::Semaphore,
    wait: Duration,
) -> (bool, Response) {
    if let Ok(_slot) = holds.try_acquire() {
        // Not ready in time: the answer lists what is pending.
        let _ = tokio::time::timeout(wait, ready(readiness)).await;
    }
    readiness_answer(readiness)
}

/// Return once no guard is pending.
async fn ready(readiness: &Readiness) {
    // Subscribed before the check, so a change between the two is seen; the
    // sender lives in `readiness`, so `changed` cannot fail while we hold it.
    let mut changes = readiness.subscribe();
    while !readiness.is_ready() && changes.changed().await.is_ok() {}
}

#[derive(Clone)]
struct AdminState {
    registry: Arc<Registry>,
    supervisor: SupervisorHandle,
    cfg: Arc<RunConfig>,
    live: LiveSettings,
    log: LogLevelHandle,
    admin_token: Secret,
    prestop: AppPrestop,
    readiness: Readiness,
    holds: Arc<tokio::sync::Semaphore>,
}

/// The loopback port. Reads are open; what changes the agent (stop, drain,
/// log level) needs the admin token from the run dir, which an app that can
/// only make the sidecar's loopback requests (an SSRF) cannot know. The app
/// hook has its own token, which starts a drain and nothing else.
pub fn admin_router(
    readiness: Readiness,
    registry: Arc<Registry>,
    supervisor: SupervisorHandle,
    cfg: Arc<RunConfig>,
    log: LogLevelHandle,
    admin_token: Secret,
    prestop: AppPrestop,
) -> Router {
    let live = supervisor.live.clone();
    let state = AdminState {
        registry,
        supervisor,
        cfg,
        live,
        log,
        admin_token,
        prestop,
        readiness,
        holds: Arc::new(tokio::sync::Semaphore::new(HOLD_READY_SLOTS)),
    };
    let guarded = Router::new()
        .route("/quitquitquit", post(quit))
        .route("/drain", post(drain))
        .route("/logging", post(logging))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_admin_token,
        ));
    Router::new()
        .route("/metrics", get(metrics))
        .route("/debug/config", get(debug_config))
        .route(HOLD_READY_PATH, get(hold_ready))
        .route(pod::APP_PRESTOP_PATH, post(app_prestop))
        .merge(guarded)
        .with_state(state)
}

async fn require_admin_token(
    State(s): State<AdminState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if s.admin_token.authorizes(bearer(req.headers())) {
        next.run(req).await
    } else {
        tracing::warn!(path = %req.uri().path(), "admin request without the admin token refused");
        unauthorized("the admin token (the run dir's admin-token file)")
    }
}

async fn metrics(State(s): State<AdminState>) -> Response {
    let mut out = String::new();
    match prometheus_client::encoding::text::encode(&mut out, &s.registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            out,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn quit(State(s): State<AdminState>) -> Response {
    match s.supervisor.control.send(Control::Quit).await {
        Ok(()) => (StatusCode::OK, "stopping Envoy and exiting\n").into_response(),
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "already stopping\n").into_response(),
    }
}

/// Start a drain (or join the one under way) and answer when it has finished.
async fn drain(State(s): State<AdminState>) -> Response {
    let mut rx = s.supervisor.drained.clone();
    if rx.borrow().is_none()
        && s.supervisor
            .control
            .send(Control::Drain(DrainOrigin::Admin))
            .await
            .is_err()
    {
        return (StatusCode::SERVICE_UNAVAILABLE, "the agent is stopping\n").into_response();
    }
    match rx.wait_for(Option::is_some).await {
        Ok(report) => {
            let body = serde_json::to_string(&*report).unwrap_or_default();
            ([(header::CONTENT_TYPE, "application/json")], body + "\n").into_response()
        }
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "the agent stopped\n").into_response(),
    }
}

async fn debug_config(State(s): State<AdminState>) -> Response {
    let body = serde_json::json!({
        "config": s.cfg.redacted(),
        "effective_drain_settings": s.live.current(),
        "envoy": *s.supervisor.state.borrow(),
        "version": env!("CARGO_PKG_VERSION"),
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::to_string_pretty(&body).unwrap_or_default(),
    )
        .into_response()
}

#[derive(Deserialize)]
struct LevelQuery {
    level: String,
}

async fn logging(
    State(s): State<AdminState>,
    q: Result<Query<LevelQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(q)) = q else {
        return (
            StatusCode::BAD_REQUEST,
            "usage: POST /logging?level=<filter>\n",
        )
            .into_response();
    };
    match s.log.set(&q.level) {
        Ok(()) => {
            tracing::info!(level = %q.level, "log level changed");
            (StatusCode::OK, format!("log level: {}\n", q.level)).into_response()
        }
        Err(e) => (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    }
}

/// The bounds of the agent's two ports. The health port faces the pod
/// network, so anyone there can open connections to it: they are capped
/// (the oldest idle or slow one makes room for a new one, so probes get
/// through a flood) and short-lived; its requests are kubelet probes, so a
/// few dozen in flight is plenty. The admin port is loopback only, with the
/// same bounds; the app containers' preStop hooks (one each, held during the
/// drain) are among its requests.
pub fn limits() -> remora_serve::Limits {
    remora_serve::Limits {
        max_connections: 128,
        // Probes and hooks come one at a time per source; a source that
        // opens more than 128 waits its turn instead of churning.
        evict_after: Duration::from_secs(1),
        max_parked: 4096,
        max_in_flight: 32,
        header_read_timeout: Duration::from_secs(5),
        body_read_timeout: Duration::from_secs(5),
        max_header_bytes: 16 * 1024,
        tls_handshake_timeout: Duration::from_secs(5),
        // The agent is exiting: it waits at most 1 s for its servers anyway.
        // Probes and hooks open a connection each; nothing to linger for.
        drain_linger: Duration::ZERO,
        drain_grace: Duration::from_secs(1),
    }
}

/// One of the agent's bounded servers, counting into `registry` under the
/// label `server=<name>`.
pub fn server(name: &'static str, registry: &mut Registry) -> remora_serve::Server {
    let metrics = remora_serve::Metrics::register(
        registry.sub_registry_with_label(("server".into(), name.into())),
    );
    // The limits are constants that validate.
    remora_serve::Server::new(name, limits())
        .unwrap_or_else(|e| unreachable!("agent server limits: {e}"))
        .with_metrics(metrics)
}

/// Serve `router` on `listener` until `shutdown` is cancelled.
pub async fn serve(
    server: remora_serve::Server,
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
) {
    let addr = listener.local_addr().ok();
    if let Err(e) = server
        .serve(listener, router, shutdown.cancelled_owned())
        .await
    {
        tracing::error!(?addr, error = %e, "server failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::Semaphore;

    fn slots() -> Semaphore {
        Semaphore::new(HOLD_READY_SLOTS)
    }

    #[tokio::test(start_paused = true)]
    async fn a_held_check_answers_as_soon_as_the_agent_is_ready() {
        let readiness = Readiness::new();
        let envoy = readiness.register("envoy", "starting");
        let held = tokio::spawn({
            let readiness = readiness.clone();
            async move {
                let started = tokio::time::Instant::now();
                let (ready, _) = hold(&readiness, &slots(), Duration::from_secs(5)).await;
                (ready, started.elapsed())
            }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        envoy.ready();
        let (ready, after) = held.await.expect("no panic");
        assert!(ready);
        assert_eq!(after, Duration::from_millis(300), "answered on the change");
    }

    #[tokio::test(start_paused = true)]
    async fn a_held_check_says_what_is_pending_when_its_wait_ends() {
        let readiness = Readiness::new();
        let _envoy = readiness.register("envoy", "starting");
        let started = tokio::time::Instant::now();
        let (ready, answer) = hold(&readiness, &slots(), Duration::from_secs(2)).await;
        assert!(!ready);
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    }

    #[tokio::test(start_paused = true)]
    async fn checks_beyond_the_slots_are_answered_at_once() {
        let readiness = Readiness::new();
        let _envoy = readiness.register("envoy", "starting");
        let holds = slots();
        let _taken = holds
            .try_acquire_many(u32::try_from(HOLD_READY_SLOTS).expect("small"))
            .expect("free");
        let started = tokio::time::Instant::now();
        let (ready, _) = hold(&readiness, &holds, Duration::from_secs(5)).await;
        assert!(!ready);
        assert_eq!(started.elapsed(), Duration::ZERO);
    }
}
