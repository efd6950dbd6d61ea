//! One simulated sidecar: a real gRPC ADS client (state of the world, or
//! delta as the agent speaks by default) from a loopback address of its
//! own, subscribing as Envoy does: CDS first, then EDS for the EDS clusters
//! CDS names, and LDS; every response ACKed at once. It records when it ACKed each endpoint address it had not seen
//! before, and how many EDS responses it got. It never retries: a stream
//! that fails ends the proxy with the error.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::cluster::v3::cluster::{ClusterDiscoveryType, DiscoveryType};
use envoy_types::pb::envoy::config::core::v3::{Node, address, socket_address};
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use futures::StreamExt;
use prost::Message;
use remora_test_support::ads_requests::{delta_request, request};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_util::sync::CancellationToken;

pub const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const ENDPOINTS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
pub const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";

/// The name Remora's serving certificate carries (the bench's own CA).
pub const REMORA_SERVER_NAME: &str = "remora-operator.ops.svc";
/// Large enough for istiod's CDS and LDS of every Service in the cluster.
const MAX_MESSAGE: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("proxy {0}: connecting: {1}")]
    Connect(usize, String),
    #[error("proxy {0}: {1}")]
    Status(usize, tonic::Status),
    #[error("proxy {0}: the server ended the stream")]
    Ended(usize),
    #[error("proxy {0}: its request stream closed")]
    Send(usize),
}

/// Which ADS the proxies speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Xds {
    /// State of the world: each response carries the type's whole set.
    Sotw,
    /// Incremental: only what changed (the agent's default).
    Delta,
}

impl std::fmt::Display for Xds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Sotw => "sotw",
            Self::Delta => "delta",
        })
    }
}

/// Whom the proxies dial.
#[derive(Clone)]
pub enum Target {
    /// Remora's discovery server: TLS with the bench's CA, a bearer token.
    Remora {
        addr: SocketAddr,
        bundle: Arc<String>,
        token: Arc<String>,
    },
    /// istiod's plaintext xDS port (`--grpcAddr`).
    Istiod { addr: SocketAddr },
}

/// Who proxy `index` is.
#[derive(Clone, Debug)]
pub struct Identity {
    pub index: usize,
    pub ip: Ipv4Addr,
    pub namespace: String,
    /// Its workload (`app` label; proxies of one workload declare the same Services).
    pub workload: String,
}

impl Identity {
    pub fn pod(&self) -> String {
        format!("p-{}", self.index)
    }

    /// Istio's sidecar node id, which Remora reads the same way.
    pub fn node_id(&self) -> String {
        let ns = &self.namespace;
        format!(
            "sidecar~{}~{}.{ns}~{ns}.svc.cluster.local",
            self.ip,
            self.pod()
        )
    }

    /// The metadata pilot-agent sends that istiod reads to place a proxy
    /// with no pod behind it (labels pick its Sidecar resource).
    fn istio_metadata(&self) -> Struct {
        let s = |v: &str| Value {
            kind: Some(Kind::StringValue(v.to_string())),
        };
        let labels = Struct {
            fields: [("app".to_string(), s(&self.workload))].into(),
        };
        let fields = [
            ("ISTIO_VERSION", s("1.31.0")),
            ("CLUSTER_ID", s("Kubernetes")),
            ("NAMESPACE", s(&self.namespace)),
            ("NAME", s(&self.pod())),
            ("SERVICE_ACCOUNT", s("web")),
            ("WORKLOAD_NAME", s(&self.workload)),
            ("INSTANCE_IPS", s(&self.ip.to_string())),
            ("INTERCEPTION_MODE", s("REDIRECT")),
            (
                "LABELS",
                Value {
                    kind: Some(Kind::StructValue(labels)),
                },
            ),
        ];
        Struct {
            fields: fields
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
        }
    }
}

/// What one proxy saw.
#[derive(Debug, Default)]
pub struct Seen {
    /// Endpoint address → when the EDS response first carrying it was ACKed.
    pub first_ack: HashMap<Ipv4Addr, Instant>,
    /// Endpoint address → when the first EDS response after which the
    /// proxy no longer held it was ACKed (it held it before).
    pub first_ack_without: HashMap<Ipv4Addr, Instant>,
    /// Each EDS cluster's addresses as the proxy holds them: a response
    /// replaces the clusters it carries, as Envoy applies EDS.
    held: HashMap<String, HashSet<Ipv4Addr>>,
    pub eds_responses: u64,
    /// EDS clusters in its latest CDS response.
    pub eds_clusters: usize,
}

