//! Bounded HTTP/1.1 serving for every Remora listener (the agent's health
//! and admin ports, the operator's webhook), plain or TLS.
//!
//! What a hostile or broken client can hold is capped:
//! - connections: at [`Limits::max_connections`] a new connection evicts the
//!   oldest one with no request in flight (a slow-loris connection still
//!   sending its head, or an idle keep-alive one) of the source address
//!   holding the most of them, so a flood of slow connections from one
//!   client cannot lock a kubelet probe or the API server out. A source
//!   evicts its own connections only once they are [`Limits::evict_after`]
//!   old; until then (and while every connection is busy) its newcomers
//!   are parked: accepted, held unread, given the next free place, and
//!   closed unserved after [`Limits::header_read_timeout`]. At most
//!   [`Limits::max_parked`] are parked (fewer if the process may open few
//!   files); beyond that the oldest parked one is closed. An attacker that
//!   reconnects the moment it is closed thus gets a place only as fast as
//!   places free up, not as fast as the CPU can accept, and the kernel's
//!   listen queue stays short enough for a probe's connection.
//! - a TLS handshake that fails (a client speaking something else) keeps
//!   its place until the handshake's deadline before it is closed, for the
//!   same reason; another source's newcomer may still evict it.
//! - the kernel's queue: listeners from [`bind`] take [`LISTEN_BACKLOG`]
//!   connections before the kernel starts dropping SYNs, not 128.
//! - time: the TLS handshake, the request head (hyper restarts that timer
//!   for every head, so it is also the keep-alive idle timeout) and the
//!   whole request body each have a deadline;
//! - memory per connection: the head's size is capped;
//! - requests in flight: over [`Limits::max_in_flight`] a request gets a
//!   fast `503` instead of queueing.
//!
//! Each request carries its client's address as axum's `ConnectInfo`, for
//! handlers that bound what one client may hold.
//!
//! Shutdown: stop accepting; for [`Limits::drain_linger`] keep every open
//! connection serving, each response saying `connection: close`; then let
//! each connection finish the request it is in (idle ones close), and after
//! [`Limits::drain_grace`] close what is left. The linger is for HTTP/1.1
//! clients that reuse idle keep-alive connections (the API server calling
//! a webhook): closing an idle connection races with a request the client
//! is writing on it, which fails unretried; a connection closed after a
//! response that says so is never reused.

mod conns;
mod metrics;
mod parking;
pub mod readiness;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;
use tower_http::timeout::DeadlineBody;

use conns::{Admission, BusyGuard, Table};
pub use metrics::Metrics;
use parking::Parking;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("invalid server limits: {0}")]
    Limits(String),
    #[error("accept: {0}")]
    Accept(#[source] std::io::Error),
}

/// The bounds of one server. Every field has a floor checked by
/// [`Limits::validate`]; zero would mean "refuse everything".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Connections held open at once.
    pub max_connections: usize,
    /// How long a connection is safe from eviction by a newer connection
    /// of its own source.
    pub evict_after: Duration,
    /// Connections accepted and held unread while no place is free (0:
    /// close them at once).
    pub max_parked: usize,
    /// Requests being handled at once, over all connections.
    pub max_in_flight: usize,
    /// Time to receive a request head; also how long a keep-alive connection
    /// may sit idle between requests.
    pub header_read_timeout: Duration,
    /// Time to receive a whole request body.
    pub body_read_timeout: Duration,
    /// Largest request head (request line and headers).
    pub max_header_bytes: usize,
    /// Time to complete a TLS handshake (TLS servers only).
    pub tls_handshake_timeout: Duration,
    /// After shutdown begins: how long open connections keep serving
    /// (answering `connection: close`) before idle ones are closed.
    pub drain_linger: Duration,
    /// After shutdown begins: how long until what is still open is closed
    /// by force (the linger included).
    pub drain_grace: Duration,
}

/// hyper refuses a read buffer smaller than this.
const MIN_HEADER_BYTES: usize = 8192;

impl Default for Limits {
    /// Sized for a port that serves probes and small admin requests.
    fn default() -> Self {
        Self {
            max_connections: 128,
            evict_after: Duration::from_secs(1),
            max_parked: 4096,
            max_in_flight: 64,
            header_read_timeout: Duration::from_secs(5),
            body_read_timeout: Duration::from_secs(10),
            max_header_bytes: 16 * 1024,
            tls_handshake_timeout: Duration::from_secs(5),
            drain_linger: Duration::ZERO,
            drain_grace: Duration::from_secs(5),
        }
    }
}

impl Limits {
    pub fn validate(&self) -> Result<(), ServeError> {
        let bad = |what: &str| Err(ServeError::Limits(what.to_string()));
        if self.max_connections == 0 {
            return bad("max_connections must be at least 1");
        }
        if self.max_in_flight == 0 {
            return bad("max_in_flight must be at least 1");
        }
        if self.max_header_bytes < MIN_HEADER_BYTES {
            return Err(ServeError::Limits(format!(
                "max_header_bytes must be at least {MIN_HEADER_BYTES}"
            )));
        }
        if self.header_read_timeout.is_zero()
            || self.body_read_timeout.is_zero()
            || self.tls_handshake_timeout.is_zero()
        {
            return bad("read timeouts must be longer than 0");
        }
        if self.drain_linger > self.drain_grace {
            return bad("drain_linger must not exceed drain_grace");
        }
        Ok(())
    }
}

