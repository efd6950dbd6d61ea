//! One automatic rollout at a time, cluster-wide, with the namespaces
//! waiting for one taking turns.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// At most one automatic rollout per interval, cluster-wide, so a change to
/// a resource that governs many workloads never restarts them all at once;
/// and the namespaces waiting for one take turns, so that one tenant's many
/// resources and workloads cannot keep another namespace's rollout waiting
/// behind all of theirs: with `n` namespaces waiting, each gets one
/// rollout in `n` intervals whatever the others ask.
#[derive(Debug)]
pub struct RolloutLimiter {
    interval: Duration,
    last: Option<Instant>,
    /// The namespaces waiting for a rollout, in turn order, each with the
    /// last time it asked.
    waiting: VecDeque<(String, Instant)>,
}

/// How long past an interval a waiting namespace keeps its place without
/// asking again. A reconcile held back is requeued for the moment the slot
/// frees, so one still waiting asks at least once an interval; one that
/// stopped (its rollouts done, its resource gone) gives its turn up then.
const TURN_GRACE: Duration = Duration::from_secs(5);
/// The shortest wait handed out, so that no reconcile is requeued at once.
const MIN_WAIT: Duration = Duration::from_millis(100);

impl RolloutLimiter {
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            last: None,
            waiting: VecDeque::new(),
        }
    }

    /// Take the slot for a rollout in `namespace`, or learn how long until
    /// asking again may get it. Asking puts the namespace in line.
    pub fn try_acquire(&mut self, namespace: &str, now: Instant) -> Result<(), Duration> {
        let keep = self.interval + TURN_GRACE;
        self.waiting
            .retain(|(ns, asked)| ns == namespace || now.saturating_duration_since(*asked) < keep);
        match self.waiting.iter_mut().find(|(ns, _)| ns == namespace) {
            Some((_, asked)) => *asked = now,
            None => self.waiting.push_back((namespace.to_owned(), now)),
        }
        if let Some(last) = self.last {
            let free_at = last + self.interval;
            if now < free_at {
                return Err(free_at - now);
            }
        }
        match self.waiting.front() {
            Some((head, asked)) if head != namespace => {
                // The slot is the first namespace's until it gives its place up.
                Err((*asked + keep).saturating_duration_since(now).max(MIN_WAIT))
            }
            _ => {
                self.waiting.pop_front();
                self.last = Some(now);
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    const INTERVAL: Duration = Duration::from_secs(30);

    #[tokio::test(start_paused = true)]
    async fn limiter_spaces_rollouts_by_the_interval() {
        let mut l = RolloutLimiter::new(INTERVAL);
        assert_eq!(l.try_acquire("a", Instant::now()), Ok(()));
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(
            l.try_acquire("a", Instant::now()),
            Err(Duration::from_secs(20))
        );
        // A refused attempt does not take the slot.
        tokio::time::advance(Duration::from_secs(20)).await;
        assert_eq!(l.try_acquire("a", Instant::now()), Ok(()));
        assert_eq!(l.try_acquire("a", Instant::now()), Err(INTERVAL));
    }

    /// One reconcile loop: asks for a rollout in `ns` until it has made
    /// `rollouts` of them, coming back `late` after each wait it is told
    /// (a busy controller); returns when each rollout was made.
    async fn reconciler(
        limiter: Arc<Mutex<RolloutLimiter>>,
        ns: &'static str,
        rollouts: usize,
        late: Duration,
    ) -> Vec<Duration> {
        let start = Instant::now();
        let mut made = Vec::new();
        while made.len() < rollouts {
            let slot = limiter
                .lock()
                .expect("not poisoned")
                .try_acquire(ns, Instant::now());
            match slot {
                Ok(()) => made.push(start.elapsed()),
                Err(wait) => tokio::time::sleep(wait + late).await,
            }
        }
        made
    }

    /// The attack: a tenant with 50 Automatic SidecarLifecycles, each with
    /// four workloads to roll, asks for the limiter first and always comes
    /// back first. Another namespace's one rollout still comes within two
    /// intervals (one of the noisy tenant's, then its own), not after all
    /// 200 of the tenant's as with one slot for whoever asks first.
    #[tokio::test(start_paused = true)]
    async fn many_resources_of_one_namespace_do_not_hold_back_another() {
        let limiter = Arc::new(Mutex::new(RolloutLimiter::new(INTERVAL)));
        let noisy: Vec<_> = (0..50)
            .map(|_| tokio::spawn(reconciler(Arc::clone(&limiter), "noisy", 4, Duration::ZERO)))
            .collect();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let quiet = tokio::spawn(reconciler(
            Arc::clone(&limiter),
            "quiet",
            1,
            Duration::from_millis(10),
        ));
        let quiet = quiet.await.expect("the quiet namespace's rollout")[0];
        // Asked at 1 s; the noisy tenant's turn came at 30 s, its own at 60 s.
        assert!(
            quiet <= 2 * INTERVAL + Duration::from_millis(100),
            "the quiet namespace's rollout came {quiet:?} after it asked"
        );
        // And the noisy tenant still gets every interval nobody else wants.
        let mut all: Vec<Duration> = Vec::new();
        for t in noisy {
            all.extend(t.await.expect("noisy rollouts"));
        }
        all.sort();
        assert_eq!(all.len(), 200);
        for pair in all.windows(2) {
            assert!(pair[1] - pair[0] >= INTERVAL, "{pair:?}");
        }
        assert!(
            *all.last().expect("200") <= 201 * INTERVAL,
            "one rollout an interval: {:?}",
            all.last()
        );
    }

    /// A namespace that stops asking (its workload rolled by hand, its
    /// resource deleted) does not keep its turn from the others for long.
    #[tokio::test(start_paused = true)]
    async fn a_namespace_that_stops_asking_gives_its_turn_up() {
        let mut l = RolloutLimiter::new(INTERVAL);
        assert_eq!(l.try_acquire("a", Instant::now()), Ok(()));
        assert_eq!(l.try_acquire("gone", Instant::now()), Err(INTERVAL));
        assert_eq!(l.try_acquire("b", Instant::now()), Err(INTERVAL));
        tokio::time::advance(INTERVAL).await;
        // "gone" is first in line but never comes back: its place is held
        // for it a grace past an interval since it last asked, no longer.
        let wait = l.try_acquire("b", Instant::now()).expect_err("gone's turn");
        assert_eq!(wait, TURN_GRACE);
        tokio::time::advance(wait).await;
        assert_eq!(l.try_acquire("b", Instant::now()), Ok(()));
    }
}