/// What every proxy of a phase saw, by index.
pub struct Board {
    seen: Vec<Mutex<Seen>>,
}

impl Board {
    pub fn new(proxies: usize) -> Arc<Self> {
        Arc::new(Self {
            seen: (0..proxies).map(|_| Mutex::default()).collect(),
        })
    }

    pub fn with<T>(&self, i: usize, f: impl FnOnce(&Seen) -> T) -> T {
        f(&self.seen[i].lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn with_mut<T>(&self, i: usize, f: impl FnOnce(&mut Seen) -> T) -> T {
        f(&mut self.seen[i].lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// When the last of `who` ACKed a version without `ip` (having held
    /// it), or `None` while one has not.
    pub fn all_acked_without(&self, who: &[usize], ip: Ipv4Addr) -> Option<Instant> {
        let mut last: Option<Instant> = None;
        for &i in who {
            let t = self.with(i, |s| s.first_ack_without.get(&ip).copied())?;
            last = Some(last.map_or(t, |l| l.max(t)));
        }
        last
    }

    /// When the last of `who` ACKed `ip`, or `None` while one has not.
    pub fn all_acked(&self, who: &[usize], ip: Ipv4Addr) -> Option<Instant> {
        let mut last: Option<Instant> = None;
        for &i in who {
            let t = self.with(i, |s| s.first_ack.get(&ip).copied())?;
            last = Some(last.map_or(t, |l| l.max(t)));
        }
        last
    }
}

/// One proxy's ADS client, as each contender is dialled.
enum Ads {
    Remora(AggregatedDiscoveryServiceClient<remora_test_support::h2_client::Channel>),
    Istiod(AggregatedDiscoveryServiceClient<tonic::transport::Channel>),
}

impl Ads {
    async fn connect(
        target: &Target,
        who: &Identity,
    ) -> Result<(Self, Option<String>), ProxyError> {
        let i = who.index;
        match target {
            Target::Remora {
                addr,
                bundle,
                token,
            } => {
                let h2 = remora_test_support::h2_client::connect(
                    IpAddr::V4(who.ip),
                    *addr,
                    REMORA_SERVER_NAME,
                    bundle,
                )
                .await
                .map_err(|e| ProxyError::Connect(i, e.to_string()))?;
                let origin = format!("https://{REMORA_SERVER_NAME}")
                    .parse()
                    .map_err(|e: http::uri::InvalidUri| ProxyError::Connect(i, e.to_string()))?;
                // The connection's task lives as long as a stream uses it.
                let c = AggregatedDiscoveryServiceClient::with_origin(
                    remora_test_support::h2_client::channel(&h2),
                    origin,
                )
                .max_decoding_message_size(MAX_MESSAGE);
                Ok((Self::Remora(c), Some(format!("Bearer {token}"))))
            }
            Target::Istiod { addr } => {
                let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                    .map_err(|e| ProxyError::Connect(i, e.to_string()))?
                    .local_address(Some(IpAddr::V4(who.ip)))
                    .tcp_nodelay(true)
                    .connect()
                    .await
                    .map_err(|e| ProxyError::Connect(i, e.to_string()))?;
                let c = AggregatedDiscoveryServiceClient::new(channel)
                    .max_decoding_message_size(MAX_MESSAGE);
                Ok((Self::Istiod(c), None))
            }
        }
    }
}

/// `requests` as a gRPC request, with `bearer` as its authorization.
fn with_bearer<T>(
    i: usize,
    requests: mpsc::UnboundedReceiver<T>,
    bearer: Option<String>,
) -> Result<tonic::Request<UnboundedReceiverStream<T>>, ProxyError> {
    let mut req = tonic::Request::new(UnboundedReceiverStream::new(requests));
    if let Some(b) = bearer {
        let v = b
            .parse()
            .map_err(|_| ProxyError::Connect(i, "token is no header value".into()))?;
        req.metadata_mut().insert("authorization", v);
    }
    Ok(req)
}

/// A state-of-the-world ADS stream to `target` from `who`'s address, its
/// requests read from `rx` (the first names the node).
pub async fn open(
    target: &Target,
    who: &Identity,
    rx: mpsc::UnboundedReceiver<DiscoveryRequest>,
) -> Result<tonic::Streaming<DiscoveryResponse>, ProxyError> {
    let i = who.index;
    let (ads, bearer) = Ads::connect(target, who).await?;
    let req = with_bearer(i, rx, bearer)?;
    let r = match ads {
        Ads::Remora(mut c) => c.stream_aggregated_resources(req).await,
        Ads::Istiod(mut c) => c.stream_aggregated_resources(req).await,
    };
    Ok(r.map_err(|s| ProxyError::Status(i, s))?.into_inner())
}

async fn open_delta(
    target: &Target,
    who: &Identity,
    rx: mpsc::UnboundedReceiver<DeltaDiscoveryRequest>,
) -> Result<tonic::Streaming<DeltaDiscoveryResponse>, ProxyError> {
    let i = who.index;
    let (ads, bearer) = Ads::connect(target, who).await?;
    let req = with_bearer(i, rx, bearer)?;
    let r = match ads {
        Ads::Remora(mut c) => c.delta_aggregated_resources(req).await,
        Ads::Istiod(mut c) => c.delta_aggregated_resources(req).await,
    };
    Ok(r.map_err(|s| ProxyError::Status(i, s))?.into_inner())
}

/// The names of the EDS clusters among CDS resources, sorted.
fn eds_clusters<'a>(resources: impl Iterator<Item = &'a Any>) -> Vec<String> {
    let mut names: Vec<String> = resources
        .filter_map(|a| Cluster::decode(a.value.as_slice()).ok())
        .filter(|c| {
            c.cluster_discovery_type == Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32))
        })
        .map(|c| c.name)
        .collect();
    names.sort();
    names
}

/// Whether Envoy routes to an endpoint of this health status: not to one
/// EDS marks unhealthy, draining or timed out.
fn routable(health_status: i32) -> bool {
    use envoy_types::pb::envoy::config::core::v3::HealthStatus;
    ![
        HealthStatus::Unhealthy,
        HealthStatus::Draining,
        HealthStatus::Timeout,
    ]
    .iter()
    .any(|h| *h as i32 == health_status)
}

/// The routable addresses of a load assignment.
fn addresses(c: ClusterLoadAssignment) -> HashSet<Ipv4Addr> {
    c.endpoints
        .into_iter()
        .flat_map(|l| l.lb_endpoints)
        .filter(|e| routable(e.health_status))
        .filter_map(|e| match e.host_identifier? {
            HostIdentifier::Endpoint(e) => match e.address?.address? {
                address::Address::SocketAddress(s) => {
                    matches!(
                        s.port_specifier,
                        Some(socket_address::PortSpecifier::PortValue(_))
                    )
                    .then_some(())?;
                    s.address.parse().ok()
                }
                _ => None,
            },
            _ => None,
        })
        .collect()
}

/// Proxy `i` ACKed EDS resources `resources` now.
fn eds_acked<'a>(board: &Board, i: usize, resources: impl Iterator<Item = &'a Any>) {
    let acked = Instant::now();
    let assignments: Vec<(String, HashSet<Ipv4Addr>)> = resources
        .filter_map(|a| ClusterLoadAssignment::decode(a.value.as_slice()).ok())
        .map(|c| (c.cluster_name.clone(), addresses(c)))
        .collect();
    board.with_mut(i, |s| {
        s.eds_responses += 1;
        let union = |held: &HashMap<String, HashSet<Ipv4Addr>>| -> HashSet<Ipv4Addr> {
            held.values().flatten().copied().collect()
        };
        let before = union(&s.held);
        for (cluster, ips) in assignments {
            for ip in &ips {
                s.first_ack.entry(*ip).or_insert(acked);
            }
            s.held.insert(cluster, ips);
        }
        let after = union(&s.held);
        for ip in before.difference(&after) {
            s.first_ack_without.entry(*ip).or_insert(acked);
        }
    });
}

