//! Secure naming through real Envoys, no node: the operator's workload CA
//! and discovery server run in this process (the registry fed directly, a
//! test double for the API server's TokenReview), and three
//! `remora-agent`s run as injected sidecars do, each with its certificate
//! from that CA: a client (discovery mode, `remora.dev/outbound` naming
//! Service `cart.shop`) and two servers behind `cart`, `server-0` under
//! ServiceAccount `server` and `impostor-0` under `impostor`, each an agent
//! with a permissive inbound listener in front of a small HTTP app.
//!
//! Shown, in order, on the same processes:
//! - `cart` declares `remora.dev/identities: server`: the client's Envoy is
//!   never sent the impostor's endpoint, every call is answered by
//!   `server-0`, over mTLS (handshakes counted on both Envoys);
//! - the registry is wrong about the impostor's address (it believes a
//!   `server` pod holds it, as a stale EndpointSlice or a reused address
//!   would have it): the endpoint is sent, and the client's Envoy refuses
//!   the certificate it is shown there (`ssl.fail_verify_san`); no call
//!   reaches the impostor's app;
//! - without a declaration and with the impostor not meshed (a pod
//!   injected without the CA, or before this version), the client reaches
//!   it in plain text and `server-0` over mTLS; a client without a sidecar
//!   still reaches `server-0`'s permissive inbound listener in plain text,
//!   while a TLS client offering the mesh's ALPN without a certificate is
//!   refused there.
//!
//! The agent binary must be built (`cargo build -p remora-agent`, or set
//! `REMORA_AGENT_BIN`); Envoy is found as the other tests find it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use remora_contract::discovery::{ServiceHost, TOKEN_AUDIENCE as DISCOVERY_AUDIENCE};
use remora_contract::workload_ca::TOKEN_AUDIENCE as CA_AUDIENCE;
use remora_operator::discovery::push::{Debounce, Discovery};
use remora_operator::discovery::registry::{
    PodKey, Protocol, ProxyInfo, ServiceInfo, ServicePort, SliceInfo,
};
use remora_operator::pki::workload_ca::authn::{AuthError, Authenticate, Caller, Gate, GateLimits};
use remora_operator::pki::workload_ca::service::{CaService, Lifetimes};
use remora_operator::pki::workload_ca::{ServingCert, testing};
use remora_test_support::jwt;
use remora_test_support::named_backend::{self, NamedBackend};
use remora_test_support::ports::free_port;
use remora_test_support::wait::wait_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

const SERVER_NAME: &str = "remora-operator.remora-system.svc";
const NS: &str = "shop";
const EXP: u64 = 4_000_000_000;
const DEADLINE: Duration = Duration::from_secs(30);
const CART: &str = "outbound|80||cart.shop.svc.cluster.local";
/// Token nonces, one per ServiceAccount.
const ACCOUNTS: [(u64, &str); 3] = [(1, "web"), (2, "server"), (3, "impostor")];

/// The API server's TokenReview, as a table: each account's token (of
/// either audience) is that account's in `shop`.
struct Reviewer;

impl Authenticate for Reviewer {
    async fn authenticate(&self, token: &str) -> Result<Caller, AuthError> {
        for (nonce, sa) in ACCOUNTS {
            for aud in [CA_AUDIENCE, DISCOVERY_AUDIENCE] {
                if token == jwt::service_account(aud, EXP, nonce) {
                    return Ok(Caller {
                        namespace: NS.into(),
                        service_account: sa.into(),
                        pod: None,
                    });
                }
            }
        }
        Err(AuthError::Rejected("invalid bearer token".into()))
    }
}

/// The operator's CA and discovery server on loopback.
struct ControlPlane {
    ca: SocketAddr,
    xds: SocketAddr,
    bundle: String,
    discovery: Arc<Discovery>,
    stop: CancellationToken,
}

