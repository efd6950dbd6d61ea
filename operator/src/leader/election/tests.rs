//! The election's time logic against an in-memory Lease store (a test
//! double of the API server's optimistic concurrency), in paused time.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use super::*;

/// Test double: one Lease with the API server's resourceVersion checks.
#[derive(Clone, Default)]
struct InMemoryLeaseStore {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    lease: Mutex<Option<Lease>>,
    version: AtomicU32,
    /// Every call fails while set (an unreachable API server).
    failing: AtomicBool,
    /// The next replace answers 409 (someone wrote in between).
    conflict_next_replace: AtomicBool,
}

impl InMemoryLeaseStore {
    fn lease(&self) -> Option<Lease> {
        self.inner.lease.lock().ok().and_then(|l| l.clone())
    }

    fn holder(&self) -> Option<String> {
        self.lease()
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity)
    }

    fn transitions(&self) -> Option<i32> {
        self.lease()
            .and_then(|l| l.spec)
            .and_then(|s| s.lease_transitions)
    }

    /// Someone else's Lease, as if written by another replica.
    fn put(&self, holder: &str, duration_seconds: i32) {
        let v = self.inner.version.fetch_add(1, Ordering::SeqCst) + 1;
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some("l".into()),
                resource_version: Some(v.to_string()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.into()),
                lease_duration_seconds: Some(duration_seconds),
                lease_transitions: Some(0),
                renew_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
                ..LeaseSpec::default()
            }),
        };
        if let Ok(mut l) = self.inner.lease.lock() {
            *l = Some(lease);
        }
    }

    fn fail(&self, on: bool) {
        self.inner.failing.store(on, Ordering::SeqCst);
    }

    fn check(&self) -> Result<(), LeaderError> {
        if self.inner.failing.load(Ordering::SeqCst) {
            Err(LeaderError::Store("unreachable".into()))
        } else {
            Ok(())
        }
    }

    fn stamp(&self, mut lease: Lease) -> Lease {
        let v = self.inner.version.fetch_add(1, Ordering::SeqCst) + 1;
        lease.metadata.resource_version = Some(v.to_string());
        lease
    }
}

impl LeaseStore for InMemoryLeaseStore {
    async fn get(&self) -> Result<Option<Lease>, LeaderError> {
        self.check()?;
        Ok(self.lease())
    }

    async fn create(&self, lease: Lease) -> Result<Lease, LeaderError> {
        self.check()?;
        let mut cur = self
            .inner
            .lease
            .lock()
            .map_err(|_| LeaderError::Store("poisoned".into()))?;
        if cur.is_some() {
            return Err(LeaderError::Conflict);
        }
        let lease = self.stamp(lease);
        *cur = Some(lease.clone());
        Ok(lease)
    }

    async fn replace(&self, lease: Lease) -> Result<Lease, LeaderError> {
        self.check()?;
        if self
            .inner
            .conflict_next_replace
            .swap(false, Ordering::SeqCst)
        {
            return Err(LeaderError::Conflict);
        }
        let mut cur = self
            .inner
            .lease
            .lock()
            .map_err(|_| LeaderError::Store("poisoned".into()))?;
        let current_version = cur
            .as_ref()
            .and_then(|l| l.metadata.resource_version.clone());
        if current_version.is_none() || current_version != lease.metadata.resource_version {
            return Err(LeaderError::Conflict);
        }
        let lease = self.stamp(lease);
        *cur = Some(lease.clone());
        Ok(lease)
    }
}

fn cfg(id: &str) -> LeaderConfig {
    LeaderConfig::new("l", "ns", id)
}

/// A candidate running in the background: whether it leads, how many times
/// its leader work started, and whether that work is running now.
struct Candidate {
    leading: watch::Receiver<bool>,
    started: Arc<AtomicU32>,
    running: Arc<AtomicBool>,
    shutdown: CancellationToken,
    done: tokio::task::JoinHandle<()>,
}

