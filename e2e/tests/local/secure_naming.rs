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
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::discovery_rig::{NS, Reviewer, Rig, Sidecar, Upstreams, get, stat};
use e2e::eds_convergence::cluster_hosts;
use remora_contract::discovery::ServiceHost;
use remora_operator::discovery::registry::{
    PodKey, Protocol, ProxyInfo, ServiceInfo, ServicePort, SliceInfo,
};
use remora_test_support::named_backend::{self, NamedBackend};
use remora_test_support::ports::free_port;
use remora_test_support::wait::wait_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(30);
const CART: &str = "outbound|80||cart.shop.svc.cluster.local";
const ACCOUNTS: [(u64, &str); 3] = [(1, "web"), (2, "server"), (3, "impostor")];

/// The `x-backend` of a response, lower-cased headers or not.
fn backend(raw: &str) -> Option<&str> {
    raw.lines()
        .find_map(|l| l.strip_prefix("x-backend: "))
        .map(str::trim)
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
    cluster_hosts(&body, CART)
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
    let rig = Rig::new(Reviewer::new(&ACCOUNTS), Some("cluster.local"))?;
    let stop = CancellationToken::new();
    let ca = rig.serve_ca(stop.clone()).await?;
    let xds: SocketAddr = format!("127.0.0.1:{}", free_port()).parse()?;
    let _served = rig.serve_discovery(xds, stop.clone()).await?;
    // The servers take their certificates from the CA and serve a static
    // inbound; the client takes its configuration from discovery too.
    let certified = Upstreams {
        discovery: None,
        ca: Some(ca),
    };
    let discovered = Upstreams {
        discovery: Some(xds),
        ca: Some(ca),
    };
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let server_app = NamedBackend::start(any, "server-0").await?;
    let impostor_app = NamedBackend::start(any, "impostor-0").await?;
    let (server_in, impostor_in, listen) = (free_port(), free_port(), free_port());

    // What the watches would bring: cart declares `server`; its two slices
    // name server-0 and impostor-0, both meshed on their inbound ports.
    rig.discovery.update(|r| {
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
        &rig,
        &certified,
        "server-0",
        "server",
        2,
        &[format!("--inbound={server_in}:{}", server_app.addr.port())],
    )?;
    let mut impostor = Sidecar::start(
        &rig,
        &certified,
        "impostor-0",
        "impostor",
        3,
        &[format!(
            "--inbound={impostor_in}:{}",
            impostor_app.addr.port()
        )],
    )?;
    let mut client = Sidecar::start(
        &rig,
        &discovered,
        "client-0",
        "web",
        1,
        &[format!("--outbound={listen}:cart.shop:80")],
    )?;
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
    rig.discovery
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
    rig.discovery.update(|r| {
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
    stop.cancel();
    Ok(())
}
