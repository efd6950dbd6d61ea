//! Confirmed withdrawal: which proxies have confirmed that they no longer
//! route to a pod whose endpoints were withdrawn (issue 30), pure
//! ([`Withdrawals`]), with the shared handle the server and the feed use
//! ([`Tracker`]: a lock, a change notification, the metrics).
//!
//! The rules:
//! - a pod is withdrawn when it starts deleting or stops being Ready
//!   ([`super::registry::ProxyInfo::withdrawn`]); its addresses are those
//!   its Services' EndpointSlices named ready for it at that moment;
//! - each stream's EDS sends are recorded as [`EdsView`]s (the addresses
//!   of the load assignments the proxy holds after that send), numbered
//!   in the order sent;
//! - when the pod is withdrawn, every proxy whose last EDS send holds one
//!   of its addresses is waited for; so is a proxy sent a view holding one
//!   *after* the withdrawal (a response computed just before it, sent
//!   just after), even if that reopens a withdrawal found done (with
//!   nobody waited for, say): the proxy does route to the pod until it
//!   confirms. A proxy first sent its endpoints after the withdrawal is
//!   never sent the pod, so never waited for;
//! - a waited-for proxy confirms when it ACKs an EDS send made after the
//!   last one that held the pod and holding none of its addresses. A NACK
//!   confirms nothing (Envoy keeps what it had); an ACK of an older send
//!   confirms nothing either;
//! - a proxy whose stream ends is no longer waited for: it counts as gone;
//! - the withdrawal is done when no proxy is pending; it is forgotten when
//!   the pod is Ready again or leaves the watch (proxies still pending then
//!   were never confirmed, and are counted);
//! - bounded: once the pod's withdrawal timeout has passed since the
//!   withdrawal, proxies still pending are given up on ([`Withdrawals::expire`]):
//!   the withdrawal is done and timed out, they are counted and named (the
//!   pod's agent is told, and a Warning Event on the pod names them,
//!   [`raise_timed_out`]); [`Discovery::bound_withdrawals`](super::push::Discovery::bound_withdrawals)
//!   runs the clock.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use remora_contract::discovery::MAX_WITHDRAWAL_PENDING_NAMES;
use tokio::sync::watch;
use tokio::time::Instant;

use super::registry::PodKey;
use crate::pod_events::{PodEvents, Warning};

/// The addresses of each load assignment (EDS resource) of a snapshot.
pub type EndpointAddresses = BTreeMap<String, BTreeSet<IpAddr>>;

/// EDS sends remembered per stream, awaiting their answer: as many as a
/// delta stream remembers (its `MAX_PENDING`; this module does not depend on
/// the sessions); an older one was answered or lost.
pub const MAX_UNANSWERED: usize = 16;

/// A stream, numbered by the server (one proxy may hold several in turn).
pub type StreamId = u64;

/// What a proxy holds of EDS after one send: the load assignments of its
/// snapshot it holds (all of them, or `only` these).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EdsView {
    addresses: Arc<EndpointAddresses>,
    only: Option<BTreeSet<String>>,
}

impl EdsView {
    /// The view of a proxy holding, of `addresses`' load assignments,
    /// those for which `holds` is true. Shared with the snapshot when it
    /// holds them all (the usual case: Envoy asks for every EDS cluster).
    pub fn new(addresses: &Arc<EndpointAddresses>, holds: impl Fn(&str) -> bool) -> Self {
        let all = addresses.keys().all(|c| holds(c));
        Self {
            addresses: Arc::clone(addresses),
            only: (!all).then(|| addresses.keys().filter(|c| holds(c)).cloned().collect()),
        }
    }

    /// Whether it holds any of `ips`.
    pub fn holds_any(&self, ips: &BTreeSet<IpAddr>) -> bool {
        self.addresses
            .iter()
            .filter(|(c, _)| self.only.as_ref().is_none_or(|o| o.contains(*c)))
            .any(|(_, a)| !a.is_disjoint(ips))
    }
}

/// One stream, as far as withdrawals go.
#[derive(Debug)]
struct Stream {
    /// Its proxy's pod, as a withdrawal names it pending (`namespace/name`).
    name: Arc<str>,
    /// The number of its last EDS send.
    seq: u64,
    latest: EdsView,
    /// Its last ACKed send (what the proxy holds when it NACKed those after).
    acked: Option<(u64, EdsView)>,
    /// Sends not answered yet: number, the type's version, view.
    unanswered: VecDeque<(u64, String, EdsView)>,
    /// The withdrawn pods it is pending for.
    pending_for: BTreeSet<PodKey>,
}

/// Where one waited-for stream stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// Not confirmed; the number of the last send that held the pod.
    Pending {
        last_with: u64,
    },
    Confirmed,
    Gone,
}

/// The streams one withdrawal waits for, with its counts and its pending
/// streams' names kept as they change: where it stands is read at every
/// confirmation, so reading it must not walk every stream (at 1,000
/// subscribers, naming each of 1,000 at each of 1,000 confirmations of
/// each withdrawn pod was most of the server's time).
#[derive(Debug, Default)]
struct Waits {
    by_stream: BTreeMap<StreamId, Wait>,
    confirmed: usize,
    gone: usize,
    /// The pending ones, by name.
    pending: BTreeSet<(Arc<str>, StreamId)>,
}

