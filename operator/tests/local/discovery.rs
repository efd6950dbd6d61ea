//! The discovery server over TLS, driven by a real gRPC ADS client (Envoy's
//! stubs from envoy-types), with the registry fed directly and a test
//! double for the API server's TokenReview.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use futures::StreamExt;
use remora_contract::discovery::TOKEN_AUDIENCE;
use remora_operator::discovery::Metrics;
use remora_operator::discovery::push::{DEFAULT_PUSH_THROTTLE, Debounce, Discovery};
use remora_operator::discovery::registry::{
    PodKey, Protocol, ProxyInfo, ServiceInfo, ServicePort, SliceInfo,
};
use remora_operator::discovery::resources::{CLUSTER, ENDPOINTS, LISTENER, WITHDRAWAL, decode};
use remora_operator::discovery::serve::{Limits, limits, serve};
use remora_operator::discovery::server::AdsService;
use remora_operator::pki::workload_ca::authn::{AuthError, Authenticate, Caller, Gate, GateLimits};
use remora_operator::pki::workload_ca::{ServingCert, testing};
use remora_operator::pod_events::{PodEvents, Warning};
use remora_test_support::h2_client::{self, H2};
use remora_test_support::jwt;
use remora_test_support::named_backend::{self, NamedBackend};
use remora_test_support::wait::wait_until;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const SERVER_NAME: &str = "remora-operator.ops.svc";
const EXP: u64 = 4_000_000_000;
/// Token nonces the double knows: shop/web (pod-bound or not), shop/db.
const WEB: u64 = 1;
const DB: u64 = 2;
const WAIT: Duration = Duration::from_secs(10);
const CART: &str = "outbound|80||cart.shop.svc.cluster.local";

/// Test double of the API server's TokenReview.
struct TokenReviewDouble;

impl Authenticate for TokenReviewDouble {
    async fn authenticate(&self, token: &str) -> Result<Caller, AuthError> {
        let sa = if token == jwt::service_account(TOKEN_AUDIENCE, EXP, WEB) {
            "web"
        } else if token == jwt::service_account(TOKEN_AUDIENCE, EXP, DB) {
            "db"
        } else {
            return Err(AuthError::Rejected("invalid bearer token".into()));
        };
        Ok(Caller {
            namespace: "shop".into(),
            service_account: sa.into(),
            pod: None,
        })
    }
}

fn cart() -> remora_contract::discovery::ServiceHost {
    remora_contract::discovery::ServiceHost {
        name: "cart".into(),
        namespace: "shop".into(),
    }
}

fn pod(name: &str) -> PodKey {
    PodKey {
        namespace: "shop".into(),
        name: name.into(),
    }
}

fn slice(ips: &[&str]) -> SliceInfo {
    SliceInfo {
        service: Some(cart()),
        ports: [("http".to_string(), 8080)].into(),
        ready: ips.iter().map(|i| i.parse().expect("ip")).collect(),
        ..Default::default()
    }
}

struct Server {
    addr: SocketAddr,
    bundle: String,
    discovery: Arc<Discovery>,
    metrics: Metrics,
    /// The Warning Events the server would publish.
    warnings: tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<Warning>>,
    stop: CancellationToken,
}

impl Server {
    async fn start() -> Self {
        Self::start_with(Duration::ZERO, limits()).await
    }

    /// A server whose streams wait up to `pod_wait` for an unknown pod.
    async fn start_waiting(pod_wait: Duration) -> Self {
        Self::start_with(pod_wait, limits()).await
    }

    async fn start_with(pod_wait: Duration, limits: Limits) -> Self {
        Self::start_throttled(pod_wait, limits, DEFAULT_PUSH_THROTTLE).await
    }

    async fn start_throttled(pod_wait: Duration, limits: Limits, push_throttle: usize) -> Self {
        let debounce = Debounce {
            quiet: Duration::from_millis(10),
            max_delay: Duration::from_millis(50),
        };
        Self::start_full(pod_wait, limits, push_throttle, debounce).await
    }

    /// A server whose debounced changes wait `debounce`.
    async fn start_debounced(debounce: Debounce) -> Self {
        Self::start_full(Duration::ZERO, limits(), DEFAULT_PUSH_THROTTLE, debounce).await
    }

    async fn start_full(
        pod_wait: Duration,
        limits: Limits,
        push_throttle: usize,
        debounce: Debounce,
    ) -> Self {
        let authority = testing::authority(&[SERVER_NAME]).expect("authority");
        let bundle = authority.bundle.clone();
        let (tx, rx) = tokio::sync::watch::channel(Some(Arc::new(authority)));
        let (discovery, debounce) =
            Discovery::with_push_throttle("cluster.local", None, debounce, push_throttle);
        tokio::spawn(debounce);
        discovery.update(|r| {
            let mut t = Vec::new();
            t.extend(r.apply_service(
                cart(),
                ServiceInfo {
                    ports: vec![ServicePort {
                        port: 80,
                        name: "http".into(),
                        protocol: Protocol::Http,
                    }],
                    ..Default::default()
                },
            ));
            t.extend(r.apply_slice(("shop".into(), "cart-1".into()), slice(&["10.1.0.1"])));
            for (name, sa, ip) in [("web-0", "web", "127.0.0.1"), ("db-0", "db", "127.0.0.1")] {
                t.extend(r.apply_proxy(
                    pod(name),
                    ProxyInfo {
                        ip: Some(ip.into()),
                        service_account: sa.into(),
                        outbound: Some("15001:cart.shop:80".into()),
                        ..Default::default()
                    },
                ));
            }
            t
        });
        let metrics = Metrics::default();
        let stop = CancellationToken::new();
        let (events, warnings) = PodEvents::channel_for_tests();
        let svc = AdsService {
            auth: TokenReviewDouble,
            gate: Gate::new(TOKEN_AUDIENCE, GateLimits::default()),
            discovery: Arc::clone(&discovery),
            metrics: metrics.clone(),
            events: Some(events),
            shutdown: stop.clone(),
            pod_wait,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let token = stop.clone();
        tokio::spawn(async move {
            let _tx = tx;
            serve(listener, svc, Arc::new(ServingCert(rx)), limits, token)
                .await
                .expect("served");
        });
        Self {
            addr,
            bundle,
            discovery,
            metrics,
            warnings: tokio::sync::Mutex::new(warnings),
            stop,
        }
    }

    /// `web-0`'s proxy, admitted with its token, its first request sent;
    /// the connection is kept open as long as the returned one lives.
    async fn web_0(&self) -> (H2<tonic::body::Body>, Proxy) {
        let h2 = self.connect().await;
        let mut c = client(&h2);
        let p = open(&mut c, Some(&token(WEB)), hello("web-0"))
            .await
            .expect("admitted");
        (h2, p)
    }

    async fn connect(&self) -> H2<tonic::body::Body> {
        let me: IpAddr = "127.0.0.1".parse().expect("ip");
        h2_client::connect(me, self.addr, SERVER_NAME, &self.bundle)
            .await
            .expect("connected")
    }
}

type Client = AggregatedDiscoveryServiceClient<h2_client::Channel>;

fn client(h2: &H2<tonic::body::Body>) -> Client {
    AggregatedDiscoveryServiceClient::with_origin(
        h2_client::channel(h2),
        format!("https://{SERVER_NAME}").parse().expect("origin"),
    )
}

/// One ADS stream, as a proxy holds it.
struct Proxy {
    tx: mpsc::UnboundedSender<DiscoveryRequest>,
    rx: tonic::Streaming<DiscoveryResponse>,
}

fn node(pod: &str) -> Option<Node> {
    Some(Node {
        id: format!("sidecar~127.0.0.1~{pod}.shop~shop.svc.cluster.local"),
        ..Default::default()
    })
}

fn request(t: &str, names: &[&str], ack: Option<&DiscoveryResponse>) -> DiscoveryRequest {
    DiscoveryRequest {
        type_url: t.into(),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        version_info: ack.map(|r| r.version_info.clone()).unwrap_or_default(),
        response_nonce: ack.map(|r| r.nonce.clone()).unwrap_or_default(),
        ..Default::default()
    }
}

/// Open a stream whose first request is `first`, with `token` (if any).
async fn open(
    c: &mut Client,
    token: Option<&str>,
    first: DiscoveryRequest,
) -> Result<Proxy, tonic::Status> {
    let (tx, rx) = mpsc::unbounded_channel();
    tx.send(first).expect("queued");
    let mut req = tonic::Request::new(tokio_stream::wrappers::UnboundedReceiverStream::new(rx));
    if let Some(t) = token {
        let v = format!("Bearer {t}").parse().expect("header value");
        req.metadata_mut().insert("authorization", v);
    }
    let rx = c.stream_aggregated_resources(req).await?.into_inner();
    Ok(Proxy { tx, rx })
}

impl Proxy {
    async fn next(&mut self) -> Result<DiscoveryResponse, tonic::Status> {
        match tokio::time::timeout(WAIT, self.rx.next()).await {
            Ok(Some(r)) => r,
            Ok(None) => Err(tonic::Status::aborted("the stream ended")),
            Err(_) => panic!("no response within {WAIT:?}"),
        }
    }

