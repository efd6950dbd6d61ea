//! Waiting until one Envoy is up, by polling its admin API.
//!
//! The schedule starts fast (Envoy is usually LIVE about 60 ms after exec, and
//! the pod's startup waits on it), then backs off while nothing changes: an
//! Envoy waiting for a control plane that is down is asked once a second, not
//! hundreds of times. Progress (an answer at last, LIVE, the first xDS
//! update) starts the schedule over, so the next step is seen quickly. Once
//! Envoy is what was wanted, polling stops.

use std::future::Future;
use std::time::Duration;

use backon::{BackoffBuilder, ConstantBuilder, ExponentialBuilder};

use super::admin::{AdminError, EnvoyAdmin, ServerState, ServerStatus};

/// The first polls come this often...
pub const FAST_POLL: Duration = Duration::from_millis(2);
/// ...this many times (about 100 ms)...
pub const FAST_POLLS: usize = 50;
/// ...then the pause doubles up to this.
pub const MAX_POLL: Duration = Duration::from_secs(1);

/// Where Envoy's status comes from (its admin API; a test double in tests).
pub trait StatusSource {
    fn server_status(&self) -> impl Future<Output = Result<ServerStatus, AdminError>> + Send;
}

impl StatusSource for EnvoyAdmin {
    async fn server_status(&self) -> Result<ServerStatus, AdminError> {
        EnvoyAdmin::server_status(self).await
    }
}

/// The pauses between polls, from the start or from the last progress.
pub fn poll_schedule() -> impl Iterator<Item = Duration> + Send {
    ConstantBuilder::default()
        .with_delay(FAST_POLL)
        .with_max_times(FAST_POLLS)
        .build()
        .chain(
            ExponentialBuilder::default()
                .with_min_delay(FAST_POLL.saturating_mul(2))
                .with_max_delay(MAX_POLL)
                .with_factor(2.0)
                .without_max_times()
                .build(),
        )
}

/// What "up" means for one Envoy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Wanted {
    /// xDS mode: the first LDS and CDS must have come from this server.
    pub xds: Option<String>,
    /// A new hot-restart epoch: the answer must come from it, not its parent.
    pub epoch: Option<u32>,
}

impl Wanted {
    /// How far Envoy has come (comparable: more is further), and why it is not
    /// there yet (`None`: it is).
    fn observe(&self, status: &Result<ServerStatus, AdminError>) -> (Progress, Option<String>) {
        let st = match status {
            Ok(st) => st,
            Err(e) => {
                return (
                    Progress::default(),
                    Some(format!("Envoy admin does not answer yet: {e}")),
                );
            }
        };
        if let Some(want) = self.epoch
            && st.hot_restart_epoch != Some(want)
        {
            return (
                Progress::default(),
                Some(format!(
                    "the admin API answers for epoch {}, not yet for the new epoch {want}",
                    st.hot_restart_epoch
                        .map_or_else(|| "unknown".to_string(), |e| e.to_string())
                )),
            );
        }
        let step = |stage| Progress {
            stage,
            ..Progress::default()
        };
        match st.state {
            ServerState::Live if !st.workers_started => (
                step(3),
                Some("Envoy's workers have not started".to_string()),
            ),
            ServerState::Live => match &self.xds {
                Some(addr) if st.lds_updates == 0 || st.cds_updates == 0 => (
                    Progress {
                        stage: 4,
                        lds: st.lds_updates,
                        cds: st.cds_updates,
                    },
                    Some(format!(
                        "waiting for the first LDS and CDS from {addr} \
                         (LDS updates: {}, CDS updates: {})",
                        st.lds_updates, st.cds_updates
                    )),
                ),
                _ => (step(5), None),
            },
            other => {
                let stage = if other == ServerState::Initializing {
                    2
                } else {
                    1
                };
                (
                    step(stage),
                    Some(format!("Envoy is not LIVE yet (state {other:?})")),
                )
            }
        }
    }
}

/// Progress towards ready, compared field by field: the stage (no answer,
/// answering, initializing, LIVE, workers started), then the xDS updates.
/// Only a step forward resets the schedule, so an Envoy that flaps between
/// two states is not polled fast forever.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
struct Progress {
    stage: u8,
    lds: u64,
    cds: u64,
}

