//! The SDS gRPC service (state-of-the-world xDS over `StreamSecrets`).
//!
//! Per stream: the set of watched names, the version last sent per name, and
//! the last nonce. A response carries only the changed resource(s), with
//! `version_info` and a fresh `nonce`. ACKs (matching nonce, no error) are not
//! answered; NACKs are logged and counted and nothing is resent (Envoy keeps
//! the last good secret); requests with a stale nonce are ignored, as xDS
//! prescribes. Only the names a stream watches are ever sent to it.

use std::collections::{BTreeSet, HashMap};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_server::SecretDiscoveryService;
use futures::Stream;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::{ReceiverStream, WatchStream};
use tokio_stream::{StreamExt, StreamMap};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use super::store::{ROOT_CA, Resource, SECRET_TYPE_URL, SecretStore, WORKLOAD_CERT};

/// SDS metrics.
#[derive(Clone, Debug, Default)]
pub struct SdsMetrics {
    pub pushes: Counter,
    pub nacks: Counter,
    pub unknown_names: Counter,
    pub streams: Gauge,
    pub file_secret_failures: Counter,
    pub file_secrets: Gauge,
}

impl SdsMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register("sds_pushes", "Secrets sent to Envoy", self.pushes.clone());
        registry.register(
            "sds_nacks",
            "Secrets Envoy rejected (NACK); the last good one stays",
            self.nacks.clone(),
        );
        registry.register(
            "sds_unknown_names",
            "Requests for a secret name this agent does not serve",
            self.unknown_names.clone(),
        );
        registry.register("sds_streams", "Open SDS streams", self.streams.clone());
        registry.register(
            "sds_file_secret_failures",
            "Failed loads of file-cert:/file-root: secrets",
            self.file_secret_failures.clone(),
        );
        registry.register(
            "sds_file_secrets",
            "file-cert:/file-root: secrets held now, each with a file watch (released when no stream asks for it)",
            self.file_secrets.clone(),
        );
    }
}

/// Which of `default` / `ROOTCA` were sent at least once (for readiness).
#[derive(Debug, Clone)]
pub struct Served {
    tx: watch::Sender<(bool, bool)>,
}

impl Default for Served {
    fn default() -> Self {
        Self {
            tx: watch::channel((false, false)).0,
        }
    }
}

impl Served {
    fn mark(&self, name: &str) {
        self.tx.send_if_modified(|(w, r)| match name {
            WORKLOAD_CERT if !*w => {
                *w = true;
                true
            }
            ROOT_CA if !*r => {
                *r = true;
                true
            }
            _ => false,
        });
    }
    pub fn subscribe(&self) -> watch::Receiver<(bool, bool)> {
        self.tx.subscribe()
    }
}

/// The tonic service.
#[derive(Debug, Clone)]
pub struct SdsService {
    store: SecretStore,
    metrics: SdsMetrics,
    served: Served,
    cancel: CancellationToken,
    nonce: Arc<AtomicU64>,
}

