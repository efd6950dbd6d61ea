//! The discovery server on [`crate::grpc_server`]: the ADS service, its
//! message bounds, and the bounds of a server of long-lived streams.

use std::sync::Arc;
use std::time::Duration;

use remora_contract::discovery::MAX_REQUEST_BYTES;
use rustls::server::ResolvesServerCert;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use crate::grpc_server::{Limits, ServeError};

use super::ads_grpc::AdsServer;
use super::server::AdsService;
use crate::pki::workload_ca::authn::Authenticate;

/// The most one response may weigh: a proxy's resources are those of the
/// few Services it declared, far below this even with thousands of
/// endpoints.
pub const MAX_RESPONSE_BYTES: usize = 16 * 1024 * 1024;

/// [`limits`]' HTTP/2 flow control windows (per stream and per connection).
pub const WINDOW: u32 = 64 * 1024;

/// The discovery server's bounds: the CA's, but a connection lives as long
/// as its stream (30 min at most, then the proxy reconnects, possibly to
/// another replica, which spreads proxies after a rollout of the operator),
/// and a source holds a few streams (one per sidecar; pods on the host
/// network share the node's address).
pub fn limits() -> Limits {
    Limits {
        per_source: 8,
        per_source_requests: 8,
        idle: Duration::from_secs(60),
        max_age: Duration::from_secs(30 * 60),
        // Each sidecar holds one connection (its agent's one stream): the
        // CA's 4,096 would cap a replica at 4,096 sidecars.
        connections: 16_384,
        streams: 16_384,
        streams_per_connection: 4,
        // HTTP/2's own default window, not hyper's 1 MiB: a stream whose
        // task is busy pushing (up to its send timeout) can have this much
        // of its proxy's requests waiting in h2, on each of thousands of
        // streams. Requests are ACKs of ~150 bytes; one larger than the
        // window (a resume naming thousands of resources, up to
        // MAX_REQUEST_BYTES) still arrives, at a window per round trip.
        stream_window: Some(WINDOW),
        connection_window: Some(WINDOW),
        ..Limits::default()
    }
}

/// Serve `service` on `listener` until `token`, with the certificate of
/// `certs` (the workload CA's serving certificate).
pub async fn serve<A: Authenticate>(
    listener: TcpListener,
    service: AdsService<A>,
    certs: Arc<dyn ResolvesServerCert>,
    limits: Limits,
    token: CancellationToken,
) -> Result<(), ServeError> {
    let metrics = service.metrics.clone();
    // The withdrawals' bounds run while the server does.
    tokio::spawn(
        Arc::clone(&service.discovery)
            .bound_withdrawals(service.events.clone(), token.child_token()),
    );
    let svc = AdsServer::new(service, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES);
    crate::grpc_server::serve(
        "discovery",
        listener,
        tonic::service::Routes::new(svc),
        certs,
        limits,
        metrics,
        token,
    )
    .await
}
