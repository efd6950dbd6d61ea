//! Waiting on a condition with a deadline, instead of sleeping and hoping:
//! the one wait helper of the tests, benchmarks and e2e harness, and
//! [`assert_eventually!`](crate::assert_eventually) for tests.
//!
//! A check answers with anything that is [`Poll`]: `bool`, `Option<T>`,
//! [`Check<T>`] (which says why not yet), or a `Result` of one of those
//! whose error ends the wait at once. On timeout the error names the
//! condition and the last "not yet" reason, so a failure says what it saw.

use std::fmt;
use std::time::{Duration, Instant};

/// Checks start this far apart and double up to [`MAX_POLL`]: quick for
/// what is nearly there, light (on an API server, say) for what takes
/// seconds.
const FIRST_POLL: Duration = Duration::from_millis(5);
const MAX_POLL: Duration = Duration::from_millis(500);

/// One poll of a condition: done with a value, or not yet and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check<T> {
    Done(T),
    NotYet(String),
}

/// A condition that did not hold in time.
#[derive(Debug, Clone, thiserror::Error)]
pub struct Timeout {
    pub what: String,
    pub timeout: Duration,
    /// The last reason a check gave for "not yet", if it gave one.
    pub last: Option<String>,
}

impl fmt::Display for Timeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "timed out after {:?} waiting for {}",
            self.timeout, self.what
        )?;
        match &self.last {
            Some(last) => write!(f, "; last seen: {last}"),
            None => Ok(()),
        }
    }
}

/// What a check may answer. The error of a failing check is the wait's
/// error too, so it must hold a [`Timeout`]; checks that cannot fail time
/// out with a plain [`Timeout`].
pub trait Poll {
    type Value;
    type Error: From<Timeout>;
    fn into_check(self) -> Result<Check<Self::Value>, Self::Error>;
}

impl Poll for bool {
    type Value = ();
    type Error = Timeout;
    fn into_check(self) -> Result<Check<()>, Timeout> {
        Ok(if self {
            Check::Done(())
        } else {
            Check::NotYet("false".to_owned())
        })
    }
}

impl<T> Poll for Option<T> {
    type Value = T;
    type Error = Timeout;
    fn into_check(self) -> Result<Check<T>, Timeout> {
        Ok(self.map_or_else(|| Check::NotYet("None".to_owned()), Check::Done))
    }
}

impl<T> Poll for Check<T> {
    type Value = T;
    type Error = Timeout;
    fn into_check(self) -> Result<Check<T>, Timeout> {
        Ok(self)
    }
}

impl<P, E> Poll for Result<P, E>
where
    P: Poll<Error = Timeout>,
    E: From<Timeout>,
{
    type Value = P::Value;
    type Error = E;
    fn into_check(self) -> Result<Check<P::Value>, E> {
        self?.into_check().map_err(E::from)
    }
}

/// A wait: what for, how long, how often. [`wait_until`] and
/// [`wait_until_blocking`] are its usual form; [`Wait::every`] sets a fixed
/// poll interval where the doubling one does not fit.
#[derive(Debug, Clone)]
pub struct Wait<'a> {
    timeout: Duration,
    what: &'a str,
    first: Duration,
    max: Duration,
}

impl<'a> Wait<'a> {
    pub fn new(timeout: Duration, what: &'a str) -> Self {
        Self {
            timeout,
            what,
            first: FIRST_POLL,
            max: MAX_POLL,
        }
    }

    /// Polls every `interval` instead of 5 ms doubling to 500 ms.
    pub fn every(self, interval: Duration) -> Self {
        Self {
            first: interval,
            max: interval,
            ..self
        }
    }

    fn timed_out(&self, last: Option<String>) -> Timeout {
        Timeout {
            what: self.what.to_owned(),
            timeout: self.timeout,
            last,
        }
    }

    /// Polls `check` until it is done, for at most the timeout; a failing
    /// check ends the wait at once. Uses tokio's clock, so paused-time
    /// tests work.
    pub async fn until<P, F, Fut>(self, mut check: F) -> Result<P::Value, P::Error>
    where
        P: Poll,
        F: FnMut() -> Fut,
        Fut: Future<Output = P>,
    {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut delay = self.first;
        loop {
            let why = match check().await.into_check()? {
                Check::Done(v) => return Ok(v),
                Check::NotYet(why) => why,
            };
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(self.timed_out(Some(why)).into());
            }
            tokio::time::sleep(delay.min(deadline - now)).await;
            delay = (delay * 2).min(self.max);
        }
    }

    /// [`Wait::until`] for synchronous tests and benchmarks: blocks the
    /// thread between checks.
    pub fn until_blocking<P: Poll>(
        self,
        mut check: impl FnMut() -> P,
    ) -> Result<P::Value, P::Error> {
        let deadline = Instant::now() + self.timeout;
        let mut delay = self.first;
        loop {
            let why = match check().into_check()? {
                Check::Done(v) => return Ok(v),
                Check::NotYet(why) => why,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timed_out(Some(why)).into());
            }
            std::thread::sleep(delay.min(deadline - now));
            delay = (delay * 2).min(self.max);
        }
    }
}

