//! From registry changes to pushes: the [`Discovery`] state (the registry
//! and the batches its streams follow), and the debounce that gathers
//! changes into a [`Batch`]: after a quiet window with no change, or at
//! the latest a maximum delay after the first one, so a rollout of many
//! pods is pushed a few times rather than once per pod.
//!
//! Pushes are throttled ([`Throttle`]): at most so many streams recompute
//! and send at once, across all streams, as Istio's `PILOT_PUSH_THROTTLE`.
//!
//! A withdrawal ([`Discovery::apply_proxy`] of a pod that starts deleting
//! or stops being Ready) is not debounced: its batch (the endpoints of the
//! Services the pod backs, and the pod's own proxy) goes out at once, and so
//! does the news that a withdrawal is done ([`super::withdrawal`]).
//!
//! Each stream coalesces its pushes ([`Coalesce`]): while its proxy has not
//! answered the last response, whatever concerns it waits and goes out as
//! one push when the proxy answers. So a lone withdrawal is pushed at
//! once, and a burst of them costs each dependent a push per round trip of
//! its proxy rather than one per withdrawal.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use remora_contract::discovery::ServiceHost;
use tokio::sync::{Semaphore, SemaphorePermit, mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::inbound::ServedInbound;
use super::registry::{PodKey, ProxyInfo, Registry, Touched};
use super::resources::{self, Snapshot};
use super::withdrawal::{self, Changed, EdsView, StreamId, Tracker};
use crate::pod_events::PodEvents;

/// The debounce. The defaults (100 ms quiet, 1 s at most) were chosen by
/// measurement (`benches/discovery_push.rs --debounce-quiet-ms`, README).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Debounce {
    pub quiet: Duration,
    pub max_delay: Duration,
}

impl Default for Debounce {
    fn default() -> Self {
        Self {
            quiet: Duration::from_millis(100),
            max_delay: Duration::from_secs(1),
        }
    }
}

/// Pushes at once by default: Istio's `PILOT_PUSH_THROTTLE` default. A push
/// is a recompute (CPU, shared per outbound annotation) and a send into the
/// stream's queue, so more at once than the runtime's threads buys nothing;
/// the bound is what keeps a burst of 10,000 streams from each holding a
/// freshly computed snapshot at once (README, "Push throttling", for the
/// measurement).
pub const DEFAULT_PUSH_THROTTLE: usize = 100;

/// A bound on the pushes (recompute + send) in flight across all streams.
#[derive(Debug)]
pub struct Throttle {
    permits: Semaphore,
    limit: usize,
    in_flight: AtomicUsize,
    /// The most in flight at once so far.
    most: AtomicUsize,
    waiting: AtomicUsize,
}

impl Throttle {
    /// At most `limit` (at least 1) pushes at once.
    pub fn new(limit: usize) -> Self {
        let limit = limit.max(1);
        Self {
            permits: Semaphore::new(limit),
            limit,
            in_flight: AtomicUsize::new(0),
            most: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
        }
    }

    /// A place for one push, once one is free; the push ends when it drops.
    pub async fn acquire(&self) -> PushPermit<'_> {
        self.waiting.fetch_add(1, Ordering::AcqRel);
        // Never closed: a closed semaphore would be a bug here.
        let permit = self.permits.acquire().await;
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        let now = self.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        self.most.fetch_max(now, Ordering::AcqRel);
        PushPermit {
            _permit: permit.ok(),
            throttle: self,
        }
    }

    pub fn limit(&self) -> usize {
        self.limit
    }
    /// Pushes in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }
    /// The most pushes that were in flight at once.
    pub fn most(&self) -> usize {
        self.most.load(Ordering::Acquire)
    }
    /// Pushes waiting for a place now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }
}

/// One push's place in the [`Throttle`].
#[derive(Debug)]
pub struct PushPermit<'a> {
    _permit: Option<SemaphorePermit<'a>>,
    throttle: &'a Throttle,
}

