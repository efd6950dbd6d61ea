//! The supervisor's phases, and the one function that moves between them.
//!
//! [`Machine::next`] decides what an [`Event`] does in the current [`Phase`]:
//! it starts no process, sends nothing and reads no clock (time comes in as
//! `now`; it only logs its decisions), so every transition is tested on its
//! own; the supervisor's loop only waits for events and performs the
//! [`Action`]s it returns.

use std::future::pending;
use std::process::ExitStatus;
use std::time::Duration;

use tokio::time::Instant;

use super::restart_budget::RestartBudget;
use super::{DrainOrigin, ExitReason};
use crate::drain::DrainReport;
use crate::envoy::process::KILL_WAIT;

/// SIGTERM's grace when a second signal aborts a drain.
pub(super) const ABORT_STOP_GRACE: Duration = Duration::from_millis(500);

/// Where the agent is in Envoy's life.
#[derive(Debug, Clone)]
pub(super) enum Phase {
    /// Envoy runs, or is starting: a crash restarts it within the budget, a
    /// changed input hot restarts it, a signal or a drain request drains it.
    Running,
    /// Envoy exited abnormally and is started afresh `at` that time. There is
    /// nothing to drain: a signal ends the agent at once.
    Backoff { at: Instant },
    /// A drain is under way. No hot restart (it would bring the listeners
    /// back); Envoy exiting now ends the agent.
    Draining(Drain),
    /// The drain has ended; Envoy runs on, its inbound listeners drained,
    /// until a signal or `/quitquitquit` stops it, or an app hook's drain is
    /// undone.
    Drained { drain: Drain, report: DrainReport },
}

/// One drain, from its start until the agent exits or the drain is undone.
#[derive(Debug, Clone)]
pub(super) struct Drain {
    pub started: Instant,
    /// The drain deadline it started with; Envoy is gone by `started` plus this.
    pub deadline: Duration,
    /// A signal came: Envoy stops when the drain ends, and a second signal
    /// aborts it.
    pub stop_after: bool,
    /// Only an app hook asked for it: it is undone then, unless a signal or
    /// the sidecar's own preStop comes first (see [`hook_undo_after`]).
    pub undo_at: Option<Instant>,
    /// It was asked for while Envoy was down between crash restarts: Envoy is
    /// still started afresh then.
    pub restart_at: Option<Instant>,
}

/// What happened, as the loop tells [`Machine::next`].
#[derive(Debug)]
pub(super) enum Event {
    /// The current Envoy exited; `successor`: a new epoch that is starting
    /// still runs, and takes its place.
    Exited { status: ExitStatus, successor: bool },
    /// The crash restart's backoff is over.
    RestartDue,
    /// SIGTERM or SIGINT. `drain_deadline`: what a drain starting now gets.
    /// `apps_exited`: the sidecar is a native one, which the kubelet signals
    /// only once every app container has exited (or before any started: a
    /// failed startup probe), so a drain would wait for no one.
    Signal {
        drain_deadline: Duration,
        apps_exited: bool,
    },
    /// A drain is asked for (`POST /drain`).
    Drain {
        origin: DrainOrigin,
        drain_deadline: Duration,
    },
    /// `/quitquitquit`.
    Quit,
    /// The bootstrap's inputs changed.
    HotRestart { reason: String },
    /// The drain under way has ended.
    DrainDone(DrainReport),
    /// The new epoch has taken over. `deferred`: a hot restart asked for
    /// while it was starting.
    CandidateUp { deferred: Option<String> },
    /// The new epoch exited, or did not take over in time.
    CandidateFailed {
        error: String,
        deferred: Option<String>,
    },
    /// An app hook's drain was followed by no signal within the grace period.
    UndoDue,
}