impl ControlPlane {
    async fn start() -> anyhow::Result<Self> {
        let authority = testing::authority(&[SERVER_NAME]).map_err(anyhow::Error::msg)?;
        let bundle = authority.bundle.clone();
        let (tx, rx) = tokio::sync::watch::channel(Some(Arc::new(authority)));
        let stop = CancellationToken::new();

        let ca = CaService {
            auth: Reviewer,
            gate: Gate::new(CA_AUDIENCE, GateLimits::default()),
            authority: rx.clone(),
            trust_domain: "cluster.local".into(),
            lifetimes: Lifetimes {
                default: Duration::from_secs(3600),
                max: Duration::from_secs(3600),
            },
            metrics: remora_operator::pki::workload_ca::Metrics::default(),
            events: None,
        };
        let ca_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let ca_addr = ca_listener.local_addr()?;
        let token = stop.clone();
        tokio::spawn(async move {
            let _tx = tx;
            let limits = remora_operator::pki::workload_ca::serve::Limits::default();
            let served =
                remora_operator::pki::workload_ca::serve::serve(ca_listener, ca, limits, token)
                    .await;
            served.expect("the CA served");
        });

        let (discovery, debounce) = Discovery::new(
            "cluster.local",
            Some("cluster.local"),
            Debounce {
                quiet: Duration::from_millis(10),
                max_delay: Duration::from_millis(50),
            },
        );
        tokio::spawn(debounce);
        let ads = remora_operator::discovery::server::AdsService {
            auth: Reviewer,
            gate: Gate::new(DISCOVERY_AUDIENCE, GateLimits::default()),
            discovery: Arc::clone(&discovery),
            metrics: remora_operator::discovery::Metrics::default(),
            events: None,
            shutdown: stop.clone(),
            pod_wait: remora_operator::discovery::server::POD_WAIT,
        };
        let xds_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let xds_addr = xds_listener.local_addr()?;
        let token = stop.clone();
        tokio::spawn(async move {
            let served = remora_operator::discovery::serve::serve(
                xds_listener,
                ads,
                Arc::new(ServingCert(rx)),
                remora_operator::discovery::serve::limits(),
                token,
            )
            .await;
            served.expect("discovery served");
        });
        Ok(Self {
            ca: ca_addr,
            xds: xds_addr,
            bundle,
            discovery,
            stop,
        })
    }
}

/// One HTTP/1.1 GET on a connection of its own (never retried): the
/// status and the raw response, `None` when nothing answered.
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

/// The `x-backend` of a response, lower-cased headers or not.
fn backend(raw: &str) -> Option<&str> {
    raw.lines()
        .find_map(|l| l.strip_prefix("x-backend: "))
        .map(str::trim)
}

