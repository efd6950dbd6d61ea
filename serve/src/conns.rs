//! The table of open connections, oldest first, and who gets evicted when
//! it is full: the oldest connection with no request in flight, of the
//! source address that holds the most such connections. A flood from one
//! client (a pod on the network) therefore only ever evicts its own
//! connections, never the kubelet's probe or the API server's.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

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
    /// Full, and every connection has a request in flight.
    Refused,
}

struct Entry {
    source: IpAddr,
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
    /// newcomer counted); refuse when no connection is idle.
    pub fn admit(&self, max: usize, source: IpAddr, metrics: &Metrics) -> Admission {
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
                .map(|(_, (_, id))| id);
            match victim.and_then(|id| t.open.remove(&id)) {
                Some(e) => {
                    e.evict.cancel();
                    metrics.evicted();
                }
                None => {
                    metrics.refused();
                    return Admission::Refused;
                }
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
                busy: Arc::clone(&busy),
                evict: evict.clone(),
            },
        );
        Admission::Admitted(Slot { id, busy, evict })
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
            Admission::Refused => panic!("refused"),
        }
    }

    #[test]
    fn full_table_evicts_the_oldest_idle_connection() {
        let m = Metrics::default();
        let t = Table::default();
        let a = admitted(t.admit(2, A, &m));
        let b = admitted(t.admit(2, A, &m));
        let _busy_a = BusyGuard::new(&a.busy);
        let c = admitted(t.admit(2, A, &m));
        assert!(!a.evict.is_cancelled(), "a has a request in flight");
        assert!(b.evict.is_cancelled(), "b is the oldest idle one");
        assert!(!c.evict.is_cancelled());
        assert_eq!(t.len(), 2);
        assert_eq!(m.evicted_total(), 1);
    }

    #[test]
    fn full_table_of_busy_connections_refuses() {
        let m = Metrics::default();
        let t = Table::default();
        let a = admitted(t.admit(1, A, &m));
        let _busy = BusyGuard::new(&a.busy);
        assert!(matches!(t.admit(1, A, &m), Admission::Refused));
        assert_eq!(m.refused_total(), 1);
        drop(_busy);
        let _b = admitted(t.admit(1, A, &m));
        assert!(a.evict.is_cancelled());
    }

    #[test]
    fn a_flood_from_one_source_evicts_only_its_own_connections() {
        let m = Metrics::default();
        let t = Table::default();
        // The probe's connection is the oldest and idle (between requests).
        let probe = admitted(t.admit(3, B, &m));
        let flood: Vec<Slot> = (0..100).map(|_| admitted(t.admit(3, A, &m))).collect();
        assert!(!probe.evict.is_cancelled(), "B holds one; A holds the most");
        assert_eq!(flood.iter().filter(|s| !s.evict.is_cancelled()).count(), 2);
        // A newcomer from B, with B not the largest, still evicts one of A's.
        let probe2 = admitted(t.admit(3, B, &m));
        assert!(!probe.evict.is_cancelled() && !probe2.evict.is_cancelled());
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn removing_an_evicted_connection_is_a_no_op() {
        let m = Metrics::default();
        let t = Table::default();
        let a = admitted(t.admit(1, A, &m));
        let b = admitted(t.admit(1, A, &m));
        t.remove(a.id);
        assert_eq!(t.len(), 1);
        t.remove(b.id);
        assert_eq!(t.len(), 0);
    }
}
