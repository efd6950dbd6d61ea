//! A minimal keep-alive HTTPS client for the webhook: the tests, the e2e
//! harness and the benchmark talk to a server whose CA they hold.

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::pki::{ClientConfigError, client_config};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("TLS client config: {0}")]
    Config(#[from] ClientConfigError),
    #[error("connect: {0}")]
    Connect(#[source] std::io::Error),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("HTTP: {0}")]
    Http(#[from] hyper::Error),
    #[error("request: {0}")]
    Request(#[from] http::Error),
}

/// One HTTPS connection, kept alive across requests.
pub struct Connection {
    sender: SendRequest<Full<Bytes>>,
    host: String,
}

/// Connect to `addr`, trusting only `ca_pem`, checking the name `server_name`.
pub async fn connect(
    addr: std::net::SocketAddr,
    server_name: &str,
    ca_pem: &str,
) -> Result<Connection, ClientError> {
    connect_from(addr, None, server_name, ca_pem).await
}

/// [`connect`] from the local address `source` (any of 127.0.0.0/8 on
/// loopback: a client that looks like another pod to the server).
pub async fn connect_from(
    addr: std::net::SocketAddr,
    source: Option<std::net::IpAddr>,
    server_name: &str,
    ca_pem: &str,
) -> Result<Connection, ClientError> {
    let tls = tls_from(addr, source, server_name, ca_pem).await?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(Connection {
        sender,
        host: server_name.to_string(),
    })
}

/// A TLS connection to `addr` from `source` (else the kernel's choice),
/// for writing raw HTTP (a request sent slowly, say).
pub async fn tls_from(
    addr: std::net::SocketAddr,
    source: Option<std::net::IpAddr>,
    server_name: &str,
    ca_pem: &str,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, ClientError> {
    let cfg = client_config(ca_pem, None)?;
    let tcp = match source {
        None => TcpStream::connect(addr).await,
        Some(ip) => {
            let socket = if ip.is_ipv4() {
                tokio::net::TcpSocket::new_v4()
            } else {
                tokio::net::TcpSocket::new_v6()
            }
            .map_err(ClientError::Connect)?;
            socket
                .bind(std::net::SocketAddr::new(ip, 0))
                .map_err(ClientError::Connect)?;
            socket.connect(addr).await
        }
    }
    .map_err(ClientError::Connect)?;
    let _ = tcp.set_nodelay(true);
    let name = ServerName::try_from(server_name.to_string())
        .map_err(|e| ClientError::Tls(e.to_string()))?;
    TlsConnector::from(cfg)
        .connect(name, tcp)
        .await
        .map_err(|e| ClientError::Tls(e.to_string()))
}

impl Connection {
    /// Whether the server has closed it (an idle keep-alive connection
    /// past the server's timeout, say): a pool drops it rather than send
    /// on it, as Go's HTTP client (the API server's) does.
    pub fn is_closed(&self) -> bool {
        self.sender.is_closed()
    }

    /// Send one request; returns the status and the body.
    pub async fn request(
        &mut self,
        method: http::Method,
        path: &str,
        body: Vec<u8>,
    ) -> Result<(http::StatusCode, Vec<u8>), ClientError> {
        self.sender.ready().await?;
        let req = http::Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, &self.host)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let resp = self.sender.send_request(req).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes().to_vec();
        Ok((status, body))
    }
}
