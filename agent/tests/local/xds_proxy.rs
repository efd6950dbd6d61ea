//! The agent's ADS proxy against the real Envoy and an xDS server double
//! over TLS: Envoy's listener and cluster arrive through the proxy and carry
//! traffic, the pod's token and certificate reach the server, the listener
//! keeps serving while the server is away, the proxy resumes without a
//! resync when it is back, and readiness waits for the first ACKs.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::support_sds::{Ca, DEADLINE, Envoy, metric, wait_until};
use anyhow::Result;
use prometheus_client::registry::Registry;
use remora_agent::certs::CertBundle;
use remora_agent::pod_annotations::StreamCopy;
use remora_agent::readiness::Readiness;
use remora_agent::xds::{self, UpstreamConfig, XdsHandle};
use remora_contract::discovery::NodeId;
use remora_test_support::pki::WORKLOAD_ID;
use remora_test_support::xds_double::{
    CLUSTER_TYPE, LISTENER_TYPE, XdsDouble, static_cluster, tcp_listener,
};
use serde_json::json;
use tempfile::TempDir;
use tokio::io::AsyncReadExt;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const SERVER_NAME: &str = "discovery.remora.test";

struct Rig {
    tmp: TempDir,
    token: PathBuf,
    node_id: String,
    readiness: Readiness,
    registry: Registry,
    cancel: CancellationToken,
    handle: Option<XdsHandle>,
    envoy: Envoy,
    double: Option<XdsDouble>,
    _bundles: watch::Sender<Option<Arc<CertBundle>>>,
    /// The pod's annotations as the proxy hands them to the agent.
    pod_annotations: watch::Receiver<StreamCopy>,
    /// The pod's withdrawal and the stream's state, likewise.
    withdrawal: watch::Receiver<remora_agent::withdrawal::Upstream>,
}

impl Rig {
    async fn start() -> Result<Self> {
        let tmp = tempfile::tempdir()?;
        let root = Ca::new("mesh-root");
        let serving = root.issue().names(&[SERVER_NAME]).server_auth().sign();
        let double = XdsDouble::start(&serving.chain, &serving.key, &root.pem).await?;
        let roots = tmp.path().join("root-cert.pem");
        std::fs::write(&roots, &root.pem)?;
        let token = tmp.path().join("token");
        std::fs::write(&token, "tok-1\n")?;
        // The pod's workload certificate, as the SDS source would hold it.
        let leaf = root.issue().uri(WORKLOAD_ID).client_auth().sign();
        let now = SystemTime::now();
        let (bundles, bundles_rx) = watch::channel(Some(Arc::new(CertBundle {
            chain_pem: leaf.chain.clone(),
            key_pem: leaf.key.clone(),
            roots_pem: root.pem.clone(),
            not_before: now - Duration::from_secs(60),
            not_after: now + Duration::from_secs(3600),
            serial: leaf.serial.clone(),
        })));
        let upstream = UpstreamConfig {
            address: double.addr.to_string(),
            server_name: Some(SERVER_NAME.into()),
            roots_file: Some(roots),
            bundles: Some(bundles_rx),
            token_path: token.clone(),
            min_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(500),
        };
        let socket = tmp.path().join("run").join("xds.sock");
        let readiness = Readiness::new();
        let mut registry = Registry::default();
        let cancel = CancellationToken::new();
        let (annotations_tx, pod_annotations) = watch::channel(None);
        let (withdrawal_tx, withdrawal) = watch::channel(Default::default());
        let handle = xds::start_with(
            socket.clone(),
            upstream,
            xds::ToAgent {
                pod_annotations: annotations_tx,
                withdrawal: withdrawal_tx,
            },
            &mut registry,
            cancel.clone(),
        )
        .await?;
        handle.hold_readiness(&readiness);
        let node_id = NodeId {
            ip: "127.0.0.1".into(),
            pod: "web-1".into(),
            namespace: "shop".into(),
            domain: "cluster.local".into(),
        }
        .to_string();
        let bootstrap = json!({
            "node": {"id": node_id, "cluster": "web.shop"},
            "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
            "static_resources": {"clusters": [xds::bootstrap::ads_cluster(&socket)]},
            "dynamic_resources": xds::bootstrap::dynamic_resources(false),
        });
        let envoy = Envoy::start(tmp.path(), &bootstrap, 0).await?;
        Ok(Self {
            tmp,
            token,
            node_id,
            readiness,
            registry,
            cancel,
            handle: Some(handle),
            envoy,
            double: Some(double),
            _bundles: bundles,
            pod_annotations,
            withdrawal,
        })
    }

