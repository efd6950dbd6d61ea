//! The operator's gRPC servers (the workload CA's, the discovery
//! server's): TLS with a certificate read at each handshake, HTTP/2 only,
//! bounded per source as well as in total, so that one pod cannot hold the
//! places every sidecar needs:
//!
//! - a source address holds at most [`Limits::per_source`] connections,
//!   handshaking or served; one more is closed at once, before any TLS work;
//!   and has at most [`Limits::per_source_requests`] requests in flight
//!   (waiting for a place under `max_in_flight` included); one more is
//!   answered UNAVAILABLE at once;
//! - TLS handshakes run in a pool of their own ([`Limits::handshakes`]),
//!   under a deadline, and take a served place only once done, so silent
//!   clients cannot fill the served places;
//! - at most [`Limits::connections`] connections are served; a newly
//!   hand-shaken one waits for a place up to the handshake deadline;
//! - a connection with no request in flight for [`Limits::idle`] is closed
//!   (a GOAWAY), and every connection after [`Limits::max_age`]; requests
//!   in flight get [`Limits::request_timeout`] to finish, then it is closed;
//! - a request timeout (until the answer's headers: a stream runs on), a
//!   message size cap (the service's), at most [`Limits::max_in_flight`]
//!   requests being answered at once, and at most [`Limits::streams`]
//!   requests open (their answer's body included, so a long stream counts
//!   until it ends), over all sources.
//!
//! A request and its answer's body count as in flight for their source and
//! their connection until the body ends, so an open stream keeps its
//! connection from being idle.
//!
//! The source address goes with each request as a [`Peer`], for the
//! per-source TokenReview budget.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Bytes, Frame, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use rustls::server::ResolvesServerCert;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tower::{Service, ServiceExt};

/// The source address of a request's connection, in its extensions: the
/// server puts it there for the per-source TokenReview budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer(pub IpAddr);

