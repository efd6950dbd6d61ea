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
//! Each operator replica answers only for the proxies on its own streams:
//! the withdrawal names the other replicas serving, and the wait asks each
//! of them as well ([`AskReplicas`], streams the xDS proxy opens), counting
//! the pod confirmed only when every replica is done ([`combine`]). A
//! replica that cannot be reached, or has not withdrawn the pod, is waited
//! for within the same bound and then named.
//!
//! The wait is bounded by the pod's withdrawal timeout and the drain's
//! wait; it falls back to the quiet period alone when it cannot know: the
//! stream is down when the drain starts, or no withdrawal arrives within
//! [`FIRST_WITHDRAWAL`] (an operator that does not know the pod deleting
//! yet, or one that serves no withdrawals).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use remora_contract::discovery::{MAX_DISCOVERY_REPLICAS, MAX_WITHDRAWAL_PENDING_NAMES};
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
    /// The other discovery replicas to ask as well (the main stream's
    /// word only; at most [`MAX_DISCOVERY_REPLICAS`]).
    pub replicas: Vec<Replica>,
}

/// Another discovery replica, as the server names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Replica {
    /// Its pod.
    pub name: String,
    /// `IP:port` of its discovery server.
    pub address: String,
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
            replicas: w
                .replicas
                .into_iter()
                .take(MAX_DISCOVERY_REPLICAS)
                .map(|r| Replica {
                    name: r.name,
                    address: r.address,
                })
                .collect(),
        }
    }
}

/// What one other replica has said of the pod's withdrawal, on the stream
/// the agent holds to it while it drains.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplicaView {
    /// As last told; `None` before its first word, or absent there (it has
    /// not withdrawn the pod yet).
    pub withdrawal: Option<Progress>,
    /// Why the stream to it is down, if it is (kept until it is up again).
    pub error: Option<String>,
}

/// Opens a stream to another replica for the pod's withdrawal and
/// publishes what it says; the stream ends once the receiver is dropped.
pub trait AskReplicas: Send + Sync {
    fn ask(&self, replica: &Replica) -> watch::Receiver<ReplicaView>;
}

/// Where the drain learns of the withdrawal: the main stream's view, and
/// the way to ask the other replicas.
#[derive(Clone)]
pub struct Source {
    pub upstream: watch::Receiver<Upstream>,
    pub replicas: Arc<dyn AskReplicas>,
}

impl Source {
    /// One replica only: any other named is never reached (tests).
    pub fn single(upstream: watch::Receiver<Upstream>) -> Self {
        struct Nobody;
        impl AskReplicas for Nobody {
            fn ask(&self, _: &Replica) -> watch::Receiver<ReplicaView> {
                watch::channel(ReplicaView {
                    withdrawal: None,
                    error: Some("not asked: no way to reach other replicas".into()),
                })
                .1
            }
        }
        Self {
            upstream,
            replicas: Arc::new(Nobody),
        }
    }
}

/// The withdrawal as every replica told it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Combined {
    /// Counts summed, pending names merged (sorted, bounded); `done` when
    /// every replica is, `timed_out` if any of them gave up.
    pub progress: Progress,
    /// Replicas that answered.
    pub replicas: u32,
    /// Those that did not (yet), each named with why: unreachable, or the
    /// pod not withdrawn there.
    pub unanswered: Vec<String>,
}

