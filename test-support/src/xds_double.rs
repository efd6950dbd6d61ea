//! A test double of a discovery server: a small tonic ADS server
//! (state-of-the-world) over TLS that serves whatever resources a test sets
//! per type URL, records every request with its `authorization` metadata
//! and whether the client showed a certificate, and can be stopped and
//! restarted on the same port with the same resources.
//!
//! Its one rule, a state-of-the-world server's: a type's resources go to a
//! stream when the stream asks for the type with a version other than the
//! current one, or when the current version changes; a request that
//! carries the current version (an ACK, or a resumed stream) gets nothing.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::cluster::v3::cluster::{ClusterDiscoveryType, DiscoveryType};
use envoy_types::pb::envoy::config::core::v3::address::Address as AddressKind;
use envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier;
use envoy_types::pb::envoy::config::core::v3::{Address, SocketAddress};
use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::config::listener::v3::filter::ConfigType;
use envoy_types::pb::envoy::config::listener::v3::{Filter, FilterChain, Listener};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::TcpProxy;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::tcp_proxy::ClusterSpecifier;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::{Any, Duration as PbDuration};
use envoy_types::util::pack_any;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};

pub const LISTENER_TYPE: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub const CLUSTER_TYPE: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

/// One request as the double received it.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub request: DiscoveryRequest,
    /// The stream's `authorization` metadata.
    pub authorization: Option<String>,
    /// Whether the client presented a certificate (verified by the client root).
    pub client_cert: bool,
}

#[derive(Default)]
struct Inner {
    /// Per type URL: version and resources.
    resources: HashMap<String, (String, Vec<Any>)>,
    requests: Vec<Recorded>,
    responses: usize,
    streams: usize,
    open: usize,
}

/// What survives a restart: the resources and the records.
#[derive(Clone)]
struct State {
    inner: Arc<Mutex<Inner>>,
    changed: Arc<watch::Sender<u64>>,
}

impl State {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A test thread that panicked holding it has failed already.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A running double.
pub struct XdsDouble {
    pub addr: SocketAddr,
    state: State,
    tls: (String, String, String),
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

/// A stopped double: [`XdsDouble::restart`] brings it back.
pub struct Stopped {
    addr: SocketAddr,
    state: State,
    tls: (String, String, String),
}

impl XdsDouble {
    /// Serve on 127.0.0.1 (a free port) with the certificate `cert_pem` and
    /// key `key_pem`, asking for (not requiring) client certificates from
    /// `client_root_pem`.
    pub async fn start(
        cert_pem: &str,
        key_pem: &str,
        client_root_pem: &str,
    ) -> std::io::Result<Self> {
        let state = State {
            inner: Arc::default(),
            changed: Arc::new(watch::channel(0).0),
        };
        let tls = (cert_pem.into(), key_pem.into(), client_root_pem.into());
        Self::spawn(
            "127.0.0.1:0".parse().map_err(std::io::Error::other)?,
            state,
            tls,
        )
        .await
    }

    async fn spawn(
        addr: SocketAddr,
        state: State,
        tls: (String, String, String),
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let cancel = CancellationToken::new();
        let config = ServerTlsConfig::new()
            .identity(Identity::from_pem(&tls.0, &tls.1))
            .client_ca_root(Certificate::from_pem(&tls.2))
            .client_auth_optional(true);
        let svc = AggregatedDiscoveryServiceServer::new(Ads {
            state: state.clone(),
            cancel: cancel.clone(),
        });
        let mut builder = Server::builder()
            .tls_config(config)
            .map_err(std::io::Error::other)?;
        let shutdown = cancel.clone();
        let task = tokio::spawn(async move {
            let _ = builder
                .add_service(svc)
                .serve_with_incoming_shutdown(
                    TcpListenerStream::new(listener),
                    shutdown.cancelled_owned(),
                )
                .await;
        });
        Ok(Self {
            addr,
            state,
            tls,
            cancel,
            task,
        })
    }

    /// Serve `resources` as `version` of `type_url`, to every stream that
    /// asked for the type (now, and on later requests).
    pub fn set(&self, type_url: &str, version: &str, resources: Vec<Any>) {
        self.state
            .lock()
            .resources
            .insert(type_url.into(), (version.into(), resources));
        self.state.changed.send_modify(|n| *n += 1);
    }

    /// Every request received so far, across restarts.
    pub fn requests(&self) -> Vec<Recorded> {
        self.state.lock().requests.clone()
    }

    /// Responses sent so far, across restarts.
    pub fn responses(&self) -> usize {
        self.state.lock().responses
    }

    /// Streams opened so far, across restarts.
    pub fn streams(&self) -> usize {
        self.state.lock().streams
    }

    /// Streams open now.
    pub fn open_streams(&self) -> usize {
        self.state.lock().open
    }

    /// Stop: open streams end with UNAVAILABLE, the port refuses connections.
    pub async fn stop(self) -> Stopped {
        self.cancel.cancel();
        // Graceful first (streams end with UNAVAILABLE); a client holding
        // its connection open must not hold the test up.
        let mut task = self.task;
        if tokio::time::timeout(std::time::Duration::from_secs(5), &mut task)
            .await
            .is_err()
        {
            task.abort();
            let _ = task.await;
        }
        Stopped {
            addr: self.addr,
            state: self.state,
            tls: self.tls,
        }
    }

