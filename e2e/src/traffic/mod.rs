//! The one traffic library of the harness: every client that tests,
//! benchmarks and the demos send requests with, with **no retries of any
//! kind**, sending open-loop at a fixed rate, and a precise account of how
//! each request ended.
//!
//! - [`clients`]: every hyper and tonic client (HTTP/1.1 keep-alive, h2c,
//!   HTTP/1.1 over (m)TLS, a fresh handshake per request, gRPC, the lagging
//!   ingress's upstream pool), all built without retries.
//! - [`tls`]: the (m)TLS connector, which records the server's certificate.
//! - [`outcome`]: [`Outcome`], the one classification of how a request
//!   ended (could the server have seen it?).
//! - [`sample`]: [`Sample`], one request's record, and [`LoadSummary`].
//! - [`load`]: [`Traffic`], [`Load`]s of each [`Kind`] at fixed addresses
//!   side by side; requests go to the test app's routes
//!   (`e2e/test-app/src/main.rs`): `GET /`, `POST /echo`, `GET /slow?ms=N`
//!   and gRPC `grpc.health.v1.Health`.
//! - [`balanced`]: a load balanced on the client side over changing
//!   endpoints, plain or (m)TLS.
//!
//! Why no retries: hyper's pool silently resends a request it had queued on
//! a connection the server closed (`retry_canceled_requests`), and gRPC
//! clients often retry refused streams transparently; either hides exactly
//! the losses a drain causes. Here every failure is a sample, and
//! [`Outcome`] says whether the server could have seen the request.

use std::time::Duration;

pub mod balanced;
pub mod clients;
mod exchange;
pub mod load;
pub mod outcome;
pub mod sample;
pub mod tls;

pub use balanced::{run_balanced, run_balanced_tls};
pub use clients::{
    HttpClient, IDLE_KEEP_ALIVE, TlsClient, fresh_tls_client, grpc_channel, h2c_client,
    http1_client, http1_pool, tls_client,
};
pub use exchange::get;
pub use load::{Kind, Load, Traffic, spread};
pub use outcome::Outcome;
pub use sample::{LoadSummary, Sample, summarize};
pub use tls::{PeerCert, TlsConnector, TlsError, fingerprint};

/// Default time a request may take before it counts as [`Outcome::Timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

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
mod tests;