fn spawn(store: &InMemoryLeaseStore, cfg: LeaderConfig) -> Candidate {
    let elector = Elector::new(store.clone(), cfg).expect("valid config");
    let leading = elector.subscribe();
    let started = Arc::new(AtomicU32::new(0));
    let running = Arc::new(AtomicBool::new(false));
    let shutdown = CancellationToken::new();
    let (s, r) = (Arc::clone(&started), Arc::clone(&running));
    let done = tokio::spawn(
        elector.run(shutdown.clone(), move |token: CancellationToken| {
            s.fetch_add(1, Ordering::SeqCst);
            let r = Arc::clone(&r);
            async move {
                r.store(true, Ordering::SeqCst);
                token.cancelled().await;
                r.store(false, Ordering::SeqCst);
            }
        }),
    );
    Candidate {
        leading,
        started,
        running,
        shutdown,
        done,
    }
}

/// Waits until `c` leads (or not); returns how long that took.
async fn until_leading(c: &mut Candidate, want: bool, within: Duration) -> Duration {
    let start = Instant::now();
    tokio::time::timeout(within, c.leading.wait_for(|l| *l == want))
        .await
        .unwrap_or_else(|_| panic!("leading != {want} after {within:?}"))
        .expect("elector alive");
    start.elapsed()
}