/// Polls `check` until it is done, for at most `timeout`; `what` names the
/// condition in the error.
pub async fn wait_until<P, F, Fut>(
    timeout: Duration,
    what: &str,
    check: F,
) -> Result<P::Value, P::Error>
where
    P: Poll,
    F: FnMut() -> Fut,
    Fut: Future<Output = P>,
{
    Wait::new(timeout, what).until(check).await
}

/// [`wait_until`] for synchronous tests and benchmarks, which can only fail:
/// panics with the [`Timeout`] (or the check's error) message.
pub fn wait_until_blocking<P>(timeout: Duration, what: &str, check: impl FnMut() -> P) -> P::Value
where
    P: Poll,
    P::Error: fmt::Display,
{
    Wait::new(timeout, what)
        .until_blocking(check)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Asserts that a condition comes true within a deadline, in an async test:
/// `assert_eventually!(timeout, || async { .. }, "what {}", arg)`, or with
/// `timeout, every: interval, ..` to poll at a fixed interval. The check
/// answers like [`wait_until`]'s; the macro yields the value and panics
/// with the message and the last "not yet" reason (give one with
/// [`Check::NotYet`] to show the last value seen).
#[macro_export]
macro_rules! assert_eventually {
    ($timeout:expr, every: $interval:expr, $check:expr, $($what:tt)+) => {
        match $crate::wait::Wait::new($timeout, &format!($($what)+))
            .every($interval)
            .until($check)
            .await
        {
            Ok(v) => v,
            Err(e) => panic!("{e}"),
        }
    };
    ($timeout:expr, $check:expr, $($what:tt)+) => {
        match $crate::wait::wait_until($timeout, &format!($($what)+), $check).await {
            Ok(v) => v,
            Err(e) => panic!("{e}"),
        }
    };
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
            std::future::ready(false)
        })
        .await;
        let msg = e.err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(
            msg,
            "timed out after 120ms waiting for never; last seen: false"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_timeout_reports_the_last_reason() {
        let mut n = 0;
        let e = wait_until(Duration::from_secs(1), "n to pass 1000", || {
            n += 1;
            std::future::ready(Check::<()>::NotYet(format!("n = {n}")))
        })
        .await
        .err();
        let last = e.as_ref().and_then(|e| e.last.clone());
        assert_eq!(last, Some(format!("n = {n}")));
        // 5 ms doubling to 500 ms within a second: a handful of polls.
        assert!((5..=10).contains(&n), "{n} polls");
    }

    #[tokio::test(start_paused = true)]
    async fn a_fixed_interval_polls_that_often() {
        let mut n = 0u32;
        let e = Wait::new(Duration::from_secs(1), "never")
            .every(Duration::from_millis(100))
            .until(|| {
                n += 1;
                std::future::ready(None::<()>)
            })
            .await;
        assert!(e.is_err());
        // At 0, 100, .., 1000 ms.
        assert_eq!(n, 11);
    }

    #[derive(Debug, thiserror::Error)]
    enum Broken {
        #[error("broken")]
        Broken,
        #[error(transparent)]
        Timeout(#[from] Timeout),
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_check_ends_the_wait() {
        let mut calls = 0;
        let e = wait_until(Duration::from_secs(5), "anything", || {
            calls += 1;
            std::future::ready(Err::<Option<()>, _>(Broken::Broken))
        })
        .await;
        assert!(matches!(e, Err(Broken::Broken)));
        assert_eq!(calls, 1);
        let e = wait_until(Duration::from_millis(10), "ok", || {
            std::future::ready(Ok::<_, Broken>(Check::<()>::NotYet("later".into())))
        })
        .await;
        assert!(matches!(e, Err(Broken::Timeout(t)) if t.last.as_deref() == Some("later")));
    }

    #[tokio::test(start_paused = true)]
    async fn assert_eventually_yields_the_value() {
        let mut n = 0;
        let v = crate::assert_eventually!(
            Duration::from_secs(1),
            || {
                n += 1;
                std::future::ready((n == 2).then_some("two"))
            },
            "n to be {}",
            2
        );
        assert_eq!(v, "two");
    }

    #[tokio::test(start_paused = true)]
    #[should_panic(expected = "timed out after 50ms waiting for x to be 7; last seen: x = 3")]
    async fn assert_eventually_panics_with_the_last_reason() {
        let x = 3;
        crate::assert_eventually!(
            Duration::from_millis(50),
            every: Duration::from_millis(10),
            || std::future::ready(if x == 7 {
                Check::Done(())
            } else {
                Check::NotYet(format!("x = {x}"))
            }),
            "x to be {}",
            7
        );
    }

    #[test]
    fn blocking_variant_returns_the_value() {
        assert_eq!(
            wait_until_blocking(Duration::from_millis(20), "now", || Some(1)),
            1
        );
    }

    #[test]
    #[should_panic(expected = "timed out after 20ms waiting for nothing; last seen: None")]
    fn blocking_variant_panics_naming_what_timed_out() {
        wait_until_blocking(Duration::from_millis(20), "nothing", || None::<()>);
    }
}
