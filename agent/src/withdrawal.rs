//! Confirmed removal, the agent's side (issue 30): what the discovery
//! server says of the withdrawal of this pod's endpoints
//! ([`remora_contract::discovery::WITHDRAWAL_TYPE`]), and the drain's wait
//! for it.
//!
//! The xDS proxy ([`crate::xds`]) subscribes to the pod's withdrawal on the
//! upstream stream it holds for Envoy and publishes, on a watch channel,
//! whether that stream is connected and the withdrawal as last told
//! ([`Upstream`]). When an adaptive drain starts in discovery mode it
//! first waits here ([`confirm`]) until the withdrawal is `done`: every
//! proxy that routed to the pod has ACKed an EDS version without it. Then
//! no meshed client sends it anything new, and the quiet period (which may
//! be 0 for a workload called only by meshed clients) covers the rest.
//!
//! The wait is bounded by the pod's withdrawal timeout and the drain's
//! wait; it falls back to the quiet period alone when it cannot know: the
//! stream is down when the drain starts, or no withdrawal arrives within
//! [`FIRST_WITHDRAWAL`] (an operator that does not know the pod deleting
//! yet, or one that serves no withdrawals).

use std::time::Duration;

use remora_proto::remora::v1::Withdrawal;
use serde::Serialize;
use tokio::sync::watch;
use tokio::time::Instant;

/// How long a drain waits for a first word of its pod's withdrawal before
/// it falls back to the quiet period. The server withdraws the pod from its
/// pod watch the moment it starts deleting, and the kubelet starts the
/// drain (preStop, SIGTERM) after that same deletion: the withdrawal is
/// normally there within tens of milliseconds. Longer means an operator
/// that does not withdraw it, and the quiet period is all there is.
pub const FIRST_WITHDRAWAL: Duration = Duration::from_secs(1);

/// Where the withdrawal of the pod's endpoints stands, as the server last
/// said (`remora.v1.Withdrawal`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Progress {
    /// Proxies that routed to the pod when it was withdrawn.
    pub expected: u32,
    pub confirmed: u32,
    /// Ended their stream before confirming.
    pub gone: u32,
    /// At most [`remora_contract::discovery::MAX_WITHDRAWAL_PENDING_NAMES`]
    /// of those pending (`namespace/pod`).
    pub pending: Vec<String>,
    pub done: bool,
    /// Done because the server stopped waiting: `pending` never confirmed.
    pub timed_out: bool,
    pub last_confirmation_ms: u64,
}

impl Progress {
    /// Proxies still pending, all of them (not only those named).
    pub fn pending_count(&self) -> u32 {
        self.expected
            .saturating_sub(self.confirmed)
            .saturating_sub(self.gone)
    }
}

impl From<Withdrawal> for Progress {
    fn from(w: Withdrawal) -> Self {
        Self {
            expected: w.expected,
            confirmed: w.confirmed,
            gone: w.gone,
            pending: w.pending,
            done: w.done,
            timed_out: w.timed_out,
            last_confirmation_ms: w.last_confirmation_ms,
        }
    }
}

/// What a response of the withdrawal type says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Told {
    /// Nothing changed (a delta response that carries nothing of it).
    Unchanged,
    /// The pod is not withdrawn (serving, or not known to the server yet).
    Absent,
    Withdrawn(Progress),
}

/// The upstream stream as the drain sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Upstream {
    /// The upstream stream is open.
    pub connected: bool,
    /// The pod's withdrawal as last told; kept while the stream is down (a
    /// resumed delta stream does not repeat what did not change).
    pub withdrawal: Option<Progress>,
}

/// How the drain's wait for the confirmation ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum Outcome {
    /// Every proxy that routed to the pod confirmed (or left).
    Confirmed {
        /// Confirmed, of `expected`; `gone` left without confirming.
        proxies: u32,
        expected: u32,
        gone: u32,
        /// The server's time from the withdrawal to the last confirmation.
        last_confirmation_ms: u64,
        /// How long the drain waited.
        waited_ms: u64,
    },
    /// The bound came first (the pod's withdrawal timeout, at the server or
    /// here, or the drain's deadline) with proxies still pending.
    TimedOut {
        pending: u32,
        /// At most [`remora_contract::discovery::MAX_WITHDRAWAL_PENDING_NAMES`].
        names: Vec<String>,
        waited_ms: u64,
    },
    /// Nothing to wait for: the quiet period alone decides, as without
    /// discovery.
    FellBack { reason: FallBack },
}

