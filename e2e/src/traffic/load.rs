//! Steady-rate loads at fixed addresses: a [`Load`] is one kind of client
//! ([`Kind`]) aimed at one address at a rate, open loop; [`Traffic`] runs
//! several side by side against a shared epoch.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::exchange::{Answer, Open, get_request, grpc_stream, grpc_unary, http};
use super::{DEFAULT_TIMEOUT, HttpClient, Outcome, Sample, grpc_channel, h2c_client, http1_client};

/// A kind of client, as the benchmark's users run them.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    /// `GET /` over HTTP/1.1 keep-alive ([`IDLE_KEEP_ALIVE`] idle pool).
    Http1KeepAlive,
    /// `GET /` over `connections` HTTP/2 connections with prior knowledge
    /// (h2c), requests spread round-robin over them.
    H2c { connections: usize },
    /// `POST /echo` with a body of `body_bytes` over HTTP/1.1 keep-alive;
    /// the echoed body must come back whole.
    Post { body_bytes: usize },
    /// `GET /slow?ms=N` over HTTP/1.1 keep-alive, N spread evenly over
    /// `min..=max` (a request in flight for seconds when SIGTERM comes).
    Long { min: Duration, max: Duration },
    /// gRPC `grpc.health.v1.Health/Check` over one tonic channel.
    GrpcUnary,
    /// gRPC `grpc.health.v1.Health/Watch` over one tonic channel, each stream
    /// held `hold` (or until the traffic stops) and then closed by the
    /// client. A stream the server ends cleanly is fine; one that ends with
    /// an error status or a reset is a failure.
    GrpcStream { hold: Duration },
}

impl Kind {
    /// A short name for tables and JSON.
    pub fn label(&self) -> &'static str {
        match self {
            Kind::Http1KeepAlive => "http1",
            Kind::H2c { .. } => "h2c",
            Kind::Post { .. } => "post",
            Kind::Long { .. } => "long",
            Kind::GrpcUnary => "grpc-unary",
            Kind::GrpcStream { .. } => "grpc-stream",
        }
    }

    fn default_timeout(&self) -> Duration {
        match self {
            Kind::Long { max, .. } => *max + DEFAULT_TIMEOUT,
            _ => DEFAULT_TIMEOUT,
        }
    }
}

/// One client of the benchmark: a kind aimed at an address at a rate.
#[derive(Debug, Clone)]
pub struct Load {
    /// What samples are labelled with (default: the kind's label); name
    /// loads apart when one kind goes to two places.
    pub name: String,
    pub kind: Kind,
    /// `ip:port` served by the test app, directly or through proxies.
    pub target: SocketAddr,
    /// Requests (or streams) started per second, whatever the answers do
    /// (open loop).
    pub rate: f64,
    /// Time a request may take (for a stream: until its first message).
    pub timeout: Duration,
}

impl Load {
    pub fn new(kind: Kind, target: SocketAddr, rate: f64) -> Self {
        Self {
            name: kind.label().to_owned(),
            timeout: kind.default_timeout(),
            kind,
            target,
            rate,
        }
    }

    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// Loads running side by side until [`Traffic::stop`].
pub struct Traffic {
    stop: watch::Sender<bool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    open: std::collections::BTreeMap<String, Arc<AtomicUsize>>,
    runs: JoinSet<()>,
}

impl Traffic {
    /// Starts every load at once; sample times are since `epoch`.
    pub fn start(loads: Vec<Load>, epoch: Instant) -> Self {
        let (stop, stopped) = watch::channel(false);
        let samples = Arc::new(Mutex::new(Vec::new()));
        let mut runs = JoinSet::new();
        let mut open: std::collections::BTreeMap<String, Arc<AtomicUsize>> = Default::default();
        for load in loads {
            let gauge = open.entry(load.name.clone()).or_default().clone();
            runs.spawn(run_load(
                load,
                epoch,
                stopped.clone(),
                samples.clone(),
                gauge,
            ));
        }
        Self {
            stop,
            samples,
            open,
            runs,
        }
    }

    /// Requests of load `name` in flight now (sent, not answered); for
    /// streams, those open (first message received) and not ended. To wait
    /// for work in flight before a scenario's next step.
    pub fn open(&self, name: &str) -> usize {
        self.open.get(name).map_or(0, |g| g.load(Ordering::SeqCst))
    }

