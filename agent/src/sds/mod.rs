//! SDS: serves workload certificates to Envoy over a Unix socket.
//!
//! # What the rest of the agent calls
//!
//! Bootstrap generator (JSON snippets, see [`bootstrap`]):
//! - [`bootstrap::sds_cluster`]`(socket: &Path) -> serde_json::Value`: add to
//!   `static_resources.clusters` whenever SDS is used (the static cluster
//!   `sds-grpc`, HTTP/2 over the pipe `socket`).
//! - [`bootstrap::inbound_tls_transport_socket`]`(sans: &[String]) -> serde_json::Value`:
//!   with `--inbound-tls`, set as `transport_socket` of each inbound filter
//!   chain (`sans` = `--inbound-tls-san`).
//! - [`bootstrap::outbound_tls_transport_socket`]`(spiffe_id: &str) -> serde_json::Value`:
//!   with `--outbound-tls PORT=SPIFFE_ID`, set as `transport_socket` of that
//!   outbound listener's cluster.
//! - [`bootstrap::sds_secret_config`]`(name: &str) -> serde_json::Value`:
//!   an `SdsSecretConfig` for any other TLS context.
//!
//! App wiring:
//! - [`start`]`(cfg: &RunConfig, registry: &mut Registry, cancel:
//!   CancellationToken) -> Result<SdsHandle, SdsError>`: picks the
//!   certificate source from the flags (`--ca-address`, else `--cert-dir`,
//!   else `/etc/certs` when `--inbound-tls` or `--outbound-tls`, else none), binds
//!   `cfg.sds_socket_path()`, and runs until `cancel`. Metrics go into
//!   `registry` (pass a sub-registry, e.g.
//!   `registry.sub_registry_with_prefix("remora")`). [`SdsHandle::join`]
//!   waits for a clean stop (socket removed).
//! - [`SdsHandle::hold_readiness`]`(readiness, used)`: with a source and a
//!   bootstrap that uses `default` or `ROOTCA`
//!   ([`bootstrap::UsedSecrets::of_bootstrap`]), a readiness guard
//!   `certificates` stays pending until each used one was sent to Envoy
//!   once. Nothing uses them: no guard, since Envoy would never ask.
//! - [`start_with`]: the same with an explicit socket and source (tests, benches).

pub mod bootstrap;
pub mod server;
pub mod store;

use std::path::PathBuf;
use std::sync::Arc;

use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_server::SecretDiscoveryServiceServer;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;

use crate::certs::{self, BundleReceiver, BundleSender, CertBundle, CertMetrics, CertSource};
use crate::config::RunConfig;
use crate::readiness::Readiness;
pub use bootstrap::UsedSecrets;
use server::{SdsMetrics, SdsService, Served};
use store::SecretStore;

/// Name of the readiness guard held until the used certificates were served.
pub const READINESS_GUARD: &str = "certificates";