    fn send(&self, r: DiscoveryRequest) {
        self.tx.send(r).expect("sent");
    }
}

fn token(n: u64) -> String {
    jwt::service_account(TOKEN_AUDIENCE, EXP, n)
}

/// The first request of `pod`'s proxy.
fn hello(pod: &str) -> DiscoveryRequest {
    DiscoveryRequest {
        node: node(pod),
        ..request(CLUSTER, &[], None)
    }
}

/// A proxy subscribed to CDS, LDS and EDS, every response ACKed. Returns
/// the last EDS response.
async fn subscribed(p: &mut Proxy) -> DiscoveryResponse {
    let cds = p.next().await.expect("cds");
    assert_eq!(cds.type_url, CLUSTER);
    p.send(request(CLUSTER, &[], Some(&cds)));
    p.send(request(LISTENER, &[], None));
    let lds = p.next().await.expect("lds");
    assert_eq!(lds.type_url, LISTENER);
    p.send(request(LISTENER, &[], Some(&lds)));
    p.send(request(ENDPOINTS, &[CART], None));
    let eds = p.next().await.expect("eds");
    assert_eq!(eds.type_url, ENDPOINTS);
    p.send(request(ENDPOINTS, &[CART], Some(&eds)));
    eds
}

fn endpoints(r: &DiscoveryResponse) -> Vec<String> {
    let cla: ClusterLoadAssignment = decode(&r.resources[0]).expect("cla");
    cla.endpoints
        .iter()
        .flat_map(|l| &l.lb_endpoints)
        .map(|e| format!("{e:?}"))
        .collect()
}

#[tokio::test]
async fn a_proxy_gets_its_declared_service_then_endpoint_changes_as_eds_only() {
    let s = Server::start().await;
    let (_h2, mut p) = s.web_0().await;

    let cds = p.next().await.expect("cds");
    assert_eq!(cds.type_url, CLUSTER);
    assert_eq!(cds.resources.len(), 1, "its declared Service only");
    p.send(request(CLUSTER, &[], Some(&cds)));
    p.send(request(LISTENER, &[], None));
    let lds = p.next().await.expect("lds");
    assert_eq!(lds.resources.len(), 1);
    p.send(request(LISTENER, &[], Some(&lds)));
    // A name outside its scope is not returned, and counted.
    p.send(request(
        ENDPOINTS,
        &[CART, "outbound|80||secret.other.svc.cluster.local"],
        None,
    ));
    let eds = p.next().await.expect("eds");
    assert_eq!(eds.resources.len(), 1);
    assert_eq!(endpoints(&eds).len(), 1);
    assert_eq!(s.metrics.out_of_scope_total(ENDPOINTS), 1);
    // The ACK narrows the names to its own: answered, with the same version.
    p.send(request(ENDPOINTS, &[CART], Some(&eds)));
    let narrowed = p.next().await.expect("eds");
    assert_eq!(narrowed.version_info, eds.version_info);
    p.send(request(ENDPOINTS, &[CART], Some(&narrowed)));

    // The endpoints change: EDS alone is pushed, twice in a row (a CDS or
    // LDS push of the first batch would come before the second EDS).
    let pushes = |t| s.metrics.pushes_total(t);
    let (cds_before, lds_before) = (pushes(CLUSTER), pushes(LISTENER));
    for ips in [&["10.1.0.1", "10.1.0.2"][..], &["10.1.0.3"][..]] {
        s.discovery
            .update(|r| r.apply_slice(("shop".into(), "cart-1".into()), slice(ips)));
        let pushed = p.next().await.expect("push");
        assert_eq!(pushed.type_url, ENDPOINTS, "EDS only");
        assert_eq!(endpoints(&pushed).len(), ips.len());
        p.send(request(ENDPOINTS, &[CART], Some(&pushed)));
    }
    assert_eq!(
        (pushes(CLUSTER), pushes(LISTENER)),
        (cds_before, lds_before)
    );
    s.stop.cancel();
}

/// The ADS codec's buffers start small and grow on demand
/// (`discovery::ads_grpc`), and the server's HTTP/2 window is 64 KiB: a
/// first request larger than both (Envoy's node lists its hundreds of
/// extensions; these are more) is read whole, and so is a push far larger
/// than the buffers (a Service of 2,000 endpoints, more than tonic's usual
/// 32 KiB batch), and the stream goes on with small messages after.
#[tokio::test]
async fn requests_and_pushes_larger_than_the_codec_buffers_arrive_whole() {
    use envoy_types::pb::envoy::config::core::v3::Extension;
    use prost::Message;
    use remora_operator::discovery::ads_grpc::BUFFER_BYTES;
    use remora_operator::discovery::serve::WINDOW;

    let s = Server::start().await;
    let h2 = s.connect().await;
    let mut c = client(&h2);
    let mut first = hello("web-0");
    if let Some(n) = first.node.as_mut() {
        n.extensions = (0..2000)
            .map(|i| Extension {
                name: format!("envoy.filters.network.extension_number_{i}"),
                category: "envoy.filters.network".into(),
                ..Default::default()
            })
            .collect();
    }
    let len = first.encoded_len();
    assert!(len > WINDOW as usize && len > 20 * BUFFER_BYTES, "{len}");
    let mut p = open(&mut c, Some(&token(WEB)), first)
        .await
        .expect("admitted");
    subscribed(&mut p).await;

    let ips: Vec<String> = (0..2000)
        .map(|i| format!("10.2.{}.{}", i / 250, i % 250 + 1))
        .collect();
    let refs: Vec<&str> = ips.iter().map(String::as_str).collect();
    s.discovery
        .update(|r| r.apply_slice(("shop".into(), "cart-1".into()), slice(&refs)));
    let big = p.next().await.expect("push");
    assert!(big.encoded_len() > 32 * 1024, "{}", big.encoded_len());
    let got = endpoints(&big);
    assert_eq!(got.len(), ips.len());
    for ip in [&ips[0], &ips[1999]] {
        assert!(got.iter().any(|e| e.contains(ip.as_str())), "{ip} missing");
    }
    p.send(request(ENDPOINTS, &[CART], Some(&big)));

    // Small again after it: the stream goes on.
    s.discovery
        .update(|r| r.apply_slice(("shop".into(), "cart-1".into()), slice(&["10.1.0.9"])));
    let small = p.next().await.expect("push");
    assert_eq!(endpoints(&small).len(), 1);
    s.stop.cancel();
}

/// A proxy whose agent reconnects names, on its new stream, the versions
/// it holds: what is unchanged is not sent again, and the nonces of the two
/// streams never meet.
#[tokio::test]
async fn a_resumed_stream_gets_only_what_changed() {
    let s = Server::start().await;
    let h2 = s.connect().await;
    let mut c = client(&h2);
    let mut p = open(&mut c, Some(&token(WEB)), hello("web-0"))
        .await
        .expect("admitted");
    let cds = p.next().await.expect("cds");
    p.send(request(CLUSTER, &[], Some(&cds)));
    p.send(request(LISTENER, &[], None));
    let lds = p.next().await.expect("lds");
    p.send(request(LISTENER, &[], Some(&lds)));
    drop(p);

    // The new stream's first requests carry the versions held and no nonce.
    let resume = |t: &str, version: &str| DiscoveryRequest {
        version_info: version.into(),
        ..request(t, &[], None)
    };
    let mut q = open(
        &mut c,
        Some(&token(WEB)),
        DiscoveryRequest {
            node: node("web-0"),
            ..resume(CLUSTER, &cds.version_info)
        },
    )
    .await
    .expect("admitted again");
    q.send(resume(LISTENER, &lds.version_info));
    // Only EDS, never asked on the first stream, is answered: a resent CDS
    // or LDS would come before it on the stream.
    q.send(request(ENDPOINTS, &[CART], None));
    let first = q.next().await.expect("a response");
    assert_eq!(first.type_url, ENDPOINTS, "unchanged CDS or LDS resent");
    assert_ne!(first.nonce, cds.nonce, "a nonce of the earlier stream");
    assert_ne!(first.nonce, lds.nonce, "a nonce of the earlier stream");

    // A version it does not hold is answered.
    let mut r = open(
        &mut c,
        Some(&token(WEB)),
        DiscoveryRequest {
            node: node("web-0"),
            ..resume(CLUSTER, "stale")
        },
    )
    .await
    .expect("admitted again");
    let resent = r.next().await.expect("cds");
    assert_eq!(resent.type_url, CLUSTER);
    assert_eq!(resent.version_info, cds.version_info);
    s.stop.cancel();
}

/// The agent subscribes to its pod's annotations on the same stream: it
/// gets those it reads (not the outbound, nor anything else of the pod), and
/// an edit of the pod (a Job's stop request) is pushed to it.
#[tokio::test]
async fn the_agent_gets_its_pods_annotations_and_their_changes() {
    use remora_contract::annotations::{LIFECYCLE, OUTBOUND, QUIET_PERIOD, STOP};
    use remora_operator::discovery::resources::POD_ANNOTATIONS;
    use remora_proto::remora::v1::PodAnnotations;
    let s = Server::start().await;
    let with = |extra: &[(&str, &str)]| {
        let mut a: std::collections::BTreeMap<String, String> =
            [(LIFECYCLE, r#"{"mode":"Legacy"}"#), (QUIET_PERIOD, "1s")]
                .iter()
                .chain(extra)
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
        a.retain(|k, _| remora_contract::discovery::sent_to_agent(k));
        ProxyInfo {
            ip: Some("127.0.0.1".into()),
            service_account: "web".into(),
            outbound: Some("15001:cart.shop:80".into()),
            agent_annotations: a,
            ..Default::default()
        }
    };
    s.discovery
        .update(|r| r.apply_proxy(pod("web-0"), with(&[(OUTBOUND, "15001:cart.shop:80")])));
    let h2 = s.connect().await;
    let mut c = client(&h2);
    let mut p = open(
        &mut c,
        Some(&token(WEB)),
        DiscoveryRequest {
            node: node("web-0"),
            ..request(POD_ANNOTATIONS, &[], None)
        },
    )
    .await
    .expect("admitted");
    let first = p.next().await.expect("annotations");
    assert_eq!(first.type_url, POD_ANNOTATIONS);
    let read = |r: &DiscoveryResponse| -> std::collections::BTreeMap<String, String> {
        assert_eq!(r.resources.len(), 1, "{r:?}");
        decode::<PodAnnotations>(&r.resources[0])
            .expect("PodAnnotations")
            .annotations
    };
    let a = read(&first);
    assert_eq!(a.get(QUIET_PERIOD).map(String::as_str), Some("1s"));
    assert!(a.contains_key(LIFECYCLE), "{a:?}");
    assert!(
        !a.contains_key(OUTBOUND),
        "only what the agent reads: {a:?}"
    );
    p.send(request(POD_ANNOTATIONS, &[], Some(&first)));

    s.discovery
        .update(|r| r.apply_proxy(pod("web-0"), with(&[(STOP, "AppsCompleted")])));
    let next = p.next().await.expect("the stop pushed");
    assert_eq!(next.type_url, POD_ANNOTATIONS);
    assert_ne!(next.version_info, first.version_info);
    assert_eq!(
        read(&next).get(STOP).map(String::as_str),
        Some("AppsCompleted")
    );
    s.stop.cancel();
}

#[tokio::test]
async fn a_nack_is_counted_and_not_answered_with_the_same_config() {
    let s = Server::start().await;
    let (_h2, mut p) = s.web_0().await;
    let eds = subscribed(&mut p).await;
    s.discovery
        .update(|r| r.apply_slice(("shop".into(), "cart-1".into()), slice(&["10.1.0.9"])));
    let bad = p.next().await.expect("push");
    assert_eq!(bad.type_url, ENDPOINTS);
    // NACK: the previous version, the new nonce, Envoy's error.
    p.send(DiscoveryRequest {
        version_info: eds.version_info.clone(),
        error_detail: Some(RpcStatus {
            code: 3,
            message: "endpoint 10.1.0.9: refused by the test".into(),
            details: vec![],
        }),
        ..request(ENDPOINTS, &[CART], Some(&bad))
    });
    let nacks = wait_until(WAIT, "the NACK counted", || async {
        let n = s.metrics.nacks_total(ENDPOINTS);
        (n > 0).then_some(n)
    })
    .await
    .expect("counted");
    assert_eq!(nacks, 1);
    // A Warning Event on the proxy's pod names Envoy's error.
    let w = tokio::time::timeout(WAIT, s.warnings.lock().await.recv())
        .await
        .expect("a warning in time")
        .expect("a warning");
    assert_eq!(
        (w.namespace.as_str(), w.pod.as_str(), w.reason),
        ("shop", "web-0", "ConfigurationRefused")
    );
    assert!(
        w.note.contains("eds") && w.note.contains("refused by the test"),
        "{w:?}"
    );
    // Nothing is re-sent for it: the next response is the next content.
    s.discovery
        .update(|r| r.apply_slice(("shop".into(), "cart-1".into()), slice(&["10.1.0.1"])));
    let next = p.next().await.expect("push");
    assert_eq!(next.type_url, ENDPOINTS);
    assert_ne!(next.version_info, bad.version_info);
    assert_eq!(
        next.version_info, eds.version_info,
        "the same content as before"
    );
    assert_ne!(next.nonce, bad.nonce);
    s.stop.cancel();
}

#[tokio::test]
async fn a_node_of_another_pod_or_service_account_is_refused() {
    let s = Server::start().await;
    let h2 = s.connect().await;
    let mut c = client(&h2);
    // web's token naming db's pod (another ServiceAccount's), an unknown
    // pod, and another namespace.
    let other_ns = DiscoveryRequest {
        node: Some(Node {
            id: "sidecar~127.0.0.1~web-0.evil~evil.svc.cluster.local".into(),
            ..Default::default()
        }),
        ..request(CLUSTER, &[], None)
    };
    for (first, why) in [
        (hello("db-0"), "ServiceAccount"),
        (hello("web-9"), "no injected pod"),
        (other_ns, "namespace"),
    ] {
        let status = match open(&mut c, Some(&token(WEB)), first).await {
            Ok(mut p) => p.next().await.expect_err("refused"),
            Err(s) => s,
        };
        assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
        assert!(status.message().contains(why), "{status:?}");
    }
    // db's own token for its own pod is served.
    let mut p = open(&mut c, Some(&token(DB)), hello("db-0"))
        .await
        .expect("admitted");
    assert_eq!(p.next().await.expect("cds").type_url, CLUSTER);
    assert_eq!(s.metrics.refused_total("not_its_pod"), 2);
    s.stop.cancel();
}

#[tokio::test]
async fn no_token_no_node_or_a_bad_type_is_refused() {
    let s = Server::start().await;
    let h2 = s.connect().await;
    let mut c = client(&h2);
    let refused = |r: Result<Proxy, tonic::Status>| async {
        match r {
            Ok(mut p) => p.next().await.expect_err("refused"),
            Err(s) => s,
        }
    };
    let st = refused(open(&mut c, None, hello("web-0")).await).await;
    assert_eq!(st.code(), tonic::Code::Unauthenticated, "{st:?}");
    let st = refused(open(&mut c, Some("not-a-jwt"), hello("web-0")).await).await;
    assert_eq!(st.code(), tonic::Code::Unauthenticated, "{st:?}");
    let st = refused(open(&mut c, Some(&token(WEB)), request(CLUSTER, &[], None)).await).await;
    assert_eq!(st.code(), tonic::Code::InvalidArgument, "{st:?}");
    let bad_type = DiscoveryRequest {
        type_url: "type.googleapis.com/envoy.config.route.v3.RouteConfiguration".into(),
        ..hello("web-0")
    };
    let st = refused(open(&mut c, Some(&token(WEB)), bad_type).await).await;
    assert_eq!(st.code(), tonic::Code::InvalidArgument, "{st:?}");
    // Delta streams are admitted by the same rules.
    let (_tx, rx) = mpsc::unbounded_channel::<DeltaDiscoveryRequest>();
    let st = match c
        .delta_aggregated_resources(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
    {
        Ok(r) => r
            .into_inner()
            .next()
            .await
            .expect("an answer")
            .expect_err("refused"),
        Err(st) => st,
    };
    assert_eq!(st.code(), tonic::Code::Unauthenticated, "{st:?}");
    s.stop.cancel();
}

#[tokio::test]
async fn an_oversized_request_ends_the_stream() {
    let s = Server::start().await;
    let h2 = s.connect().await;
    let mut c = client(&h2);
    let mut p = open(&mut c, Some(&token(WEB)), hello("web-0"))
        .await
        .expect("admitted");
    assert_eq!(p.next().await.expect("cds").type_url, CLUSTER);
    let name = "x".repeat(1024);
    let names: Vec<&str> = std::iter::repeat_n(name.as_str(), 1100).collect();
    p.send(request(ENDPOINTS, &names, None));
    let st = p.next().await.expect_err("refused");
    assert!(
        matches!(
            st.code(),
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
        ),
        "{st:?}"
    );
    // The connection still serves another stream.
    let mut q = open(&mut c, Some(&token(WEB)), hello("web-0"))
        .await
        .expect("admitted");
    assert_eq!(q.next().await.expect("cds").type_url, CLUSTER);
    s.stop.cancel();
}

/// A sidecar can dial before the pod watch brings its new pod: its stream
/// is not answered until the pod comes, then it is.
#[tokio::test]
async fn a_stream_for_a_pod_not_yet_seen_waits_for_it() {
    let s = Server::start_waiting(WAIT).await;
    let h2 = s.connect().await;
    let mut c = client(&h2);
    let mut opening = std::pin::pin!(async move {
        let mut p = open(&mut c, Some(&token(WEB)), hello("web-1")).await?;
        p.next().await
    });
    assert!(futures::poll!(opening.as_mut()).is_pending());
    // Another proxy's stream, sent after it on the same connection, is
    // answered: by then the server has taken the first one up, and holds it.
    let mut other = open(&mut client(&h2), Some(&token(DB)), hello("db-0"))
        .await
        .expect("admitted");
    assert_eq!(other.next().await.expect("cds").type_url, CLUSTER);
    assert!(
        futures::poll!(opening.as_mut()).is_pending(),
        "answered before the pod came"
    );
    // That the server looked and found no pod cannot be seen on the wire:
    // the admission such a stream goes through, polled by hand, shows it.
    let ads = AdsService {
        auth: TokenReviewDouble,
        gate: Gate::new(TOKEN_AUDIENCE, GateLimits::default()),
        discovery: Arc::clone(&s.discovery),
        metrics: Metrics::default(),
        events: None,
        shutdown: CancellationToken::new(),
        pod_wait: WAIT,
    };
    let bearer = format!("Bearer {}", token(WEB));
    let caller = ads.caller(Some(bearer.as_str()), None).await.expect("web");
    let first = hello("web-1");
    let mut admission = std::pin::pin!(ads.entitle(&caller, &first));
    assert!(
        futures::poll!(admission.as_mut()).is_pending(),
        "admitted or refused before the pod came"
    );

    // The pod watch brings the pod.
    s.discovery.update(|r| {
        r.apply_proxy(
            pod("web-1"),
            ProxyInfo {
                ip: Some("127.0.0.1".into()),
                service_account: "web".into(),
                outbound: Some("15001:cart.shop:80".into()),
                ..Default::default()
            },
        )
    });
    let admitted = tokio::time::timeout(WAIT, admission)
        .await
        .expect("admitted in time");
    assert_eq!(admitted.expect("admitted"), pod("web-1"));
    let cds = opening.await.expect("answered");
    assert_eq!(cds.type_url, CLUSTER);
    s.stop.cancel();
}

#[tokio::test]
async fn an_open_stream_keeps_its_connection_past_the_idle_time() {
    let idle = Duration::from_millis(200);
    let s = Server::start_with(Duration::ZERO, Limits { idle, ..limits() }).await;
    let h2 = s.connect().await;
    let mut c = client(&h2);
    let mut p = open(&mut c, Some(&token(WEB)), hello("web-0"))
        .await
        .expect("admitted");
    let _eds = subscribed(&mut p).await;
    // The server's own clock: a connection opened once the stream fell
    // silent, with nothing on it, is closed as idle; the stream has said
    // nothing for longer than that.
    let silent = s.connect().await;
    tokio::time::timeout(WAIT, silent.conn)
        .await
        .expect("an idle connection closed within 10 s")
        .expect("connection task")
        .expect("closed cleanly");
    // A stream with nothing to say is not idle: its connection is neither
    // closed nor closing (a GOAWAY would refuse a new stream).
    assert!(!h2.conn.is_finished(), "closed with a stream open");
    let mut q = open(&mut c, Some(&token(WEB)), hello("web-0"))
        .await
        .expect("a new stream on the connection");
    assert_eq!(q.next().await.expect("cds").type_url, CLUSTER);
    drop(q);
    s.discovery
        .update(|r| r.apply_slice(("shop".into(), "cart-1".into()), slice(&["10.1.0.5"])));
    assert_eq!(p.next().await.expect("push").type_url, ENDPOINTS);
    // Once the stream ends, the connection is idle, and closed cleanly.
    drop(p);
    drop(c);
    let closed = tokio::time::timeout(WAIT, h2.conn)
        .await
        .expect("the idle connection is closed within 10 s")
        .expect("connection task");
    assert!(closed.is_ok(), "{closed:?}");
    s.stop.cancel();
}

/// One delta ADS stream, as a proxy holds it.
struct DeltaProxy {
    tx: mpsc::UnboundedSender<DeltaDiscoveryRequest>,
    rx: tonic::Streaming<DeltaDiscoveryResponse>,
}

impl DeltaProxy {
    async fn open(c: &mut Client, first: DeltaDiscoveryRequest) -> Result<Self, tonic::Status> {
        let (tx, rx) = mpsc::unbounded_channel();
        tx.send(first).expect("queued");
        let mut req = tonic::Request::new(tokio_stream::wrappers::UnboundedReceiverStream::new(rx));
        let v = format!("Bearer {}", token(WEB))
            .parse()
            .expect("header value");
        req.metadata_mut().insert("authorization", v);
        let rx = c.delta_aggregated_resources(req).await?.into_inner();
        Ok(Self { tx, rx })
    }

    async fn next(&mut self) -> Result<DeltaDiscoveryResponse, tonic::Status> {
        match tokio::time::timeout(WAIT, self.rx.next()).await {
            Ok(Some(r)) => r,
            Ok(None) => Err(tonic::Status::aborted("the stream ended")),
            Err(_) => panic!("no response within {WAIT:?}"),
        }
    }

    fn send(&self, r: DeltaDiscoveryRequest) {
        self.tx.send(r).expect("sent");
    }

    fn ack(&self, r: &DeltaDiscoveryResponse) {
        self.send(delta(&r.type_url, &[], Some(r)));
    }

    /// Subscribed as Envoy does (CDS and LDS wildcard, EDS by name), every
    /// response ACKed: what it holds, by type then name.
    async fn subscribed(&mut self) -> BTreeMap<String, BTreeMap<String, String>> {
        let mut held = BTreeMap::new();
        for (t, names) in [
            (CLUSTER, &[][..]),
            (LISTENER, &[][..]),
            (ENDPOINTS, &[CART][..]),
        ] {
            if t != CLUSTER {
                self.send(delta(t, names, None));
            }
            let r = self.next().await.expect("a response");
            assert_eq!(r.type_url, t);
            self.ack(&r);
            held.insert(t.to_string(), versions(&r));
        }
        held
    }
}

fn delta(
    t: &str,
    subscribe: &[&str],
    ack: Option<&DeltaDiscoveryResponse>,
) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: t.into(),
        resource_names_subscribe: subscribe.iter().map(|n| n.to_string()).collect(),
        response_nonce: ack.map(|r| r.nonce.clone()).unwrap_or_default(),
        ..Default::default()
    }
}

fn delta_hello(pod: &str) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        node: node(pod),
        ..delta(CLUSTER, &[], None)
    }
}

