//! The graceful drain of Envoy's inbound side.
//!
//! Readiness has already failed when this runs. It asks Envoy to drain its
//! inbound listeners gracefully (clients are told `connection: close`,
//! outbound keeps serving), then waits either the termination drain duration,
//! or — with exit-on-zero — the minimum drain duration and then until no
//! workload connection is left. It never runs past the drain deadline, minus
//! a reserve kept for stopping Envoy.

use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use crate::envoy::admin::{AdminError, EnvoyAdmin};
use crate::lifecycle::DrainSettings;
use crate::metrics::DrainOutcomeLabel;

/// What the drain needs from Envoy.
pub trait DrainTarget {
    fn drain_inbound(&self) -> impl Future<Output = Result<(), AdminError>> + Send;
    fn active_connections(&self) -> impl Future<Output = Result<u64, AdminError>> + Send;
}

impl DrainTarget for EnvoyAdmin {
    async fn drain_inbound(&self) -> Result<(), AdminError> {
        self.drain_inbound_listeners().await
    }
    async fn active_connections(&self) -> Result<u64, AdminError> {
        EnvoyAdmin::active_connections(self).await
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum DrainOutcome {
    /// No workload connection was left (exit-on-zero).
    Drained,
    /// The termination drain duration elapsed.
    Elapsed,
    /// The deadline came first; this many connections were still open (when known).
    DeadlineExceeded { active: Option<u64> },
    /// A second signal cut it short.
    Aborted,
}

impl DrainOutcome {
    pub fn label(&self) -> DrainOutcomeLabel {
        match self {
            Self::Drained => DrainOutcomeLabel::Drained,
            Self::Elapsed => DrainOutcomeLabel::Elapsed,
            Self::DeadlineExceeded { .. } => DrainOutcomeLabel::DeadlineExceeded,
            Self::Aborted => DrainOutcomeLabel::Aborted,
        }
    }

    /// Whether the drain ended the way the configuration intended.
    pub fn is_clean(&self) -> bool {
        matches!(self, Self::Drained | Self::Elapsed)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct DrainReport {
    #[serde(flatten)]
    pub outcome: DrainOutcome,
    /// Workload connections when the drain began (None if Envoy did not say).
    pub active_at_start: Option<u64>,
    pub duration_seconds: f64,
    pub settings: DrainSettings,
}

/// Time kept back from the deadline for stopping Envoy afterwards.
pub fn stop_reserve(deadline: Duration) -> Duration {
    (deadline / 10).min(Duration::from_secs(1))
}

/// Run one drain with `settings`, started at `started` (the deadline counts from there).
pub async fn run<T: DrainTarget>(
    target: &T,
    settings: DrainSettings,
    poll: Duration,
    started: Instant,
) -> DrainReport {
    let wait_until = started
        + settings
            .drain_deadline
            .saturating_sub(stop_reserve(settings.drain_deadline));
    let active_at_start = match target.active_connections().await {
        Ok(n) => Some(n),
        Err(e) => {
            tracing::warn!(error = %e, "cannot count connections at drain start");
            None
        }
    };
    if let Err(e) = target.drain_inbound().await {
        // Without Envoy's drain the wait still protects in-flight requests.
        tracing::warn!(error = %e, "Envoy did not accept drain_listeners");
    }
    tracing::info!(?active_at_start, ?settings, "draining inbound listeners");

    let outcome = if settings.exit_on_zero_active_connections {
        let min_end = started + settings.minimum_drain_duration;
        if min_end >= wait_until {
            tokio::time::sleep_until(wait_until).await;
            DrainOutcome::DeadlineExceeded {
                active: target.active_connections().await.ok(),
            }
        } else {
            tokio::time::sleep_until(min_end).await;
            wait_for_zero(target, poll, wait_until).await
        }
    } else {
        let end = started + settings.termination_drain_duration;
        if end > wait_until {
            tokio::time::sleep_until(wait_until).await;
            DrainOutcome::DeadlineExceeded {
                active: target.active_connections().await.ok(),
            }
        } else {
            tokio::time::sleep_until(end).await;
            DrainOutcome::Elapsed
        }
    };
    DrainReport {
        outcome,
        active_at_start,
        duration_seconds: started.elapsed().as_secs_f64(),
        settings,
    }
}

async fn wait_for_zero<T: DrainTarget>(
    target: &T,
    poll: Duration,
    wait_until: Instant,
) -> DrainOutcome {
    let mut last = None;
    loop {
        match target.active_connections().await {
            Ok(0) => return DrainOutcome::Drained,
            Ok(n) => {
                if last != Some(n) {
                    tracing::debug!(active = n, "waiting for connections to close");
                }
                last = Some(n);
            }
            Err(e) => tracing::debug!(error = %e, "cannot count connections"),
        }
        let next = Instant::now() + poll;
        if next >= wait_until {
            tokio::time::sleep_until(wait_until).await;
            return DrainOutcome::DeadlineExceeded {
                active: target.active_connections().await.ok().or(last),
            };
        }
        tokio::time::sleep_until(next).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Test double of Envoy's admin API: connections close at given instants.
    struct FakeEnvoy {
        start: Instant,
        closes_at: Mutex<Vec<Duration>>,
        drained: AtomicBool,
        fail_counts: bool,
    }

    impl FakeEnvoy {
        fn new(closes_at: Vec<Duration>) -> Self {
            Self {
                start: Instant::now(),
                closes_at: Mutex::new(closes_at),
                drained: AtomicBool::new(false),
                fail_counts: false,
            }
        }
    }

    impl DrainTarget for FakeEnvoy {
        async fn drain_inbound(&self) -> Result<(), AdminError> {
            self.drained.store(true, Ordering::SeqCst);
            Ok(())
        }
        async fn active_connections(&self) -> Result<u64, AdminError> {
            if self.fail_counts {
                return Err(AdminError::Status {
                    path: "/stats".into(),
                    status: 503,
                    body: String::new(),
                });
            }
            let now = self.start.elapsed();
            let open = self
                .closes_at
                .lock()
                .expect("lock")
                .iter()
                .filter(|t| **t > now)
                .count();
            Ok(open as u64)
        }
    }

    fn settings(exit_on_zero: bool) -> DrainSettings {
        DrainSettings {
            drain_duration: Duration::from_secs(45),
            termination_drain_duration: Duration::from_secs(5),
            exit_on_zero_active_connections: exit_on_zero,
            minimum_drain_duration: Duration::from_secs(2),
            drain_deadline: Duration::from_secs(25),
        }
    }

    const POLL: Duration = Duration::from_millis(50);

    #[tokio::test(start_paused = true)]
    async fn termination_duration_mode_waits_exactly_that_long() {
        let envoy = FakeEnvoy::new(vec![Duration::from_secs(1)]);
        let start = Instant::now();
        let r = run(&envoy, settings(false), POLL, start).await;
        assert_eq!(r.outcome, DrainOutcome::Elapsed);
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        assert_eq!(r.active_at_start, Some(1));
        assert!(envoy.drained.load(Ordering::SeqCst));
    }

    #[tokio::test(start_paused = true)]
    async fn exit_on_zero_waits_minimum_then_for_last_connection() {
        let envoy = FakeEnvoy::new(vec![Duration::from_secs(1), Duration::from_millis(7300)]);
        let start = Instant::now();
        let r = run(&envoy, settings(true), POLL, start).await;
        assert_eq!(r.outcome, DrainOutcome::Drained);
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(7300), "{took:?}");
        assert!(took <= Duration::from_millis(7300) + POLL, "{took:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn exit_on_zero_with_no_connections_ends_at_minimum() {
        let envoy = FakeEnvoy::new(vec![]);
        let start = Instant::now();
        let r = run(&envoy, settings(true), POLL, start).await;
        assert_eq!(r.outcome, DrainOutcome::Drained);
        assert_eq!(start.elapsed(), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn deadline_bounds_a_connection_that_never_closes() {
        let envoy = FakeEnvoy::new(vec![Duration::from_secs(3600)]);
        let start = Instant::now();
        let r = run(&envoy, settings(true), POLL, start).await;
        assert_eq!(
            r.outcome,
            DrainOutcome::DeadlineExceeded { active: Some(1) }
        );
        // 25 s deadline less the 1 s kept for stopping Envoy.
        assert_eq!(start.elapsed(), Duration::from_secs(24));
    }

    #[tokio::test(start_paused = true)]
    async fn termination_longer_than_deadline_is_cut() {
        let envoy = FakeEnvoy::new(vec![]);
        let mut s = settings(false);
        s.termination_drain_duration = Duration::from_secs(60);
        s.drain_deadline = Duration::from_secs(5);
        let start = Instant::now();
        let r = run(&envoy, s, POLL, start).await;
        assert!(matches!(r.outcome, DrainOutcome::DeadlineExceeded { .. }));
        assert_eq!(start.elapsed(), Duration::from_millis(4500));
    }

    #[tokio::test(start_paused = true)]
    async fn unreachable_admin_still_bounded() {
        let mut envoy = FakeEnvoy::new(vec![]);
        envoy.fail_counts = true;
        let start = Instant::now();
        let r = run(&envoy, settings(true), POLL, start).await;
        assert_eq!(r.active_at_start, None);
        assert_eq!(r.outcome, DrainOutcome::DeadlineExceeded { active: None });
        assert_eq!(start.elapsed(), Duration::from_secs(24));
    }
}
