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
//! - [`bootstrap::sds_secret_config`]`(name: &str) -> serde_json::Value`:
//!   an `SdsSecretConfig` for any other TLS context (e.g. outbound).
//!
//! App wiring:
//! - [`start`]`(cfg: &RunConfig, readiness: &Readiness, registry: &mut Registry,
//!   cancel: CancellationToken) -> Result<SdsHandle, SdsError>`: picks the
//!   certificate source from the flags (`--ca-address`, else `--cert-dir`,
//!   else `/etc/certs` when `--inbound-tls`, else none), binds
//!   `cfg.sds_socket_path()`, and runs until `cancel`. With a source, a
//!   readiness guard `certificates` stays pending until `default` and
//!   `ROOTCA` were each sent to Envoy once. Metrics go into `registry` (pass a
//!   sub-registry, e.g. `registry.sub_registry_with_prefix("remora")`).
//!   [`SdsHandle::join`] waits for a clean stop (socket removed).
//! - [`start_with`]: the same with an explicit socket and source (tests, benches).

pub mod bootstrap;
pub mod server;
pub mod store;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_server::SecretDiscoveryServiceServer;
use prometheus_client::registry::Registry;
use tokio::net::UnixListener;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;

use crate::certs::{self, BundleReceiver, BundleSender, CertBundle, CertMetrics, CertSource};
use crate::config::RunConfig;
use crate::readiness::Readiness;
use server::{SdsMetrics, SdsService, Served};
use store::SecretStore;

/// Name of the readiness guard held until `default` and `ROOTCA` were served.
pub const READINESS_GUARD: &str = "certificates";

#[derive(Debug, thiserror::Error)]
pub enum SdsError {
    #[error("SDS socket {path}: {source}")]
    Socket {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("SDS socket path {0} exists and is not a socket; refusing to remove it")]
    NotASocket(PathBuf),
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
    store: SecretStore,
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
    /// Wait until the server stopped (after the cancel token fired).
    pub async fn join(self) -> Result<(), SdsError> {
        self.task.await.map_err(|e| SdsError::Join(e.to_string()))?
    }
}

/// Start SDS as configured by the flags. See the module docs.
pub async fn start(
    cfg: &RunConfig,
    readiness: &Readiness,
    registry: &mut Registry,
    cancel: CancellationToken,
) -> Result<SdsHandle, SdsError> {
    let source = certs::source_from_config(cfg)?;
    start_with(cfg.sds_socket_path(), source, readiness, registry, cancel).await
}

/// Start SDS on `socket` with `source` (if any).
pub async fn start_with(
    socket: PathBuf,
    source: Option<Box<dyn CertSource>>,
    readiness: &Readiness,
    registry: &mut Registry,
    cancel: CancellationToken,
) -> Result<SdsHandle, SdsError> {
    let cert_metrics = CertMetrics::default();
    cert_metrics.register(registry);
    let sds_metrics = SdsMetrics::default();
    sds_metrics.register(registry);
    let served = Served::default();

    let listener = bind(&socket)?;

    let mut bundles = None;
    if let Some(src) = source {
        let tx = BundleSender::new(cert_metrics.clone());
        bundles = Some(tx.subscribe());
        tracing::info!(source = %src.describe(), socket = %socket.display(), "SDS starting");
        let guard = readiness.register(READINESS_GUARD, "certificate source starting");
        tokio::spawn(track_readiness(
            guard,
            tx.status(),
            tx.subscribe(),
            served.subscribe(),
            cancel.clone(),
        ));
        tokio::spawn(src.run(tx, cancel.clone()));
    }
    let store = SecretStore::new(
        bundles.clone(),
        cancel.clone(),
        sds_metrics.file_secret_failures.clone(),
        sds_metrics.file_secrets.clone(),
    );
    let svc = SdsService::new(store.clone(), sds_metrics, served, cancel.clone());
    let sock = socket.clone();
    let task = tokio::spawn(async move {
        let res = tonic::transport::Server::builder()
            .add_service(SecretDiscoveryServiceServer::new(svc))
            .serve_with_incoming_shutdown(
                UnixListenerStream::new(listener),
                cancel.cancelled_owned(),
            )
            .await;
        let _ = std::fs::remove_file(&sock);
        res.map_err(SdsError::from)
    });
    Ok(SdsHandle {
        socket,
        bundles,
        store,
        task,
    })
}

/// Bind the socket: parent created 0750 if missing, a stale socket removed,
/// the socket itself 0600.
fn bind(path: &Path) -> Result<UnixListener, SdsError> {
    let err = |source| SdsError::Socket {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && !dir.exists()
    {
        std::fs::create_dir_all(dir).map_err(err)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750)).map_err(err)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path).map_err(err)?,
        Ok(_) => return Err(SdsError::NotASocket(path.to_path_buf())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let l = UnixListener::bind(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    Ok(l)
}

/// Readiness: pending with the source's reason until it has a bundle, then
/// until Envoy got `default` and `ROOTCA` once; then ready for good (a later
/// bad update keeps the old cert in service, so it must not flap readiness).
async fn track_readiness(
    guard: crate::readiness::ReadinessGuard,
    mut status: tokio::sync::watch::Receiver<Option<String>>,
    mut bundle: BundleReceiver,
    mut served: tokio::sync::watch::Receiver<(bool, bool)>,
    cancel: CancellationToken,
) {
    loop {
        let have = bundle.borrow_and_update().is_some();
        let reason = status.borrow_and_update().clone();
        let (w, r) = *served.borrow_and_update();
        if !have {
            guard.pending(reason.unwrap_or_else(|| "no workload certificate yet".into()));
        } else if !(w && r) {
            let mut missing = Vec::new();
            if !w {
                missing.push(store::WORKLOAD_CERT);
            }
            if !r {
                missing.push(store::ROOT_CA);
            }
            guard.pending(format!(
                "waiting for Envoy to fetch {}",
                missing.join(" and ")
            ));
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