/// A delta response's resources: name → version.
fn versions(r: &DeltaDiscoveryResponse) -> BTreeMap<String, String> {
    r.resources
        .iter()
        .map(|r| (r.name.clone(), r.version.clone()))
        .collect()
}

/// Services `cart` and `pay`, each with an endpoint; web-0 calls both.
fn two_services(s: &Server) {
    let pay = remora_contract::discovery::ServiceHost {
        name: "pay".into(),
        namespace: "shop".into(),
    };
    s.discovery.update(|r| {
        let mut t = Vec::new();
        t.extend(r.apply_service(
            pay.clone(),
            ServiceInfo {
                ports: vec![ServicePort {
                    port: 80,
                    name: "http".into(),
                    protocol: Protocol::Http,
                }],
                ..Default::default()
            },
        ));
        t.extend(r.apply_slice(
            ("shop".into(), "pay-1".into()),
            SliceInfo {
                service: Some(pay.clone()),
                ..slice(&["10.2.0.1"])
            },
        ));
        t.extend(r.apply_proxy(
            pod("web-0"),
            ProxyInfo {
                ip: Some("127.0.0.1".into()),
                service_account: "web".into(),
                outbound: Some("15001:cart.shop:80,15002:pay.shop:80".into()),
                ..Default::default()
            },
        ));
        t
    });
}