    fn double(&self) -> &XdsDouble {
        self.double.as_ref().unwrap()
    }

    /// Serve version `version`: a listener on `port` to the cluster
    /// `backend`, whose one endpoint is 127.0.0.1:`backend`.
    fn serve(&self, version: &str, port: u16, backend: u16) {
        let d = self.double();
        d.set(
            CLUSTER_TYPE,
            version,
            vec![static_cluster("backend", backend)],
        );
        d.set(
            LISTENER_TYPE,
            version,
            vec![tcp_listener("out", port, "backend")],
        );
    }

    /// Requests Envoy sent (through the proxy) of `type_url`.
    fn requests_of(&self, type_url: &str) -> usize {
        self.double()
            .requests()
            .iter()
            .filter(|r| r.request.type_url == type_url)
            .count()
    }

    async fn stop(mut self) -> Result<()> {
        self.cancel.cancel();
        if let Some(h) = self.handle.take() {
            let socket = h.socket.clone();
            tokio::time::timeout(Duration::from_secs(10), h.join()).await??;
            assert!(!socket.exists(), "socket removed on shutdown");
        }
        let _ = self.envoy.child.kill().await;
        if let Some(d) = self.double.take() {
            d.stop().await;
        }
        drop(self.tmp);
        Ok(())
    }
}

/// A backend that answers each connection with its name and closes.
async fn named_backend(name: &'static str) -> u16 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                let _ = s.write_all(name.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    port
}

/// What a connection to 127.0.0.1:`port` reads, if it connects.
async fn answer(port: u16) -> Option<String> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out))
        .await
        .ok()?
        .ok()?;
    (!out.is_empty()).then_some(out)
}

