//! Every HTTP and gRPC client of the harness (tests, benches, the demos,
//! the lagging ingress's upstream side), each without retries of any kind.
//!
//! hyper's pool silently resends a request it had queued on a pooled
//! connection the server closed (`retry_canceled_requests`), which hides
//! exactly the losses a drain causes; [`no_retry`] turns that off for every
//! hyper client here, and it is the only place that may build one. The
//! pool drops a connection once it sees it closed and never reuses it.
//! tonic adds no retry layer unless asked (none is): a failed connection
//! fails the calls on it.

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Body, Bytes};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Builder, Client};
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::TlsConnector;

/// How long an idle keep-alive connection stays in a client's pool: the
/// 90 s of Go's `http.Transport` and hyper's default, far longer than any
/// drain, so a client stays pinned to a stopping pod unless told to leave.
pub const IDLE_KEEP_ALIVE: Duration = Duration::from_secs(90);

/// A plain HTTP client of this module (HTTP/1.1 or h2c).
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;
/// An HTTP/1.1 client over TLS (mTLS when the connector has a client
/// certificate).
pub type TlsClient = Client<TlsConnector, Full<Bytes>>;

/// The builder of every hyper client: no resend of a request whose pooled
/// connection closed before it was written. Idle connections are evicted
/// after `idle` (the pool only evicts with a timer).
fn no_retry(idle: Duration) -> Builder {
    let mut builder = Client::builder(TokioExecutor::new());
    builder
        .retry_canceled_requests(false)
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(idle);
    builder
}

fn connector() -> HttpConnector {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    c
}

/// An HTTP/1.1 keep-alive client of any request body (the ingress
/// forwards its clients' bodies), idle connections closed after `idle`.
pub fn http1_pool<B>(idle: Duration) -> Client<HttpConnector, B>
where
    B: Body + Send + 'static,
    B::Data: Send,
{
    no_retry(idle).build(connector())
}

/// An HTTP/1.1 keep-alive client with a [`IDLE_KEEP_ALIVE`] idle pool.
pub fn http1_client() -> HttpClient {
    http1_pool(IDLE_KEEP_ALIVE)
}

/// An h2c (prior knowledge) client on one connection.
pub fn h2c_client() -> HttpClient {
    no_retry(IDLE_KEEP_ALIVE)
        .http2_only(true)
        .build(connector())
}

/// An HTTP/1.1 keep-alive client over TLS whose idle connections close
/// after `idle`.
pub fn tls_client(connector: TlsConnector, idle: Duration) -> TlsClient {
    no_retry(idle).build(connector)
}

/// An HTTP/1.1 client over TLS that opens a new connection (a new
/// handshake) for every request: what shows the certificate a server
/// presents right now.
pub fn fresh_tls_client(connector: TlsConnector) -> TlsClient {
    no_retry(IDLE_KEEP_ALIVE)
        .pool_max_idle_per_host(0)
        .build(connector)
}

/// A tonic channel to `target` that connects on first use, without a
/// retry layer.
pub fn grpc_channel(
    target: SocketAddr,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    Ok(
        tonic::transport::Endpoint::from_shared(format!("http://{target}"))?
            .tcp_nodelay(true)
            .connect_lazy(),
    )
}