const PAY: &str = "outbound|80||pay.shop.svc.cluster.local";

/// Over delta, a proxy gets its scope once, then only the resource that
/// changed (one load assignment of two), and a removal when a Service goes.
#[tokio::test]
async fn a_delta_proxy_gets_only_the_resources_that_changed() {
    let s = Server::start().await;
    two_services(&s);
    let h2 = s.connect().await;
    let mut c = client(&h2);
    let mut p = DeltaProxy::open(&mut c, delta_hello("web-0"))
        .await
        .expect("admitted");
    let cds = p.next().await.expect("cds");
    assert_eq!(cds.type_url, CLUSTER);
    assert_eq!(
        versions(&cds).keys().collect::<Vec<_>>(),
        [CART, PAY],
        "its declared Services only"
    );
    p.ack(&cds);
    p.send(delta(LISTENER, &[], None));
    let lds = p.next().await.expect("lds");
    assert_eq!(lds.resources.len(), 2);
    p.ack(&lds);
    // EDS by name; a name outside its scope is not returned, and counted.
    p.send(delta(
        ENDPOINTS,
        &[CART, PAY, "outbound|80||secret.other.svc.cluster.local"],
        None,
    ));
    let eds = p.next().await.expect("eds");
    assert_eq!(versions(&eds).keys().collect::<Vec<_>>(), [CART, PAY]);
    assert_eq!(s.metrics.out_of_scope_total(ENDPOINTS), 1);
    p.ack(&eds);

    // cart's endpoints change: cart's load assignment alone, twice; no CDS
    // or LDS (they would come first on the stream).
    for ips in [&["10.1.0.1", "10.1.0.2"][..], &["10.1.0.3"][..]] {
        s.discovery
            .update(|r| r.apply_slice(("shop".into(), "cart-1".into()), slice(ips)));
        let pushed = p.next().await.expect("push");
        assert_eq!(pushed.type_url, ENDPOINTS, "EDS only");
        assert_eq!(versions(&pushed).keys().collect::<Vec<_>>(), [CART]);
        assert!(pushed.removed_resources.is_empty());
        p.ack(&pushed);
    }
    // pay goes from web-0's annotation: its cluster and listener are
    // removed, by name, and nothing else is sent.
    s.discovery.update(|r| {
        r.apply_proxy(
            pod("web-0"),
            ProxyInfo {
                ip: Some("127.0.0.1".into()),
                service_account: "web".into(),
                outbound: Some("15001:cart.shop:80".into()),
                ..Default::default()
            },
        )
    });
    let cds = p.next().await.expect("cds");
    assert_eq!(
        (
            cds.type_url.as_str(),
            cds.resources.len(),
            cds.removed_resources.clone()
        ),
        (CLUSTER, 0, vec![PAY.to_string()])
    );
    p.ack(&cds);
    let next = p.next().await.expect("eds or lds");
    let lds = if next.type_url == ENDPOINTS {
        // Its subscription still names pay, which is out of its scope now.
        assert_eq!(next.removed_resources, [PAY]);
        p.ack(&next);
        p.next().await.expect("lds")
    } else {
        next
    };
    assert_eq!(lds.type_url, LISTENER);
    assert_eq!((lds.resources.len(), lds.removed_resources.len()), (0, 1));
    s.stop.cancel();
}

