//! Service discovery on the real node: Remora installed with its workload
//! CA and its discovery server (`discovery.enabled=true`), a 3-replica
//! Deployment `edge` of the test app behind Service `edge` (port 80, named
//! `http`, → the sidecars' inbound port), and one injected client pod
//! annotated `remora.dev/outbound: "15001:edge.<ns>:80"`: a Service named,
//! not an address. The client's sidecar gets its outbound listener
//! (127.0.0.1:15001, HTTP-aware) and the Service's endpoints from the
//! operator over ADS, and balances per request.
//!
//! Shown: three real clients from the `e2e::traffic` library (HTTP/1.1
//! keep-alive, h2c on one connection, gRPC unary on one channel; none
//! retries), each calling the client pod's listener through the API
//! server's port-forward (`e2e::node::port_forward`) for a few seconds,
//! get every answer right, and every one of the 3 replicas answers each of
//! them (by the test app's `x-pod`), although each client holds one or few
//! connections: the balancing is per request, by Envoy, from endpoints
//! discovery gave it. A per-client, per-replica table is printed.
//!
//! Runs with `REMORA_NODE_TESTS=1` (see `e2e::node`).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::node::port_forward::PortForward;
use e2e::node::workload_ca as ca;
use e2e::node::workloads::wait_deployment_rolled_out;
use e2e::node::{self, Check, Node, Remora, TestNamespace, pods, report, wait_for};
use e2e::traffic::{Kind, Load, Sample, Traffic, summarize};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::Client;
use kube::api::PostParams;
use remora_contract::annotations::{INBOUND, OUTBOUND};
use remora_contract::discovery::cluster_name;
use remora_contract::env::{DISCOVERY_ADDRESS, DISCOVERY_SERVER_NAME};
use remora_contract::pod::{ENVOY_ADMIN_PORT, INBOUND_PORT};
use tokio::time::Instant;

/// The server Deployment and its Service.
const SERVER: &str = "edge";
const REPLICAS: usize = 3;
/// The client pod's Deployment.
const CALLER: &str = "caller";
const APP_PORT: u16 = 8080;
const SERVICE_PORT: u16 = 80;
/// The client's outbound listener, on its pod's loopback.
const OUTBOUND_PORT: u16 = 15001;
const DEADLINE: Duration = Duration::from_secs(120);
/// Each client's rate, and how many answers it must have (5 s' worth).
const RATE: f64 = 20.0;
const ANSWERS: usize = 100;
const VALUES: [&str; 2] = ["workloadCA.enabled=true", "discovery.enabled=true"];

/// Remora with the workload CA and discovery, installed once per binary.
async fn install(node: &Node, client: &Client) -> anyhow::Result<&'static Remora> {
    static INSTALLED: tokio::sync::OnceCell<Remora> = tokio::sync::OnceCell::const_new();
    let values: Vec<String> = VALUES.iter().map(|s| s.to_string()).collect();
    Ok(INSTALLED
        .get_or_try_init(|| node.install_remora(client, node::RELEASE_NAMESPACE, &values))
        .await?)
}

fn name(p: &Pod) -> String {
    p.metadata.name.clone().unwrap_or_default()
}

fn pod_ip(p: &Pod) -> anyhow::Result<String> {
    p.status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .with_context(|| format!("pod {} has no IP", name(p)))
}