/// What the loop is to do, in order; [`Action::Exit`] ends the run.
#[derive(Debug)]
pub(super) enum Action {
    /// The new epoch becomes current. `taken_over`: it said so; otherwise
    /// its parent exited while it was starting.
    Promote {
        taken_over: bool,
    },
    /// The new epoch is given up; the running one stays.
    DropCandidate {
        error: String,
    },
    /// Start a new epoch beside the running one.
    HotRestart {
        trigger: String,
    },
    /// Envoy crashed: not ready until it is started afresh after `delay`.
    AwaitRestart {
        status: ExitStatus,
        delay: Duration,
        failures: usize,
    },
    /// Start Envoy afresh (epoch 0); the run ends if it cannot start.
    StartFresh,
    /// Fail readiness and drain Envoy, counting from `started`.
    StartDrain {
        started: Instant,
    },
    /// An app hook waits for the app's release.
    NoteAppWaits,
    /// Publish a finished drain.
    RecordDrain(DrainReport),
    /// A second signal cut the drain short `elapsed` after it began: let the
    /// app go and record an aborted drain.
    AbortDrain {
        elapsed: Duration,
    },
    /// Drop the drain and bring Envoy's listeners back.
    UndoDrain,
    /// Stop every Envoy: SIGTERM, SIGKILL after `grace`.
    Stop {
        grace: Duration,
    },
    Exit(ExitReason),
}

/// How long after an app hook's drain started it is undone if no SIGTERM
/// (nor an admin drain) came: the grace period the drain deadline was derived
/// from. A pod that really terminates has been killed by then; so an agent
/// still running then was drained by a hook outside a termination.
pub fn hook_undo_after(deadline: Duration) -> Duration {
    remora_contract::pod::grace_of_deadline(deadline).max(Duration::from_millis(100))
}

/// SIGTERM's grace: at most `configured`, and no later than the deadline
/// less [`KILL_WAIT`], so that Envoy is gone by the deadline even when it
/// ignores SIGTERM. Zero when the deadline has passed: SIGKILL at once.
pub(super) fn stop_grace(configured: Duration, elapsed: Duration, deadline: Duration) -> Duration {
    configured.min(deadline.saturating_sub(elapsed).saturating_sub(KILL_WAIT))
}

/// SIGTERM's grace when Envoy stops after `drain`, at `now`.
fn grace_after(configured: Duration, drain: &Drain, now: Instant) -> Duration {
    stop_grace(
        configured,
        now.saturating_duration_since(drain.started),
        drain.deadline,
    )
}

/// Stop every Envoy, then end the run with `reason`.
fn stop(reason: ExitReason, grace: Duration) -> Vec<Action> {
    vec![Action::Stop { grace }, Action::Exit(reason)]
}

/// The phase, and what its transitions need besides the event.
#[derive(Debug)]
pub(super) struct Machine {
    phase: Phase,
    budget: RestartBudget,
    /// `--envoy-stop-grace`: SIGTERM's grace when no drain bounds it.
    stop_grace: Duration,
}

impl Machine {
    /// Envoy has just been started.
    pub fn new(budget: RestartBudget, stop_grace: Duration) -> Self {
        Self {
            phase: Phase::Running,
            budget,
            stop_grace,
        }
    }

    #[cfg(test)]
    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// The timed event due next, if any, and when.
    pub fn next_timer(&self) -> Option<(Instant, Event)> {
        let (restart, undo) = match &self.phase {
            Phase::Running => (None, None),
            Phase::Backoff { at } => (Some(*at), None),
            Phase::Draining(d) | Phase::Drained { drain: d, .. } => (d.restart_at, d.undo_at),
        };
        match (restart, undo) {
            (Some(r), Some(u)) if u < r => Some((u, Event::UndoDue)),
            (Some(r), _) => Some((r, Event::RestartDue)),
            (None, Some(u)) => Some((u, Event::UndoDue)),
            (None, None) => None,
        }
    }

    /// Resolves with the timed event when it is due; never when none is.
    pub async fn timer(&self) -> Event {
        match self.next_timer() {
            Some((at, event)) => {
                tokio::time::sleep_until(at).await;
                event
            }
            None => pending().await,
        }
    }

    fn draining(&self) -> bool {
        matches!(self.phase, Phase::Draining(_) | Phase::Drained { .. })
    }

    /// The hot restart asked for while a candidate started: taken unless a
    /// drain has begun since.
    fn deferred(&self, deferred: Option<String>) -> Option<Action> {
        deferred
            .filter(|_| !self.draining())
            .map(|trigger| Action::HotRestart { trigger })
    }