/// The node a proxy announces on its first request.
fn node(target: &Target, who: &Identity) -> Option<Node> {
    Some(Node {
        id: who.node_id(),
        cluster: who.workload.clone(),
        metadata: matches!(target, Target::Istiod { .. }).then(|| who.istio_metadata()),
        ..Default::default()
    })
}

/// Run proxy `who` against `target` speaking `xds` until `stop`,
/// recording into `board`.
pub async fn run(
    target: Target,
    who: Identity,
    xds: Xds,
    board: Arc<Board>,
    stop: CancellationToken,
) -> Result<(), ProxyError> {
    match xds {
        Xds::Sotw => run_sotw(target, who, board, stop).await,
        Xds::Delta => run_delta(target, who, board, stop).await,
    }
}

/// Delta as Envoy speaks it: CDS and LDS as wildcards, EDS by name (the
/// EDS clusters CDS brings, subscribed as they come, unsubscribed as they
/// go); every response ACKed with its nonce.
async fn run_delta(
    target: Target,
    who: Identity,
    board: Arc<Board>,
    stop: CancellationToken,
) -> Result<(), ProxyError> {
    let i = who.index;
    let (tx, rx) = mpsc::unbounded_channel();
    let send = |r| tx.send(r).map_err(|_| ProxyError::Send(i));
    send(DeltaDiscoveryRequest {
        node: node(&target, &who),
        ..delta_request(CLUSTER, Vec::new(), None)
    })?;
    let mut stream = tokio::select! {
        _ = stop.cancelled() => return Ok(()),
        s = open_delta(&target, &who, rx) => s?,
    };
    // The EDS clusters held (CDS name → whether EDS).
    let mut clusters: std::collections::BTreeMap<String, bool> = Default::default();
    let mut listeners_asked = false;
    loop {
        let resp = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            r = stream.next() => match r {
                Some(r) => r.map_err(|s| ProxyError::Status(i, s))?,
                None => return Err(ProxyError::Ended(i)),
            },
        };
        send(delta_request(&resp.type_url, Vec::new(), Some(&resp)))?;
        let held = resp.resources.iter().filter_map(|r| r.resource.as_ref());
        match resp.type_url.as_str() {
            CLUSTER => {
                let eds: std::collections::BTreeSet<String> =
                    eds_clusters(held).into_iter().collect();
                let mut subscribe = Vec::new();
                for r in &resp.resources {
                    let is_eds = eds.contains(&r.name);
                    if is_eds && clusters.insert(r.name.clone(), true) != Some(true) {
                        subscribe.push(r.name.clone());
                    } else if !is_eds {
                        clusters.insert(r.name.clone(), false);
                    }
                }
                let mut unsubscribe = Vec::new();
                for n in &resp.removed_resources {
                    if clusters.remove(n) == Some(true) {
                        unsubscribe.push(n.clone());
                    }
                }
                board.with_mut(i, |s| {
                    s.eds_clusters = clusters.values().filter(|e| **e).count()
                });
                if !subscribe.is_empty() || !unsubscribe.is_empty() {
                    send(DeltaDiscoveryRequest {
                        resource_names_unsubscribe: unsubscribe,
                        ..delta_request(ENDPOINTS, subscribe, None)
                    })?;
                }
                if !listeners_asked {
                    listeners_asked = true;
                    send(delta_request(LISTENER, Vec::new(), None))?;
                }
            }
            ENDPOINTS => eds_acked(&board, i, held),
            _ => {}
        }
    }
}

