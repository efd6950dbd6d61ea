//! The table of open connections, oldest first, and who gets evicted when
//! it is full: the oldest connection with no request in flight, of the
//! source address that holds the most such connections. A flood from one
//! client (a pod on the network) therefore only ever evicts its own
//! connections, never the kubelet's probe or the API server's.
//!
//! A source evicts its own connections only once they have been open
//! [`Limits::evict_after`](crate::Limits::evict_after): a newcomer that
//! finds none that old is parked instead (see the crate doc). Evicting at
//! once would let a client that reconnects as soon as it is closed spin the
//! accept loop as fast as the CPU allows, and the kernel's listen queue
//! would then overflow with its SYNs, the probe's among them.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::Metrics;

/// A connection's place in the table.
pub(crate) struct Slot {
    pub id: u64,
    /// Requests in flight on this connection.
    pub busy: Arc<AtomicUsize>,
    /// Cancelled when the connection is evicted.
    pub evict: CancellationToken,
}

pub(crate) enum Admission {
    Admitted(Slot),
    /// Full, and no connection may be evicted for this one: every one has
    /// a request in flight, or the candidate is of the newcomer's own
    /// source and younger than `evict_after`.
    Wait,
}

struct Entry {
    source: IpAddr,
    opened: Instant,
    busy: Arc<AtomicUsize>,
    evict: CancellationToken,
}

#[derive(Default)]
pub(crate) struct Table {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    next_id: u64,
    /// Ids grow with time, so the first entry is the oldest.
    open: BTreeMap<u64, Entry>,
}

impl Table {
    /// Make room for a new connection from `source`: at `max`, evict the
    /// oldest idle connection of the source with the most idle ones (the
    /// newcomer counted), if that is another source or the connection is at
    /// least `evict_after` old; otherwise the newcomer waits.
    pub fn admit(
        &self,
        max: usize,
        source: IpAddr,
        evict_after: Duration,
        metrics: &Metrics,
    ) -> Admission {
        let now = Instant::now();
        let mut t = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if t.open.len() >= max {
            let mut idle: HashMap<IpAddr, (usize, u64)> = HashMap::new();
            // Oldest first, so the first id seen per source is its oldest.
            for (id, e) in &t.open {
                if e.busy.load(Ordering::Acquire) == 0 {
                    idle.entry(e.source).or_insert((0, *id)).0 += 1;
                }
            }
            if let Some((n, _)) = idle.get_mut(&source) {
                *n += 1;
            }
            // Most idle connections; on a tie, not the newcomer's source
            // (it is not over its share), then the oldest connection.
            let victim = idle
                .into_iter()
                .max_by_key(|(src, (n, id))| (*n, *src != source, std::cmp::Reverse(*id)))
                .map(|(_, (_, id))| id)
                .filter(|id| {
                    t.open.get(id).is_some_and(|e| {
                        e.source != source || now.saturating_duration_since(e.opened) >= evict_after
                    })
                });
            match victim.and_then(|id| t.open.remove(&id)) {
                Some(e) => {
                    e.evict.cancel();
                    metrics.evicted();
                }
                None => return Admission::Wait,
            }
        }
        let id = t.next_id;
        t.next_id = t.next_id.wrapping_add(1);
        let busy = Arc::new(AtomicUsize::new(0));
        let evict = CancellationToken::new();
        t.open.insert(
            id,
            Entry {
                source,
                opened: now,
                busy: Arc::clone(&busy),
                evict: evict.clone(),
            },
        );
        Admission::Admitted(Slot { id, busy, evict })
    }

    /// Whether a connection can be admitted without evicting one.
    pub fn has_room(&self, max: usize) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .open
            .len()
            < max
    }

    /// The connection ended (a no-op when it was evicted).
    pub fn remove(&self, id: u64) {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .open
            .remove(&id);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .open
            .len()
    }
}