/// How a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    /// Connections still open at the deadline, closed by force.
    pub forced: usize,
}

/// One bounded server: a name (for logs), its limits, its metrics, and TLS
/// if it has any.
#[derive(Clone)]
pub struct Server {
    name: &'static str,
    limits: Limits,
    tls: Option<Arc<rustls::ServerConfig>>,
    metrics: Metrics,
}

impl Server {
    pub fn new(name: &'static str, limits: Limits) -> Result<Self, ServeError> {
        limits.validate()?;
        Ok(Self {
            name,
            limits,
            tls: None,
            metrics: Metrics::default(),
        })
    }

    /// Serve TLS with this configuration.
    pub fn with_tls(mut self, tls: Arc<rustls::ServerConfig>) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Count into these metrics (registered by the caller) instead of
    /// private ones.
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Serve `app` on `listener` until `shutdown` resolves, then drain (see
    /// the crate doc).
    pub async fn serve(
        self,
        listener: TcpListener,
        app: Router,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Drained, ServeError> {
        let shared = Arc::new(Shared {
            limits: self.limits.clone(),
            acceptor: self.tls.clone().map(TlsAcceptor::from),
            app,
            in_flight: Arc::new(Semaphore::new(self.limits.max_in_flight)),
            metrics: self.metrics.clone(),
            table: Table::default(),
            draining: CancellationToken::new(),
        });
        let mut conns = JoinSet::new();
        let mut parked = Parking::new(self.limits.max_parked, self.limits.header_read_timeout);
        let max = self.limits.max_connections;
        let evict_after = self.limits.evict_after;
        tokio::pin!(shutdown);
        loop {
            let expiry = parked.next_deadline();
            let (stream, peer) = tokio::select! {
                biased;
                () = &mut shutdown => break,
                // Reap finished connections as we go; each frees a place
                // for the oldest parked one.
                Some(_) = conns.join_next(), if !conns.is_empty() => {
                    while shared.table.has_room(max) {
                        let Some((stream, peer)) = parked.pop(&shared.metrics) else { break };
                        let Admission::Admitted(slot) =
                            shared.table.admit(max, peer.ip(), evict_after, &shared.metrics)
                        else {
                            break;
                        };
                        Self::spawn(&shared, &mut conns, self.name, stream, peer, slot);
                    }
                    continue;
                }
                () = tokio::time::sleep_until(expiry.unwrap_or_else(tokio::time::Instant::now)),
                    if expiry.is_some() => {
                    parked.expire(&shared.metrics);
                    continue;
                }
                r = listener.accept() => match r {
                    Ok(accepted) => accepted,
                    // Out of file descriptors and the like: wait a moment
                    // instead of spinning; the server stays up.
                    Err(e) if is_transient(&e) => {
                        tracing::warn!(server = self.name, error = %e, "accept failed; retrying");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    Err(e) => return Err(ServeError::Accept(e)),
                },
            };
            match shared
                .table
                .admit(max, peer.ip(), evict_after, &shared.metrics)
            {
                Admission::Admitted(slot) => {
                    Self::spawn(&shared, &mut conns, self.name, stream, peer, slot);
                }
                Admission::Wait => {
                    tracing::debug!(server = self.name, %peer, "no place free; parked");
                    parked.park(stream, peer, &shared.metrics);
                    continue;
                }
            }
            // Let the new connection read its head before more arrivals can
            // evict it: under a flood, accepting alone would outrun every
            // connection task, and a probe would be evicted unread.
            tokio::task::yield_now().await;
        }
        // Parked connections were never read: nothing of theirs is lost.
        let unserved = parked.len();
        drop(parked);
        drop(listener);
        shared.draining.cancel();
        let open = conns.len();
        let grace = self.limits.drain_grace;
        tracing::info!(
            server = self.name,
            connections = open,
            parked_closed = unserved,
            ?grace,
            "{} server draining",
            self.name
        );
        let drained =
            tokio::time::timeout(grace, async { while conns.join_next().await.is_some() {} }).await;
        let forced = if drained.is_err() {
            let n = conns.len();
            tracing::warn!(
                server = self.name,
                connections = n,
                ?grace,
                "drain grace over; closing connections"
            );
            conns.shutdown().await;
            n
        } else {
            0
        };
        Ok(Drained { forced })
    }
}

/// The kernel's queue of connections not yet accepted. The standard
/// library's (and tokio's) 128 fills within moments of a flood's first
/// burst, and a probe's SYN dropped there waits a second for its
/// retransmission; the kernel caps this at `net.core.somaxconn`.
pub const LISTEN_BACKLOG: u32 = 4096;

/// Binds a listener for [`Server::serve`]: address reuse on, as
/// `TcpListener::bind` does, and a backlog of [`LISTEN_BACKLOG`].
pub fn bind(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

impl Server {
    fn spawn(
        shared: &Arc<Shared>,
        conns: &mut JoinSet<()>,
        name: &'static str,
        stream: TcpStream,
        peer: std::net::SocketAddr,
        slot: conns::Slot,
    ) {
        let _ = stream.set_nodelay(true);
        let shared = Arc::clone(shared);
        conns.spawn(async move {
            let id = slot.id;
            let _open = shared.metrics.open_guard();
            shared.connection(stream, slot, peer).await;
            shared.table.remove(id);
            tracing::trace!(server = name, %peer, "connection closed");
        });
    }
}

/// `now + d`, or about 30 years from now when that overflows (as tokio's
/// own timers do): a huge configured timeout must not panic.
pub(crate) fn deadline_after(d: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(86_400 * 365 * 30)))
        .unwrap_or(now)
}

fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | Interrupted | WouldBlock
    ) || matches!(e.raw_os_error(), Some(23 | 24 | 12 | 105)) // ENFILE, EMFILE, ENOMEM, ENOBUFS
}

