//! What a bounded server counts: open connections, and what its limits
//! turned away.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Default)]
pub struct Metrics {
    open: Gauge,
    evicted: Counter,
    refused: Counter,
    parked: Counter,
    shed: Counter,
}

impl Metrics {
    /// Register under `registry` (give each server its own sub-registry,
    /// e.g. labelled with its name).
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "server_connections_open",
            "Connections open now",
            m.open.clone(),
        );
        registry.register(
            "server_connections_evicted",
            "Idle or slow connections closed to make room for a new one",
            m.evicted.clone(),
        );
        registry.register(
            "server_connections_parked",
            "Connections held unread at accept until a place frees up (the server was full)",
            m.parked.clone(),
        );
        registry.register(
            "server_connections_refused",
            "Connections closed unserved: parked past their deadline, or over the parking cap",
            m.refused.clone(),
        );
        registry.register(
            "server_requests_shed",
            "Requests answered 503 because too many were in flight",
            m.shed.clone(),
        );
        m
    }

    pub fn open_now(&self) -> i64 {
        self.open.get()
    }
    pub fn evicted_total(&self) -> u64 {
        self.evicted.get()
    }
    pub fn refused_total(&self) -> u64 {
        self.refused.get()
    }
    pub fn parked_total(&self) -> u64 {
        self.parked.get()
    }
    pub fn shed_total(&self) -> u64 {
        self.shed.get()
    }

    pub(crate) fn evicted(&self) {
        self.evicted.inc();
    }
    pub(crate) fn refused(&self) {
        self.refused.inc();
    }
    pub(crate) fn parked(&self) {
        self.parked.inc();
    }
    pub(crate) fn shed(&self) {
        self.shed.inc();
    }
    pub(crate) fn open_guard(&self) -> OpenGuard {
        self.open.inc();
        OpenGuard(self.open.clone())
    }
}

pub(crate) struct OpenGuard(Gauge);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}
