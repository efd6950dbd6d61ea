//! The harness for tests on the real single-node cluster: kubelet,
//! containerd, kube-proxy and the CNI bridge, started by
//! `scripts/cluster.sh up` (which this module calls, never re-implements),
//! and Remora installed into it with `helm`, as a user installs it.
//!
//! Node tests need root, the node's binaries (`scripts/build-k8s.sh --node`)
//! and the images (`scripts/images.sh`), so they are `#[ignore]`d with that
//! reason and run when asked for (`-- --ignored`) with `REMORA_NODE_TESTS=1`;
//! without it [`Node::for_test`] fails saying why. Each test gets its own
//! namespace ([`TestNamespace`]).

pub mod ingress;
pub mod istio;
pub mod kube_proxy;
pub mod pods;
pub mod port_forward;
pub mod workload_ca;
pub mod workloads;
pub mod zero_loss;

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Container, Namespace, Pod, PodSpec, Secret, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, ListParams, LogParams, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use remora_test_support::wait::{Timeout, Wait, wait_until};
use tokio::sync::OnceCell;

/// `1` lets the node tests run (CI and scripts/test.sh set it).
pub const ENV_NODE_TESTS: &str = "REMORA_NODE_TESTS";
/// Tag of the locally built images (`scripts/images.sh`); default `dev`.
/// Another tag lets a developer try images built beside the shipped ones.
pub const ENV_IMAGE_TAG: &str = "REMORA_NODE_IMAGE_TAG";

/// The namespace label the webhook selects (`../shared/DESIGN.md`,
/// `charts/remora/templates/webhook.yaml`).
pub const INJECT_LABEL: (&str, &str) = ("remora.dev/inject", "enabled");
/// The chart's release name and namespace, as the README installs it.
pub const RELEASE: &str = "remora";
pub const RELEASE_NAMESPACE: &str = "remora-system";
/// Images `scripts/images.sh` builds and imports into the node's containerd.
pub const OPERATOR_IMAGE: &str = "localhost/remora/remora-operator";
pub const PROXY_IMAGE: &str = "localhost/remora/remora-agent";
pub const TEST_APP_IMAGE: &str = "localhost/remora/test-app";
pub const PAUSE_IMAGE: &str = "localhost/remora/pause:dev";

/// How long `helm --wait` and the harness's own waits give a rollout. The
/// operator's preStop sleep (5 s) and a cold kubelet make seconds normal.
pub const ROLLOUT_TIMEOUT: Duration = Duration::from_secs(180);

/// Container waiting reasons that no amount of waiting fixes.
const FATAL_WAITING: &[&str] = &[
    "ErrImageNeverPull",
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "CrashLoopBackOff",
];

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} failed ({status}); its output ends with:\n{tail}")]
    Command {
        what: String,
        status: String,
        tail: String,
    },
    #[error("scripts/cluster.sh up printed no `export KUBECONFIG=` last line; it printed:\n{0}")]
    NoKubeconfig(String),
    #[error("`scripts/cluster.sh status` printed no egress guard counter (is the node up?):\n{0}")]
    NoGuardCounter(String),
    #[error("node tests need root (the node owns cgroups, mounts, iptables)")]
    NotRoot,
    #[error(
        "{0}: a node test needs REMORA_NODE_TESTS=1 (root, scripts/build-k8s.sh --node, scripts/images.sh)"
    )]
    NotEnabled(String),
    #[error("kubeconfig: {0}")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Chart(#[from] crate::chart::Error),
    #[error(transparent)]
    Timeout(#[from] Timeout),
    #[error("{what}: {detail}")]
    Failed { what: String, detail: String },
    #[error("the shared node failed to start: {0}")]
    Shared(Arc<Error>),
}

impl Error {
    fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            what: what.into(),
            source,
        }
    }
}

pub use remora_test_support::wait::Check;

/// Polls every `every` until pod `name` of `uid` is gone (deleted, or
/// replaced by one of the same name), for at most `limit`; how long after
/// `t0` it was first seen gone. The poll interval is the caller's since
/// that time is a figure tests report.
pub async fn wait_pod_gone(
    api: &Api<Pod>,
    name: &str,
    uid: &str,
    t0: Instant,
    every: Duration,
    limit: Duration,
) -> Result<Duration, Error> {
    Wait::new(limit, &format!("pod {name} gone after its deletion"))
        .every(every)
        .until(|| async {
            Ok::<_, Error>(match api.get_opt(name).await? {
                Some(p) if p.metadata.uid.as_deref() == Some(uid) => {
                    Check::NotYet("still there".to_owned())
                }
                _ => Check::Done(t0.elapsed()),
            })
        })
        .await
}

