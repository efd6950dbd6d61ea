//! The simulated fleet the discovery benches share: Remora's discovery
//! server in this process (TLS, the chart's bounds, a TokenReview double:
//! every proxy shows the same cached token) with its registry fed
//! directly, and N simulated proxies, each a real gRPC ADS client over TLS
//! from a loopback address of its own (as pods have theirs), subscribing
//! and ACKing as Envoy does, state of the world or delta. Each proxy
//! declares `shared` (every proxy), one of S Services (N/S each) and
//! `rollout` (100 endpoints) in `remora.dev/outbound`.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use futures::StreamExt;
use remora_contract::discovery::{ServiceHost, TOKEN_AUDIENCE};
use remora_operator::discovery::Metrics;
use remora_operator::discovery::push::{Debounce, Discovery};
use remora_operator::discovery::registry::{
    PodKey, Protocol, ProxyInfo, ServiceInfo, ServicePort, SliceInfo,
};
use remora_operator::discovery::resources::{CLUSTER, ENDPOINTS, LISTENER};
use remora_operator::discovery::serve::{limits, serve};
use remora_operator::discovery::server::AdsService;
use remora_operator::pki::workload_ca::authn::{AuthError, Authenticate, Caller, Gate, GateLimits};
use remora_operator::pki::workload_ca::{ServingCert, testing};
use remora_test_support::ads_requests::{delta_request, request};
use remora_test_support::h2_client::{self, H2};
use remora_test_support::jwt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub const SERVER_NAME: &str = "remora-operator.ops.svc";
pub const EXP: u64 = 4_000_000_000;
pub const NS: &str = "shop";
/// Pods of the `rollout` Service, replaced one at a time.
pub const ROLLOUT_PODS: usize = 100;

/// Which ADS the simulated proxies speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Xds {
    /// State of the world: every response carries the type's whole set.
    Sotw,
    /// Incremental: only the resources that changed (the agent's default).
    Delta,
}

impl Xds {
    pub fn label(self) -> &'static str {
        match self {
            Self::Sotw => "sotw",
            Self::Delta => "delta",
        }
    }
}

impl std::fmt::Display for Xds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// Stand-in for the API server's TokenReview: the one token every
/// simulated proxy shows is `shop/web`'s, not bound to a pod.
struct TokenReviewDouble;

impl Authenticate for TokenReviewDouble {
    async fn authenticate(&self, token: &str) -> Result<Caller, AuthError> {
        if token != jwt::service_account(TOKEN_AUDIENCE, EXP, 1) {
            return Err(AuthError::Rejected("unknown token".into()));
        }
        Ok(Caller {
            namespace: NS.into(),
            service_account: "web".into(),
            pod: None,
        })
    }
}

fn host(name: &str) -> ServiceHost {
    ServiceHost {
        name: name.into(),
        namespace: NS.into(),
    }
}

pub fn service_name(j: usize) -> String {
    format!("svc-{j}")
}

/// Proxy `i`'s address: 127.10.x.y, one per pod.
pub fn proxy_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 10, (i / 250) as u8, (i % 250 + 1) as u8)
}

pub fn slice(name: &str, endpoints: &[String]) -> SliceInfo {
    SliceInfo {
        service: Some(host(name)),
        ports: [("http".to_string(), 8080)].into(),
        ready: endpoints.iter().filter_map(|ip| ip.parse().ok()).collect(),
        ..Default::default()
    }
}

type Client = AggregatedDiscoveryServiceClient<h2_client::Channel>;

fn client(h2: &H2<tonic::body::Body>) -> Client {
    AggregatedDiscoveryServiceClient::with_origin(
        h2_client::channel(h2),
        format!("https://{SERVER_NAME}").parse().expect("origin"),
    )
}

/// When each proxy ACKed each EDS version.
#[derive(Default)]
pub struct Acks {
    /// (proxy, EDS version) → when its ACK was sent.
    pub at: Mutex<BTreeMap<(usize, String), Instant>>,
    /// Proxies that ACKed their first EDS response.
    pub subscribed: std::sync::atomic::AtomicUsize,
    /// Per proxy, the latest rollout step its `rollout` endpoints show
    /// (10.9.<step>.1 is the pod of step <step>), and when it ACKed it.
    pub rollout: Mutex<BTreeMap<usize, (u8, Instant)>>,
}

