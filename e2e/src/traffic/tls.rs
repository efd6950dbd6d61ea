//! The TLS (and mTLS) connector of this module's HTTP clients: it tells
//! hyper which certificate the server presented on each connection.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("invalid TLS server name {0:?}")]
    ServerName(String),
}
/// A fingerprint of a certificate (a hash of its DER), to tell certificates
/// apart without parsing them.
pub fn fingerprint(der: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    der.hash(&mut h);
    h.finish()
}

/// The fingerprint of the leaf certificate the server presented on a
/// response's connection (in the response's extensions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerCert(pub u64);

/// Connects over TCP, then TLS with `config` (which verifies the server and
/// may present a client certificate), for hyper's client.
#[derive(Clone)]
pub struct TlsConnector {
    tls: tokio_rustls::TlsConnector,
    server_name: ServerName<'static>,
}

impl TlsConnector {
    /// `server_name` is what the server certificate is verified against
    /// (the endpoints are IP addresses, certificates name the Service).
    pub fn new(config: Arc<rustls::ClientConfig>, server_name: &str) -> Result<Self, TlsError> {
        let server_name = ServerName::try_from(server_name.to_string())
            .map_err(|_| TlsError::ServerName(server_name.to_string()))?;
        Ok(Self {
            tls: tokio_rustls::TlsConnector::from(config),
            server_name,
        })
    }
}

type ConnectFuture = Pin<Box<dyn Future<Output = std::io::Result<TlsConn>> + Send>>;

impl tower::Service<hyper::Uri> for TlsConnector {
    type Response = TlsConn;
    type Error = std::io::Error;
    type Future = ConnectFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: hyper::Uri) -> Self::Future {
        let (tls, name) = (self.tls.clone(), self.server_name.clone());
        Box::pin(async move {
            let host = uri.host().unwrap_or("127.0.0.1").to_string();
            let port = uri.port_u16().unwrap_or(443);
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let stream = tls.connect(name, tcp).await?;
            let peer = stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .map(|c| fingerprint(c));
            Ok(TlsConn {
                io: TokioIo::new(stream),
                peer,
            })
        })
    }
}

/// A client TLS connection, telling hyper which certificate the server presented.
pub struct TlsConn {
    io: TokioIo<tokio_rustls::client::TlsStream<TcpStream>>,
    peer: Option<u64>,
}

impl Connection for TlsConn {
    fn connected(&self) -> Connected {
        let c = Connected::new();
        match self.peer {
            Some(p) => c.extra(PeerCert(p)),
            None => c,
        }
    }
}

impl hyper::rt::Read for TlsConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for TlsConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }
}
