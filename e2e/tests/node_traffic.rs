//! The benchmark's clients (`e2e::traffic`) and lagging ingress
//! (`e2e::node::ingress`) on the real node, in steady state: a 2-replica
//! Deployment of the test app with Remora injected (Legacy), behind a
//! ClusterIP Service (80 → the sidecar's inbound 15006 → the app's 8080).
//! Every client kind must get all its answers, through the Service and
//! kube-proxy from the host, and through the ingress fed from the
//! Service's real EndpointSlices. No scenario here (no pod stops): a
//! failure in steady state is a bug of the harness or the sidecar.
//!
//! Runs with `REMORA_NODE_TESTS=1` (see `e2e::node`); each test has its own
//! namespace. Rates and latencies are printed, not asserted.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::node::ingress::{EndpointFeed, LaggingIngress};
use e2e::node::pods;
use e2e::node::workloads::wait_deployment_rolled_out;
use e2e::node::{self, Check, Node, TestNamespace, report};
use e2e::traffic::{Kind, Load, Sample, Traffic, summarize};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::Client;
use kube::api::{Patch, PatchParams, PostParams};
use remora_contract::annotations::{INBOUND, MODE};
use remora_contract::pod::INBOUND_PORT;
use remora_test_support::wait::wait_until;
use tokio::time::Instant;

const APP: &str = "web";
const APP_PORT: u16 = 8080;
const DEADLINE: Duration = Duration::from_secs(120);
/// Answers each load must have before the traffic stops (long requests:
/// [`LONG_ANSWERS`]).
const ANSWERS: usize = 40;
const LONG_ANSWERS: usize = 3;
/// The ingress's lag in these tests: short, but not zero, so the delay line
/// is on the path.
const LAG: Duration = Duration::from_secs(1);

/// The injected test app (Legacy, inbound 15006 → 8080) and its Service;
/// returns the running pods and the ClusterIP once kube-proxy serves it.
async fn deploy(client: &Client, ns: &TestNamespace) -> anyhow::Result<(Vec<Pod>, IpAddr)> {
    node::wait_injected(client, ns.name(), DEADLINE).await?;
    let inbound = format!("{INBOUND_PORT}:{APP_PORT}");
    let port = APP_PORT.to_string();
    let deployment = pods::test_app_deployment(
        APP,
        2,
        &[(MODE, "Legacy"), (INBOUND, &inbound)],
        &["--port", &port, "--delay", "2ms"],
    )?;
    let t = Instant::now();
    ns.api::<Deployment>()
        .create(&PostParams::default(), &deployment)
        .await?;
    let svc = ns
        .api::<Service>()
        .create(
            &PostParams::default(),
            &pods::test_app_service(APP, 80, INBOUND_PORT)?,
        )
        .await?;
    let running = wait_deployment_rolled_out(client, ns.name(), APP, DEADLINE).await?;
    pods::wait_service_endpoints(client, ns.name(), APP, 2, DEADLINE).await?;
    let ip: IpAddr = svc
        .spec
        .and_then(|s| s.cluster_ip)
        .context("Service has no ClusterIP")?
        .parse()?;
    // Nothing goes to the ClusterIP before kube-proxy knows it (the egress
    // guard would count it).
    pods::wait_kube_proxy(ip, 80, DEADLINE).await?;
    report(&format!(
        "  Deployment {}/{APP} (2 replicas) serving through {ip}:80 after {} ms",
        ns.name(),
        t.elapsed().as_millis()
    ));
    Ok((running, ip))
}

fn pod_ips(pods: &[Pod]) -> anyhow::Result<Vec<IpAddr>> {
    pods.iter()
        .map(|p| {
            Ok(p.status
                .as_ref()
                .and_then(|s| s.pod_ip.as_deref())
                .context("pod without IP")?
                .parse()?)
        })
        .collect()
}

