//! A load generator: keep-alive HTTP/1.1 clients (plain or over mTLS)
//! sending at a steady rate.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connect, Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio::sync::Mutex;
use tokio::time::Instant;

/// One request's fate.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Since the start of the run.
    pub at: Duration,
    pub latency: Duration,
    /// `None`: the request failed (connection refused/reset, timeout).
    pub status: Option<u16>,
    pub error: Option<String>,
    /// The endpoint (pod) the request went to, for balanced runs.
    pub pod: Option<String>,
    /// Over TLS: the fingerprint of the certificate the server presented.
    pub peer: Option<u64>,
}

#[derive(Debug, Default, Clone)]
pub struct Summary {
    pub sent: usize,
    pub ok: usize,
    pub failed: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

pub fn summarize(samples: &[Sample]) -> Summary {
    let mut lat: Vec<f64> = samples
        .iter()
        .filter(|s| s.status == Some(200))
        .map(|s| s.latency.as_secs_f64() * 1e3)
        .collect();
    lat.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| {
        if lat.is_empty() {
            0.0
        } else {
            let i = ((lat.len() as f64 - 1.0) * p).round() as usize;
            lat[i.min(lat.len() - 1)]
        }
    };
    let ok = lat.len();
    Summary {
        sent: samples.len(),
        ok,
        failed: samples.len() - ok,
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
    }
}

/// Every client of this module: no retries of any kind. hyper's pool
/// otherwise resends a request that was queued on a connection the server
/// closed before the request was written, which hides exactly the losses a
/// drain can cause.
fn no_retry() -> hyper_util::client::legacy::Builder {
    let mut builder = Client::builder(TokioExecutor::new());
    builder.retry_canceled_requests(false);
    builder
}

/// Send `rate` requests a second to `url` until `stop` is set.
pub async fn run(url: String, rate: u32, stop: Arc<AtomicBool>) -> Vec<Sample> {
    run_with(no_retry(), url, rate, stop).await
}

/// [`run`]; kept for its callers (every client here is without retries).
pub async fn run_no_retry(url: String, rate: u32, stop: Arc<AtomicBool>) -> Vec<Sample> {
    run(url, rate, stop).await
}

async fn run_with(
    builder: hyper_util::client::legacy::Builder,
    url: String,
    rate: u32,
    stop: Arc<AtomicBool>,
) -> Vec<Sample> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Empty<Bytes>> = builder.build(connector);
    let samples = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let period = Duration::from_secs_f64(1.0 / f64::from(rate.max(1)));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tasks = tokio::task::JoinSet::new();
    while !stop.load(Ordering::SeqCst) {
        tick.tick().await;
        let client = client.clone();
        let url = url.clone();
        let samples = samples.clone();
        tasks.spawn(async move {
            let sent = Instant::now();
            let res = tokio::time::timeout(Duration::from_secs(10), async {
                let uri: hyper::Uri = url.parse()?;
                let resp = client.get(uri).await?;
                let status = resp.status().as_u16();
                resp.into_body().collect().await?;
                anyhow::Ok(status)
            })
            .await;
            let (status, error) = match res {
                Ok(Ok(s)) => (Some(s), None),
                Ok(Err(e)) => (None, Some(format!("{e:#}"))),
                Err(_) => (None, Some("timeout".into())),
            };
            samples.lock().await.push(Sample {
                at: sent.duration_since(start),
                latency: sent.elapsed(),
                status,
                error,
                pod: None,
                peer: None,
            });
        });
    }
    while tasks.join_next().await.is_some() {}
    let mut v = std::mem::take(&mut *samples.lock().await);
    v.sort_by_key(|s| s.at);
    v
}

/// Send `rate` requests a second, round-robin over `endpoints()` as read at
/// each request (a client-side balanced Service), until `stop` is set. With no
/// endpoint, the request fails at once ("no endpoint"). Idle keep-alive
/// connections are closed after `idle`. Sample times are since `epoch`.
pub async fn run_balanced<F>(
    endpoints: F,
    rate: u32,
    idle: Duration,
    epoch: Instant,
    stop: Arc<AtomicBool>,
) -> Vec<Sample>
where
    F: Fn() -> Vec<(String, std::net::SocketAddr)>,
{
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    balanced(
        pooled(connector, idle),
        "http",
        endpoints,
        rate,
        epoch,
        stop,
    )
    .await
}