/// Writes past libtest's output capture (which only `print!` and friends
/// go through), so a skip or a timing shows in CI logs of passing tests.
pub fn report(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The repository root (`e2e/..`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
}

/// Runs a command to completion off the async threads; its stdout on
/// success, else an error with the end of its output.
async fn run(what: &str, cmd: &mut tokio::process::Command) -> Result<String, Error> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| Error::io(format!("running {what}"), e))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(Error::Command {
            what: what.to_owned(),
            status: out.status.to_string(),
            tail: tail(
                &format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)),
                40,
            ),
        });
    }
    Ok(stdout)
}

async fn read_all<R: tokio::io::AsyncRead + Unpin>(r: Option<R>) -> String {
    let mut s = String::new();
    if let Some(mut r) = r {
        let _ = tokio::io::AsyncReadExt::read_to_string(&mut r, &mut s).await;
    }
    s
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The node, started (or found running) by `scripts/cluster.sh up`.
#[derive(Debug)]
pub struct Node {
    kubeconfig: PathBuf,
    config: Config,
}

static SHARED: OnceCell<Result<Node, Arc<Error>>> = OnceCell::const_new();

/// The operator the tests of one process share. A test that takes it away
/// (scales it to 0) holds it exclusively; every other test that relies on
/// it holds it shared: none sees an outage another test made (a drain
/// that starts while its stream reconnects falls back to the quiet
/// period). Test binaries run one after another, so one process is all.
static OPERATOR: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

impl Node {
    /// The node for a test. Node tests are `#[ignore]`d with their reason,
    /// so a plain `cargo test` lists them as ignored; one asked for
    /// (`-- --ignored`) without `REMORA_NODE_TESTS=1` fails saying so,
    /// rather than passing without running. Every node test starts with
    /// `let node = Node::for_test("name").await?;`.
    pub async fn for_test(test: &str) -> Result<&'static Node, Error> {
        if std::env::var(ENV_NODE_TESTS).as_deref() != Ok("1") {
            return Err(Error::NotEnabled(test.to_string()));
        }
        Self::shared().await
    }

    /// For a test that relies on the operator staying up, for as long as
    /// it holds the guard: waits while a test that takes it down runs.
    pub async fn share_operator(&self) -> tokio::sync::RwLockReadGuard<'static, ()> {
        OPERATOR.read().await
    }

    /// For a test that takes the operator down: waits until no other test
    /// relies on it, and keeps them waiting until the guard is dropped.
    pub async fn own_operator(&self) -> tokio::sync::RwLockWriteGuard<'static, ()> {
        OPERATOR.write().await
    }

    /// Once per process: `bash scripts/cluster.sh up` (a no-op when the node
    /// runs already), its kubeconfig, and one API call to prove it answers.
    /// The node is left running at exit: it is shared by every node test
    /// binary, and `scripts/cluster.sh down` is the caller's (CI's) to run.
    pub async fn shared() -> Result<&'static Node, Error> {
        let node = SHARED
            .get_or_init(|| async { Self::up().await.map_err(Arc::new) })
            .await;
        node.as_ref().map_err(|e| Error::Shared(e.clone()))
    }

    async fn up() -> Result<Self, Error> {
        if !nix::unistd::Uid::effective().is_root() {
            return Err(Error::NotRoot);
        }
        let t0 = Instant::now();
        let stdout = run(
            "scripts/cluster.sh up",
            tokio::process::Command::new("bash")
                .arg("scripts/cluster.sh")
                .arg("up")
                .current_dir(repo_root()),
        )
        .await?;
        let kubeconfig = stdout
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .and_then(|l| l.trim().strip_prefix("export KUBECONFIG="))
            .map(PathBuf::from)
            .ok_or_else(|| Error::NoKubeconfig(tail(&stdout, 10)))?;
        let kc = Kubeconfig::read_from(&kubeconfig)?;
        let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
        // Fail here, naming the kubeconfig, rather than in every test.
        Client::try_from(config.clone())?
            .apiserver_version()
            .await?;
        report(&format!(
            "node: up in {} ms, KUBECONFIG={}",
            t0.elapsed().as_millis(),
            kubeconfig.display()
        ));
        Ok(Self { kubeconfig, config })
    }

    /// A new admin client. Make one per test: a client belongs to the tokio
    /// runtime that made it, and each `#[tokio::test]` has its own.
    pub fn client(&self) -> Result<Client, Error> {
        Ok(Client::try_from(self.config.clone())?)
    }

    /// The admin kubeconfig (for helm, or kubectl while debugging).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Packets the egress guard dropped so far (`scripts/cluster.sh status`):
    /// pod or Service traffic that tried to leave the machine. Tests assert 0.
    pub async fn guard_drops(&self) -> Result<u64, Error> {
        let stdout = run(
            "scripts/cluster.sh status",
            tokio::process::Command::new("bash")
                .arg("scripts/cluster.sh")
                .arg("status")
                .current_dir(repo_root()),
        )
        .await?;
        stdout
            .lines()
            .find_map(|l| l.strip_prefix("egress guard dropped: "))
            .and_then(|n| n.trim().parse().ok())
            .ok_or_else(|| Error::NoGuardCounter(tail(&stdout, 10)))
    }

    /// `helm upgrade --install` of `charts/remora` as release [`RELEASE`]
    /// into `namespace`, with the locally built images and the workload CA
    /// ([`node_settings`]) and `extra` `--set` values, `--wait`ing for
    /// the rollout. Idempotent: the same values again roll nothing. While
    /// helm waits, operator pods that cannot start (image not imported,
    /// crash loop) end the install at once with what the kubelet says.
    pub async fn install_remora(
        &self,
        client: &Client,
        namespace: &str,
        extra: &[String],
    ) -> Result<Remora, Error> {
        let remora = self.remora_release(namespace);
        remora.upgrade(client, extra).await?;
        Ok(remora)
    }

    /// [`Node::install_remora`] with the local images and only `values`
    /// (none of [`node_settings`]): the chart's own defaults for
    /// everything else, as a user's `helm upgrade --install` gets them.
    pub async fn install_remora_with(
        &self,
        client: &Client,
        namespace: &str,
        values: &[String],
    ) -> Result<Remora, Error> {
        let remora = self.remora_release(namespace);
        remora.upgrade_with(client, values).await?;
        Ok(remora)
    }

    /// The release [`RELEASE`] in `namespace`, installed or not.
    pub fn remora_release(&self, namespace: &str) -> Remora {
        Remora {
            release: RELEASE.to_owned(),
            namespace: namespace.to_owned(),
            kubeconfig: self.kubeconfig.clone(),
        }
    }
}