/// Runs `loads` until each has its answers (deadline 120 s), then stops.
async fn run(loads: Vec<Load>) -> anyhow::Result<Vec<Sample>> {
    let wanted: Vec<(String, usize)> = loads
        .iter()
        .map(|l| {
            let n = if matches!(l.kind, Kind::Long { .. }) {
                LONG_ANSWERS
            } else {
                ANSWERS
            };
            (l.name.clone(), n)
        })
        .collect();
    let traffic = Traffic::start(loads, Instant::now());
    let waited = wait_until(DEADLINE, "every load's answers", || async {
        let samples = traffic.samples();
        let short: Vec<String> = wanted
            .iter()
            .filter_map(|(name, n)| {
                let got = samples.iter().filter(|s| &*s.load == name).count();
                (got < *n).then(|| format!("{name}: {got}/{n}"))
            })
            .collect();
        Ok::<_, anyhow::Error>(if short.is_empty() {
            Check::Done(())
        } else {
            Check::NotYet(short.join(", "))
        })
    })
    .await;
    let samples = traffic.stop().await;
    print(&samples);
    waited?;
    Ok(samples)
}

fn print(samples: &[Sample]) {
    for s in summarize(samples) {
        report(&format!(
            "  {:<18} sent {:>4} ok {:>4} failed {:>3} {:?} p50 {:.1} ms p99 {:.1} ms",
            s.load, s.sent, s.ok, s.failed, s.failures, s.latency.p50_ms, s.latency.p99_ms
        ));
    }
}

/// Every sample succeeded; each load was answered by both replicas.
fn all_ok(samples: &[Sample], pods: &[Pod]) -> anyhow::Result<()> {
    let failed: Vec<&Sample> = samples.iter().filter(|s| !s.outcome.is_ok()).collect();
    ensure!(
        failed.is_empty(),
        "{} of {} failed in steady state, first: {:?}",
        failed.len(),
        samples.len(),
        failed.first()
    );
    let names: BTreeSet<&str> = pods
        .iter()
        .filter_map(|p| p.metadata.name.as_deref())
        .collect();
    for sum in summarize(samples) {
        let answered: BTreeSet<&str> = samples
            .iter()
            .filter(|s| *s.load == *sum.load)
            .filter_map(|s| s.pod.as_deref())
            .collect();
        ensure!(
            answered.is_subset(&names) && !answered.is_empty(),
            "{}: answered by {answered:?}, pods {names:?}",
            sum.load
        );
    }
    Ok(())
}

