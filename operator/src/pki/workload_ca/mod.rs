//! The workload CA: Istio's CA protocol
//! (`istio.v1.auth.IstioCertificateService/CreateCertificate`) served by
//! every replica over TLS, so that sidecars get workload certificates with
//! no Istio in the cluster.
//!
//! - [`authn`]: who is calling (TokenReview of the pod's projected token);
//! - [`signer`]: the CSR must ask for exactly `spiffe://<td>/ns/<ns>/sa/<sa>`;
//! - [`roots`] and [`keeper`]: the self-managed signing roots in a Secret,
//!   rotated with an overlap ([`crate::pki::rotation`]);
//! - [`crate::controllers::trust_bundle`]: the trust bundle as a ConfigMap
//!   in every injected namespace (the leader's work);
//! - [`serve`]: the bounded TLS gRPC server;
//! - [`testing`]: a ready CA for tests and benchmarks.

pub mod authn;

pub mod keeper;
pub mod roots;
pub mod serve;
pub mod service;
pub mod signer;
pub mod testing;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

pub use keeper::Authority;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StepLabel {
    step: &'static str,
}

/// The CA's metrics (`remora_operator_workload_ca_*`).
#[derive(Clone)]
pub struct Metrics {
    issued: Counter,
    refused: Family<ReasonLabel, Counter>,
    connections_refused: Family<ReasonLabel, Counter>,
    seconds: Histogram,
    rotations: Family<StepLabel, Counter>,
    root_expiry: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            issued: Counter::default(),
            refused: Family::default(),
            connections_refused: Family::default(),
            // 0.5 ms doubling to 4 s.
            seconds: Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
                0.0005, 2.0, 14,
            )),
            rotations: Family::default(),
            root_expiry: Gauge::default(),
        }
    }
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        let r = registry.sub_registry_with_prefix("workload_ca");
        r.register("issued", "Workload certificates issued", m.issued.clone());
        r.register(
            "refused",
            "Certificate requests refused, by reason",
            m.refused.clone(),
        );
        r.register(
            "connections_refused",
            "Connections closed unserved, by reason (per_source, handshake, no_place)",
            m.connections_refused.clone(),
        );
        r.register(
            "request_seconds",
            "Time to answer a certificate request (authentication and signing)",
            m.seconds.clone(),
        );
        r.register(
            "root_steps",
            "Signing-root steps this replica wrote (create, stage, switch, retire)",
            m.rotations.clone(),
        );
        r.register(
            "root_expiry_seconds",
            "Unix time at which the signing root this replica uses ends",
            m.root_expiry.clone(),
        );
        m
    }

    pub fn issued(&self) {
        self.issued.inc();
    }
    pub fn issued_total(&self) -> u64 {
        self.issued.get()
    }
    pub fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabel { reason }).inc();
    }
    pub fn refused_total(&self, reason: &'static str) -> u64 {
        self.refused.get_or_create(&ReasonLabel { reason }).get()
    }
    pub fn connection_refused(&self, reason: &'static str) {
        self.connections_refused
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }
    pub fn connections_refused_total(&self, reason: &'static str) -> u64 {
        self.connections_refused
            .get_or_create(&ReasonLabel { reason })
            .get()
    }
    pub fn observe(&self, d: Duration) {
        self.seconds.observe(d.as_secs_f64());
    }
    pub fn rotation(&self, step: roots::Step) {
        self.rotations
            .get_or_create(&StepLabel {
                step: step.as_str(),
            })
            .inc();
    }
    pub fn root_expiry(&self, at: SystemTime) {
        let s = at
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.root_expiry.set(i64::try_from(s).unwrap_or(i64::MAX));
    }
}

/// The names the CA's serving certificate carries: the Service's.
pub fn serving_names(service: &str, aliases: &[String], namespace: &str) -> Vec<String> {
    std::iter::once(service)
        .chain(aliases.iter().map(String::as_str).filter(|a| !a.is_empty()))
        .flat_map(|s| crate::pki::webhook_cert::service_names(s, namespace))
        .collect()
}

/// What the replica's CA publishes for the rest of the process.
pub type AuthorityRx = watch::Receiver<Option<Arc<Authority>>>;

/// The serving certificate of the current [`Authority`], read at each
/// handshake: the CA's server, and the discovery server on the same names.
#[derive(Debug)]
pub struct ServingCert(pub AuthorityRx);

impl rustls::server::ResolvesServerCert for ServingCert {
    fn resolve(
        &self,
        _hello: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        self.0.borrow().as_ref().map(|a| Arc::clone(&a.serving))
    }
}

/// Keep `guard` ready while the replica has an authority and pending while
/// it has none (none yet, or its last reading of the signing Secret is too
/// old), until the sender goes.
pub async fn follow_readiness(
    mut authority: AuthorityRx,
    guard: remora_serve::readiness::ReadinessGuard,
) {
    // Before the first authority the guard keeps the reason it was made with.
    let mut had = false;
    loop {
        match authority.borrow_and_update().is_some() {
            true => {
                had = true;
                guard.ready();
            }
            false if had => {
                guard.pending("the signing Secret was not read within the settle time: not signing")
            }
            false => {}
        }
        if authority.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_serving_certificate_carries_every_alias() {
        let names = serving_names(
            "remora-operator",
            &["remora-injector".into(), String::new()],
            "ops",
        );
        for want in [
            "remora-operator.ops.svc",
            "remora-injector",
            "remora-injector.ops.svc",
            "remora-injector.ops.svc.cluster.local",
        ] {
            assert!(names.iter().any(|n| n == want), "{want} not in {names:?}");
        }
        assert_eq!(names.len(), 8, "an empty alias adds nothing: {names:?}");
    }
}
