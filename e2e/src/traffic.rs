//! The benchmark's traffic: clients that behave like real ones, with **no
//! retries of any kind**, sending open-loop at a fixed rate, and a precise
//! account of how each request ended.
//!
//! Each [`Load`] is one kind of client ([`Kind`]) aimed at one address (a
//! ClusterIP, a pod, the [`crate::node::ingress::LaggingIngress`]) at a rate;
//! [`Traffic::start`] runs several side by side against a shared epoch and
//! [`Traffic::stop`] returns every [`Sample`]. Requests go to the test app's
//! routes (`e2e/src/bin/test-app.rs`): `GET /`, `POST /echo`,
//! `GET /slow?ms=N` and gRPC `grpc.health.v1.Health`.
//!
//! Why no retries: hyper's pool silently resends a request it had queued on
//! a connection the server closed (`retry_canceled_requests`), and gRPC
//! clients often retry refused streams transparently; either hides exactly
//! the losses a drain causes. Here every failure is a sample, and
//! [`Outcome`] says whether the server could have seen the request.

use std::error::Error as StdError;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde::{Serialize, Serializer};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use crate::stats;

/// How long an idle keep-alive connection stays in a client's pool: the
/// 90 s of Go's `http.Transport` and hyper's default, far longer than any
/// drain, so a client stays pinned to a stopping pod unless told to leave.
pub const IDLE_KEEP_ALIVE: Duration = Duration::from_secs(90);
/// Default time a request may take before it counts as [`Outcome::Timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// The headers a failed response's detail keeps: who produced it (Envoy's
/// local replies, the ingress's own 502s).
const DETAIL_HEADERS: &[&str] = &["server", "x-envoy-", "x-ingress-", "x-pod"];
/// How much of a failed response's body its detail keeps.
const DETAIL_BODY: usize = 200;

/// A kind of client, as the benchmark's users run them.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    /// `GET /` over HTTP/1.1 keep-alive ([`IDLE_KEEP_ALIVE`] idle pool).
    Http1KeepAlive,
    /// `GET /` over `connections` HTTP/2 connections with prior knowledge
    /// (h2c), requests spread round-robin over them.
    H2c { connections: usize },
    /// `POST /echo` with a body of `body_bytes` over HTTP/1.1 keep-alive;
    /// the echoed body must come back whole.
    Post { body_bytes: usize },
    /// `GET /slow?ms=N` over HTTP/1.1 keep-alive, N spread evenly over
    /// `min..=max` (a request in flight for seconds when SIGTERM comes).
    Long { min: Duration, max: Duration },
    /// gRPC `grpc.health.v1.Health/Check` over one tonic channel.
    GrpcUnary,
    /// gRPC `grpc.health.v1.Health/Watch` over one tonic channel, each stream
    /// held `hold` (or until the traffic stops) and then closed by the
    /// client. A stream the server ends cleanly is fine; one that ends with
    /// an error status or a reset is a failure.
    GrpcStream { hold: Duration },
}

impl Kind {
    /// A short name for tables and JSON.
    pub fn label(&self) -> &'static str {
        match self {
            Kind::Http1KeepAlive => "http1",
            Kind::H2c { .. } => "h2c",
            Kind::Post { .. } => "post",
            Kind::Long { .. } => "long",
            Kind::GrpcUnary => "grpc-unary",
            Kind::GrpcStream { .. } => "grpc-stream",
        }
    }

    fn default_timeout(&self) -> Duration {
        match self {
            Kind::Long { max, .. } => *max + DEFAULT_TIMEOUT,
            _ => DEFAULT_TIMEOUT,
        }
    }
}

/// One client of the benchmark: a kind aimed at an address at a rate.
#[derive(Debug, Clone)]
pub struct Load {
    /// What samples are labelled with (default: the kind's label); name
    /// loads apart when one kind goes to two places.
    pub name: String,
    pub kind: Kind,
    /// `ip:port` served by the test app, directly or through proxies.
    pub target: SocketAddr,
    /// Requests (or streams) started per second, whatever the answers do
    /// (open loop).
    pub rate: f64,
    /// Time a request may take (for a stream: until its first message).
    pub timeout: Duration,
}