impl SdsService {
    pub fn new(
        store: SecretStore,
        metrics: SdsMetrics,
        served: Served,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            store,
            metrics,
            served,
            cancel,
            nonce: Arc::default(),
        }
    }

    fn response(&self, resources: &[Arc<Resource>]) -> DiscoveryResponse {
        let n = self.nonce.fetch_add(1, Ordering::Relaxed) + 1;
        // One version for the response: the resources' own versions joined.
        let version = resources
            .iter()
            .map(|r| r.version.as_str())
            .collect::<Vec<_>>()
            .join(".");
        for r in resources {
            self.served.mark(&r.name);
        }
        self.metrics.pushes.inc_by(resources.len() as u64);
        DiscoveryResponse {
            version_info: version,
            resources: resources.iter().map(|r| r.any.clone()).collect(),
            type_url: SECRET_TYPE_URL.to_string(),
            nonce: n.to_string(),
            ..Default::default()
        }
    }

    /// Refuse a request for another resource type (pub for the fuzz targets).
    pub fn check_type(req: &DiscoveryRequest) -> Result<(), Status> {
        if !req.type_url.is_empty() && req.type_url != SECRET_TYPE_URL {
            return Err(Status::invalid_argument(format!(
                "this server serves only {SECRET_TYPE_URL}, not {:?}",
                req.type_url
            )));
        }
        Ok(())
    }

    async fn run_stream(
        self,
        mut inbound: Streaming<DiscoveryRequest>,
        out: mpsc::Sender<Result<DiscoveryResponse, Status>>,
    ) {
        self.metrics.streams.inc();
        let mut watched: BTreeSet<String> = BTreeSet::new();
        let mut subs: StreamMap<String, WatchStream<Option<Arc<Resource>>>> = StreamMap::new();
        let mut sent: HashMap<String, String> = HashMap::new();
        let mut last_nonce = String::new();
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => break,
                msg = inbound.message() => {
                    let req = match msg {
                        Ok(Some(r)) => r,
                        Ok(None) => break,
                        Err(status) => {
                            tracing::debug!(%status, "SDS stream ended with an error");
                            break;
                        }
                    };
                    if let Err(st) = Self::check_type(&req) {
                        let _ = out.send(Err(st)).await;
                        break;
                    }
                    if !req.response_nonce.is_empty() && req.response_nonce != last_nonce {
                        // A reply to an older response: superseded, ignore (xDS rule).
                        tracing::debug!(nonce = %req.response_nonce, "stale SDS request ignored");
                        continue;
                    }
                    if let Some(err) = &req.error_detail {
                        self.metrics.nacks.inc();
                        tracing::warn!(
                            names = ?req.resource_names,
                            version = %req.version_info,
                            code = err.code,
                            message = %err.message,
                            "Envoy rejected a secret (NACK); it keeps the last good one"
                        );
                    }
                    let wanted: BTreeSet<String> = req.resource_names.iter().cloned().collect();
                    for gone in watched.difference(&wanted) {
                        subs.remove(gone);
                        sent.remove(gone);
                    }
                    for new in wanted.difference(&watched) {
                        match self.store.subscribe(new) {
                            // WatchStream yields the current value first, so a known secret goes out at once.
                            Some(rx) => { subs.insert(new.clone(), WatchStream::new(rx)); }
                            None => {
                                self.metrics.unknown_names.inc();
                                tracing::warn!(name = %new, "SDS request for an unknown secret name; not served");
                            }
                        }
                    }
                    watched = wanted;
                }
                Some((name, value)) = subs.next(), if !subs.is_empty() => {
                    let Some(res) = value else { continue };
                    if sent.get(&name) == Some(&res.version) {
                        continue;
                    }
                    // Take everything else that is ready too, so a bundle change is one response.
                    let mut batch = vec![res];
                    while let Some(Some((n2, Some(r2)))) = futures::FutureExt::now_or_never(subs.next()) {
                        if sent.get(&n2) != Some(&r2.version) && !batch.iter().any(|b| b.name == n2) {
                            batch.push(r2);
                        }
                    }
                    let resp = self.response(&batch);
                    for r in &batch {
                        sent.insert(r.name.clone(), r.version.clone());
                    }
                    last_nonce = resp.nonce.clone();
                    if out.send(Ok(resp)).await.is_err() {
                        break;
                    }
                }
            }
        }
        self.metrics.streams.dec();
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl SecretDiscoveryService for SdsService {
    type DeltaSecretsStream = BoxStream<DeltaDiscoveryResponse>;
    type StreamSecretsStream = BoxStream<DiscoveryResponse>;

    async fn delta_secrets(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaSecretsStream>, Status> {
        Err(Status::unimplemented(
            "delta SDS is not supported; use StreamSecrets",
        ))
    }

    async fn stream_secrets(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamSecretsStream>, Status> {
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(self.clone().run_stream(request.into_inner(), tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn fetch_secrets(
        &self,
        request: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        let req = request.into_inner();
        Self::check_type(&req)?;
        let mut found = Vec::new();
        for name in &req.resource_names {
            match self.store.subscribe(name) {
                Some(mut rx) => {
                    // File secrets load on first use: give them a moment.
                    let _ = tokio::time::timeout(
                        std::time::Duration::from_secs(1),
                        rx.wait_for(Option::is_some),
                    )
                    .await;
                    if let Some(r) = rx.borrow().clone() {
                        found.push(r);
                    }
                }
                None => {
                    self.metrics.unknown_names.inc();
                }
            }
        }
        if found.is_empty() {
            return Err(Status::not_found(format!(
                "no secret available for {:?}",
                req.resource_names
            )));
        }
        Ok(Response::new(self.response(&found)))
    }
}