/// Where a server counts what it refused (its own metrics).
pub trait Refusals: Clone + Send + Sync + 'static {
    /// A request refused before it was served (`source_busy`, `streams`).
    fn request_refused(&self, reason: &'static str);
    /// A connection closed unserved (`per_source`, `handshake`, `no_place`).
    fn connection_refused(&self, reason: &'static str);
}

/// Enough for a token and gRPC's headers; hyper's default is 16 MiB.
const MAX_HEADER_LIST_BYTES: u32 = 32 * 1024;

/// The server's bounds. [`Limits::default`] is what the operator serves with.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections served at once, over all sources.
    pub connections: usize,
    /// Connections one source address holds at once, handshaking or served.
    /// A sidecar's agent keeps one connection and opens a second only while
    /// the first is being closed; 8 leaves room for a few agents sharing an
    /// address (host-network pods share the node's) and is 1/512 of
    /// `connections`, so filling the CA takes 512 addresses.
    pub per_source: usize,
    /// Requests one source address has in flight at once. An agent asks
    /// one thing at a time; without this, one pod's slow requests (a body
    /// sent a byte at a time) on its connections' streams could hold every
    /// place under `max_in_flight` (8 connections x 64 streams > 256).
    pub per_source_requests: usize,
    /// TLS handshakes at once, over all sources.
    pub handshakes: usize,
    pub handshake_timeout: Duration,
    /// A connection with no request in flight this long is closed. Agents
    /// ask about once per half certificate lifetime and reconnect by
    /// themselves, so an idle connection serves no one.
    pub idle: Duration,
    /// Every connection is closed this long after it got its place.
    pub max_age: Duration,
    pub request_timeout: Duration,
    /// Requests being answered at once (until their answer's headers),
    /// over all connections; more wait for a place.
    pub max_in_flight: usize,
    /// Requests open at once, their answer's body included, over all
    /// connections: one more is answered UNAVAILABLE at once. For unary
    /// calls this is about `max_in_flight`; for streams, how many are open.
    pub streams: usize,
    /// Requests (streams) open at once on one connection.
    pub streams_per_connection: u32,
    /// HTTP/2 flow control windows: how many request bytes a client may
    /// send on one stream, and over its connection, before the service has
    /// read them (what h2 buffers for a stream that is busy elsewhere).
    /// `None`: hyper's, 1 MiB each.
    pub stream_window: Option<u32>,
    pub connection_window: Option<u32>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            connections: 4096,
            per_source: 8,
            per_source_requests: 16,
            handshakes: 256,
            handshake_timeout: Duration::from_secs(5),
            idle: Duration::from_secs(30),
            max_age: Duration::from_secs(300),
            request_timeout: Duration::from_secs(15),
            max_in_flight: 256,
            streams: 16_384,
            streams_per_connection: 64,
            stream_window: None,
            connection_window: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    #[error("limits: {0}")]
    Limits(&'static str),
}

/// What each source address holds: connections (handshaking or served)
/// and the places for its requests in flight, shared by its connections.
#[derive(Debug, Default)]
struct Sources(Mutex<HashMap<IpAddr, Source>>);

#[derive(Debug)]
struct Source {
    conns: usize,
    requests: Arc<Semaphore>,
}

/// One connection's place in [`Sources`], given back on drop.
struct SourceHold {
    sources: Arc<Sources>,
    ip: IpAddr,
    requests: Arc<Semaphore>,
}

impl Sources {
    fn hold(self: &Arc<Self>, ip: IpAddr, max: usize, requests: usize) -> Option<SourceHold> {
        let mut held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let source = held.entry(ip).or_insert_with(|| Source {
            conns: 0,
            requests: Arc::new(Semaphore::new(requests)),
        });
        if source.conns >= max {
            return None;
        }
        source.conns += 1;
        Some(SourceHold {
            sources: Arc::clone(self),
            ip,
            requests: Arc::clone(&source.requests),
        })
    }
}

impl Drop for SourceHold {
    fn drop(&mut self) {
        let mut held = self
            .sources
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(source) = held.get_mut(&self.ip) {
            source.conns = source.conns.saturating_sub(1);
            if source.conns == 0 {
                held.remove(&self.ip);
            }
        }
    }
}

/// Requests in flight on one connection, and a counter bumped at each
/// start and end, so the idle timer sees activity between two looks.
#[derive(Debug, Default, Clone, Copy)]
struct Activity {
    in_flight: usize,
    changes: u64,
}

/// Marks its connection busy while alive.
struct Busy(Arc<watch::Sender<Activity>>);

impl Busy {
    fn new(activity: &Arc<watch::Sender<Activity>>) -> Self {
        activity.send_modify(|a| {
            a.in_flight += 1;
            a.changes = a.changes.wrapping_add(1);
        });
        Self(Arc::clone(activity))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.send_modify(|a| {
            a.in_flight = a.in_flight.saturating_sub(1);
            a.changes = a.changes.wrapping_add(1);
        });
    }
}

/// Resolves once the connection has had no request in flight for `idle`.
async fn idle_for(activity: &mut watch::Receiver<Activity>, idle: Duration) {
    loop {
        let busy = activity.borrow_and_update().in_flight > 0;
        let changed = if busy {
            activity.changed().await
        } else {
            match tokio::time::timeout(idle, activity.changed()).await {
                Err(_) => return,
                Ok(changed) => changed,
            }
        };
        if changed.is_err() {
            // The service is gone, and with it the connection.
            return std::future::pending().await;
        }
    }
}

/// The per-connection service: tags each request with its [`Peer`], counts
/// it in flight from its arrival (waiting for a place under
/// `max_in_flight` included) to the end of its answer's body, for its
/// connection, its source and the server, and answers DEADLINE_EXCEEDED
/// when the answer's headers take longer than the request timeout.
#[derive(Clone)]
struct Tracked<S, M> {
    inner: S,
    peer: Peer,
    activity: Arc<watch::Sender<Activity>>,
    /// The source's places for requests in flight.
    requests: Arc<Semaphore>,
    /// The server's places for open requests (streams).
    streams: Arc<Semaphore>,
    timeout: Duration,
    metrics: M,
}

/// An answer's body, holding its request's places until it ends.
struct Held {
    body: tonic::body::Body,
    _places: Box<dyn Send + Sync>,
}

impl Body for Held {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, M: Refusals> Service<http::Request<B>> for Tracked<S, M>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    S::Error: std::fmt::Display,
    B: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        req.extensions_mut().insert(self.peer);
        let busy = Busy::new(&self.activity);
        let Ok(place) = Arc::clone(&self.requests).try_acquire_owned() else {
            self.metrics.request_refused("source_busy");
            let refused = tonic::Status::unavailable(
                "too many requests in flight from this address; try again shortly",
            );
            return Box::pin(async move {
                drop(busy);
                Ok(refused.into_http())
            });
        };
        let Ok(stream) = Arc::clone(&self.streams).try_acquire_owned() else {
            self.metrics.request_refused("streams");
            let refused =
                tonic::Status::unavailable("too many requests open on this server; try again");
            return Box::pin(async move {
                drop((busy, place));
                Ok(refused.into_http())
            });
        };
        let inner = self.inner.clone();
        let timeout = self.timeout;
        Box::pin(async move {
            let places = (busy, place, stream);
            match tokio::time::timeout(timeout, inner.oneshot(req)).await {
                Ok(Ok(res)) => Ok(res.map(|body| {
                    tonic::body::Body::new(Held {
                        body,
                        _places: Box::new(places),
                    })
                })),
                Ok(Err(e)) => Ok(tonic::Status::internal(e.to_string()).into_http()),
                Err(_) => Ok(tonic::Status::deadline_exceeded(format!(
                    "no answer within {timeout:?}"
                ))
                .into_http()),
            }
        })
    }
}

