//! An open-loop AdmissionReview client for the operator's `/inject`: the
//! i-th review is due at `start + i / rate` whatever became of the others,
//! and its latency runs from that due time (a slow answer delays no later
//! send, so a stall shows in full: no coordinated omission). No retries: a
//! failed review is counted as an error. Keep-alive HTTPS connections are
//! reused when idle and opened when none is (the connect then counts in the
//! latency), as the API server's webhook client does; one the server closed
//! while idle is dropped, as that client's is.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use remora_test_support::webhook_client::{Connection, connect};
use serde::Serialize;
use serde_json::Value;

use crate::webhook::pod_create_review;
use tokio::sync::{Mutex, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::stats::Summary;

/// Reviews in flight at once; past that a due review is counted as an
/// error (`overloaded`) rather than queued behind the client.
const MAX_IN_FLIGHT: usize = 512;
/// How long one review may take before it is an error.
const REVIEW_TIMEOUT: Duration = Duration::from_secs(10);

/// What a run of the client saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Outcome {
    pub rate: u32,
    pub seconds: f64,
    pub sent: usize,
    /// Answered 200, allowed, with the review's uid and a patch.
    pub ok: usize,
    pub errors: usize,
    /// Of the errors, the first few, for the report.
    pub first_errors: Vec<String>,
    /// Latency of the answered reviews, from their due times.
    pub latency: Summary,
    /// The same window as the operator itself timed it (`None`: its
    /// `/metrics` could not be read).
    pub server: Option<ServerSide>,
}

/// The operator's own histogram of review times over the run (its
/// `admission_duration_seconds`, from a review's first byte read to its
/// answer): what the client's latency holds besides the operator's work
/// (accept and TLS, the client's and the machine's scheduling). The
/// buckets double, so each figure is the bucket's upper bound.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ServerSide {
    /// Reviews the operator answered in the window (any client's).
    pub reviews: u64,
    pub p50_ms_at_most: Option<f64>,
    pub p99_ms_at_most: Option<f64>,
}

/// The histogram's series in the Prometheus text format.
const HISTOGRAM: &str = "remora_operator_admission_duration_seconds_bucket";

/// Cumulative counts by upper bound (seconds; `+Inf` last).
type Buckets = Vec<(f64, u64)>;

fn buckets(metrics: &str) -> Buckets {
    metrics
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(HISTOGRAM)?;
            let le = rest.split("le=\"").nth(1)?.split('"').next()?;
            let count = rest.rsplit(' ').next()?.parse().ok()?;
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((bound, count))
        })
        .collect()
}

/// What the operator answered between two readings of its histogram.
fn between(before: &Buckets, after: &Buckets) -> ServerSide {
    let delta: Buckets = after
        .iter()
        .map(|&(le, n)| {
            let was = before.iter().find(|(b, _)| *b == le).map_or(0, |(_, n)| *n);
            (le, n.saturating_sub(was))
        })
        .collect();
    let reviews = delta.last().map_or(0, |(_, n)| *n);
    let at_most = |q: f64| {
        let rank = (q * reviews as f64).ceil() as u64;
        delta
            .iter()
            .find(|(_, n)| reviews > 0 && *n >= rank)
            .map(|(le, _)| le * 1e3)
            .filter(|ms| ms.is_finite())
    };
    ServerSide {
        reviews,
        p50_ms_at_most: at_most(0.5),
        p99_ms_at_most: at_most(0.99),
    }
}

/// Whether `body` is a successful answer to the review `uid` that injects.
fn injected(body: &[u8], uid: &str) -> Result<(), String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let r = &v["response"];
    if r["uid"] != uid {
        return Err(format!("uid {} for {uid}", r["uid"]));
    }
    if r["allowed"] != true {
        return Err(format!("not allowed: {}", r["status"]));
    }
    if r["patch"].as_str().is_none_or(str::is_empty) {
        return Err("allowed without a patch (not injected)".into());
    }
    Ok(())
}

struct Pool {
    addr: SocketAddr,
    ca_pem: String,
    idle: Mutex<Vec<Connection>>,
}

impl Pool {
    async fn send(&self, body: Vec<u8>, uid: &str) -> Result<(), String> {
        let idle = {
            let mut idle = self.idle.lock().await;
            // Closed by the server while idle (its 30 s read timeout):
            // dropped unused, as the API server's client does.
            idle.retain(|c| !c.is_closed());
            idle.pop()
        };
        let mut conn = match idle {
            Some(c) => c,
            None => connect(self.addr, "localhost", &self.ca_pem)
                .await
                .map_err(|e| format!("connect: {e}"))?,
        };
        let (status, answer) = conn
            .request(http::Method::POST, "/inject", body)
            .await
            .map_err(|e| e.to_string())?;
        // Only a connection that answered goes back to the pool.
        self.idle.lock().await.push(conn);
        if status != http::StatusCode::OK {
            return Err(format!("HTTP {status}"));
        }
        injected(&answer, uid)
    }

    /// The operator's review-time histogram, on a connection of its own.
    async fn histogram(&self) -> Option<Buckets> {
        let mut conn = connect(self.addr, "localhost", &self.ca_pem).await.ok()?;
        let (status, body) = conn
            .request(http::Method::GET, "/metrics", Vec::new())
            .await
            .ok()?;
        let b = buckets(&String::from_utf8_lossy(&body));
        (status == http::StatusCode::OK && !b.is_empty()).then_some(b)
    }
}

