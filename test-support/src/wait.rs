//! Waiting on a condition with a deadline, instead of sleeping and hoping.

use std::convert::Infallible;
use std::time::{Duration, Instant};

/// Checks start this far apart and double up to [`MAX_POLL`]: quick for
/// what is nearly there, light (on an API server, say) for what takes
/// seconds.
const FIRST_POLL: Duration = Duration::from_millis(5);
const MAX_POLL: Duration = Duration::from_millis(500);

/// A condition that did not hold in time.
#[derive(Debug, Clone, thiserror::Error)]
#[error("timed out after {timeout:?} waiting for {what}")]
pub struct Timeout {
    pub what: String,
    pub timeout: Duration,
}

/// Why [`try_wait_until`] gave up.
#[derive(Debug, thiserror::Error)]
pub enum WaitError<E> {
    #[error(transparent)]
    TimedOut(#[from] Timeout),
    /// The check itself failed; the wait ended there.
    #[error("{0}")]
    Failed(E),
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
    let checked = try_wait_until(timeout, what, || {
        let next = check();
        async move { Ok::<_, Infallible>(next.await) }
    });
    match checked.await {
        Ok(v) => Ok(v),
        Err(WaitError::TimedOut(t)) => Err(t),
        Err(WaitError::Failed(never)) => match never {},
    }
}

/// [`wait_until`] for a check that can fail: an error ends the wait at once.
pub async fn try_wait_until<T, E, F, Fut>(
    timeout: Duration,
    what: &str,
    mut check: F,
) -> Result<T, WaitError<E>>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>, E>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let mut delay = FIRST_POLL;
    loop {
        if let Some(v) = check().await.map_err(WaitError::Failed)? {
            return Ok(v);
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Err(WaitError::TimedOut(Timeout {
                what: what.to_owned(),
                timeout,
            }));
        }
        tokio::time::sleep(delay.min(deadline - now)).await;
        delay = (delay * 2).min(MAX_POLL);
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
    let mut delay = FIRST_POLL;
    loop {
        if let Some(v) = check() {
            return v;
        }
        let now = Instant::now();
        if now >= deadline {
            let e = Timeout {
                what: what.to_owned(),
                timeout,
            };
            panic!("{e}");
        }
        std::thread::sleep(delay.min(deadline - now));
        delay = (delay * 2).min(MAX_POLL);
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

    #[tokio::test(start_paused = true)]
    async fn a_failing_check_ends_the_wait() {
        let mut calls = 0;
        let e = try_wait_until(Duration::from_secs(5), "anything", || {
            calls += 1;
            std::future::ready(Err::<Option<()>, _>("broken"))
        })
        .await;
        assert!(matches!(e, Err(WaitError::Failed("broken"))));
        assert_eq!(calls, 1);
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