/// State of the world as Envoy speaks it: every response ACKed with its
/// version and nonce, EDS asked for by name again when the clusters change.
async fn run_sotw(
    target: Target,
    who: Identity,
    board: Arc<Board>,
    stop: CancellationToken,
) -> Result<(), ProxyError> {
    let i = who.index;
    let (tx, rx) = mpsc::unbounded_channel();
    let send = |r| tx.send(r).map_err(|_| ProxyError::Send(i));
    send(DiscoveryRequest {
        node: node(&target, &who),
        ..request(CLUSTER, Vec::new(), None)
    })?;
    let mut stream = tokio::select! {
        _ = stop.cancelled() => return Ok(()),
        s = open(&target, &who, rx) => s?,
    };
    let mut eds_names: Vec<String> = Vec::new();
    let mut listeners_asked = false;
    loop {
        let resp = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            r = stream.next() => match r {
                Some(r) => r.map_err(|s| ProxyError::Status(i, s))?,
                None => return Err(ProxyError::Ended(i)),
            },
        };
        match resp.type_url.as_str() {
            CLUSTER => {
                let names = eds_clusters(resp.resources.iter());
                board.with_mut(i, |s| s.eds_clusters = names.len());
                send(request(CLUSTER, Vec::new(), Some(&resp)))?;
                // Envoy asks for the endpoints of its EDS clusters (again
                // when they change), then for listeners once.
                if names != eds_names {
                    eds_names = names;
                    send(request(ENDPOINTS, eds_names.clone(), None))?;
                }
                if !listeners_asked {
                    listeners_asked = true;
                    send(request(LISTENER, Vec::new(), None))?;
                }
            }
            ENDPOINTS => {
                send(request(ENDPOINTS, eds_names.clone(), Some(&resp)))?;
                eds_acked(&board, i, resp.resources.iter());
            }
            t => send(request(t, Vec::new(), Some(&resp)))?,
        }
    }
}