/// A counter of an Envoy's `/stats`, 0 when absent.
async fn stat(admin_port: u16, name: &str) -> u64 {
    let body = get(admin_port, "/stats")
        .await
        .map(|r| r.1)
        .unwrap_or_default();
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A sidecar: `remora-agent run` with the settings the injector gives a
/// pod wired to the workload CA (its token files written here).
struct Sidecar {
    child: Child,
    health: u16,
    envoy_admin: u16,
    dir: tempfile::TempDir,
}

impl Sidecar {
    async fn start(
        cp: &ControlPlane,
        pod: &str,
        nonce: u64,
        service_account: &str,
        extra: &[String],
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let write = |name: &str, text: &str| -> anyhow::Result<String> {
            let path = dir.path().join(name);
            std::fs::write(&path, text)?;
            Ok(path.display().to_string())
        };
        let bundle = write("root-cert.pem", &cp.bundle)?;
        let ca_token = write("ca-token", &jwt::service_account(CA_AUDIENCE, EXP, nonce))?;
        let xds_token = write(
            "xds-token",
            &jwt::service_account(DISCOVERY_AUDIENCE, EXP, nonce),
        )?;
        let (health, envoy_admin) = (free_port(), free_port());
        let log = std::fs::File::create(dir.path().join("agent.log"))?;
        let agent = e2e::jobpod::agent_bin()?;
        let envoy = remora_test_support::bins::envoy_bin()?;
        let child = Command::new(agent)
            .arg("run")
            .arg(format!("--envoy-bin={}", envoy.display()))
            .arg(format!("--run-dir={}", dir.path().join("run").display()))
            .arg(format!(
                "--annotations-file={}",
                dir.path().join("annotations").display()
            ))
            .args(["--health-address=127.0.0.1", "--concurrency=1"])
            .arg(format!("--health-port={health}"))
            .arg(format!("--envoy-admin-port={envoy_admin}"))
            .arg(format!("--admin-port={}", free_port()))
            .arg(format!("--stats-port={}", free_port()))
            .arg(format!("--pod-name={pod}"))
            .arg(format!("--pod-namespace={NS}"))
            .arg(format!("--service-account={service_account}"))
            .arg("--instance-ip=127.0.0.1")
            .arg(format!("--ca-address={}", cp.ca))
            .arg(format!("--ca-server-name={SERVER_NAME}"))
            .arg(format!("--ca-root-cert={bundle}"))
            .arg(format!("--token-path={ca_token}"))
            .arg(format!("--discovery-token-path={xds_token}"))
            .args(extra)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("the agent starts")?;
        Ok(Self {
            child,
            health,
            envoy_admin,
            dir,
        })
    }

    async fn ready(&mut self, what: &str) -> anyhow::Result<()> {
        let health = self.health;
        let ok = wait_until(DEADLINE, &format!("{what} ready"), || async move {
            get(health, "/healthz/ready")
                .await
                .filter(|(s, _)| *s == 200)
                .map(|_| ())
        })
        .await;
        if ok.is_err() {
            let log =
                std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default();
            let _ = self.child.start_kill();
            bail!("{what} not ready within {DEADLINE:?}:\n{log}");
        }
        Ok(())
    }
}

fn pod(name: &str) -> PodKey {
    PodKey {
        namespace: NS.into(),
        name: name.into(),
    }
}

fn cart() -> ServiceHost {
    ServiceHost {
        name: "cart".into(),
        namespace: NS.into(),
    }
}

/// A slice of `cart` with one endpoint, 127.0.0.1 at `port`, naming `pod`.
fn slice(port: u16, pod: &str) -> SliceInfo {
    let ip = "127.0.0.1".parse().expect("ip");
    SliceInfo {
        service: Some(cart()),
        ports: [("http".to_string(), port)].into(),
        ready: [ip].into(),
        pods: [(ip, pod.to_string())].into(),
    }
}

fn meshed(service_account: &str, mtls_ports: &[u16]) -> ProxyInfo {
    ProxyInfo {
        ip: Some("127.0.0.1".into()),
        service_account: service_account.into(),
        mtls_ports: mtls_ports.iter().copied().collect(),
        ..Default::default()
    }
}

fn service(identities: Option<&[&str]>) -> ServiceInfo {
    ServiceInfo {
        ports: vec![ServicePort {
            port: 80,
            name: "http".into(),
            protocol: Protocol::Http,
        }],
        identities: identities.map(|ids| ids.iter().map(|s| s.to_string()).collect()),
    }
}

/// `n` calls through the client's listener: answers by backend (`503` for
/// a call no app answered).
async fn calls(listen: u16, n: usize) -> BTreeMap<String, usize> {
    let mut counted = BTreeMap::new();
    for _ in 0..n {
        let who = match get(listen, "/").await {
            Some((200, raw)) => backend(&raw).unwrap_or("?").to_string(),
            Some((status, _)) => status.to_string(),
            None => "no answer".into(),
        };
        *counted.entry(who).or_default() += 1;
    }
    counted
}

/// `n` h2c requests on one connection through the client's listener,
/// counted by the backend that answered.
async fn h2c_calls(listen: u16, n: usize) -> anyhow::Result<BTreeMap<String, usize>> {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", listen)).await?;
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp)).await?;
    tokio::spawn(conn);
    let mut counted = BTreeMap::new();
    for _ in 0..n {
        let req = http::Request::builder()
            .uri(format!("http://cart.shop:{listen}/"))
            .body(String::new())?;
        let r = send.send_request(req).await?;
        let who = if r.status() == 200 {
            r.headers()
                .get(named_backend::HEADER)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("?")
                .to_string()
        } else {
            r.status().as_str().to_string()
        };
        *counted.entry(who).or_default() += 1;
    }
    Ok(counted)
}