impl Waits {
    /// Stream `id`, named `name`, now stands at `wait`: what it stood at.
    fn set(&mut self, id: StreamId, name: &Arc<str>, wait: Wait) -> Option<Wait> {
        let before = self.by_stream.insert(id, wait);
        match before {
            Some(Wait::Confirmed) => self.confirmed -= 1,
            Some(Wait::Gone) => self.gone -= 1,
            Some(Wait::Pending { .. }) => {
                self.pending.remove(&(Arc::clone(name), id));
            }
            None => {}
        }
        match wait {
            Wait::Confirmed => self.confirmed += 1,
            Wait::Gone => self.gone += 1,
            Wait::Pending { .. } => {
                self.pending.insert((Arc::clone(name), id));
            }
        }
        before
    }

    fn get(&self, id: StreamId) -> Option<Wait> {
        self.by_stream.get(&id).copied()
    }

    fn len(&self) -> usize {
        self.by_stream.len()
    }

    fn is_empty(&self) -> bool {
        self.by_stream.is_empty()
    }

    fn streams(&self) -> impl Iterator<Item = &StreamId> {
        self.by_stream.keys()
    }

    /// The first `max` names pending, sorted, each once.
    fn pending_names(&self, max: usize) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for (name, _) in &self.pending {
            if names.len() == max {
                break;
            }
            if names.last().is_none_or(|last| **last != **name) {
                names.push(name.to_string());
            }
        }
        names
    }
}

/// One withdrawn pod.
#[derive(Debug)]
struct Withdrawal {
    addresses: BTreeSet<IpAddr>,
    started: Instant,
    /// Proxies still pending then are given up on.
    deadline: Instant,
    waits: Waits,
    last_confirmed: Option<Instant>,
    done: bool,
    /// Done at the deadline, with proxies still pending.
    timed_out: bool,
}

/// Where the withdrawal of one pod stands: what the server tells the
/// pod's own agent (`remora.v1.Withdrawal`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    /// Proxies waited for: confirmed, gone and pending.
    pub expected: usize,
    pub confirmed: usize,
    /// Streams that ended before confirming.
    pub gone: usize,
    /// The pods of the proxies still pending, sorted, at most
    /// [`MAX_WITHDRAWAL_PENDING_NAMES`] (`namespace/name`).
    pub pending: Vec<String>,
    /// None pending, or given up on those pending (`timed_out`).
    pub done: bool,
    /// Done at the withdrawal timeout: `pending` never confirmed.
    pub timed_out: bool,
    /// From the withdrawal to the last confirmation so far.
    pub last_confirmation: Option<Duration>,
}

impl Progress {
    /// Proxies still pending (all of them, not only those named).
    pub fn pending_count(&self) -> usize {
        self.expected - self.confirmed - self.gone
    }
}

/// One pod's withdrawal changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Changed {
    pub pod: PodKey,
    pub progress: Progress,
    /// It has just become done.
    pub settled: bool,
}

/// Every withdrawal in progress and the EDS sends of every stream, pure.
#[derive(Debug, Default)]
pub struct Withdrawals {
    streams: HashMap<StreamId, Stream>,
    pods: BTreeMap<PodKey, Withdrawal>,
}

impl Withdrawals {
    /// `pod` withdrawn at `now`, its addresses `addresses`: every stream
    /// whose last EDS send holds one is waited for, for `bound` at most.
    /// Replaces a withdrawal of the same pod in progress.
    pub fn withdraw(
        &mut self,
        pod: PodKey,
        addresses: BTreeSet<IpAddr>,
        now: Instant,
        bound: Duration,
    ) -> Progress {
        self.restore(&pod);
        let mut waits = Waits::default();
        for (id, s) in &mut self.streams {
            // The last send that holds it, of those the proxy may hold.
            let sent = std::iter::once((s.seq, &s.latest))
                .chain(s.unanswered.iter().map(|(n, _, v)| (*n, v)))
                .chain(s.acked.iter().map(|(n, v)| (*n, v)));
            if let Some(last_with) = sent
                .filter(|(_, v)| v.holds_any(&addresses))
                .map(|(n, _)| n)
                .max()
            {
                waits.set(*id, &s.name, Wait::Pending { last_with });
                s.pending_for.insert(pod.clone());
            }
        }
        let w = Withdrawal {
            done: waits.is_empty(),
            addresses,
            started: now,
            deadline: now + bound,
            waits,
            last_confirmed: None,
            timed_out: false,
        };
        let progress = progress_of(&w);
        self.pods.insert(pod, w);
        progress
    }

    /// `pod`'s withdrawal forgotten (Ready again, or gone from the
    /// watch): where it stood, if there was one.
    pub fn restore(&mut self, pod: &PodKey) -> Option<Progress> {
        let w = self.pods.remove(pod)?;
        for id in w.waits.streams() {
            if let Some(s) = self.streams.get_mut(id) {
                s.pending_for.remove(pod);
            }
        }
        Some(progress_of(&w))
    }