    /// The transition: what `event` does at `now`. The phase changes in
    /// place; the actions are for the loop to perform, in order.
    pub fn next(&mut self, event: Event, now: Instant) -> Vec<Action> {
        match event {
            Event::CandidateUp { deferred } => {
                let mut actions = vec![Action::Promote { taken_over: true }];
                actions.extend(self.deferred(deferred));
                actions
            }
            Event::CandidateFailed { error, deferred } => {
                let mut actions = vec![Action::DropCandidate { error }];
                actions.extend(self.deferred(deferred));
                actions
            }
            Event::Exited {
                status,
                successor: true,
            } => {
                tracing::warn!(%status, "the running Envoy exited while a new epoch was starting; \
                    the new epoch takes its place");
                vec![Action::Promote { taken_over: false }]
            }
            Event::Exited { status, .. } => self.exited(status, now),
            Event::RestartDue => self.restart_due(),
            Event::Quit => {
                tracing::info!("quitquitquit: stopping Envoy");
                stop(ExitReason::Quit, self.stop_grace)
            }
            Event::HotRestart { reason } => {
                if self.draining() {
                    tracing::info!(reason, "draining: no hot restart");
                    Vec::new()
                } else {
                    vec![Action::HotRestart { trigger: reason }]
                }
            }
            Event::Signal {
                drain_deadline,
                apps_exited,
            } => self.signal(drain_deadline, apps_exited, now),
            Event::Drain {
                origin,
                drain_deadline,
            } => self.drain_asked(origin, drain_deadline, now),
            Event::UndoDue => self.undo(),
            Event::DrainDone(report) => self.drain_done(report, now),
        }
    }

    fn exited(&mut self, status: ExitStatus, now: Instant) -> Vec<Action> {
        if self.draining() || status.success() {
            tracing::info!(%status, "Envoy exited");
            return stop(ExitReason::EnvoyExited(status), self.stop_grace);
        }
        let delay = self.budget.on_failure(now);
        let failures = self.budget.failures();
        match delay {
            Some(delay) => {
                self.phase = Phase::Backoff { at: now + delay };
                vec![Action::AwaitRestart {
                    status,
                    delay,
                    failures,
                }]
            }
            None => {
                tracing::error!(%status, failures, window = ?self.budget.window(),
                    "Envoy keeps failing; giving up so the kubelet takes over");
                stop(
                    ExitReason::RestartBudgetExhausted { failures },
                    self.stop_grace,
                )
            }
        }
    }

    fn restart_due(&mut self) -> Vec<Action> {
        match &mut self.phase {
            Phase::Backoff { .. } => self.phase = Phase::Running,
            Phase::Draining(d) | Phase::Drained { drain: d, .. } if d.restart_at.is_some() => {
                d.restart_at = None;
            }
            _ => return Vec::new(),
        }
        vec![Action::StartFresh]
    }

    fn signal(&mut self, drain_deadline: Duration, apps_exited: bool, now: Instant) -> Vec<Action> {
        let configured = self.stop_grace;
        match &mut self.phase {
            Phase::Draining(d) if d.stop_after => {
                tracing::warn!("second signal: aborting the drain");
                let elapsed = now.saturating_duration_since(d.started);
                let mut actions = vec![Action::AbortDrain { elapsed }];
                actions.extend(stop(ExitReason::Aborted, ABORT_STOP_GRACE));
                actions
            }
            // preStop already drained: stop now.
            Phase::Drained { drain, report } => {
                let grace = grace_after(configured, drain, now);
                let reason = ExitReason::Drained(report.clone());
                stop(reason, grace)
            }
            // Envoy is down between crash restarts: nothing to drain.
            Phase::Backoff { .. } => vec![Action::Exit(ExitReason::Quit)],
            Phase::Draining(d) if d.restart_at.is_some() => vec![Action::Exit(ExitReason::Quit)],
            // The pod is terminating: the drain ends in a stop, never undone.
            Phase::Draining(d) => {
                d.stop_after = true;
                d.undo_at = None;
                Vec::new()
            }
            // Nothing of the app is left to serve or to call out: a Native
            // Job's pod ends here, not one drain (a quiet period) later.
            Phase::Running if apps_exited => {
                tracing::info!(
                    "signal to a native sidecar: the kubelet sends it only once the app containers \
                     have exited, so there is nothing to drain for; stopping Envoy"
                );
                stop(ExitReason::AppsExited, configured)
            }
            Phase::Running => {
                self.phase = Phase::Draining(Drain {
                    started: now,
                    deadline: drain_deadline,
                    stop_after: true,
                    undo_at: None,
                    restart_at: None,
                });
                vec![Action::StartDrain { started: now }]
            }
        }
    }