#[tokio::test(start_paused = true)]
async fn acquires_a_free_lease_at_once_and_keeps_it() {
    let store = InMemoryLeaseStore::default();
    let mut a = spawn(&store, cfg("a"));
    until_leading(&mut a, true, Duration::from_millis(1)).await;
    assert_eq!(store.holder().as_deref(), Some("a"));
    assert_eq!(store.transitions(), Some(0));
    tokio::task::yield_now().await;
    assert!(a.running.load(Ordering::SeqCst));
    // Renewing for a minute changes neither the holder nor the transitions.
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(*a.leading.borrow());
    assert_eq!(store.holder().as_deref(), Some("a"));
    assert_eq!(store.transitions(), Some(0));
    assert_eq!(a.started.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn waits_while_another_replica_renews() {
    let store = InMemoryLeaseStore::default();
    let mut a = spawn(&store, cfg("a"));
    until_leading(&mut a, true, Duration::from_millis(1)).await;
    let b = spawn(&store, cfg("b"));
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert!(!*b.leading.borrow());
    assert_eq!(b.started.load(Ordering::SeqCst), 0);
    assert_eq!(store.holder().as_deref(), Some("a"));
}

#[tokio::test(start_paused = true)]
async fn takes_over_a_lease_that_stopped_changing_after_its_duration() {
    let store = InMemoryLeaseStore::default();
    // Held by a replica that died; its renewTime says "now" by the wall
    // clock, which the candidate must not trust.
    store.put("dead", 15);
    let mut a = spawn(&store, cfg("a"));
    let took = until_leading(&mut a, true, Duration::from_secs(30)).await;
    // First seen at t=0, expired at 15 s: tried then, not at the next
    // retry (every 2 s, so at 16 s).
    assert!(
        took >= Duration::from_secs(15) && took < Duration::from_millis(15_100),
        "{took:?}"
    );
    assert_eq!(store.holder().as_deref(), Some("a"));
    assert_eq!(store.transitions(), Some(1));
}

#[tokio::test(start_paused = true)]
async fn the_holders_own_lease_duration_counts() {
    let store = InMemoryLeaseStore::default();
    store.put("dead", 4);
    let mut a = spawn(&store, cfg("a"));
    let took = until_leading(&mut a, true, Duration::from_secs(30)).await;
    assert!(
        took >= Duration::from_secs(4) && took < Duration::from_millis(4_100),
        "{took:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn steps_down_when_renewals_fail_past_the_deadline_then_comes_back() {
    let store = InMemoryLeaseStore::default();
    let mut a = spawn(&store, cfg("a"));
    until_leading(&mut a, true, Duration::from_millis(1)).await;
    let last_ok = Instant::now();
    store.fail(true);
    until_leading(&mut a, false, Duration::from_secs(30)).await;
    let after = last_ok.elapsed();
    // Before the others may take over (lease duration 15 s), at the renew
    // deadline (10 s), rounded to the 2 s retry.
    assert!(
        after >= Duration::from_secs(10) && after < Duration::from_secs(13),
        "{after:?}"
    );
    tokio::task::yield_now().await;
    assert!(
        !a.running.load(Ordering::SeqCst),
        "leader work still running"
    );
    // The API server is back; the Lease still names us: take it again.
    store.fail(false);
    until_leading(&mut a, true, Duration::from_secs(3)).await;
    assert_eq!(a.started.load(Ordering::SeqCst), 2);
    assert_eq!(store.transitions(), Some(0));
}

#[tokio::test(start_paused = true)]
async fn a_renewal_conflict_is_retried_within_the_deadline() {
    let store = InMemoryLeaseStore::default();
    let mut a = spawn(&store, cfg("a"));
    until_leading(&mut a, true, Duration::from_millis(1)).await;
    store
        .inner
        .conflict_next_replace
        .store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(*a.leading.borrow());
    assert!(!store.inner.conflict_next_replace.load(Ordering::SeqCst));
    assert_eq!(a.started.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn the_holder_steps_down_at_once_when_another_took_the_lease() {
    let store = InMemoryLeaseStore::default();
    let mut a = spawn(&store, cfg("a"));
    until_leading(&mut a, true, Duration::from_millis(1)).await;
    // A new holder (after a partition, say): the next renewal sees it.
    store.put("b", 15);
    let took = until_leading(&mut a, false, Duration::from_secs(3)).await;
    assert!(took <= Duration::from_secs(2), "{took:?}");
    assert_eq!(store.holder().as_deref(), Some("b"));
}

#[tokio::test(start_paused = true)]
async fn racing_candidates_elect_exactly_one() {
    let store = InMemoryLeaseStore::default();
    let mut cs: Vec<Candidate> = (0..4)
        .map(|i| spawn(&store, cfg(&format!("c{i}"))))
        .collect();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let leaders: Vec<usize> = cs
        .iter_mut()
        .enumerate()
        .filter(|(_, c)| *c.leading.borrow())
        .map(|(i, _)| i)
        .collect();
    assert_eq!(leaders.len(), 1, "{leaders:?}");
    assert_eq!(store.holder(), Some(format!("c{}", leaders[0])));
    let started: u32 = cs.iter().map(|c| c.started.load(Ordering::SeqCst)).sum();
    assert_eq!(started, 1);
}

#[tokio::test(start_paused = true)]
async fn shutdown_stops_the_work_then_releases_and_a_standby_takes_over_at_once() {
    let store = InMemoryLeaseStore::default();
    let mut a = spawn(&store, cfg("a"));
    until_leading(&mut a, true, Duration::from_millis(1)).await;
    let mut b = spawn(&store, cfg("b"));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!*b.leading.borrow());

    a.shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(1), &mut a.done)
        .await
        .expect("run returns promptly")
        .expect("no panic");
    assert!(!a.running.load(Ordering::SeqCst));
    assert!(!*a.leading.borrow());
    // Released: no holder, so b need not wait for the 15 s lease duration.
    let took = until_leading(&mut b, true, Duration::from_secs(3)).await;
    assert!(took <= Duration::from_secs(2), "{took:?}");
    assert_eq!(store.holder().as_deref(), Some("b"));
    assert_eq!(store.transitions(), Some(1));

    // And back: every change of holder counts.
    let mut a2 = spawn(&store, cfg("a"));
    b.shutdown.cancel();
    until_leading(&mut a2, true, Duration::from_secs(3)).await;
    assert_eq!(store.transitions(), Some(2));
}

#[tokio::test(start_paused = true)]
async fn shutdown_of_a_candidate_touches_nothing() {
    let store = InMemoryLeaseStore::default();
    store.put("other", 15);
    let before = store.lease();
    let mut a = spawn(&store, cfg("a"));
    tokio::time::sleep(Duration::from_secs(3)).await;
    a.shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(1), &mut a.done)
        .await
        .expect("run returns promptly")
        .expect("no panic");
    assert_eq!(store.lease(), before);
}

#[tokio::test(start_paused = true)]
async fn leader_work_that_ignores_its_token_is_aborted_after_the_stop_timeout() {
    let store = InMemoryLeaseStore::default();
    let elector = Elector::new(store.clone(), cfg("a")).expect("valid config");
    let mut leading = elector.subscribe();
    let shutdown = CancellationToken::new();
    let done = tokio::spawn(elector.run(shutdown.clone(), |_token| std::future::pending::<()>()));
    leading.wait_for(|l| *l).await.expect("alive");
    let start = Instant::now();
    shutdown.cancel();
    done.await.expect("no panic");
    assert_eq!(start.elapsed(), Duration::from_secs(5));
    assert_eq!(store.holder(), None);
}

#[tokio::test(start_paused = true)]
async fn after_a_failed_renewal_the_work_is_aborted_before_others_may_take_over() {
    let store = InMemoryLeaseStore::default();
    let mut c = cfg("a");
    // Generous on shutdown; on a lost Lease only 15 s - 10 s is safe.
    c.stop_timeout = Duration::from_secs(60);
    let elector = Elector::new(store.clone(), c).expect("valid config");
    let mut leading = elector.subscribe();
    let shutdown = CancellationToken::new();
    let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel::<()>();
    /// Tells when the leader work is dropped (aborted).
    struct OnDrop(Option<tokio::sync::oneshot::Sender<()>>);
    impl Drop for OnDrop {
        fn drop(&mut self) {
            if let Some(tx) = self.0.take() {
                let _ = tx.send(());
            }
        }
    }
    let mut guard = Some(OnDrop(Some(stopped_tx)));
    let _done = tokio::spawn(elector.run(shutdown.clone(), move |_token| {
        let guard = guard.take();
        async move {
            let _guard = guard;
            std::future::pending::<()>().await
        }
    }));
    leading.wait_for(|l| *l).await.expect("alive");
    let last_ok = Instant::now();
    store.fail(true);
    stopped_rx.await.expect("the work was dropped");
    let gone = last_ok.elapsed();
    // Stepped down at the renew deadline (10 s); the work got what was
    // left of the lease duration, not the 60 s.
    assert_eq!(gone, Duration::from_secs(15));
}

#[tokio::test(start_paused = true)]
async fn metrics_follow_leadership() {
    let store = InMemoryLeaseStore::default();
    let metrics = Metrics::register(&mut Registry::default());
    let elector = Elector::new(store.clone(), cfg("a"))
        .expect("valid config")
        .with_metrics(metrics.clone());
    let mut leading = elector.subscribe();
    let shutdown = CancellationToken::new();
    let done = tokio::spawn(
        elector.run(shutdown.clone(), |t: CancellationToken| async move {
            t.cancelled().await
        }),
    );
    leading.wait_for(|l| *l).await.expect("alive");
    assert_eq!(metrics.leader.get(), 1);
    assert_eq!(metrics.transitions.get(), 1);
    shutdown.cancel();
    done.await.expect("no panic");
    assert_eq!(metrics.leader.get(), 0);
    assert_eq!(metrics.transitions.get(), 2);
}

#[test]
fn settings_are_checked() {
    let ok = cfg("a");
    assert!(ok.validate().is_ok());
    let bad = |f: fn(&mut LeaderConfig)| {
        let mut c = cfg("a");
        f(&mut c);
        c.validate().is_err()
    };
    assert!(bad(|c| c.renew_deadline = c.lease_duration));
    assert!(bad(|c| c.retry_period = c.renew_deadline));
    assert!(bad(|c| c.retry_period = Duration::ZERO));
    assert!(bad(|c| c.identity.clear()));
    let mut c = cfg("a");
    c.lease_duration = Duration::from_millis(2500);
    assert_eq!(c.lease_duration_seconds(), 3);
    c.lease_duration = Duration::from_millis(300);
    assert_eq!(c.lease_duration_seconds(), 1);
}
