//! A load generator: keep-alive HTTP/1.1 clients sending at a steady rate.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
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

/// Send `rate` requests a second to `url` until `stop` is set.
pub async fn run(url: String, rate: u32, stop: Arc<AtomicBool>) -> Vec<Sample> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build(connector);
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
    // The pool only evicts idle connections when it has a timer.
    let client: Client<HttpConnector, Empty<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_timer(hyper_util::rt::TokioTimer::new())
        .pool_idle_timeout(idle)
        .build(connector);
    let samples = Arc::new(Mutex::new(Vec::new()));
    let start = epoch;
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
            let sent = Instant::now();
            let (status, error, pod) = match target {
                None => (None, Some("no endpoint".to_string()), None),
                Some((pod, addr)) => {
                    let res = tokio::time::timeout(Duration::from_secs(10), async {
                        let uri: hyper::Uri = format!("http://{addr}/").parse()?;
                        let resp = client.get(uri).await?;
                        let status = resp.status().as_u16();
                        resp.into_body().collect().await?;
                        anyhow::Ok(status)
                    })
                    .await;
                    match res {
                        Ok(Ok(s)) => (Some(s), None, Some(pod)),
                        Ok(Err(e)) => (None, Some(format!("{e:#}")), Some(pod)),
                        Err(_) => (None, Some("timeout".into()), Some(pod)),
                    }
                }
            };
            samples.lock().await.push(Sample {
                at: sent.duration_since(start),
                latency: sent.elapsed(),
                status,
                error,
                pod,
            });
        });
    }
    while tasks.join_next().await.is_some() {}
    let mut v = std::mem::take(&mut *samples.lock().await);
    v.sort_by_key(|s| s.at);
    v
}