    fn drain_asked(
        &mut self,
        origin: DrainOrigin,
        drain_deadline: Duration,
        now: Instant,
    ) -> Vec<Action> {
        let mut actions = Vec::new();
        if origin == DrainOrigin::AppHook {
            actions.push(Action::NoteAppWaits);
        }
        let restart_at = match &mut self.phase {
            Phase::Running => None,
            Phase::Backoff { at } => Some(*at),
            Phase::Draining(d) | Phase::Drained { drain: d, .. } => {
                if origin == DrainOrigin::Admin {
                    // The sidecar's own preStop: the pod is terminating.
                    d.undo_at = None;
                }
                return actions;
            }
        };
        self.phase = Phase::Draining(Drain {
            started: now,
            deadline: drain_deadline,
            stop_after: false,
            undo_at: (origin == DrainOrigin::AppHook)
                .then(|| now + hook_undo_after(drain_deadline)),
            restart_at,
        });
        actions.push(Action::StartDrain { started: now });
        actions
    }

    fn undo(&mut self) -> Vec<Action> {
        let (Phase::Draining(d) | Phase::Drained { drain: d, .. }) = &self.phase else {
            return Vec::new();
        };
        if d.undo_at.is_none() {
            return Vec::new();
        }
        tracing::warn!(
            "the drain the app hook started was followed by no SIGTERM within the grace period: \
             the pod is not terminating; undoing it (ready again, Envoy's listeners back through \
             a hot restart)"
        );
        let restart_at = d.restart_at;
        self.phase = match restart_at {
            Some(at) => Phase::Backoff { at },
            None => Phase::Running,
        };
        vec![Action::UndoDrain]
    }

    fn drain_done(&mut self, report: DrainReport, now: Instant) -> Vec<Action> {
        let Phase::Draining(d) = &self.phase else {
            return Vec::new();
        };
        let mut actions = vec![Action::RecordDrain(report.clone())];
        if d.stop_after {
            let grace = grace_after(self.stop_grace, d, now);
            actions.extend(stop(ExitReason::Drained(report), grace));
        } else {
            let drain = d.clone();
            self.phase = Phase::Drained { drain, report };
        }
        actions
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;
    use crate::drain::DrainOutcome;
    use crate::lifecycle::DrainSettings;

    const STOP_GRACE: Duration = Duration::from_secs(5);
    const DEADLINE: Duration = Duration::from_secs(25);

    fn machine() -> Machine {
        Machine::new(
            RestartBudget::new(2, Duration::from_secs(60), Duration::from_millis(200)),
            STOP_GRACE,
        )
    }

    fn signal() -> Event {
        Event::Signal {
            drain_deadline: DEADLINE,
            apps_exited: false,
        }
    }

    /// A native sidecar's signal: the app containers have exited.
    fn signal_after_the_apps() -> Event {
        Event::Signal {
            drain_deadline: DEADLINE,
            apps_exited: true,
        }
    }

    fn drain(origin: DrainOrigin) -> Event {
        Event::Drain {
            origin,
            drain_deadline: DEADLINE,
        }
    }

    fn crash() -> Event {
        Event::Exited {
            status: ExitStatus::from_raw(9),
            successor: false,
        }
    }

    fn report() -> DrainReport {
        DrainReport {
            outcome: DrainOutcome::Quiet,
            active_at_start: Some(0),
            duration_seconds: 1.0,
            inbound_quiet_seconds: None,
            withdrawal: None,
            settings: DrainSettings::from_config(
                &crate::config::tests::run(&[], &[]).expect("config"),
            ),
        }
    }

    /// Whether the timed event comes within `within` of paused time.
    async fn fires(m: &Machine, within: Duration) -> Option<Event> {
        tokio::time::timeout(within, m.timer()).await.ok()
    }

    #[test]
    fn stop_grace_leaves_time_to_kill_before_the_deadline() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        // After a drain that used its whole wait: the 1 s reserve less the kill wait.
        assert_eq!(stop_grace(s(5), s(24), s(25)), ms(950));
        assert_eq!(stop_grace(ms(300), s(24), s(25)), ms(300));
        // Past the deadline: SIGKILL at once, never a floor.
        assert_eq!(stop_grace(s(5), s(26), s(25)), Duration::ZERO);
        assert_eq!(
            stop_grace(s(5), Duration::ZERO, Duration::ZERO),
            Duration::ZERO
        );
    }

