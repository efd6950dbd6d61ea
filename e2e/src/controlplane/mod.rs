//! A real Kubernetes control plane for end-to-end tests: etcd, kube-apiserver
//! and kube-controller-manager on 127.0.0.1, started the way controller-runtime's
//! envtest does it (fresh certificates, free ports, a temporary data dir).
//! Certificates, kubeconfigs and flags come from `scripts/lib/controlplane.sh`,
//! which `scripts/cluster.sh` starts the node's control plane with ([`pki`]).
//!
//! There is no scheduler and no kubelet: pods are accepted and stay `Pending`
//! unless a test plays the kubelet's part. Binaries come from
//! `scripts/build-k8s.sh`; `REMORA_E2E_KUBECONFIG` points the same tests at an
//! existing cluster (kind) instead. See `e2e/README.md`.

pub mod kubelet;
pub mod pki;
pub mod process;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{DeleteParams, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use remora_test_support::wait::{Check, Timeout, Wait};
use tokio::sync::OnceCell;

pub use kubelet::FakeKubelet;
pub use pki::PkiFiles;
use process::{Janitor, Proc};

/// The Kubernetes release `scripts/build-k8s.sh` builds (a test checks).
pub const K8S_VERSION: &str = "v1.36.3";
/// The etcd release `scripts/build-k8s.sh` builds (a test checks).
pub const ETCD_VERSION: &str = "v3.6.16";

/// Directory holding `kube-apiserver` and `kube-controller-manager`.
pub const ENV_K8S_BIN_DIR: &str = "REMORA_K8S_BIN_DIR";
/// Path of the `etcd` binary.
pub const ENV_ETCD_BIN: &str = "REMORA_ETCD_BIN";
/// Root of the build cache (default `$HOME/.cache/remora`).
pub const ENV_CACHE: &str = "REMORA_CACHE";
/// Kubeconfig of an existing cluster to test against instead of a local one.
pub const ENV_KUBECONFIG: &str = "REMORA_E2E_KUBECONFIG";
/// Context to use from `REMORA_E2E_KUBECONFIG` (default: its current context).
pub const ENV_CONTEXT: &str = "REMORA_E2E_CONTEXT";
/// `1`: keep the local control plane's directory (logs, certs, etcd data).
pub const ENV_KEEP: &str = "REMORA_E2E_KEEP";

/// The label on every namespace the harness creates, for bulk cleanup on a
/// real cluster: `kubectl delete ns -l remora.dev/e2e=true`.
pub const NAMESPACE_LABEL: (&str, &str) = ("remora.dev/e2e", "true");

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what} not found at {path}: run scripts/build-k8s.sh, or set {env}")]
    MissingBinary {
        what: &'static str,
        path: PathBuf,
        env: &'static str,
    },
    #[error("neither {ENV_CACHE} nor HOME is set: cannot find the binaries' cache")]
    NoCacheDir,
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("kubeconfig: {0}")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("building a request: {0}")]
    Http(#[from] http::Error),
    #[error("{name} exited during startup ({status}); its log ends with:\n{log}")]
    Exited {
        name: &'static str,
        status: String,
        log: String,
    },
    #[error("kube-apiserver not ready after {timeout:?} (last: {last}); its log ends with:\n{log}")]
    NotReady {
        timeout: Duration,
        last: String,
        log: String,
    },
    #[error("pod {pod} has no container {container} in its status")]
    NoSuchContainer { pod: String, container: String },
    #[error(transparent)]
    Timeout(#[from] Timeout),
    #[error("the shared control plane failed to start: {0}")]
    Shared(Arc<Error>),
    #[error("{0} has no namespace or name")]
    Unnamed(&'static str),
    #[error("TokenRequest for ServiceAccount {0} returned no token")]
    NoToken(String),
    #[error("scripts/lib/controlplane.sh {function} failed ({status}): {stderr}")]
    Launcher {
        function: String,
        status: String,
        stderr: String,
    },
}

impl Error {
    fn io(context: String, source: std::io::Error) -> Self {
        Self::Io { context, source }
    }
}

/// The binaries a local control plane runs.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub etcd: PathBuf,
    pub kube_apiserver: PathBuf,
    pub kube_controller_manager: PathBuf,
}

impl Binaries {
    /// `$REMORA_K8S_BIN_DIR` and `$REMORA_ETCD_BIN`, else the cache that
    /// `scripts/build-k8s.sh` fills. Fails, naming the script, when a binary
    /// is missing: a missing control plane must not silently skip tests.
    pub fn locate() -> Result<Self, Error> {
        let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
        let cache = || -> Result<PathBuf, Error> {
            env(ENV_CACHE)
                .map(PathBuf::from)
                .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".cache/remora")))
                .ok_or(Error::NoCacheDir)
        };
        let k8s_dir = match env(ENV_K8S_BIN_DIR) {
            Some(d) => PathBuf::from(d),
            None => cache()?.join("k8s").join(K8S_VERSION).join("bin"),
        };
        let etcd = match env(ENV_ETCD_BIN) {
            Some(p) => PathBuf::from(p),
            None => cache()?.join("etcd").join(ETCD_VERSION).join("bin/etcd"),
        };
        let bins = Self {
            kube_apiserver: k8s_dir.join("kube-apiserver"),
            kube_controller_manager: k8s_dir.join("kube-controller-manager"),
            etcd,
        };
        for (what, path, env) in [
            ("etcd", &bins.etcd, ENV_ETCD_BIN),
            ("kube-apiserver", &bins.kube_apiserver, ENV_K8S_BIN_DIR),
            (
                "kube-controller-manager",
                &bins.kube_controller_manager,
                ENV_K8S_BIN_DIR,
            ),
        ] {
            if !path.is_file() {
                return Err(Error::MissingBinary {
                    what,
                    path: path.clone(),
                    env,
                });
            }
        }
        Ok(bins)
    }
}