static SHARED_REMORA: OnceCell<Remora> = OnceCell::const_new();

impl Node {
    /// Remora installed once per test process into [`RELEASE_NAMESPACE`]
    /// with [`node_settings`] (the local images, the CA on, discovery
    /// off; the chart's defaults otherwise), for tests that only
    /// need it there; tests of install itself use [`Node::install_remora`].
    /// Concurrent callers wait for the one `helm upgrade --install`.
    pub async fn remora(&self, client: &Client) -> Result<&'static Remora, Error> {
        SHARED_REMORA
            .get_or_try_init(|| self.install_remora(client, RELEASE_NAMESPACE, &[]))
            .await
    }
}

/// `GET path` on `port` of `pod`, through the API server's port-forward (as
/// `kubectl port-forward` does): the way to reach a port bound to the pod's
/// loopback, such as the agent's admin (`/debug/config`, `/metrics`).
/// Returns the status and the body.
pub async fn pod_http_get(
    client: &Client,
    namespace: &str,
    pod: &str,
    port: u16,
    path: &str,
) -> Result<(http::StatusCode, String), Error> {
    let what = format!("GET {path} on {namespace}/{pod}:{port} (port-forward)");
    let failed = |detail: String| Error::Failed {
        what: what.clone(),
        detail,
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let mut forwarder = pods.portforward(pod, &[port]).await?;
    let stream = forwarder
        .take_stream(port)
        .ok_or_else(|| failed("no stream for the port".to_owned()))?;
    let result = tokio::time::timeout(Duration::from_secs(10), get_once(stream, "localhost", path))
        .await
        .map_err(|_| failed("no response in 10 s".to_owned()))
        .and_then(|r| r.map_err(failed))
        .map(|r| (r.status(), r.into_body()));
    forwarder.abort();
    result
}

/// What a node benchmark measured is the code in the images, not the
/// harness's checkout: `commit` and `dirty` in `doc` (a results stamp)
/// become those `scripts/images.sh` recorded when it built the agent and
/// operator (`images/built-from.json`), and the checkout's go to
/// `harness_commit` and `harness_dirty`. Without that record the stamp is
/// left as it is and `images_built_from` says so.
pub fn stamp_images(doc: &mut serde_json::Map<String, serde_json::Value>) {
    let built = std::fs::read(cluster_dir().join("images/built-from.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .filter(|b| b["commit"].is_string());
    match built {
        Some(b) => {
            for (key, harness) in [("commit", "harness_commit"), ("dirty", "harness_dirty")] {
                if let Some(v) = doc.insert(key.into(), b[key].clone()) {
                    doc.insert(harness.into(), v);
                }
            }
            doc.insert("images_built_from".into(), b);
        }
        None => {
            doc.insert(
                "images_built_from".into(),
                serde_json::json!("not recorded: the commit is the harness's checkout"),
            );
        }
    }
}

/// Where `scripts/cluster.sh` keeps the node's state (containerd's socket,
/// the images' `built-from.json`): `$REMORA_CLUSTER_DIR`, else its default.
pub fn cluster_dir() -> PathBuf {
    std::env::var_os("REMORA_CLUSTER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/remora-cluster"))
}

/// The tag of the local images: `$REMORA_NODE_IMAGE_TAG`, else `dev`.
pub fn image_tag() -> String {
    std::env::var(ENV_IMAGE_TAG)
        .ok()
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| "dev".to_owned())
}

/// `--set` values giving the chart the tag of the images
/// `scripts/images.sh` imported, on top of `values-local.yaml`
/// ([`crate::chart::local_values_file`]: the repositories, `pullPolicy:
/// Never`, as the README installs the chart).
pub fn local_image_values() -> Vec<String> {
    let tag = image_tag();
    vec![
        format!("image.operator.tag={tag}"),
        format!("image.proxy.tag={tag}"),
    ]
}

/// Every `--set` the node's install gives before a test's own (which win),
/// on top of `values-local.yaml` and [`local_image_values`]: the workload CA
/// on, so injected pods get their certificates from the operator, and
/// discovery off: the lifecycle tests sharing this release (node_pods,
/// node_workloads, node_traffic, node_zero_loss, node_install, node_mtls)
/// were written for sidecars in static mode, and the chart's "auto" would
/// otherwise keep whatever the previous test binary left installed. Tests
/// of discovery set it on (node_discovery, node_external); node_upgrade
/// installs with the chart's own defaults.
fn node_settings() -> Vec<String> {
    vec![
        "workloadCA.enabled=true".to_owned(),
        "discovery.enabled=false".to_owned(),
        // node_workloads rolls a Deployment under rolloutPolicy Automatic.
        "rollouts.automatic=true".to_owned(),
    ]
}

/// A pod of the pause image (present on every node: `cluster.sh up`
/// imports it), for admission checks.
pub fn pause_pod(name: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "app".into(),
                image: Some(PAUSE_IMAGE.into()),
                image_pull_policy: Some("Never".into()),
                ..Container::default()
            }],
            termination_grace_period_seconds: Some(1),
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