async fn wait_answer(port: u16, want: &str) -> Result<()> {
    wait_until(
        DEADLINE,
        &format!("the listener on {port} to answer {want}"),
        || async move { (answer(port).await.as_deref() == Some(want)).then_some(()) },
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn listener_arrives_through_the_proxy_with_the_pods_identity_and_readiness_waits_for_it()
-> Result<()> {
    let rig = Rig::start().await?;
    // Envoy asks for clusters first; nothing is served yet, so nothing is ACKed.
    wait_until(DEADLINE, "Envoy's CDS request at the double", || async {
        (rig.requests_of(CLUSTER_TYPE) > 0).then_some(())
    })
    .await?;
    assert!(!rig.readiness.is_ready(), "ready before any ACK");
    assert_eq!(
        rig.readiness.pending().first().map(|(n, _)| n.as_str()),
        Some(xds::READINESS_GUARD)
    );

    let a = named_backend("A").await;
    let port = remora_test_support::ports::free_port();
    rig.serve("v1", port, a);
    wait_answer(port, "A").await?;
    wait_until(
        DEADLINE,
        "readiness after the first LDS and CDS ACKs",
        || async { rig.readiness.is_ready().then_some(()) },
    )
    .await?;
    let acks = rig.handle.as_ref().unwrap().first_acks();
    assert!(acks.listeners && acks.clusters, "{acks:?}");

    let requests = rig.double().requests();
    // The node reaches the server on the stream's first request.
    let first = &requests[0].request;
    assert_eq!(
        first.node.as_ref().map(|n| n.id.as_str()),
        Some(rig.node_id.as_str())
    );
    for r in &requests {
        assert_eq!(r.authorization.as_deref(), Some("Bearer tok-1"));
        assert!(
            r.client_cert,
            "the workload certificate is the client certificate"
        );
    }
    assert_eq!(metric(&rig.registry, "xds_nacks_total"), 0.0);
    assert_eq!(metric(&rig.registry, "xds_streams"), 1.0);

    // The socket is private to the proxy's user.
    use std::os::unix::fs::PermissionsExt;
    let sock = rig.tmp.path().join("run").join("xds.sock");
    assert_eq!(
        std::fs::metadata(&sock)?.permissions().mode() & 0o777,
        0o600
    );
    rig.stop().await
}

/// The agent subscribes to its pod's annotations on the stream it holds for
/// Envoy: the server's push reaches the agent (not Envoy, which would not
/// know the type), the proxy ACKs it itself, and while the server is away
/// the agent falls back to the downward-API file.
#[tokio::test]
async fn the_pods_annotations_reach_the_agent_and_not_envoy() -> Result<()> {
    use prost::Message as _;
    use remora_contract::discovery::POD_ANNOTATIONS_TYPE;
    use remora_proto::remora::v1::PodAnnotations;
    let mut rig = Rig::start().await?;
    let a = named_backend("A").await;
    let port = remora_test_support::ports::free_port();
    rig.serve("v1", port, a);
    wait_answer(port, "A").await?;
    // Subscribed once the node went up, with no version yet.
    wait_until(DEADLINE, "the agent's own subscription", || async {
        (rig.requests_of(POD_ANNOTATIONS_TYPE) > 0).then_some(())
    })
    .await?;
    let msg = PodAnnotations {
        annotations: [(
            remora_contract::annotations::STOP.to_string(),
            "AppsCompleted".to_string(),
        )]
        .into(),
    };
    rig.double().set(
        POD_ANNOTATIONS_TYPE,
        "a1",
        vec![envoy_types::pb::google::protobuf::Any {
            type_url: POD_ANNOTATIONS_TYPE.into(),
            value: msg.encode_to_vec(),
        }],
    );
    let got = wait_until(DEADLINE, "the annotations at the agent", || {
        let a = rig.pod_annotations.borrow().clone();
        async move { a }
    })
    .await?;
    assert_eq!(
        got.get(remora_contract::annotations::STOP)
            .map(String::as_str),
        Some("AppsCompleted")
    );
    wait_until(DEADLINE, "the proxy's ACK", || async {
        rig.double()
            .requests()
            .iter()
            .any(|r| {
                r.request.type_url == POD_ANNOTATIONS_TYPE
                    && r.request.version_info == "a1"
                    && !r.request.response_nonce.is_empty()
                    && r.request.error_detail.is_none()
            })
            .then_some(())
    })
    .await?;
    // The ACK is the proxy's (Envoy ignores a type it did not ask for, and
    // would not answer): nothing was refused either.
    assert_eq!(metric(&rig.registry, "xds_nacks_total"), 0.0);

    // The pod's withdrawal (issue 30) the same way, for the drain, with
    // whether the stream is up.
    use remora_contract::discovery::WITHDRAWAL_TYPE;
    assert!(rig.withdrawal.borrow().connected, "the stream is up");
    let w = remora_proto::remora::v1::Withdrawal {
        expected: 2,
        confirmed: 2,
        done: true,
        last_confirmation_ms: 12,
        ..Default::default()
    };
    rig.double().set(
        WITHDRAWAL_TYPE,
        "w1",
        vec![envoy_types::pb::google::protobuf::Any {
            type_url: WITHDRAWAL_TYPE.into(),
            value: w.encode_to_vec(),
        }],
    );
    let got = wait_until(DEADLINE, "the withdrawal at the agent", || {
        let w = rig.withdrawal.borrow().withdrawal.clone();
        async move { w }
    })
    .await?;
    assert_eq!(
        (
            got.expected,
            got.confirmed,
            got.done,
            got.last_confirmation_ms
        ),
        (2, 2, true, 12)
    );
    wait_until(DEADLINE, "the proxy's ACK of the withdrawal", || async {
        rig.double()
            .requests()
            .iter()
            .any(|r| {
                r.request.type_url == WITHDRAWAL_TYPE
                    && r.request.version_info == "w1"
                    && !r.request.response_nonce.is_empty()
            })
            .then_some(())
    })
    .await?;

    // The server away: the agent reads the file again, and the drain
    // knows the stream is down (keeping the withdrawal last told).
    let stopped = rig.double.take().unwrap().stop().await;
    wait_until(DEADLINE, "the stream's copy dropped", || {
        let a = rig.pod_annotations.borrow().clone();
        async move { a.is_none().then_some(()) }
    })
    .await?;
    wait_until(DEADLINE, "the stream down for the drain", || {
        let u = rig.withdrawal.borrow().clone();
        async move { (!u.connected && u.withdrawal.is_some()).then_some(()) }
    })
    .await?;
    rig.double = Some(XdsDouble::restart(stopped).await?);
    rig.stop().await
}

#[tokio::test]
async fn envoy_keeps_serving_while_the_server_is_away_and_the_proxy_resumes_without_a_resync()
-> Result<()> {
    let mut rig = Rig::start().await?;
    let a = named_backend("A").await;
    let b = named_backend("B").await;
    let port = remora_test_support::ports::free_port();
    rig.serve("v1", port, a);
    wait_answer(port, "A").await?;
    wait_until(DEADLINE, "ready", || async {
        rig.readiness.is_ready().then_some(())
    })
    .await?;

    // The server goes away: the proxy notices and retries; Envoy serves on.
    let stopped = rig.double.take().unwrap().stop().await;
    wait_until(DEADLINE, "a reconnect attempt", || async {
        (metric(&rig.registry, "xds_upstream_reconnects_total") >= 2.0).then_some(())
    })
    .await?;
    for _ in 0..3 {
        assert_eq!(answer(port).await.as_deref(), Some("A"));
    }
    assert!(rig.readiness.is_ready(), "readiness does not flap");
    // The kubelet rotates the token meanwhile.
    std::fs::write(&rig.token, "tok-2\n")?;

    rig.double = Some(XdsDouble::restart(stopped).await?);
    let responses = rig.double().responses();
    // The proxy reconnects and replays Envoy's latest request per type with
    // the version Envoy accepted: the double has nothing newer, so it sends nothing.
    let resumed = |ty: &'static str| {
        let requests = rig.double().requests();
        requests.iter().any(|r| {
            r.request.type_url == ty
                && r.authorization.as_deref() == Some("Bearer tok-2")
                && r.request.version_info == "v1"
                && r.request.response_nonce.is_empty()
        })
    };
    wait_until(DEADLINE, "the replayed CDS and LDS requests", || async {
        (resumed(CLUSTER_TYPE) && resumed(LISTENER_TYPE)).then_some(())
    })
    .await?;
    assert_eq!(rig.double().streams(), 2);
    assert_eq!(
        rig.double().responses(),
        responses,
        "no resync after a resume"
    );
    let replayed: Vec<_> = rig
        .double()
        .requests()
        .into_iter()
        .filter(|r| r.authorization.as_deref() == Some("Bearer tok-2"))
        .collect();
    assert_eq!(
        replayed[0].request.node.as_ref().map(|n| n.id.as_str()),
        Some(rig.node_id.as_str()),
        "the new stream's first request names the node"
    );

    // A new version reaches Envoy through the new stream.
    rig.serve("v2", port, b);
    wait_answer(port, "B").await?;

    // A configuration Envoy refuses is NACKed (counted) and the last good one stays.
    rig.double().set(
        LISTENER_TYPE,
        "v3",
        vec![
            tcp_listener("out", port, "backend"),
            tcp_listener("out", port + 1, "backend"),
        ],
    );
    wait_until(DEADLINE, "a NACK", || async {
        (metric(&rig.registry, "xds_nacks_total") >= 1.0).then_some(())
    })
    .await?;
    assert_eq!(answer(port).await.as_deref(), Some("B"));
    rig.stop().await
}

#[tokio::test]
async fn the_upstream_stream_ends_with_envoys() -> Result<()> {
    let mut rig = Rig::start().await?;
    wait_until(DEADLINE, "Envoy's stream at the double", || async {
        (rig.double().open_streams() == 1).then_some(())
    })
    .await?;
    rig.envoy.child.kill().await?;
    wait_until(DEADLINE, "the upstream stream closed", || async {
        (rig.double().open_streams() == 0).then_some(())
    })
    .await?;
    wait_until(DEADLINE, "the proxy's stream gone", || async {
        (metric(&rig.registry, "xds_streams") == 0.0).then_some(())
    })
    .await?;
    assert_eq!(
        rig.double().streams(),
        1,
        "no reconnect for a stream Envoy ended"
    );
    rig.stop().await
}
