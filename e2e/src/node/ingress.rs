//! An ingress-like L7 hop that lags behind the endpoints, as cloud load
//! balancers and ingress controllers do: [`LaggingIngress`] forwards
//! HTTP/1.1 requests round-robin to its current endpoints over a
//! keep-alive upstream pool, and [`EndpointFeed`] tells it the endpoints of
//! a Service's EndpointSlices only after a configurable lag.
//!
//! Like nginx with `proxy_next_upstream off`: no retries and no next
//! upstream. An upstream error becomes a 502 whose `x-ingress-error` header
//! says why (the classes of [`crate::traffic::Outcome`]), so the client
//! sees every loss the hop causes or passes on. Hop-by-hop headers stay on
//! their hop: an upstream's `connection: close` (a draining Envoy's signal)
//! closes the upstream connection only, never the client's, as with a
//! real ingress.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt as _, Full};
use hyper::body::{Bytes, Incoming};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use crate::traffic::Outcome;

/// The header of the ingress's own error answers: `<class>: <detail>`.
pub const ERROR_HEADER: &str = "x-ingress-error";
/// The header naming the endpoint a request went to (on every answer
/// that had one).
pub const UPSTREAM_HEADER: &str = "x-ingress-upstream";
/// How long an idle upstream connection stays pooled (nginx's upstream
/// `keepalive_timeout` default).
pub const UPSTREAM_IDLE: Duration = Duration::from_secs(60);
/// How long an upstream may take to answer (nginx's `proxy_read_timeout`
/// default); then a 504.
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(60);

/// Headers that belong to one hop (RFC 9110 §7.6.1).
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("binding the ingress on 127.0.0.1: {0}")]
    Bind(#[source] std::io::Error),
    #[error("the EndpointSlice watch of Service {service} listed nothing in {timeout:?}")]
    FirstList { service: String, timeout: Duration },
}

/// An endpoint set, sorted.
pub type Endpoints = Vec<SocketAddr>;

/// One change of the endpoint set: when the feed saw it and when the
/// ingress applied it (`applied - seen` is the lag).
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    pub seen: Instant,
    pub applied: Instant,
    pub endpoints: Endpoints,
    pub added: Endpoints,
    pub removed: Endpoints,
}

/// The endpoint set an ingress follows, each change published `lag` after
/// it was seen, in order. Fed by hand ([`EndpointFeed::manual`]) or from a
/// Service's EndpointSlices ([`EndpointFeed::from_slices`]); the initial
/// set is applied at once (the ingress was configured long before).
pub struct EndpointFeed {
    seen: mpsc::UnboundedSender<(Instant, Endpoints)>,
    applied: watch::Receiver<Endpoints>,
    changes: Arc<Mutex<Vec<Change>>>,
    tasks: Vec<JoinHandle<()>>,
}

impl EndpointFeed {
    /// A feed that changes only when [`EndpointFeed::push`] says so.
    pub fn manual(initial: Endpoints, lag: Duration) -> Self {
        let (seen, rx) = mpsc::unbounded_channel();
        let initial = sorted(initial);
        let (tx, applied) = watch::channel(initial.clone());
        let now = Instant::now();
        let changes = Arc::new(Mutex::new(vec![Change {
            seen: now,
            applied: now,
            added: initial.clone(),
            removed: Vec::new(),
            endpoints: initial,
        }]));
        let task = tokio::spawn(delay_line(rx, lag, tx, changes.clone()));
        Self {
            seen,
            applied,
            changes,
            tasks: vec![task],
        }
    }