    /// The samples finished so far (in completion order), e.g. to wait for
    /// each load to have answers before starting a scenario.
    pub fn samples(&self) -> Vec<Sample> {
        self.samples
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Stops sending, lets the requests in flight finish (each within its
    /// timeout; held streams end at once), and returns every sample, by
    /// send time.
    pub async fn stop(mut self) -> Vec<Sample> {
        let _ = self.stop.send(true);
        while self.runs.join_next().await.is_some() {}
        let mut all = std::mem::take(&mut *self.samples.lock().unwrap_or_else(|p| p.into_inner()));
        all.sort_by_key(|s| s.at);
        all
    }
}

/// The client of one load, shared by its requests.
#[derive(Clone)]
enum Clients {
    Http(Box<HttpClient>),
    H2c(Vec<HttpClient>),
    Grpc(tonic::transport::Channel),
}

async fn run_load(
    load: Load,
    epoch: Instant,
    mut stopped: watch::Receiver<bool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    open: Arc<AtomicUsize>,
) {
    let name: Arc<str> = load.name.clone().into();
    let clients = match &load.kind {
        Kind::H2c { connections } => {
            Clients::H2c((0..(*connections).max(1)).map(|_| h2c_client()).collect())
        }
        Kind::GrpcUnary | Kind::GrpcStream { .. } => match grpc_channel(load.target) {
            Ok(c) => Clients::Grpc(c),
            Err(e) => {
                let sample = Sample {
                    load: name,
                    kind: load.kind.label(),
                    at: Instant::now().duration_since(epoch),
                    latency: Duration::ZERO,
                    outcome: Outcome::Other {
                        detail: format!("gRPC endpoint: {e}"),
                    },
                    pod: None,
                    peer: None,
                };
                samples
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(sample);
                return;
            }
        },
        _ => Clients::Http(Box::new(http1_client())),
    };
    let load = Arc::new(load);
    let period = Duration::from_secs_f64(1.0 / load.rate.max(1e-3));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut inflight = JoinSet::new();
    let mut n: u64 = 0;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopped.wait_for(|s| *s) => break,
        }
        // Reap finished requests so the set stays small in long runs.
        while inflight.try_join_next().is_some() {}
        let (load, clients, name, samples, stopped, open) = (
            load.clone(),
            clients.clone(),
            name.clone(),
            samples.clone(),
            stopped.clone(),
            open.clone(),
        );
        let seq = n;
        n += 1;
        inflight.spawn(async move {
            let sent = Instant::now();
            let answer = one(&load, &clients, seq, stopped, &open).await;
            let sample = Sample {
                load: name,
                kind: load.kind.label(),
                at: sent.duration_since(epoch),
                latency: answer.first.unwrap_or_else(|| sent.elapsed()),
                outcome: answer.outcome,
                pod: answer.pod,
                peer: answer.peer,
            };
            samples
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(sample);
        });
    }
    while inflight.join_next().await.is_some() {}
}

/// The `seq`-th request of a load.
async fn one(
    load: &Load,
    clients: &Clients,
    seq: u64,
    stopped: watch::Receiver<bool>,
    open: &AtomicUsize,
) -> Answer {
    if let (Kind::GrpcStream { hold }, Clients::Grpc(ch)) = (&load.kind, clients) {
        return grpc_stream(ch.clone(), load.timeout, *hold, stopped, open).await;
    }
    let _open = Open::new(open);
    let base = format!("http://{}", load.target);
    match (&load.kind, clients) {
        (Kind::Http1KeepAlive, Clients::Http(c)) => {
            http(c, get_request(&format!("{base}/")), load.timeout, None).await
        }
        (Kind::H2c { .. }, Clients::H2c(cs)) => {
            let c = &cs[seq as usize % cs.len()];
            http(c, get_request(&format!("{base}/")), load.timeout, None).await
        }
        (Kind::Post { body_bytes }, Clients::Http(c)) => {
            let body = Bytes::from(vec![b'x'; *body_bytes]);
            let req = http::Request::post(format!("{base}/echo"))
                .header(http::header::CONTENT_TYPE, "application/octet-stream")
                .body(Full::new(body));
            http(c, req, load.timeout, Some(*body_bytes)).await
        }
        (Kind::Long { min, max }, Clients::Http(c)) => {
            let ms = spread(seq, *min, *max).as_millis();
            http(
                c,
                get_request(&format!("{base}/slow?ms={ms}")),
                load.timeout,
                None,
            )
            .await
        }
        (Kind::GrpcUnary, Clients::Grpc(ch)) => grpc_unary(ch.clone(), load.timeout).await,
        (kind, _) => (
            Outcome::Other {
                detail: format!("no client for {kind:?}"),
            },
            None,
        )
            .into(),
    }
}

/// The `seq`-th point of a low-discrepancy sequence over `min..=max`:
/// evenly spread, the same in every run, no random source needed.
pub fn spread(seq: u64, min: Duration, max: Duration) -> Duration {
    const GOLDEN: f64 = 0.618_033_988_749_895;
    let x = (seq as f64 * GOLDEN).fract();
    min + (max.saturating_sub(min)).mul_f64(x)
}
