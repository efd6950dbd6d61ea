//! Delta xDS through the agent's proxy, with the real Envoy and the
//! operator's discovery server in this process (the registry fed directly,
//! a test double for TokenReview), no node: a `remora-agent` in discovery
//! mode writes Envoy's bootstrap with delta ADS (its default) and forwards
//! Envoy's delta stream to the server.
//!
//! Shown, on the same processes:
//! - Envoy takes its listener and clusters over delta (each dynamic
//!   cluster's version is its own resource version, not the type's) and
//!   calls through the listener reach the Service's endpoint;
//! - the server goes away, a Service's endpoints change meanwhile, and a
//!   server comes back on the same address: the agent resumes with what
//!   Envoy holds (`initial_resource_versions`), so the server sends one
//!   response, the changed load assignment, and nothing of the clusters,
//!   listeners or the other Service's endpoints (counted by the server, and
//!   by Envoy's own CDS and LDS update counters).
//!
//! The agent binary must be built (`cargo build -p remora-agent`, or set
//! `REMORA_AGENT_BIN`); Envoy is found as the other tests find it.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use e2e::discovery_rig::{NS, Reviewer, Rig, Sidecar, Upstreams, get, host, http_service, stat};
use remora_operator::discovery::registry::{PodKey, ProxyInfo, SliceInfo};
use remora_operator::discovery::resources::{CLUSTER, ENDPOINTS, LISTENER};
use remora_test_support::named_backend::NamedBackend;
use remora_test_support::ports::free_port;
use remora_test_support::wait::wait_until;
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(30);
const CART: &str = "outbound|80||cart.shop.svc.cluster.local";
const PAY: &str = "outbound|80||pay.shop.svc.cluster.local";

/// A slice of `service` whose endpoints are `ips` at `port`.
fn slice(service: &str, port: u16, ips: &[&str]) -> SliceInfo {
    SliceInfo {
        service: Some(host(service)),
        ports: [("http".to_string(), port)].into(),
        ready: ips.iter().map(|ip| ip.parse().expect("ip")).collect(),
        ..Default::default()
    }
}

/// An HTTP app on `ip:port` named after its address.
async fn app(ip: &'static str, port: u16) -> anyhow::Result<()> {
    NamedBackend::start(SocketAddr::new(ip.parse()?, port), ip).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_over_delta_through_the_agent_resumes_without_a_resync() -> anyhow::Result<()> {
    let rig = Rig::new(Reviewer::new(&[(1, "web")]), None)?;
    let (discovery, metrics) = (&rig.discovery, &rig.metrics);

    let (cart_port, listen, pay_listen) = (free_port(), free_port(), free_port());
    app("127.0.0.2", cart_port).await?;
    app("127.0.0.3", cart_port).await?;
    discovery.update(|r| {
        let mut t = Vec::new();
        t.extend(r.apply_service(host("cart"), http_service()));
        t.extend(r.apply_service(host("pay"), http_service()));
        t.extend(r.apply_slice(
            (NS.into(), "cart-1".into()),
            slice("cart", cart_port, &["127.0.0.2"]),
        ));
        t.extend(r.apply_slice(
            (NS.into(), "pay-1".into()),
            slice("pay", cart_port, &["127.0.0.3"]),
        ));
        t.extend(r.apply_proxy(
            PodKey {
                namespace: NS.into(),
                name: "web-0".into(),
            },
            ProxyInfo {
                ip: Some("127.0.0.1".into()),
                service_account: "web".into(),
                outbound: Some(format!("{listen}:cart.shop:80,{pay_listen}:pay.shop:80").into()),
                ..Default::default()
            },
        ));
        t
    });
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse()?;
    let stop = CancellationToken::new();
    let first = rig.serve_discovery(addr, stop.clone()).await?;
    let upstreams = Upstreams {
        discovery: Some(addr),
        ca: None,
    };
    let mut agent = Sidecar::start(&rig, &upstreams, "web-0", "web", 1, &[])?;
    agent.ready("the sidecar").await?;
    let admin = agent.envoy_admin;
    let (status, raw) = get(listen, "/")
        .await
        .context("a call through the sidecar")?;
    ensure!(
        status == 200 && raw.contains("x-backend: 127.0.0.2"),
        "{raw}"
    );
    // Delta: each cluster's version is its own resource version.
    let snapshot = discovery
        .snapshot(&PodKey {
            namespace: NS.into(),
            name: "web-0".into(),
        })
        .context("web-0 known")?;
    let dump = get(admin, "/config_dump?resource=dynamic_active_clusters")
        .await
        .map(|r| r.1)
        .unwrap_or_default();
    ensure!(dump.contains(PAY), "pay's cluster: {dump}");
    let cart_version = &snapshot.clusters.versions[CART];
    ensure!(
        dump.contains(&format!("\"version_info\": \"{cart_version}\"")),
        "cart's cluster not at its resource version {cart_version} (the type's is {}): {dump}",
        snapshot.clusters.version
    );

    // Away: the server stops; cart's endpoints change meanwhile.
    let before: Vec<u64> = [CLUSTER, LISTENER, ENDPOINTS]
        .iter()
        .map(|t| metrics.pushes_total(t))
        .collect();
    let envoy_before = (
        stat(admin, "cluster_manager.cds.update_success").await,
        stat(admin, "listener_manager.lds.update_success").await,
    );
    stop.cancel();
    first.await?;
    discovery.update(|r| {
        r.apply_slice(
            (NS.into(), "cart-1".into()),
            slice("cart", cart_port, &["127.0.0.3"]),
        )
    });
    let stop = CancellationToken::new();
    let second = rig.serve_discovery(addr, stop.clone()).await?;

    // Back: the new endpoint is taken, and only it was sent.
    let moved = wait_until(
        DEADLINE,
        "cart's new endpoint through the sidecar",
        || async move {
            get(listen, "/")
                .await
                .filter(|(s, raw)| *s == 200 && raw.contains("x-backend: 127.0.0.3"))
                .map(|_| ())
        },
    )
    .await;
    if moved.is_err() {
        bail!("cart's change never arrived:\n{}", agent.log());
    }
    let after: Vec<u64> = [CLUSTER, LISTENER, ENDPOINTS]
        .iter()
        .map(|t| metrics.pushes_total(t))
        .collect();
    println!(
        "delta resume: responses (cds, lds, eds) before {before:?}, after {after:?}; Envoy's (cds, lds) updates before {envoy_before:?}"
    );
    ensure!(
        after == [before[0], before[1], before[2] + 1],
        "one EDS response and nothing else after the reconnect: {before:?} -> {after:?}"
    );
    let envoy_after = (
        stat(admin, "cluster_manager.cds.update_success").await,
        stat(admin, "listener_manager.lds.update_success").await,
    );
    ensure!(
        envoy_after == envoy_before,
        "Envoy re-applied CDS or LDS: {envoy_before:?} -> {envoy_after:?}"
    );
    let opened = agent
        .log()
        .matches("ADS stream to the discovery server open")
        .count();
    ensure!(opened >= 2, "no reconnect seen ({opened} streams opened)");
    for t in [CLUSTER, LISTENER, ENDPOINTS] {
        ensure!(metrics.nacks_total(t) == 0, "{t} NACKed");
    }
    agent.child.start_kill()?;
    stop.cancel();
    second.await?;
    Ok(())
}