/// How to start a local control plane.
#[derive(Debug, Clone)]
pub struct Options {
    /// Also run kube-controller-manager (Deployments get ReplicaSets and Pods).
    pub controller_manager: bool,
    /// Deadline for `/readyz` (and for the controller manager's first work).
    pub start_timeout: Duration,
    /// Extra `--flag=value` arguments for kube-apiserver (e.g. feature gates).
    pub apiserver_args: Vec<String>,
}

impl Options {
    /// A control plane whose workloads get no pods but the test's own: for
    /// tests that create a workload's pods themselves, or whose objects
    /// kube-controller-manager would race.
    pub fn without_controller_manager() -> Self {
        Self {
            controller_manager: false,
            ..Self::default()
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Self {
            controller_manager: true,
            // A cold kube-apiserver on 2 busy cores takes 10-20 s to be ready.
            start_timeout: Duration::from_secs(120),
            apiserver_args: Vec::new(),
        }
    }
}

/// A cluster to test against: a local control plane this process started,
/// or an existing cluster from `REMORA_E2E_KUBECONFIG`.
#[derive(Debug)]
pub struct ControlPlane {
    config: Config,
    kubeconfig: PathBuf,
    local: Option<Local>,
}

#[derive(Debug)]
struct Local {
    dir: PathBuf,
    pki: PkiFiles,
    /// In start order; stopped in reverse.
    procs: Vec<Proc>,
    janitor: Janitor,
    controller_manager: bool,
}

static SHARED: OnceCell<Result<ControlPlane, Arc<Error>>> = OnceCell::const_new();

impl ControlPlane {
    /// The test binary's one control plane, started on first use (with the
    /// controller manager), or the cluster of `REMORA_E2E_KUBECONFIG`.
    ///
    /// It lives in a `static`, never dropped: its processes are killed and
    /// its directory removed by the janitor when the test process exits.
    /// Make a new [`Client`] per test with [`ControlPlane::client`]: a client
    /// belongs to the tokio runtime that made it, and each `#[tokio::test]`
    /// has its own.
    pub async fn shared() -> Result<&'static ControlPlane, Error> {
        Self::shared_with(Options::default()).await
    }

