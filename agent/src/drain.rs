//! The graceful drain of Envoy's inbound side.
//!
//! Readiness has already failed when this runs. It asks Envoy to drain its
//! inbound listeners gracefully (clients are told `connection: close` or
//! GOAWAY, outbound keeps serving), then waits:
//! - adaptive (the default): until the pod is no longer used — no new
//!   connection or request, inbound or outbound, for the quiet period, and
//!   none in flight. A fixed timer cannot know how far the load balancers lag
//!   behind the endpoints; Envoy's counters can see when they have caught up.
//!   On the way it reports when inbound alone has gone quiet: that is when the
//!   app containers' preStop hook lets the kubelet send them SIGTERM;
//! - fixed: the termination drain duration, or — with exit-on-zero — the
//!   minimum drain duration and then until no workload connection is left.
//!
//! In discovery mode an adaptive drain first waits for the pod's withdrawal
//! to be confirmed ([`crate::withdrawal`]: every proxy that routed to the
//! pod has taken it out of its endpoints), bounded by the withdrawal
//! timeout; only then, and once no inbound request is in flight, does the
//! quiet period run and the app get released ([`run_confirming`]).
//!
//! It never runs past the drain deadline, minus a reserve kept for stopping
//! Envoy: every admin call it makes is bounded, by [`ADMIN_CALL_TIMEOUT`] and
//! by the end of the wait, so a hung or slow admin API cannot hold it (Envoy
//! is then stopped by signal in the reserve).

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::envoy::admin::{AdminError, EnvoyAdmin, Traffic};
use crate::envoy::idle_close;
use crate::lifecycle::DrainSettings;
use crate::metrics::DrainOutcomeLabel;
use crate::withdrawal;

/// What the agent logs as it lets the app stop (its hook answers), with
/// `why`: inbound went quiet, or the drain's deadline came.
pub const RELEASED: &str = "the app may stop";
/// No admin call of a drain waits longer than this for its answer.
pub const ADMIN_CALL_TIMEOUT: Duration = Duration::from_secs(1);
/// Inbound quiet this long means Envoy has closed every idle HTTP
/// connection (see [`idle_close`]): the app is never let stop sooner, even
/// with a shorter quiet period, so no idle pooled connection outlives it.
pub const IDLE_CLOSED: Duration = idle_close::IDLE_AFTER
    .saturating_add(idle_close::CLOSE_GRACE)
    .saturating_add(idle_close::REFRESH);
/// Exit-on-zero counts connections at least this often once its minimum is
/// over: the last close is followed by the agent's exit, and a count costs
/// Envoy's admin a fraction of a millisecond.
pub const ZERO_POLL: Duration = Duration::from_millis(10);
/// The last count of open connections (for the report) is made in this slot
/// before the end of the wait, so it never eats into the stop reserve.
const FINAL_COUNT_SLOT: Duration = Duration::from_millis(200);