    /// Serve again on the same port, with the same resources and records.
    pub async fn restart(stopped: Stopped) -> std::io::Result<Self> {
        Self::spawn(stopped.addr, stopped.state, stopped.tls).await
    }
}

struct Ads {
    state: State,
    cancel: CancellationToken,
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = BoxStream<DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = BoxStream<DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let authorization = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let client_cert = request.peer_certs().is_some_and(|c| !c.is_empty());
        {
            let mut inner = self.state.lock();
            inner.streams += 1;
            inner.open += 1;
        }
        let (tx, rx) = mpsc::channel(16);
        let stream = DoubleStream {
            state: self.state.clone(),
            authorization,
            client_cert,
            sent: HashMap::new(),
            asked: HashSet::new(),
            nonce: 0,
            tx,
        };
        let state = self.state.clone();
        let cancel = self.cancel.clone();
        tokio::spawn(async move {
            stream.run(request.into_inner(), cancel).await;
            state.lock().open -= 1;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn delta_aggregated_resources(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented(
            "the double serves state of the world",
        ))
    }
}

struct DoubleStream {
    state: State,
    authorization: Option<String>,
    client_cert: bool,
    /// Per type, the version last sent on this stream.
    sent: HashMap<String, String>,
    asked: HashSet<String>,
    nonce: u64,
    tx: mpsc::Sender<Result<DiscoveryResponse, Status>>,
}

impl DoubleStream {
    async fn run(mut self, mut requests: Streaming<DiscoveryRequest>, cancel: CancellationToken) {
        let mut changed = self.state.changed.subscribe();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => {
                    let _ = self.tx.send(Err(Status::unavailable("the double stopped"))).await;
                    return;
                }
                m = requests.message() => {
                    let Ok(Some(req)) = m else { return };
                    let ty = req.type_url.clone();
                    let current = self.state.lock().resources.get(&ty).map(|(v, _)| v.clone());
                    let behind = current.as_ref().is_some_and(|v| *v != req.version_info);
                    self.asked.insert(ty.clone());
                    let ok = !(behind && self.sent.get(&ty) != current.as_ref()) || self.send(&ty).await;
                    // Recorded after the answer: a test that sees the request
                    // sees what it was answered with too.
                    self.state.lock().requests.push(Recorded {
                        request: req,
                        authorization: self.authorization.clone(),
                        client_cert: self.client_cert,
                    });
                    if !ok {
                        return;
                    }
                }
                r = changed.changed() => {
                    if r.is_err() {
                        return;
                    }
                    let types: Vec<String> = self.asked.iter().cloned().collect();
                    for ty in types {
                        let current = self.state.lock().resources.get(&ty).map(|(v, _)| v.clone());
                        if current.is_some() && self.sent.get(&ty) != current.as_ref() && !self.send(&ty).await {
                            return;
                        }
                    }
                }
            }
        }
    }

    async fn send(&mut self, ty: &str) -> bool {
        let Some((version, resources)) = self.state.lock().resources.get(ty).cloned() else {
            return true;
        };
        self.nonce += 1;
        self.sent.insert(ty.into(), version.clone());
        self.state.lock().responses += 1;
        let resp = DiscoveryResponse {
            version_info: version,
            resources,
            type_url: ty.into(),
            nonce: self.nonce.to_string(),
            ..Default::default()
        };
        self.tx.send(Ok(resp)).await.is_ok()
    }
}

fn socket_address(port: u16) -> Address {
    Address {
        address: Some(AddressKind::SocketAddress(SocketAddress {
            address: "127.0.0.1".into(),
            port_specifier: Some(PortSpecifier::PortValue(port.into())),
            ..Default::default()
        })),
    }
}

/// A listener `name` on 127.0.0.1:`port` proxying TCP to `cluster`.
pub fn tcp_listener(name: &str, port: u16, cluster: &str) -> Any {
    let proxy = TcpProxy {
        stat_prefix: name.into(),
        cluster_specifier: Some(ClusterSpecifier::Cluster(cluster.into())),
        ..Default::default()
    };
    pack_any(Listener {
        name: name.into(),
        address: Some(socket_address(port)),
        filter_chains: vec![FilterChain {
            filters: vec![Filter {
                name: "envoy.filters.network.tcp_proxy".into(),
                config_type: Some(ConfigType::TypedConfig(pack_any(proxy))),
            }],
            ..Default::default()
        }],
        ..Default::default()
    })
}

/// A static cluster `name` of one endpoint, 127.0.0.1:`port`.
pub fn static_cluster(name: &str, port: u16) -> Any {
    pack_any(Cluster {
        name: name.into(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Static.into())),
        connect_timeout: Some(PbDuration {
            seconds: 1,
            nanos: 0,
        }),
        load_assignment: Some(ClusterLoadAssignment {
            cluster_name: name.into(),
            endpoints: vec![LocalityLbEndpoints {
                lb_endpoints: vec![LbEndpoint {
                    host_identifier: Some(HostIdentifier::Endpoint(Endpoint {
                        address: Some(socket_address(port)),
                        ..Default::default()
                    })),
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    })
}