    /// Follows the ready endpoints (`conditions.ready == true`, so
    /// terminating ones are out, as ingress controllers do) of Service
    /// `service` in `slices`' namespace, with kube's watcher; `port`: the
    /// slice port of that name (a Service's port name), else the first.
    /// Returns once the first list is in, applied at once.
    pub async fn from_slices(
        slices: Api<EndpointSlice>,
        service: &str,
        port: Option<&str>,
        lag: Duration,
    ) -> Result<Self, Error> {
        let (first_tx, first) = oneshot::channel();
        let (changes_tx, changes_rx) = mpsc::unbounded_channel();
        let follower = tokio::spawn(follow_slices(
            slices,
            service.to_owned(),
            port.map(str::to_owned),
            first_tx,
            changes_tx,
        ));
        let timeout = Duration::from_secs(30);
        let initial = match tokio::time::timeout(timeout, first).await {
            Ok(Ok(eps)) => eps,
            _ => {
                follower.abort();
                return Err(Error::FirstList {
                    service: service.to_owned(),
                    timeout,
                });
            }
        };
        let mut feed = Self::manual(initial, lag);
        // The follower's changes go through the same delay line as pushes.
        let seen = feed.seen.clone();
        let relay = tokio::spawn(async move {
            let mut changes_rx = changes_rx;
            while let Some(change) = changes_rx.recv().await {
                if seen.send(change).is_err() {
                    return;
                }
            }
        });
        feed.tasks.extend([follower, relay]);
        Ok(feed)
    }

    /// A change of the set, seen now.
    pub fn push(&self, endpoints: Endpoints) {
        let _ = self.seen.send((Instant::now(), sorted(endpoints)));
    }

    /// The applied set, for [`LaggingIngress::start`].
    pub fn receiver(&self) -> watch::Receiver<Endpoints> {
        self.applied.clone()
    }

    /// The set the ingress uses now.
    pub fn current(&self) -> Endpoints {
        self.applied.borrow().clone()
    }

    /// Every applied change so far (the initial set first).
    pub fn changes(&self) -> Vec<Change> {
        self.changes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for EndpointFeed {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn sorted(mut eps: Endpoints) -> Endpoints {
    eps.sort();
    eps.dedup();
    eps
}

/// Publishes each seen change at `seen + lag`, one after the other, so
/// order is kept whatever the lag.
async fn delay_line(
    mut seen: mpsc::UnboundedReceiver<(Instant, Endpoints)>,
    lag: Duration,
    out: watch::Sender<Endpoints>,
    changes: Arc<Mutex<Vec<Change>>>,
) {
    while let Some((at, endpoints)) = seen.recv().await {
        tokio::time::sleep_until(at + lag).await;
        let before = out.send_replace(endpoints.clone());
        let change = Change {
            seen: at,
            applied: Instant::now(),
            added: endpoints
                .iter()
                .filter(|e| !before.contains(e))
                .copied()
                .collect(),
            removed: before
                .iter()
                .filter(|e| !endpoints.contains(e))
                .copied()
                .collect(),
            endpoints,
        };
        changes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(change);
    }
}

/// The ready endpoints of one slice on the chosen port.
pub fn ready_addresses(slice: &EndpointSlice, port: Option<&str>) -> Endpoints {
    let ports = slice.ports.iter().flatten();
    let number = match port {
        Some(name) => ports
            .filter(|p| p.name.as_deref() == Some(name))
            .find_map(|p| p.port),
        None => ports.clone().find_map(|p| p.port),
    };
    let Some(number) = number.and_then(|n| u16::try_from(n).ok()) else {
        return Vec::new();
    };
    slice
        .endpoints
        .iter()
        .flatten()
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
        .filter_map(|e| e.addresses.first()?.parse().ok())
        .map(|ip| SocketAddr::new(ip, number))
        .collect()
}

/// Follows the Service's slices with kube's watcher (relists included) and
/// sends the union of their ready endpoints each time it changes: the first
/// on `first`, the next ones with the time they were seen on `changes`.
async fn follow_slices(
    slices: Api<EndpointSlice>,
    service: String,
    port: Option<String>,
    first: oneshot::Sender<Endpoints>,
    changes: mpsc::UnboundedSender<(Instant, Endpoints)>,
) {
    use futures::StreamExt as _;
    use kube::runtime::WatchStreamExt as _;
    use kube::runtime::watcher::{self, Event};
    let config =
        watcher::Config::default().labels(&format!("kubernetes.io/service-name={service}"));
    let events = watcher::watcher(slices, config).default_backoff();
    let mut events = std::pin::pin!(events);
    let mut first = Some(first);
    let mut by_slice: BTreeMap<String, Endpoints> = BTreeMap::new();
    let mut relisting: Option<BTreeMap<String, Endpoints>> = None;
    let mut last: Option<Endpoints> = None;
    let name = |s: &EndpointSlice| s.metadata.name.clone().unwrap_or_default();
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Init) => relisting = Some(BTreeMap::new()),
            Ok(Event::InitApply(s)) => {
                if let Some(r) = relisting.as_mut() {
                    r.insert(name(&s), ready_addresses(&s, port.as_deref()));
                }
            }
            Ok(Event::InitDone) => by_slice = relisting.take().unwrap_or_default(),
            Ok(Event::Apply(s)) => {
                by_slice.insert(name(&s), ready_addresses(&s, port.as_deref()));
            }
            Ok(Event::Delete(s)) => {
                by_slice.remove(&name(&s));
            }
            Err(_) => continue,
        }
        if relisting.is_some() {
            continue;
        }
        let now = sorted(by_slice.values().flatten().copied().collect());
        if last.as_ref() == Some(&now) {
            continue;
        }
        last = Some(now.clone());
        if let Some(tx) = first.take() {
            let _ = tx.send(now);
        } else if changes.send((Instant::now(), now)).is_err() {
            return;
        }
    }
}

