//! An app that names itself: every request (HTTP/1.1 or h2c) gets an empty
//! 200 with its name in [`HEADER`], and is counted. Tests of balancing and
//! secure naming read which backend answered.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use hyper_util::rt::{TokioExecutor, TokioIo};

/// The response header carrying the backend's name.
pub const HEADER: &str = "x-backend";

/// A running backend; it serves until the runtime ends.
pub struct NamedBackend {
    pub addr: SocketAddr,
    served: Arc<AtomicUsize>,
}

impl NamedBackend {
    /// Binds `addr` (port 0 for any) and serves as `name`.
    pub async fn start(addr: SocketAddr, name: impl Into<String>) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let served = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&served);
        let name: Arc<str> = name.into().into();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (count, name) = (Arc::clone(&count), Arc::clone(&name));
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |_req| {
                        count.fetch_add(1, Ordering::SeqCst);
                        let name = Arc::clone(&name);
                        async move {
                            http::Response::builder()
                                .header(HEADER, &*name)
                                .body(String::new())
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Ok(Self { addr, served })
    }

    /// Requests answered so far.
    pub fn served(&self) -> usize {
        self.served.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn answers_with_its_name_and_counts() {
        let b = NamedBackend::start("127.0.0.1:0".parse().expect("addr"), "web-1")
            .await
            .expect("bind");
        let mut s = tokio::net::TcpStream::connect(b.addr)
            .await
            .expect("connect");
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("read");
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        assert!(out.contains("x-backend: web-1"), "{out}");
        assert_eq!(b.served(), 1);
    }
}