/// Serve `service` on `listener` until `token`, then close every
/// connection gracefully (a GOAWAY; requests in flight finish within the
/// request timeout) and return once all are closed.
/// `what` names the server in its logs; `certs` gives the serving
/// certificate at each handshake.
pub async fn serve<M: Refusals>(
    what: &'static str,
    listener: TcpListener,
    routes: tonic::service::Routes,
    certs: Arc<dyn ResolvesServerCert>,
    limits: Limits,
    metrics: M,
    token: CancellationToken,
) -> Result<(), ServeError> {
    if limits.connections == 0
        || limits.per_source == 0
        || limits.per_source_requests == 0
        || limits.handshakes == 0
        || limits.max_in_flight == 0
        || limits.streams == 0
        || limits.streams_per_connection == 0
    {
        return Err(ServeError::Limits(
            "every connection and request limit must be at least 1",
        ));
    }
    let mut tls = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_cert_resolver(certs);
    tls.alpn_protocols = vec![b"h2".to_vec()];
    let acceptor = TlsAcceptor::from(Arc::new(tls));
    let routes = tower::ServiceBuilder::new()
        .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
            limits.max_in_flight,
        ))
        .service(routes);
    let streams = Arc::new(Semaphore::new(limits.streams));

    let handshakes = Arc::new(Semaphore::new(limits.handshakes));
    let places = Arc::new(Semaphore::new(limits.connections));
    let sources = Arc::new(Sources::default());
    // Every connection's task holds a receiver; `closed` is when all ended.
    let (open_tx, open_rx) = watch::channel(());
    loop {
        let handshake = tokio::select! {
            () = token.cancelled() => break,
            p = Arc::clone(&handshakes).acquire_owned() => match p { Ok(p) => p, Err(_) => break },
        };
        let accepted = tokio::select! {
            () = token.cancelled() => break,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!(server = what, error = %e, "accept failed");
                // Out of files: give others a moment rather than spin.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Small gRPC messages: no waiting for the peer's delayed ACK.
        let _ = stream.set_nodelay(true);
        let Some(hold) = sources.hold(peer.ip(), limits.per_source, limits.per_source_requests)
        else {
            tracing::debug!(server = what, %peer, limit = limits.per_source,
                "too many connections from this address; closed");
            metrics.connection_refused("per_source");
            continue;
        };
        let conn = Accepted {
            what,
            streams: Arc::clone(&streams),
            stream,
            peer,
            hold,
            handshake,
            acceptor: acceptor.clone(),
            places: Arc::clone(&places),
            routes: routes.clone(),
            limits,
            token: token.clone(),
            open: open_rx.clone(),
            metrics: metrics.clone(),
        };
        tokio::spawn(conn.run());
    }
    drop(listener);
    drop(open_rx);
    open_tx.closed().await;
    Ok(())
}

/// A connection from accept to close.
struct Accepted<S, M> {
    what: &'static str,
    streams: Arc<Semaphore>,
    stream: TcpStream,
    peer: SocketAddr,
    hold: SourceHold,
    handshake: OwnedSemaphorePermit,
    acceptor: TlsAcceptor,
    places: Arc<Semaphore>,
    routes: S,
    limits: Limits,
    token: CancellationToken,
    open: watch::Receiver<()>,
    metrics: M,
}