/// Creates `pod` in `namespace` with server-side dry-run: the API server runs
/// the whole admission chain, mutating webhooks included (the chart's say
/// `sideEffects: None`), and stores nothing, so nothing is scheduled.
pub async fn dry_run_create(
    client: &Client,
    namespace: &str,
    pod: &Pod,
) -> Result<Pod, kube::Error> {
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    Api::<Pod>::namespaced(client.clone(), namespace)
        .create(&dry, pod)
        .await
}

/// Dry-run creates of a pause pod in `namespace` until one comes back with
/// the sidecar: the webhook is in force (the API server picks up webhook
/// configurations and caBundle changes asynchronously, and refuses pods
/// under `failurePolicy: Fail` until the operator answers). Returns the
/// mutated pod and how long it took.
pub async fn wait_injected(
    client: &Client,
    namespace: &str,
    timeout: Duration,
) -> Result<(Pod, Duration), Error> {
    let t0 = Instant::now();
    let probe = pause_pod("inject-probe");
    let pod = wait_until(
        timeout,
        &format!("a pod in {namespace} injected by the webhook"),
        || async {
            Ok::<_, Error>(match dry_run_create(client, namespace, &probe).await {
                Ok(p) if crate::webhook::sidecar(&p).is_some() => Check::Done(p),
                Ok(_) => Check::NotYet("admitted without a sidecar".into()),
                // A refusal (webhook unreachable, TLS not trusted yet) is
                // what this waits out; its message is the "last seen".
                Err(kube::Error::Api(s)) => Check::NotYet(format!("refused: {}", s.message)),
                Err(e) => return Err(e.into()),
            })
        },
    )
    .await?;
    Ok((pod, t0.elapsed()))
}

/// A namespace of one test: a unique name (`node-<prefix>-xxxxx`), labelled
/// `remora.dev/e2e=true` (bulk cleanup: `kubectl delete ns -l
/// remora.dev/e2e=true`) plus the test's labels, ready for pods (its
/// `default` ServiceAccount exists). Deleted by [`TestNamespace::delete`] or
/// on drop; neither waits for the namespace to be gone.
pub struct TestNamespace {
    name: String,
    client: Client,
    config: Config,
    deleted: bool,
}