#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    #[error(transparent)]
    Admin(#[from] AdminError),
    #[error("Envoy's admin API did not answer {what} within {after:?}")]
    TimedOut { what: &'static str, after: Duration },
}

/// One admin call, given up after [`ADMIN_CALL_TIMEOUT`] or at `until`,
/// whichever comes first.
async fn bounded<T>(
    what: &'static str,
    call: impl Future<Output = Result<T, AdminError>>,
    until: Instant,
) -> Result<T, DrainError> {
    let started = Instant::now();
    let give_up = until.min(started + ADMIN_CALL_TIMEOUT);
    match tokio::time::timeout_at(give_up, call).await {
        Ok(r) => r.map_err(DrainError::from),
        Err(_) => Err(DrainError::TimedOut {
            what,
            after: started.elapsed(),
        }),
    }
}

/// What the drain needs from Envoy.
pub trait DrainTarget {
    fn drain_inbound(&self) -> impl Future<Output = Result<(), AdminError>> + Send;
    fn active_connections(&self) -> impl Future<Output = Result<u64, AdminError>> + Send;
    fn traffic(&self) -> impl Future<Output = Result<Traffic, AdminError>> + Send;
}

impl DrainTarget for EnvoyAdmin {
    async fn drain_inbound(&self) -> Result<(), AdminError> {
        self.drain_inbound_listeners().await
    }
    async fn active_connections(&self) -> Result<u64, AdminError> {
        EnvoyAdmin::active_connections(self).await
    }
    async fn traffic(&self) -> Result<Traffic, AdminError> {
        EnvoyAdmin::traffic(self).await
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum DrainOutcome {
    /// Adaptive: nothing new arrived for the quiet period and nothing was in flight.
    Quiet,
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
            Self::Quiet => DrainOutcomeLabel::Quiet,
            Self::Drained => DrainOutcomeLabel::Drained,
            Self::Elapsed => DrainOutcomeLabel::Elapsed,
            Self::DeadlineExceeded { .. } => DrainOutcomeLabel::DeadlineExceeded,
            Self::Aborted => DrainOutcomeLabel::Aborted,
        }
    }

    /// Whether the drain ended the way the configuration intended.
    pub fn is_clean(&self) -> bool {
        matches!(self, Self::Quiet | Self::Drained | Self::Elapsed)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct DrainReport {
    #[serde(flatten)]
    pub outcome: DrainOutcome,
    /// Workload connections when the drain began (None if Envoy did not say).
    pub active_at_start: Option<u64>,
    pub duration_seconds: f64,
    /// Adaptive: when the app was let stop (its SIGTERM): inbound traffic
    /// went quiet, or the deadline came first; since the start.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inbound_quiet_seconds: Option<f64>,
    /// Adaptive in discovery mode: how the wait for the confirmed removal
    /// of the pod's endpoints ended.
    #[serde(skip_serializing_if = "Option::is_none")]
    /// (Boxed: the report travels in enums whose other variants are small.)
    pub withdrawal: Option<Box<withdrawal::Outcome>>,
    pub settings: DrainSettings,
}

/// Time kept back from the deadline for stopping Envoy afterwards (SIGTERM,
/// and SIGKILL when it does not stop in time). No admin call runs in it.
pub fn stop_reserve(deadline: Duration) -> Duration {
    (deadline / 10).min(Duration::from_secs(1))
}

/// Run one drain with `settings`, started at `started` (the deadline counts
/// from there). `inbound_quiet` turns true once inbound traffic has gone
/// quiet (adaptive), at once (fixed: the app is not held), and always by the end.
pub async fn run<T: DrainTarget>(
    target: &T,
    settings: DrainSettings,
    poll: Duration,
    started: Instant,
    inbound_quiet: &watch::Sender<bool>,
    app_waits: &AtomicBool,
) -> DrainReport {
    run_confirming(
        target,
        settings,
        poll,
        started,
        (inbound_quiet, app_waits),
        None,
    )
    .await
}

/// [`run`]; in discovery mode (`upstream`, the xDS proxy's view) an
/// adaptive drain first waits for the confirmed removal of the pod's
/// endpoints (see the module docs).
pub async fn run_confirming<T: DrainTarget>(
    target: &T,
    settings: DrainSettings,
    poll: Duration,
    started: Instant,
    (inbound_quiet, app_waits): (&watch::Sender<bool>, &AtomicBool),
    upstream: Option<&mut withdrawal::Source>,
) -> DrainReport {
    let wait_until = started
        + settings
            .drain_deadline
            .saturating_sub(stop_reserve(settings.drain_deadline));
    // Both read before Envoy starts telling clients to leave: the count for the
    // report, and the baseline the adaptive drain compares with.
    let (count, baseline) = tokio::join!(
        bounded(
            "the connection count",
            target.active_connections(),
            wait_until
        ),
        async {
            if settings.adaptive() {
                bounded("the traffic counters", target.traffic(), wait_until)
                    .await
                    .ok()
            } else {
                None
            }
        }
    );
    let active_at_start = match count {
        Ok(n) => Some(n),
        Err(e) => {
            tracing::warn!(error = %e, "cannot count connections at drain start");
            None
        }
    };
    if let Some(outcome) = nothing_to_wait_for(&settings, active_at_start) {
        // Envoy is stopped next: telling clients to leave first would only
        // cost an admin call before the stop closes their connections anyway.
        inbound_quiet.send_replace(true);
        tracing::info!(?active_at_start, ?settings, "nothing to drain for");
        return DrainReport {
            outcome,
            active_at_start,
            duration_seconds: started.elapsed().as_secs_f64(),
            inbound_quiet_seconds: None,
            withdrawal: None,
            settings,
        };
    }
    if let Err(e) = bounded("drain_listeners", target.drain_inbound(), wait_until).await {
        // Without Envoy's drain the wait still protects in-flight requests.
        tracing::warn!(error = %e, "Envoy did not accept drain_listeners");
    }
    tracing::info!(?active_at_start, ?settings, "draining inbound listeners");

    let mut inbound_quiet_at = None;
    let mut confirmation = None;
    let outcome = if settings.adaptive() {
        let mut quiet = Quiet {
            period: settings.quiet_period,
            floor: IDLE_CLOSED,
            from: started,
            needs_idle: false,
        };
        if let Some(upstream) = upstream {
            let until = wait_until.min(started + settings.withdrawal_timeout);
            let c = withdrawal::confirm(upstream, until).await;
            quiet = confirmed_quiet(quiet, &c);
            confirmation = Some(Box::new(c));
        }
        let (outcome, quiet_at) = wait_for_quiet(
            target,
            quiet,
            poll,
            (started, wait_until),
            baseline,
            (inbound_quiet, app_waits),
        )
        .await;
        inbound_quiet_at = quiet_at;
        outcome
    } else if settings.exit_on_zero_active_connections {
        inbound_quiet.send_replace(true);
        let min_end = started + settings.minimum_drain_duration;
        if min_end >= wait_until {
            at_deadline(target, wait_until, None).await
        } else {
            tokio::time::sleep_until(min_end).await;
            wait_for_zero(target, poll.min(ZERO_POLL), wait_until).await
        }
    } else {
        inbound_quiet.send_replace(true);
        let end = started + settings.termination_drain_duration;
        if end > wait_until {
            at_deadline(target, wait_until, None).await
        } else {
            tokio::time::sleep_until(end).await;
            DrainOutcome::Elapsed
        }
    };
    if !inbound_quiet.send_replace(true) {
        // The deadline came first: the app is let go now, and says so as
        // when inbound went quiet.
        tracing::info!(after = ?started.elapsed(), why = "the drain's deadline came", "{RELEASED}");
        inbound_quiet_at = Some(Instant::now());
    }
    DrainReport {
        outcome,
        active_at_start,
        duration_seconds: started.elapsed().as_secs_f64(),
        inbound_quiet_seconds: inbound_quiet_at.map(|t: Instant| (t - started).as_secs_f64()),
        withdrawal: confirmation,
        settings,
    }
}

/// How a fixed drain ends at once, when it has no time to wait: a
/// termination drain of zero, or exit-on-zero with no minimum and no
/// connection open.
fn nothing_to_wait_for(settings: &DrainSettings, active: Option<u64>) -> Option<DrainOutcome> {
    if !settings.can_wait() {
        return Some(DrainOutcome::Elapsed);
    }
    (settings.exit_on_zero_active_connections
        && settings.minimum_drain_duration.is_zero()
        && active == Some(0))
    .then_some(DrainOutcome::Drained)
}

/// How the adaptive wait decides that inbound has gone quiet.
#[derive(Debug, Clone, Copy)]
struct Quiet {
    period: Duration,
    /// Inbound quiet never counts before this long (see [`IDLE_CLOSED`]).
    floor: Duration,
    /// The quiet period counts from here.
    from: Instant,
    /// The app is released only once no inbound request is in flight.
    needs_idle: bool,
}

/// The quiet period after the wait for the confirmation: it counts from
/// the confirmation, and once every meshed client confirmed, without the
/// idle-connection floor. Each of their Envoys drains its pools to the pod
/// as it takes the pod out of its endpoints, so no idle pooled connection
/// of theirs can be picked again; a client outside the mesh is what the
/// quiet period is for, and a workload that sets it to 0 says it has none.
/// Timed out or fallen back: as without discovery, the quiet period and
/// its floor count from the drain's start (`quiet` unchanged), so the
/// quiet time that passed during the wait counts: counted from the end of
/// the wait instead, a timed-out wait plus the floor ran into the drain
/// deadline and the app was never let go before it.
fn confirmed_quiet(quiet: Quiet, c: &withdrawal::Outcome) -> Quiet {
    if c.is_confirmed() {
        Quiet {
            floor: Duration::ZERO,
            from: Instant::now(),
            needs_idle: true,
            ..quiet
        }
    } else {
        quiet
    }
}

/// The adaptive wait. A counter that moved (or could not be read) restarts
/// its quiet period; the drain ends when every counter has been still for
/// `quiet` and no request is in flight. Returns when inbound went quiet too.
async fn wait_for_quiet<T: DrainTarget>(
    target: &T,
    how: Quiet,
    poll: Duration,
    (started, wait_until): (Instant, Instant),
    baseline: Option<Traffic>,
    (inbound_quiet, app_waits): (&watch::Sender<bool>, &AtomicBool),
) -> (DrainOutcome, Option<Instant>) {
    let quiet = how.period;
    let mut last = baseline;
    let (mut inbound_since, mut any_since) = (how.from, how.from);
    let mut inbound_quiet_at = None;
    let mut inbound_in_flight = None;
    loop {
        let now = Instant::now();
        let in_flight = match bounded("the traffic counters", target.traffic(), wait_until).await {
            Ok(t) => {
                match last {
                    Some(prev) => {
                        if t.inbound_arrivals != prev.inbound_arrivals {
                            inbound_since = now;
                        }
                        if t.arrivals != prev.arrivals {
                            any_since = now;
                        }
                    }
                    // No baseline: this read is one, and counts as activity.
                    None => (inbound_since, any_since) = (now, now),
                }
                last = Some(t);
                inbound_in_flight = Some(t.inbound_in_flight);
                Some(t.in_flight)
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot read Envoy's counters");
                (inbound_since, any_since) = (now, now);
                None
            }
        };
        if inbound_quiet_at.is_none()
            && now.duration_since(inbound_since) >= quiet.max(how.floor)
            && (!how.needs_idle || inbound_in_flight == Some(0))
        {
            inbound_quiet_at = Some(now);
            // An app hook waiting returns now and its app gets SIGTERM: the
            // outbound calls of its shutdown start from here, so they get a
            // quiet period of their own before Envoy may stop.
            if app_waits.load(Ordering::Acquire) {
                any_since = now;
            }
            inbound_quiet.send_replace(true);
            tracing::info!(
                after = ?now.duration_since(started),
                why = "inbound traffic has gone quiet",
                "{RELEASED}"
            );
        }
        if inbound_quiet_at.is_some()
            && now.duration_since(any_since) >= quiet
            && in_flight == Some(0)
        {
            return (DrainOutcome::Quiet, inbound_quiet_at);
        }
        let next = Instant::now() + poll;
        if next >= wait_until {
            return (
                at_deadline(target, wait_until, None).await,
                inbound_quiet_at,
            );
        }
        tokio::time::sleep_until(next).await;
    }
}

/// Wait for the deadline and say how many connections were still open
/// (`last` when Envoy cannot say in time).
async fn at_deadline<T: DrainTarget>(
    target: &T,
    wait_until: Instant,
    last: Option<u64>,
) -> DrainOutcome {
    let count_from = wait_until
        .checked_sub(FINAL_COUNT_SLOT)
        .unwrap_or(wait_until);
    tokio::time::sleep_until(count_from).await;
    let active = if Instant::now() < wait_until {
        bounded(
            "the connection count",
            target.active_connections(),
            wait_until,
        )
        .await
        .ok()
    } else {
        None
    };
    tokio::time::sleep_until(wait_until).await;
    DrainOutcome::DeadlineExceeded {
        active: active.or(last),
    }
}

async fn wait_for_zero<T: DrainTarget>(
    target: &T,
    poll: Duration,
    wait_until: Instant,
) -> DrainOutcome {
    let mut last = None;
    loop {
        match bounded(
            "the connection count",
            target.active_connections(),
            wait_until,
        )
        .await
        {
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
            return at_deadline(target, wait_until, last).await;
        }
        tokio::time::sleep_until(next).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    use remora_contract::DrainMode;

    /// Test double of Envoy's admin API: connections close at given instants;
    /// requests arrive (inbound or outbound) and are in flight at given times.
    struct FakeEnvoy {
        start: Instant,
        closes_at: Mutex<Vec<Duration>>,
        inbound_at: Vec<Duration>,
        outbound_at: Vec<Duration>,
        in_flight: Vec<(Duration, Duration)>,
        drained: AtomicBool,
        fail_counts: bool,
    }

    impl FakeEnvoy {
        fn new(closes_at: Vec<Duration>) -> Self {
            Self {
                start: Instant::now(),
                closes_at: Mutex::new(closes_at),
                inbound_at: Vec::new(),
                outbound_at: Vec::new(),
                in_flight: Vec::new(),
                drained: AtomicBool::new(false),
                fail_counts: false,
            }
        }
    }

    fn stats_unavailable() -> AdminError {
        AdminError::Status {
            path: "/stats".into(),
            status: 503,
            body: String::new(),
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Arrivals every `every` from `from` until `until` (exclusive).
    fn arrivals(from: Duration, until: Duration, every: Duration) -> Vec<Duration> {
        std::iter::successors(Some(from), |t| Some(*t + every))
            .take_while(|t| *t < until)
            .collect()
    }

    impl DrainTarget for FakeEnvoy {
        async fn drain_inbound(&self) -> Result<(), AdminError> {
            self.drained.store(true, Ordering::SeqCst);
            Ok(())
        }
        async fn active_connections(&self) -> Result<u64, AdminError> {
            if self.fail_counts {
                return Err(stats_unavailable());
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
        async fn traffic(&self) -> Result<Traffic, AdminError> {
            if self.fail_counts {
                return Err(stats_unavailable());
            }
            let now = self.start.elapsed();
            let seen = |v: &[Duration]| v.iter().filter(|t| **t <= now).count() as u64;
            let inbound = seen(&self.inbound_at);
            // The double's requests in flight are inbound ones.
            let in_flight = self
                .in_flight
                .iter()
                .filter(|(a, b)| *a <= now && now < *b)
                .count() as u64;
            Ok(Traffic {
                inbound_arrivals: inbound,
                arrivals: inbound + seen(&self.outbound_at),
                in_flight,
                inbound_in_flight: in_flight,
            })
        }
    }

    fn settings(exit_on_zero: bool) -> DrainSettings {
        DrainSettings {
            drain_duration: Duration::from_secs(45),
            termination_drain_duration: Duration::from_secs(5),
            exit_on_zero_active_connections: exit_on_zero,
            minimum_drain_duration: Duration::from_secs(2),
            drain_deadline: Duration::from_secs(25),
            drain_mode: DrainMode::Fixed,
            quiet_period: Duration::from_secs(3),
            withdrawal_timeout: Duration::from_secs(5),
        }
    }

    fn adaptive() -> DrainSettings {
        DrainSettings {
            drain_mode: DrainMode::Adaptive,
            ..settings(false)
        }
    }

    async fn drain(envoy: &FakeEnvoy, s: DrainSettings) -> (DrainReport, watch::Receiver<bool>) {
        let (tx, rx) = watch::channel(false);
        (
            run(envoy, s, POLL, envoy.start, &tx, &AtomicBool::new(false)).await,
            rx,
        )
    }

    const POLL: Duration = Duration::from_millis(50);

    #[tokio::test(start_paused = true)]
    async fn termination_duration_mode_waits_exactly_that_long() {
        let envoy = FakeEnvoy::new(vec![Duration::from_secs(1)]);
        let start = Instant::now();
        let (r, _) = drain(&envoy, settings(false)).await;
        assert_eq!(r.outcome, DrainOutcome::Elapsed);
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        assert_eq!(r.active_at_start, Some(1));
        assert!(envoy.drained.load(Ordering::SeqCst));
    }

    #[tokio::test(start_paused = true)]
    async fn exit_on_zero_waits_minimum_then_for_last_connection() {
        let envoy = FakeEnvoy::new(vec![Duration::from_secs(1), Duration::from_millis(7300)]);
        let start = Instant::now();
        let (r, _) = drain(&envoy, settings(true)).await;
        assert_eq!(r.outcome, DrainOutcome::Drained);
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(7300), "{took:?}");
        assert!(took <= Duration::from_millis(7300) + POLL, "{took:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn exit_on_zero_with_no_connections_ends_at_minimum() {
        let envoy = FakeEnvoy::new(vec![]);
        let start = Instant::now();
        let (r, _) = drain(&envoy, settings(true)).await;
        assert_eq!(r.outcome, DrainOutcome::Drained);
        assert_eq!(start.elapsed(), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn exit_on_zero_counts_often_once_the_minimum_is_over() {
        let envoy = FakeEnvoy::new(vec![Duration::from_millis(2345)]);
        let start = Instant::now();
        let (r, _) = drain(&envoy, settings(true)).await;
        assert_eq!(r.outcome, DrainOutcome::Drained);
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(2345), "{took:?}");
        assert!(took <= Duration::from_millis(2345) + ZERO_POLL, "{took:?}");
    }

    /// With no time to wait, Envoy is not asked to drain (it is stopped
    /// next); the connections are still counted for the report.
    #[tokio::test(start_paused = true)]
    async fn a_drain_with_nothing_to_wait_for_ends_at_once_without_draining_envoy() {
        let zero_termination = DrainSettings {
            termination_drain_duration: Duration::ZERO,
            ..settings(false)
        };
        let zero_minimum = DrainSettings {
            minimum_drain_duration: Duration::ZERO,
            ..settings(true)
        };
        // Only the fixed zero never waits (Envoy then runs without idle close).
        assert!(!zero_termination.can_wait());
        assert!(zero_minimum.can_wait());
        assert!(
            DrainSettings {
                termination_drain_duration: Duration::ZERO,
                ..adaptive()
            }
            .can_wait()
        );
        for (s, open, outcome) in [
            (
                zero_termination,
                vec![Duration::from_secs(60)],
                DrainOutcome::Elapsed,
            ),
            (zero_termination, vec![], DrainOutcome::Elapsed),
            (zero_minimum, vec![], DrainOutcome::Drained),
        ] {
            let envoy = FakeEnvoy::new(open.clone());
            let start = Instant::now();
            let (r, quiet) = drain(&envoy, s).await;
            assert_eq!(r.outcome, outcome, "{s:?}");
            assert_eq!(start.elapsed(), Duration::ZERO, "{s:?}");
            assert_eq!(r.active_at_start, Some(open.len() as u64));
            assert!(!envoy.drained.load(Ordering::SeqCst), "{s:?}");
            assert!(*quiet.borrow(), "the app is let go");
        }
        // A connection open: exit-on-zero still drains and waits for it.
        let envoy = FakeEnvoy::new(vec![Duration::from_secs(1)]);
        let (r, _) = drain(&envoy, zero_minimum).await;
        assert_eq!(r.outcome, DrainOutcome::Drained);
        assert!(envoy.drained.load(Ordering::SeqCst));
        assert!(Duration::from_secs_f64(r.duration_seconds) >= Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn deadline_bounds_a_connection_that_never_closes() {
        let envoy = FakeEnvoy::new(vec![Duration::from_secs(3600)]);
        let start = Instant::now();
        let (r, _) = drain(&envoy, settings(true)).await;
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
        let (r, _) = drain(&envoy, s).await;
        assert!(matches!(r.outcome, DrainOutcome::DeadlineExceeded { .. }));
        assert_eq!(start.elapsed(), Duration::from_millis(4500));
    }

    #[tokio::test(start_paused = true)]
    async fn unreachable_admin_still_bounded() {
        let mut envoy = FakeEnvoy::new(vec![]);
        envoy.fail_counts = true;
        let start = Instant::now();
        let (r, _) = drain(&envoy, settings(true)).await;
        assert_eq!(r.active_at_start, None);
        assert_eq!(r.outcome, DrainOutcome::DeadlineExceeded { active: None });
        assert_eq!(start.elapsed(), Duration::from_secs(24));
    }

    /// The drain with an app hook waiting, and when (since the start) the
    /// app was released.
    async fn drain_timed(envoy: &FakeEnvoy, s: DrainSettings) -> (DrainReport, Duration) {
        let app_waits = AtomicBool::new(true);
        let (tx, mut rx) = watch::channel(false);
        let start = envoy.start;
        let (r, released) = tokio::join!(run(envoy, s, POLL, start, &tx, &app_waits), async {
            let _ = rx.wait_for(|q| *q).await;
            start.elapsed()
        });
        (r, released)
    }

    fn near(got: Duration, want: Duration) -> bool {
        got >= want && got <= want + POLL
    }

    #[tokio::test(start_paused = true)]
    async fn adaptive_releases_the_app_one_quiet_period_after_the_load_balancer_stops_sending() {
        // The load balancer lags 2 s behind the endpoints: requests keep coming until then.
        let mut envoy = FakeEnvoy::new(vec![]);
        envoy.inbound_at = arrivals(ms(0), ms(2000), ms(100));
        let (r, released) = drain_timed(&envoy, adaptive()).await;
        assert_eq!(r.outcome, DrainOutcome::Quiet);
        assert!(near(released, ms(1900 + 3000)), "{released:?}");
        // Then a quiet period for the calls of the app's own shutdown.
        let took = Duration::from_secs_f64(r.duration_seconds);
        assert!(near(took, ms(1900 + 3000 + 3000)), "{took:?}");
        assert!(envoy.drained.load(Ordering::SeqCst));
    }

    #[tokio::test(start_paused = true)]
    async fn adaptive_releases_the_app_on_inbound_quiet_and_waits_for_its_outbound_calls() {
        // The app calls out every 100 ms while it shuts down, until 6 s.
        let mut envoy = FakeEnvoy::new(vec![]);
        envoy.inbound_at = arrivals(ms(0), ms(1000), ms(100));
        envoy.outbound_at = arrivals(ms(0), ms(6000), ms(100));
        let (r, released) = drain_timed(&envoy, adaptive()).await;
        assert_eq!(r.outcome, DrainOutcome::Quiet);
        assert!(near(released, ms(900 + 3000)), "{released:?}");
        let took = Duration::from_secs_f64(r.duration_seconds);
        assert!(near(took, ms(5900 + 3000)), "{took:?}");
        let quiet = r.inbound_quiet_seconds.map(Duration::from_secs_f64);
        assert!(quiet.is_some_and(|q| near(q, ms(3900))), "{quiet:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn adaptive_waits_for_requests_in_flight() {
        let mut envoy = FakeEnvoy::new(vec![]);
        envoy.inbound_at = vec![ms(0)];
        envoy.in_flight = vec![(ms(0), ms(10_000))];
        let (r, released) = drain_timed(&envoy, adaptive()).await;
        assert_eq!(r.outcome, DrainOutcome::Quiet);
        // The app is released (it finishes in-flight work itself); the proxy stays.
        assert!(near(released, ms(3000)), "{released:?}");
        let took = Duration::from_secs_f64(r.duration_seconds);
        assert!(near(took, ms(10_000)), "{took:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn adaptive_with_no_traffic_releases_the_app_after_one_quiet_period() {
        let envoy = FakeEnvoy::new(vec![Duration::from_secs(3600)]);
        let (r, released) = drain_timed(&envoy, adaptive()).await;
        // An idle keep-alive connection does not hold the drain: it was told to close.
        assert_eq!(r.outcome, DrainOutcome::Quiet);
        assert_eq!(released, ms(3000));
        assert_eq!(Duration::from_secs_f64(r.duration_seconds), ms(6000));
    }

    #[tokio::test(start_paused = true)]
    async fn a_short_quiet_period_still_waits_for_idle_connections_to_be_closed() {
        let envoy = FakeEnvoy::new(vec![]);
        let s = DrainSettings {
            quiet_period: ms(200),
            ..adaptive()
        };
        let (r, released) = drain_timed(&envoy, s).await;
        assert_eq!(r.outcome, DrainOutcome::Quiet);
        assert!(released >= IDLE_CLOSED, "{released:?}");
        assert!(near(released, IDLE_CLOSED), "{released:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn adaptive_with_no_app_hook_waiting_ends_after_one_quiet_period() {
        let envoy = FakeEnvoy::new(vec![]);
        let (r, _) = drain(&envoy, adaptive()).await;
        assert_eq!(r.outcome, DrainOutcome::Quiet);
        assert_eq!(Duration::from_secs_f64(r.duration_seconds), ms(3000));
    }

    #[tokio::test(start_paused = true)]
    async fn adaptive_keeps_envoy_for_outbound_calls_the_app_starts_after_its_release() {
        // The app calls out only once it has its SIGTERM: from 1 s after
        // its release, for 2 s.
        let mut envoy = FakeEnvoy::new(vec![]);
        envoy.inbound_at = arrivals(ms(0), ms(1000), ms(100));
        envoy.outbound_at = arrivals(ms(4900), ms(6900), ms(100));
        let (r, released) = drain_timed(&envoy, adaptive()).await;
        assert_eq!(r.outcome, DrainOutcome::Quiet);
        assert!(near(released, ms(900 + 3000)), "{released:?}");
        let took = Duration::from_secs_f64(r.duration_seconds);
        assert!(near(took, ms(6800 + 3000)), "{took:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn adaptive_never_outlives_the_deadline() {
        let mut envoy = FakeEnvoy::new(vec![]);
        envoy.inbound_at = arrivals(ms(0), ms(60_000), ms(100));
        let (r, released) = drain_timed(&envoy, adaptive()).await;
        assert!(matches!(r.outcome, DrainOutcome::DeadlineExceeded { .. }));
        assert_eq!(Duration::from_secs_f64(r.duration_seconds), ms(24_000));
        assert_eq!(
            released,
            ms(24_000),
            "the app is released by the end at the latest"
        );
        // And the report says when, as when inbound went quiet.
        assert_eq!(r.inbound_quiet_seconds, Some(24.0));
    }

    #[tokio::test(start_paused = true)]
    async fn adaptive_unreadable_counters_never_count_as_quiet() {
        let mut envoy = FakeEnvoy::new(vec![]);
        envoy.fail_counts = true;
        let (r, _) = drain_timed(&envoy, adaptive()).await;
        assert_eq!(r.outcome, DrainOutcome::DeadlineExceeded { active: None });
        assert_eq!(Duration::from_secs_f64(r.duration_seconds), ms(24_000));
    }

    /// Test double of Envoy's admin API that takes every request and never
    /// answers (a wedged main thread), or only after `delay` (`Some`), and
    /// then with a 503.
    struct HungAdmin {
        delay: Option<Duration>,
        calls: std::sync::atomic::AtomicUsize,
    }

    impl HungAdmin {
        fn never() -> Self {
            Self {
                delay: None,
                calls: Default::default(),
            }
        }
        fn slow(delay: Duration) -> Self {
            Self {
                delay: Some(delay),
                ..Self::never()
            }
        }
        async fn answer<T>(&self) -> Result<T, AdminError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            match self.delay {
                Some(d) => {
                    tokio::time::sleep(d).await;
                    Err(stats_unavailable())
                }
                None => std::future::pending().await,
            }
        }
    }

    impl DrainTarget for HungAdmin {
        async fn drain_inbound(&self) -> Result<(), AdminError> {
            self.answer().await
        }
        async fn active_connections(&self) -> Result<u64, AdminError> {
            self.answer().await
        }
        async fn traffic(&self) -> Result<Traffic, AdminError> {
            self.answer().await
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_or_slow_admin_never_holds_the_drain_into_the_stop_reserve() {
        let short = |s: DrainSettings| DrainSettings {
            drain_deadline: Duration::from_secs(2),
            ..s
        };
        let cases = [
            ("adaptive", adaptive()),
            ("exit-on-zero", settings(true)),
            ("fixed past the deadline", short(settings(false))),
            ("adaptive, 2 s deadline", short(adaptive())),
            ("exit-on-zero, 2 s deadline", short(settings(true))),
        ];
        // Slower than the call timeout, and just under it: the latter answers,
        // too late for each poll to start inside the wait.
        for admin in [
            HungAdmin::never(),
            HungAdmin::slow(ms(5_000)),
            HungAdmin::slow(ms(900)),
        ] {
            for (name, s) in cases {
                let wait = s.drain_deadline - stop_reserve(s.drain_deadline);
                let start = Instant::now();
                let (tx, _rx) = watch::channel(false);
                let r = tokio::time::timeout(
                    s.drain_deadline,
                    run(&admin, s, POLL, start, &tx, &AtomicBool::new(false)),
                )
                .await
                .unwrap_or_else(|_| {
                    panic!("{name}, {:?}: still draining at the deadline", admin.delay)
                });
                assert_eq!(start.elapsed(), wait, "{name}, {:?}", admin.delay);
                assert!(
                    matches!(r.outcome, DrainOutcome::DeadlineExceeded { .. }),
                    "{name}: {:?}",
                    r.outcome
                );
            }
            assert!(admin.calls.load(Ordering::SeqCst) > 0);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_admin_leaves_a_fixed_drain_its_duration() {
        let start = Instant::now();
        let (tx, _rx) = watch::channel(false);
        let r = run(
            &HungAdmin::never(),
            settings(false),
            POLL,
            start,
            &tx,
            &AtomicBool::new(false),
        )
        .await;
        assert_eq!(r.outcome, DrainOutcome::Elapsed);
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        assert_eq!(r.active_at_start, None);
    }

    #[tokio::test(start_paused = true)]
    async fn fixed_and_exit_on_zero_release_the_app_at_once() {
        for s in [
            settings(false),
            settings(true),
            DrainSettings {
                exit_on_zero_active_connections: true,
                ..adaptive()
            },
        ] {
            let envoy = FakeEnvoy::new(vec![]);
            let (r, released) = drain_timed(&envoy, s).await;
            assert_eq!(released, Duration::ZERO, "{s:?}");
            assert_ne!(r.outcome, DrainOutcome::Quiet, "{s:?}");
        }
    }
}
