//! The discovery server: Envoy's aggregated discovery service (state of
//! the world and delta) for the sidecars, on every replica, off by default
//! (`--discovery`).
//!
//! - [`registry`]: Services, their ready endpoints and the proxies' pods,
//!   pure, fed from the shared watches, with [`external`]: the services
//!   outside the cluster (ExternalService, ExternalWorkload);
//! - [`resources`]: what one proxy may see (LDS, CDS, EDS), only for the
//!   Services it declared in `remora.dev/outbound`;
//! - [`push`]: changes debounced into batches the streams follow;
//! - [`session`]: what one stream does with each request (per-type
//!   versions, nonces, ACK/NACK, scope), pure;
//! - [`delta`]: the same for a delta stream (per-resource versions,
//!   subscriptions, resuming from what the proxy holds), pure;
//! - [`server`]: the ADS service (authentication, then each stream's
//!   session), served by [`crate::grpc_server`] through [`ads_grpc`]
//!   (tonic's routing of it, with small codec buffers).
//! - [`withdrawal`]: a pod deleting or not Ready is withdrawn from every
//!   endpoint at once; who of the proxies that held it has confirmed (ACKed
//!   EDS without it), pure, and told to the pod's own agent.

pub mod ads_grpc;
pub mod delta;
pub mod external;
pub mod feed;
pub mod inbound;
pub mod proto;
pub mod push;
pub mod registry;
pub mod resources;
pub mod serve;
pub mod server;
pub mod session;
pub mod withdrawal;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TypeLabel {
    r#type: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// The discovery server's metrics (`remora_operator_xds_*`).
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    nacks: Family<TypeLabel, Counter>,
    pushes: Family<TypeLabel, Counter>,
    out_of_scope: Family<TypeLabel, Counter>,
    refused: Family<ReasonLabel, Counter>,
    connections_refused: Family<ReasonLabel, Counter>,
    streams: Gauge,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        let r = registry.sub_registry_with_prefix("xds");
        r.register(
            "nacks",
            "Configurations a proxy refused (NACK), by type (lds, cds, eds)",
            m.nacks.clone(),
        );
        r.register("pushes", "Responses sent, by type", m.pushes.clone());
        r.register(
            "out_of_scope",
            "Resource names asked for outside the proxy's scope (not returned), by type",
            m.out_of_scope.clone(),
        );
        r.register(
            "refused",
            "Streams or requests refused, by reason",
            m.refused.clone(),
        );
        r.register(
            "connections_refused",
            "Connections closed unserved, by reason (per_source, handshake, no_place)",
            m.connections_refused.clone(),
        );
        r.register("streams", "ADS streams open", m.streams.clone());
        m
    }

    fn ty(t: &str) -> TypeLabel {
        TypeLabel {
            r#type: server::short_type(t),
        }
    }
    pub fn nack(&self, t: &str) {
        self.nacks.get_or_create(&Self::ty(t)).inc();
    }
    pub fn nacks_total(&self, t: &str) -> u64 {
        self.nacks.get_or_create(&Self::ty(t)).get()
    }
    pub fn pushed(&self, t: &str) {
        self.pushes.get_or_create(&Self::ty(t)).inc();
    }
    pub fn pushes_total(&self, t: &str) -> u64 {
        self.pushes.get_or_create(&Self::ty(t)).get()
    }
    /// `n` names of type `t` asked for outside the proxy's scope.
    pub fn out_of_scope(&self, t: &str, n: usize) {
        self.out_of_scope
            .get_or_create(&Self::ty(t))
            .inc_by(u64::try_from(n).unwrap_or(u64::MAX));
    }
    pub fn out_of_scope_total(&self, t: &str) -> u64 {
        self.out_of_scope.get_or_create(&Self::ty(t)).get()
    }
    pub fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabel { reason }).inc();
    }
    pub fn refused_total(&self, reason: &'static str) -> u64 {
        self.refused.get_or_create(&ReasonLabel { reason }).get()
    }
    fn stream_opened(&self) {
        self.streams.inc();
    }
    fn stream_closed(&self) {
        self.streams.dec();
    }
}

impl crate::grpc_server::Refusals for Metrics {
    fn request_refused(&self, reason: &'static str) {
        self.refused(reason);
    }
    fn connection_refused(&self, reason: &'static str) {
        self.connections_refused
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nacks_are_exported_by_type() {
        let mut registry = Registry::with_prefix("remora_operator");
        let m = Metrics::register(&mut registry);
        m.nack(resources::ENDPOINTS);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encoded");
        assert!(
            text.contains("remora_operator_xds_nacks_total{type=\"eds\"} 1"),
            "{text}"
        );
    }
}
