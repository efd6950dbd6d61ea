//! The CA's gRPC server: TLS with this replica's serving certificate
//! (swapped in place when the root changes), HTTP/2 only, bounded: at most
//! [`MAX_CONNECTIONS`] connections (more wait in the kernel's queue), a TLS
//! handshake deadline, a request timeout, a message size cap, at most
//! `max_in_flight` requests served at once, and connections closed
//! (gracefully: a GOAWAY, requests in flight finish) after
//! [`MAX_CONNECTION_AGE`], so an idle or silent client holds a place for at
//! most that long. There is no per-peer cap: a pod that opens thousands of
//! connections can still fill the places for that long.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use remora_proto::istio::v1::auth::istio_certificate_service_server::IstioCertificateServiceServer;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;

use super::authn::Authenticate;
use super::keeper::Authority;
use super::service::CaService;

pub const MAX_CONNECTIONS: usize = 4096;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// A CSR is a few KiB; nothing legitimate comes near this.
const MAX_MESSAGE_BYTES: usize = 64 * 1024;
const MAX_STREAMS_PER_CONNECTION: u32 = 64;
/// A sidecar asks about once per half certificate lifetime; its client
/// reconnects by itself when the connection is closed.
pub const MAX_CONNECTION_AGE: Duration = Duration::from_secs(300);

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// The certificate of the current [`Authority`], read at each handshake.
#[derive(Debug)]
struct Resolver(watch::Receiver<Option<Arc<Authority>>>);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.borrow().as_ref().map(|a| Arc::clone(&a.serving))
    }
}

/// An accepted TLS connection holding its place under [`MAX_CONNECTIONS`].
struct Conn {
    io: TlsStream<TcpStream>,
    _place: OwnedSemaphorePermit,
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = ();
    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Accept, hand-shake (each on its own task, under a deadline) and pass on.
async fn accept_loop(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    out: mpsc::Sender<std::io::Result<Conn>>,
    token: CancellationToken,
) {
    let places = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let place = tokio::select! {
            () = token.cancelled() => return,
            p = Arc::clone(&places).acquire_owned() => match p { Ok(p) => p, Err(_) => return },
        };
        let accepted = tokio::select! {
            () = token.cancelled() => return,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!(error = %e, "workload CA: accept failed");
                // Out of files: give others a moment rather than spin.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (acceptor, out) = (acceptor.clone(), out.clone());
        tokio::spawn(async move {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(io)) => {
                    let _ = out.send(Ok(Conn { io, _place: place })).await;
                }
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "workload CA: TLS handshake failed")
                }
                Err(_) => tracing::debug!(%peer, "workload CA: TLS handshake timed out"),
            }
        });
    }
}

/// Serve `service` on `listener` until `token`, then let requests in flight
/// finish (tonic's graceful shutdown).
pub async fn serve<A: Authenticate>(
    listener: TcpListener,
    service: CaService<A>,
    max_in_flight: usize,
    token: CancellationToken,
) -> Result<(), ServeError> {
    let mut tls = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(Resolver(service.authority.clone())));
    tls.alpn_protocols = vec![b"h2".to_vec()];
    let acceptor = TlsAcceptor::from(Arc::new(tls));
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(accept_loop(listener, acceptor, tx, token.clone()));
    let incoming = tokio_stream::wrappers::ReceiverStream::new(rx);
    let svc = IstioCertificateServiceServer::new(service)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    tonic::transport::Server::builder()
        .timeout(REQUEST_TIMEOUT)
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .max_connection_age(MAX_CONNECTION_AGE)
        .max_connection_age_grace(REQUEST_TIMEOUT)
        .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
            max_in_flight,
        ))
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming, token.cancelled_owned())
        .await?;
    Ok(())
}
