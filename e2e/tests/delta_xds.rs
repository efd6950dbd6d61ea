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
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use remora_contract::discovery::{ServiceHost, TOKEN_AUDIENCE};
use remora_operator::discovery::Metrics;
use remora_operator::discovery::push::{Debounce, Discovery};
use remora_operator::discovery::registry::{
    PodKey, Protocol, ProxyInfo, ServiceInfo, ServicePort, SliceInfo,
};
use remora_operator::discovery::resources::{CLUSTER, ENDPOINTS, LISTENER};
use remora_operator::discovery::server::AdsService;
use remora_operator::pki::workload_ca::authn::{AuthError, Authenticate, Caller, Gate, GateLimits};
use remora_operator::pki::workload_ca::{Authority, ServingCert, testing};
use remora_test_support::jwt;
use remora_test_support::named_backend::NamedBackend;
use remora_test_support::ports::free_port;
use remora_test_support::wait::wait_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const SERVER_NAME: &str = "remora-operator.remora-system.svc";
const NS: &str = "shop";
const EXP: u64 = 4_000_000_000;
const DEADLINE: Duration = Duration::from_secs(30);
const CART: &str = "outbound|80||cart.shop.svc.cluster.local";
const PAY: &str = "outbound|80||pay.shop.svc.cluster.local";

/// TokenReview: the one token is `web`'s of `shop`.
struct Reviewer;

impl Authenticate for Reviewer {
    async fn authenticate(&self, token: &str) -> Result<Caller, AuthError> {
        if token == jwt::service_account(TOKEN_AUDIENCE, EXP, 1) {
            return Ok(Caller {
                namespace: NS.into(),
                service_account: "web".into(),
                pod: None,
            });
        }
        Err(AuthError::Rejected("invalid bearer token".into()))
    }
}

/// The discovery server on `addr`, until `stop`; the task ends when it has.
async fn serve(
    addr: SocketAddr,
    discovery: &Arc<Discovery>,
    metrics: &Metrics,
    certs: watch::Receiver<Option<Arc<Authority>>>,
    stop: CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let ads = AdsService {
        auth: Reviewer,
        gate: Gate::new(TOKEN_AUDIENCE, GateLimits::default()),
        discovery: Arc::clone(discovery),
        metrics: metrics.clone(),
        events: None,
        shutdown: stop.clone(),
        pod_wait: remora_operator::discovery::server::POD_WAIT,
    };
    Ok(tokio::spawn(async move {
        let served = remora_operator::discovery::serve::serve(
            listener,
            ads,
            Arc::new(ServingCert(certs)),
            remora_operator::discovery::serve::limits(),
            stop,
        )
        .await;
        served.expect("discovery served");
    }))
}

fn host(name: &str) -> ServiceHost {
    ServiceHost {
        name: name.into(),
        namespace: NS.into(),
    }
}

fn http_service() -> ServiceInfo {
    ServiceInfo {
        ports: vec![ServicePort {
            port: 80,
            name: "http".into(),
            protocol: Protocol::Http,
        }],
        ..Default::default()
    }
}

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

/// One HTTP/1.1 GET on a connection of its own: status and raw response.
async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: cart.shop\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out))
        .await
        .ok()?
        .ok()?;
    let status = out.split(' ').nth(1)?.parse().ok()?;
    Some((status, out))
}

/// A counter of Envoy's `/stats`, 0 when absent.
async fn stat(admin: u16, name: &str) -> u64 {
    let body = get(admin, "/stats").await.map(|r| r.1).unwrap_or_default();
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_over_delta_through_the_agent_resumes_without_a_resync() -> anyhow::Result<()> {
    let authority = testing::authority(&[SERVER_NAME]).map_err(anyhow::Error::msg)?;
    let bundle = authority.bundle.clone();
    let (_certs_tx, certs) = watch::channel(Some(Arc::new(authority)));
    let (discovery, debounce) = Discovery::new(
        "cluster.local",
        None,
        Debounce {
            quiet: Duration::from_millis(10),
            max_delay: Duration::from_millis(50),
        },
    );
    tokio::spawn(debounce);
    let metrics = Metrics::default();

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
    let first = serve(addr, &discovery, &metrics, certs.clone(), stop.clone()).await?;

    let dir = tempfile::tempdir()?;
    let write = |name: &str, text: &str| -> anyhow::Result<String> {
        let path = dir.path().join(name);
        std::fs::write(&path, text)?;
        Ok(path.display().to_string())
    };
    let roots_file = write("root-cert.pem", &bundle)?;
    let token = write("xds-token", &jwt::service_account(TOKEN_AUDIENCE, EXP, 1))?;
    let (health, admin) = (free_port(), free_port());
    let log_path = dir.path().join("agent.log");
    let log = std::fs::File::create(&log_path)?;
    let mut agent = Command::new(e2e::jobpod::agent_bin()?)
        .arg("run")
        .arg(format!(
            "--envoy-bin={}",
            remora_test_support::bins::envoy_bin()?.display()
        ))
        .arg(format!("--run-dir={}", dir.path().join("run").display()))
        .arg(format!(
            "--annotations-file={}",
            dir.path().join("annotations").display()
        ))
        .args(["--health-address=127.0.0.1", "--concurrency=1"])
        .arg(format!("--health-port={health}"))
        .arg(format!("--envoy-admin-port={admin}"))
        .arg(format!("--admin-port={}", free_port()))
        .arg(format!("--stats-port={}", free_port()))
        .args([
            "--pod-name=web-0",
            "--pod-namespace=shop",
            "--service-account=web",
            "--instance-ip=127.0.0.1",
        ])
        .arg(format!("--discovery-address={addr}"))
        .arg(format!("--discovery-server-name={SERVER_NAME}"))
        .arg(format!("--ca-root-cert={roots_file}"))
        .arg(format!("--discovery-token-path={token}"))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .context("the agent starts")?;
    let agent_log = || std::fs::read_to_string(&log_path).unwrap_or_default();

    let ready = wait_until(DEADLINE, "the sidecar ready", || async move {
        get(health, "/healthz/ready")
            .await
            .filter(|(s, _)| *s == 200)
            .map(|_| ())
    })
    .await;
    if ready.is_err() {
        let _ = agent.start_kill();
        bail!(
            "the sidecar is not ready within {DEADLINE:?}:\n{}",
            agent_log()
        );
    }
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
    let second = serve(addr, &discovery, &metrics, certs, stop.clone()).await?;

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
        bail!("cart's change never arrived:\n{}", agent_log());
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
    let opened = agent_log()
        .matches("ADS stream to the discovery server open")
        .count();
    ensure!(opened >= 2, "no reconnect seen ({opened} streams opened)");
    for t in [CLUSTER, LISTENER, ENDPOINTS] {
        ensure!(metrics.nacks_total(t) == 0, "{t} NACKed");
    }
    agent.start_kill()?;
    stop.cancel();
    second.await?;
    Ok(())
}
