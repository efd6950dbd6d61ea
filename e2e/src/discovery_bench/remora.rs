//! Remora's discovery server as a process of its own (so its CPU and
//! memory are its own, as istiod's are): the operator library's server,
//! registry and debounce at the operator's defaults, fed by real watches
//! (Services, EndpointSlices, pods) of the API server the kubeconfig
//! names. Two stand-ins, both named here:
//! - the proxies are not pods: they are put in the registry directly, as
//!   the pod watch would put injected pods that declared `shared`, one
//!   Service each and `rollout` in `remora.dev/outbound` (the callee pods
//!   of the withdrawal measurement are real pods, read by the pod watch);
//! - TokenReview is [`TokenReviewDouble`]: every proxy shows the same token.
//!
//! The bench runs this file's [`serve`] in a child (`--serve-remora DIR`)
//! and finds its address and CA bundle in DIR.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use remora_contract::discovery::TOKEN_AUDIENCE;
use remora_operator::cluster::live_pod;
use remora_operator::discovery::Metrics;
use remora_operator::discovery::feed::{self, Watches};
use remora_operator::discovery::push::{Debounce, Discovery};
use remora_operator::discovery::registry::{PodKey, ProxyInfo};
use remora_operator::discovery::serve::{limits, serve as serve_ads};
use remora_operator::discovery::server::{AdsService, POD_WAIT};
use remora_operator::pki::workload_ca::authn::{AuthError, Authenticate, Caller, Gate, GateLimits};
use remora_operator::pki::workload_ca::{ServingCert, testing};
use remora_test_support::jwt;
use tokio_util::sync::CancellationToken;

use super::proxy::{Identity, REMORA_SERVER_NAME};

/// The token's expiry (far ahead: the double checks nothing else).
const EXP: u64 = 4_000_000_000;
/// The ServiceAccount every proxy runs as.
pub const SERVICE_ACCOUNT: &str = "web";

#[derive(Debug, thiserror::Error)]
pub enum RemoraError {
    #[error("the kube client: {0}")]
    Client(kube::Error),
    #[error("the kubeconfig: {0}")]
    Config(String),
    #[error("the bench's CA: {0}")]
    Ca(String),
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    #[error("serving: {0}")]
    Serve(String),
    #[error("the Remora server did not write {0} in {1:?}; its log ends with:\n{2}")]
    NotReady(PathBuf, Duration, String),
    #[error("the Remora server exited ({0}); its log ends with:\n{1}")]
    Exited(String, String),
    #[error("starting the Remora server: {0}")]
    Start(crate::controlplane::Error),
}

/// The token every simulated proxy shows.
pub fn token() -> String {
    jwt::service_account(TOKEN_AUDIENCE, EXP, 1)
}

/// Stand-in for the API server's TokenReview: [`token`] is a
/// ServiceAccount of the bench's namespace, not bound to a pod.
struct TokenReviewDouble {
    namespace: String,
}

impl Authenticate for TokenReviewDouble {
    async fn authenticate(&self, token: &str) -> Result<Caller, AuthError> {
        if token != self::token() {
            return Err(AuthError::Rejected("unknown token".into()));
        }
        Ok(Caller {
            namespace: self.namespace.clone(),
            service_account: SERVICE_ACCOUNT.into(),
            pod: None,
        })
    }
}

/// What the child serves.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The proxies and the Services each declared.
    pub proxies: Vec<(Identity, Vec<String>)>,
    /// Where it writes `addr` and `bundle.pem` once it serves.
    pub dir: PathBuf,
    /// The API server to watch (the bench's `--kubeconfig`).
    pub kubeconfig: PathBuf,
}

/// A client of the API server `kubeconfig` names.
async fn client(kubeconfig: &Path) -> Result<kube::Client, RemoraError> {
    use kube::config::{Config, KubeConfigOptions, Kubeconfig};
    let kc = Kubeconfig::read_from(kubeconfig).map_err(|e| RemoraError::Config(e.to_string()))?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(|e| RemoraError::Config(e.to_string()))?;
    kube::Client::try_from(config).map_err(RemoraError::Client)
}