impl TestNamespace {
    pub async fn create(
        node: &Node,
        client: &Client,
        prefix: &str,
        labels: &[(&str, &str)],
    ) -> Result<Self, Error> {
        let mut all = BTreeMap::from([(
            crate::controlplane::NAMESPACE_LABEL.0.to_owned(),
            crate::controlplane::NAMESPACE_LABEL.1.to_owned(),
        )]);
        all.extend(
            labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
        let prefix: String = prefix
            .to_ascii_lowercase()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .take(40)
            .collect();
        let ns = Namespace {
            metadata: ObjectMeta {
                generate_name: Some(format!("node-{}-", prefix.trim_matches('-'))),
                labels: Some(all),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        let created = Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await?;
        let me = Self {
            name: created.metadata.name.unwrap_or_default(),
            client: client.clone(),
            config: node.config.clone(),
            deleted: false,
        };
        // The ServiceAccount admission plugin refuses pods until the
        // controller manager made `default`.
        let sa: Api<ServiceAccount> = Api::namespaced(client.clone(), &me.name);
        wait_until(
            Duration::from_secs(60),
            &format!("ServiceAccount {}/default", me.name),
            || async {
                Ok::<_, Error>(match sa.get_opt("default").await? {
                    Some(_) => Check::Done(()),
                    None => Check::NotYet("not created yet".into()),
                })
            },
        )
        .await?;
        Ok(me)
    }

    /// A namespace labelled [`INJECT_LABEL`]: the webhook injects its pods.
    pub async fn injected(node: &Node, client: &Client, prefix: &str) -> Result<Self, Error> {
        Self::create(node, client, prefix, &[INJECT_LABEL]).await
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// An API of a namespaced kind in this namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.name)
    }

    /// Starts the namespace's deletion (background; does not wait for it).
    pub async fn delete(mut self) -> Result<(), Error> {
        self.deleted = true;
        Api::<Namespace>::all(self.client.clone())
            .delete(&self.name, &DeleteParams::background())
            .await?;
        Ok(())
    }
}

impl Drop for TestNamespace {
    /// A test that failed (or forgot) still removes its namespace. The
    /// test's runtime may be shutting down, where a spawned task would never
    /// run, so one DELETE goes out from a thread with its own runtime and
    /// client; only that request is waited for.
    fn drop(&mut self) {
        if self.deleted {
            return;
        }
        let (config, name) = (self.config.clone(), self.name.clone());
        let sent = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(async {
                let client = Client::try_from(config).ok()?;
                tokio::time::timeout(
                    Duration::from_secs(10),
                    Api::<Namespace>::all(client).delete(&name, &DeleteParams::background()),
                )
                .await
                .ok()?
                .ok()
            })
        })
        .join();
        if !matches!(sent, Ok(Some(_))) {
            report(&format!("node: could not delete namespace {}", self.name));
        }
    }
}

/// A helm release of `charts/remora` on the node.
#[derive(Debug, Clone)]
pub struct Remora {
    pub release: String,
    pub namespace: String,
    kubeconfig: PathBuf,
}

impl Remora {
    /// The chart's `remora.fullname`: the release name, with "remora" once.
    pub fn fullname(&self) -> String {
        let base = if self.release.contains("remora") {
            self.release.clone()
        } else {
            format!("{}-remora", self.release)
        };
        base.chars()
            .take(54)
            .collect::<String>()
            .trim_end_matches('-')
            .to_owned()
    }

    /// Name of the operator's Deployment, Service, ServiceAccount,
    /// MutatingWebhookConfiguration and leader Lease (`REMORA_LEASE_NAME`).
    pub fn operator(&self) -> String {
        format!("{}-operator", self.fullname())
    }

    /// The self-managed certificate's Secret.
    pub fn tls_secret(&self) -> String {
        format!("{}-tls", self.operator())
    }

    /// The admin kubeconfig helm runs with.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// `helm upgrade --install --wait` with [`node_settings`] and `extra`.
    pub async fn upgrade(&self, client: &Client, extra: &[String]) -> Result<Duration, Error> {
        let values: Vec<String> = node_settings()
            .into_iter()
            .chain(extra.iter().cloned())
            .collect();
        self.upgrade_with(client, &values).await
    }