    /// As [`ControlPlane::shared`], started with `options` if this is the
    /// first use in the test binary (a binary whose tests need no
    /// kube-controller-manager, or must not have one acting on their objects).
    pub async fn shared_with(options: Options) -> Result<&'static ControlPlane, Error> {
        let cp = SHARED
            .get_or_init(|| async {
                match std::env::var_os(ENV_KUBECONFIG).filter(|v| !v.is_empty()) {
                    Some(path) => Self::external(PathBuf::from(path)).await,
                    None => Self::start(options).await,
                }
                .map_err(Arc::new)
            })
            .await;
        cp.as_ref().map_err(|e| Error::Shared(e.clone()))
    }

    /// Uses an existing cluster through its kubeconfig (context from
    /// `REMORA_E2E_CONTEXT`, else the current one).
    pub async fn external(kubeconfig: PathBuf) -> Result<Self, Error> {
        let kc = Kubeconfig::read_from(&kubeconfig)?;
        let options = KubeConfigOptions {
            context: std::env::var(ENV_CONTEXT).ok().filter(|c| !c.is_empty()),
            ..KubeConfigOptions::default()
        };
        let config = Config::from_custom_kubeconfig(kc, &options).await?;
        // Fail here, with the kubeconfig named, rather than in every test.
        Client::try_from(config.clone())?
            .apiserver_version()
            .await?;
        Ok(Self {
            config,
            kubeconfig,
            local: None,
        })
    }

    /// Starts a local control plane owned by the caller; dropping it stops it.
    /// Retries when a component dies at startup, which is how losing a race
    /// for a "free" port shows.
    pub async fn start(options: Options) -> Result<Self, Error> {
        let bins = Binaries::locate()?;
        let mut attempt = 1;
        loop {
            match Self::start_once(&bins, &options).await {
                Err(Error::Exited { .. }) if attempt < 3 => attempt += 1,
                r => return r,
            }
        }
    }

    async fn start_once(bins: &Binaries, options: &Options) -> Result<Self, Error> {
        let keep = std::env::var(ENV_KEEP).is_ok_and(|v| v == "1");
        let dir = tempfile::Builder::new()
            .prefix("remora-cp-")
            .tempdir()
            .map_err(|e| Error::io("creating a temp dir".to_owned(), e))?
            .keep();
        // The janitor first, so that whatever happens next is cleaned up.
        let janitor = Janitor::spawn(&dir, keep)?;
        let layout = pki::Layout {
            dir: dir.clone(),
            pki: dir.join("pki"),
            port: free_port()?,
            etcd_client: free_port()?,
            etcd_peer: free_port()?,
        };
        let pki = layout.write_pki()?;
        let kubeconfig = dir.join("admin.kubeconfig");
        layout.write_kubeconfig(&kubeconfig, "admin")?;
        let kc = Kubeconfig::read_from(&kubeconfig)?;
        let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
        if keep {
            eprintln!("control plane: keeping {}", dir.display());
        }
        // Built before any process starts, so that its Drop stops them if
        // startup fails half-way.
        let mut cp = Self {
            config,
            kubeconfig,
            local: Some(Local {
                dir: dir.clone(),
                pki: pki.clone(),
                procs: Vec::new(),
                janitor,
                controller_manager: options.controller_manager,
            }),
        };

        let etcd_args = layout.etcd_flags()?;
        cp.spawn("etcd", &bins.etcd, &etcd_args)?;

        let mut api_args = layout.apiserver_flags()?;
        api_args.extend(options.apiserver_args.iter().cloned());
        cp.spawn("kube-apiserver", &bins.kube_apiserver, &api_args)?;
        cp.wait_ready(options.start_timeout).await?;

        if options.controller_manager {
            let kcm_kubeconfig = dir.join("controller-manager.kubeconfig");
            layout.write_kubeconfig(&kcm_kubeconfig, "controller-manager")?;
            let kcm_args = layout.controller_manager_flags(&kcm_kubeconfig)?;
            cp.spawn(
                "kube-controller-manager",
                &bins.kube_controller_manager,
                &kcm_args,
            )?;
            cp.wait_controller_manager(options.start_timeout).await?;
        }
        Ok(cp)
    }

    fn spawn(&mut self, name: &'static str, bin: &Path, args: &[String]) -> Result<(), Error> {
        let Some(l) = self.local.as_mut() else {
            return Ok(());
        };
        let proc = Proc::spawn(name, bin, args, &l.dir)?;
        let pid = proc.pid();
        l.procs.push(proc);
        l.janitor.watch(pid)
    }

    /// Fails at once, with its log, if a component has died.
    fn check_alive(&mut self) -> Result<(), Error> {
        let Some(l) = self.local.as_mut() else {
            return Ok(());
        };
        for p in &mut l.procs {
            if let Some(status) = p.exited() {
                return Err(Error::Exited {
                    name: p.name,
                    status: status.to_string(),
                    log: p.log_tail(),
                });
            }
        }
        Ok(())
    }

    async fn wait_ready(&mut self, timeout: Duration) -> Result<(), Error> {
        let client = self.client()?;
        let client = &client;
        let ready = Wait::new(timeout, "kube-apiserver's /readyz")
            .every(Duration::from_millis(200))
            .until(|| {
                let alive = self.check_alive();
                async move {
                    alive?;
                    let req = http::Request::get("/readyz").body(Vec::new())?;
                    Ok::<_, Error>(match client.request_text(req).await {
                        Ok(body) if body.trim() == "ok" => Check::Done(()),
                        Ok(body) => Check::NotYet(body),
                        Err(e) => Check::NotYet(e.to_string()),
                    })
                }
            })
            .await;
        match ready {
            Err(Error::Timeout(t)) => {
                let log = self
                    .local
                    .as_ref()
                    .and_then(|l| l.procs.iter().find(|p| p.name == "kube-apiserver"))
                    .map(Proc::log_tail)
                    .unwrap_or_default();
                Err(Error::NotReady {
                    timeout,
                    last: t.last.unwrap_or_default(),
                    log,
                })
            }
            other => other,
        }
    }

    /// The controller manager has no probe without its serving port; its
    /// service-account controller creating `default/default` shows that it is
    /// connected, has synced its caches and runs controllers.
    async fn wait_controller_manager(&mut self, timeout: Duration) -> Result<(), Error> {
        let api: Api<ServiceAccount> = Api::namespaced(self.client()?, "default");
        let api = &api;
        Wait::new(
            timeout,
            "kube-controller-manager to create the default service account",
        )
        .every(Duration::from_millis(200))
        .until(|| {
            let alive = self.check_alive();
            async move {
                alive?;
                Ok::<_, Error>(api.get_opt("default").await?.is_some())
            }
        })
        .await
    }

    /// A new client (admin, `system:masters` on a local control plane).
    /// Must be called inside the tokio runtime that will use it.
    pub fn client(&self) -> Result<Client, Error> {
        Ok(Client::try_from(self.config.clone())?)
    }

    /// The API server's URL.
    pub fn server_url(&self) -> String {
        self.config.cluster_url.to_string()
    }

    /// The client configuration, e.g. to build a client with other settings.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// A kubeconfig file for this cluster, for processes under test
    /// (`KUBECONFIG=...` or `--kubeconfig`) and for debugging with kubectl.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// True when this process runs the control plane (false on a real cluster).
    pub fn is_local(&self) -> bool {
        self.local.is_some()
    }

    /// The gitVersion `/version` must report: the pinned release locally,
    /// unknown on an external cluster.
    pub fn expected_version(&self) -> Option<&'static str> {
        self.local.as_ref().map(|_| K8S_VERSION)
    }

    /// Whether workload controllers run (always assumed on a real cluster).
    pub fn has_controller_manager(&self) -> bool {
        self.local.as_ref().is_none_or(|l| l.controller_manager)
    }

    /// The local control plane's scratch directory (logs, certs, etcd data).
    pub fn dir(&self) -> Option<&Path> {
        self.local.as_ref().map(|l| l.dir.as_path())
    }

    /// Pids of the local components, in start order.
    pub fn pids(&self) -> Vec<u32> {
        self.local
            .as_ref()
            .map(|l| l.procs.iter().map(Proc::pid).collect())
            .unwrap_or_default()
    }

    /// The local control plane's certificates, e.g. the CA that signs the
    /// API server's serving certificate and that it trusts for clients.
    pub fn pki(&self) -> Option<&PkiFiles> {
        self.local.as_ref().map(|l| &l.pki)
    }

    /// Creates a fresh namespace named `e2e-<prefix>-<random>`, labelled
    /// [`NAMESPACE_LABEL`], and returns its name. Any prefix is accepted: it
    /// is reduced to what a namespace name allows.
    pub async fn create_namespace(&self, client: &Client, prefix: &str) -> Result<String, Error> {
        let ns = Namespace {
            metadata: ObjectMeta {
                generate_name: Some(format!("e2e-{}-", sanitize(prefix))),
                labels: Some(BTreeMap::from([(
                    NAMESPACE_LABEL.0.to_owned(),
                    NAMESPACE_LABEL.1.to_owned(),
                )])),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        let created = Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await?;
        created
            .metadata
            .name
            .ok_or(Error::Unnamed("the created namespace"))
    }

    /// Deletes a namespace (it goes away asynchronously); matters on a real
    /// cluster, where test namespaces would otherwise pile up.
    pub async fn delete_namespace(&self, client: &Client, name: &str) -> Result<(), Error> {
        Api::<Namespace>::all(client.clone())
            .delete(name, &DeleteParams::background())
            .await?;
        Ok(())
    }

    /// A client of this cluster that authenticates with `token` only (no
    /// client certificate): RBAC and admission policies judge its requests
    /// as those of the token's subject.
    pub fn client_with_token(&self, token: &str) -> Result<Client, Error> {
        let mut config = self.config.clone();
        config.auth_info = kube::config::AuthInfo {
            token: Some(token.into()),
            ..kube::config::AuthInfo::default()
        };
        Ok(Client::try_from(config)?)
    }
}

/// A real token of ServiceAccount `ns/name` (TokenRequest, valid an hour),
/// the one a pod running under that account would present.
pub async fn service_account_token(admin: &Client, ns: &str, name: &str) -> Result<String, Error> {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    let tr = Api::<ServiceAccount>::namespaced(admin.clone(), ns)
        .create_token_request(
            name,
            &PostParams::default(),
            &TokenRequest {
                spec: Some(TokenRequestSpec {
                    expiration_seconds: Some(3600),
                    ..TokenRequestSpec::default()
                }),
                ..TokenRequest::default()
            },
        )
        .await?;
    tr.status
        .and_then(|s| s.token)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| Error::NoToken(format!("{ns}/{name}")))
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if let Some(l) = self.local.as_mut() {
            for p in l.procs.iter_mut().rev() {
                p.stop(Duration::from_secs(5));
            }
            // The janitor removes the directory (unless kept).
            l.janitor.finish();
        }
    }
}