    /// Stream `id` (of pod `pod`'s proxy) sent EDS version `version`,
    /// after which its proxy holds `view`.
    pub fn sent(
        &mut self,
        id: StreamId,
        pod: &PodKey,
        version: &str,
        view: EdsView,
    ) -> Vec<Changed> {
        let s = self.streams.entry(id).or_insert_with(|| Stream {
            name: format!("{}/{}", pod.namespace, pod.name).into(),
            seq: 0,
            latest: EdsView::default(),
            acked: None,
            unanswered: VecDeque::new(),
            pending_for: BTreeSet::new(),
        });
        s.seq += 1;
        let seq = s.seq;
        s.unanswered
            .push_back((seq, version.to_string(), view.clone()));
        if s.unanswered.len() > MAX_UNANSWERED {
            s.unanswered.pop_front();
        }
        // Sent a withdrawn pod (a response computed before the
        // withdrawal): waited for until it confirms, as if it had held it
        // then, even if the withdrawal was done meanwhile.
        let mut touched = Vec::new();
        for (p, w) in &mut self.pods {
            if !view.holds_any(&w.addresses) {
                continue;
            }
            let before = w.waits.set(id, &s.name, Wait::Pending { last_with: seq });
            s.pending_for.insert(p.clone());
            if !matches!(before, Some(Wait::Pending { .. })) {
                // Past its deadline, the next expiry gives up on it again.
                w.done = false;
                w.timed_out = false;
                touched.push(p.clone());
            }
        }
        s.latest = view;
        touched
            .into_iter()
            .filter_map(|p| self.changed(p, false))
            .collect()
    }

    /// Stream `id`'s proxy answered its EDS send of version `version`:
    /// an ACK, or a NACK (`acked` false).
    pub fn answered(
        &mut self,
        id: StreamId,
        version: &str,
        acked: bool,
        now: Instant,
    ) -> Vec<Changed> {
        let Some(s) = self.streams.get_mut(&id) else {
            return Vec::new();
        };
        // The oldest unanswered send of that version: Envoy answers in order.
        let Some(at) = s.unanswered.iter().position(|(_, v, _)| v == version) else {
            return Vec::new();
        };
        let mut older = s.unanswered.drain(..=at);
        let Some((seq, _, view)) = older.next_back() else {
            return Vec::new();
        };
        drop(older);
        if !acked {
            return Vec::new();
        }
        s.acked = Some((seq, view.clone()));
        let mut confirmed = Vec::new();
        for p in &s.pending_for {
            let Some(w) = self.pods.get_mut(p) else {
                continue;
            };
            if matches!(w.waits.get(id), Some(Wait::Pending { last_with }) if seq > last_with)
                && !view.holds_any(&w.addresses)
            {
                w.waits.set(id, &s.name, Wait::Confirmed);
                w.last_confirmed = Some(now);
                confirmed.push(p.clone());
            }
        }
        for p in &confirmed {
            s.pending_for.remove(p);
        }
        confirmed
            .into_iter()
            .filter_map(|p| self.changed(p, true))
            .collect()
    }

    /// Stream `id` ended: no longer waited for.
    pub fn gone(&mut self, id: StreamId) -> Vec<Changed> {
        let Some(s) = self.streams.remove(&id) else {
            return Vec::new();
        };
        let mut touched = Vec::new();
        for p in s.pending_for {
            if let Some(w) = self.pods.get_mut(&p)
                && w.waits.get(id).is_some()
            {
                w.waits.set(id, &s.name, Wait::Gone);
                touched.push(p);
            }
        }
        touched
            .into_iter()
            .filter_map(|p| self.changed(p, true))
            .collect()
    }

    /// Withdrawals whose deadline has come by `now` with proxies still
    /// pending: done and timed out, the pending ones named in their
    /// progress (they stay pending: an ACK still confirms, for the count).
    pub fn expire(&mut self, now: Instant) -> Vec<Changed> {
        let due: Vec<PodKey> = self
            .pods
            .iter()
            .filter(|(_, w)| !w.done && w.deadline <= now)
            .map(|(p, _)| p.clone())
            .collect();
        let mut changed = Vec::new();
        for pod in due {
            if let Some(w) = self.pods.get_mut(&pod) {
                w.done = true;
                w.timed_out = true;
            }
            if let Some(p) = self.progress(&pod) {
                changed.push(Changed {
                    pod,
                    progress: p,
                    settled: true,
                });
            }
        }
        changed
    }

    /// The earliest deadline of a withdrawal not done.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.pods
            .values()
            .filter(|w| !w.done)
            .map(|w| w.deadline)
            .min()
    }

    /// Where `pod`'s withdrawal stands, if it is withdrawn.
    pub fn progress(&self, pod: &PodKey) -> Option<Progress> {
        Some(progress_of(self.pods.get(pod)?))
    }

    /// Whether `pod` is withdrawn (its progress, without reading it).
    pub fn is_withdrawn(&self, pod: &PodKey) -> bool {
        self.pods.contains_key(pod)
    }

    /// Streams known (sent EDS at least once, not ended).
    pub fn streams(&self) -> usize {
        self.streams.len()
    }

    /// `pod`'s withdrawal changed; done if nothing is pending and `may_settle`.
    fn changed(&mut self, pod: PodKey, may_settle: bool) -> Option<Changed> {
        let w = self.pods.get_mut(&pod)?;
        let settled = may_settle && w.waits.pending.is_empty() && !w.done;
        w.done |= settled;
        let progress = progress_of(w);
        Some(Changed {
            pod,
            progress,
            settled,
        })
    }
}