    /// `helm upgrade --install --wait` with the local images and `values`
    /// only: the chart's defaults for the rest.
    pub async fn upgrade_with(
        &self,
        client: &Client,
        values: &[String],
    ) -> Result<Duration, Error> {
        let mut args: Vec<OsString> = [
            "upgrade",
            "--install",
            &self.release,
            "--namespace",
            &self.namespace,
            "--create-namespace",
            "--wait",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        args.push(crate::chart::chart_dir().into());
        args.push(format!("--timeout={}s", ROLLOUT_TIMEOUT.as_secs()).into());
        args.push("-f".into());
        args.push(crate::chart::local_values_file().into());
        for s in local_image_values().iter().chain(values) {
            args.push("--set".into());
            args.push(s.into());
        }
        let took = self.helm(client, "helm upgrade --install", args).await?;
        // helm's --wait returns with the previous replicas still there (and
        // answering the webhook until they are gone): a pod injected by one
        // of them would get the previous install's sidecar.
        wait_until(
            ROLLOUT_TIMEOUT,
            "only the new operator replicas",
            || async {
                let pods = self.operator_pods(client).await?;
                let revisions: std::collections::BTreeSet<Option<&String>> = pods
                    .iter()
                    .map(|p| kube::ResourceExt::labels(p).get("pod-template-hash"))
                    .collect();
                let leaving = pods
                    .iter()
                    .filter(|p| p.metadata.deletion_timestamp.is_some())
                    .count();
                Ok::<_, Error>(if revisions.len() <= 1 && leaving == 0 {
                    Check::Done(())
                } else {
                    Check::NotYet(format!(
                        "{} revisions, {leaving} pods terminating",
                        revisions.len()
                    ))
                })
            },
        )
        .await?;
        Ok(took)
    }

    /// `helm uninstall --wait`: every object of the release is gone when it
    /// returns (CRDs stay, as helm keeps `crds/`; so do the Lease and the
    /// Secret the operator made itself). No release is not an error.
    pub async fn uninstall(&self, client: &Client) -> Result<Duration, Error> {
        let args = [
            "uninstall",
            &self.release,
            "--namespace",
            &self.namespace,
            "--wait",
            "--ignore-not-found",
        ]
        .iter()
        .map(OsString::from)
        .chain([format!("--timeout={}s", ROLLOUT_TIMEOUT.as_secs()).into()])
        .collect();
        self.helm(client, "helm uninstall", args).await
    }

    /// Runs helm; meanwhile checks the operator pods every second, and on a
    /// container that cannot start sends helm SIGTERM (it then marks the
    /// release failed, not pending, so the next install works) and fails
    /// with the kubelet's reason rather than after helm's whole timeout.
    async fn helm(
        &self,
        client: &Client,
        what: &str,
        args: Vec<OsString>,
    ) -> Result<Duration, Error> {
        let helm = crate::chart::helm_bin()?;
        let t0 = Instant::now();
        let mut child = tokio::process::Command::new(helm)
            .args(&args)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| Error::io(format!("starting {what}"), e))?;
        let pid = child.id();
        // Read both pipes while helm runs, so a full pipe never stalls it.
        let out = tokio::spawn(read_all(child.stdout.take()));
        let err = tokio::spawn(read_all(child.stderr.take()));
        let mut fatal = None;
        let status = loop {
            tokio::select! {
                status = child.wait() => break status,
                _ = tokio::time::sleep(Duration::from_secs(1)), if fatal.is_none() => {
                    if let Ok(Some(reason)) = self.stuck(client).await {
                        if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
                            let _ = nix::sys::signal::kill(
                                nix::unistd::Pid::from_raw(pid),
                                nix::sys::signal::Signal::SIGTERM,
                            );
                        }
                        fatal = Some(reason);
                    }
                }
            }
        }
        .map_err(|e| Error::io(format!("waiting for {what}"), e))?;
        let output = format!(
            "{}{}",
            out.await.unwrap_or_default(),
            err.await.unwrap_or_default()
        );
        if let Some(reason) = fatal {
            return Err(Error::Failed {
                what: format!("{what} (stopped: an operator pod cannot start)"),
                detail: format!("{reason}\n{}", self.diagnose(client).await),
            });
        }
        if !status.success() {
            return Err(Error::Command {
                what: what.to_owned(),
                status: status.to_string(),
                tail: format!("{}\n{}", tail(&output, 20), self.diagnose(client).await),
            });
        }
        Ok(t0.elapsed())
    }

    /// The release's operator pods, terminating ones included.
    pub async fn operator_pods(&self, client: &Client) -> Result<Vec<Pod>, Error> {
        let selector = format!(
            "app.kubernetes.io/name=remora-operator,app.kubernetes.io/instance={}",
            self.release
        );
        Ok(Api::<Pod>::namespaced(client.clone(), &self.namespace)
            .list(&ListParams::default().labels(&selector))
            .await?
            .items)
    }

