//! Hostile clients for the bounds benchmark (`hostile-bench`): slow-loris
//! connections that keep coming back, oversized admission reviews, and the
//! probe and memory samplers that show what the target did meanwhile.
//! Traffic goes to loopback only.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::agentbench::rss;
use crate::stats::Summary;

/// What the slow-loris attackers managed.
#[derive(Debug, Default)]
pub struct LorisCounts {
    /// Connections opened (first ones and reconnects after a close).
    pub opened: AtomicU64,
    /// Connects that failed (refused, reset).
    pub connect_failed: AtomicU64,
}

/// `n` attackers until `stop`: each opens a connection from `source` (a
/// loopback address other than the prober's: the attacker is another pod),
/// starts a request head and sends one more byte every second, never
/// finishing it; when the server closes the connection it opens another at
/// once.
pub fn slow_loris(
    target: SocketAddr,
    source: std::net::IpAddr,
    n: usize,
    stop: CancellationToken,
) -> (Arc<LorisCounts>, tokio::task::JoinSet<()>) {
    let counts = Arc::new(LorisCounts::default());
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        let counts = Arc::clone(&counts);
        let stop = stop.clone();
        set.spawn(async move {
            while !stop.is_cancelled() {
                let Ok(mut s) = connect_from(source, target).await else {
                    counts.connect_failed.fetch_add(1, Ordering::Relaxed);
                    // Spread reconnects instead of hammering in step.
                    tokio::time::sleep(Duration::from_millis(10 + (i % 50) as u64)).await;
                    continue;
                };
                counts.opened.fetch_add(1, Ordering::Relaxed);
                if s.write_all(b"GET /healthz HTTP/1.1\r\nx-slow: ")
                    .await
                    .is_err()
                {
                    continue;
                }
                let mut buf = [0u8; 1024];
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_secs(1)) => {
                            if s.write_all(b"a").await.is_err() { break; }
                        }
                        // The server closed (or answered and closed): go again.
                        r = s.read(&mut buf) => if matches!(r, Ok(0) | Err(_)) { break },
                    }
                }
            }
        });
    }
    (counts, set)
}

async fn connect_from(source: std::net::IpAddr, target: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = if source.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.bind(SocketAddr::new(source, 0))?;
    socket.connect(target).await
}

/// Probe results: latency of every answered probe, and how many failed.
#[derive(Debug, Default, Clone)]
pub struct Probes {
    pub latencies_ms: Vec<f64>,
    /// Not answered 200 within the probe timeout (1 s, the kubelet's default).
    pub failed: u64,
    /// The failures by what went wrong.
    pub failures: std::collections::BTreeMap<&'static str, u64>,
}

impl Probes {
    pub fn summary(&self) -> Summary {
        Summary::of(&self.latencies_ms)
    }
}

/// GET `path` on a fresh connection every `period` until `stop`, the way a
/// kubelet probes. `get` does one probe and says whether it got a 200.
pub async fn probe_every<F, Fut>(period: Duration, stop: CancellationToken, mut get: F) -> Probes
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), &'static str>>,
{
    let mut out = Probes::default();
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return out,
            _ = tick.tick() => {}
        }
        let t = Instant::now();
        let why = match tokio::time::timeout(Duration::from_secs(1), get()).await {
            Ok(Ok(())) => {
                out.latencies_ms.push(t.elapsed().as_secs_f64() * 1e3);
                continue;
            }
            Ok(Err(why)) => why,
            Err(_) => "timeout",
        };
        out.failed += 1;
        *out.failures.entry(why).or_default() += 1;
    }
}

/// One plain-HTTP probe: `GET path` with `connection: close`; Ok on 200,
/// else what went wrong.
pub async fn plain_get(addr: SocketAddr, path: &str) -> Result<(), &'static str> {
    let mut s = TcpStream::connect(addr).await.map_err(|_| "connect")?;
    let req = format!("GET {path} HTTP/1.1\r\nhost: probe\r\nconnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.map_err(|_| "write")?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head)
        .await
        .map_err(|_| "closed without an answer")?;
    if head.starts_with(b"HTTP/1.1 200") {
        Ok(())
    } else {
        Err("not 200")
    }
}

/// The highest VmRSS of `pid`, sampled every `period` until `stop`, in MiB.
pub async fn peak_rss_mib(pid: i32, period: Duration, stop: CancellationToken) -> f64 {
    let mut peak = 0;
    loop {
        peak = peak.max(rss(pid));
        tokio::select! {
            () = stop.cancelled() => return mib(peak.max(rss(pid))),
            () = tokio::time::sleep(period) => {}
        }
    }
}

pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// An AdmissionReview of a Pod CREATE whose JSON is `bytes` long (within a
/// few bytes): one annotation carries the bulk, the way a big pod would.
pub fn review_of_size(bytes: usize, uid: &str) -> Vec<u8> {
    let shell = |pad: &str| {
        let pod = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "big",
                "namespace": "hostile",
                "labels": {"remora.dev/inject": "true"},
                "annotations": {"bench.remora.dev/pad": pad}
            },
            "spec": {"containers": [{"name": "app", "image": "app:1"}]}
        });
        crate::webhook::pod_create_review(&pod, "hostile", uid)
            .to_string()
            .into_bytes()
    };
    let base = shell("").len();
    shell(&"x".repeat(bytes.saturating_sub(base)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reviews_have_the_size_asked_for() {
        let r = review_of_size(100_000, "u");
        assert_eq!(r.len(), 100_000);
        let v: serde_json::Value = serde_json::from_slice(&r).expect("json");
        assert_eq!(v["request"]["object"]["kind"], "Pod");
    }
}