impl Drop for PushPermit<'_> {
    fn drop(&mut self) {
        self.throttle.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What changed since the previous batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    /// One more than the previous batch's: a stream that sees a gap missed
    /// a batch and recomputes whatever it touched.
    pub generation: u64,
    /// Services whose ports or endpoints changed.
    pub services: BTreeSet<ServiceHost>,
    /// Proxies whose own pod changed.
    pub pods: BTreeSet<PodKey>,
}

impl Batch {
    /// Whether a proxy of pod `pod` depending on `services` must recompute.
    pub fn concerns(&self, pod: &PodKey, services: &BTreeSet<ServiceHost>) -> bool {
        self.pods.contains(pod) || !self.services.is_disjoint(services)
    }
}

/// One stream's pushes, coalesced: a push goes out at once unless the
/// proxy has not answered (ACKed or NACKed) a response of the stream yet;
/// then it is held, and what else concerns the stream meanwhile merges
/// into it (a push recomputes from the registry as it then stands), until
/// the proxy answers or, at the latest, the debounce's max delay after it
/// was first held: a proxy that never answers is not waited for longer
/// than a debounced change is.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Coalesce {
    /// A push is held until then at the latest.
    held_until: Option<Instant>,
}

impl Coalesce {
    /// A change concerns the stream at `now`: whether to push it now, the
    /// proxy awaiting an answer to a response or not (`awaiting`).
    pub fn change(&mut self, awaiting: bool, now: Instant, debounce: Debounce) -> bool {
        if awaiting {
            self.held_until.get_or_insert(now + debounce.max_delay);
            return false;
        }
        self.held_until = None;
        true
    }

    /// The proxy answered, or its stream sent: whether a held push is due
    /// now (none is awaited any more, or the bound has come by `now`).
    pub fn due(&mut self, awaiting: bool, now: Instant) -> bool {
        let due = self
            .held_until
            .is_some_and(|until| !awaiting || until <= now);
        if due {
            self.held_until = None;
        }
        due
    }

    /// When a held push goes out, answered or not.
    pub fn held_until(&self) -> Option<Instant> {
        self.held_until
    }
}

/// A change for the debounce.
#[derive(Debug)]
pub enum Change {
    /// Gathered into the next batch.
    Later(Touched),
    /// Pushed at once, in a batch of its own.
    Now(Vec<Touched>),
}

/// Snapshots (without the pod's own part) by outbound annotation and
/// inbound listeners (the replicas of a workload share both).
type SharedSnapshots = HashMap<(Option<Arc<str>>, Arc<ServedInbound>), Snapshot>;

/// The registry, shared by the feeds (the watches) and the streams.
pub struct Discovery {
    registry: RwLock<Registry>,
    /// One more at each update, under the registry's write lock.
    revision: AtomicU64,
    /// Snapshots by outbound annotation, all of one revision: the replicas
    /// of a workload carry the same annotation, so a change the fleet
    /// depends on is generated once per distinct annotation, not per proxy.
    shared: Mutex<(u64, SharedSnapshots)>,
    changes: mpsc::UnboundedSender<Change>,
    batches: watch::Receiver<Arc<Batch>>,
    /// Who has confirmed each withdrawal.
    pub withdrawals: Tracker,
    /// The last stream number given.
    streams: AtomicU64,
    /// The cluster's DNS domain (`cluster.local`).
    pub domain: String,
    /// The workload CA's trust domain when it is on: meshed endpoints are
    /// then reached over mTLS (secure naming, see [`resources`]).
    pub trust_domain: Option<String>,
    /// Bounds the pushes of all streams.
    pub throttle: Throttle,
    /// How long changes are gathered; a held push ([`Coalesce`]) waits at
    /// most its max delay.
    pub debounce: Debounce,
}

impl Discovery {
    /// The state and the debounce task's future, which ends once every
    /// [`Discovery`] is dropped; pushes throttled at [`DEFAULT_PUSH_THROTTLE`].
    pub fn new(
        domain: &str,
        trust_domain: Option<&str>,
        debounce: Debounce,
    ) -> (
        Arc<Self>,
        impl std::future::Future<Output = ()> + Send + use<>,
    ) {
        Self::with_push_throttle(domain, trust_domain, debounce, DEFAULT_PUSH_THROTTLE)
    }