    /// Why a pod of the rollout in progress cannot start (see
    /// [`cannot_start`]), if one cannot. Only pods of the Deployment's newest
    /// ReplicaSet running the image being installed count: pods of an
    /// earlier, broken revision (a missing image) are what a rollout
    /// replaces, not a reason to stop it.
    pub async fn stuck(&self, client: &Client) -> Result<Option<String>, Error> {
        let selector = format!(
            "app.kubernetes.io/name=remora-operator,app.kubernetes.io/instance={}",
            self.release
        );
        let revision = |rs: &ReplicaSet| -> u64 {
            rs.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("deployment.kubernetes.io/revision"))
                .and_then(|r| r.parse().ok())
                .unwrap_or(0)
        };
        let newest = Api::<ReplicaSet>::namespaced(client.clone(), &self.namespace)
            .list(&ListParams::default().labels(&selector))
            .await?
            .items
            .into_iter()
            .max_by_key(revision);
        let Some(hash) = newest
            .and_then(|rs| rs.metadata.labels)
            .and_then(|mut l| l.remove("pod-template-hash"))
        else {
            return Ok(None);
        };
        let image = format!("{OPERATOR_IMAGE}:{}", image_tag());
        Ok(self
            .operator_pods(client)
            .await?
            .iter()
            .filter(|p| {
                p.metadata.deletion_timestamp.is_none()
                    && p.metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get("pod-template-hash"))
                        == Some(&hash)
                    && p.spec.as_ref().is_some_and(|s| {
                        s.containers
                            .iter()
                            .any(|c| c.image.as_deref() == Some(&image))
                    })
            })
            .find_map(cannot_start))
    }

    /// Names of the operator pods that are Running, Ready and not being
    /// deleted, sorted.
    pub async fn ready_operators(&self, client: &Client) -> Result<Vec<String>, Error> {
        let mut names: Vec<String> = self
            .operator_pods(client)
            .await?
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none() && is_ready(p))
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        names.sort();
        Ok(names)
    }

    /// Waits until exactly `n` operator pods exist, all Running and Ready
    /// (none terminating), and the Service has `n` ready endpoints (what the
    /// API server's webhook calls go to). Returns their names.
    pub async fn wait_ready(&self, client: &Client, n: usize) -> Result<Vec<String>, Error> {
        let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &self.namespace);
        let res = wait_until(
            ROLLOUT_TIMEOUT,
            &format!("{n} operator replicas Ready behind the Service"),
            || async {
                if let Some(reason) = self.stuck(client).await? {
                    return Err(Error::Failed {
                        what: "an operator pod cannot start".into(),
                        detail: reason,
                    });
                }
                let pods = self.operator_pods(client).await?;
                let ready = self.ready_operators(client).await?;
                if pods.len() != n || ready.len() != n {
                    return Ok::<_, Error>(Check::NotYet(format!(
                        "{} pods, ready: {ready:?}",
                        pods.len()
                    )));
                }
                let endpoints = ready_endpoints(&slices, &self.operator()).await?;
                Ok(if endpoints == n {
                    Check::Done(ready)
                } else {
                    Check::NotYet(format!("pods ready {ready:?}, {endpoints} ready endpoints"))
                })
            },
        )
        .await;
        match res {
            Err(e) => Err(Error::Failed {
                what: e.to_string(),
                detail: self.diagnose(client).await,
            }),
            ok => ok,
        }
    }

    /// The leader Lease's holder; `None` when nobody holds it (released, or
    /// not created yet).
    pub async fn leader(&self, client: &Client) -> Result<Option<String>, Error> {
        let lease = Api::<Lease>::namespaced(client.clone(), &self.namespace)
            .get_opt(&self.operator())
            .await?;
        Ok(lease
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity)
            .filter(|h| !h.is_empty()))
    }

    /// Waits until the Lease is held by one of the ready operator pods
    /// other than `not` (if given); returns the holder.
    pub async fn wait_leader(
        &self,
        client: &Client,
        not: Option<&str>,
        timeout: Duration,
    ) -> Result<String, Error> {
        wait_until(
            timeout,
            "a ready operator holding the leader Lease",
            || async {
                let holder = self.leader(client).await?;
                let ready = self.ready_operators(client).await?;
                Ok::<_, Error>(match holder {
                    Some(h) if Some(h.as_str()) != not && ready.contains(&h) => Check::Done(h),
                    h => Check::NotYet(format!("holder {h:?}, ready operators {ready:?}")),
                })
            },
        )
        .await
    }

    /// The release's MutatingWebhookConfiguration, if it exists.
    pub async fn webhook_config(
        &self,
        client: &Client,
    ) -> Result<Option<MutatingWebhookConfiguration>, Error> {
        Ok(Api::<MutatingWebhookConfiguration>::all(client.clone())
            .get_opt(&self.operator())
            .await?)
    }

    /// Every webhook's caBundle (PEM), in order; an empty entry where one is
    /// missing. `None` without the configuration.
    pub async fn ca_bundles(&self, client: &Client) -> Result<Option<Vec<Vec<u8>>>, Error> {
        Ok(self.webhook_config(client).await?.map(|m| {
            m.webhooks
                .unwrap_or_default()
                .into_iter()
                .map(|w| w.client_config.ca_bundle.map(|b| b.0).unwrap_or_default())
                .collect()
        }))
    }

    /// The CA the operator serves under (`ca.crt` of its self-managed
    /// Secret), if the Secret exists.
    pub async fn secret_ca(&self, client: &Client) -> Result<Option<Vec<u8>>, Error> {
        let secret = Api::<Secret>::namespaced(client.clone(), &self.namespace)
            .get_opt(&self.tls_secret())
            .await?;
        Ok(secret
            .and_then(|s| s.data)
            .and_then(|mut d| d.remove("ca.crt"))
            .map(|ByteString(b)| b))
    }

    /// What the operator pods are doing, for a failure message: phase,
    /// container states, and the end of a crashed container's log.
    pub async fn diagnose(&self, client: &Client) -> String {
        let pods = match self.operator_pods(client).await {
            Ok(p) => p,
            Err(e) => return format!("(listing operator pods: {e})"),
        };
        if pods.is_empty() {
            return format!("no operator pods in {}", self.namespace);
        }
        let api: Api<Pod> = Api::namespaced(client.clone(), &self.namespace);
        let mut out = String::new();
        for p in &pods {
            let name = p.metadata.name.clone().unwrap_or_default();
            let status = p.status.clone().unwrap_or_default();
            out.push_str(&format!(
                "pod {name}: phase {}{}\n",
                status.phase.unwrap_or_default(),
                if p.metadata.deletion_timestamp.is_some() {
                    " (terminating)"
                } else {
                    ""
                }
            ));
            for c in status.container_statuses.unwrap_or_default() {
                let state = c.state.unwrap_or_default();
                let now = if let Some(w) = state.waiting {
                    format!(
                        "waiting {}: {}",
                        w.reason.unwrap_or_default(),
                        w.message.unwrap_or_default()
                    )
                } else if let Some(t) = state.terminated {
                    format!(
                        "terminated {} (exit {})",
                        t.reason.unwrap_or_default(),
                        t.exit_code
                    )
                } else {
                    "running".to_owned()
                };
                out.push_str(&format!(
                    "  {}: {now}, ready {}, restarts {}\n",
                    c.name, c.ready, c.restart_count
                ));
                if c.restart_count > 0 {
                    let lp = LogParams {
                        container: Some(c.name.clone()),
                        previous: true,
                        tail_lines: Some(20),
                        ..LogParams::default()
                    };
                    if let Ok(log) = api.logs(&name, &lp).await {
                        out.push_str(&format!("  previous log:\n{log}\n"));
                    }
                }
            }
        }
        out
    }
}