/// A delta proxy reconnecting with `initial_resource_versions` gets only
/// what changed while it was away, and nothing of what did not.
#[tokio::test]
async fn a_resumed_delta_stream_gets_only_what_changed_meanwhile() {
    let s = Server::start().await;
    two_services(&s);
    let h2 = s.connect().await;
    let mut c = client(&h2);
    let mut p = DeltaProxy::open(&mut c, delta_hello("web-0"))
        .await
        .expect("admitted");
    let held = p.subscribed().await;
    drop(p);
    // Away: pay's endpoints change.
    s.discovery.update(|r| {
        r.apply_slice(
            ("shop".into(), "pay-1".into()),
            SliceInfo {
                service: Some(remora_contract::discovery::ServiceHost {
                    name: "pay".into(),
                    namespace: "shop".into(),
                }),
                ..slice(&["10.2.0.2"])
            },
        )
    });
    let resume = |t: &str, names: &[&str]| DeltaDiscoveryRequest {
        initial_resource_versions: held[t].clone().into_iter().collect(),
        ..delta(t, names, None)
    };
    let mut q = DeltaProxy::open(
        &mut c,
        DeltaDiscoveryRequest {
            node: node("web-0"),
            ..resume(CLUSTER, &[])
        },
    )
    .await
    .expect("admitted again");
    q.send(resume(LISTENER, &[]));
    q.send(resume(ENDPOINTS, &[CART, PAY]));
    let first = q.next().await.expect("a response");
    assert_eq!(
        (
            first.type_url.as_str(),
            versions(&first).keys().collect::<Vec<_>>()
        ),
        (ENDPOINTS, vec![&PAY.to_string()]),
        "pay's load assignment alone: unchanged CDS, LDS or cart resent"
    );
    q.ack(&first);
    // The pod's annotations over delta too: one resource, named after it.
    q.send(delta(
        remora_operator::discovery::resources::POD_ANNOTATIONS,
        &[],
        None,
    ));
    let own = q.next().await.expect("annotations");
    assert_eq!(
        versions(&own).keys().collect::<Vec<_>>(),
        ["shop/web-0"],
        "{own:?}"
    );
    s.stop.cancel();
}

/// A delta NACK takes the state-of-the-world path: counted, a Warning
/// Event naming Envoy's error, and the same content not sent again.
#[tokio::test]
async fn a_delta_nack_is_counted_raised_and_not_answered_with_the_same_config() {
    let s = Server::start().await;
    let h2 = s.connect().await;
    let mut c = client(&h2);
    let mut p = DeltaProxy::open(&mut c, delta_hello("web-0"))
        .await
        .expect("admitted");
    let held = p.subscribed().await;
    s.discovery
        .update(|r| r.apply_slice(("shop".into(), "cart-1".into()), slice(&["10.1.0.9"])));
    let bad = p.next().await.expect("push");
    assert_eq!(bad.type_url, ENDPOINTS);
    p.send(DeltaDiscoveryRequest {
        error_detail: Some(RpcStatus {
            code: 3,
            message: "endpoint 10.1.0.9: refused by the test".into(),
            details: vec![],
        }),
        ..delta(ENDPOINTS, &[], Some(&bad))
    });
    wait_until(WAIT, "the NACK counted", || async {
        (s.metrics.nacks_total(ENDPOINTS) == 1).then_some(())
    })
    .await
    .expect("counted");
    let w = tokio::time::timeout(WAIT, s.warnings.lock().await.recv())
        .await
        .expect("a warning in time")
        .expect("a warning");
    assert_eq!(
        (w.pod.as_str(), w.reason),
        ("web-0", "ConfigurationRefused")
    );
    assert!(w.note.contains("refused by the test"), "{w:?}");
    // The next response is the next content: back to the first endpoints,
    // the version Envoy kept (it held it all along).
    s.discovery
        .update(|r| r.apply_slice(("shop".into(), "cart-1".into()), slice(&["10.1.0.1"])));
    let next = p.next().await.expect("push");
    assert_eq!(next.type_url, ENDPOINTS);
    assert_eq!(versions(&next), held[ENDPOINTS]);
    assert_ne!(next.nonce, bad.nonce);
    s.stop.cancel();
}

/// Pushes wait for a place in the throttle: with one place held by the
/// test, a change reaches no proxy until it is let go, and with two places
/// no more than two streams ever push at once.
#[tokio::test]
async fn pushes_wait_for_a_place_in_the_throttle() {
    use futures::FutureExt;
    let s = Server::start_throttled(Duration::ZERO, limits(), 1).await;
    let (_h2, mut p) = s.web_0().await;
    subscribed(&mut p).await;
    let place = s.discovery.throttle.acquire().await;
    s.discovery
        .update(|r| r.apply_slice(("shop".into(), "cart-1".into()), slice(&["10.1.0.5"])));
    wait_until(WAIT, "the stream waits for a place", || async {
        (s.discovery.throttle.waiting() == 1).then_some(())
    })
    .await
    .expect("waiting");
    // Waiting before it recomputes: nothing can be on its way.
    assert!(
        p.rx.next().now_or_never().is_none(),
        "pushed past the throttle"
    );
    drop(place);
    let pushed = p.next().await.expect("pushed once let go");
    assert_eq!(endpoints(&pushed).len(), 1);
    s.stop.cancel();

    let s = Server::start_throttled(Duration::ZERO, limits(), 2).await;
    s.discovery.update(|r| {
        (0..8)
            .flat_map(|i| {
                r.apply_proxy(
                    pod(&format!("web-{i}")),
                    ProxyInfo {
                        ip: Some("127.0.0.1".into()),
                        service_account: "web".into(),
                        outbound: Some("15001:cart.shop:80".into()),
                        ..Default::default()
                    },
                )
            })
            .collect::<Vec<_>>()
    });
    // Four streams a connection at most (the server's limit).
    let conns = [s.connect().await, s.connect().await];
    let mut proxies = Vec::new();
    for i in 0..8 {
        let mut c = client(&conns[i / 4]);
        let mut p = DeltaProxy::open(&mut c, delta_hello(&format!("web-{i}")))
            .await
            .expect("admitted");
        p.subscribed().await;
        proxies.push(p);
    }
    // Held, so every stream queues behind it and they go two by two.
    let both = (
        s.discovery.throttle.acquire().await,
        s.discovery.throttle.acquire().await,
    );
    s.discovery
        .update(|r| r.apply_slice(("shop".into(), "cart-1".into()), slice(&["10.1.0.6"])));
    wait_until(WAIT, "every stream waits", || async {
        (s.discovery.throttle.waiting() == 8).then_some(())
    })
    .await
    .expect("all waiting");
    drop(both);
    for p in &mut proxies {
        let pushed = p.next().await.expect("pushed");
        assert_eq!(pushed.type_url, ENDPOINTS);
    }
    assert_eq!(s.discovery.throttle.most(), 2, "at most two at once");
    s.stop.cancel();
}

/// GET `path` of Envoy's admin interface; `None` while it does not answer.
async fn admin(port: u16, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: envoy\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).await.ok()?;
    Some(out)
}

/// A backend on `ip:port` named after its address.
async fn backend(ip: &str, port: u16) -> Option<()> {
    let addr = SocketAddr::new(ip.parse().ok()?, port);
    NamedBackend::start(addr, ip).await.ok().map(drop)
}