/// Proxy `i`'s address: 127.10.x.y, one per pod.
pub fn proxy_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 10, (i / 250) as u8, (i % 250 + 1) as u8)
}

/// Start `n` proxies against `target` (a few at a time, as a rollout
/// would, not all at once).
pub async fn start_all(
    target: &Target,
    xds: Xds,
    identities: &[Identity],
    board: &Arc<Board>,
    stop: &CancellationToken,
) -> Vec<tokio::task::JoinHandle<Result<(), ProxyError>>> {
    let mut tasks = Vec::with_capacity(identities.len());
    for (k, who) in identities.iter().enumerate() {
        tasks.push(tokio::spawn(run(
            target.clone(),
            who.clone(),
            xds,
            Arc::clone(board),
            stop.clone(),
        )));
        if k % 50 == 49 {
            tokio::task::yield_now().await;
        }
    }
    tasks
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::{Address, HealthStatus, SocketAddress};
    use envoy_types::pb::envoy::config::endpoint::v3::{Endpoint, LbEndpoint, LocalityLbEndpoints};

    /// Cluster `name`'s load assignment: each address with its health.
    fn cla(name: &str, hosts: &[(&str, HealthStatus)]) -> Any {
        let lb_endpoints = hosts
            .iter()
            .map(|(ip, h)| LbEndpoint {
                health_status: *h as i32,
                host_identifier: Some(HostIdentifier::Endpoint(Endpoint {
                    address: Some(Address {
                        address: Some(address::Address::SocketAddress(SocketAddress {
                            address: (*ip).into(),
                            port_specifier: Some(socket_address::PortSpecifier::PortValue(8080)),
                            ..Default::default()
                        })),
                    }),
                    ..Default::default()
                })),
                ..Default::default()
            })
            .collect();
        let c = ClusterLoadAssignment {
            cluster_name: name.into(),
            endpoints: vec![LocalityLbEndpoints {
                lb_endpoints,
                ..Default::default()
            }],
            ..Default::default()
        };
        Any {
            type_url: ENDPOINTS.into(),
            value: c.encode_to_vec(),
        }
    }

    #[test]
    fn an_endpoint_counts_withdrawn_once_a_response_leaves_the_proxy_without_it() {
        let (a, b) = (Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2));
        let ok = HealthStatus::Unknown;
        let board = Board::new(1);
        eds_acked(
            &board,
            0,
            [
                cla("cart", &[("10.0.0.1", ok), ("10.0.0.2", ok)]),
                cla("db", &[]),
            ]
            .iter(),
        );
        assert!(board.all_acked(&[0], a).is_some());
        // Another cluster's response leaves cart's endpoints as they were.
        eds_acked(&board, 0, [cla("db", &[("10.0.0.9", ok)])].iter());
        assert_eq!(board.all_acked_without(&[0], a), None);
        // cart without a, and b marked unhealthy: neither is routed to.
        eds_acked(
            &board,
            0,
            [cla("cart", &[("10.0.0.2", HealthStatus::Unhealthy)])].iter(),
        );
        let without_a = board.all_acked_without(&[0], a).expect("a withdrawn");
        assert!(board.all_acked_without(&[0], b).is_some(), "unhealthy");
        // An address never held is never withdrawn; a later ACK keeps the first time.
        assert_eq!(
            board.all_acked_without(&[0], Ipv4Addr::new(10, 0, 0, 7)),
            None
        );
        eds_acked(&board, 0, [cla("cart", &[])].iter());
        assert_eq!(board.all_acked_without(&[0], a), Some(without_a));
        assert_eq!(board.with(0, |s| s.eds_responses), 4);
    }
}