/// Ready (condition `Ready` true) and Running.
pub fn is_ready(pod: &Pod) -> bool {
    let Some(status) = pod.status.as_ref() else {
        return false;
    };
    status.phase.as_deref() == Some("Running")
        && status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// Why a pod's container cannot start, when it is a reason no wait fixes;
/// the missing-image case says how to build the images.
pub fn cannot_start(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    let name = pod.metadata.name.as_deref().unwrap_or("?");
    status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten())
        .find_map(|c| {
            let w = c.state.as_ref()?.waiting.as_ref()?;
            let reason = w.reason.as_deref()?;
            FATAL_WAITING.contains(&reason).then(|| {
                let hint = if reason.contains("Image") {
                    format!(
                        " (image {} is not in the node's containerd: run scripts/images.sh)",
                        c.image
                    )
                } else {
                    String::new()
                };
                format!(
                    "pod {name}, container {}: {reason}{hint}: {}",
                    c.name,
                    w.message.as_deref().unwrap_or("")
                )
            })
        })
}

/// Ready endpoints in the EndpointSlices of Service `service` (`slices`:
/// its namespace's).
pub async fn ready_endpoints(slices: &Api<EndpointSlice>, service: &str) -> Result<usize, Error> {
    let by_service = format!("kubernetes.io/service-name={service}");
    Ok(slices
        .list(&ListParams::default().labels(&by_service))
        .await?
        .items
        .iter()
        .flat_map(|s| s.endpoints.iter().flatten())
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
        .count())
}

/// The test app's container (the local image, `args`), locked down as the
/// chart's own containers are: non-root by the pod, read-only root, no
/// capabilities, no privilege escalation.
pub fn test_app_container<S: AsRef<str>>(name: &str, args: &[S]) -> serde_json::Value {
    let args: Vec<&str> = args.iter().map(AsRef::as_ref).collect();
    serde_json::json!({
        "name": name,
        "image": format!("{TEST_APP_IMAGE}:{}", image_tag()),
        "imagePullPolicy": "Never",
        "args": args,
        "securityContext": {
            "readOnlyRootFilesystem": true,
            "allowPrivilegeEscalation": false,
            "capabilities": {"drop": ["ALL"]}
        }
    })
}

/// One HTTP/1.1 `GET path` (`connection: close`) over `stream`: the
/// response with its body as text, or what went wrong.
pub async fn get_once<S>(
    stream: S,
    host: &str,
    path: &str,
) -> Result<http::Response<String>, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use http_body_util::BodyExt as _;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    let conn = tokio::spawn(conn);
    let exchange = async {
        let request = http::Request::get(path)
            .header(http::header::HOST, host)
            .header(http::header::CONNECTION, "close")
            .body(http_body_util::Empty::<hyper::body::Bytes>::new())
            .map_err(|e| e.to_string())?;
        let (parts, body) = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?
            .into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok(http::Response::from_parts(
            parts,
            String::from_utf8_lossy(&body).into_owned(),
        ))
    };
    let result = exchange.await;
    conn.abort();
    result
}
