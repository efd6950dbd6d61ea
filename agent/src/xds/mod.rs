//! Discovery mode: the agent's ADS proxy between Envoy and the discovery
//! server.
//!
//! Envoy's ADS cluster ([`bootstrap::ads_cluster`]) is the Unix socket
//! `<run-dir>/xds.sock` (0600). Each Envoy stream on it is forwarded to one
//! TLS stream to `--discovery-address` that carries the pod's identity: the
//! bearer token from `--discovery-token-path` (re-read on each connect), and
//! the workload certificate as client certificate when the agent has one
//! (Remora's discovery server authenticates by the token alone so far).
//! The server is verified with `--ca-root-cert` and the workload trust
//! bundle. Envoy's ADS is delta xDS by default, state of the world with
//! `--discovery-delta=false` ([`bootstrap::dynamic_resources`]); the proxy
//! forwards either. See [`proxy`] for reconnecting, and [`session`] (state
//! of the world) and [`delta`] for what is replayed on a new upstream stream.
//!
//! App wiring: [`start`] (nothing without a discovery address), then
//! [`XdsHandle::hold_readiness`]: the guard [`READINESS_GUARD`] is pending
//! until Envoy has ACKed its first listeners and its first clusters, the
//! inbound ones among them (served, not static, in this mode): a pod whose
//! operator is unreachable at start is not Ready, and once it has them Envoy
//! keeps serving them while the server is away.

pub mod bootstrap;
pub mod delta;
pub mod proxy;
pub mod replicas;
pub mod session;
pub mod upstream;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;

use crate::certs::BundleReceiver;
use crate::config::RunConfig;
use crate::pod_annotations::StreamCopy;
use crate::readiness::Readiness;
use crate::unix_socket::{SocketError, bind_private};
use crate::withdrawal;
pub use upstream::{UpstreamConfig, UpstreamError};

/// Name of the readiness guard held until the first listeners and clusters
/// were accepted.
pub const READINESS_GUARD: &str = "discovery";
/// ADS streams the proxy serves at once: one Envoy, two during a hot restart.
pub const MAX_STREAMS: usize = 4;
const MIN_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    #[error("xDS proxy socket {0}")]
    Socket(#[from] SocketError),
    #[error("xDS proxy: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error("xDS proxy task failed: {0}")]
    Join(String),
}

/// The proxy's metrics.
#[derive(Clone, Debug, Default)]
pub struct XdsMetrics {
    pub reconnects: Counter,
    pub nacks: Counter,
    pub streams: Gauge,
}

impl XdsMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "xds_upstream_reconnects",
            "Attempts to reopen the ADS stream to the discovery server after it failed",
            self.reconnects.clone(),
        );
        registry.register(
            "xds_nacks",
            "Discovery responses Envoy rejected (NACK); it keeps its previous configuration",
            self.nacks.clone(),
        );
        registry.register(
            "xds_streams",
            "Envoy ADS streams open on the proxy",
            self.streams.clone(),
        );
    }
}

/// Whether Envoy has accepted any listeners and any clusters yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FirstAcks {
    pub listeners: bool,
    pub clusters: bool,
}

/// The running proxy.
#[derive(Debug)]
pub struct XdsHandle {
    pub socket: PathBuf,
    acked: watch::Receiver<FirstAcks>,
    /// The main stream's server: the other replicas are dialled alike.
    upstream: UpstreamConfig,
    cancel: CancellationToken,
    task: JoinHandle<Result<(), XdsError>>,
}

impl XdsHandle {
    /// What Envoy has accepted so far.
    pub fn first_acks(&self) -> FirstAcks {
        *self.acked.borrow()
    }

    /// The guard [`READINESS_GUARD`]: pending until Envoy has ACKed its
    /// first listeners and clusters, then ready for good (losing the server
    /// later leaves Envoy serving what it has, so it must not flap).
    pub fn hold_readiness(&self, readiness: &Readiness) {
        let guard = readiness.register(
            READINESS_GUARD,
            "waiting for Envoy to accept its first listeners and clusters",
        );
        let mut acked = self.acked.clone();
        let cancel = self.cancel.clone();
        tokio::spawn(async move {
            tokio::select! {
                r = acked.wait_for(|a| a.listeners && a.clusters) => if r.is_ok() {
                    guard.ready();
                    tracing::info!("Envoy accepted its first listeners and clusters");
                },
                _ = cancel.cancelled() => return,
            }
            cancel.cancelled().await;
        });
    }