    /// [`Discovery::new`], with at most `push_throttle` pushes at once.
    pub fn with_push_throttle(
        domain: &str,
        trust_domain: Option<&str>,
        debounce: Debounce,
        push_throttle: usize,
    ) -> (
        Arc<Self>,
        impl std::future::Future<Output = ()> + Send + use<>,
    ) {
        let (changes, rx) = mpsc::unbounded_channel();
        let (tx, batches) = watch::channel(Arc::new(Batch::default()));
        let me = Arc::new(Self {
            registry: RwLock::default(),
            revision: AtomicU64::new(0),
            shared: Mutex::default(),
            changes,
            batches,
            withdrawals: Tracker::default(),
            streams: AtomicU64::new(0),
            domain: domain.to_string(),
            trust_domain: trust_domain.map(str::to_string),
            throttle: Throttle::new(push_throttle),
            debounce,
        });
        (me, run(rx, tx, debounce))
    }

    /// Change the registry; what `f` says it touched is pushed (debounced).
    pub fn update<T: IntoIterator<Item = Touched>>(&self, f: impl FnOnce(&mut Registry) -> T) {
        let touched = {
            let mut r = self
                .registry
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            self.revision.fetch_add(1, Ordering::Release);
            f(&mut r)
        };
        for t in touched {
            // The debounce ends only when every Discovery is gone.
            let _ = self.changes.send(Change::Later(t));
        }
    }

    /// Push `touched` at once, in a batch of its own.
    fn push_now(&self, touched: Vec<Touched>) {
        if !touched.is_empty() {
            let _ = self.changes.send(Change::Now(touched));
        }
    }

    /// A proxy's pod created or changed ([`Registry::apply_proxy`]). If it
    /// starts deleting or stops being Ready, its addresses are withdrawn:
    /// pushed at once to the dependents of the Services it backs, and who
    /// held them is tracked ([`Tracker::withdraw`]) if any Service had them
    /// or the pod is deleting (its agent will ask; a pod still starting is
    /// not tracked); if it is Ready again, its withdrawal is forgotten and
    /// it serves again. The pod watch
    /// applies pods through this ([`super::feed`]); [`Registry::apply_proxy`]
    /// through [`Discovery::update`] changes the registry alone (tests).
    pub fn apply_proxy(&self, key: PodKey, info: ProxyInfo) {
        let (touched, now) = {
            let mut r = self
                .registry
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            self.revision.fetch_add(1, Ordering::Release);
            let was = r.is_withdrawn(&key);
            let in_slices = r.addresses(&key);
            // The pod's own address too: its EndpointSlices may already
            // call it not ready (a terminating endpoint) when the pod watch
            // shows the deletion, and a proxy last sent it still routes to
            // it until it ACKs a send without it.
            let own = r
                .proxy(&key)
                .and_then(|p| p.ip.as_deref())
                .into_iter()
                .chain(info.ip.as_deref())
                .filter_map(|ip| ip.parse::<IpAddr>().ok());
            let addresses: BTreeSet<_> = in_slices.iter().copied().chain(own).collect();
            let deleting = info.deleting;
            // The pod's own bound, read as its agent reads it.
            let bound = remora_contract::overlay::withdrawal_timeout(&info.agent_annotations);
            let touched = r.apply_proxy(key.clone(), info);
            let is = r.is_withdrawn(&key);
            // Under the registry's lock: a stream computing its snapshot
            // after this sees both the endpoints and the withdrawal.
            let tracked = self.withdrawals.is_withdrawn(&key);
            let track = is && !tracked && (deleting || !in_slices.is_empty());
            if track {
                let p = self
                    .withdrawals
                    .withdraw(key.clone(), addresses, Instant::now(), bound);
                tracing::debug!(pod = ?key, waiting = p.expected, "discovery: endpoints withdrawn");
            } else if !is && tracked {
                self.withdrawals.restore(&key);
            }
            (touched, was != is || track)
        };
        if now {
            self.push_now(touched);
        } else {
            for t in touched {
                let _ = self.changes.send(Change::Later(t));
            }
        }
    }