/// Combine the main stream's word with what each other replica said: a
/// proxy is on one replica at a time, so the counts add up.
pub fn combine(main: &Progress, others: &[(String, ReplicaView)]) -> Combined {
    let mut p = Progress {
        replicas: Vec::new(),
        ..main.clone()
    };
    let mut names: BTreeSet<String> = main.pending.iter().cloned().collect();
    let (mut replicas, mut unanswered) = (1, Vec::new());
    for (name, view) in others {
        match &view.withdrawal {
            Some(o) => {
                replicas += 1;
                p.expected = p.expected.saturating_add(o.expected);
                p.confirmed = p.confirmed.saturating_add(o.confirmed);
                p.gone = p.gone.saturating_add(o.gone);
                p.done &= o.done;
                p.timed_out |= o.timed_out;
                p.last_confirmation_ms = p.last_confirmation_ms.max(o.last_confirmation_ms);
                names.extend(o.pending.iter().cloned());
            }
            None => {
                p.done = false;
                unanswered.push(match &view.error {
                    Some(e) => format!("replica {name} unreachable: {e}"),
                    None => format!("replica {name} has not withdrawn the pod"),
                });
            }
        }
    }
    p.pending = names
        .into_iter()
        .take(MAX_WITHDRAWAL_PENDING_NAMES)
        .collect();
    Combined {
        progress: p,
        replicas,
        unanswered,
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
        /// The servers' time from the withdrawal to the last confirmation.
        last_confirmation_ms: u64,
        /// How long the drain waited.
        waited_ms: u64,
        /// Discovery replicas that answered (all of them, here).
        replicas: u32,
    },
    /// The bound came first (the pod's withdrawal timeout, at a server or
    /// here, or the drain's deadline) with proxies still pending, or a
    /// replica that never answered.
    TimedOut {
        /// Confirmed, of `expected`; `gone` left without confirming.
        proxies: u32,
        expected: u32,
        gone: u32,
        pending: u32,
        /// At most [`remora_contract::discovery::MAX_WITHDRAWAL_PENDING_NAMES`].
        names: Vec<String>,
        waited_ms: u64,
        /// Discovery replicas that answered.
        replicas: u32,
        /// Those that did not, with why ("replica <pod> unreachable: ...").
        #[serde(skip_serializing_if = "Vec::is_empty")]
        unanswered: Vec<String>,
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

/// Wait until the pod's withdrawal is done at every replica, at most
/// until `until` (the caller's bound: the withdrawal timeout within the
/// drain's wait). See the module docs for when it falls back.
pub async fn confirm(source: &mut Source, until: Instant) -> Outcome {
    let started = Instant::now();
    if !source.upstream.borrow_and_update().connected {
        tracing::warn!(
            "the discovery stream is down at drain start: cannot learn who still routes to the pod, falling back to the quiet period"
        );
        return Outcome::FellBack {
            reason: FallBack::NotConnected,
        };
    }
    let first_until = until.min(started + FIRST_WITHDRAWAL);
    // The other replicas asked so far; dropping one ends its stream.
    let mut asked: BTreeMap<String, watch::Receiver<ReplicaView>> = BTreeMap::new();
    loop {
        let main = source.upstream.borrow_and_update().withdrawal.clone();
        let now = main.map(|p| {
            // Those no longer named stopped serving: their proxies moved on.
            asked.retain(|n, _| p.replicas.iter().any(|r| r.name == *n));
            for r in &p.replicas {
                if !asked.contains_key(&r.name) {
                    tracing::info!(replica = %r.name, address = %r.address,
                        "asking another discovery replica for the pod's withdrawal");
                    asked.insert(r.name.clone(), source.replicas.ask(r));
                }
            }
            let views: Vec<(String, ReplicaView)> = asked
                .iter_mut()
                .map(|(n, rx)| (n.clone(), rx.borrow_and_update().clone()))
                .collect();
            combine(&p, &views)
        });
        match &now {
            Some(c) if c.progress.done && !c.progress.timed_out => {
                return confirmed(c, started);
            }
            Some(c) if c.progress.done => return timed_out(c, started, "a discovery server"),
            _ => {}
        }
        let wait_until = if now.is_some() { until } else { first_until };
        let changed = tokio::time::timeout_at(
            wait_until,
            any_changed(&mut source.upstream, asked.values_mut()),
        )
        .await;
        match (changed, now) {
            (Ok(true), _) => {}
            // The proxy is gone (the agent stops): what was last told stands.
            (Ok(false) | Err(_), None) => {
                tracing::warn!(after = ?started.elapsed(),
                    "no withdrawal of the pod from the discovery server: falling back to the quiet period");
                return Outcome::FellBack {
                    reason: FallBack::NoWithdrawal,
                };
            }
            (Ok(false) | Err(_), Some(c)) => return timed_out(&c, started, "the drain"),
        }
    }
}

/// Resolves when the main view or a replica's changed: `false` once the
/// main view's sender is gone (a replica whose stream task ended is no
/// longer waited on for changes).
async fn any_changed<'a>(
    upstream: &mut watch::Receiver<Upstream>,
    replicas: impl Iterator<Item = &'a mut watch::Receiver<ReplicaView>>,
) -> bool {
    let open: Vec<_> = replicas
        .filter(|rx| rx.has_changed().is_ok())
        .map(|rx| Box::pin(rx.changed()))
        .collect();
    let any_replica = async {
        if open.is_empty() {
            std::future::pending::<()>().await;
        }
        let _ = futures::future::select_all(open).await;
    };
    tokio::select! {
        r = upstream.changed() => r.is_ok(),
        () = any_replica => true,
    }
}

fn confirmed(c: &Combined, started: Instant) -> Outcome {
    let (p, waited) = (&c.progress, started.elapsed());
    tracing::info!(
        confirmed = p.confirmed,
        expected = p.expected,
        gone = p.gone,
        last_confirmation_ms = p.last_confirmation_ms,
        replicas = c.replicas,
        ?waited,
        "every proxy that routed to the pod confirmed it no longer does"
    );
    Outcome::Confirmed {
        proxies: p.confirmed,
        expected: p.expected,
        gone: p.gone,
        last_confirmation_ms: p.last_confirmation_ms,
        waited_ms: ms(waited),
        replicas: c.replicas,
    }
}

fn timed_out(c: &Combined, started: Instant, by: &str) -> Outcome {
    let (p, waited) = (&c.progress, started.elapsed());
    tracing::warn!(
        confirmed = p.confirmed,
        expected = p.expected,
        gone = p.gone,
        pending = p.pending_count(),
        names = ?p.pending,
        replicas = c.replicas,
        unanswered = ?c.unanswered,
        ?waited,
        by,
        "proxies that routed to the pod never confirmed they stopped: the drain goes on"
    );
    Outcome::TimedOut {
        proxies: p.confirmed,
        expected: p.expected,
        gone: p.gone,
        pending: p.pending_count(),
        names: p.pending.clone(),
        waited_ms: ms(waited),
        replicas: c.replicas,
        unanswered: c.unanswered.clone(),
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
        let (tx, rx) = watch::channel(connected(None));
        let start = Instant::now();
        let mut rx = Source::single(rx);
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
                replicas: 1,
            }
        );
        assert!(got.is_confirmed());
    }

    #[tokio::test(start_paused = true)]
    async fn a_proxy_that_never_confirms_is_named_at_the_bound() {
        let (tx, rx) = watch::channel(connected(withdrawn(2, 1, &["shop/web-9"], false)));
        let start = Instant::now();
        let mut rx = Source::single(rx);
        let got = confirm(&mut rx, start + 5 * S).await;
        assert_eq!(start.elapsed(), 5 * S);
        assert_eq!(
            got,
            Outcome::TimedOut {
                proxies: 1,
                expected: 2,
                gone: 0,
                pending: 1,
                names: vec!["shop/web-9".into()],
                waited_ms: 5000,
                replicas: 1,
                unanswered: vec![],
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
        let (_tx, rx) = watch::channel(Upstream::default());
        let mut rx = Source::single(rx);
        let start = Instant::now();
        let got = confirm(&mut rx, start + 5 * S).await;
        assert_eq!(
            got,
            Outcome::FellBack {
                reason: FallBack::NotConnected
            }
        );
        assert_eq!(start.elapsed(), Duration::ZERO, "at once");

        let (_tx, rx) = watch::channel(connected(None));
        let mut rx = Source::single(rx);
        let got = confirm(&mut rx, start + 5 * S).await;
        assert_eq!(
            got,
            Outcome::FellBack {
                reason: FallBack::NoWithdrawal
            }
        );
        assert_eq!(start.elapsed(), FIRST_WITHDRAWAL);
        // Nobody routed to the pod: done at once, with none.
        let (_tx, rx) = watch::channel(connected(withdrawn(0, 0, &[], true)));
        let mut rx = Source::single(rx);
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
            drain_with(settings(), busy, first, told).await
        }

        /// [`drain`] with these settings.
        async fn drain_with(
            settings: DrainSettings,
            busy: Duration,
            first: Upstream,
            told: Vec<(Duration, Upstream)>,
        ) -> (DrainReport, Duration) {
            let start = Instant::now();
            let envoy = Envoy { start, busy };
            let (tx, rx) = watch::channel(first);
            let mut rx = Source::single(rx);
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
                    settings,
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
            assert_eq!(
                r.withdrawal.as_deref().map(Outcome::label),
                Some("confirmed")
            );
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
            // The bound; the quiet period and its floor (not confirmed)
            // count from the drain's start, and nothing arrived since: the
            // app is let go at the bound.
            let want = 5 * S;
            assert!(released >= want && released <= want + POLL, "{released:?}");
            assert_eq!(r.outcome, crate::drain::DrainOutcome::Quiet);
            assert_eq!(
                r.withdrawal.as_deref(),
                Some(&Outcome::TimedOut {
                    proxies: 2,
                    expected: 3,
                    gone: 0,
                    pending: 1,
                    names: vec!["shop/web-7".into()],
                    waited_ms: 5000,
                    replicas: 1,
                    unanswered: vec![],
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
                r.withdrawal.as_deref(),
                Some(&Outcome::FellBack {
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
            let (_tx, rx) = watch::channel(connected(withdrawn(1, 0, &["shop/a"], false)));
            let mut rx = Source::single(rx);
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
            assert_eq!(
                r.withdrawal.as_deref().map(Outcome::label),
                Some("timed_out")
            );
            // Nothing arrived meanwhile: the app is let go as the wait ends,
            // and the report says when.
            assert_eq!(r.inbound_quiet_seconds, Some(3.6));
        }

        /// The node's frozen-subscriber case: a 2 s withdrawal timeout
        /// within a 4 s drain deadline. The floor of the quiet period used
        /// to count from the end of the wait (2 s + 1.75 s, past the 3.6 s
        /// the deadline leaves), so the app was only let go as the drain
        /// ran out, without a word; it counts from the drain's start, so
        /// the app goes at the bound and the drain ends quiet.
        #[tokio::test(start_paused = true)]
        async fn a_timed_out_wait_lets_the_app_go_at_the_bound_within_a_short_deadline() {
            let s = DrainSettings {
                withdrawal_timeout: 2 * S,
                drain_deadline: 4 * S,
                ..settings()
            };
            let frozen = connected(withdrawn(2, 1, &["shop/frozen"], false));
            let (r, released) = drain_with(s, Duration::ZERO, frozen, vec![]).await;
            assert!(
                released >= 2 * S && released <= 2 * S + POLL,
                "{released:?}"
            );
            assert_eq!(r.outcome, crate::drain::DrainOutcome::Quiet);
            let took = Duration::from_secs_f64(r.duration_seconds);
            assert!(took <= 2 * S + POLL, "{took:?}");
            assert_eq!(r.inbound_quiet_seconds, Some(released.as_secs_f64()));
            assert_eq!(
                r.withdrawal.as_deref().map(Outcome::label),
                Some("timed_out")
            );
        }
    }

    /// Several discovery replicas: the main stream's and each other's.
    mod replicas {
        use std::collections::HashMap;
        use std::sync::Mutex;

        use super::*;

        /// The other replicas' streams, as the test drives them.
        #[derive(Default)]
        struct Fake {
            views: Mutex<HashMap<String, watch::Receiver<ReplicaView>>>,
            asked: Mutex<Vec<String>>,
        }

        impl Fake {
            fn replica(&self, name: &str, first: ReplicaView) -> watch::Sender<ReplicaView> {
                let (tx, rx) = watch::channel(first);
                self.views.lock().expect("lock").insert(name.into(), rx);
                tx
            }
        }

        impl AskReplicas for Fake {
            fn ask(&self, r: &Replica) -> watch::Receiver<ReplicaView> {
                self.asked.lock().expect("lock").push(r.name.clone());
                self.views.lock().expect("lock")[&r.name].clone()
            }
        }

        fn naming(p: Option<Progress>, replicas: &[&str]) -> Upstream {
            connected(p.map(|p| {
                Progress {
                    replicas: replicas
                        .iter()
                        .map(|n| Replica {
                            name: n.to_string(),
                            address: "10.0.1.2:15010".into(),
                        })
                        .collect(),
                    ..p
                }
            }))
        }

        fn told(p: Option<Progress>) -> ReplicaView {
            ReplicaView {
                withdrawal: p,
                error: None,
            }
        }

        fn source(first: Upstream, fake: &Arc<Fake>) -> (watch::Sender<Upstream>, Source) {
            let (tx, rx) = watch::channel(first);
            let replicas: Arc<dyn AskReplicas> = fake.clone();
            (
                tx,
                Source {
                    upstream: rx,
                    replicas,
                },
            )
        }

        #[test]
        fn counts_add_up_names_merge_and_done_needs_every_replica() {
            let main = withdrawn(2, 1, &["shop/z"], false).expect("some");
            let b = told(withdrawn(3, 2, &["shop/a"], false));
            let c = ReplicaView {
                withdrawal: None,
                error: Some("connection refused".into()),
            };
            let got = combine(&main, &[("op-b".into(), b), ("op-c".into(), c)]);
            assert_eq!(got.progress.expected, 5);
            assert_eq!(got.progress.confirmed, 3);
            assert_eq!(got.progress.pending, ["shop/a", "shop/z"]);
            assert!(!got.progress.done);
            assert_eq!(got.replicas, 2);
            assert_eq!(
                got.unanswered,
                ["replica op-c unreachable: connection refused"]
            );
            let done = |n| withdrawn(n, n, &[], true);
            let got = combine(
                &done(1).expect("some"),
                &[("op-b".into(), told(done(2))), ("op-c".into(), told(None))],
            );
            assert!(!got.progress.done, "op-c has not withdrawn the pod");
            assert_eq!(got.unanswered, ["replica op-c has not withdrawn the pod"]);
            let got = combine(&done(1).expect("some"), &[("op-b".into(), told(done(2)))]);
            assert!(got.progress.done && !got.progress.timed_out);
            assert_eq!((got.progress.confirmed, got.replicas), (3, 2));
        }

        #[tokio::test(start_paused = true)]
        async fn confirmed_only_once_every_replica_is_done() {
            let fake = Arc::new(Fake::default());
            let b = fake.replica("op-b", ReplicaView::default());
            let (_tx, mut src) = source(naming(withdrawn(1, 1, &[], true), &["op-b"]), &fake);
            let start = Instant::now();
            let wait = tokio::spawn(async move { confirm(&mut src, start + 5 * S).await });
            tokio::time::sleep(Duration::from_millis(100)).await;
            b.send_replace(told(withdrawn(2, 1, &["shop/c-1"], false)));
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert!(!wait.is_finished(), "op-b still has a proxy pending");
            b.send_replace(told(withdrawn(2, 2, &[], true)));
            let got = wait.await.expect("no panic");
            assert_eq!(
                got,
                Outcome::Confirmed {
                    proxies: 3,
                    expected: 3,
                    gone: 0,
                    last_confirmation_ms: 7,
                    waited_ms: 300,
                    replicas: 2,
                }
            );
            assert_eq!(*fake.asked.lock().expect("lock"), ["op-b"], "asked once");
        }

        #[tokio::test(start_paused = true)]
        async fn an_unreachable_replica_is_waited_for_until_the_bound_and_named() {
            let fake = Arc::new(Fake::default());
            let down = ReplicaView {
                withdrawal: None,
                error: Some("connection refused".into()),
            };
            let _b = fake.replica("op-b", down);
            let (_tx, mut src) = source(naming(withdrawn(1, 1, &[], true), &["op-b"]), &fake);
            let start = Instant::now();
            let got = confirm(&mut src, start + 5 * S).await;
            assert_eq!(start.elapsed(), 5 * S, "not skipped: waited the bound");
            let Outcome::TimedOut {
                pending,
                replicas,
                unanswered,
                ..
            } = got
            else {
                panic!("timed out: {got:?}")
            };
            assert_eq!((pending, replicas), (0, 1));
            assert_eq!(unanswered, ["replica op-b unreachable: connection refused"]);
        }

        #[tokio::test(start_paused = true)]
        async fn a_replica_that_gives_up_names_its_frozen_proxy() {
            let fake = Arc::new(Fake::default());
            let b = fake.replica("op-b", ReplicaView::default());
            let (_tx, mut src) = source(naming(withdrawn(1, 1, &[], true), &["op-b"]), &fake);
            let start = Instant::now();
            let wait = tokio::spawn(async move { confirm(&mut src, start + 5 * S).await });
            tokio::time::sleep(Duration::from_millis(2000)).await;
            // Its own bound passed: done, timed out, naming the frozen one.
            let gave_up = Progress {
                timed_out: true,
                ..withdrawn(2, 1, &["shop/frozen"], true).expect("some")
            };
            b.send_replace(told(Some(gave_up)));
            let got = wait.await.expect("no panic");
            assert_eq!(start.elapsed(), 2 * S, "at once");
            let Outcome::TimedOut {
                proxies,
                expected,
                names,
                replicas,
                unanswered,
                ..
            } = got
            else {
                panic!("timed out: {got:?}")
            };
            assert_eq!((proxies, expected, replicas), (2, 3, 2));
            assert_eq!(names, ["shop/frozen"]);
            assert!(unanswered.is_empty());
        }

        #[tokio::test(start_paused = true)]
        async fn a_replica_no_longer_named_is_no_longer_waited_for() {
            let fake = Arc::new(Fake::default());
            let _b = fake.replica("op-b", ReplicaView::default());
            let (tx, mut src) = source(
                naming(withdrawn(1, 0, &["shop/c"], false), &["op-b"]),
                &fake,
            );
            let start = Instant::now();
            let wait = tokio::spawn(async move { confirm(&mut src, start + 5 * S).await });
            tokio::time::sleep(Duration::from_millis(400)).await;
            // op-b stopped serving (its proxies moved here, and confirmed).
            tx.send_replace(naming(withdrawn(1, 1, &[], true), &[]));
            let got = wait.await.expect("no panic");
            assert_eq!(got.label(), "confirmed", "{got:?}");
            assert_eq!(start.elapsed(), Duration::from_millis(400));
        }
    }
}