    #[test]
    fn a_signal_drains_then_stops_within_the_deadline() {
        let mut m = machine();
        let t0 = Instant::now();
        let a = m.next(signal(), t0);
        assert!(matches!(a[..], [Action::StartDrain { started }] if started == t0));
        assert!(matches!(m.phase(), Phase::Draining(d) if d.stop_after && d.undo_at.is_none()));
        // Hot restarts wait out the drain.
        let a = m.next(
            Event::HotRestart {
                reason: "input".into(),
            },
            t0,
        );
        assert!(a.is_empty());
        // The drain ends 24 s in: 1 s of the deadline is left, less the kill wait.
        let a = m.next(Event::DrainDone(report()), t0 + Duration::from_secs(24));
        assert!(
            matches!(
                &a[..],
                [
                    Action::RecordDrain(_),
                    Action::Stop { grace },
                    Action::Exit(ExitReason::Drained(_)),
                ] if *grace == DEADLINE - Duration::from_secs(24) - KILL_WAIT
            ),
            "{a:?}"
        );
    }

    #[test]
    fn a_second_signal_aborts_the_drain() {
        let mut m = machine();
        let t0 = Instant::now();
        m.next(signal(), t0);
        let a = m.next(signal(), t0 + Duration::from_secs(3));
        assert!(
            matches!(
                &a[..],
                [
                    Action::AbortDrain { elapsed },
                    Action::Stop { grace: ABORT_STOP_GRACE },
                    Action::Exit(ExitReason::Aborted),
                ] if *elapsed == Duration::from_secs(3)
            ),
            "{a:?}"
        );
    }

    #[test]
    fn a_native_sidecars_signal_stops_envoy_without_a_drain() {
        let mut m = machine();
        let t0 = Instant::now();
        let a = m.next(signal_after_the_apps(), t0);
        assert!(
            matches!(
                &a[..],
                [
                    Action::Stop { grace: STOP_GRACE },
                    Action::Exit(ExitReason::AppsExited)
                ]
            ),
            "{a:?}"
        );
        // A Legacy sidecar's (or one whose mode is unknown) drains as before.
        let mut m = machine();
        assert!(matches!(
            m.next(signal(), t0)[..],
            [Action::StartDrain { .. }]
        ));
    }

    #[test]
    fn a_native_sidecars_signal_during_an_app_hooks_drain_lets_the_drain_end() {
        // The app's preStop drain runs while the app does: the sidecar's
        // signal after it is the end of that drain, as for Legacy.
        let mut m = machine();
        let t0 = Instant::now();
        m.next(drain(DrainOrigin::AppHook), t0);
        assert!(matches!(m.phase(), Phase::Draining(_)));
        assert!(m.next(signal_after_the_apps(), t0).is_empty());
        assert!(matches!(m.phase(), Phase::Draining(d) if d.stop_after && d.undo_at.is_none()));
    }

    #[test]
    fn after_a_prestop_drain_a_signal_stops_at_once() {
        let mut m = machine();
        let t0 = Instant::now();
        let a = m.next(drain(DrainOrigin::Admin), t0);
        assert!(matches!(a[..], [Action::StartDrain { .. }]));
        assert!(matches!(m.phase(), Phase::Draining(d) if !d.stop_after && d.undo_at.is_none()));
        let a = m.next(Event::DrainDone(report()), t0 + Duration::from_secs(2));
        assert!(matches!(a[..], [Action::RecordDrain(_)]));
        assert!(matches!(m.phase(), Phase::Drained { .. }));
        // A second preStop is no second drain.
        assert!(m.next(drain(DrainOrigin::Admin), t0).is_empty());
        let a = m.next(signal(), t0 + Duration::from_secs(10));
        assert!(
            matches!(
                &a[..],
                [
                    Action::Stop { grace: STOP_GRACE },
                    Action::Exit(ExitReason::Drained(_))
                ]
            ),
            "{a:?}"
        );
    }