    /// A proxy's pod gone from the watch: its withdrawal, if any, ends.
    pub fn delete_proxy(&self, key: &PodKey) {
        self.update(|r| r.delete_proxy(key));
        self.withdrawals.restore(key);
    }

    /// A new stream's number.
    pub fn stream_id(&self) -> StreamId {
        self.streams.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Stream `id` of `pod`'s proxy sent EDS of `snapshot`, after which the
    /// proxy holds the load assignments `holds` says. Returns the
    /// withdrawals that became done.
    pub fn eds_sent(
        &self,
        id: StreamId,
        pod: &PodKey,
        snapshot: &Snapshot,
        holds: impl Fn(&str) -> bool,
    ) -> Vec<Changed> {
        let view = EdsView::new(&snapshot.addresses, holds);
        let c = self
            .withdrawals
            .sent(id, pod, &snapshot.endpoints.version, view);
        self.withdrawals_changed(c)
    }

    /// Stream `id`'s proxy ACKed (or NACKed) EDS version `version`.
    /// Returns the withdrawals that became done.
    pub fn eds_answered(&self, id: StreamId, version: &str, acked: bool) -> Vec<Changed> {
        let c = self
            .withdrawals
            .answered(id, version, acked, Instant::now());
        self.withdrawals_changed(c)
    }

    /// Stream `id` ended. Returns the withdrawals that became done.
    pub fn stream_ended(&self, id: StreamId) -> Vec<Changed> {
        let c = self.withdrawals.gone(id);
        self.withdrawals_changed(c)
    }

    /// Withdrawals whose pod's withdrawal timeout has come by `now` with
    /// proxies still pending ([`Tracker::expire`]): given up on, and their
    /// pods' own proxies told at once. Returns them.
    pub fn expire_withdrawals(&self, now: Instant) -> Vec<Changed> {
        let c = self.withdrawals.expire(now);
        self.withdrawals_changed(c)
    }

    /// The clock of the withdrawals' bounds, until `stop`: at each
    /// deadline, [`Discovery::expire_withdrawals`], and a Warning Event on
    /// each pod given up on naming the proxies that never confirmed.
    pub async fn bound_withdrawals(
        self: Arc<Self>,
        events: Option<PodEvents>,
        stop: CancellationToken,
    ) {
        let mut changes = self.withdrawals.changes();
        loop {
            let next = self.withdrawals.next_deadline();
            tokio::select! {
                () = stop.cancelled() => return,
                r = changes.changed() => if r.is_err() { return },
                () = async {
                    match next {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
            for c in self.expire_withdrawals(Instant::now()) {
                tracing::warn!(pod = ?c.pod, pending = c.progress.pending_count(),
                    names = ?c.progress.pending, confirmed = c.progress.confirmed,
                    expected = c.progress.expected,
                    "discovery: proxies never confirmed a withdrawal within its timeout");
                if let Some(events) = &events {
                    withdrawal::raise_timed_out(events, &c.pod, &c.progress);
                }
            }
        }
    }

    /// The withdrawn pods' own proxies are told: at once when done,
    /// debounced before. Returns those done.
    fn withdrawals_changed(&self, changed: Vec<Changed>) -> Vec<Changed> {
        let (done, progress): (Vec<Changed>, Vec<Changed>) =
            changed.into_iter().partition(|c| c.settled);
        for c in progress {
            let _ = self.changes.send(Change::Later(Touched::Pod(c.pod)));
        }
        self.push_now(done.iter().map(|c| Touched::Pod(c.pod.clone())).collect());
        done
    }

    /// Read the registry.
    pub fn read<T>(&self, f: impl FnOnce(&Registry) -> T) -> T {
        f(&self.registry.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// The resources of the proxy of pod `pod`, if it is known.
    pub fn snapshot(&self, pod: &PodKey) -> Option<Snapshot> {
        self.read(|r| {
            let p = r.proxy(pod)?;
            // Read under the registry's read lock: no update runs meanwhile.
            let revision = self.revision.load(Ordering::Acquire);
            let cached = {
                let shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
                let key = (p.outbound.clone(), p.inbound.clone());
                (shared.0 == revision)
                    .then(|| shared.1.get(&key).cloned())
                    .flatten()
            };
            let mut s = match cached {
                Some(s) => s,
                None => {
                    let s = resources::generate(
                        r,
                        p.outbound.as_deref(),
                        &p.inbound,
                        &self.domain,
                        self.trust_domain.as_deref(),
                    );
                    let mut shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
                    if shared.0 != revision {
                        *shared = (revision, HashMap::new());
                    }
                    shared
                        .1
                        .insert((p.outbound.clone(), p.inbound.clone()), s.clone());
                    s
                }
            };
            s.pod = resources::pod_annotations(&pod.namespace, &pod.name, &p.agent_annotations);
            // Only a withdrawn pod has a withdrawal to look up.
            let progress = r
                .is_withdrawn(pod)
                .then(|| self.withdrawals.progress(pod))
                .flatten();
            let replicas = if progress.is_some() {
                r.other_replicas()
            } else {
                BTreeMap::new()
            };
            s.withdrawal =
                resources::withdrawal(&pod.namespace, &pod.name, progress.as_ref(), &replicas);
            Some(s)
        })
    }

    pub fn batches(&self) -> watch::Receiver<Arc<Batch>> {
        self.batches.clone()
    }
}

/// Add what `t` touched to `batch`.
fn add(batch: &mut Batch, t: Touched) {
    match t {
        Touched::Service(s) | Touched::Endpoints(s) => {
            batch.services.insert(s);
        }
        Touched::Pod(p) => {
            batch.pods.insert(p);
        }
    }
}

/// Gather changes into batches (see the module doc) until `rx` closes;
/// [`Change::Now`] is sent at once, in a batch of its own, whatever is
/// being gathered meanwhile.
pub async fn run(
    mut rx: mpsc::UnboundedReceiver<Change>,
    tx: watch::Sender<Arc<Batch>>,
    debounce: Debounce,
) {
    let mut generation = 0u64;
    let mut send = |mut batch: Batch| {
        generation += 1;
        batch.generation = generation;
        tx.send_replace(Arc::new(batch));
    };
    loop {
        let mut batch = Batch::default();
        match rx.recv().await {
            None => return,
            Some(Change::Now(ts)) => {
                ts.into_iter().for_each(|t| add(&mut batch, t));
                send(batch);
                continue;
            }
            Some(Change::Later(t)) => add(&mut batch, t),
        }
        let deadline = Instant::now() + debounce.max_delay;
        let quiet = || (Instant::now() + debounce.quiet).min(deadline);
        // A change now does not extend the window of those gathered.
        let mut quiet_until = quiet();
        loop {
            match tokio::time::timeout_at(quiet_until, rx.recv()).await {
                Ok(Some(Change::Later(t))) => {
                    add(&mut batch, t);
                    quiet_until = quiet();
                }
                Ok(Some(Change::Now(ts))) => {
                    let mut now = Batch::default();
                    ts.into_iter().for_each(|t| add(&mut now, t));
                    send(now);
                }
                // Gone: push what was gathered, then end.
                Ok(None) | Err(_) => break,
            }
        }
        send(batch);
        if rx.is_closed() && rx.is_empty() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(n: &str) -> Touched {
        Touched::Endpoints(ServiceHost {
            name: n.into(),
            namespace: "shop".into(),
        })
    }

    #[tokio::test(start_paused = true)]
    async fn changes_wait_for_a_quiet_window_but_no_longer_than_the_max_delay() {
        let (tx, rx) = mpsc::unbounded_channel();
        let (btx, mut brx) = watch::channel(Arc::new(Batch::default()));
        let d = Debounce::default();
        tokio::spawn(run(rx, btx, d));

        // Two changes 50 ms apart: one batch, 100 ms after the second.
        let start = Instant::now();
        tx.send(Change::Later(svc("a"))).expect("send");
        tokio::time::sleep(Duration::from_millis(50)).await;
        tx.send(Change::Later(svc("b"))).expect("send");
        brx.changed().await.expect("batch");
        assert_eq!(start.elapsed(), Duration::from_millis(150));
        let b = brx.borrow_and_update().clone();
        assert_eq!(b.generation, 1);
        assert_eq!(b.services.len(), 2);

        // A change every 50 ms without end: pushed at the max delay.
        let start = Instant::now();
        let feeding = tokio::spawn({
            let tx = tx.clone();
            async move {
                loop {
                    if tx.send(Change::Later(svc("c"))).is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        });
        brx.changed().await.expect("batch");
        assert_eq!(start.elapsed(), d.max_delay);
        assert_eq!(brx.borrow_and_update().generation, 2);
        feeding.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_now_is_pushed_at_once_whatever_is_being_gathered() {
        let (tx, rx) = mpsc::unbounded_channel();
        let (btx, mut brx) = watch::channel(Arc::new(Batch::default()));
        tokio::spawn(run(rx, btx, Debounce::default()));
        let start = Instant::now();
        tx.send(Change::Later(svc("a"))).expect("send");
        tokio::time::sleep(Duration::from_millis(10)).await;
        tx.send(Change::Now(vec![svc("w")])).expect("send");
        brx.changed().await.expect("batch");
        // Not a moment of the quiet window waited for.
        assert_eq!(start.elapsed(), Duration::from_millis(10));
        let b = brx.borrow_and_update().clone();
        assert_eq!((b.generation, b.services.len()), (1, 1));
        assert!(b.services.iter().all(|s| s.name == "w"));
        // What was being gathered goes out after its window, next.
        brx.changed().await.expect("batch");
        assert_eq!(start.elapsed(), Duration::from_millis(100));
        let b = brx.borrow_and_update().clone();
        assert_eq!(b.generation, 2);
        assert!(b.services.iter().all(|s| s.name == "a"));
        // And with nothing being gathered.
        let start = Instant::now();
        tx.send(Change::Now(vec![svc("x")])).expect("send");
        brx.changed().await.expect("batch");
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert_eq!(brx.borrow_and_update().generation, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn no_more_pushes_than_the_throttle_run_at_once() {
        let throttle = Arc::new(Throttle::new(3));
        let start = Instant::now();
        let pushes: Vec<_> = (0..10)
            .map(|_| {
                let t = Arc::clone(&throttle);
                tokio::spawn(async move {
                    let _p = t.acquire().await;
                    assert!(t.in_flight() <= 3, "{} in flight", t.in_flight());
                    tokio::time::sleep(Duration::from_millis(10)).await;
                })
            })
            .collect();
        for p in pushes {
            p.await.expect("pushed");
        }
        // 10 pushes of 10 ms, 3 at a time: 4 rounds.
        assert_eq!(start.elapsed(), Duration::from_millis(40));
        assert_eq!(throttle.most(), 3);
        assert_eq!((throttle.in_flight(), throttle.waiting()), (0, 0));
        assert_eq!(Throttle::new(0).limit(), 1, "never none at all");
    }

    #[tokio::test(start_paused = true)]
    async fn a_push_waits_for_the_answer_to_the_last_then_goes_once() {
        let d = Debounce::default();
        let mut c = Coalesce::default();
        // Nothing awaited: at once, a lone change as much as any.
        assert!(c.change(false, Instant::now(), d));
        assert_eq!(c.held_until(), None);
        // Awaited: held, and so is every change after it, into one push.
        let t0 = Instant::now();
        assert!(!c.change(true, t0, d));
        for _ in 0..99 {
            tokio::time::advance(Duration::from_millis(1)).await;
            assert!(!c.change(true, Instant::now(), d));
        }
        assert_eq!(c.held_until(), Some(t0 + d.max_delay), "from the first");
        assert!(!c.due(true, Instant::now()), "not answered yet");
        // Answered: the one push goes, and nothing is held after it.
        assert!(c.due(false, Instant::now()));
        assert!(!c.due(false, Instant::now()), "once");
        assert_eq!(c.held_until(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_held_push_goes_at_the_max_delay_if_the_proxy_never_answers() {
        let d = Debounce::default();
        let mut c = Coalesce::default();
        let t0 = Instant::now();
        assert!(!c.change(true, t0, d));
        tokio::time::advance(d.max_delay - Duration::from_millis(1)).await;
        assert!(!c.due(true, Instant::now()));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(c.due(true, Instant::now()), "at the bound, answered or not");
        // The next change is held anew, from then.
        let t1 = Instant::now();
        assert!(!c.change(true, t1, d));
        assert_eq!(c.held_until(), Some(t1 + d.max_delay));
    }

    #[test]
    fn a_batch_concerns_the_dependents_and_the_pod_only() {
        let pod = PodKey {
            namespace: "shop".into(),
            name: "web-0".into(),
        };
        let cart = ServiceHost {
            name: "cart".into(),
            namespace: "shop".into(),
        };
        let b = Batch {
            generation: 1,
            services: [cart.clone()].into(),
            pods: BTreeSet::new(),
        };
        assert!(b.concerns(&pod, &[cart].into()));
        assert!(!b.concerns(&pod, &BTreeSet::new()));
        let mine = Batch {
            pods: [pod.clone()].into(),
            ..Batch::default()
        };
        assert!(mine.concerns(&pod, &BTreeSet::new()));
    }

    /// A slice that marked the pod's endpoint not ready before the pod's
    /// deletion reached the watch names no address for it; a proxy that
    /// still holds the pod's IP is waited for all the same.
    #[tokio::test]
    async fn a_pod_its_slice_dropped_first_is_waited_for_by_its_own_ip() {
        use super::super::registry::SliceInfo;
        use super::super::withdrawal::EndpointAddresses;
        let key = |n: &str| PodKey {
            namespace: "shop".into(),
            name: n.into(),
        };
        let ip: IpAddr = "10.1.0.1".parse().expect("ip");
        let (d, _debounce) = Discovery::new("cluster.local", None, Debounce::default());
        // The slice already says not ready: no ready address names cart-0.
        d.update(|r| {
            r.apply_slice(
                ("shop".into(), "cart-x".into()),
                SliceInfo {
                    service: Some(ServiceHost {
                        name: "cart".into(),
                        namespace: "shop".into(),
                    }),
                    ..Default::default()
                },
            )
        });
        assert!(d.read(|r| r.addresses(&key("cart-0")).is_empty()));
        // web-0's proxy still holds it (the push without it not ACKed yet).
        let held: Arc<EndpointAddresses> = Arc::new([("cart".to_string(), [ip].into())].into());
        d.withdrawals
            .sent(1, &key("web-0"), "v1", EdsView::new(&held, |_| true));
        d.apply_proxy(
            key("cart-0"),
            ProxyInfo {
                ip: Some(ip.to_string()),
                withdrawn: true,
                deleting: true,
                ..Default::default()
            },
        );
        let p = d.withdrawals.progress(&key("cart-0")).expect("withdrawn");
        assert_eq!((p.expected, p.done), (1, false), "{p:?}");
        assert_eq!(p.pending, ["shop/web-0"]);
        // A pod still starting (not Ready, not deleting, named by no slice)
        // is not tracked, its IP notwithstanding.
        d.apply_proxy(
            key("cart-1"),
            ProxyInfo {
                ip: Some("10.1.0.2".into()),
                withdrawn: true,
                ..Default::default()
            },
        );
        assert!(d.withdrawals.progress(&key("cart-1")).is_none());
    }

    /// The bound of a withdrawal is the pod's own withdrawal timeout: at
    /// it, the pod's proxy is told at once and a Warning Event names the
    /// proxy that never confirmed.
    #[tokio::test(start_paused = true)]
    async fn a_withdrawal_is_given_up_on_at_the_pods_own_timeout() {
        use super::super::registry::SliceInfo;
        use super::super::withdrawal::EndpointAddresses;
        let key = |n: &str| PodKey {
            namespace: "shop".into(),
            name: n.into(),
        };
        let ip: IpAddr = "10.1.0.1".parse().expect("ip");
        let (d, debounce) = Discovery::new("cluster.local", None, Debounce::default());
        tokio::spawn(debounce);
        d.update(|r| {
            r.apply_slice(
                ("shop".into(), "cart-x".into()),
                SliceInfo {
                    service: Some(ServiceHost {
                        name: "cart".into(),
                        namespace: "shop".into(),
                    }),
                    ready: [ip].into(),
                    pods: [(ip, "cart-0".to_string())].into(),
                    ..Default::default()
                },
            )
        });
        // web-0's proxy holds it.
        let held: Arc<EndpointAddresses> = Arc::new([("cart".to_string(), [ip].into())].into());
        d.withdrawals
            .sent(1, &key("web-0"), "v1", EdsView::new(&held, |_| true));
        let (events, mut warnings) = crate::pod_events::PodEvents::channel_for_tests();
        let stop = CancellationToken::new();
        tokio::spawn(Arc::clone(&d).bound_withdrawals(Some(events), stop.clone()));
        let mut batches = d.batches();
        let t0 = Instant::now();
        d.apply_proxy(
            key("cart-0"),
            ProxyInfo {
                agent_annotations: [(
                    remora_contract::annotations::WITHDRAWAL_TIMEOUT.to_string(),
                    "2s".to_string(),
                )]
                .into(),
                withdrawn: true,
                deleting: true,
                ..Default::default()
            },
        );
        assert_eq!(
            d.withdrawals.next_deadline(),
            Some(t0 + Duration::from_secs(2))
        );
        let w = warnings.recv().await.expect("a Warning Event");
        assert_eq!(
            t0.elapsed(),
            Duration::from_secs(2),
            "at the pod's own bound"
        );
        assert_eq!(
            (w.reason, w.pod.as_str()),
            ("EndpointsWithdrawalTimedOut", "cart-0")
        );
        assert!(w.note.ends_with("shop/web-0"), "{}", w.note);
        let p = d.withdrawals.progress(&key("cart-0")).expect("withdrawn");
        assert!(p.done && p.timed_out, "{p:?}");
        // The pod's own proxy is told at once, in a batch of its own.
        let told = batches
            .wait_for(|b| b.pods.contains(&key("cart-0")) && b.services.is_empty())
            .await
            .expect("a batch");
        drop(told);
        stop.cancel();
    }

    /// The EndpointSlice controller may mark a deleted pod's endpoint not
    /// ready before the pod watch shows the deletion: the proxies last
    /// sent the pod's address are waited for all the same (the
    /// withdrawal is not done with nobody waited for).
    #[tokio::test(start_paused = true)]
    async fn a_pod_its_slices_already_call_not_ready_is_waited_for_by_its_own_address() {
        use super::super::withdrawal::EndpointAddresses;
        let key = |n: &str| PodKey {
            namespace: "shop".into(),
            name: n.into(),
        };
        let ip: IpAddr = "10.1.0.1".parse().expect("ip");
        let (d, debounce) = Discovery::new("cluster.local", None, Debounce::default());
        tokio::spawn(debounce);
        let serving = ProxyInfo {
            ip: Some(ip.to_string()),
            ..Default::default()
        };
        d.apply_proxy(key("cart-0"), serving.clone());
        // web-0's proxy was last sent the pod's address; the slice no
        // longer names it ready (no slice here at all).
        let held: Arc<EndpointAddresses> = Arc::new([("cart".to_string(), [ip].into())].into());
        d.withdrawals
            .sent(1, &key("web-0"), "v1", EdsView::new(&held, |_| true));
        d.apply_proxy(
            key("cart-0"),
            ProxyInfo {
                withdrawn: true,
                deleting: true,
                ..serving
            },
        );
        let p = d.withdrawals.progress(&key("cart-0")).expect("withdrawn");
        assert_eq!((p.expected, p.done), (1, false), "{p:?}");
        assert_eq!(p.pending, ["shop/web-0"]);
    }
}