/// Marks a connection busy while a request is being handled on it.
pub(crate) struct BusyGuard(Arc<AtomicUsize>);

impl BusyGuard {
    pub fn new(busy: &Arc<AtomicUsize>) -> Self {
        busy.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(busy))
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

    fn admitted(a: Admission) -> Slot {
        match a {
            Admission::Admitted(s) => s,
            Admission::Wait => panic!("told to wait"),
        }
    }

    #[test]
    fn full_table_evicts_the_oldest_idle_connection() {
        let m = Metrics::default();
        let t = Table::default();
        let a = admitted(t.admit(2, A, Duration::ZERO, &m));
        let b = admitted(t.admit(2, A, Duration::ZERO, &m));
        let _busy_a = BusyGuard::new(&a.busy);
        let c = admitted(t.admit(2, A, Duration::ZERO, &m));
        assert!(!a.evict.is_cancelled(), "a has a request in flight");
        assert!(b.evict.is_cancelled(), "b is the oldest idle one");
        assert!(!c.evict.is_cancelled());
        assert_eq!(t.len(), 2);
        assert_eq!(m.evicted_total(), 1);
    }

    #[test]
    fn full_table_of_busy_connections_makes_the_newcomer_wait() {
        let m = Metrics::default();
        let t = Table::default();
        let a = admitted(t.admit(1, A, Duration::ZERO, &m));
        let _busy = BusyGuard::new(&a.busy);
        assert!(matches!(t.admit(1, B, Duration::ZERO, &m), Admission::Wait));
        assert!(!t.has_room(1));
        drop(_busy);
        let _b = admitted(t.admit(1, A, Duration::ZERO, &m));
        assert!(a.evict.is_cancelled());
    }

    #[test]
    fn a_flood_from_one_source_evicts_only_its_own_connections() {
        let m = Metrics::default();
        let t = Table::default();
        // The probe's connection is the oldest and idle (between requests).
        let probe = admitted(t.admit(3, B, Duration::ZERO, &m));
        let flood: Vec<Slot> = (0..100)
            .map(|_| admitted(t.admit(3, A, Duration::ZERO, &m)))
            .collect();
        assert!(!probe.evict.is_cancelled(), "B holds one; A holds the most");
        assert_eq!(flood.iter().filter(|s| !s.evict.is_cancelled()).count(), 2);
        // A newcomer from B, with B not the largest, still evicts one of A's.
        let probe2 = admitted(t.admit(3, B, Duration::ZERO, &m));
        assert!(!probe.evict.is_cancelled() && !probe2.evict.is_cancelled());
        assert_eq!(t.len(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_source_evicts_its_own_connections_only_once_they_are_old_enough() {
        let m = Metrics::default();
        let t = Table::default();
        let second = Duration::from_secs(1);
        let a = admitted(t.admit(2, A, second, &m));
        let _a2 = admitted(t.admit(2, A, second, &m));
        // Both of A's are younger than a second: A's newcomer waits.
        assert!(matches!(t.admit(2, A, second, &m), Admission::Wait));
        assert_eq!(m.evicted_total(), 0);
        // Another source does not wait for age.
        let b = admitted(t.admit(2, B, second, &m));
        assert!(a.evict.is_cancelled(), "A's oldest made room for B");
        tokio::time::advance(second).await;
        // A's remaining one is old enough now, and A holds the most.
        let _a3 = admitted(t.admit(2, A, second, &m));
        assert!(!b.evict.is_cancelled());
        assert_eq!(m.evicted_total(), 2);
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn removing_an_evicted_connection_is_a_no_op() {
        let m = Metrics::default();
        let t = Table::default();
        let a = admitted(t.admit(1, A, Duration::ZERO, &m));
        let b = admitted(t.admit(1, A, Duration::ZERO, &m));
        t.remove(a.id);
        assert_eq!(t.len(), 1);
        t.remove(b.id);
        assert_eq!(t.len(), 0);
    }
}