type Body = BoxBody<Bytes, hyper::Error>;

/// Requests forwarded per endpoint, and the ingress's own error answers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IngressStats {
    pub forwarded: BTreeMap<SocketAddr, u64>,
    /// By [`Outcome::class`], plus `no_endpoints`.
    pub errors: BTreeMap<String, u64>,
}

struct Shared {
    endpoints: watch::Receiver<Endpoints>,
    next: AtomicUsize,
    upstream: Client<HttpConnector, Incoming>,
    stats: Mutex<IngressStats>,
}

/// The L7 hop: listens on 127.0.0.1 (a free port), forwards to the
/// endpoints its `watch` channel holds at each request. Stops when dropped
/// (its connections too).
pub struct LaggingIngress {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl LaggingIngress {
    pub async fn start(endpoints: watch::Receiver<Endpoints>) -> Result<Self, Error> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(Error::Bind)?;
        let addr = listener.local_addr().map_err(Error::Bind)?;
        // The harness's keep-alive client: no retry of a request queued on
        // a pooled connection that closed.
        let upstream = crate::traffic::http1_pool(UPSTREAM_IDLE);
        let shared = Arc::new(Shared {
            endpoints,
            next: AtomicUsize::new(0),
            upstream,
            stats: Mutex::new(IngressStats::default()),
        });
        let task = tokio::spawn(accept(listener, shared.clone()));
        Ok(Self { addr, shared, task })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> IngressStats {
        self.shared
            .stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for LaggingIngress {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept(listener: tokio::net::TcpListener, shared: Arc<Shared>) {
    // Owned here, so aborting the accept loop ends every connection.
    let mut conns = JoinSet::new();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        while conns.try_join_next().is_some() {}
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        conns.spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, Infallible>(forward(&shared, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn local_answer(
    status: http::StatusCode,
    why: &str,
    upstream: Option<SocketAddr>,
) -> http::Response<Body> {
    let mut resp = http::Response::new(
        Full::new(Bytes::from(format!("ingress: {why}\n")))
            .map_err(|never| match never {})
            .boxed(),
    );
    *resp.status_mut() = status;
    // A header value cannot hold control characters.
    let clean: String = why
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if let Ok(v) = http::HeaderValue::from_str(&clean) {
        resp.headers_mut().insert(ERROR_HEADER, v);
    }
    if let Some(Ok(v)) = upstream.map(|ep| http::HeaderValue::from_str(&ep.to_string())) {
        resp.headers_mut().insert(UPSTREAM_HEADER, v);
    }
    resp
}

fn strip_hop_by_hop(headers: &mut http::HeaderMap) {
    // Also whatever `connection` names as hop-by-hop.
    let named: Vec<String> = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()))
        .collect();
    for h in HOP_BY_HOP
        .iter()
        .copied()
        .chain(named.iter().map(String::as_str))
    {
        headers.remove(h);
    }
}

async fn forward(shared: &Shared, req: http::Request<Incoming>) -> http::Response<Body> {
    let endpoints = shared.endpoints.borrow().clone();
    if endpoints.is_empty() {
        count_error(shared, "no_endpoints");
        return local_answer(
            http::StatusCode::SERVICE_UNAVAILABLE,
            "no_endpoints: the endpoint set is empty",
            None,
        );
    }
    let ep = endpoints[shared.next.fetch_add(1, Ordering::Relaxed) % endpoints.len()];
    let (mut parts, body) = req.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    parts.uri = match format!("http://{ep}{path}").parse() {
        Ok(u) => u,
        Err(e) => {
            return local_answer(
                http::StatusCode::BAD_REQUEST,
                &format!("bad path: {e}"),
                None,
            );
        }
    };
    strip_hop_by_hop(&mut parts.headers);
    let req = http::Request::from_parts(parts, body);
    let answer = tokio::time::timeout(UPSTREAM_TIMEOUT, shared.upstream.request(req)).await;
    let resp = match answer {
        Err(_) => {
            count_error(shared, "timeout");
            return local_answer(
                http::StatusCode::GATEWAY_TIMEOUT,
                &format!("timeout: no answer from {ep} in {UPSTREAM_TIMEOUT:?}"),
                Some(ep),
            );
        }
        Ok(Err(e)) => {
            let outcome = Outcome::from_error(&e);
            count_error(shared, outcome.class());
            return local_answer(
                http::StatusCode::BAD_GATEWAY,
                &format!("{}: {e:#}", outcome.class()),
                Some(ep),
            );
        }
        Ok(Ok(resp)) => resp,
    };
    *shared
        .stats
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .forwarded
        .entry(ep)
        .or_insert(0) += 1;
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    if let Ok(v) = http::HeaderValue::from_str(&ep.to_string()) {
        parts.headers.insert(UPSTREAM_HEADER, v);
    }
    // Streamed: an upstream cut mid-body cuts the client's response too.
    http::Response::from_parts(parts, body.boxed())
}

fn count_error(shared: &Shared, class: &str) {
    *shared
        .stats
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .errors
        .entry(class.to_owned())
        .or_insert(0) += 1;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::traffic::http1_client;
    use std::sync::atomic::AtomicU64;
    use tokio::io::AsyncWriteExt as _;
    use tokio::net::TcpListener;

    /// A loopback backend answering `name` (keep-alive, with `extra`
    /// headers); counts the requests it received.
    async fn backend(name: &'static str, extra: &'static str) -> (SocketAddr, Arc<AtomicU64>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let count = Arc::new(AtomicU64::new(0));
        let seen = count.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |_req| {
                        seen.fetch_add(1, Ordering::SeqCst);
                        let mut resp = http::Response::new(Full::new(Bytes::from(name)));
                        if !extra.is_empty() {
                            let (k, v) = extra.split_once(": ").unwrap_or((extra, ""));
                            if let (Ok(k), Ok(v)) = (
                                http::HeaderName::from_bytes(k.as_bytes()),
                                http::HeaderValue::from_str(v),
                            ) {
                                resp.headers_mut().insert(k, v);
                            }
                        }
                        async move { Ok::<_, Infallible>(resp) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        (addr, count)
    }

    /// A backend that reads each request and closes without answering;
    /// counts the requests.
    async fn cutting_backend() -> (SocketAddr, Arc<AtomicU64>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let count = Arc::new(AtomicU64::new(0));
        let seen = count.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                crate::traffic::read_request_head(&mut s).await;
                seen.fetch_add(1, Ordering::SeqCst);
                let _ = s.shutdown().await;
            }
        });
        (addr, count)
    }

    async fn dead_addr() -> SocketAddr {
        TcpListener::bind("127.0.0.1:0")
            .await
            .and_then(|l| l.local_addr())
            .expect("a free port")
    }

    /// `GET /` through the ingress on a keep-alive client: status,
    /// headers, body.
    async fn ask(
        client: &Client<HttpConnector, Full<Bytes>>,
        ingress: &LaggingIngress,
    ) -> (u16, http::HeaderMap, String) {
        let req = http::Request::get(format!("http://{}/", ingress.addr()))
            .body(Full::new(Bytes::new()))
            .expect("request");
        let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
            .await
            .expect("an answer in 10 s")
            .expect("the ingress answers");
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.expect("body").to_bytes();
        (
            parts.status.as_u16(),
            parts.headers,
            String::from_utf8_lossy(&body).into_owned(),
        )
    }

    #[tokio::test]
    async fn round_robin_over_the_current_endpoints() {
        let (a, _) = backend("a", "").await;
        let (b, _) = backend("b", "").await;
        let feed = EndpointFeed::manual(vec![a, b], Duration::ZERO);
        let ingress = LaggingIngress::start(feed.receiver())
            .await
            .expect("ingress");
        let client = http1_client();
        let mut answers = Vec::new();
        for _ in 0..10 {
            let (status, headers, body) = ask(&client, &ingress).await;
            assert_eq!(status, 200);
            let upstream = headers.get(UPSTREAM_HEADER).and_then(|v| v.to_str().ok());
            let expected = if body == "a" { a } else { b };
            assert_eq!(upstream, Some(expected.to_string().as_str()));
            answers.push(body);
        }
        assert!(answers.windows(2).all(|w| w[0] != w[1]), "{answers:?}");
        assert_eq!(answers.iter().filter(|b| *b == "a").count(), 5);
        assert_eq!(ingress.stats().forwarded, BTreeMap::from([(a, 5), (b, 5)]));
    }

    #[tokio::test]
    async fn a_removal_applies_only_after_the_lag() {
        let (a, _) = backend("a", "").await;
        let (b, b_count) = backend("b", "").await;
        let lag = Duration::from_millis(300);
        let feed = EndpointFeed::manual(vec![a, b], lag);
        let ingress = LaggingIngress::start(feed.receiver())
            .await
            .expect("ingress");
        let client = http1_client();
        let mut applied = feed.receiver();
        applied.mark_unchanged();
        feed.push(vec![a]);
        // Seen but not applied: b still gets its share.
        let before = b_count.load(Ordering::SeqCst);
        for _ in 0..2 {
            ask(&client, &ingress).await;
        }
        let lag_left = feed.changes().len() == 1;
        if lag_left {
            assert_eq!(b_count.load(Ordering::SeqCst), before + 1);
        }
        tokio::time::timeout(Duration::from_secs(5), applied.changed())
            .await
            .expect("the removal applied within 5 s")
            .expect("feed alive");
        let changes = feed.changes();
        let last = changes.last().expect("a change");
        assert_eq!(
            (last.endpoints.clone(), last.removed.clone()),
            (vec![a], vec![b])
        );
        assert!(
            last.applied - last.seen >= lag,
            "{:?}",
            last.applied - last.seen
        );
        let after = b_count.load(Ordering::SeqCst);
        for _ in 0..6 {
            assert_eq!(ask(&client, &ingress).await.2, "a");
        }
        assert_eq!(b_count.load(Ordering::SeqCst), after);
    }

    #[tokio::test(start_paused = true)]
    async fn changes_keep_their_order_and_lag() {
        let (a, b, c) = (
            SocketAddr::from(([127, 0, 0, 1], 1)),
            SocketAddr::from(([127, 0, 0, 1], 2)),
            SocketAddr::from(([127, 0, 0, 1], 3)),
        );
        let lag = Duration::from_secs(5);
        let feed = EndpointFeed::manual(vec![a], lag);
        let t0 = Instant::now();
        feed.push(vec![a, b]);
        tokio::time::sleep(Duration::from_secs(1)).await;
        feed.push(vec![c]);
        let mut rx = feed.receiver();
        let mut seen = Vec::new();
        while seen.len() < 2 {
            rx.changed().await.expect("feed alive");
            seen.push((rx.borrow_and_update().clone(), Instant::now() - t0));
        }
        assert_eq!(
            seen,
            vec![
                (vec![a, b], Duration::from_secs(5)),
                (vec![c], Duration::from_secs(6))
            ]
        );
        let changes = feed.changes();
        assert_eq!(changes.len(), 3);
        assert_eq!(
            (changes[2].added.clone(), changes[2].removed.clone()),
            (vec![c], vec![a, b])
        );
    }

    #[tokio::test]
    async fn a_dead_endpoint_is_a_502_that_says_why() {
        let dead = dead_addr().await;
        let feed = EndpointFeed::manual(vec![dead], Duration::ZERO);
        let ingress = LaggingIngress::start(feed.receiver())
            .await
            .expect("ingress");
        let (status, headers, _) = ask(&http1_client(), &ingress).await;
        assert_eq!(status, 502);
        let why = headers
            .get(ERROR_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        assert!(why.starts_with("connect_refused: "), "{why:?}");
        assert_eq!(
            headers.get(UPSTREAM_HEADER).and_then(|v| v.to_str().ok()),
            Some(dead.to_string().as_str())
        );
    }

    #[tokio::test]
    async fn no_endpoints_is_a_503() {
        let feed = EndpointFeed::manual(Vec::new(), Duration::ZERO);
        let ingress = LaggingIngress::start(feed.receiver())
            .await
            .expect("ingress");
        let (status, headers, _) = ask(&http1_client(), &ingress).await;
        assert_eq!(status, 503);
        assert!(headers.get(ERROR_HEADER).is_some());
    }

    #[tokio::test]
    async fn a_failed_request_is_neither_retried_nor_sent_elsewhere() {
        let (cut, cut_count) = cutting_backend().await;
        let (good, good_count) = backend("good", "").await;
        let feed = EndpointFeed::manual(vec![cut, good], Duration::ZERO);
        let ingress = LaggingIngress::start(feed.receiver())
            .await
            .expect("ingress");
        let client = http1_client();
        let mut statuses = Vec::new();
        for _ in 0..4 {
            let (status, headers, _) = ask(&client, &ingress).await;
            if status == 502 {
                let why = headers
                    .get(ERROR_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default();
                assert!(why.starts_with("closed_before_response: "), "{why:?}");
            }
            statuses.push(status);
        }
        statuses.sort_unstable();
        assert_eq!(statuses, vec![200, 200, 502, 502]);
        // Each failed request reached the cutting backend once, never the good one.
        assert_eq!(cut_count.load(Ordering::SeqCst), 2);
        assert_eq!(good_count.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn an_upstream_connection_close_stays_on_its_hop() {
        let (a, _) = backend("a", "connection: close").await;
        let feed = EndpointFeed::manual(vec![a], Duration::ZERO);
        let ingress = LaggingIngress::start(feed.receiver())
            .await
            .expect("ingress");
        let (status, headers, _) = ask(&http1_client(), &ingress).await;
        assert_eq!(status, 200);
        assert!(
            headers.get(http::header::CONNECTION).is_none(),
            "{headers:?}"
        );
    }
}
