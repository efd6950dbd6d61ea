//! How fast the leader's controllers may call the API server: a rate
//! (`--kube-api-qps`, with bursts of `--kube-api-burst`) and a bound on
//! requests in flight. A change that reaches 10,000 pods becomes 10,000
//! patches; unbounded, they would queue in the API server ahead of
//! everyone else's requests and take this process's CPU from the webhook.

use std::sync::Arc;
use std::time::Duration;

use leaky_bucket::RateLimiter;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Requests in flight at once: enough to cover the API server's latency at
/// the default rate, few enough to keep its queue short.
pub const MAX_IN_FLIGHT: usize = 32;

/// The default sustained rate, requests per second. 10,000 pods retuned in
/// under a minute needs about 170 patches a second.
pub const DEFAULT_QPS: u32 = 200;
/// The default burst: a change reaching a few hundred pods goes out at once.
pub const DEFAULT_BURST: u32 = 400;

/// Shared by every request the controllers make (watches excepted).
pub struct Budget {
    rate: RateLimiter,
    in_flight: Arc<Semaphore>,
}

/// Held while one request is in flight.
pub struct Permit {
    _in_flight: OwnedSemaphorePermit,
}

impl Budget {
    /// `qps` requests per second and bursts of `burst` (each at least 1).
    pub fn new(qps: u32, burst: u32) -> Self {
        // The bucket counts whole milliseconds: `refill` tokens every
        // `interval` ms with refill/interval = qps/1000 exactly. It sleeps
        // from one refill to the next and counts the next interval from when
        // it woke, so each wake-up's lateness is lost: with a refill every
        // few ms, the timer's millisecond and a busy machine's delays take a
        // large share of the rate. Refills at least `MIN_REFILL_INTERVAL_MS`
        // apart make that loss a few percent.
        let qps = qps.max(1);
        let g = gcd(qps, 1000);
        let (exact_refill, exact_ms) = (qps / g, 1000 / g);
        let k = MIN_REFILL_INTERVAL_MS.div_ceil(exact_ms).max(1);
        let (refill, interval) = (
            exact_refill.saturating_mul(k) as usize,
            Duration::from_millis(u64::from(exact_ms.saturating_mul(k))),
        );
        let burst = burst.max(1) as usize;
        Self {
            rate: RateLimiter::builder()
                .max(burst.max(refill))
                .initial(burst)
                .refill(refill)
                .interval(interval)
                .build(),
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
        }
    }

    /// Wait for a slot in flight, then for the rate; hold the permit until
    /// the request is answered.
    pub async fn acquire(&self) -> Permit {
        let permit = Arc::clone(&self.in_flight)
            .acquire_owned()
            .await
            .unwrap_or_else(|_| unreachable!("the budget's semaphore is never closed"));
        self.rate.acquire_one().await;
        Permit { _in_flight: permit }
    }
}

/// The shortest time between refills, in milliseconds (see [`Budget::new`]).
const MIN_REFILL_INTERVAL_MS: u32 = 100;

fn gcd(mut a: u32, mut b: u32) -> u32 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    async fn take(budget: &Budget, n: usize) -> Duration {
        let start = Instant::now();
        for _ in 0..n {
            drop(budget.acquire().await);
        }
        start.elapsed()
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_goes_at_once_then_the_rate_holds() {
        let budget = Budget::new(200, 400);
        assert_eq!(take(&budget, 400).await, Duration::ZERO, "the burst");
        let t = take(&budget, 2000).await;
        assert!(
            (Duration::from_millis(9_900)..=Duration::from_millis(10_100)).contains(&t),
            "2,000 more at 200/s: {t:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_rate_that_is_no_multiple_of_100_holds() {
        let budget = Budget::new(150, 1);
        let t = take(&budget, 1501).await;
        assert!(
            (Duration::from_millis(9_900)..=Duration::from_millis(10_100)).contains(&t),
            "1,500 after the first at 150/s: {t:?}"
        );
    }

    /// Real timers fire late (the timer wheel's millisecond, a busy
    /// machine). Here the clock moves 1.3 ms at a time, so every wake-up is
    /// late by up to that: the rate must hold anyway.
    #[tokio::test(start_paused = true)]
    async fn late_wake_ups_cost_little_of_the_rate() {
        let stepping = tokio::spawn(async {
            loop {
                tokio::time::advance(Duration::from_micros(1_300)).await;
                tokio::task::yield_now().await;
            }
        });
        let budget = Budget::new(200, 1);
        let t = take(&budget, 2001).await;
        stepping.abort();
        assert!(
            t <= Duration::from_millis(10_300),
            "2,000 after the first at 200/s with late wake-ups: {t:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_low_rate_is_spread_evenly() {
        let budget = Budget::new(5, 1);
        let t = take(&budget, 11).await;
        assert_eq!(t, Duration::from_secs(2), "1 at once, then 10 at 5/s");
    }

    #[tokio::test(start_paused = true)]
    async fn no_more_than_the_bound_is_in_flight() {
        let budget = Budget::new(100_000, 100_000);
        let mut held = Vec::new();
        for _ in 0..MAX_IN_FLIGHT {
            held.push(budget.acquire().await);
        }
        let next = tokio::time::timeout(Duration::from_secs(60), budget.acquire()).await;
        assert!(next.is_err(), "a 33rd request waits while 32 are in flight");
        held.pop();
        tokio::time::timeout(Duration::from_secs(1), budget.acquire())
            .await
            .expect("one answered frees a place");
    }
}