/// Accepts any server certificate: the test is about the server's check.
#[derive(Debug)]
struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A GET over TLS offering the mesh's ALPN, with no client certificate:
/// the raw response, or why there was none.
async fn tls_get_without_a_certificate(port: u16) -> anyhow::Result<String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(provider)))
        .with_no_client_auth();
    config.alpn_protocols = vec![remora_contract::mesh::MTLS_ALPN.as_bytes().to_vec()];
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let name = rustls::pki_types::ServerName::try_from("server-0.shop")?;
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await?;
    tls.write_all(b"GET / HTTP/1.1\r\nHost: cart.shop\r\nConnection: close\r\n\r\n")
        .await?;
    let mut out = String::new();
    tls.read_to_string(&mut out).await?;
    ensure!(!out.is_empty(), "the connection closed without an answer");
    Ok(out)
}

/// The client Envoy's endpoints of `cart`, as `ip:port`.
async fn cart_endpoints(admin: u16) -> BTreeSet<String> {
    let body = get(admin, "/clusters")
        .await
        .map(|r| r.1)
        .unwrap_or_default();
    body.lines()
        .filter_map(|l| l.strip_prefix(&format!("{CART}::")))
        .filter_map(|l| l.split("::").next())
        .filter(|a| a.contains(':'))
        .map(str::to_string)
        .collect()
}