/// One simulated proxy: connect, then speak `xds` until `stop`.
async fn run_proxy(
    i: usize,
    xds: Xds,
    addr: SocketAddr,
    bundle: Arc<String>,
    token: Arc<String>,
    acks: Arc<Acks>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let h2 = h2_client::connect(IpAddr::V4(proxy_ip(i)), addr, SERVER_NAME, &bundle)
        .await
        .with_context(|| format!("proxy {i} connects"))?;
    let c = client(&h2);
    let node = Some(Node {
        id: format!("sidecar~{}~p-{i}.{NS}~{NS}.svc.cluster.local", proxy_ip(i)),
        ..Default::default()
    });
    match xds {
        Xds::Sotw => run_sotw(i, c, node, &token, &acks, &stop).await,
        Xds::Delta => run_delta(i, c, node, &token, &acks, &stop).await,
    }
}

/// When proxy `i` ACKed EDS response `key` (a version, or a delta nonce),
/// and the rollout step its `rollout` endpoints show, if the response had them.
fn eds_acked<'a>(
    i: usize,
    key: &str,
    resources: impl Iterator<Item = &'a Any>,
    acks: &Acks,
    first_eds: &mut bool,
) {
    if let Some(step) = rollout_step(resources) {
        acks.rollout
            .lock()
            .expect("lock")
            .insert(i, (step, Instant::now()));
    }
    acks.at
        .lock()
        .expect("lock")
        .insert((i, key.to_string()), Instant::now());
    if std::mem::take(first_eds) {
        acks.subscribed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The cluster names of CDS resources.
fn cluster_names<'a>(resources: impl Iterator<Item = &'a Any>) -> Vec<String> {
    resources
        .filter_map(|a| {
            remora_operator::discovery::resources::decode::<
                envoy_types::pb::envoy::config::cluster::v3::Cluster,
            >(a)
        })
        .map(|c| c.name)
        .collect()
}

/// State of the world as Envoy speaks it: CDS, then EDS of the clusters
/// it got, then LDS; every response ACKed with its version and nonce.
async fn run_sotw(
    i: usize,
    mut c: Client,
    node: Option<Node>,
    token: &str,
    acks: &Acks,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    let (tx, rx) = mpsc::unbounded_channel();
    tx.send(DiscoveryRequest {
        node,
        ..request(CLUSTER, Vec::new(), None)
    })?;
    let mut req = tonic::Request::new(tokio_stream::wrappers::UnboundedReceiverStream::new(rx));
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse()?);
    let mut stream = c.stream_aggregated_resources(req).await?.into_inner();
    let mut first_eds = true;
    loop {
        let resp = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            r = stream.next() => match r {
                Some(r) => r?,
                None => anyhow::bail!("proxy {i}: the stream ended"),
            },
        };
        let t = resp.type_url.as_str();
        if t == CLUSTER {
            // Envoy asks for the endpoints of its EDS clusters, then listeners.
            let names = cluster_names(resp.resources.iter());
            tx.send(request(CLUSTER, Vec::new(), Some(&resp)))?;
            tx.send(request(ENDPOINTS, names, None))?;
            tx.send(request(LISTENER, Vec::new(), None))?;
        } else if t == ENDPOINTS {
            tx.send(request(ENDPOINTS, resp_names(&resp), Some(&resp)))?;
            eds_acked(
                i,
                &resp.version_info,
                resp.resources.iter(),
                acks,
                &mut first_eds,
            );
        } else {
            tx.send(request(t, Vec::new(), Some(&resp)))?;
        }
    }
}