impl Load {
    pub fn new(kind: Kind, target: SocketAddr, rate: f64) -> Self {
        Self {
            name: kind.label().to_owned(),
            timeout: kind.default_timeout(),
            kind,
            target,
            rate,
        }
    }

    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// How one request ended, as precisely as the client can tell.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "class", rename_all = "snake_case")]
pub enum Outcome {
    /// A 2xx (gRPC: status OK, a stream that ended cleanly or was held to
    /// its end) with the whole body.
    Ok,
    /// Another HTTP status, e.g. 503 from Envoy; `detail` keeps the
    /// headers that say who answered (`server`, `x-envoy-*`, `x-ingress-*`)
    /// and the start of the body.
    Status {
        code: u16,
        detail: String,
    },
    /// A gRPC status other than OK from the server or a proxy (Envoy turns
    /// its local replies into `grpc-status` for gRPC requests).
    GrpcStatus {
        code: i32,
        message: String,
    },
    /// Nothing listened: the request never left.
    ConnectRefused,
    /// The connection closed before the request was written (the case
    /// hyper would have retried): the server never saw it.
    NotSent {
        detail: String,
    },
    /// The connection ended (EOF) after the request was sent, before the
    /// response was complete: an in-flight cut.
    ClosedBeforeResponse {
        detail: String,
    },
    /// The connection was reset (RST, broken pipe) with the request in
    /// flight: an in-flight cut.
    ResetInFlight {
        detail: String,
    },
    /// HTTP/2 refused the stream without processing it: `RST_STREAM
    /// REFUSED_STREAM`, or a graceful `GOAWAY` whose last stream id is below
    /// this stream's.
    StreamRefused {
        detail: String,
    },
    /// HTTP/2 reset the stream (any other `RST_STREAM`, or a `GOAWAY` with
    /// an error code) after the request was sent: it may have been processed.
    StreamReset {
        detail: String,
    },
    /// No answer within the load's timeout.
    Timeout,
    Other {
        detail: String,
    },
}

impl Outcome {
    pub fn is_ok(&self) -> bool {
        matches!(self, Outcome::Ok)
    }

    /// The variant's name, as in JSON (`"ok"`, `"status"`, ...).
    pub fn class(&self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Status { .. } => "status",
            Outcome::GrpcStatus { .. } => "grpc_status",
            Outcome::ConnectRefused => "connect_refused",
            Outcome::NotSent { .. } => "not_sent",
            Outcome::ClosedBeforeResponse { .. } => "closed_before_response",
            Outcome::ResetInFlight { .. } => "reset_in_flight",
            Outcome::StreamRefused { .. } => "stream_refused",
            Outcome::StreamReset { .. } => "stream_reset",
            Outcome::Timeout => "timeout",
            Outcome::Other { .. } => "other",
        }
    }

    /// The server certainly never processed the request: what a retrying
    /// client would resend safely, and so hide.
    pub fn unprocessed(&self) -> bool {
        matches!(
            self,
            Outcome::ConnectRefused | Outcome::NotSent { .. } | Outcome::StreamRefused { .. }
        )
    }

    /// The request was cut while in flight (HTTP/1.1 connection closed or
    /// reset under it, or an HTTP/2 stream reset after it was sent).
    pub fn in_flight_cut(&self) -> bool {
        matches!(
            self,
            Outcome::ClosedBeforeResponse { .. }
                | Outcome::ResetInFlight { .. }
                | Outcome::StreamReset { .. }
        )
    }