async fn wait_endpoints(admin: u16, want: &[u16], why: &str) -> anyhow::Result<()> {
    let want: BTreeSet<String> = want.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    wait_until(DEADLINE, why, || {
        let want = want.clone();
        async move { (cart_endpoints(admin).await == want).then_some(()) }
    })
    .await
    .with_context(|| format!("{why}: the client's Envoy has {want:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sidecar_reaches_only_the_services_identities_over_mtls() -> anyhow::Result<()> {
    let cp = ControlPlane::start().await?;
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let server_app = NamedBackend::start(any, "server-0").await?;
    let impostor_app = NamedBackend::start(any, "impostor-0").await?;
    let (server_in, impostor_in, listen) = (free_port(), free_port(), free_port());

    // What the watches would bring: cart declares `server`; its two slices
    // name server-0 and impostor-0, both meshed on their inbound ports.
    cp.discovery.update(|r| {
        let mut t = Vec::new();
        t.extend(r.apply_service(cart(), service(Some(&["server"]))));
        t.extend(r.apply_slice((NS.into(), "cart-a".into()), slice(server_in, "server-0")));
        t.extend(r.apply_slice(
            (NS.into(), "cart-b".into()),
            slice(impostor_in, "impostor-0"),
        ));
        t.extend(r.apply_proxy(pod("server-0"), meshed("server", &[server_in])));
        t.extend(r.apply_proxy(pod("impostor-0"), meshed("impostor", &[impostor_in])));
        t.extend(r.apply_proxy(
            pod("client-0"),
            ProxyInfo {
                outbound: Some(format!("{listen}:cart.shop:80").into()),
                ..meshed("web", &[])
            },
        ));
        t
    });

    let mut server = Sidecar::start(
        &cp,
        "server-0",
        2,
        "server",
        &[format!("--inbound={server_in}:{}", server_app.addr.port())],
    )
    .await?;
    let mut impostor = Sidecar::start(
        &cp,
        "impostor-0",
        3,
        "impostor",
        &[format!(
            "--inbound={impostor_in}:{}",
            impostor_app.addr.port()
        )],
    )
    .await?;
    let mut client = Sidecar::start(
        &cp,
        "client-0",
        1,
        "web",
        &[
            format!("--discovery-address={}", cp.xds),
            format!("--discovery-server-name={SERVER_NAME}"),
            format!("--outbound={listen}:cart.shop:80"),
        ],
    )
    .await?;
    server.ready("server-0's sidecar").await?;
    impostor.ready("impostor-0's sidecar").await?;
    client.ready("the client's sidecar").await?;
    let server_tls = format!("listener.0.0.0.0_{server_in}.ssl.handshake");
    let impostor_tls = format!("listener.0.0.0.0_{impostor_in}.ssl.handshake");
    let client_tls = format!("cluster.{CART}.ssl.handshake");
    let client_san = format!("cluster.{CART}.ssl.fail_verify_san");

    // 1. Declared: the impostor is not even sent; every call is server-0's, over mTLS.
    wait_endpoints(client.envoy_admin, &[server_in], "only server-0 sent").await?;
    let counted = calls(listen, 20).await;
    println!("secure naming, declared: 20 calls answered by {counted:?}");
    ensure!(
        counted == BTreeMap::from([("server-0".to_string(), 20)]),
        "{counted:?}"
    );
    // h2c on one connection: HTTP/2 upstream over the mesh's mTLS (the
    // server's sidecar reads the protocol from the bytes, not from ALPN).
    let h2 = h2c_calls(listen, 10).await?;
    println!("secure naming, declared: 10 h2c calls on one connection answered by {h2:?}");
    ensure!(
        h2 == BTreeMap::from([("server-0".to_string(), 10)]),
        "{h2:?}"
    );
    ensure!(impostor_app.served() == 0);
    let (s, c) = (
        stat(server.envoy_admin, &server_tls).await,
        stat(client.envoy_admin, &client_tls).await,
    );
    println!("mTLS handshakes: server-0's inbound {s}, the client's cluster {c}");
    ensure!(
        s >= 1 && c >= 1,
        "no mTLS handshake (server {s}, client {c})"
    );

    // 2. The registry believes a `server` pod holds the impostor's address:
    // it is sent, and the client's Envoy refuses the certificate there.
    cp.discovery
        .update(|r| r.apply_proxy(pod("impostor-0"), meshed("server", &[impostor_in])));
    wait_endpoints(
        client.envoy_admin,
        &[server_in, impostor_in],
        "the stale endpoint sent",
    )
    .await?;
    let counted = calls(listen, 20).await;
    println!("secure naming, stale endpoint: 20 calls answered by {counted:?}");
    let refused = stat(client.envoy_admin, &client_san).await;
    println!("handshakes refused for the SAN: {refused}");
    ensure!(
        impostor_app.served() == 0,
        "a call reached the impostor's app"
    );
    ensure!(refused >= 1, "no SAN refusal counted");
    ensure!(
        counted.get("server-0").copied().unwrap_or(0) + counted.get("503").copied().unwrap_or(0)
            == 20,
        "{counted:?}"
    );

    // 3. No declaration, the impostor not meshed: plain text to it, mTLS to
    // server-0; a client without a sidecar reaches server-0's permissive
    // listener in plain text.
    let before = stat(impostor.envoy_admin, &impostor_tls).await;
    cp.discovery.update(|r| {
        let mut t = Vec::new();
        t.extend(r.apply_service(cart(), service(None)));
        t.extend(r.apply_proxy(pod("impostor-0"), meshed("impostor", &[])));
        t
    });
    let plain = format!("cluster.{CART}.{}.total_match_count", "plaintext");
    let client_admin = client.envoy_admin;
    wait_until(DEADLINE, "the impostor reached in plain text", || {
        let plain = plain.clone();
        async move {
            let answered = get(listen, "/").await;
            let hit = answered.as_ref().and_then(|r| backend(&r.1)) == Some("impostor-0");
            (hit && stat(client_admin, &plain).await > 0).then_some(())
        }
    })
    .await
    .context("plain text to the unmeshed endpoint")?;
    let counted = calls(listen, 20).await;
    println!("no declaration, impostor unmeshed: 20 calls answered by {counted:?}");
    ensure!(
        counted.keys().all(|k| k == "server-0" || k == "impostor-0"),
        "{counted:?}"
    );
    ensure!(
        stat(impostor.envoy_admin, &impostor_tls).await == before,
        "the unmeshed endpoint was reached over TLS"
    );
    let direct = get(server_in, "/").await;
    ensure!(
        direct.as_ref().map(|r| r.0) == Some(200),
        "plain text to the permissive listener: {direct:?}"
    );
    // The mesh's ALPN without a client certificate: the handshake is refused
    // and nothing reaches server-0's app.
    let before = server_app.served();
    let anonymous = tls_get_without_a_certificate(server_in).await;
    ensure!(
        anonymous.is_err(),
        "an anonymous TLS client was answered: {anonymous:?}"
    );
    if let Err(e) = &anonymous {
        println!("the mesh's ALPN without a client certificate: {e:#}");
    }
    ensure!(server_app.served() == before);
    let answered = server_app.served();
    println!(
        "apps answered: server-0 {answered}, impostor-0 {}",
        impostor_app.served()
    );
    cp.stop.cancel();
    Ok(())
}