/// Delta as Envoy speaks it: CDS as a wildcard, then EDS by name for the
/// clusters it got (only those new to it), then LDS as a wildcard; every
/// response ACKed with its nonce.
async fn run_delta(
    i: usize,
    mut c: Client,
    node: Option<Node>,
    token: &str,
    acks: &Acks,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    let (tx, rx) = mpsc::unbounded_channel();
    tx.send(DeltaDiscoveryRequest {
        node,
        ..delta_request(CLUSTER, Vec::new(), None)
    })?;
    let mut req = tonic::Request::new(tokio_stream::wrappers::UnboundedReceiverStream::new(rx));
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse()?);
    let mut stream = c.delta_aggregated_resources(req).await?.into_inner();
    let mut first_eds = true;
    let mut subscribed = std::collections::BTreeSet::new();
    let mut asked_listeners = false;
    loop {
        let resp = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            r = stream.next() => match r {
                Some(r) => r?,
                None => anyhow::bail!("proxy {i}: the stream ended"),
            },
        };
        let t = resp.type_url.as_str();
        tx.send(delta_request(t, Vec::new(), Some(&resp)))?;
        let held = resp.resources.iter().filter_map(|r| r.resource.as_ref());
        if t == CLUSTER {
            let new: Vec<String> = cluster_names(held)
                .into_iter()
                .filter(|n| subscribed.insert(n.clone()))
                .collect();
            if !new.is_empty() {
                tx.send(delta_request(ENDPOINTS, new, None))?;
            }
            if !std::mem::replace(&mut asked_listeners, true) {
                tx.send(delta_request(LISTENER, Vec::new(), None))?;
            }
        } else if t == ENDPOINTS {
            eds_acked(i, &resp.nonce, held, acks, &mut first_eds);
        }
    }
}

/// The latest rollout step among the `rollout` Service's endpoints.
fn rollout_step<'a>(resources: impl Iterator<Item = &'a Any>) -> Option<u8> {
    resources
        .filter_map(|a| {
            remora_operator::discovery::resources::decode::<
                envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment,
            >(a)
        })
        .find(|c| c.cluster_name.contains("||rollout."))?
        .endpoints
        .iter()
        .flat_map(|l| &l.lb_endpoints)
        .filter_map(|e| {
            let debug = format!("{e:?}");
            let at = debug.find("\"10.9.")? + 6;
            debug[at..].split('.').next()?.parse::<u8>().ok()
        })
        .max()
}

/// Rollout pod `step` (0 = the pods before the rollout).
pub fn rollout_ip(step: usize, replica: usize) -> String {
    format!("10.9.{step}.{}", replica + 1)
}

/// The cluster names of an EDS response (what the proxy keeps asking for).
fn resp_names(resp: &DiscoveryResponse) -> Vec<String> {
    resp.resources
        .iter()
        .filter_map(|a| {
            remora_operator::discovery::resources::decode::<
                envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment,
            >(a)
        })
        .map(|c| c.cluster_name)
        .collect()
}

/// Fresh endpoint addresses (10.1.x.y), never one twice.
#[derive(Default)]
pub struct Endpoints(u32);

impl Endpoints {
    pub fn fresh(&mut self, n: usize) -> Vec<String> {
        (0..n)
            .map(|_| {
                self.0 += 1;
                Ipv4Addr::from(0x0a01_0000 + self.0).to_string()
            })
            .collect()
    }
}

/// The server and its proxies, every one subscribed.
pub struct Fleet {
    pub discovery: Arc<Discovery>,
    pub acks: Arc<Acks>,
    pub endpoints: Endpoints,
    /// One task per proxy.
    pub tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
    /// Stops the server and every proxy.
    pub stop: CancellationToken,
    /// From the first connection to the last proxy's first EDS ACK.
    pub subscribe_seconds: f64,
    _authority:
        tokio::sync::watch::Sender<Option<Arc<remora_operator::pki::workload_ca::Authority>>>,
}