    /// Classifies a client error by what its source chain holds: an h2
    /// error (stream reset, GOAWAY) first, then the deepest I/O error, then
    /// hyper's own kinds (a request canceled before it was written, a
    /// message cut short, a timeout).
    pub fn from_error(err: &(dyn StdError + 'static)) -> Outcome {
        let chain: Vec<&(dyn StdError + 'static)> =
            std::iter::successors(Some(err), |e| (*e).source()).collect();
        let detail = describe(&chain);
        if let Some(h2) = chain.iter().find_map(|e| e.downcast_ref::<h2::Error>()) {
            if let Some(io) = h2.get_io() {
                return from_io(io, detail);
            }
            let reason = h2.reason().unwrap_or(h2::Reason::NO_ERROR);
            // A stream above a graceful GOAWAY's last stream id fails with
            // that GOAWAY; streams below it go on (and fail otherwise if cut).
            if (h2.is_reset() && reason == h2::Reason::REFUSED_STREAM)
                || (h2.is_go_away() && reason == h2::Reason::NO_ERROR)
            {
                return Outcome::StreamRefused { detail };
            }
            if h2.is_reset() || h2.is_go_away() {
                return Outcome::StreamReset { detail };
            }
            return Outcome::Other { detail };
        }
        let connect = chain.iter().any(|e| {
            e.downcast_ref::<hyper_util::client::legacy::Error>()
                .is_some_and(|e| e.is_connect())
        });
        if let Some(io) = chain
            .iter()
            .rev()
            .find_map(|e| e.downcast_ref::<std::io::Error>())
        {
            return match from_io(io, detail.clone()) {
                o @ (Outcome::ConnectRefused | Outcome::Timeout) => o,
                _ if connect => Outcome::Other { detail },
                o => o,
            };
        }
        if let Some(hyper) = chain.iter().find_map(|e| e.downcast_ref::<hyper::Error>()) {
            if hyper.is_canceled() {
                return Outcome::NotSent { detail };
            }
            if hyper.is_incomplete_message() {
                return Outcome::ClosedBeforeResponse { detail };
            }
            if hyper.is_timeout() {
                return Outcome::Timeout;
            }
        }
        Outcome::Other { detail }
    }

    /// A gRPC status: classified by its transport cause when it has one
    /// (tonic wraps connection errors in `Unavailable` and friends),
    /// otherwise it is the server's (or a proxy's) answer.
    pub fn from_grpc(status: &tonic::Status) -> Outcome {
        if let Some(source) = StdError::source(status) {
            return Outcome::from_error(source);
        }
        let mut message = status.message().to_owned();
        for (k, v) in &status.metadata().clone().into_headers() {
            if DETAIL_HEADERS.iter().any(|h| k.as_str().starts_with(h)) {
                message.push_str(&format!("; {k}: {}", v.to_str().unwrap_or("?")));
            }
        }
        Outcome::GrpcStatus {
            code: status.code() as i32,
            message,
        }
    }
}

fn from_io(io: &std::io::Error, detail: String) -> Outcome {
    use std::io::ErrorKind::*;
    match io.kind() {
        ConnectionRefused => Outcome::ConnectRefused,
        ConnectionReset | ConnectionAborted | BrokenPipe => Outcome::ResetInFlight { detail },
        UnexpectedEof => Outcome::ClosedBeforeResponse { detail },
        TimedOut => Outcome::Timeout,
        _ => Outcome::Other { detail },
    }
}

/// The error chain in one line, without the repeats of wrappers that
/// print their source inside their own message.
fn describe(chain: &[&(dyn StdError + 'static)]) -> String {
    let mut out: Vec<String> = Vec::new();
    for e in chain {
        let s = e.to_string();
        if !out.iter().any(|o| o.contains(&s)) {
            out.push(s);
        }
    }
    out.join(": ")
}

/// The detail of a non-2xx response: the headers of [`DETAIL_HEADERS`] and
/// the start of the body.
fn status_detail(headers: &http::HeaderMap, body: &[u8]) -> String {
    let mut parts: Vec<String> = headers
        .iter()
        .filter(|(k, _)| DETAIL_HEADERS.iter().any(|h| k.as_str().starts_with(h)))
        .map(|(k, v)| format!("{k}: {}", v.to_str().unwrap_or("?")))
        .collect();
    let body = String::from_utf8_lossy(&body[..body.len().min(DETAIL_BODY)]);
    let body = body.trim();
    if !body.is_empty() {
        parts.push(format!("body: {body}"));
    }
    parts.join("; ")
}

/// One request (or stream) and how it ended.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// The [`Load`]'s name.
    #[serde(serialize_with = "as_str")]
    pub load: Arc<str>,
    /// The [`Kind`]'s label.
    pub kind: &'static str,
    /// When it was sent, since the traffic's epoch.
    #[serde(rename = "at_ms", serialize_with = "millis")]
    pub at: Duration,
    /// Until the outcome was known; for a stream, until its first message
    /// (or its failure).
    #[serde(rename = "latency_ms", serialize_with = "millis")]
    pub latency: Duration,
    pub outcome: Outcome,
    /// The replica that answered (the test app's `x-pod`), when known.
    pub pod: Option<String>,
}

fn as_str<S: Serializer>(v: &Arc<str>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(v)
}

fn millis<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

/// Per load: how many were sent, how they ended, latency of the good ones.
#[derive(Debug, Clone, Serialize)]
pub struct LoadSummary {
    pub load: String,
    pub kind: &'static str,
    pub sent: usize,
    pub ok: usize,
    pub failed: usize,
    /// Failures by [`Outcome::class`].
    pub failures: std::collections::BTreeMap<&'static str, usize>,
    /// Latency of the successful samples.
    pub latency: stats::Summary,
}

/// One [`LoadSummary`] per load name, by name.
pub fn summarize(samples: &[Sample]) -> Vec<LoadSummary> {
    let mut by_load: std::collections::BTreeMap<&str, Vec<&Sample>> = Default::default();
    for s in samples {
        by_load.entry(&s.load).or_default().push(s);
    }
    by_load
        .into_iter()
        .map(|(load, v)| {
            let ok: Vec<f64> = v
                .iter()
                .filter(|s| s.outcome.is_ok())
                .map(|s| s.latency.as_secs_f64() * 1e3)
                .collect();
            let mut failures = std::collections::BTreeMap::new();
            for s in v.iter().filter(|s| !s.outcome.is_ok()) {
                *failures.entry(s.outcome.class()).or_insert(0) += 1;
            }
            LoadSummary {
                load: load.to_owned(),
                kind: v[0].kind,
                sent: v.len(),
                ok: ok.len(),
                failed: v.len() - ok.len(),
                failures,
                latency: stats::Summary::of(&ok),
            }
        })
        .collect()
}

/// Loads running side by side until [`Traffic::stop`].
pub struct Traffic {
    stop: watch::Sender<bool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    open: std::collections::BTreeMap<String, Arc<AtomicUsize>>,
    runs: JoinSet<()>,
}

impl Traffic {
    /// Starts every load at once; sample times are since `epoch`.
    pub fn start(loads: Vec<Load>, epoch: Instant) -> Self {
        let (stop, stopped) = watch::channel(false);
        let samples = Arc::new(Mutex::new(Vec::new()));
        let mut runs = JoinSet::new();
        let mut open: std::collections::BTreeMap<String, Arc<AtomicUsize>> = Default::default();
        for load in loads {
            let gauge = open.entry(load.name.clone()).or_default().clone();
            runs.spawn(run_load(
                load,
                epoch,
                stopped.clone(),
                samples.clone(),
                gauge,
            ));
        }
        Self {
            stop,
            samples,
            open,
            runs,
        }
    }

    /// Requests of load `name` in flight now (sent, not answered); for
    /// streams, those open (first message received) and not ended. To wait
    /// for work in flight before a scenario's next step.
    pub fn open(&self, name: &str) -> usize {
        self.open.get(name).map_or(0, |g| g.load(Ordering::SeqCst))
    }

    /// The samples finished so far (in completion order), e.g. to wait for
    /// each load to have answers before starting a scenario.
    pub fn samples(&self) -> Vec<Sample> {
        self.samples
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Stops sending, lets the requests in flight finish (each within its
    /// timeout; held streams end at once), and returns every sample, by
    /// send time.
    pub async fn stop(mut self) -> Vec<Sample> {
        let _ = self.stop.send(true);
        while self.runs.join_next().await.is_some() {}
        let mut all = std::mem::take(&mut *self.samples.lock().unwrap_or_else(|p| p.into_inner()));
        all.sort_by_key(|s| s.at);
        all
    }
}

/// The client of one load, shared by its requests.
#[derive(Clone)]
enum Clients {
    Http(Box<Client<HttpConnector, Full<Bytes>>>),
    H2c(Vec<Client<HttpConnector, Full<Bytes>>>),
    Grpc(tonic::transport::Channel),
}

fn connector() -> HttpConnector {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    c
}

/// An HTTP/1.1 keep-alive client that never retries; the pool evicts idle
/// connections after [`IDLE_KEEP_ALIVE`] (it needs a timer for that).
pub fn http1_client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new())
        .retry_canceled_requests(false)
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(IDLE_KEEP_ALIVE)
        .build(connector())
}

/// An h2c (prior knowledge) client on one connection that never retries.
pub fn h2c_client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .retry_canceled_requests(false)
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(IDLE_KEEP_ALIVE)
        .build(connector())
}

/// A tonic channel to `target` that connects on first use; tonic adds no
/// retries of its own (a failed connection fails the calls queued on it).
pub fn grpc_channel(
    target: SocketAddr,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    Ok(
        tonic::transport::Endpoint::from_shared(format!("http://{target}"))?
            .tcp_nodelay(true)
            .connect_lazy(),
    )
}

async fn run_load(
    load: Load,
    epoch: Instant,
    mut stopped: watch::Receiver<bool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    open: Arc<AtomicUsize>,
) {
    let name: Arc<str> = load.name.clone().into();
    let clients = match &load.kind {
        Kind::H2c { connections } => {
            Clients::H2c((0..(*connections).max(1)).map(|_| h2c_client()).collect())
        }
        Kind::GrpcUnary | Kind::GrpcStream { .. } => match grpc_channel(load.target) {
            Ok(c) => Clients::Grpc(c),
            Err(e) => {
                let sample = Sample {
                    load: name,
                    kind: load.kind.label(),
                    at: Instant::now().duration_since(epoch),
                    latency: Duration::ZERO,
                    outcome: Outcome::Other {
                        detail: format!("gRPC endpoint: {e}"),
                    },
                    pod: None,
                };
                samples
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(sample);
                return;
            }
        },
        _ => Clients::Http(Box::new(http1_client())),
    };
    let load = Arc::new(load);
    let period = Duration::from_secs_f64(1.0 / load.rate.max(1e-3));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut inflight = JoinSet::new();
    let mut n: u64 = 0;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopped.wait_for(|s| *s) => break,
        }
        // Reap finished requests so the set stays small in long runs.
        while inflight.try_join_next().is_some() {}
        let (load, clients, name, samples, stopped, open) = (
            load.clone(),
            clients.clone(),
            name.clone(),
            samples.clone(),
            stopped.clone(),
            open.clone(),
        );
        let seq = n;
        n += 1;
        inflight.spawn(async move {
            let sent = Instant::now();
            let answer = one(&load, &clients, seq, stopped, &open).await;
            let sample = Sample {
                load: name,
                kind: load.kind.label(),
                at: sent.duration_since(epoch),
                latency: answer.first.unwrap_or_else(|| sent.elapsed()),
                outcome: answer.outcome,
                pod: answer.pod,
            };
            samples
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(sample);
        });
    }
    while inflight.join_next().await.is_some() {}
}

