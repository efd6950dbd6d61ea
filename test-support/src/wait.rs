//! Waiting on a condition with a deadline, instead of sleeping and hoping.

use std::time::{Duration, Instant};

/// How often a condition is checked: short, so latency measurements taken
/// with these helpers stay within a few milliseconds.
const POLL: Duration = Duration::from_millis(5);

/// A condition that did not hold in time.
#[derive(Debug, Clone, thiserror::Error)]
#[error("timed out after {timeout:?} waiting for {what}")]
pub struct Timeout {
    pub what: String,
    pub timeout: Duration,
}

/// Polls `check` until it yields `Some`, for at most `timeout`; `what` names
/// the condition in the error. Uses tokio's clock, so paused-time tests work.
pub async fn wait_until<T, F, Fut>(
    timeout: Duration,
    what: &str,
    mut check: F,
) -> Result<T, Timeout>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Timeout {
                what: what.to_owned(),
                timeout,
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

/// [`wait_until`] for synchronous tests and benchmarks, which can only fail:
/// blocks the thread between checks and panics with the [`Timeout`] message.
pub fn wait_until_blocking<T>(
    timeout: Duration,
    what: &str,
    mut check: impl FnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check() {
            return v;
        }
        if Instant::now() >= deadline {
            let e = Timeout {
                what: what.to_owned(),
                timeout,
            };
            panic!("{e}");
        }
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn returns_the_value_or_names_what_timed_out() {
        let mut n = 0;
        let v = wait_until(Duration::from_secs(5), "n to reach 3", || {
            n += 1;
            std::future::ready((n >= 3).then_some(n))
        })
        .await;
        assert_eq!(v.ok(), Some(3));
        let e = wait_until(Duration::from_millis(120), "never", || {
            std::future::ready(None::<()>)
        })
        .await;
        let msg = e.err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(msg, "timed out after 120ms waiting for never");
    }

    #[test]
    fn blocking_variant_returns_the_value() {
        assert_eq!(
            wait_until_blocking(Duration::from_millis(20), "now", || Some(1)),
            1
        );
    }

    #[test]
    #[should_panic(expected = "timed out after 20ms waiting for nothing")]
    fn blocking_variant_panics_naming_what_timed_out() {
        wait_until_blocking(Duration::from_millis(20), "nothing", || None::<()>);
    }
}