/// Sends `rate` reviews of `pod` (in `namespace`) a second to the operator
/// at `addr` (trusting `ca_pem`) until `stop` or `max` has passed.
pub async fn run(
    addr: SocketAddr,
    ca_pem: &str,
    pod: &Value,
    namespace: &str,
    rate: u32,
    stop: CancellationToken,
    max: Duration,
) -> Outcome {
    let pool = Arc::new(Pool {
        addr,
        ca_pem: ca_pem.to_owned(),
        idle: Mutex::new(Vec::new()),
    });
    let before = pool.histogram().await;
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let start = Instant::now();
    let period = Duration::from_secs_f64(1.0 / f64::from(rate.max(1)));
    let mut tasks: JoinSet<Result<Duration, String>> = JoinSet::new();
    let mut sent = 0usize;
    let mut overloaded = 0usize;
    loop {
        let due = start + period * u32::try_from(sent).unwrap_or(u32::MAX);
        if due - start >= max {
            break;
        }
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep_until(due) => {}
        }
        sent += 1;
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            overloaded += 1;
            continue;
        };
        let uid = format!("00000000-0000-4000-8000-{sent:012}");
        let body = serde_json::to_vec(&pod_create_review(pod, namespace, &uid)).unwrap_or_default();
        let pool = Arc::clone(&pool);
        tasks.spawn(async move {
            let r = tokio::time::timeout(REVIEW_TIMEOUT, pool.send(body, &uid)).await;
            drop(permit);
            match r {
                Ok(Ok(())) => Ok(due.elapsed()),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(format!("no answer within {REVIEW_TIMEOUT:?}")),
            }
        });
    }
    let seconds = start.elapsed().as_secs_f64();
    let mut latencies = Vec::with_capacity(sent);
    let mut first_errors = Vec::new();
    let mut errors = overloaded;
    if overloaded > 0 {
        first_errors.push(format!("{overloaded} due with {MAX_IN_FLIGHT} in flight"));
    }
    while let Some(r) = tasks.join_next().await {
        match r {
            Ok(Ok(d)) => latencies.push(d.as_secs_f64() * 1e3),
            Ok(Err(e)) => {
                errors += 1;
                if first_errors.len() < 5 {
                    first_errors.push(e);
                }
            }
            Err(e) => {
                errors += 1;
                if first_errors.len() < 5 {
                    first_errors.push(format!("task: {e}"));
                }
            }
        }
    }
    let after = pool.histogram().await;
    Outcome {
        rate,
        seconds,
        sent,
        ok: latencies.len(),
        errors,
        first_errors,
        latency: Summary::of(&latencies),
        server: before.zip(after).map(|(b, a)| between(&b, &a)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_an_injecting_answer_to_this_review_counts() {
        let ok = json!({"response": {"uid": "u", "allowed": true, "patch": "W10="}});
        assert_eq!(injected(ok.to_string().as_bytes(), "u"), Ok(()));
        assert!(injected(ok.to_string().as_bytes(), "v").is_err());
        let bare = json!({"response": {"uid": "u", "allowed": true}});
        assert!(injected(bare.to_string().as_bytes(), "u").is_err());
        let refused = json!({"response": {"uid": "u", "allowed": false}});
        assert!(injected(refused.to_string().as_bytes(), "u").is_err());
        assert!(injected(b"<html>", "u").is_err());
    }

    #[test]
    fn the_operators_own_quantiles_come_from_the_histograms_difference() {
        let text = |counts: [u64; 4]| {
            format!(
                "# TYPE x histogram\n{HISTOGRAM}{{le=\"0.0001\"}} {}\n{HISTOGRAM}{{le=\"0.0002\"}} {}\n{HISTOGRAM}{{le=\"0.0004\"}} {}\n{HISTOGRAM}{{le=\"+Inf\"}} {}\nremora_operator_admission_duration_seconds_count 9\n",
                counts[0], counts[1], counts[2], counts[3]
            )
        };
        let before = buckets(&text([5, 5, 5, 5]));
        assert_eq!(before.len(), 4);
        // 100 more: 90 under 100 µs, 9 under 200 µs, 1 over 400 µs.
        let after = buckets(&text([95, 104, 104, 105]));
        let s = between(&before, &after);
        assert_eq!(s.reviews, 100);
        assert_eq!(s.p50_ms_at_most, Some(0.1));
        assert_eq!(s.p99_ms_at_most, Some(0.2));
        // A quantile past the last finite bound has no figure.
        let slow = buckets(&text([5, 5, 5, 105]));
        assert_eq!(between(&before, &slow).p99_ms_at_most, None);
        assert_eq!(between(&before, &before).p50_ms_at_most, None);
    }

    #[test]
    fn a_review_carries_the_pod_and_its_namespace() {
        let pod = json!({"metadata": {"name": "p"}, "spec": {"containers": []}});
        let r = pod_create_review(&pod, "ns", "u");
        assert_eq!(r["request"]["object"], pod);
        assert_eq!(r["request"]["namespace"], "ns");
        assert_eq!(r["request"]["name"], "p");
        assert_eq!(r["request"]["operation"], "CREATE");
    }
}
