//! The loopback rig of the discovery tests (`delta_xds`, `inbound_xds`,
//! `secure_naming`): the operator's discovery server (and, if asked, its
//! workload CA) in this process with a TokenReview double, a registry the
//! test feeds directly, and `remora-agent run` sidecars with the real Envoy
//! pointed at them. No node, no API server.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use remora_contract::discovery::ServiceHost;
use remora_contract::discovery::TOKEN_AUDIENCE as DISCOVERY_AUDIENCE;
use remora_contract::workload_ca::TOKEN_AUDIENCE as CA_AUDIENCE;
use remora_operator::discovery::Metrics;
use remora_operator::discovery::push::{Debounce, Discovery};
use remora_operator::discovery::registry::{Protocol, ServiceInfo, ServicePort};
use remora_operator::discovery::server::{AdsService, POD_WAIT};
use remora_operator::pki::workload_ca::authn::{AuthError, Authenticate, Caller, Gate, GateLimits};
use remora_operator::pki::workload_ca::service::{CaService, Lifetimes};
use remora_operator::pki::workload_ca::{Authority, ServingCert, testing};
use remora_test_support::jwt;
use remora_test_support::ports::free_port;
use remora_test_support::wait::{Timeout, wait_until};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The name the served certificates carry and the sidecars check.
pub const SERVER_NAME: &str = "remora-operator.remora-system.svc";
/// The namespace of every workload of the rig.
pub const NS: &str = "shop";
/// The expiry of the rig's tokens (far off).
const EXP: u64 = 4_000_000_000;
/// Service `name` in the rig's namespace.
pub fn host(name: &str) -> ServiceHost {
    ServiceHost {
        name: name.into(),
        namespace: NS.into(),
    }
}

/// A Service with one HTTP port, 80.
pub fn http_service() -> ServiceInfo {
    ServiceInfo {
        ports: vec![ServicePort {
            port: 80,
            name: "http".into(),
            protocol: Protocol::Http,
        }],
        ..Default::default()
    }
}