/// Run the server until killed (the child's whole life).
pub async fn serve(plan: Plan) -> Result<(), RemoraError> {
    let client = client(&plan.kubeconfig).await?;
    let stop = CancellationToken::new();
    // The workload CA's serving certificate, as the operator has it.
    let authority = testing::authority(&[REMORA_SERVER_NAME]).map_err(RemoraError::Ca)?;
    let bundle = authority.bundle.clone();
    let (_authority_tx, authority_rx) = tokio::sync::watch::channel(Some(Arc::new(authority)));

    // Plain text between the workloads (no trust domain): the endpoints
    // here name no pods, so with the mesh on each would only carry a mark.
    let (discovery, debouncer) = Discovery::new("cluster.local", None, Debounce::default());
    tokio::spawn(debouncer);
    let pods = live_pod::live_pods(client.clone(), live_pod::Metrics::default(), stop.clone());
    // The external-service CRDs are watched when served, as the operator does.
    let externals = feed::externals_served(&client).await;
    let watches = Watches::start(&client, pods, externals, stop.clone());
    watches.feed(&discovery);
    watches.synced().await;
    discovery.update(|r| {
        let mut t = Vec::new();
        for (who, services) in &plan.proxies {
            let outbound: Vec<String> = services
                .iter()
                .enumerate()
                .map(|(k, s)| format!("{}:{s}.{}:80", 15001 + k, who.namespace))
                .collect();
            t.extend(r.apply_proxy(
                PodKey {
                    namespace: who.namespace.clone(),
                    name: who.pod(),
                },
                ProxyInfo {
                    ip: Some(who.ip.to_string()),
                    service_account: SERVICE_ACCOUNT.into(),
                    outbound: Some(outbound.join(",").into()),
                    ..Default::default()
                },
            ));
        }
        t
    });
    let namespace = plan
        .proxies
        .first()
        .map(|(w, _)| w.namespace.clone())
        .unwrap_or_default();
    let svc = AdsService {
        auth: TokenReviewDouble { namespace },
        gate: Gate::new(TOKEN_AUDIENCE, GateLimits::default()),
        discovery,
        metrics: Metrics::default(),
        events: None,
        shutdown: stop.clone(),
        // As the operator waits: a callee pod's subscriber may come before
        // the pod watch brings its pod.
        pod_wait: POD_WAIT,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| RemoraError::Io("binding".into(), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| RemoraError::Io("its address".into(), e))?;
    let write = |name: &str, text: &str| {
        let path = plan.dir.join(name);
        let tmp = plan.dir.join(format!("{name}.tmp"));
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| RemoraError::Io(format!("writing {}", path.display()), e))
    };
    write("bundle.pem", &bundle)?;
    // Last: its presence says the server is ready.
    write("addr", &addr.to_string())?;
    serve_ads(
        listener,
        svc,
        Arc::new(ServingCert(authority_rx)),
        limits(),
        stop,
    )
    .await
    .map_err(|e| RemoraError::Serve(e.to_string()))
}

/// The child, seen from the bench.
pub struct RemoraProcess {
    proc: crate::controlplane::process::Proc,
    dir: PathBuf,
    pub addr: SocketAddr,
    pub bundle: Arc<String>,
}

impl RemoraProcess {
    /// Start `exe --serve-remora DIR <args>` and wait (up to two minutes)
    /// for it to serve.
    pub async fn start(
        exe: &Path,
        args: &[String],
        dir: &Path,
        janitor: &mut crate::controlplane::process::Janitor,
    ) -> Result<Self, RemoraError> {
        let mut all = vec!["--serve-remora".to_string(), dir.display().to_string()];
        all.extend_from_slice(args);
        let mut proc = crate::controlplane::process::Proc::spawn_with_env(
            "remora-discovery",
            exe,
            &all,
            &[],
            dir,
        )
        .map_err(RemoraError::Start)?;
        janitor.watch(proc.pid()).map_err(RemoraError::Start)?;
        let addr_file = dir.join("addr");
        let limit = Duration::from_secs(120);
        let deadline = Instant::now() + limit;
        let addr = loop {
            if let Some(status) = proc.exited() {
                return Err(RemoraError::Exited(status.to_string(), proc.log_tail()));
            }
            if let Some(a) = std::fs::read_to_string(&addr_file)
                .ok()
                .and_then(|s| s.trim().parse().ok())
            {
                break a;
            }
            if Instant::now() > deadline {
                return Err(RemoraError::NotReady(addr_file, limit, proc.log_tail()));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let bundle = std::fs::read_to_string(dir.join("bundle.pem"))
            .map_err(|e| RemoraError::Io("reading bundle.pem".into(), e))?;
        Ok(Self {
            proc,
            dir: dir.to_path_buf(),
            addr,
            bundle: Arc::new(bundle),
        })
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// The child's live heap (MiB) as it last wrote it ([`super::HEAP_FILE`]).
    pub fn heap_mib(&self) -> Option<f64> {
        self.heap_bytes().map(|b| b as f64 / 1_048_576.0)
    }

    /// The child's live heap (bytes) as it last wrote it.
    pub fn heap_bytes(&self) -> Option<u64> {
        std::fs::read_to_string(self.dir.join(super::HEAP_FILE))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    pub fn stop(&mut self) {
        self.proc.stop(Duration::from_secs(5));
    }
}

impl Drop for RemoraProcess {
    fn drop(&mut self) {
        self.stop();
    }
}