/// HTTP/1.1 and h2c through the Service (kube-proxy, then the sidecar),
/// keep-alive HTTP/1.1 through the lagging ingress fed from the Service's
/// EndpointSlices, and h2c and gRPC straight to the app's port on each pod
/// (see [`grpc_through_the_sidecar`] for why gRPC not through it).
#[tokio::test]
#[ignore = "needs the real node: REMORA_NODE_TESTS=1 cargo test -p e2e --test node_traffic -- --ignored (root, scripts/cluster.sh, scripts/images.sh)"]
async fn every_client_kind_in_steady_state() -> anyhow::Result<()> {
    let node = Node::for_test("node_traffic::every_client_kind_in_steady_state").await?;
    let client = node.client()?;
    node.remora(&client).await?;
    let ns = TestNamespace::injected(node, &client, "traffic").await?;
    let (pods, ip) = deploy(&client, &ns).await?;
    let service = SocketAddr::new(ip, 80);

    // The ingress follows the slices' sidecar port (the Service's "http").
    let feed = EndpointFeed::from_slices(ns.api(), APP, Some("http"), LAG).await?;
    let expected: Vec<SocketAddr> = {
        let mut v: Vec<SocketAddr> = pod_ips(&pods)?
            .into_iter()
            .map(|ip| SocketAddr::new(ip, INBOUND_PORT))
            .collect();
        v.sort();
        v
    };
    ensure!(
        feed.current() == expected,
        "the ingress starts with {:?}, the pods are {expected:?}",
        feed.current()
    );
    let ingress = LaggingIngress::start(feed.receiver()).await?;

    let mut loads = vec![
        Load::new(Kind::Http1KeepAlive, service, 50.0),
        Load::new(Kind::H2c { connections: 2 }, service, 50.0),
        Load::new(
            Kind::Post {
                body_bytes: 16 * 1024,
            },
            service,
            20.0,
        ),
        Load::new(
            Kind::Long {
                min: Duration::from_secs(2),
                max: Duration::from_secs(4),
            },
            service,
            2.0,
        ),
        Load::new(Kind::Http1KeepAlive, ingress.addr(), 50.0).named("http1@ingress"),
    ];
    for (i, pod_ip) in pod_ips(&pods)?.into_iter().enumerate() {
        let app = SocketAddr::new(pod_ip, APP_PORT);
        loads.extend([
            Load::new(Kind::H2c { connections: 2 }, app, 25.0).named(format!("h2c@pod{i}")),
            Load::new(Kind::GrpcUnary, app, 25.0).named(format!("grpc-unary@pod{i}")),
            Load::new(
                Kind::GrpcStream {
                    hold: Duration::from_secs(1),
                },
                app,
                20.0,
            )
            .named(format!("grpc-stream@pod{i}")),
        ]);
    }
    let samples = run(loads).await?;
    all_ok(&samples, &pods)?;
    let stats = ingress.stats();
    report(&format!("  ingress: {stats:?}"));
    ensure!(
        stats.forwarded.keys().copied().collect::<Vec<_>>() == expected,
        "the ingress forwarded to {:?}",
        stats.forwarded
    );
    drop(ingress);

    // A real change of the slices reaches the feed, applied `LAG` after
    // the watch saw it: a third replica.
    ns.api::<Deployment>()
        .patch(
            APP,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"replicas": 3}})),
        )
        .await?;
    let grown = wait_until(
        DEADLINE,
        "the ingress applying a third endpoint",
        || async {
            let now = feed.current();
            Ok::<_, anyhow::Error>(if now.len() == 3 {
                Check::Done(now)
            } else {
                Check::NotYet(format!("{now:?}"))
            })
        },
    )
    .await?;
    let change = feed.changes().last().cloned().context("no change")?;
    ensure!(
        change.endpoints == grown && change.added.len() == 1 && change.removed.is_empty(),
        "{change:?}"
    );
    ensure!(change.applied - change.seen >= LAG, "{change:?}");
    report(&format!(
        "  slice change {:?} seen, applied {} ms later",
        change.added,
        (change.applied - change.seen).as_millis()
    ));
    drop(feed);

    ns.delete().await?;
    let drops = node.guard_drops().await?;
    ensure!(drops == 0, "egress guard dropped {drops} packets");
    Ok(())
}

/// gRPC through the Service and the sidecar: the agent's inbound cluster
/// speaks the client's protocol to the app, so trailers survive.
#[tokio::test]
#[ignore = "needs the real node: REMORA_NODE_TESTS=1 cargo test -p e2e --test node_traffic -- --ignored (root, scripts/cluster.sh, scripts/images.sh)"]
async fn grpc_through_the_sidecar() -> anyhow::Result<()> {
    let node = Node::for_test("node_traffic::grpc_through_the_sidecar").await?;
    let client = node.client()?;
    node.remora(&client).await?;
    let ns = TestNamespace::injected(node, &client, "traffic-h2").await?;
    let (pods, ip) = deploy(&client, &ns).await?;
    let service = SocketAddr::new(ip, 80);
    let samples = run(vec![
        Load::new(Kind::GrpcUnary, service, 50.0),
        Load::new(
            Kind::GrpcStream {
                hold: Duration::from_secs(1),
            },
            service,
            20.0,
        ),
    ])
    .await;
    let result = samples.and_then(|s| all_ok(&s, &pods));
    ns.delete().await?;
    let drops = node.guard_drops().await?;
    ensure!(drops == 0, "egress guard dropped {drops} packets");
    result
}