struct Shared {
    limits: Limits,
    acceptor: Option<TlsAcceptor>,
    app: Router,
    in_flight: Arc<Semaphore>,
    metrics: Metrics,
    table: Table,
    /// Tells the connections to finish their request and close.
    draining: CancellationToken,
}

impl Shared {
    /// One connection, from handshake to close; returns early when evicted.
    async fn connection(self: &Arc<Self>, stream: TcpStream, slot: conns::Slot, peer: SocketAddr) {
        let evicted = slot.evict.clone();
        tokio::select! {
            () = evicted.cancelled() => {}
            () = self.handshake_and_serve(stream, slot, peer) => {}
        }
    }

    async fn handshake_and_serve(
        self: &Arc<Self>,
        stream: TcpStream,
        slot: conns::Slot,
        peer: SocketAddr,
    ) {
        match &self.acceptor {
            None => self.http(TokioIo::new(stream), slot, peer).await,
            Some(acceptor) => {
                let deadline = deadline_after(self.limits.tls_handshake_timeout);
                let handshake = tokio::time::timeout_at(deadline, acceptor.accept(stream));
                let tls = tokio::select! {
                    // A handshake not done by the end of the linger carries
                    // no request yet; one done before may still carry one.
                    () = self.linger_over() => return,
                    r = handshake => match r {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => {
                            tracing::debug!(error = %e, "TLS handshake failed");
                            // Keep the place until the deadline: closed at
                            // once, a client that reconnects at once would
                            // spin us (see the crate doc).
                            tokio::select! {
                                () = tokio::time::sleep_until(deadline) => {}
                                () = self.draining.cancelled() => {}
                            }
                            return;
                        }
                        Err(_) => {
                            tracing::debug!("TLS handshake timed out");
                            return;
                        }
                    },
                };
                self.http(TokioIo::new(tls), slot, peer).await;
            }
        }
    }

    async fn http<I>(self: &Arc<Self>, io: I, slot: conns::Slot, peer: SocketAddr)
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let shared = Arc::clone(self);
        let busy = slot.busy;
        let svc = tower::service_fn(move |mut req: Request<Incoming>| {
            let shared = Arc::clone(&shared);
            let busy = BusyGuard::new(&busy);
            // Handlers that bound what one client may hold read its address
            // as axum's `ConnectInfo`.
            req.extensions_mut().insert(ConnectInfo(peer));
            async move {
                let _busy = busy;
                Ok::<_, Infallible>(shared.request(req).await)
            }
        });
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(self.limits.header_read_timeout)
            .max_buf_size(self.limits.max_header_bytes)
            .max_header_size(self.limits.max_header_bytes)
            .keep_alive(true)
            .serve_connection(io, TowerToHyperService::new(svc));
        tokio::pin!(conn);
        let r = tokio::select! {
            r = conn.as_mut() => r,
            () = self.linger_over() => {
                conn.as_mut().graceful_shutdown();
                conn.await
            }
        };
        if let Err(e) = r {
            tracing::debug!(error = %e, "connection ended with an error");
        }
    }

    /// Resolves once draining began and the linger has passed.
    async fn linger_over(&self) {
        self.draining.cancelled().await;
        tokio::time::sleep(self.limits.drain_linger).await;
    }

    async fn request(&self, req: Request<Incoming>) -> Response {
        let Ok(_permit) = Arc::clone(&self.in_flight).try_acquire_owned() else {
            self.metrics.shed();
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                [(header::CONNECTION, "close")],
                "over capacity: too many requests in flight\n",
            )
                .into_response();
        };
        let deadline = self.limits.body_read_timeout;
        let req = req.map(|b| Body::new(DeadlineBody::new(deadline, b)));
        let mut res = match self.app.clone().oneshot(req).await {
            Ok(res) => res,
            Err(never) => match never {},
        };
        // Draining: the client must not send another request on this
        // connection (hyper closes it once this response is written).
        if self.draining.is_cancelled() {
            res.headers_mut().insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
        }
        res
    }
}
