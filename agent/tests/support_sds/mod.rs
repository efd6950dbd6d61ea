//! Shared helpers of the SDS tests and benchmark: the agent's certificate
//! files, a real Envoy with an inbound mTLS listener fed by SDS, a TLS
//! client, an echo app, and an Istio-CA test double. The PKI, ports and
//! waiting come from remora-test-support.
#![allow(dead_code, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use remora_agent::sds::bootstrap;
pub use remora_test_support::pki::{Ca, Leaf, serial_of};
pub use remora_test_support::wait::wait_until;
use remora_test_support::wait::{Check, Wait};
use rustls::pki_types::ServerName;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

pub const DEADLINE: Duration = Duration::from_secs(20);

// ---------- PKI ----------

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

/// The files a Kubernetes Secret volume holds, swapped in the way the
/// kubelet does (`..data` symlink).
pub fn k8s_swap(dir: &Path, leaf: &Leaf, root_pem: &str) {
    remora_test_support::kubelet::atomic_write(
        dir,
        [
            ("cert-chain.pem", leaf.chain.as_str()),
            ("key.pem", leaf.key.as_str()),
            ("root-cert.pem", root_pem),
        ],
    )
    .unwrap();
}

// ---------- Envoy ----------

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
    /// Envoy in `dir` with an inbound mTLS listener on a free port, fed by
    /// the SDS server on `socket`, in front of a fresh [`echo_server`].
    pub async fn start_inbound(dir: &Path, socket: &Path) -> Result<Self> {
        let app = echo_server().await;
        let port = remora_test_support::ports::free_port();
        Self::start(dir, &bootstrap_json(port, app, socket, &[]), port).await
    }

    pub async fn start(dir: &Path, bootstrap: &Value, listener_port: u16) -> Result<Self> {
        let cfg = dir.join("envoy.json");
        std::fs::write(&cfg, serde_json::to_vec_pretty(bootstrap)?)?;
        let addr_file = dir.join("admin-address");
        let log = std::fs::File::create(dir.join("envoy.log"))?;
        let child = Command::new(remora_test_support::bins::envoy_bin()?)
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
        let admin = wait_until(DEADLINE, "Envoy admin address", || {
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
    TlsConnector::from(remora_test_support::pki::client_config(root_pem, Some(leaf)).unwrap())
}

/// Connect to `localhost:port` and handshake. Returns the stream and the
/// serial of the certificate the server presented.
pub async fn connect_tls(port: u16, tls: &TlsConnector) -> Result<(TlsStream<TcpStream>, String)> {
    let tcp = TcpStream::connect(("127.0.0.1", port)).await?;
    // Without this, Nagle + delayed ACK add ~40 ms to the TLS 1.3 client-auth flight.
    tcp.set_nodelay(true)?;
    let s = tls.connect(ServerName::try_from("localhost")?, tcp).await?;
    let serial = s
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| serial_of(c))
        .ok_or_else(|| anyhow!("no peer certificate"))?;
    Ok((s, serial))
}

/// Connect, handshake, and echo one message. Returns the stream and the
/// serial of the certificate Envoy presented.
pub async fn roundtrip(port: u16, tls: &TlsConnector) -> Result<(TlsStream<TcpStream>, String)> {
    let fut = async {
        let (mut s, serial) = connect_tls(port, tls).await?;
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
    let what = format!("Envoy to present serial {serial}");
    Wait::new(DEADLINE, &what)
        .every(Duration::from_millis(5))
        .until(|| async {
            match roundtrip(port, tls).await {
                Ok((_, s)) if s == serial => Check::Done(()),
                Ok((_, s)) => Check::NotYet(format!("serial {s}")),
                Err(e) => Check::NotYet(format!("error: {e}")),
            }
        })
        .await?;
    Ok(())
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
        /// Sent as the CA's trust bundle (response metadata), as Remora's
        /// CA does; `None`: none, as Istio's.
        pub trust_bundle: Arc<Mutex<Option<String>>>,
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
            // A `localhost` DNS SAN too, so test clients can verify the server.
            let leaf = ca
                .sign_csr(&r.csr, ttl, &["localhost"])
                .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?;
            let mut resp = tonic::Response::new(IstioCertificateResponse {
                cert_chain: vec![leaf, ca.pem.clone()],
            });
            if let Some(b) = self.trust_bundle.lock().unwrap().clone() {
                resp.metadata_mut().insert_bin(
                    remora_contract::workload_ca::TRUST_BUNDLE_METADATA,
                    tonic::metadata::BinaryMetadataValue::from_bytes(b.as_bytes()),
                );
            }
            Ok(resp)
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
            let serving_ca = Ca::new("ca-serving-root");
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