fn progress_of(w: &Withdrawal) -> Progress {
    Progress {
        expected: w.waits.len(),
        confirmed: w.waits.confirmed,
        gone: w.waits.gone,
        pending: w.waits.pending_names(MAX_WITHDRAWAL_PENDING_NAMES),
        done: w.done,
        timed_out: w.timed_out,
        last_confirmation: w.last_confirmed.map(|t| t.duration_since(w.started)),
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

/// Withdrawal metrics (`remora_operator_xds_withdrawal_*`).
#[derive(Clone, Debug)]
pub struct WithdrawalMetrics {
    confirmation: Histogram,
    unconfirmed: Family<OutcomeLabel, Counter>,
}

impl Default for WithdrawalMetrics {
    fn default() -> Self {
        Self {
            // 1 ms to ~65 s.
            confirmation: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            unconfirmed: Family::default(),
        }
    }
}

impl WithdrawalMetrics {
    /// Export under `registry` (the operator's).
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("xds");
        r.register(
            "withdrawal_confirmation_seconds",
            "From a pod's withdrawal to the last confirmation by a proxy that held it, per withdrawal with at least one",
            self.confirmation.clone(),
        );
        r.register(
            "withdrawal_unconfirmed",
            "Proxies waited for that never confirmed a withdrawal, by outcome (gone: the stream ended; abandoned: the withdrawal ended first; timed_out: the pod's withdrawal timeout passed)",
            self.unconfirmed.clone(),
        );
    }

    pub fn unconfirmed_total(&self, outcome: &'static str) -> u64 {
        self.unconfirmed
            .get_or_create(&OutcomeLabel { outcome })
            .get()
    }

    /// Withdrawals with a confirmation time observed (for tests: read
    /// back through the text encoding, as a scrape would).
    pub fn confirmations_observed(&self) -> u64 {
        let mut text = String::new();
        let mut r = Registry::default();
        self.register(&mut r);
        let _ = prometheus_client::encoding::text::encode(&mut text, &r);
        text.lines()
            .find_map(|l| l.strip_prefix("xds_withdrawal_confirmation_seconds_count "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// The shared [`Withdrawals`]: what the feed and every stream call, with a
/// notification of each change ([`Tracker::changes`]) and the metrics.
#[derive(Debug)]
pub struct Tracker {
    state: Mutex<Withdrawals>,
    changes: watch::Sender<u64>,
    pub metrics: WithdrawalMetrics,
}

impl Default for Tracker {
    fn default() -> Self {
        Self {
            state: Mutex::default(),
            changes: watch::Sender::new(0),
            metrics: WithdrawalMetrics::default(),
        }
    }
}

impl Tracker {
    fn with<T>(&self, f: impl FnOnce(&mut Withdrawals) -> T) -> T {
        f(&mut self.state.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn notify(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    /// See [`Withdrawals::withdraw`].
    pub fn withdraw(
        &self,
        pod: PodKey,
        addresses: BTreeSet<IpAddr>,
        now: Instant,
        bound: Duration,
    ) -> Progress {
        let abandoned = self.with(|w| w.restore(&pod));
        self.abandoned(abandoned);
        let p = self.with(|w| w.withdraw(pod, addresses, now, bound));
        self.notify();
        p
    }

    /// See [`Withdrawals::restore`]; proxies still pending are counted as
    /// never confirmed.
    pub fn restore(&self, pod: &PodKey) -> Option<Progress> {
        let p = self.with(|w| w.restore(pod));
        self.abandoned(p.clone());
        if p.is_some() {
            self.notify();
        }
        p
    }

    fn abandoned(&self, p: Option<Progress>) {
        // Given up on already: counted then.
        if let Some(p) = p.filter(|p| p.pending_count() > 0 && !p.timed_out) {
            self.metrics
                .unconfirmed
                .get_or_create(&OutcomeLabel {
                    outcome: "abandoned",
                })
                .inc_by(p.pending_count() as u64);
        }
    }

    /// See [`Withdrawals::sent`].
    pub fn sent(&self, id: StreamId, pod: &PodKey, version: &str, view: EdsView) -> Vec<Changed> {
        let c = self.with(|w| w.sent(id, pod, version, view));
        self.settle(c)
    }

    /// See [`Withdrawals::answered`].
    pub fn answered(&self, id: StreamId, version: &str, acked: bool, now: Instant) -> Vec<Changed> {
        let c = self.with(|w| w.answered(id, version, acked, now));
        self.settle(c)
    }

    /// See [`Withdrawals::gone`]; counted as never confirmed.
    pub fn gone(&self, id: StreamId) -> Vec<Changed> {
        let c = self.with(|w| w.gone(id));
        if !c.is_empty() {
            self.metrics
                .unconfirmed
                .get_or_create(&OutcomeLabel { outcome: "gone" })
                .inc_by(c.len() as u64);
        }
        self.settle(c)
    }

    /// The settled ones observed, every change notified.
    fn settle(&self, changed: Vec<Changed>) -> Vec<Changed> {
        for c in changed.iter().filter(|c| c.settled) {
            if let Some(t) = c.progress.last_confirmation {
                self.metrics.confirmation.observe(t.as_secs_f64());
            }
        }
        if !changed.is_empty() {
            self.notify();
        }
        changed
    }

    /// See [`Withdrawals::expire`]; the proxies given up on are counted as
    /// never confirmed.
    pub fn expire(&self, now: Instant) -> Vec<Changed> {
        let c = self.with(|w| w.expire(now));
        let given_up: usize = c.iter().map(|c| c.progress.pending_count()).sum();
        if given_up > 0 {
            self.metrics
                .unconfirmed
                .get_or_create(&OutcomeLabel {
                    outcome: "timed_out",
                })
                .inc_by(given_up as u64);
        }
        if !c.is_empty() {
            self.notify();
        }
        c
    }

    /// See [`Withdrawals::next_deadline`].
    pub fn next_deadline(&self) -> Option<Instant> {
        self.with(|w| w.next_deadline())
    }

    /// Where `pod`'s withdrawal stands, if it is withdrawn.
    pub fn progress(&self, pod: &PodKey) -> Option<Progress> {
        self.with(|w| w.progress(pod))
    }

    /// See [`Withdrawals::is_withdrawn`].
    pub fn is_withdrawn(&self, pod: &PodKey) -> bool {
        self.with(|w| w.is_withdrawn(pod))
    }

    /// Changes with each withdrawal's progress.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Returns `pod`'s progress once `f` holds of it (or of its absence).
    pub async fn wait_for(
        &self,
        pod: &PodKey,
        f: impl Fn(Option<&Progress>) -> bool,
    ) -> Option<Progress> {
        let mut changes = self.changes();
        loop {
            let p = self.progress(pod);
            if f(p.as_ref()) {
                return p;
            }
            if changes.changed().await.is_err() {
                return p;
            }
        }
    }
}

/// The Warning Event on a pod whose withdrawal timed out, naming the
/// proxies that never confirmed (at most [`MAX_WITHDRAWAL_PENDING_NAMES`]).
pub fn raise_timed_out(events: &PodEvents, pod: &PodKey, p: &Progress) {
    let mut names = p.pending.join(", ");
    if p.pending_count() > p.pending.len() {
        names.push_str(&format!(
            " and {} more",
            p.pending_count() - p.pending.len()
        ));
    }
    events.warn(Warning {
        namespace: pod.namespace.clone(),
        pod: pod.name.clone(),
        reason: "EndpointsWithdrawalTimedOut",
        action: "WithdrawEndpoints",
        note: format!(
            "{} of {} proxies did not confirm within the pod's withdrawal timeout that they stopped routing to it: {names}",
            p.pending_count(),
            p.expected,
        ),
    });
}

/// The Event on a pod whose withdrawal is done, for the proxies that
/// held it (none: no Event, nothing was waited for).
pub fn raise_done(events: &PodEvents, pod: &PodKey, p: &Progress) {
    if p.expected == 0 {
        return;
    }
    let ms = p.last_confirmation.unwrap_or_default().as_millis();
    let mut note = format!(
        "{} of {} proxies confirmed in {ms} ms",
        p.confirmed, p.expected
    );
    if p.gone > 0 {
        note.push_str(&format!(" ({} disconnected before confirming)", p.gone));
    }
    events.normal(Warning {
        namespace: pod.namespace.clone(),
        pod: pod.name.clone(),
        reason: "EndpointsWithdrawn",
        action: "WithdrawEndpoints",
        note,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(n: &str) -> PodKey {
        PodKey {
            namespace: "shop".into(),
            name: n.into(),
        }
    }

    fn ips(a: &[&str]) -> BTreeSet<IpAddr> {
        a.iter().map(|i| i.parse().expect("ip")).collect()
    }

    /// A snapshot's load assignments: cluster → addresses.
    fn eds(clusters: &[(&str, &[&str])]) -> Arc<EndpointAddresses> {
        Arc::new(
            clusters
                .iter()
                .map(|(c, a)| (c.to_string(), ips(a)))
                .collect(),
        )
    }

    fn all(a: &Arc<EndpointAddresses>) -> EdsView {
        EdsView::new(a, |_| true)
    }

    /// The pods' withdrawal timeout.
    const BOUND: Duration = Duration::from_secs(5);

    const A: &str = "10.0.0.1";
    const B: &str = "10.0.0.2";

    #[test]
    fn a_view_holds_only_the_clusters_the_proxy_holds() {
        let a = eds(&[("cart", &[A]), ("db", &[B])]);
        assert!(all(&a).holds_any(&ips(&[B])));
        let only_cart = EdsView::new(&a, |c| c == "cart");
        assert!(only_cart.holds_any(&ips(&[A])));
        assert!(!only_cart.holds_any(&ips(&[B])));
        assert!(!all(&a).holds_any(&ips(&["10.9.9.9"])));
    }

    #[test]
    fn an_ack_without_the_pod_confirms_one_with_it_or_a_nack_does_not() {
        let t0 = Instant::now();
        let mut w = Withdrawals::default();
        let with = eds(&[("cart", &[A, B])]);
        let without = eds(&[("cart", &[B])]);
        let (p1, p2, p3) = (pod("c-1"), pod("c-2"), pod("c-3"));
        for (id, p) in [(1, &p1), (2, &p2), (3, &p3)] {
            w.sent(id, p, "v1", all(&with));
            w.answered(id, "v1", true, t0);
        }
        let progress = w.withdraw(pod("cart-0"), ips(&[A]), t0, BOUND);
        assert_eq!((progress.expected, progress.done), (3, false));
        assert_eq!(progress.pending, ["shop/c-1", "shop/c-2", "shop/c-3"]);

        for id in 1..=3 {
            assert!(w.sent(id, &pod("x"), "v2", all(&without)).is_empty());
        }
        // An ACK of the older version (still holding the pod): nothing.
        assert!(w.answered(1, "v1", true, t0).is_empty());
        // A NACK of the one without it: nothing.
        assert!(w.answered(2, "v2", false, t0).is_empty());
        let c = w.answered(1, "v2", true, t0 + Duration::from_millis(5));
        assert_eq!(c.len(), 1);
        assert_eq!(
            (
                c[0].progress.confirmed,
                c[0].progress.pending_count(),
                c[0].settled
            ),
            (1, 2, false)
        );
        let c = w.answered(3, "v2", true, t0 + Duration::from_millis(9));
        assert_eq!(c[0].progress.pending, ["shop/c-2"]);
        // c-2 NACKed v2; it ACKs a later v3, still without the pod.
        w.sent(2, &p2, "v3", all(&without));
        let c = w.answered(2, "v3", true, t0 + Duration::from_millis(38));
        assert!(c[0].settled);
        let p = &c[0].progress;
        assert_eq!((p.expected, p.confirmed, p.gone, p.done), (3, 3, 0, true));
        assert_eq!(p.last_confirmation, Some(Duration::from_millis(38)));
        assert!(p.pending.is_empty());
        // Done once: a later ACK changes nothing.
        assert!(w.answered(2, "v3", true, t0).is_empty());
    }

    #[test]
    fn a_proxy_that_refused_the_version_without_the_pod_still_holds_it() {
        let t0 = Instant::now();
        let mut w = Withdrawals::default();
        let with = eds(&[("cart", &[A])]);
        let without = eds(&[("cart", &[])]);
        w.sent(1, &pod("c-1"), "v1", all(&with));
        w.answered(1, "v1", true, t0);
        w.sent(1, &pod("c-1"), "v2", all(&without));
        w.answered(1, "v2", false, t0);
        // Its last send lacks the pod, but it keeps v1, which holds it.
        let p = w.withdraw(pod("cart-0"), ips(&[A]), t0, BOUND);
        assert_eq!(p.pending, ["shop/c-1"]);
        w.sent(1, &pod("c-1"), "v3", all(&without));
        assert!(w.answered(1, "v3", true, t0)[0].settled);
    }

    #[test]
    fn a_stream_that_ends_is_gone_not_waited_for() {
        let t0 = Instant::now();
        let mut w = Withdrawals::default();
        let with = eds(&[("cart", &[A])]);
        w.sent(1, &pod("c-1"), "v1", all(&with));
        w.sent(2, &pod("c-2"), "v1", all(&with));
        w.withdraw(pod("cart-0"), ips(&[A]), t0, BOUND);
        w.sent(1, &pod("c-1"), "v2", all(&eds(&[("cart", &[])])));
        let c = w.answered(1, "v2", true, t0 + Duration::from_millis(3));
        assert!(!c[0].settled);
        let c = w.gone(2);
        assert!(c[0].settled);
        let p = &c[0].progress;
        assert_eq!((p.expected, p.confirmed, p.gone), (2, 1, 1));
        assert_eq!(p.last_confirmation, Some(Duration::from_millis(3)));
        assert_eq!(w.streams(), 1);
        assert!(w.gone(2).is_empty(), "once");
    }

    #[test]
    fn a_proxy_first_sent_endpoints_after_the_withdrawal_is_not_waited_for() {
        let t0 = Instant::now();
        let mut w = Withdrawals::default();
        let with = eds(&[("cart", &[A])]);
        let without = eds(&[("cart", &[])]);
        w.sent(1, &pod("c-1"), "v1", all(&with));
        w.withdraw(pod("cart-0"), ips(&[A]), t0, BOUND);
        // A new stream, sent the load assignment without the pod.
        assert!(w.sent(2, &pod("c-2"), "v2", all(&without)).is_empty());
        assert_eq!(w.progress(&pod("cart-0")).expect("withdrawn").expected, 1);
        // A proxy not holding the pod at all is not waited for either.
        let mut w2 = Withdrawals::default();
        w2.sent(1, &pod("c-1"), "v0", all(&without));
        let p = w2.withdraw(pod("cart-0"), ips(&[A]), t0, BOUND);
        assert_eq!((p.expected, p.done), (0, true));
    }

    #[test]
    fn a_push_computed_before_the_withdrawal_is_waited_for() {
        let t0 = Instant::now();
        let mut w = Withdrawals::default();
        let with = eds(&[("cart", &[A])]);
        // Nobody held it: done at once.
        let p = w.withdraw(pod("cart-0"), ips(&[A]), t0, BOUND);
        assert_eq!((p.expected, p.done), (0, true));
        // Computed before the withdrawal, sent after it: it holds the pod,
        // and is waited for after all.
        let c = w.sent(1, &pod("c-1"), "v1", all(&with));
        assert_eq!((c[0].progress.expected, c[0].progress.done), (1, false));
        // Acked: still holding it, not confirmed.
        assert!(w.answered(1, "v1", true, t0).is_empty());
        w.sent(1, &pod("c-1"), "v2", all(&eds(&[("cart", &[])])));
        let c = w.answered(1, "v2", true, t0 + Duration::from_millis(1));
        assert!(c[0].settled);
    }

    #[test]
    fn concurrent_withdrawals_are_confirmed_each_by_what_it_held() {
        let t0 = Instant::now();
        let mut w = Withdrawals::default();
        let both = eds(&[("cart", &[A]), ("db", &[B])]);
        w.sent(1, &pod("c-1"), "v1", all(&both));
        w.sent(2, &pod("c-2"), "v1", EdsView::new(&both, |c| c == "db"));
        let pa = w.withdraw(pod("cart-0"), ips(&[A]), t0, BOUND);
        let pb = w.withdraw(pod("db-0"), ips(&[B]), t0, BOUND);
        assert_eq!((pa.expected, pb.expected), (1, 2));
        // c-1 drops cart-0 only: cart-0 is done, db-0 still waits for it.
        w.sent(
            1,
            &pod("c-1"),
            "v2",
            all(&eds(&[("cart", &[]), ("db", &[B])])),
        );
        let c = w.answered(1, "v2", true, t0 + Duration::from_millis(2));
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].pod, pod("cart-0"));
        assert!(c[0].settled);
        let db = w.progress(&pod("db-0")).expect("withdrawn");
        assert_eq!(db.pending, ["shop/c-1", "shop/c-2"]);
        // Ready again: forgotten, with two never confirmed.
        let p = w.restore(&pod("db-0")).expect("was withdrawn");
        assert_eq!(p.pending_count(), 2);
        assert!(w.progress(&pod("db-0")).is_none());
        // An ACK of a view without db-0 now confirms nothing.
        w.sent(2, &pod("c-2"), "v2", all(&eds(&[])));
        assert!(w.answered(2, "v2", true, t0).is_empty());
    }

    /// Pushes coalesced per stream: one send removes several withdrawn
    /// pods, and its ACK confirms each of them.
    #[test]
    fn one_send_without_several_withdrawn_pods_confirms_them_all() {
        let t0 = Instant::now();
        let mut w = Withdrawals::default();
        let c = "10.0.0.3";
        w.sent(1, &pod("c-1"), "v1", all(&eds(&[("cart", &[A, B, c])])));
        w.answered(1, "v1", true, t0);
        for (p, ip) in [("cart-0", A), ("cart-1", B), ("cart-2", c)] {
            assert_eq!(w.withdraw(pod(p), ips(&[ip]), t0, BOUND).expected, 1);
        }
        assert!(
            w.sent(1, &pod("c-1"), "v2", all(&eds(&[("cart", &[])])))
                .is_empty()
        );
        let done = w.answered(1, "v2", true, t0 + Duration::from_millis(7));
        let pods: Vec<_> = done.iter().map(|c| c.pod.name.as_str()).collect();
        assert_eq!(pods, ["cart-0", "cart-1", "cart-2"]);
        assert!(done.iter().all(|c| c.settled && c.progress.confirmed == 1));
    }

    /// An ACK of an older send confirms only what that send removed, not
    /// a pod that only a newer send (unanswered yet) removed.
    #[test]
    fn an_ack_of_an_older_send_confirms_only_what_it_removed() {
        let t0 = Instant::now();
        let mut w = Withdrawals::default();
        w.sent(1, &pod("c-1"), "v1", all(&eds(&[("cart", &[A, B])])));
        w.answered(1, "v1", true, t0);
        w.withdraw(pod("cart-0"), ips(&[A]), t0, BOUND);
        w.sent(1, &pod("c-1"), "v2", all(&eds(&[("cart", &[B])])));
        w.withdraw(pod("cart-1"), ips(&[B]), t0, BOUND);
        w.sent(1, &pod("c-1"), "v3", all(&eds(&[("cart", &[])])));
        let c = w.answered(1, "v2", true, t0);
        assert_eq!(c.len(), 1);
        assert_eq!((c[0].pod.name.as_str(), c[0].settled), ("cart-0", true));
        let p = w.progress(&pod("cart-1")).expect("withdrawn");
        assert_eq!(
            (p.confirmed, p.pending.as_slice()),
            (0, &["shop/c-1".to_string()][..])
        );
        let c = w.answered(1, "v3", true, t0);
        assert_eq!((c[0].pod.name.as_str(), c[0].settled), ("cart-1", true));
    }

    /// The counts and names kept as streams change, not recounted: two
    /// streams of one pod (a reconnect) are named once and counted twice.
    #[test]
    fn counts_and_names_follow_each_stream() {
        let t0 = Instant::now();
        let mut w = Withdrawals::default();
        let with = eds(&[("cart", &[A])]);
        let without = eds(&[("cart", &[])]);
        w.sent(1, &pod("c-1"), "v1", all(&with));
        w.sent(2, &pod("c-1"), "v1", all(&with));
        w.sent(3, &pod("c-0"), "v1", all(&with));
        let p = w.withdraw(pod("cart-0"), ips(&[A]), t0, BOUND);
        assert_eq!((p.expected, p.pending_count()), (3, 3));
        assert_eq!(p.pending, ["shop/c-0", "shop/c-1"]);
        w.sent(2, &pod("c-1"), "v2", all(&without));
        let c = w.answered(2, "v2", true, t0);
        let p = &c[0].progress;
        assert_eq!((p.confirmed, p.pending_count()), (1, 2));
        assert_eq!(p.pending, ["shop/c-0", "shop/c-1"], "c-1's other stream");
        let p = &w.gone(1)[0].progress;
        assert_eq!(
            (p.confirmed, p.gone, p.pending.as_slice()),
            (1, 1, &["shop/c-0".to_string()][..])
        );
        // Sent the pod again (computed before the withdrawal): pending anew.
        let p = &w.sent(2, &pod("c-1"), "v1", all(&with))[0].progress;
        assert_eq!(
            (p.expected, p.confirmed, p.gone, p.pending_count()),
            (3, 0, 1, 2)
        );
        assert_eq!(p.pending, ["shop/c-0", "shop/c-1"]);
    }

    #[test]
    fn pending_names_are_bounded() {
        let t0 = Instant::now();
        let mut w = Withdrawals::default();
        let with = eds(&[("cart", &[A])]);
        let n = MAX_WITHDRAWAL_PENDING_NAMES + 10;
        for id in 0..n as u64 {
            w.sent(id, &pod(&format!("c-{id:03}")), "v1", all(&with));
        }
        let p = w.withdraw(pod("cart-0"), ips(&[A]), t0, BOUND);
        assert_eq!(p.expected, n);
        assert_eq!(p.pending_count(), n);
        assert_eq!(p.pending.len(), MAX_WITHDRAWAL_PENDING_NAMES);
    }

    #[tokio::test(start_paused = true)]
    async fn the_tracker_notifies_counts_and_observes() {
        let t = Arc::new(Tracker::default());
        let with = eds(&[("cart", &[A])]);
        t.sent(1, &pod("c-1"), "v1", all(&with));
        t.sent(2, &pod("c-2"), "v1", all(&with));
        let t0 = Instant::now();
        t.withdraw(pod("cart-0"), ips(&[A]), t0, BOUND);
        let waiter = tokio::spawn({
            let t = Arc::clone(&t);
            async move {
                t.wait_for(&pod("cart-0"), |p| p.is_some_and(|p| p.done))
                    .await
            }
        });
        tokio::time::advance(Duration::from_millis(20)).await;
        t.sent(1, &pod("c-1"), "v2", all(&eds(&[("cart", &[])])));
        t.answered(1, "v2", true, Instant::now());
        t.gone(2);
        let p = waiter.await.expect("waited").expect("withdrawn");
        assert_eq!((p.confirmed, p.gone, p.done), (1, 1, true));
        assert_eq!(p.last_confirmation, Some(Duration::from_millis(20)));
        assert_eq!(t.metrics.unconfirmed_total("gone"), 1);
        assert_eq!(t.metrics.confirmations_observed(), 1);
        // A second withdrawal abandoned with one pending.
        t.sent(3, &pod("c-3"), "v1", all(&with));
        t.withdraw(pod("cart-1"), ips(&[A]), t0, BOUND);
        t.restore(&pod("cart-1"));
        assert_eq!(t.metrics.unconfirmed_total("abandoned"), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_proxy_that_never_confirms_is_given_up_on_at_the_bound() {
        let t = Tracker::default();
        let with = eds(&[("cart", &[A])]);
        let without = eds(&[("cart", &[])]);
        t.sent(1, &pod("c-1"), "v1", all(&with));
        t.sent(2, &pod("c-2"), "v1", all(&with));
        let t0 = Instant::now();
        t.withdraw(pod("cart-0"), ips(&[A]), t0, BOUND);
        assert_eq!(t.next_deadline(), Some(t0 + BOUND));
        t.sent(1, &pod("c-1"), "v2", all(&without));
        t.answered(1, "v2", true, t0 + Duration::from_millis(4));
        // Not yet due.
        assert!(t.expire(t0 + BOUND - Duration::from_millis(1)).is_empty());
        let c = t.expire(t0 + BOUND);
        assert_eq!(c.len(), 1);
        assert!(c[0].settled);
        let p = &c[0].progress;
        assert_eq!(
            (p.expected, p.confirmed, p.done, p.timed_out),
            (2, 1, true, true)
        );
        assert_eq!(p.pending, ["shop/c-2"], "named");
        assert_eq!(t.metrics.unconfirmed_total("timed_out"), 1);
        assert_eq!(t.next_deadline(), None, "nothing left to time");
        assert!(t.expire(t0 + 2 * BOUND).is_empty(), "once");
        // Forgotten later: not counted again as abandoned.
        t.restore(&pod("cart-0"));
        assert_eq!(t.metrics.unconfirmed_total("abandoned"), 0);
        // A withdrawal confirmed in time never times out.
        t.withdraw(pod("cart-1"), ips(&[A]), t0, BOUND);
        t.sent(2, &pod("c-2"), "v2", all(&without));
        t.answered(2, "v2", true, t0);
        t.sent(1, &pod("c-1"), "v3", all(&without));
        assert!(t.expire(t0 + BOUND).is_empty());
    }

    #[test]
    fn the_timeout_event_names_the_pending_and_counts_the_rest() {
        let (events, mut rx) = PodEvents::channel_for_tests();
        let p = Progress {
            expected: 40,
            confirmed: 2,
            pending: (0..MAX_WITHDRAWAL_PENDING_NAMES)
                .map(|i| format!("shop/c-{i:02}"))
                .collect(),
            done: true,
            timed_out: true,
            ..Progress::default()
        };
        raise_timed_out(&events, &pod("cart-0"), &p);
        let w = rx.try_recv().expect("an Event");
        assert_eq!(w.reason, "EndpointsWithdrawalTimedOut");
        assert!(w.note.starts_with("38 of 40 proxies"), "{}", w.note);
        assert!(w.note.contains("shop/c-00, shop/c-01"), "{}", w.note);
        assert!(w.note.ends_with("and 6 more"), "{}", w.note);
    }
}