/// `run_balanced` over TLS (`connector` holds the client certificate for
/// mTLS). Each sample records which certificate the server presented on
/// the connection it used.
pub async fn run_balanced_tls<F>(
    endpoints: F,
    rate: u32,
    idle: Duration,
    connector: TlsConnector,
    epoch: Instant,
    stop: Arc<AtomicBool>,
) -> Vec<Sample>
where
    F: Fn() -> Vec<(String, std::net::SocketAddr)>,
{
    balanced(
        pooled(connector, idle),
        "https",
        endpoints,
        rate,
        epoch,
        stop,
    )
    .await
}

/// A keep-alive client whose idle connections close after `idle`.
fn pooled<C>(connector: C, idle: Duration) -> Client<C, Empty<Bytes>>
where
    C: Connect + Clone + Send + Sync + 'static,
{
    // The pool only evicts idle connections when it has a timer.
    no_retry()
        .pool_timer(hyper_util::rt::TokioTimer::new())
        .pool_idle_timeout(idle)
        .build(connector)
}

/// A client that opens a new connection (a new TLS handshake) for every
/// request: what shows the certificate a server presents right now.
pub fn fresh_tls_client(connector: TlsConnector) -> Client<TlsConnector, Empty<Bytes>> {
    no_retry().pool_max_idle_per_host(0).build(connector)
}

async fn balanced<C, F>(
    client: Client<C, Empty<Bytes>>,
    scheme: &'static str,
    endpoints: F,
    rate: u32,
    epoch: Instant,
    stop: Arc<AtomicBool>,
) -> Vec<Sample>
where
    C: Connect + Clone + Send + Sync + 'static,
    F: Fn() -> Vec<(String, std::net::SocketAddr)>,
{
    let samples = Arc::new(Mutex::new(Vec::new()));
    let period = Duration::from_secs_f64(1.0 / f64::from(rate.max(1)));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tasks = tokio::task::JoinSet::new();
    let mut next = 0usize;
    while !stop.load(Ordering::SeqCst) {
        tick.tick().await;
        let eps = endpoints();
        let target = (!eps.is_empty()).then(|| eps[next % eps.len()].clone());
        next = next.wrapping_add(1);
        let client = client.clone();
        let samples = samples.clone();
        tasks.spawn(async move {
            let sample = match target {
                None => Sample {
                    at: Instant::now().duration_since(epoch),
                    latency: Duration::ZERO,
                    status: None,
                    error: Some("no endpoint".to_string()),
                    pod: None,
                    peer: None,
                },
                Some((pod, addr)) => get(&client, scheme, &pod, addr, epoch).await,
            };
            samples.lock().await.push(sample);
        });
    }
    while tasks.join_next().await.is_some() {}
    let mut v = std::mem::take(&mut *samples.lock().await);
    v.sort_by_key(|s| s.at);
    v
}

/// One `GET /` to `pod` at `addr` (timeout 10 s); times since `epoch`.
pub async fn get<C>(
    client: &Client<C, Empty<Bytes>>,
    scheme: &str,
    pod: &str,
    addr: std::net::SocketAddr,
    epoch: Instant,
) -> Sample
where
    C: Connect + Clone + Send + Sync + 'static,
{
    let sent = Instant::now();
    let res = tokio::time::timeout(Duration::from_secs(10), async {
        let uri: hyper::Uri = format!("{scheme}://{addr}/").parse()?;
        let resp = client.get(uri).await?;
        let status = resp.status().as_u16();
        let peer = resp.extensions().get::<PeerCert>().map(|p| p.0);
        resp.into_body().collect().await?;
        anyhow::Ok((status, peer))
    })
    .await;
    let (status, error, peer) = match res {
        Ok(Ok((s, peer))) => (Some(s), None, peer),
        Ok(Err(e)) => (None, Some(format!("{e:#}")), None),
        Err(_) => (None, Some("timeout".into()), None),
    };
    Sample {
        at: sent.duration_since(epoch),
        latency: sent.elapsed(),
        status,
        error,
        pod: Some(pod.to_string()),
        peer,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
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
    pub fn new(config: Arc<rustls::ClientConfig>, server_name: &str) -> Result<Self, LoadError> {
        let server_name = ServerName::try_from(server_name.to_string())
            .map_err(|_| LoadError::ServerName(server_name.to_string()))?;
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