    #[test]
    fn a_signal_during_a_drain_makes_it_end_in_a_stop() {
        let mut m = machine();
        let t0 = Instant::now();
        m.next(drain(DrainOrigin::AppHook), t0);
        assert!(m.next(signal(), t0).is_empty(), "no second drain");
        assert!(matches!(m.phase(), Phase::Draining(d) if d.stop_after && d.undo_at.is_none()));
        let a = m.next(Event::DrainDone(report()), t0 + Duration::from_secs(1));
        assert!(matches!(
            a.last(),
            Some(Action::Exit(ExitReason::Drained(_)))
        ));
    }

    #[test]
    fn envoy_exiting_during_a_drain_or_cleanly_ends_the_agent() {
        let zero = Event::Exited {
            status: ExitStatus::from_raw(0),
            successor: false,
        };
        let a = machine().next(zero, Instant::now());
        assert!(
            matches!(
                &a[..],
                [Action::Stop { grace: STOP_GRACE }, Action::Exit(ExitReason::EnvoyExited(s))] if s.success()
            ),
            "{a:?}"
        );
        for first in [signal(), drain(DrainOrigin::Admin)] {
            let mut m = machine();
            m.next(first, Instant::now());
            let a = m.next(crash(), Instant::now());
            assert!(
                matches!(a.last(), Some(Action::Exit(ExitReason::EnvoyExited(_)))),
                "{a:?}"
            );
        }
    }

    #[test]
    fn the_parent_exiting_hands_over_to_the_new_epoch_in_any_phase() {
        let mut m = machine();
        m.next(drain(DrainOrigin::Admin), Instant::now());
        let a = m.next(
            Event::Exited {
                status: ExitStatus::from_raw(9),
                successor: true,
            },
            Instant::now(),
        );
        assert!(matches!(a[..], [Action::Promote { taken_over: false }]));
        assert!(matches!(m.phase(), Phase::Draining(_)));
    }

    #[test]
    fn a_deferred_hot_restart_follows_the_candidate_unless_draining() {
        let mut m = machine();
        let a = m.next(
            Event::CandidateUp {
                deferred: Some("input".into()),
            },
            Instant::now(),
        );
        assert!(matches!(
            &a[..],
            [Action::Promote { taken_over: true }, Action::HotRestart { trigger }] if trigger == "input"
        ));
        m.next(drain(DrainOrigin::Admin), Instant::now());
        let a = m.next(
            Event::CandidateFailed {
                error: "exited".into(),
                deferred: Some("input".into()),
            },
            Instant::now(),
        );
        assert!(matches!(&a[..], [Action::DropCandidate { error }] if error == "exited"));
    }

    #[test]
    fn quit_stops_in_every_phase() {
        let mut m = machine();
        m.next(drain(DrainOrigin::AppHook), Instant::now());
        let a = m.next(Event::Quit, Instant::now());
        assert!(matches!(
            a[..],
            [
                Action::Stop { grace: STOP_GRACE },
                Action::Exit(ExitReason::Quit)
            ]
        ));
    }