/// `n` requests on one connection to `127.0.0.1:port` (HTTP/1.1 keep-alive,
/// or h2c), counted by the backend that answered.
async fn calls(port: u16, n: usize, h2c: bool) -> std::collections::BTreeMap<String, usize> {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the sidecar's listener");
    let mut counted = std::collections::BTreeMap::new();
    let req = || {
        http::Request::builder()
            .uri(format!("http://cart.shop:{port}/"))
            .header("host", "cart.shop")
            .body(String::new())
            .expect("request")
    };
    let backend_of = |r: http::Response<hyper::body::Incoming>| {
        assert_eq!(r.status(), 200, "{r:?}");
        r.headers()
            .get(named_backend::HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("?")
            .to_string()
    };
    if h2c {
        let (mut send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .expect("h2c");
        tokio::spawn(conn);
        for _ in 0..n {
            let r = send.send_request(req()).await.expect("answered");
            *counted.entry(backend_of(r)).or_default() += 1;
        }
    } else {
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .expect("http/1.1");
        tokio::spawn(conn);
        for _ in 0..n {
            send.ready().await.expect("the connection is kept");
            let r = send.send_request(req()).await.expect("answered");
            *counted.entry(backend_of(r)).or_default() += 1;
        }
    }
    counted
}

/// The real Envoy, pointed at the server as a sidecar is (TLS, its token in
/// the stream's metadata), takes the listeners, clusters and endpoints,
/// follows endpoint changes, and balances one connection's requests
/// (HTTP/1.1 and h2c) over the Service's endpoints; nothing is NACKed.
#[tokio::test]
async fn the_real_envoy_takes_the_configuration_and_follows_changes() {
    let s = Server::start().await;
    // Each port free when picked: the outbound listeners Envoy binds must
    // not meet the other tests' servers (an adjacent port could).
    let (listen, listen_static, admin_port) = (
        remora_test_support::ports::free_port(),
        remora_test_support::ports::free_port(),
        remora_test_support::ports::free_port(),
    );
    s.discovery.update(|r| {
        r.apply_proxy(
            pod("envoy-0"),
            ProxyInfo {
                ip: Some("127.0.0.1".into()),
                service_account: "web".into(),
                outbound: Some(
                    format!("{listen}:cart.shop:80,{listen_static}:example.org:443").into(),
                ),
                ..Default::default()
            },
        )
    });
    let bootstrap = envoy_bootstrap(&s, "envoy-0", &token(WEB), admin_port);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("envoy.json");
    std::fs::write(&path, bootstrap.to_string()).expect("bootstrap written");
    let mut envoy =
        tokio::process::Command::new(remora_test_support::bins::envoy_bin().expect("Envoy binary"))
            .args(["--disable-hot-restart", "--log-level", "error", "-c"])
            .arg(&path)
            .kill_on_drop(true)
            .spawn()
            .expect("Envoy starts");

    let has = |path: &'static str, want: String| async move {
        wait_until(
            Duration::from_secs(30),
            &format!("{path} shows {want}"),
            || {
                let want = want.clone();
                async move {
                    admin(admin_port, path)
                        .await
                        .filter(|b| b.contains(&want))
                        .map(|_| ())
                }
            },
        )
        .await
        .expect("Envoy took it");
    };
    has(
        "/listeners",
        format!("outbound_{listen}::127.0.0.1:{listen}"),
    )
    .await;
    has("/clusters", format!("{CART}::10.1.0.1:8080::")).await;
    has(
        "/clusters",
        format!("outbound|{listen_static}|example.org|443::"),
    )
    .await;
    s.discovery
        .update(|r| r.apply_slice(("shop".into(), "cart-1".into()), slice(&["10.1.0.2"])));
    has("/clusters", format!("{CART}::10.1.0.2:8080::")).await;

    // Two backends behind the Service: one connection's requests reach
    // both, over HTTP/1.1 keep-alive and over h2c (balanced per request).
    let port = remora_test_support::ports::free_port();
    let (a, b) = ("127.0.0.2", "127.0.0.3");
    backend(a, port).await.expect("backend a");
    backend(b, port).await.expect("backend b");
    s.discovery.update(|r| {
        r.apply_slice(
            ("shop".into(), "cart-1".into()),
            SliceInfo {
                ports: [("http".to_string(), port)].into(),
                ..slice(&[a, b])
            },
        )
    });
    has("/clusters", format!("{CART}::{b}:{port}::")).await;
    for h2c in [false, true] {
        let counted = calls(listen, 20, h2c).await;
        assert_eq!(
            counted.keys().collect::<Vec<_>>(),
            [a, b],
            "h2c {h2c}: {counted:?}"
        );
        println!("discovery: 20 calls on one connection (h2c {h2c}) reached {counted:?}");
    }
    for t in [LISTENER, CLUSTER, ENDPOINTS] {
        assert_eq!(s.metrics.nacks_total(t), 0, "{t} NACKed");
    }
    let stats = admin(admin_port, "/stats?filter=update_rejected")
        .await
        .expect("stats");
    assert!(
        stats
            .lines()
            .filter(|l| l.contains("update_rejected"))
            .all(|l| l.ends_with(": 0")),
        "{stats}"
    );
    envoy.kill().await.expect("Envoy stopped");
    s.stop.cancel();
}

/// Envoy's bootstrap for a sidecar of pod `pod` (namespace shop) whose ADS
/// goes to `s` as the agent's does (TLS, `token` in the stream's metadata).
fn envoy_bootstrap(s: &Server, pod: &str, token: &str, admin_port: u16) -> serde_json::Value {
    serde_json::json!({
        "node": {
            "id": format!("sidecar~127.0.0.1~{pod}.shop~shop.svc.cluster.local"),
            "cluster": format!("{pod}.shop")
        },
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "dynamic_resources": {
            "ads_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "grpc_services": [{
                    "envoy_grpc": {"cluster_name": "xds"},
                    "initial_metadata": [{"key": "authorization", "value": format!("Bearer {token}")}]
                }]
            },
            "cds_config": {"ads": {}, "resource_api_version": "V3"},
            "lds_config": {"ads": {}, "resource_api_version": "V3"}
        },
        "static_resources": {"clusters": [{
            "name": "xds",
            "type": "STATIC",
            "connect_timeout": "1s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}}
                }
            },
            "load_assignment": {"cluster_name": "xds", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "socket_address": {"address": "127.0.0.1", "port_value": s.addr.port()}
            }}}]}]},
            "transport_socket": {
                "name": "envoy.transport_sockets.tls",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                    "sni": SERVER_NAME,
                    "common_tls_context": {
                        "alpn_protocols": ["h2"],
                        "validation_context": {"trusted_ca": {"inline_string": s.bundle}}
                    }
                }
            }
        }]}
    })
}

/// ExternalWorkload `name` of namespace shop at `ip`, serving port `http`
/// on `port`, labelled app=api, with `weight`.
fn api_workload(
    name: &str,
    ip: &str,
    port: u16,
    weight: Option<i64>,
) -> remora_crds::external::ExternalWorkload {
    use remora_crds::external::{ExternalWorkload, ExternalWorkloadSpec, WorkloadEndpoint};
    ExternalWorkload {
        metadata: kube::api::ObjectMeta {
            namespace: Some("shop".into()),
            name: Some(name.into()),
            ..Default::default()
        },
        spec: ExternalWorkloadSpec {
            endpoint: WorkloadEndpoint {
                address: ip.into(),
                ports: [("http".to_string(), i32::from(port))].into(),
                service_account: None,
                weight,
            },
            labels: [("app".to_string(), "api".to_string())].into(),
        },
    }
}