/// The environment the webhook gave the pod's sidecar, by name (values
/// only where literal).
fn sidecar_env(p: &Pod) -> BTreeMap<String, String> {
    e2e::webhook::sidecar(p)
        .map(|(_, c)| {
            c.env
                .iter()
                .flatten()
                .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default()
}

/// Hosts of `cluster` in Envoy's `/clusters` text (`CLUSTER::IP:PORT::
/// health_flags::healthy`, one line per host and stat): the healthy ones.
fn healthy_hosts(clusters: &str, cluster: &str) -> BTreeSet<String> {
    clusters
        .lines()
        .filter_map(|l| l.strip_prefix(cluster)?.strip_prefix("::"))
        .filter_map(|rest| {
            let (host, stat) = rest.split_once("::")?;
            (stat == "health_flags::healthy").then(|| host.to_owned())
        })
        .collect()
}

/// Runs one client until it has [`ANSWERS`] samples (deadline
/// [`DEADLINE`]), then stops it and returns its samples.
async fn run_one(load: Load) -> anyhow::Result<Vec<Sample>> {
    let name = load.name.clone();
    let traffic = Traffic::start(vec![load], Instant::now());
    let waited = wait_for(&format!("{ANSWERS} answers to {name}"), DEADLINE, || {
        let got = traffic.samples().len();
        async move {
            Ok(if got >= ANSWERS {
                Check::Done(())
            } else {
                Check::NotYet(format!("{got}/{ANSWERS}"))
            })
        }
    })
    .await;
    let samples = traffic.stop().await;
    waited?;
    Ok(samples)
}

/// The per-client, per-replica table: answers by replica, failures, and
/// the TCP connections the client opened into the caller's pod.
fn table(samples: &[Sample], replicas: &[String], conns: &BTreeMap<String, usize>) -> String {
    let width = replicas.iter().map(String::len).max().unwrap_or(8).max(8);
    let mut out = format!("  {:<12}", "client");
    for r in replicas {
        out.push_str(&format!(" {r:>width$}"));
    }
    out.push_str(&format!(
        " {:>8} {:>6} {:>6} {:>6} {:>9} {:>9}\n",
        "other", "sent", "failed", "conns", "p50 ms", "p99 ms"
    ));
    for sum in summarize(samples) {
        let mine: Vec<&Sample> = samples.iter().filter(|s| *s.load == *sum.load).collect();
        out.push_str(&format!("  {:<12}", sum.load));
        for r in replicas {
            let n = mine
                .iter()
                .filter(|s| s.outcome.is_ok() && s.pod.as_deref() == Some(r.as_str()))
                .count();
            out.push_str(&format!(" {n:>width$}"));
        }
        let other = mine
            .iter()
            .filter(|s| s.outcome.is_ok())
            .filter(|s| !s.pod.as_ref().is_some_and(|p| replicas.contains(p)))
            .count();
        out.push_str(&format!(
            " {other:>8} {:>6} {:>6} {:>6} {:>9.1} {:>9.1}\n",
            sum.sent,
            sum.failed,
            conns.get(&sum.load).copied().unwrap_or(0),
            sum.latency.p50_ms,
            sum.latency.p99_ms
        ));
    }
    out
}

#[tokio::test]
async fn three_clients_reach_every_replica_of_a_service_by_name() -> anyhow::Result<()> {
    let Some(node) = Node::for_test("node_discovery").await? else {
        return Ok(());
    };
    let t0 = Instant::now();
    let client = node.client()?;
    install(node, &client).await?;
    let ns = TestNamespace::injected(node, &client, "discovery").await?;
    let n = ns.name().to_string();
    node::wait_injected(&client, &n, DEADLINE).await?;
    // The leader writes the trust bundle into the new namespace; a pod
    // created before it waits on its volume.
    ca::wait_trust_bundle(&client, &n, DEADLINE).await?;

    // The servers: 3 replicas of the test app behind their sidecars'
    // inbound; the Service's port is named `http`, so HTTP-aware.
    let inbound = format!("{INBOUND_PORT}:{APP_PORT}");
    let port = APP_PORT.to_string();
    ns.api::<Deployment>()
        .create(
            &PostParams::default(),
            &pods::test_app_deployment(
                SERVER,
                REPLICAS as i32,
                &[(INBOUND, &inbound)],
                &["--port", &port],
            )?,
        )
        .await?;
    ns.api::<Service>()
        .create(
            &PostParams::default(),
            &pods::test_app_service(SERVER, SERVICE_PORT, INBOUND_PORT)?,
        )
        .await?;
    let servers = wait_deployment_rolled_out(&client, &n, SERVER, DEADLINE).await?;
    pods::wait_service_endpoints(&client, &n, SERVER, REPLICAS, DEADLINE).await?;
    let mut replicas: Vec<String> = servers.iter().map(name).collect();
    replicas.sort();
    let mut server_hosts: BTreeSet<String> = BTreeSet::new();
    for p in &servers {
        server_hosts.insert(format!("{}:{INBOUND_PORT}", pod_ip(p)?));
    }
    ensure!(
        replicas.len() == REPLICAS,
        "{SERVER} rolled out with pods {replicas:?}"
    );
    report(&format!(
        "  {n}/{SERVER}: {REPLICAS} replicas {replicas:?} ready after {} ms",
        t0.elapsed().as_millis()
    ));

    // The client: the Service by name in its outbound annotation. Its app
    // is the test app, idle: the clients are on the host.
    let outbound = format!("{OUTBOUND_PORT}:{SERVER}.{n}:{SERVICE_PORT}");
    ns.api::<Deployment>()
        .create(
            &PostParams::default(),
            &pods::test_app_deployment(CALLER, 1, &[(OUTBOUND, &outbound)], &["--port", &port])?,
        )
        .await?;
    // Ready: with discovery on, the agent holds readiness until Envoy has
    // its first listeners and clusters from the server.
    let caller = wait_deployment_rolled_out(&client, &n, CALLER, DEADLINE)
        .await?
        .into_iter()
        .next()
        .context("no pod of the caller")?;
    let cp = name(&caller);
    let env = sidecar_env(&caller);
    let discovery = env
        .get(DISCOVERY_ADDRESS)
        .with_context(|| {
            format!(
                "the caller's sidecar was injected without {DISCOVERY_ADDRESS} (is discovery on in the chart and the injection?); its env: {:?}",
                env.keys().collect::<Vec<_>>()
            )
        })?
        .clone();
    report(&format!(
        "  {cp} Ready after {} ms, discovery server {discovery} ({})",
        t0.elapsed().as_millis(),
        env.get(DISCOVERY_SERVER_NAME)
            .map_or("no server name", String::as_str)
    ));

    // Envoy in the caller holds the listener and all 3 endpoints, as
    // discovery gave them (Envoy's admin, on the pod's loopback).
    let cluster = cluster_name(&format!("{SERVER}.{n}.svc.cluster.local"), SERVICE_PORT);
    let listener = format!("127.0.0.1:{OUTBOUND_PORT}");
    let hosts = wait_for(
        "the caller's Envoy to hold the outbound listener and every endpoint",
        DEADLINE,
        || async {
            let (_, listeners) =
                node::pod_http_get(&client, &n, &cp, ENVOY_ADMIN_PORT, "/listeners").await?;
            if !listeners.contains(&listener) {
                return Ok(Check::NotYet(format!(
                    "no listener on {listener}: {listeners:?}"
                )));
            }
            let (_, clusters) =
                node::pod_http_get(&client, &n, &cp, ENVOY_ADMIN_PORT, "/clusters").await?;
            let hosts = healthy_hosts(&clusters, &cluster);
            Ok(if hosts == server_hosts {
                Check::Done(hosts)
            } else {
                Check::NotYet(format!(
                    "{cluster}: healthy hosts {hosts:?}, servers {server_hosts:?}"
                ))
            })
        },
    )
    .await?;
    report(&format!(
        "  {cp}'s Envoy: listener {listener}, {cluster} → {hosts:?} after {} ms",
        t0.elapsed().as_millis()
    ));

    // The three clients, one after the other, into the caller's listener.
    let forward = PortForward::start(&client, &n, &cp, OUTBOUND_PORT).await?;
    let local = forward.local_addr();
    report(&format!("  {local} → {} (port-forward)", forward.target()));
    let mut samples = Vec::new();
    let mut conns = BTreeMap::new();
    let t_traffic = Instant::now();
    for kind in [
        Kind::Http1KeepAlive,
        Kind::H2c { connections: 1 },
        Kind::GrpcUnary,
    ] {
        let before = forward.connections();
        let load = Load::new(kind, local, RATE);
        conns.insert(load.name.clone(), 0);
        samples.extend(run_one(load.clone()).await?);
        conns.insert(load.name, forward.connections() - before);
    }
    let traffic_for = t_traffic.elapsed();
    let forward_errors = forward.errors();
    drop(forward);
    report(&format!(
        "  per client and replica (answers), {} ms of traffic:\n{}",
        traffic_for.as_millis(),
        table(&samples, &replicas, &conns)
    ));
    if !forward_errors.is_empty() {
        report(&format!("  port-forward errors: {forward_errors:?}"));
    }

    // No failures; each client was answered by every replica, and only by them.
    let failed: Vec<&Sample> = samples.iter().filter(|s| !s.outcome.is_ok()).collect();
    ensure!(
        failed.is_empty(),
        "{} of {} failed; first: {:?}; port-forward errors: {forward_errors:?}",
        failed.len(),
        samples.len(),
        failed.iter().take(3).collect::<Vec<_>>()
    );
    let want: BTreeSet<&str> = replicas.iter().map(String::as_str).collect();
    for sum in summarize(&samples) {
        let answered: BTreeSet<&str> = samples
            .iter()
            .filter(|s| *s.load == *sum.load)
            .filter_map(|s| s.pod.as_deref())
            .collect();
        let unnamed = samples
            .iter()
            .filter(|s| *s.load == *sum.load && s.pod.is_none())
            .count();
        ensure!(
            answered == want && unnamed == 0,
            "{}: answered by {answered:?} ({unnamed} answers without x-pod), replicas {want:?}",
            sum.load
        );
    }
    ns.delete().await?;
    report(&format!(
        "  node_discovery: {} ms in all",
        t0.elapsed().as_millis()
    ));
    assert_eq!(
        node.guard_drops().await?,
        0,
        "the egress guard dropped packets: something left the machine"
    );
    Ok(())
}
