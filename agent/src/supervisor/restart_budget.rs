//! The crash-restart budget: abnormal exits are counted within a sliding
//! window, and the restarts are spaced out, doubling up to a cap.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// Longest pause between two crash restarts.
const MAX_RESTART_DELAY: Duration = Duration::from_secs(30);

/// Counts abnormal exits within a sliding window and spaces restarts out.
#[derive(Debug)]
pub struct RestartBudget {
    max: u32,
    window: Duration,
    base_delay: Duration,
    failures: VecDeque<Instant>,
}

impl RestartBudget {
    pub fn new(max: u32, window: Duration, base_delay: Duration) -> Self {
        Self {
            max,
            window,
            base_delay,
            failures: Default::default(),
        }
    }

    /// Record a failure at `now`. `Some(delay)`: restart after `delay`
    /// (doubling with each failure in the window); `None`: the budget is spent.
    pub fn on_failure(&mut self, now: Instant) -> Option<Duration> {
        while let Some(first) = self.failures.front() {
            if now.duration_since(*first) >= self.window {
                self.failures.pop_front();
            } else {
                break;
            }
        }
        self.failures.push_back(now);
        let n = self.failures.len();
        if n > self.max as usize {
            return None;
        }
        let exp = u32::try_from(n.saturating_sub(1))
            .unwrap_or(u32::MAX)
            .min(16);
        Some(
            self.base_delay
                .saturating_mul(1 << exp)
                .min(MAX_RESTART_DELAY),
        )
    }

    pub fn failures(&self) -> usize {
        self.failures.len()
    }

    pub fn window(&self) -> Duration {
        self.window
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn budget_doubles_then_gives_up() {
        let mut b = RestartBudget::new(3, Duration::from_secs(60), Duration::from_millis(200));
        let t0 = Instant::now();
        assert_eq!(b.on_failure(t0), Some(Duration::from_millis(200)));
        assert_eq!(b.on_failure(t0), Some(Duration::from_millis(400)));
        assert_eq!(b.on_failure(t0), Some(Duration::from_millis(800)));
        assert_eq!(b.on_failure(t0), None);
    }

    #[tokio::test(start_paused = true)]
    async fn budget_forgets_failures_outside_the_window() {
        let mut b = RestartBudget::new(2, Duration::from_secs(60), Duration::from_millis(200));
        assert!(b.on_failure(Instant::now()).is_some());
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(b.on_failure(Instant::now()).is_some());
        tokio::time::advance(Duration::from_secs(31)).await;
        // The first failure left the window: this is the second in it, not the third.
        assert_eq!(
            b.on_failure(Instant::now()),
            Some(Duration::from_millis(400))
        );
        assert_eq!(b.failures(), 2);
    }

    #[test]
    fn delay_is_capped() {
        let mut b = RestartBudget::new(100, Duration::from_secs(3600), Duration::from_secs(1));
        let t = Instant::now();
        let last = (0..20).filter_map(|_| b.on_failure(t)).last();
        assert_eq!(last, Some(MAX_RESTART_DELAY));
    }
}