    /// What a drain waits on for the pod's withdrawal: `upstream`, the
    /// main stream's view ([`ToAgent::withdrawal`]'s), and the other
    /// replicas it names, asked as node `node_id` ([`replicas`]).
    pub fn withdrawal_source(
        &self,
        upstream: watch::Receiver<withdrawal::Upstream>,
        node_id: String,
    ) -> withdrawal::Source {
        withdrawal::Source {
            upstream,
            replicas: Arc::new(replicas::Dialer {
                upstream: self.upstream.clone(),
                node_id,
                cancel: self.cancel.clone(),
            }),
        }
    }

    /// Wait until the server stopped (after the cancel token fired).
    pub async fn join(self) -> Result<(), XdsError> {
        self.task.await.map_err(|e| XdsError::Join(e.to_string()))?
    }
}

/// What the proxy hands the rest of the agent, from the server's pushes of
/// the agent's own types.
#[derive(Debug)]
pub struct ToAgent {
    /// The pod's annotations (`None` while the upstream stream is down).
    pub pod_annotations: watch::Sender<StreamCopy>,
    /// Whether the upstream stream is open, and the pod's withdrawal.
    pub withdrawal: watch::Sender<withdrawal::Upstream>,
}

/// Start the proxy as configured by the flags: `None` without
/// `--discovery-address`. `bundles`: the workload certificate source's, if
/// any. `to_agent` gets what the server pushes for the agent.
pub async fn start(
    cfg: &RunConfig,
    bundles: Option<BundleReceiver>,
    to_agent: ToAgent,
    registry: &mut Registry,
    cancel: CancellationToken,
) -> Result<Option<XdsHandle>, XdsError> {
    let Some(address) = cfg.discovery() else {
        return Ok(None);
    };
    let upstream = UpstreamConfig {
        address: address.to_string(),
        server_name: cfg.discovery_server_name.clone(),
        roots_file: cfg.ca_root_cert.clone(),
        bundles,
        token_path: cfg.discovery_token_path.clone(),
        min_backoff: MIN_BACKOFF,
        max_backoff: MAX_BACKOFF,
    };
    start_with(cfg.xds_socket_path(), upstream, to_agent, registry, cancel)
        .await
        .map(Some)
}

/// Start the proxy on `socket` towards `upstream`.
pub async fn start_with(
    socket: PathBuf,
    upstream: UpstreamConfig,
    to_agent: ToAgent,
    registry: &mut Registry,
    cancel: CancellationToken,
) -> Result<XdsHandle, XdsError> {
    upstream.check()?;
    let metrics = XdsMetrics::default();
    metrics.register(registry);
    let listener = bind_private(&socket)?;
    let (acked, acked_rx) = watch::channel(FirstAcks::default());
    tracing::info!(server = %upstream.address, socket = %socket.display(), "xDS proxy starting");
    let shared = Arc::new(proxy::Shared {
        upstream: upstream.clone(),
        metrics,
        acked,
        pod_annotations: to_agent.pod_annotations,
        withdrawal: to_agent.withdrawal,
        streams: Arc::new(Semaphore::new(MAX_STREAMS)),
        cancel: cancel.clone(),
    });
    let svc = AggregatedDiscoveryServiceServer::new(proxy::AdsProxy::new(shared))
        .max_decoding_message_size(remora_contract::discovery::MAX_REQUEST_BYTES);
    let sock = socket.clone();
    let shutdown = cancel.clone();
    let task = tokio::spawn(async move {
        let res = tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(
                UnixListenerStream::new(listener),
                shutdown.cancelled_owned(),
            )
            .await;
        let _ = std::fs::remove_file(&sock);
        res.map_err(XdsError::from)
    });
    Ok(XdsHandle {
        socket,
        acked: acked_rx,
        upstream,
        cancel,
        task,
    })
}
