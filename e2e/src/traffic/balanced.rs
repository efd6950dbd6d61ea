//! Steady-rate loads balanced on the client side, as a Service's endpoints
//! change: round robin over the endpoints read at each request, plain or
//! over (m)TLS.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::Connect;
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::exchange::http1_label;
use super::{Outcome, Sample, TlsConnector, get, http1_pool, tls_client};

/// Sends `rate` requests a second, round-robin over `endpoints()` (pod
/// name, address) as read at each request, until `stop` is set. With no
/// endpoint, the request fails at once (`other: no endpoint`). Idle
/// keep-alive connections close after `idle`. Sample times are since
/// `epoch`; each sample's pod is the endpoint it was sent to.
pub async fn run_balanced<F>(
    endpoints: F,
    rate: u32,
    idle: Duration,
    epoch: Instant,
    stop: Arc<AtomicBool>,
) -> Vec<Sample>
where
    F: Fn() -> Vec<(String, SocketAddr)>,
{
    balanced(http1_pool(idle), "http", endpoints, rate, epoch, stop).await
}

/// [`run_balanced`] over TLS (`connector` holds the client certificate for
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
    F: Fn() -> Vec<(String, SocketAddr)>,
{
    balanced(
        tls_client(connector, idle),
        "https",
        endpoints,
        rate,
        epoch,
        stop,
    )
    .await
}

async fn balanced<C, F>(
    client: Client<C, Full<Bytes>>,
    scheme: &'static str,
    endpoints: F,
    rate: u32,
    epoch: Instant,
    stop: Arc<AtomicBool>,
) -> Vec<Sample>
where
    C: Connect + Clone + Send + Sync + 'static,
    F: Fn() -> Vec<(String, SocketAddr)>,
{
    let samples = Arc::new(Mutex::new(Vec::new()));
    let period = Duration::from_secs_f64(1.0 / f64::from(rate.max(1)));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tasks = tokio::task::JoinSet::new();
    let mut next = 0usize;
    while !stop.load(Ordering::SeqCst) {
        tick.tick().await;
        // Reap finished requests so the set stays small in long runs.
        while tasks.try_join_next().is_some() {}
        let eps = endpoints();
        let target = (!eps.is_empty()).then(|| eps[next % eps.len()].clone());
        next = next.wrapping_add(1);
        let client = client.clone();
        let samples = samples.clone();
        tasks.spawn(async move {
            let sample = match target {
                None => {
                    let kind = http1_label(scheme);
                    Sample {
                        load: Arc::from(kind),
                        kind,
                        at: Instant::now().duration_since(epoch),
                        latency: Duration::ZERO,
                        outcome: Outcome::Other {
                            detail: "no endpoint".to_string(),
                        },
                        pod: None,
                        peer: None,
                    }
                }
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