/// How long a sidecar may take to become ready.
pub const READY_DEADLINE: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum RigError {
    #[error("the test authority: {0}")]
    Authority(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Bin(String),
    #[error("{what} not ready within {READY_DEADLINE:?}:\n{log}")]
    NotReady { what: String, log: String },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> RigError {
    let what = what.into();
    move |source| RigError::Io { what, source }
}

/// The API server's TokenReview as a table: the token of nonce `n` (of
/// either audience) is service account `accounts[n]`'s in [`NS`].
#[derive(Debug, Clone)]
pub struct Reviewer {
    accounts: Vec<(u64, String)>,
}

impl Reviewer {
    pub fn new(accounts: &[(u64, &str)]) -> Self {
        Self {
            accounts: accounts.iter().map(|&(n, sa)| (n, sa.to_owned())).collect(),
        }
    }
}

impl Authenticate for Reviewer {
    async fn authenticate(&self, token: &str) -> Result<Caller, AuthError> {
        for (nonce, sa) in &self.accounts {
            for aud in [CA_AUDIENCE, DISCOVERY_AUDIENCE] {
                if token == jwt::service_account(aud, EXP, *nonce) {
                    return Ok(Caller {
                        namespace: NS.into(),
                        service_account: sa.clone(),
                        pod: None,
                    });
                }
            }
        }
        Err(AuthError::Rejected("invalid bearer token".into()))
    }
}

/// The control-plane side: a registry, its push metrics and a CA whose
/// certificate the servers present.
pub struct Rig {
    pub discovery: Arc<Discovery>,
    pub metrics: Metrics,
    /// The root the sidecars trust (PEM).
    pub bundle: String,
    reviewer: Reviewer,
    certs: watch::Receiver<Option<Arc<Authority>>>,
    _certs_tx: watch::Sender<Option<Arc<Authority>>>,
}

impl Rig {
    /// A registry for `cluster.local` (`spiffe` names it for secure naming)
    /// with a quick debounce, the authority, and `reviewer` for both servers.
    pub fn new(reviewer: Reviewer, spiffe: Option<&str>) -> Result<Self, RigError> {
        let authority = testing::authority(&[SERVER_NAME]).map_err(RigError::Authority)?;
        let bundle = authority.bundle.clone();
        let (certs_tx, certs) = watch::channel(Some(Arc::new(authority)));
        let (discovery, debounce) = Discovery::new(
            "cluster.local",
            spiffe,
            Debounce {
                quiet: Duration::from_millis(10),
                max_delay: Duration::from_millis(50),
            },
        );
        tokio::spawn(debounce);
        Ok(Self {
            discovery,
            metrics: Metrics::default(),
            bundle,
            reviewer,
            certs,
            _certs_tx: certs_tx,
        })
    }

    /// Another operator replica: a registry of its own (fed alike by the
    /// test, as each replica's watches feed it), the same authority and
    /// reviewer.
    pub fn another_replica(&self) -> Self {
        let (certs_tx, certs) = watch::channel(self.certs.borrow().clone());
        let (discovery, debounce) = Discovery::new(
            "cluster.local",
            self.discovery.trust_domain.as_deref(),
            Debounce {
                quiet: Duration::from_millis(10),
                max_delay: Duration::from_millis(50),
            },
        );
        tokio::spawn(debounce);
        Self {
            discovery,
            metrics: Metrics::default(),
            bundle: self.bundle.clone(),
            reviewer: self.reviewer.clone(),
            certs,
            _certs_tx: certs_tx,
        }
    }

    /// The discovery server on `addr` until `stop`; the task ends when the
    /// server has (and panics if it failed).
    pub async fn serve_discovery(
        &self,
        addr: SocketAddr,
        stop: CancellationToken,
    ) -> Result<JoinHandle<()>, RigError> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(io(format!("binding the discovery server to {addr}")))?;
        let ads = AdsService {
            auth: self.reviewer.clone(),
            gate: Gate::new(DISCOVERY_AUDIENCE, GateLimits::default()),
            discovery: Arc::clone(&self.discovery),
            metrics: self.metrics.clone(),
            events: None,
            shutdown: stop.clone(),
            pod_wait: POD_WAIT,
        };
        let certs = Arc::new(ServingCert(self.certs.clone()));
        Ok(tokio::spawn(async move {
            let served = remora_operator::discovery::serve::serve(
                listener,
                ads,
                certs,
                remora_operator::discovery::serve::limits(),
                stop,
            )
            .await;
            served.expect("discovery served");
        }))
    }

    /// The workload CA on a loopback port of its own until `stop`.
    pub async fn serve_ca(&self, stop: CancellationToken) -> Result<SocketAddr, RigError> {
        let ca = CaService {
            auth: self.reviewer.clone(),
            gate: Gate::new(CA_AUDIENCE, GateLimits::default()),
            authority: self.certs.clone(),
            trust_domain: "cluster.local".into(),
            lifetimes: Lifetimes {
                default: Duration::from_secs(3600),
                max: Duration::from_secs(3600),
            },
            metrics: remora_operator::pki::workload_ca::Metrics::default(),
            events: None,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(io("binding the CA"))?;
        let addr = listener.local_addr().map_err(io("the CA's address"))?;
        tokio::spawn(async move {
            let limits = remora_operator::pki::workload_ca::serve::Limits::default();
            let served =
                remora_operator::pki::workload_ca::serve::serve(listener, ca, limits, stop).await;
            served.expect("the CA served");
        });
        Ok(addr)
    }
}

/// Where a sidecar gets its configuration and certificates.
#[derive(Debug, Clone, Default)]
pub struct Upstreams {
    /// The discovery server (`--discovery-address`).
    pub discovery: Option<SocketAddr>,
    /// The workload CA (`--ca-address`).
    pub ca: Option<SocketAddr>,
}

/// A sidecar: `remora-agent run` with the settings the injector gives a
/// pod of [`NS`], its files (tokens, root, run dir, log) in a directory of
/// its own.
pub struct Sidecar {
    pub child: Child,
    pub health: u16,
    pub envoy_admin: u16,
    pub agent_admin: u16,
    dir: tempfile::TempDir,
}

impl Sidecar {
    /// Starts the agent for `pod` of `service_account`, whose tokens carry
    /// `nonce` (see [`Reviewer`]); `extra` flags go last.
    pub fn start(
        rig: &Rig,
        upstreams: &Upstreams,
        pod: &str,
        service_account: &str,
        nonce: u64,
        extra: &[String],
    ) -> Result<Self, RigError> {
        let dir = tempfile::tempdir().map_err(io("a sidecar directory"))?;
        let write = |name: &str, text: &str| -> Result<String, RigError> {
            let path = dir.path().join(name);
            std::fs::write(&path, text).map_err(io(format!("writing {}", path.display())))?;
            Ok(path.display().to_string())
        };
        let root = write("root-cert.pem", &rig.bundle)?;
        let xds_token = write(
            "xds-token",
            &jwt::service_account(DISCOVERY_AUDIENCE, EXP, nonce),
        )?;
        let (health, envoy_admin, agent_admin) = (free_port(), free_port(), free_port());
        let log_path = dir.path().join("agent.log");
        let log = std::fs::File::create(&log_path).map_err(io("the agent's log"))?;
        let log_too = log.try_clone().map_err(io("the agent's log"))?;
        let agent = crate::operator::agent_bin().map_err(|e| RigError::Bin(e.to_string()))?;
        let envoy =
            remora_test_support::bins::envoy_bin().map_err(|e| RigError::Bin(e.to_string()))?;
        let mut cmd = Command::new(agent);
        cmd.arg("run")
            .arg(format!("--envoy-bin={}", envoy.display()))
            .arg(format!("--run-dir={}", dir.path().join("run").display()))
            .arg(format!(
                "--annotations-file={}",
                dir.path().join("annotations").display()
            ))
            .args(["--health-address=127.0.0.1", "--concurrency=1"])
            .arg(format!("--health-port={health}"))
            .arg(format!("--envoy-admin-port={envoy_admin}"))
            .arg(format!("--admin-port={agent_admin}"))
            .arg(format!("--stats-port={}", free_port()))
            .arg(format!("--pod-name={pod}"))
            .arg(format!("--pod-namespace={NS}"))
            .arg(format!("--service-account={service_account}"))
            .arg("--instance-ip=127.0.0.1")
            .arg(format!("--ca-root-cert={root}"))
            .arg(format!("--discovery-token-path={xds_token}"));
        if let Some(addr) = upstreams.discovery {
            cmd.arg(format!("--discovery-address={addr}"))
                .arg(format!("--discovery-server-name={SERVER_NAME}"));
        }
        if let Some(addr) = upstreams.ca {
            let ca_token = write("ca-token", &jwt::service_account(CA_AUDIENCE, EXP, nonce))?;
            cmd.arg(format!("--ca-address={addr}"))
                .arg(format!("--ca-server-name={SERVER_NAME}"))
                .arg(format!("--token-path={ca_token}"));
        }
        let child = cmd
            .args(extra)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .stdin(Stdio::null())
            .stdout(log_too)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(io("starting the agent"))?;
        Ok(Self {
            child,
            health,
            envoy_admin,
            agent_admin,
            dir,
        })
    }

    /// The agent's run directory (its admin token, Envoy's files).
    pub fn run_dir(&self) -> PathBuf {
        self.dir.path().join("run")
    }

    /// What the agent (and its Envoy) logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    /// Waits until the sidecar reports ready; if it does not in time, stops
    /// it and fails with its log.
    pub async fn ready(&mut self, what: &str) -> Result<(), RigError> {
        let health = self.health;
        let ready: Result<(), Timeout> =
            wait_until(READY_DEADLINE, &format!("{what} ready"), || async move {
                get(health, "/healthz/ready")
                    .await
                    .is_some_and(|(s, _)| s == 200)
            })
            .await;
        if ready.is_err() {
            let _ = self.child.start_kill();
            return Err(RigError::NotReady {
                what: what.to_owned(),
                log: self.log(),
            });
        }
        Ok(())
    }
}

/// One HTTP/1.1 GET to `127.0.0.1:port` for host `cart.shop` on a
/// connection of its own (never retried): the status and the raw
/// response, `None` when nothing answered.
pub async fn get(port: u16, path: &str) -> Option<(u16, String)> {
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

/// A counter or gauge of an Envoy's `/stats` on admin port `admin`, 0 when
/// absent.
pub async fn stat(admin: u16, name: &str) -> u64 {
    let body = get(admin, "/stats").await.map(|r| r.1).unwrap_or_default();
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The app containers' preStop hook as the kubelet runs it (what
/// `remora-prestop` does): POST the agent's app hook with the token of the
/// endpoint file in `hook_dir` (the sidecar's `--hook-dir`). Answers once
/// the agent lets the app stop: the status and the raw response, `None`
/// when the file or the agent is not there.
pub async fn app_prestop(hook_dir: &std::path::Path) -> Option<(u16, String)> {
    use remora_contract::pod::{APP_PRESTOP_PATH, HOOK_ENDPOINT_FILE};
    let text = std::fs::read_to_string(hook_dir.join(HOOK_ENDPOINT_FILE)).ok()?;
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k))
            .map(str::to_owned)
    };
    let (addr, token) = (field("addr=")?, field("token=")?);
    let mut s = tokio::net::TcpStream::connect(addr.as_str()).await.ok()?;
    let req = format!(
        "POST {APP_PRESTOP_PATH} HTTP/1.1\r\nHost: agent\r\nAuthorization: Bearer {token}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.ok()?;
    let mut out = String::new();
    // Bounded by the agent's drain deadline; this only guards the test.
    tokio::time::timeout(Duration::from_secs(60), s.read_to_string(&mut out))
        .await
        .ok()?
        .ok()?;
    let status = out.split(' ').nth(1)?.parse().ok()?;
    Some((status, out))
}

impl Sidecar {
    /// What the agent's `/debug/config` shows of its Envoy (epoch, pid,
    /// restarts), `None` when the agent did not answer.
    pub async fn envoy_state(&self) -> Option<serde_json::Value> {
        let (_, raw) = get(self.agent_admin, "/debug/config").await?;
        let body = raw.split("\r\n\r\n").nth(1)?;
        let mut v: serde_json::Value = serde_json::from_str(body.trim()).ok()?;
        Some(v["envoy"].take())
    }

    /// The pid of the agent's Envoy, from the agent's `/debug/config`.
    pub async fn envoy_pid(&self) -> Option<i32> {
        i32::try_from(self.envoy_state().await?["pid"].as_u64()?).ok()
    }

    /// A line of the agent's `/metrics` that starts with `prefix`, its
    /// value (0 when absent).
    pub async fn metric(&self, prefix: &str) -> f64 {
        let body = get(self.agent_admin, "/metrics")
            .await
            .map(|r| r.1)
            .unwrap_or_default();
        body.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    }
}