    /// A crash waits out the backoff on paused time, then starts Envoy
    /// afresh; past the budget the agent gives up.
    #[tokio::test(start_paused = true)]
    async fn a_crash_restarts_after_the_backoff_until_the_budget_is_spent() {
        let mut m = machine();
        assert!(fires(&m, Duration::from_secs(3600)).await.is_none());
        let a = m.next(crash(), Instant::now());
        assert!(
            matches!(&a[..], [Action::AwaitRestart { delay, failures: 1, .. }] if *delay == Duration::from_millis(200)),
            "{a:?}"
        );
        assert!(fires(&m, Duration::from_millis(199)).await.is_none());
        let due = fires(&m, Duration::from_millis(2)).await.expect("due");
        assert!(matches!(due, Event::RestartDue));
        assert!(matches!(
            m.next(due, Instant::now())[..],
            [Action::StartFresh]
        ));
        assert!(matches!(m.phase(), Phase::Running));

        // The second failure in the window doubles the wait.
        let a = m.next(crash(), Instant::now());
        assert!(
            matches!(&a[..], [Action::AwaitRestart { delay, failures: 2, .. }] if *delay == Duration::from_millis(400))
        );
        // Envoy is down: a signal has nothing to drain.
        let mut down = Machine::new(
            RestartBudget::new(2, Duration::from_secs(60), Duration::from_millis(200)),
            STOP_GRACE,
        );
        down.next(crash(), Instant::now());
        assert!(matches!(
            down.next(signal(), Instant::now())[..],
            [Action::Exit(ExitReason::Quit)]
        ));

        let due = fires(&m, Duration::from_secs(1)).await.expect("due");
        m.next(due, Instant::now());
        let a = m.next(crash(), Instant::now());
        assert!(
            matches!(
                a[..],
                [
                    Action::Stop { .. },
                    Action::Exit(ExitReason::RestartBudgetExhausted { failures: 3 }),
                ]
            ),
            "{a:?}"
        );
    }

    /// A drain asked for between crash restarts keeps the restart: Envoy is
    /// started afresh at the end of the backoff all the same.
    #[tokio::test(start_paused = true)]
    async fn a_drain_during_the_backoff_keeps_the_restart() {
        let mut m = machine();
        m.next(crash(), Instant::now());
        let a = m.next(drain(DrainOrigin::Admin), Instant::now());
        assert!(matches!(a[..], [Action::StartDrain { .. }]));
        let due = fires(&m, Duration::from_secs(1)).await.expect("due");
        assert!(matches!(due, Event::RestartDue));
        assert!(matches!(
            m.next(due, Instant::now())[..],
            [Action::StartFresh]
        ));
        assert!(matches!(m.phase(), Phase::Draining(d) if d.restart_at.is_none()));
        assert!(fires(&m, Duration::from_secs(3600)).await.is_none());
    }

    /// An app hook's drain alone is undone after the grace period, on paused
    /// time; a signal or the sidecar's own preStop makes it a termination.
    #[tokio::test(start_paused = true)]
    async fn an_app_hook_drain_alone_is_undone_after_the_grace_period() {
        // The grace period the operator derived a 25 s deadline from.
        assert_eq!(hook_undo_after(DEADLINE), Duration::from_secs(30));

        let mut m = machine();
        let a = m.next(drain(DrainOrigin::AppHook), Instant::now());
        assert!(matches!(
            a[..],
            [Action::NoteAppWaits, Action::StartDrain { .. }]
        ));
        assert!(fires(&m, Duration::from_secs(29)).await.is_none());
        // Still undone after the drain has ended.
        m.next(Event::DrainDone(report()), Instant::now());
        let due = fires(&m, Duration::from_secs(2))
            .await
            .expect("due at 30 s");
        assert!(matches!(due, Event::UndoDue));
        assert!(matches!(
            m.next(due, Instant::now())[..],
            [Action::UndoDrain]
        ));
        assert!(matches!(m.phase(), Phase::Running));
        assert!(fires(&m, Duration::from_secs(3600)).await.is_none());

        // SIGTERM in time: the pod terminates, nothing is undone.
        m.next(drain(DrainOrigin::AppHook), Instant::now());
        tokio::time::advance(Duration::from_secs(20)).await;
        m.next(signal(), Instant::now());
        assert!(fires(&m, Duration::from_secs(3600)).await.is_none());

        // The sidecar's own preStop joins the hook's drain: terminating too.
        let mut m = machine();
        m.next(drain(DrainOrigin::AppHook), Instant::now());
        assert!(matches!(
            m.next(drain(DrainOrigin::AppHook), Instant::now())[..],
            [Action::NoteAppWaits]
        ));
        assert!(m.next(drain(DrainOrigin::Admin), Instant::now()).is_empty());
        assert!(fires(&m, Duration::from_secs(3600)).await.is_none());

        // A drain the sidecar's own preStop started is never undone.
        let mut m = machine();
        m.next(drain(DrainOrigin::Admin), Instant::now());
        m.next(drain(DrainOrigin::AppHook), Instant::now());
        assert!(fires(&m, Duration::from_secs(3600)).await.is_none());
    }
}