/// One in-flight request on a load's gauge, for as long as it lives.
struct Open<'a>(&'a AtomicUsize);

impl<'a> Open<'a> {
    fn new(gauge: &'a AtomicUsize) -> Self {
        gauge.fetch_add(1, Ordering::SeqCst);
        Self(gauge)
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How a request ended, who answered, and (for a stream) when its first
/// message came.
struct Answer {
    outcome: Outcome,
    pod: Option<String>,
    first: Option<Duration>,
}

impl From<(Outcome, Option<String>)> for Answer {
    fn from((outcome, pod): (Outcome, Option<String>)) -> Self {
        Self {
            outcome,
            pod,
            first: None,
        }
    }
}

/// The `seq`-th request of a load.
async fn one(
    load: &Load,
    clients: &Clients,
    seq: u64,
    stopped: watch::Receiver<bool>,
    open: &AtomicUsize,
) -> Answer {
    if let (Kind::GrpcStream { hold }, Clients::Grpc(ch)) = (&load.kind, clients) {
        return grpc_stream(ch.clone(), load.timeout, *hold, stopped, open).await;
    }
    let _open = Open::new(open);
    let base = format!("http://{}", load.target);
    match (&load.kind, clients) {
        (Kind::Http1KeepAlive, Clients::Http(c)) => {
            http(c, get(&format!("{base}/")), load.timeout, None)
                .await
                .into()
        }
        (Kind::H2c { .. }, Clients::H2c(cs)) => {
            let c = &cs[seq as usize % cs.len()];
            http(c, get(&format!("{base}/")), load.timeout, None)
                .await
                .into()
        }
        (Kind::Post { body_bytes }, Clients::Http(c)) => {
            let body = Bytes::from(vec![b'x'; *body_bytes]);
            let req = http::Request::post(format!("{base}/echo"))
                .header(http::header::CONTENT_TYPE, "application/octet-stream")
                .body(Full::new(body));
            http(c, req, load.timeout, Some(*body_bytes)).await.into()
        }
        (Kind::Long { min, max }, Clients::Http(c)) => {
            let ms = spread(seq, *min, *max).as_millis();
            http(c, get(&format!("{base}/slow?ms={ms}")), load.timeout, None)
                .await
                .into()
        }
        (Kind::GrpcUnary, Clients::Grpc(ch)) => grpc_unary(ch.clone(), load.timeout).await.into(),
        (kind, _) => (
            Outcome::Other {
                detail: format!("no client for {kind:?}"),
            },
            None,
        )
            .into(),
    }
}

/// The `seq`-th point of a low-discrepancy sequence over `min..=max`:
/// evenly spread, the same in every run, no random source needed.
pub fn spread(seq: u64, min: Duration, max: Duration) -> Duration {
    const GOLDEN: f64 = 0.618_033_988_749_895;
    let x = (seq as f64 * GOLDEN).fract();
    min + (max.saturating_sub(min)).mul_f64(x)
}

fn get(url: &str) -> http::Result<http::Request<Full<Bytes>>> {
    http::Request::get(url).body(Full::new(Bytes::new()))
}

fn pod_of(headers: &http::HeaderMap) -> Option<String> {
    headers
        .get("x-pod")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Sends `req`, reads the whole answer; with `echo`, the body must be
/// that many bytes.
async fn http(
    client: &Client<HttpConnector, Full<Bytes>>,
    req: http::Result<http::Request<Full<Bytes>>>,
    timeout: Duration,
    echo: Option<usize>,
) -> (Outcome, Option<String>) {
    let req = match req {
        Ok(r) => r,
        Err(e) => {
            return (
                Outcome::Other {
                    detail: format!("request: {e}"),
                },
                None,
            );
        }
    };
    let exchange = async {
        let resp = match client.request(req).await {
            Ok(r) => r,
            Err(e) => return (Outcome::from_error(&e), None),
        };
        let (parts, body) = resp.into_parts();
        let pod = pod_of(&parts.headers);
        let body = match body.collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return (Outcome::from_error(&e), pod),
        };
        let outcome = if !parts.status.is_success() {
            Outcome::Status {
                code: parts.status.as_u16(),
                detail: status_detail(&parts.headers, &body),
            }
        } else if echo.is_some_and(|n| n != body.len()) {
            Outcome::Other {
                detail: format!("echo: {} bytes back of {}", body.len(), echo.unwrap_or(0)),
            }
        } else {
            Outcome::Ok
        };
        (outcome, pod)
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or((Outcome::Timeout, None))
}

fn grpc_pod(meta: &tonic::metadata::MetadataMap) -> Option<String> {
    meta.get("x-pod")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

async fn grpc_unary(
    channel: tonic::transport::Channel,
    timeout: Duration,
) -> (Outcome, Option<String>) {
    let mut client = HealthClient::new(channel);
    let call = client.check(HealthCheckRequest::default());
    match tokio::time::timeout(timeout, call).await {
        Err(_) => (Outcome::Timeout, None),
        Ok(Err(status)) => (Outcome::from_grpc(&status), grpc_pod(status.metadata())),
        Ok(Ok(resp)) => {
            let pod = grpc_pod(resp.metadata());
            // SERVING is 1; anything else is the app saying it cannot serve.
            let outcome = match resp.into_inner().status {
                1 => Outcome::Ok,
                s => Outcome::Other {
                    detail: format!("health status {s}"),
                },
            };
            (outcome, pod)
        }
    }
}

/// Opens a Watch stream, waits for its first message (within `timeout`:
/// the answer's `first`), then holds it for `hold` or until the traffic
/// stops. A stream the server ends cleanly is fine; an error is not.
async fn grpc_stream(
    channel: tonic::transport::Channel,
    timeout: Duration,
    hold: Duration,
    mut stopped: watch::Receiver<bool>,
    open: &AtomicUsize,
) -> Answer {
    let sent = Instant::now();
    let mut client = HealthClient::new(channel);
    let opened = async {
        let resp = client.watch(HealthCheckRequest::default()).await?;
        let pod = grpc_pod(resp.metadata());
        let mut stream = resp.into_inner();
        let msg = stream.message().await?;
        Ok::<_, tonic::Status>((stream, msg, pod))
    };
    let (mut stream, pod) = match tokio::time::timeout(timeout, opened).await {
        Err(_) => return (Outcome::Timeout, None).into(),
        Ok(Err(status)) => {
            return (Outcome::from_grpc(&status), grpc_pod(status.metadata())).into();
        }
        Ok(Ok((_, None, pod))) => return (Outcome::Ok, pod).into(),
        Ok(Ok((stream, Some(_), pod))) => (stream, pod),
    };
    let first = Some(sent.elapsed());
    let _open = Open::new(open);
    let held = tokio::time::sleep(hold);
    tokio::pin!(held);
    let outcome = loop {
        tokio::select! {
            _ = &mut held => break Outcome::Ok,
            _ = stopped.wait_for(|s| *s) => break Outcome::Ok,
            msg = stream.message() => match msg {
                Ok(Some(_)) => continue,
                Ok(None) => break Outcome::Ok,
                Err(status) => break Outcome::from_grpc(&status),
            },
        }
    };
    Answer {
        outcome,
        pod,
        first,
    }
}

/// Test servers: read a request's head off `s` (up to the blank line, or
/// until the peer stops sending).
#[cfg(test)]
pub(crate) async fn read_request_head(s: &mut tokio::net::TcpStream) {
    use tokio::io::AsyncReadExt as _;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::{TcpListener, TcpStream};

    /// A server taking one connection at a time and handing it to `then`
    /// once the request's headers are in.
    async fn raw_server<F, Fut>(then: F) -> SocketAddr
    where
        F: Fn(TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                read_request_head(&mut s).await;
                then(s).await;
            }
        });
        addr
    }

    async fn get_once(addr: SocketAddr, timeout: Duration) -> Outcome {
        http(
            &http1_client(),
            get(&format!("http://{addr}/")),
            timeout,
            None,
        )
        .await
        .0
    }

    #[tokio::test]
    async fn connection_refused() {
        let addr = TcpListener::bind("127.0.0.1:0")
            .await
            .and_then(|l| l.local_addr())
            .expect("a free port");
        assert_eq!(
            get_once(addr, DEFAULT_TIMEOUT).await,
            Outcome::ConnectRefused
        );
    }

    #[tokio::test]
    async fn closed_after_the_request_is_an_in_flight_cut() {
        let addr = raw_server(|mut s| async move {
            let _ = s.shutdown().await;
        })
        .await;
        let o = get_once(addr, DEFAULT_TIMEOUT).await;
        assert!(matches!(o, Outcome::ClosedBeforeResponse { .. }), "{o:?}");
        assert!(o.in_flight_cut() && !o.unprocessed());
    }

    #[tokio::test]
    async fn reset_after_the_request_is_an_in_flight_cut() {
        let addr = raw_server(|s| async move {
            // RST instead of FIN on close.
            let _ = s.set_zero_linger();
            drop(s);
        })
        .await;
        let o = get_once(addr, DEFAULT_TIMEOUT).await;
        assert!(matches!(o, Outcome::ResetInFlight { .. }), "{o:?}");
    }

    #[tokio::test]
    async fn an_error_status_keeps_who_answered() {
        let addr = raw_server(|mut s| async move {
            let body = "no healthy upstream";
            let _ = s
                .write_all(
                    format!(
                        "HTTP/1.1 503 Service Unavailable\r\nserver: envoy\r\nx-envoy-overloaded: true\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    )
                    .as_bytes(),
                )
                .await;
        })
        .await;
        match get_once(addr, DEFAULT_TIMEOUT).await {
            Outcome::Status { code, detail } => {
                assert_eq!(code, 503);
                for part in [
                    "server: envoy",
                    "x-envoy-overloaded: true",
                    "no healthy upstream",
                ] {
                    assert!(detail.contains(part), "{part:?} not in {detail:?}");
                }
            }
            o => panic!("{o:?}"),
        }
    }

    #[tokio::test]
    async fn no_answer_is_a_timeout() {
        let addr = raw_server(|s| async move {
            tokio::time::sleep(Duration::from_secs(5)).await;
            drop(s);
        })
        .await;
        assert_eq!(
            get_once(addr, Duration::from_millis(200)).await,
            Outcome::Timeout
        );
    }

    /// An h2c server that reads the client's preface and first HEADERS
    /// frame, then writes `frame` (a hand-made frame for stream 1) and
    /// keeps the connection open a while.
    async fn h2_server(frame: Vec<u8>) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let mut preface = [0u8; 24];
            if s.read_exact(&mut preface).await.is_err() {
                return;
            }
            // Our SETTINGS (empty), and the ACK of the client's.
            let _ = s.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await;
            let _ = s.write_all(&[0, 0, 0, 4, 1, 0, 0, 0, 0]).await;
            loop {
                let mut head = [0u8; 9];
                if s.read_exact(&mut head).await.is_err() {
                    return;
                }
                let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                let mut payload = vec![0u8; len];
                if s.read_exact(&mut payload).await.is_err() {
                    return;
                }
                if head[3] == 1 {
                    break;
                }
            }
            let _ = s.write_all(&frame).await;
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        addr
    }

    fn rst_stream(code: u32) -> Vec<u8> {
        let mut f = vec![0, 0, 4, 3, 0, 0, 0, 0, 1];
        f.extend_from_slice(&code.to_be_bytes());
        f
    }

    fn go_away(last_stream: u32, code: u32) -> Vec<u8> {
        let mut f = vec![0, 0, 8, 7, 0, 0, 0, 0, 0];
        f.extend_from_slice(&last_stream.to_be_bytes());
        f.extend_from_slice(&code.to_be_bytes());
        f
    }

    async fn h2_once(frame: Vec<u8>) -> Outcome {
        let addr = h2_server(frame).await;
        http(
            &h2c_client(),
            get(&format!("http://{addr}/")),
            DEFAULT_TIMEOUT,
            None,
        )
        .await
        .0
    }

    #[tokio::test]
    async fn h2_refused_stream_is_unprocessed() {
        let o = h2_once(rst_stream(0x7)).await;
        assert!(matches!(o, Outcome::StreamRefused { .. }), "{o:?}");
        assert!(o.unprocessed());
    }

    #[tokio::test]
    async fn h2_graceful_goaway_below_the_stream_is_unprocessed() {
        let o = h2_once(go_away(0, 0x0)).await;
        assert!(matches!(o, Outcome::StreamRefused { .. }), "{o:?}");
    }

    #[tokio::test]
    async fn h2_reset_after_sending_may_have_been_processed() {
        // INTERNAL_ERROR, as Envoy resets a stream whose upstream died.
        let o = h2_once(rst_stream(0x2)).await;
        assert!(matches!(o, Outcome::StreamReset { .. }), "{o:?}");
        assert!(o.in_flight_cut() && !o.unprocessed());
    }

    #[test]
    fn a_grpc_status_without_a_transport_cause_is_the_servers() {
        let o = Outcome::from_grpc(&tonic::Status::unavailable("no healthy upstream"));
        assert_eq!(
            o,
            Outcome::GrpcStatus {
                code: 14,
                message: "no healthy upstream".into()
            }
        );
    }

    #[test]
    fn long_requests_spread_over_their_range() {
        let (min, max) = (Duration::from_secs(2), Duration::from_secs(20));
        let v: Vec<Duration> = (0..100).map(|i| spread(i, min, max)).collect();
        assert!(v.iter().all(|d| *d >= min && *d <= max));
        let mid = Duration::from_secs(11);
        let low = v.iter().filter(|d| **d < mid).count();
        assert!((40..=60).contains(&low), "{low} of 100 below the middle");
    }

    #[test]
    fn summaries_count_failures_by_class() {
        let s = |load: &str, outcome: Outcome, ms: u64| Sample {
            load: load.into(),
            kind: "http1",
            at: Duration::ZERO,
            latency: Duration::from_millis(ms),
            outcome,
            pod: None,
        };
        let sum = summarize(&[
            s("a", Outcome::Ok, 10),
            s("a", Outcome::Ok, 30),
            s("a", Outcome::ConnectRefused, 1),
            s("b", Outcome::Timeout, 10_000),
        ]);
        assert_eq!(sum.len(), 2);
        assert_eq!((sum[0].sent, sum[0].ok, sum[0].failed), (3, 2, 1));
        assert_eq!(sum[0].failures.get("connect_refused"), Some(&1));
        assert_eq!(sum[0].latency.max_ms, 30.0);
        assert_eq!((sum[1].ok, sum[1].failures.get("timeout")), (0, Some(&1)));
    }
}