/// Why the drain could not wait for the confirmation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FallBack {
    /// The upstream stream was down when the drain started.
    NotConnected,
    /// No withdrawal arrived within [`FIRST_WITHDRAWAL`] (or the bound).
    NoWithdrawal,
}

impl Outcome {
    /// The metrics label.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Confirmed { .. } => "confirmed",
            Self::TimedOut { .. } => "timed_out",
            Self::FellBack { .. } => "fell_back",
        }
    }

    /// Every proxy confirmed: no meshed client sends anything new.
    pub fn is_confirmed(&self) -> bool {
        matches!(self, Self::Confirmed { .. })
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Wait until the pod's withdrawal is done, at most until `until` (the
/// caller's bound: the withdrawal timeout within the drain's wait). See the
/// module docs for when it falls back.
pub async fn confirm(upstream: &mut watch::Receiver<Upstream>, until: Instant) -> Outcome {
    let started = Instant::now();
    if !upstream.borrow_and_update().connected {
        tracing::warn!(
            "the discovery stream is down at drain start: cannot learn who still routes to the pod, falling back to the quiet period"
        );
        return Outcome::FellBack {
            reason: FallBack::NotConnected,
        };
    }
    let first_until = until.min(started + FIRST_WITHDRAWAL);
    loop {
        let now = upstream.borrow_and_update().clone();
        match &now.withdrawal {
            Some(p) if p.done && !p.timed_out => {
                let waited = started.elapsed();
                tracing::info!(
                    confirmed = p.confirmed,
                    expected = p.expected,
                    gone = p.gone,
                    last_confirmation_ms = p.last_confirmation_ms,
                    ?waited,
                    "every proxy that routed to the pod confirmed it no longer does"
                );
                return Outcome::Confirmed {
                    proxies: p.confirmed,
                    expected: p.expected,
                    gone: p.gone,
                    last_confirmation_ms: p.last_confirmation_ms,
                    waited_ms: ms(waited),
                };
            }
            Some(p) if p.done => return timed_out(p, started, "the discovery server"),
            _ => {}
        }
        let wait_until = if now.withdrawal.is_some() {
            until
        } else {
            first_until
        };
        let changed = tokio::time::timeout_at(wait_until, upstream.changed()).await;
        match (changed, now.withdrawal) {
            (Ok(Ok(())), _) => {}
            // The proxy is gone (the agent stops): what was last told stands.
            (Ok(Err(_)), None) | (Err(_), None) => {
                tracing::warn!(after = ?started.elapsed(),
                    "no withdrawal of the pod from the discovery server: falling back to the quiet period");
                return Outcome::FellBack {
                    reason: FallBack::NoWithdrawal,
                };
            }
            (Ok(Err(_)), Some(p)) | (Err(_), Some(p)) => {
                return timed_out(&p, started, "the drain");
            }
        }
    }
}

fn timed_out(p: &Progress, started: Instant, by: &str) -> Outcome {
    let waited = started.elapsed();
    tracing::warn!(pending = p.pending_count(), names = ?p.pending, ?waited, by,
        "proxies that routed to the pod never confirmed they stopped: the drain goes on");
    Outcome::TimedOut {
        pending: p.pending_count(),
        names: p.pending.clone(),
        waited_ms: ms(waited),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn withdrawn(expected: u32, confirmed: u32, pending: &[&str], done: bool) -> Option<Progress> {
        Some(Progress {
            expected,
            confirmed,
            pending: pending.iter().map(|s| s.to_string()).collect(),
            done,
            last_confirmation_ms: 7,
            ..Progress::default()
        })
    }

    fn connected(withdrawal: Option<Progress>) -> Upstream {
        Upstream {
            connected: true,
            withdrawal,
        }
    }

    const S: Duration = Duration::from_secs(1);

    #[tokio::test(start_paused = true)]
    async fn waits_for_done_and_reports_who_confirmed() {
        let (tx, mut rx) = watch::channel(connected(None));
        let start = Instant::now();
        let wait = tokio::spawn(async move { confirm(&mut rx, start + 5 * S).await });
        tokio::time::sleep(Duration::from_millis(30)).await;
        tx.send_replace(connected(withdrawn(
            3,
            1,
            &["shop/web-2", "shop/web-3"],
            false,
        )));
        tokio::time::sleep(Duration::from_millis(2000)).await;
        assert!(
            !wait.is_finished(),
            "not done: still waiting past the first bound"
        );
        tx.send_replace(connected(withdrawn(3, 3, &[], true)));
        let got = wait.await.expect("no panic");
        assert_eq!(
            got,
            Outcome::Confirmed {
                proxies: 3,
                expected: 3,
                gone: 0,
                last_confirmation_ms: 7,
                waited_ms: 2030,
            }
        );
        assert!(got.is_confirmed());
    }

    #[tokio::test(start_paused = true)]
    async fn a_proxy_that_never_confirms_is_named_at_the_bound() {
        let (tx, mut rx) = watch::channel(connected(withdrawn(2, 1, &["shop/web-9"], false)));
        let start = Instant::now();
        let got = confirm(&mut rx, start + 5 * S).await;
        assert_eq!(start.elapsed(), 5 * S);
        assert_eq!(
            got,
            Outcome::TimedOut {
                pending: 1,
                names: vec!["shop/web-9".into()],
                waited_ms: 5000,
            }
        );
        // The server's own bound, told first, ends it as well.
        let timed_out = Progress {
            timed_out: true,
            ..withdrawn(2, 1, &["shop/web-9"], true).expect("some")
        };
        tx.send_replace(connected(Some(timed_out)));
        let got = confirm(&mut rx, Instant::now() + 5 * S).await;
        assert_eq!(got.label(), "timed_out");
    }

    #[tokio::test(start_paused = true)]
    async fn no_stream_or_no_word_falls_back() {
        let (_tx, mut rx) = watch::channel(Upstream::default());
        let start = Instant::now();
        let got = confirm(&mut rx, start + 5 * S).await;
        assert_eq!(
            got,
            Outcome::FellBack {
                reason: FallBack::NotConnected
            }
        );
        assert_eq!(start.elapsed(), Duration::ZERO, "at once");

        let (_tx, mut rx) = watch::channel(connected(None));
        let got = confirm(&mut rx, start + 5 * S).await;
        assert_eq!(
            got,
            Outcome::FellBack {
                reason: FallBack::NoWithdrawal
            }
        );
        assert_eq!(start.elapsed(), FIRST_WITHDRAWAL);
        // Nobody routed to the pod: done at once, with none.
        let (_tx, mut rx) = watch::channel(connected(withdrawn(0, 0, &[], true)));
        assert!(
            confirm(&mut rx, Instant::now() + 5 * S)
                .await
                .is_confirmed()
        );
    }

    /// The drain's order (drain.rs), on paused time, with an Envoy double
    /// that sees no new traffic and serves inbound requests until `busy`.
    mod drain_order {
        use std::sync::atomic::AtomicBool;

        use remora_contract::DrainMode;

        use super::*;
        use crate::drain::{DrainReport, DrainTarget, IDLE_CLOSED, run_confirming};
        use crate::envoy::admin::{AdminError, Traffic};
        use crate::lifecycle::DrainSettings;

        struct Envoy {
            start: Instant,
            busy: Duration,
        }

        impl DrainTarget for Envoy {
            async fn drain_inbound(&self) -> Result<(), AdminError> {
                Ok(())
            }
            async fn active_connections(&self) -> Result<u64, AdminError> {
                Ok(0)
            }
            async fn traffic(&self) -> Result<Traffic, AdminError> {
                let n = u64::from(self.start.elapsed() < self.busy);
                Ok(Traffic {
                    in_flight: n,
                    inbound_in_flight: n,
                    ..Traffic::default()
                })
            }
        }

        const POLL: Duration = Duration::from_millis(50);

        /// Adaptive, quiet period 0, withdrawal timeout 5 s, deadline 25 s.
        fn settings() -> DrainSettings {
            DrainSettings {
                drain_duration: 45 * S,
                termination_drain_duration: 5 * S,
                exit_on_zero_active_connections: false,
                minimum_drain_duration: 5 * S,
                drain_deadline: 25 * S,
                drain_mode: DrainMode::Adaptive,
                quiet_period: Duration::ZERO,
                withdrawal_timeout: 5 * S,
            }
        }

        /// A drain with an app hook waiting, the server's word `told` at
        /// the given instants: the report and when the app was released.
        async fn drain(
            busy: Duration,
            first: Upstream,
            told: Vec<(Duration, Upstream)>,
        ) -> (DrainReport, Duration) {
            let start = Instant::now();
            let envoy = Envoy { start, busy };
            let (tx, mut rx) = watch::channel(first);
            tokio::spawn(async move {
                for (at, u) in told {
                    tokio::time::sleep_until(start + at).await;
                    tx.send_replace(u);
                }
                // Kept open: a closed channel is the agent stopping.
                std::future::pending::<()>().await;
            });
            let (quiet_tx, mut quiet_rx) = watch::channel(false);
            let app_waits = AtomicBool::new(true);
            let (r, released) = tokio::join!(
                run_confirming(
                    &envoy,
                    settings(),
                    POLL,
                    start,
                    (&quiet_tx, &app_waits),
                    Some(&mut rx)
                ),
                async {
                    let _ = quiet_rx.wait_for(|q| *q).await;
                    start.elapsed()
                }
            );
            (r, released)
        }

        fn ms(n: u64) -> Duration {
            Duration::from_millis(n)
        }

        #[tokio::test(start_paused = true)]
        async fn the_app_is_released_only_once_every_proxy_confirmed() {
            let pending = connected(withdrawn(2, 1, &["shop/web-1"], false));
            let (r, released) = drain(
                Duration::ZERO,
                connected(None),
                vec![
                    (ms(20), pending),
                    (ms(700), connected(withdrawn(2, 2, &[], true))),
                ],
            )
            .await;
            // Not before the confirmation; then quiet period 0 and no
            // idle-connection floor: released at the next poll.
            assert!(
                released >= ms(700) && released <= ms(700) + POLL,
                "{released:?}"
            );
            assert!(released < IDLE_CLOSED, "{released:?}");
            assert_eq!(r.withdrawal.as_ref().map(Outcome::label), Some("confirmed"));
            let took = Duration::from_secs_f64(r.duration_seconds);
            assert!(took <= ms(700) + 2 * POLL, "{took:?}");
        }

        #[tokio::test(start_paused = true)]
        async fn requests_in_flight_hold_the_app_after_the_confirmation() {
            let done = connected(withdrawn(1, 1, &[], true));
            let (_, released) = drain(ms(2000), done, vec![]).await;
            assert!(
                released >= ms(2000) && released <= ms(2000) + POLL,
                "{released:?}"
            );
        }

        #[tokio::test(start_paused = true)]
        async fn a_proxy_that_never_confirms_holds_the_app_until_the_bound_and_is_named() {
            let stuck = connected(withdrawn(3, 2, &["shop/web-7"], false));
            let (r, released) = drain(Duration::ZERO, stuck, vec![]).await;
            // The bound, then the quiet period with its floor (not confirmed).
            let want = 5 * S + IDLE_CLOSED;
            assert!(released >= want && released <= want + POLL, "{released:?}");
            assert_eq!(
                r.withdrawal,
                Some(Outcome::TimedOut {
                    pending: 1,
                    names: vec!["shop/web-7".into()],
                    waited_ms: 5000,
                })
            );
        }

        #[tokio::test(start_paused = true)]
        async fn no_stream_falls_back_to_the_quiet_period_at_once() {
            let (r, released) = drain(Duration::ZERO, Upstream::default(), vec![]).await;
            assert!(
                released >= IDLE_CLOSED && released <= IDLE_CLOSED + POLL,
                "{released:?}"
            );
            assert_eq!(
                r.withdrawal,
                Some(Outcome::FellBack {
                    reason: FallBack::NotConnected
                })
            );
        }

        #[tokio::test(start_paused = true)]
        async fn the_wait_stays_within_the_drain_deadline() {
            let start = Instant::now();
            let envoy = Envoy {
                start,
                busy: Duration::ZERO,
            };
            let (_tx, mut rx) = watch::channel(connected(withdrawn(1, 0, &["shop/a"], false)));
            let (quiet_tx, _q) = watch::channel(false);
            let s = DrainSettings {
                withdrawal_timeout: 60 * S,
                drain_deadline: 4 * S,
                ..settings()
            };
            let r = run_confirming(
                &envoy,
                s,
                POLL,
                start,
                (&quiet_tx, &AtomicBool::new(false)),
                Some(&mut rx),
            )
            .await;
            // 4 s less the 0.4 s stop reserve.
            assert_eq!(start.elapsed(), ms(3600));
            assert_eq!(r.withdrawal.as_ref().map(Outcome::label), Some("timed_out"));
            assert!(!r.outcome.is_clean(), "{:?}", r.outcome);
        }
    }
}
