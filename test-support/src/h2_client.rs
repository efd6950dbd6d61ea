//! One HTTP/2 connection over TLS from a chosen source address (127.0.0.2,
//! say, to be another client than 127.0.0.1 on loopback), for the tests of
//! servers bounded per source. The caller drives requests with the sender;
//! the connection's task ends when the server closes it.

use std::net::{IpAddr, SocketAddr};

use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;
use tokio::net::TcpSocket;
use tokio::task::JoinHandle;
use tokio_rustls::TlsConnector;

use crate::pki::client_config;
use crate::webhook_client::ClientError;

/// An HTTP/2 connection: its sender, and its task, which ends (with how)
/// once the connection is closed.
pub struct H2<B> {
    pub sender: SendRequest<B>,
    pub conn: JoinHandle<Result<(), hyper::Error>>,
}

/// Connect from `source` (port chosen by the kernel) to `addr`, trusting
/// only `ca_pem`, checking `server_name`, offering ALPN `h2`.
pub async fn connect<B>(
    source: IpAddr,
    addr: SocketAddr,
    server_name: &str,
    ca_pem: &str,
) -> Result<H2<B>, ClientError>
where
    B: hyper::body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut cfg = (*client_config(ca_pem, None)?).clone();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    let socket = match source {
        IpAddr::V4(_) => TcpSocket::new_v4(),
        IpAddr::V6(_) => TcpSocket::new_v6(),
    }
    .map_err(ClientError::Connect)?;
    socket
        .bind(SocketAddr::new(source, 0))
        .map_err(ClientError::Connect)?;
    let tcp = socket.connect(addr).await.map_err(ClientError::Connect)?;
    let _ = tcp.set_nodelay(true);
    let name = ServerName::try_from(server_name.to_string())
        .map_err(|e| ClientError::Tls(e.to_string()))?;
    let tls = TlsConnector::from(std::sync::Arc::new(cfg))
        .connect(name, tcp)
        .await
        .map_err(|e| ClientError::Tls(e.to_string()))?;
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls)).await?;
    Ok(H2 {
        sender,
        conn: tokio::spawn(conn),
    })
}

/// What a tonic client runs on over one [`H2`] connection
/// (`SomeServiceClient::with_origin(channel(&h2), origin)`).
pub type Channel = tower::util::BoxCloneSyncService<
    http::Request<tonic::body::Body>,
    http::Response<hyper::body::Incoming>,
    hyper::Error,
>;

/// A [`Channel`] on `h2`: every request waits for the connection to be
/// ready, then goes out on it.
pub fn channel(h2: &H2<tonic::body::Body>) -> Channel {
    let sender = h2.sender.clone();
    let svc = tower::service_fn(move |req: http::Request<tonic::body::Body>| {
        let mut sender = sender.clone();
        async move {
            sender.ready().await?;
            sender.send_request(req).await
        }
    });
    tower::util::BoxCloneSyncService::new(svc)
}