impl Fleet {
    /// A server with `debounce` and `push_throttle`, and `proxies` proxies
    /// speaking `xds` over `services` Services, each subscribed.
    pub async fn start(
        proxies: usize,
        services: usize,
        xds: Xds,
        debounce: Debounce,
        push_throttle: usize,
    ) -> anyhow::Result<Self> {
        // The workload CA's serving certificate, as the operator has it.
        let authority = testing::authority(&[SERVER_NAME]).map_err(anyhow::Error::msg)?;
        let bundle = Arc::new(authority.bundle.clone());
        let (authority_tx, authority_rx) = tokio::sync::watch::channel(Some(Arc::new(authority)));

        // Plain text, as the figures in the README were measured (the endpoints
        // here name no pods, so with the mesh on each would only carry a mark).
        let (discovery, debouncer) =
            Discovery::with_push_throttle("cluster.local", None, debounce, push_throttle);
        tokio::spawn(debouncer);
        let mut endpoints = Endpoints::default();
        let names: Vec<String> = std::iter::once("shared".to_string())
            .chain((0..services).map(service_name))
            .collect();
        let mut initial: Vec<(String, Vec<String>)> = names
            .iter()
            .map(|n| (n.clone(), endpoints.fresh(3)))
            .collect();
        initial.push((
            "rollout".into(),
            (0..ROLLOUT_PODS).map(|r| rollout_ip(0, r)).collect(),
        ));
        discovery.update(|r| {
            let mut t = Vec::new();
            for (name, eps) in &initial {
                t.extend(r.apply_service(
                    host(name),
                    ServiceInfo {
                        ports: vec![ServicePort {
                            port: 80,
                            name: "http".into(),
                            protocol: Protocol::Http,
                        }],
                        ..Default::default()
                    },
                ));
                t.extend(r.apply_slice((NS.into(), format!("{name}-1")), slice(name, eps)));
            }
            for i in 0..proxies {
                t.extend(
                    r.apply_proxy(
                        PodKey {
                            namespace: NS.into(),
                            name: format!("p-{i}"),
                        },
                        ProxyInfo {
                            ip: Some(proxy_ip(i).to_string()),
                            service_account: "web".into(),
                            outbound: Some(
                                format!(
                                    "15001:shared.{NS}:80,15002:{}.{NS}:80,15003:rollout.{NS}:80",
                                    service_name(i % services)
                                )
                                .into(),
                            ),
                            ..Default::default()
                        },
                    ),
                );
            }
            t
        });

        let stop = CancellationToken::new();
        let svc = AdsService {
            auth: TokenReviewDouble,
            gate: Gate::new(TOKEN_AUDIENCE, GateLimits::default()),
            discovery: Arc::clone(&discovery),
            metrics: Metrics::default(),
            events: None,
            shutdown: stop.clone(),
            pod_wait: Duration::ZERO,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        // The chart's bounds; every proxy has a source address of its own.
        let limits = limits();
        let token = stop.clone();
        tokio::spawn(async move {
            if let Err(e) = serve(
                listener,
                svc,
                Arc::new(ServingCert(authority_rx)),
                limits,
                token,
            )
            .await
            {
                eprintln!("the server failed: {e}");
            }
        });

        // Connect every proxy, a few at a time (as a rollout would, not all at once).
        let acks = Arc::new(Acks::default());
        let tok = Arc::new(jwt::service_account(TOKEN_AUDIENCE, EXP, 1));
        let connect_started = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..proxies {
            tasks.push(tokio::spawn(run_proxy(
                i,
                xds,
                addr,
                Arc::clone(&bundle),
                Arc::clone(&tok),
                Arc::clone(&acks),
                stop.clone(),
            )));
            if i % 50 == 49 {
                tokio::task::yield_now().await;
            }
        }
        let deadline = Instant::now() + Duration::from_secs(300);
        while acks.subscribed.load(std::sync::atomic::Ordering::Relaxed) < proxies {
            anyhow::ensure!(
                Instant::now() < deadline,
                "only {} of {} proxies subscribed within 300 s",
                acks.subscribed.load(std::sync::atomic::Ordering::Relaxed),
                proxies
            );
            if let Some(i) = tasks.iter().position(|t| t.is_finished()) {
                let ended = tasks.swap_remove(i).await;
                anyhow::bail!("a proxy ended early: {ended:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let subscribe_seconds = connect_started.elapsed().as_secs_f64();
        Ok(Self {
            discovery,
            acks,
            endpoints,
            tasks,
            stop,
            subscribe_seconds,
            _authority: authority_tx,
        })
    }
}