/// Poll until Envoy is as `wanted`; after each poll that finds it is not,
/// `pending` hears why.
pub async fn wait_until_ready<S: StatusSource>(
    source: &S,
    wanted: &Wanted,
    mut pending: impl FnMut(String),
) {
    let mut schedule = poll_schedule();
    let mut best: Option<Progress> = None;
    loop {
        let status = source.server_status().await;
        let (progress, reason) = wanted.observe(&status);
        let Some(reason) = reason else { return };
        if best.is_some_and(|b| progress > b) {
            schedule = poll_schedule();
        }
        best = Some(best.map_or(progress, |b| b.max(progress)));
        pending(reason);
        // The schedule never ends; the cap is its last value anyway.
        tokio::time::sleep(schedule.next().unwrap_or(MAX_POLL)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use tokio::time::Instant;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn live(epoch: u32, lds: u64, cds: u64) -> ServerStatus {
        ServerStatus {
            state: ServerState::Live,
            workers_started: true,
            lds_updates: lds,
            cds_updates: cds,
            hot_restart_epoch: Some(epoch),
        }
    }

    fn initializing() -> ServerStatus {
        ServerStatus {
            state: ServerState::Initializing,
            workers_started: false,
            ..live(0, 0, 0)
        }
    }

    /// Test double of Envoy's admin API: from each instant on (since its
    /// creation) it answers the given status, or does not answer (`None`);
    /// it records when it was asked.
    struct ScriptedAdmin {
        start: Instant,
        script: Vec<(Duration, Option<ServerStatus>)>,
        asked: Mutex<Vec<Duration>>,
    }

    impl ScriptedAdmin {
        fn new(script: Vec<(Duration, Option<ServerStatus>)>) -> Self {
            Self {
                start: Instant::now(),
                script,
                asked: Mutex::new(Vec::new()),
            }
        }

        fn asked(&self) -> Vec<Duration> {
            self.asked.lock().expect("lock").clone()
        }

        fn polls_between(&self, from: Duration, to: Duration) -> usize {
            self.asked()
                .iter()
                .filter(|t| **t >= from && **t < to)
                .count()
        }
    }

    impl StatusSource for ScriptedAdmin {
        async fn server_status(&self) -> Result<ServerStatus, AdminError> {
            let now = self.start.elapsed();
            self.asked.lock().expect("lock").push(now);
            let current = self
                .script
                .iter()
                .rev()
                .find(|(from, _)| *from <= now)
                .and_then(|(_, s)| *s);
            current.ok_or_else(|| AdminError::Status {
                path: "/stats".into(),
                status: 503,
                body: "no answer".into(),
            })
        }
    }

    #[test]
    fn schedule_starts_fast_then_doubles_to_one_second() {
        // Whole milliseconds: the factor is a float, off by nanoseconds.
        let pauses: Vec<u128> = poll_schedule()
            .take(FAST_POLLS + 12)
            .map(|p| p.as_millis())
            .collect();
        assert!(pauses[..FAST_POLLS].iter().all(|p| *p == 2));
        assert_eq!(
            pauses[FAST_POLLS..],
            [4, 8, 16, 32, 64, 128, 256, 512, 1000, 1000, 1000, 1000]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_envoy_that_never_answers_is_asked_ever_less_often() {
        let admin = ScriptedAdmin::new(vec![(Duration::ZERO, None)]);
        let mut reasons = Vec::new();
        let waited = tokio::time::timeout(
            Duration::from_secs(60),
            wait_until_ready(&admin, &Wanted::default(), |r| reasons.push(r)),
        )
        .await;
        assert!(waited.is_err(), "never ready");
        let asked = admin.asked();
        println!("an Envoy that never answers: {} polls in 60 s", asked.len());
        // 50 fast polls, 9 while backing off (about 1.1 s), then one a second:
        // about 118 in a minute, where a fixed 2 ms pause asks 30,000 times.
        assert!(asked.len() <= 120, "{} polls in 60 s", asked.len());
        let gaps: Vec<Duration> = asked.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.iter().all(|g| *g <= MAX_POLL), "capped: {gaps:?}");
        assert!(gaps.iter().rev().take(50).all(|g| *g == MAX_POLL));
        assert!(reasons.iter().all(|r| r.contains("does not answer")));
    }

    #[tokio::test(start_paused = true)]
    async fn live_envoy_waiting_for_xds_is_asked_once_a_second_until_it_is_configured() {
        let admin = ScriptedAdmin::new(vec![
            (Duration::ZERO, None),
            (ms(40), Some(initializing())),
            (ms(80), Some(live(0, 0, 0))),
            (ms(30_000), Some(live(0, 1, 0))),
            (ms(30_500), Some(live(0, 1, 1))),
        ]);
        let wanted = Wanted {
            xds: Some("xds.example:15010".into()),
            epoch: None,
        };
        let mut last_reason = String::new();
        wait_until_ready(&admin, &wanted, |r| last_reason = r).await;
        let asked = admin.asked();
        let ready_at = *asked.last().expect("asked");
        // Each step is seen within one longest pause.
        assert!(
            ready_at >= ms(30_500) && ready_at <= ms(30_500) + MAX_POLL,
            "{ready_at:?}"
        );
        assert!(last_reason.contains("LDS updates: 1, CDS updates: 0"));
        // While stuck between 10 s and 29 s: one poll a second.
        let stuck = admin.polls_between(ms(10_000), ms(29_000));
        assert!((18..=20).contains(&stuck), "{stuck} polls");
    }

    #[tokio::test(start_paused = true)]
    async fn progress_makes_polling_fast_again() {
        let admin = ScriptedAdmin::new(vec![
            (Duration::ZERO, None),
            (ms(20_000), Some(initializing())),
            (ms(25_000), Some(live(0, 0, 0))),
        ]);
        wait_until_ready(&admin, &Wanted::default(), |_| {}).await;
        let asked = admin.asked();
        let first_init = *asked
            .iter()
            .find(|t| **t >= ms(20_000))
            .expect("asked after 20 s");
        assert!(first_init <= ms(21_000), "{first_init:?}");
        let burst = admin.polls_between(first_init, first_init + ms(150));
        assert!(burst >= FAST_POLLS, "{burst} polls just after progress");
        let ready_at = *asked.last().expect("asked");
        assert!(ready_at >= ms(25_000) && ready_at <= ms(26_000));
    }

    #[tokio::test(start_paused = true)]
    async fn flapping_is_no_progress() {
        // Answers and stops answering in turn: only the first answer is progress.
        let script = (0..120u64)
            .map(|i| (ms(i * 500), (i % 2 == 1).then(initializing)))
            .collect();
        let admin = ScriptedAdmin::new(script);
        let waited = tokio::time::timeout(
            Duration::from_secs(60),
            wait_until_ready(&admin, &Wanted::default(), |_| {}),
        )
        .await;
        assert!(waited.is_err());
        let polls = admin.asked().len();
        assert!(polls <= 2 * 120, "{polls} polls");
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_epoch_is_up_only_when_it_answers_itself() {
        // The parent answers until the child makes it close its admin API;
        // then nobody answers until the child has bound it.
        let admin = ScriptedAdmin::new(vec![
            (Duration::ZERO, Some(live(0, 0, 0))),
            (ms(10), None),
            (ms(300), Some(live(1, 0, 0))),
        ]);
        let wanted = Wanted {
            xds: None,
            epoch: Some(1),
        };
        let mut reasons = Vec::new();
        wait_until_ready(&admin, &wanted, |r| reasons.push(r)).await;
        let ready_at = *admin.asked().last().expect("asked");
        assert!(ready_at >= ms(300), "{ready_at:?}");
        assert!(
            reasons[0].contains("epoch 0, not yet for the new epoch 1"),
            "{reasons:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn polling_stops_once_ready() {
        let admin = ScriptedAdmin::new(vec![(Duration::ZERO, Some(live(0, 0, 0)))]);
        wait_until_ready(&admin, &Wanted::default(), |_| {}).await;
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(admin.asked().len(), 1);
    }
}