/// A free port. Another process may take it before the component binds
/// it; [`ControlPlane::start`] retries for that.
fn free_port() -> Result<u16, Error> {
    remora_test_support::ports::try_free_port()
        .map_err(|e| Error::io("picking a free port".to_owned(), e))
}

/// Lowercase alphanumerics and dashes, at most 40 characters, never empty:
/// what `generateName` accepts with room for the prefix and suffix.
fn sanitize(prefix: &str) -> String {
    let s: String = prefix
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(40)
        .collect();
    let s = s.trim_matches('-');
    if s.is_empty() {
        "test".to_owned()
    } else {
        s.to_owned()
    }
}

/// A Deployment named `name` of `replicas` pods labelled `labels`, running `spec`.
pub fn deployment(
    name: &str,
    replicas: i32,
    labels: BTreeMap<String, String>,
    spec: Option<k8s_openapi::api::core::v1::PodSpec>,
) -> k8s_openapi::api::apps::v1::Deployment {
    use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
    use k8s_openapi::api::core::v1::PodTemplateSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    Deployment {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(labels.clone()),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..ObjectMeta::default()
                }),
                spec,
            },
            ..DeploymentSpec::default()
        }),
        ..Deployment::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_those_build_k8s_builds() {
        let script = std::fs::read_to_string(crate::node::repo_root().join("scripts/build-k8s.sh"))
            .expect("scripts/build-k8s.sh");
        for (var, want) in [("K8S_VERSION", K8S_VERSION), ("ETCD_VERSION", ETCD_VERSION)] {
            let line = format!("{var}=\"${{{var}:-{want}}}\"");
            assert!(
                script.lines().any(|l| l == line),
                "build-k8s.sh has no `{line}`"
            );
        }
    }

    #[test]
    fn sanitize_keeps_names_valid() {
        assert_eq!(sanitize("Webhook_Native mode"), "webhook-native-mode");
        assert_eq!(sanitize("--"), "test");
        assert_eq!(sanitize(""), "test");
        assert_eq!(sanitize("ü"), "test");
        assert_eq!(sanitize(&"a".repeat(100)).len(), 40);
    }
}