impl<S, M: Refusals> Accepted<S, M>
where
    S: Service<http::Request<hyper::body::Incoming>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    S::Error: std::fmt::Display,
{
    async fn run(self) {
        let Self {
            what,
            streams,
            stream,
            peer,
            hold,
            handshake,
            acceptor,
            places,
            routes,
            limits,
            token,
            open,
            metrics,
        } = self;
        let requests = Arc::clone(&hold.requests);
        let (_hold, _open) = (hold, open);
        let handshaken = tokio::time::timeout(limits.handshake_timeout, acceptor.accept(stream));
        let tls = match handshaken.await {
            Ok(Ok(io)) => io,
            Ok(Err(e)) => {
                tracing::debug!(server = what, %peer, error = %e, "TLS handshake failed");
                metrics.connection_refused("handshake");
                return;
            }
            Err(_) => {
                tracing::debug!(server = what, %peer, "TLS handshake timed out");
                metrics.connection_refused("handshake");
                return;
            }
        };
        drop(handshake);
        let place = tokio::select! {
            () = token.cancelled() => return,
            p = tokio::time::timeout(limits.handshake_timeout, places.acquire_owned()) => p,
        };
        let Ok(Ok(_place)) = place else {
            tracing::debug!(server = what, %peer, "no place for the connection; closed");
            metrics.connection_refused("no_place");
            return;
        };

        let (activity, mut watcher) = watch::channel(Activity::default());
        let svc = Tracked {
            inner: routes,
            peer: Peer(peer.ip()),
            activity: Arc::new(activity),
            requests,
            streams,
            timeout: limits.request_timeout,
            metrics,
        };
        let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        builder
            .timer(TokioTimer::new())
            .max_concurrent_streams(limits.streams_per_connection)
            .max_header_list_size(MAX_HEADER_LIST_BYTES)
            .initial_stream_window_size(limits.stream_window)
            .initial_connection_window_size(limits.connection_window)
            .keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10));
        let conn = builder.serve_connection(TokioIo::new(tls), TowerToHyperService::new(svc));
        tokio::pin!(conn);
        let age = tokio::time::sleep(limits.max_age);
        tokio::pin!(age);
        let why = tokio::select! {
            r = conn.as_mut() => return end(what, peer, r),
            () = idle_for(&mut watcher, limits.idle) => "idle",
            () = &mut age => "max age",
            () = token.cancelled() => "shutdown",
        };
        tracing::debug!(server = what, %peer, why, "closing the connection");
        conn.as_mut().graceful_shutdown();
        match tokio::time::timeout(limits.request_timeout, conn).await {
            Ok(r) => end(what, peer, r),
            Err(_) => {
                tracing::debug!(server = what, %peer, "connection closed with requests unfinished")
            }
        }
    }
}

fn end(what: &'static str, peer: SocketAddr, r: Result<(), hyper::Error>) {
    if let Err(e) = r {
        tracing::debug!(server = what, %peer, error = %e, "connection ended");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn idle_after_the_last_request_ends() {
        let (tx, mut rx) = watch::channel(Activity::default());
        let tx = Arc::new(tx);
        let idle = Duration::from_secs(30);
        let start = tokio::time::Instant::now();
        // Nothing ever: idle after `idle`.
        idle_for(&mut rx, idle).await;
        assert_eq!(start.elapsed(), idle);

        // A request that takes longer than `idle` keeps it open, and the
        // clock starts again when it ends.
        let busy = Busy::new(&tx);
        let start = tokio::time::Instant::now();
        let waiting = tokio::spawn({
            let mut rx = tx.subscribe();
            async move { idle_for(&mut rx, idle).await }
        });
        tokio::time::sleep(idle * 3).await;
        assert!(!waiting.is_finished(), "closed with a request in flight");
        drop(busy);
        waiting.await.expect("idle");
        assert_eq!(start.elapsed(), idle * 4);

        // A request that starts and ends between two looks restarts it too.
        let start = tokio::time::Instant::now();
        let waiting = tokio::spawn({
            let mut rx = tx.subscribe();
            async move { idle_for(&mut rx, idle).await }
        });
        tokio::time::sleep(idle / 2).await;
        drop(Busy::new(&tx));
        waiting.await.expect("idle");
        assert_eq!(start.elapsed(), idle / 2 + idle);
    }

    #[test]
    fn sources_are_capped_and_given_back() {
        let s = Arc::new(Sources::default());
        let a: IpAddr = "127.0.0.1".parse().expect("ip");
        let b: IpAddr = "127.0.0.2".parse().expect("ip");
        let held: Vec<_> = (0..3).map(|_| s.hold(a, 3, 2).expect("room")).collect();
        assert!(s.hold(a, 3, 2).is_none(), "a fourth from a");
        // The source's request places are shared by its connections.
        let first = Arc::clone(&held[0].requests).try_acquire_owned();
        let second = Arc::clone(&held[1].requests).try_acquire_owned();
        assert!(first.is_ok() && second.is_ok());
        assert!(Arc::clone(&held[2].requests).try_acquire_owned().is_err());
        let other = s.hold(b, 3, 2).expect("b is not a");
        assert!(Arc::clone(&other.requests).try_acquire_owned().is_ok());
        drop(held);
        assert!(s.hold(a, 3, 2).is_some(), "given back");
        drop(other);
        assert!(s.0.lock().expect("lock").is_empty(), "no entry left behind");
    }
}