#[derive(Debug, thiserror::Error)]
pub enum SdsError {
    #[error("SDS socket {0}")]
    Socket(#[from] crate::unix_socket::SocketError),
    #[error("SDS server: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error(transparent)]
    Certs(#[from] certs::CertError),
    #[error("SDS task failed: {0}")]
    Join(String),
}

/// A running SDS server and its certificate source.
#[derive(Debug)]
pub struct SdsHandle {
    pub socket: PathBuf,
    bundles: Option<BundleReceiver>,
    /// The source's reason for having nothing to serve yet (with a source).
    status: Option<watch::Receiver<Option<String>>>,
    served: watch::Receiver<(bool, bool)>,
    store: SecretStore,
    cancel: CancellationToken,
    task: JoinHandle<Result<(), SdsError>>,
}

impl SdsHandle {
    /// The workload bundle channel (`None` without a source).
    pub fn bundles(&self) -> Option<BundleReceiver> {
        self.bundles.clone()
    }
    /// The bundle in service now.
    pub fn current(&self) -> Option<Arc<CertBundle>> {
        self.bundles.as_ref().and_then(|b| b.borrow().clone())
    }
    /// File secrets held now (see [`SecretStore::file_secrets`]).
    pub fn file_secrets(&self) -> usize {
        self.store.file_secrets()
    }
    /// Hold readiness until Envoy got the workload secrets `used` says the
    /// configuration uses. Only then: readiness must never wait for a
    /// secret Envoy will not ask for. Without a source there is nothing that
    /// could ever be served, so no guard either (a warning says why).
    pub fn hold_readiness(&self, readiness: &Readiness, used: UsedSecrets) {
        if !used.any() {
            if self.bundles.is_some() {
                tracing::info!(
                    "no listener or cluster of the bootstrap uses the workload certificate; readiness does not wait for it"
                );
            }
            return;
        }
        let (Some(bundle), Some(status)) = (self.bundles.clone(), self.status.clone()) else {
            tracing::warn!(
                secrets = %used,
                "the bootstrap uses SDS workload secrets but no certificate source is configured (--cert-dir, --ca-address or --inbound-tls); Envoy will wait for them"
            );
            return;
        };
        let guard = readiness.register(READINESS_GUARD, "certificate source starting");
        tokio::spawn(track_readiness(
            guard,
            used,
            status,
            bundle,
            self.served.clone(),
            self.cancel.clone(),
        ));
    }
    /// Wait until the server stopped (after the cancel token fired).
    pub async fn join(self) -> Result<(), SdsError> {
        self.task.await.map_err(|e| SdsError::Join(e.to_string()))?
    }
}

/// Start SDS as configured by the flags. See the module docs.
pub async fn start(
    cfg: &RunConfig,
    registry: &mut Registry,
    cancel: CancellationToken,
) -> Result<SdsHandle, SdsError> {
    let source = certs::source_from_config(cfg)?;
    start_with(cfg.sds_socket_path(), source, registry, cancel).await
}

/// Start SDS on `socket` with `source` (if any).
pub async fn start_with(
    socket: PathBuf,
    source: Option<Box<dyn CertSource>>,
    registry: &mut Registry,
    cancel: CancellationToken,
) -> Result<SdsHandle, SdsError> {
    let cert_metrics = CertMetrics::default();
    cert_metrics.register(registry);
    let sds_metrics = SdsMetrics::default();
    sds_metrics.register(registry);
    let served = Served::default();

    let listener = crate::unix_socket::bind_private(&socket)?;

    let (mut bundles, mut status) = (None, None);
    if let Some(src) = source {
        let tx = BundleSender::new(cert_metrics.clone());
        bundles = Some(tx.subscribe());
        status = Some(tx.status());
        tracing::info!(source = %src.describe(), socket = %socket.display(), "SDS starting");
        tokio::spawn(src.run(tx, cancel.clone()));
    }
    let store = SecretStore::new(
        bundles.clone(),
        cancel.clone(),
        sds_metrics.file_secret_failures.clone(),
        sds_metrics.file_secrets.clone(),
    );
    let served_rx = served.subscribe();
    let svc = SdsService::new(store.clone(), sds_metrics, served, cancel.clone());
    let sock = socket.clone();
    let shutdown = cancel.clone();
    let task = tokio::spawn(async move {
        let res = tonic::transport::Server::builder()
            .add_service(SecretDiscoveryServiceServer::new(svc))
            .serve_with_incoming_shutdown(
                UnixListenerStream::new(listener),
                shutdown.cancelled_owned(),
            )
            .await;
        let _ = std::fs::remove_file(&sock);
        res.map_err(SdsError::from)
    });
    Ok(SdsHandle {
        socket,
        bundles,
        status,
        served: served_rx,
        store,
        cancel,
        task,
    })
}

/// Readiness: pending with the source's reason until it has a bundle, then
/// until Envoy got each secret in `used` once; then ready for good (a later
/// bad update keeps the old cert in service, so it must not flap readiness).
async fn track_readiness(
    guard: crate::readiness::ReadinessGuard,
    used: UsedSecrets,
    mut status: watch::Receiver<Option<String>>,
    mut bundle: BundleReceiver,
    mut served: watch::Receiver<(bool, bool)>,
    cancel: CancellationToken,
) {
    loop {
        let have = bundle.borrow_and_update().is_some();
        let reason = status.borrow_and_update().clone();
        let (w, r) = *served.borrow_and_update();
        let missing = UsedSecrets {
            workload: used.workload && !w,
            root_ca: used.root_ca && !r,
        };
        if !have {
            guard.pending(reason.unwrap_or_else(|| "no workload certificate yet".into()));
        } else if missing.any() {
            guard.pending(format!("waiting for Envoy to fetch {missing}"));
        } else {
            guard.ready();
            // Keep the guard alive (ready) until shutdown; dropping it is fine too.
            cancel.cancelled().await;
            return;
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            r = status.changed() => if r.is_err() { break },
            r = bundle.changed() => if r.is_err() { break },
            r = served.changed() => if r.is_err() { break },
        }
    }
    // A sender is gone (its task ended): nothing will change any more.
    cancel.cancelled().await;
}