/// A service outside the cluster, reached by its own host name: the real
/// Envoy gets an EDS cluster for `api.example.com` whose endpoints are the
/// ExternalWorkloads its ExternalService selects (two backends on
/// loopback), and balances one connection's requests over both. Then a
/// configuration the CRD accepts but Envoy refuses (a connect timeout of
/// 0s): Envoy NACKs it, the NACK is counted and raised as a Warning naming
/// Envoy's error, and the proxy keeps serving its previous configuration.
#[tokio::test]
async fn the_real_envoy_reaches_an_external_host_and_keeps_serving_through_a_nack() {
    use remora_crds::external::{
        ExternalHost, ExternalPort, ExternalProtocol, ExternalService, ExternalServiceSpec,
    };
    use remora_operator::discovery::external::{ExternalInfo, WorkloadInfo};
    let s = Server::start().await;
    let (listen, admin_port, port) = (
        remora_test_support::ports::free_port(),
        remora_test_support::ports::free_port(),
        remora_test_support::ports::free_port(),
    );
    let (a, b) = ("127.0.0.2", "127.0.0.3");
    backend(a, port).await.expect("backend a");
    backend(b, port).await.expect("backend b");
    let es = ExternalService {
        metadata: kube::api::ObjectMeta {
            namespace: Some("shop".into()),
            name: Some("api".into()),
            ..Default::default()
        },
        spec: ExternalServiceSpec {
            hosts: vec![ExternalHost("api.example.com".into())],
            ports: vec![ExternalPort {
                number: 80,
                name: "http".into(),
                protocol: ExternalProtocol::Http,
                target_port: None,
            }],
            endpoints: None,
            workload_selector: Some(remora_crds::WorkloadSelector {
                match_labels: [("app".to_string(), "api".to_string())].into(),
            }),
            connect_timeout: None,
        },
        status: None,
    };
    let workload = |w| WorkloadInfo::read(&w).expect("a workload");
    s.discovery.update(|r| {
        let (k, i) = ExternalInfo::read(&es).expect("an external service");
        let mut t = r.apply_external_service(k, i);
        for w in [
            api_workload("api-a", a, port, None),
            api_workload("api-b", b, port, None),
        ] {
            let (k, i) = workload(w);
            t.extend(r.apply_external_workload(k, i));
        }
        t.extend(r.apply_proxy(
            pod("envoy-x"),
            ProxyInfo {
                ip: Some("127.0.0.1".into()),
                service_account: "web".into(),
                outbound: Some(format!("{listen}:api.example.com:80").into()),
                ..Default::default()
            },
        ));
        t
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("envoy.json");
    let bootstrap = envoy_bootstrap(&s, "envoy-x", &token(WEB), admin_port);
    std::fs::write(&path, bootstrap.to_string()).expect("bootstrap written");
    let mut envoy =
        tokio::process::Command::new(remora_test_support::bins::envoy_bin().expect("Envoy binary"))
            .args(["--disable-hot-restart", "--log-level", "error", "-c"])
            .arg(&path)
            .kill_on_drop(true)
            .spawn()
            .expect("Envoy starts");
    const API: &str = "outbound|80||api.example.com";
    wait_until(
        Duration::from_secs(30),
        "Envoy has both endpoints of api.example.com",
        || async {
            admin(admin_port, "/clusters")
                .await
                .filter(|c| {
                    c.contains(&format!("{API}::{a}:{port}::"))
                        && c.contains(&format!("{API}::{b}:{port}::"))
                })
                .map(|_| ())
        },
    )
    .await
    .expect("Envoy took it");
    let want = format!("outbound_{listen}::127.0.0.1:{listen}");
    wait_until(
        Duration::from_secs(30),
        "Envoy has the outbound listener",
        || async {
            admin(admin_port, "/listeners")
                .await
                .filter(|l| l.contains(&want))
                .map(|_| ())
        },
    )
    .await
    .expect("Envoy took the listener");
    let both = |counted: &std::collections::BTreeMap<String, usize>| {
        counted.keys().map(String::as_str).collect::<Vec<_>>() == [a, b]
    };
    let counted = calls(listen, 20, false).await;
    assert!(both(&counted), "{counted:?}");
    for t in [LISTENER, CLUSTER, ENDPOINTS] {
        assert_eq!(s.metrics.nacks_total(t), 0, "{t} NACKed");
    }

    // A connect timeout of 0s: the schema's duration grammar takes it,
    // Envoy takes only more than 0s.
    let mut zero = es.clone();
    zero.spec.connect_timeout = Some(remora_crds::DurationString::new("0s"));
    s.discovery.update(|r| {
        let (k, i) = ExternalInfo::read(&zero).expect("an external service");
        r.apply_external_service(k, i)
    });
    wait_until(WAIT, "the NACK counted", || async {
        (s.metrics.nacks_total(CLUSTER) > 0).then_some(())
    })
    .await
    .expect("Envoy refused the cluster");
    let w = tokio::time::timeout(WAIT, s.warnings.lock().await.recv())
        .await
        .expect("a warning in time")
        .expect("a warning");
    assert_eq!(
        (w.namespace.as_str(), w.pod.as_str(), w.reason),
        ("shop", "envoy-x", "ConfigurationRefused")
    );
    println!("external: Envoy's refusal as the pod's Warning: {}", w.note);
    assert!(
        w.note.contains("cds") && w.note.contains("ConnectTimeout"),
        "Envoy's error: {w:?}"
    );
    // The previous configuration still serves, both endpoints included.
    let stats = admin(admin_port, "/stats?filter=cds.update_rejected")
        .await
        .expect("stats");
    assert!(stats.contains("cds.update_rejected: 1"), "{stats}");
    let counted = calls(listen, 20, false).await;
    assert!(both(&counted), "after the NACK: {counted:?}");
    envoy.kill().await.expect("Envoy stopped");
    s.stop.cancel();
}

/// Issue 30: a pod marked deleting leaves the EDS of every proxy that
/// routes to it at once, and its own agent is told, over its stream, when
/// every one of them has confirmed (ACKed a version without it), a NACK
/// not counting and a proxy that leaves counting as gone.
#[tokio::test]
async fn a_deleting_pod_is_withdrawn_at_once_and_its_agent_told_who_confirmed() {
    // A debounce no test outlives: whatever arrives was pushed without it.
    let s = Server::start_debounced(Debounce {
        quiet: Duration::from_secs(3600),
        max_delay: Duration::from_secs(3600),
    })
    .await;
    let ip = |a: &str| a.parse::<IpAddr>().expect("ip");
    let (gone_ip, stays) = ("10.1.0.1", "10.1.0.2");
    s.discovery.update(|r| {
        let mut t = r.apply_slice(
            ("shop".into(), "cart-1".into()),
            SliceInfo {
                pods: [(ip(gone_ip), "cart-0".into()), (ip(stays), "cart-1".into())].into(),
                ..slice(&[gone_ip, stays])
            },
        );
        for name in ["web-1", "web-2", "web-3", "web-4"] {
            t.extend(r.apply_proxy(
                pod(name),
                ProxyInfo {
                    ip: Some("127.0.0.1".into()),
                    service_account: "web".into(),
                    outbound: Some("15001:cart.shop:80".into()),
                    ..Default::default()
                },
            ));
        }
        t
    });
    // cart-0 runs a sidecar too (as ServiceAccount db, whose token the
    // double knows).
    let cart_0 = ProxyInfo {
        ip: Some("127.0.0.1".into()),
        service_account: "db".into(),
        ..Default::default()
    };
    s.discovery.apply_proxy(pod("cart-0"), cart_0.clone());

    // A connection each, as sidecars hold them.
    let mut connections = Vec::new();
    let mut connect = async || {
        let h2 = s.connect().await;
        let c = client(&h2);
        connections.push(h2);
        c
    };
    // Four state-of-the-world proxies and one delta, each holding both.
    let mut sotw = Vec::new();
    for name in ["web-0", "web-1", "web-2", "web-3"] {
        let mut p = open(&mut connect().await, Some(&token(WEB)), hello(name))
            .await
            .expect("admitted");
        let eds = subscribed(&mut p).await;
        assert_eq!(endpoints(&eds).len(), 2, "{name}");
        sotw.push(p);
    }
    let mut delta_proxy = DeltaProxy::open(&mut connect().await, delta_hello("web-4"))
        .await
        .expect("admitted");
    let held = delta_proxy.subscribed().await;
    assert_eq!(held[ENDPOINTS].len(), 1);
    // cart-0's agent subscribes to its withdrawal: none yet.
    let mut own = open(
        &mut connect().await,
        Some(&token(DB)),
        DiscoveryRequest {
            node: node("cart-0"),
            ..request(WITHDRAWAL, &[], None)
        },
    )
    .await
    .expect("admitted");
    let none = own.next().await.expect("withdrawal");
    assert_eq!(
        (none.type_url.as_str(), none.resources.len()),
        (WITHDRAWAL, 0)
    );
    own.send(request(WITHDRAWAL, &[], Some(&none)));

    // cart-0 is deleted: its slice still says it serves.
    s.discovery.apply_proxy(
        pod("cart-0"),
        ProxyInfo {
            withdrawn: true,
            deleting: true,
            ..cart_0
        },
    );
    let mut web_3 = sotw.pop().expect("web-3");
    for p in &mut sotw {
        let pushed = p.next().await.expect("push");
        assert_eq!(pushed.type_url, ENDPOINTS, "EDS only, first");
        let eps = endpoints(&pushed);
        assert_eq!(eps.len(), 1);
        assert!(eps[0].contains(stays), "{eps:?}");
        p.send(request(ENDPOINTS, &[CART], Some(&pushed)));
    }
    let pushed = delta_proxy.next().await.expect("push");
    assert_eq!(pushed.type_url, ENDPOINTS);
    assert_eq!(pushed.resources.len(), 1, "the load assignment, changed");
    delta_proxy.ack(&pushed);
    // web-3 refuses it: not a confirmation.
    let refused = web_3.next().await.expect("push");
    assert_eq!(refused.type_url, ENDPOINTS);
    web_3.send(DiscoveryRequest {
        error_detail: Some(RpcStatus {
            code: 3,
            message: "refused".into(),
            details: vec![],
        }),
        ..request(ENDPOINTS, &[CART], Some(&refused))
    });
    let tracker = &s.discovery.withdrawals;
    let four = tokio::time::timeout(
        WAIT,
        tracker.wait_for(&pod("cart-0"), |p| p.is_some_and(|p| p.confirmed == 4)),
    )
    .await
    .expect("four confirmed within 10 s")
    .expect("withdrawn");
    assert_eq!(four.expected, 5);
    wait_until(WAIT, "the NACK counted", || async {
        (s.metrics.nacks_total(ENDPOINTS) == 1).then_some(())
    })
    .await
    .expect("counted");
    let p = tracker.progress(&pod("cart-0")).expect("withdrawn");
    assert_eq!(
        (p.confirmed, p.pending.as_slice(), p.done),
        (4, &["shop/web-3".to_string()][..], false)
    );

    // web-3 leaves without confirming: no longer waited for.
    drop(web_3);
    let done = loop {
        let r = own.next().await.expect("withdrawal");
        assert_eq!(r.type_url, WITHDRAWAL);
        own.send(request(WITHDRAWAL, &[], Some(&r)));
        assert_eq!(r.resources.len(), 1, "its own pod's only");
        let w: remora_proto::remora::v1::Withdrawal = decode(&r.resources[0]).expect("withdrawal");
        if w.done {
            break w;
        }
    };
    assert_eq!(
        (done.expected, done.confirmed, done.gone, done.pending.len()),
        (5, 4, 1, 0)
    );
    let event = loop {
        let w = tokio::time::timeout(WAIT, async { s.warnings.lock().await.recv().await })
            .await
            .expect("an Event within 10 s")
            .expect("event");
        if w.reason == "EndpointsWithdrawn" {
            break w;
        }
    };
    assert_eq!(event.pod, "cart-0");
    assert!(
        event.note.starts_with("4 of 5 proxies confirmed in ")
            && event.note.contains("1 disconnected"),
        "{}",
        event.note
    );
    assert_eq!(tracker.metrics.unconfirmed_total("gone"), 1);
    assert_eq!(tracker.metrics.confirmations_observed(), 1);
    // Ready again (not deleting): it returns, and its withdrawal is gone.
    s.discovery.apply_proxy(
        pod("cart-0"),
        ProxyInfo {
            ip: Some("127.0.0.1".into()),
            service_account: "db".into(),
            ..Default::default()
        },
    );
    let back = sotw[0].next().await.expect("push");
    assert_eq!(endpoints(&back).len(), 2);
    assert!(tracker.progress(&pod("cart-0")).is_none());
    s.stop.cancel();
}

/// `k` callee pods `cart-0`.. of Service cart, each with a sidecar and an
/// address of its own, beside an endpoint that stays (no pod): every
/// proxy that declared cart holds them all.
fn callees(s: &Server, k: usize) -> Vec<(PodKey, ProxyInfo)> {
    let ip = |i: usize| format!("10.1.1.{}", i + 1);
    let mut ready: Vec<String> = (0..k).map(ip).collect();
    ready.push("10.1.0.9".into());
    let pods: Vec<(PodKey, ProxyInfo)> = (0..k)
        .map(|i| {
            let info = ProxyInfo {
                ip: Some(ip(i)),
                service_account: "db".into(),
                ..Default::default()
            };
            (pod(&format!("cart-{i}")), info)
        })
        .collect();
    s.discovery.update(|r| {
        let mut t = r.apply_slice(
            ("shop".into(), "cart-1".into()),
            SliceInfo {
                pods: (0..k)
                    .map(|i| (ip(i).parse().expect("ip"), format!("cart-{i}")))
                    .collect(),
                ..slice(&ready.iter().map(String::as_str).collect::<Vec<_>>())
            },
        );
        for (key, info) in &pods {
            t.extend(r.apply_proxy(key.clone(), info.clone()));
        }
        t
    });
    pods
}

/// Deleting, as the pod watch applies it: withdrawn at once.
fn delete(s: &Server, (key, info): &(PodKey, ProxyInfo)) {
    s.discovery.apply_proxy(
        key.clone(),
        ProxyInfo {
            withdrawn: true,
            deleting: true,
            ..info.clone()
        },
    );
}

/// Issue 30 at many subscribers: a lone withdrawal is pushed at once, and
/// withdrawals reaching a proxy that has not answered that push yet are
/// merged into one push, sent when it answers, whose ACK confirms every pod
/// it removed: two EDS pushes for twenty withdrawals. Another proxy that
/// answers every push at once gets each withdrawal as it comes, and is
/// waited for after each, so the held proxy's stream saw each on its own.
#[tokio::test]
async fn withdrawals_to_a_proxy_yet_to_answer_go_out_as_one_push() {
    const K: usize = 20;
    // A debounce no test outlives: whatever arrives went out without it,
    // and a held push is let go by the proxy's answer, never by the bound.
    let s = Server::start_debounced(Debounce {
        quiet: Duration::from_secs(3600),
        max_delay: Duration::from_secs(3600),
    })
    .await;
    let pods = callees(&s, K);
    let (_h2, mut held) = s.web_0().await;
    let eds = subscribed(&mut held).await;
    assert_eq!(endpoints(&eds).len(), K + 1);
    let h2 = s.connect().await;
    let mut prompt = open(&mut client(&h2), Some(&token(DB)), hello("db-0"))
        .await
        .expect("admitted");
    subscribed(&mut prompt).await;

    delete(&s, &pods[0]);
    let first = held.next().await.expect("push");
    assert_eq!(first.type_url, ENDPOINTS);
    assert_eq!(endpoints(&first).len(), K, "cart-0 alone withdrawn");
    for (k, callee) in pods.iter().enumerate() {
        if k > 0 {
            delete(&s, callee);
        }
        let pushed = prompt.next().await.expect("push");
        assert_eq!(endpoints(&pushed).len(), K - k, "one more withdrawn");
        prompt.send(request(ENDPOINTS, &[CART], Some(&pushed)));
    }
    held.send(request(ENDPOINTS, &[CART], Some(&first)));
    let merged = held.next().await.expect("push");
    assert_eq!(merged.type_url, ENDPOINTS);
    let left = endpoints(&merged);
    assert!(left.len() == 1 && left[0].contains("10.1.0.9"), "{left:?}");
    held.send(request(ENDPOINTS, &[CART], Some(&merged)));

    let tracker = &s.discovery.withdrawals;
    for (key, _) in &pods {
        let done = tokio::time::timeout(WAIT, tracker.wait_for(key, |p| p.is_some_and(|p| p.done)))
            .await
            .expect("confirmed within 10 s")
            .expect("withdrawn");
        assert_eq!(
            (done.expected, done.confirmed, done.timed_out),
            (2, 2, false),
            "{key:?}"
        );
    }
    // cart-0 Ready again: pushed at once, and the very next response, so
    // no other EDS push went out in between.
    s.discovery
        .apply_proxy(pods[0].0.clone(), pods[0].1.clone());
    let back = held.next().await.expect("push");
    assert_eq!(
        (back.type_url.as_str(), endpoints(&back).len()),
        (ENDPOINTS, 2)
    );
    s.stop.cancel();
}

/// A proxy that does not answer still gets a held push at the debounce's
/// max delay (50 ms here), and an ACK of the older response then confirms
/// only the pod that one removed, not the one only the newer removed.
#[tokio::test]
async fn a_held_push_goes_at_the_bound_and_an_older_ack_confirms_only_its_own() {
    let s = Server::start().await;
    let pods = callees(&s, 2);
    let h2 = s.connect().await;
    let mut p = DeltaProxy::open(&mut client(&h2), delta_hello("web-0"))
        .await
        .expect("admitted");
    p.subscribed().await;

    delete(&s, &pods[0]);
    let first = p.next().await.expect("push");
    assert_eq!(first.type_url, ENDPOINTS);
    let cla = |r: &DeltaDiscoveryResponse| -> Vec<String> {
        let cla: ClusterLoadAssignment =
            decode(r.resources[0].resource.as_ref().expect("cla")).expect("cla");
        cla.endpoints
            .iter()
            .flat_map(|l| &l.lb_endpoints)
            .map(|e| format!("{e:?}"))
            .collect()
    };
    assert_eq!(cla(&first).len(), 2, "cart-0 alone withdrawn");
    // Not answered: cart-1's withdrawal is held, then sent at the bound.
    delete(&s, &pods[1]);
    let second = p.next().await.expect("push at the bound");
    assert_eq!(cla(&second).len(), 1, "both withdrawn");

    let tracker = &s.discovery.withdrawals;
    p.ack(&first);
    let cart_0 = tokio::time::timeout(
        WAIT,
        tracker.wait_for(&pods[0].0, |p| p.is_some_and(|p| p.done)),
    )
    .await
    .expect("cart-0 confirmed within 10 s")
    .expect("withdrawn");
    assert_eq!(cart_0.confirmed, 1);
    // The same ACK, handled whole: cart-1 is still pending.
    let cart_1 = tracker.progress(&pods[1].0).expect("withdrawn");
    assert_eq!(
        (cart_1.confirmed, cart_1.done, cart_1.pending.as_slice()),
        (0, false, &["shop/web-0".to_string()][..])
    );
    p.ack(&second);
    let cart_1 = tokio::time::timeout(
        WAIT,
        tracker.wait_for(&pods[1].0, |p| p.is_some_and(|p| p.done)),
    )
    .await
    .expect("cart-1 confirmed within 10 s")
    .expect("withdrawn");
    assert_eq!(cart_1.confirmed, 1);
    s.stop.cancel();
}
