//! Issue 14's measurements, on a real kube-apiserver loaded by
//! [`crate::scale`]: two operator replicas (the release or debug binary)
//! with leader election, each under its own ServiceAccount bound to the
//! chart's ClusterRole and Role, so that the API server's audit log tells
//! their requests apart; pods created through the real admission path
//! (the chart's webhook configuration pointed at replica a); then, step by
//! step: the settled state (every status and pod as it should be),
//! a steady window (RSS, requests), the retune of a big namespace, an edit
//! of the cluster default under an open-loop webhook load, and the
//! leader's crash.
//!
//! Each step is bounded by the run's step timeout; one that times out is
//! reported as such ([`StepResult`]) and the next runs where it can.

pub mod audit;
pub mod expect;
pub mod pod_watch;
pub mod webhook_load;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{DynamicObject, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use nix::sys::signal::Signal;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::controlplane::{self, ControlPlane, NAMESPACE_LABEL, service_account_token};
use crate::operator::{self, Operator};
use crate::scale::{self, BIG_LIFECYCLE, Load, Populated, RUN_LABEL};
use crate::stats::Summary;
use expect::{Expected, LifecycleFacts, PodFacts};
use pod_watch::{PodKey, PodWatch};

/// The leader Lease (the chart's Role grants only this name).
pub const LEASE: &str = "remora-operator";
/// The chart release whose RBAC the replicas get (names `remora-operator`).
const RELEASE: &str = "remora";
/// The replicas' ServiceAccounts, also their Lease identities (POD_NAME).
pub const REPLICAS: [&str; 2] = ["remora-operator-a", "remora-operator-b"];
/// The operator's default `--lease-duration`.
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(15);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    ControlPlane(#[from] controlplane::Error),
    #[error(transparent)]
    Operator(#[from] operator::Error),
    #[error(transparent)]
    Chart(#[from] crate::chart::Error),
    #[error(transparent)]
    Webhook(#[from] crate::webhook::SetupError),
    #[error(transparent)]
    Scale(#[from] scale::Error),
    #[error(transparent)]
    Audit(#[from] audit::Error),
    #[error("kubernetes API ({what}): {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    #[error("{0}")]
    Unexpected(String),
}

fn kube_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let what = what.into();
    move |source| Error::Kube { what, source }
}

/// How to run.
#[derive(Debug, Clone)]
pub struct Options {
    pub load: Load,
    /// The steady window (RSS and request counts).
    pub steady: Duration,
    /// AdmissionReviews a second during the cluster-default edit.
    pub rate: u32,
    /// How long the webhook is measured with no reconcile running.
    pub webhook_steady: Duration,
    /// Each step's bound.
    pub step_timeout: Duration,
    /// More `serve` flags for both replicas (e.g. a shorter lease).
    pub operator_args: Vec<String>,
    /// The `--lease-duration` those flags give (for the failover goal).
    pub lease_duration: Duration,
    pub cluster_default_edit: bool,
    /// Measure [`Run::ceiling`] after the cluster-default edit.
    pub ceiling: bool,
    pub failover: bool,
}

impl Options {
    pub fn new(load: Load) -> Self {
        Self {
            load,
            steady: Duration::from_secs(30),
            rate: 500,
            webhook_steady: Duration::from_secs(10),
            step_timeout: Duration::from_secs(300),
            operator_args: Vec::new(),
            lease_duration: DEFAULT_LEASE_DURATION,
            cluster_default_edit: true,
            ceiling: true,
            failover: true,
        }
    }
}

/// A step's fate: done, or why not.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome", content = "detail")]
pub enum StepResult<T> {
    Done(T),
    TimedOut(String),
    Failed(String),
    Skipped(String),
}

impl<T> StepResult<T> {
    pub fn done(&self) -> Option<&T> {
        match self {
            Self::Done(t) => Some(t),
            _ => None,
        }
    }
}

/// Seconds, p50 and max over pods.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Spread {
    pub p50: f64,
    pub max: f64,
}

impl Spread {
    fn of(s: &Summary) -> Self {
        Self {
            p50: s.p50_ms / 1000.0,
            max: s.max_ms / 1000.0,
        }
    }
}

/// The settled state: every pod injected and carrying what its layers say,
/// every status as computed by [`expect`].
#[derive(Debug, Clone, Default, Serialize)]
pub struct Settled {
    /// From the last SidecarLifecycle's creation (the load's end).
    pub seconds: f64,
    pub pods: usize,
    pub pods_injected: usize,
    /// Pods whose drainDuration is not (yet) what their layers say.
    pub pods_mistuned: usize,
    pub lifecycles: usize,
    /// Differences of statuses (and pods), first ones.
    pub problems: Vec<String>,
    pub problem_count: usize,
}

impl Settled {
    pub fn correct(&self) -> bool {
        self.problem_count == 0
    }
}

/// One replica's resident memory over a window.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Rss {
    pub median_mib: f64,
    pub max_mib: f64,
    pub samples: usize,
}

/// The steady window.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Steady {
    /// Waited for the audit log to show no write but the Lease's for 3 s.
    pub quiet_after_s: f64,
    pub leader_rss: Rss,
    pub standby_rss: Rss,
    /// Each replica's peak RSS since it started (loading and settling
    /// included), at the end of the window.
    pub leader_peak_mib: Option<f64>,
    pub standby_peak_mib: Option<f64>,
    pub leader: audit::Counts,
    pub standby: audit::Counts,
}

/// An edit and the pods it retuned.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Retune {
    pub lifecycle: String,
    pub knob: String,
    pub value: String,
    pub pods_expected: usize,
    pub pods_reached: usize,
    /// From the edit's request until each pod was seen carrying the value.
    pub seconds: Spread,
    /// The leader's pod patches for it, and their rate (first to last).
    pub patches: usize,
    pub patches_per_s: f64,
}

/// The cluster-default edit, with the webhook under load meanwhile.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DefaultEdit {
    pub retune: Retune,
    pub webhook: webhook_load::Outcome,
}

/// The API server's own bound on pod patches, Remora's writes out of it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Ceiling {
    pub patches: usize,
    pub errors: usize,
    pub first_errors: Vec<String>,
    pub in_flight: usize,
    /// From the first patch sent to the last answered.
    pub seconds: f64,
    pub patches_per_s: f64,
    /// The reviews sent to the leader meanwhile.
    pub webhook: webhook_load::Outcome,
}

/// What [`Run::ceiling`] writes: outside Remora's prefix, so no replica
/// keeps it (their watches still carry every update).
pub const CEILING_ANNOTATION: &str = "bench.remora.test/ceiling";

/// Patches the ceiling keeps in flight: as many as the leader does.
pub const CEILING_IN_FLIGHT: usize = 32;

/// The leader's crash.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Failover {
    pub killed: String,
    pub new_leader: String,
    /// SIGKILL until the standby held the Lease.
    pub lease_takeover_s: f64,
    /// SIGKILL until the standby wrote the edited lifecycle's status with
    /// its new observedGeneration.
    pub failover_s: f64,
    /// The new leader's RSS then (after its initial list and reconciles).
    pub new_leader_rss_mib: f64,
    /// The killed leader's peak RSS over its life (every step before).
    pub killed_leader_peak_mib: Option<f64>,
}

/// Everything a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub load: Load,
    pub pods_planned: usize,
    pub lifecycles_planned: usize,
    pub populate_phases: Vec<scale::Phase>,
    pub load_problems: Vec<String>,
    pub leader: String,
    pub settled: StepResult<Settled>,
    pub steady: StepResult<Steady>,
    pub webhook_steady: StepResult<webhook_load::Outcome>,
    pub big_namespace_retune: StepResult<Retune>,
    pub cluster_default: StepResult<DefaultEdit>,
    pub ceiling: StepResult<Ceiling>,
    pub failover: StepResult<Failover>,
    /// The statuses once every edit is done.
    pub final_status: StepResult<Settled>,
}

/// The replicas and the control plane they run against.
pub struct Run {
    pub opts: Options,
    pub cp: ControlPlane,
    pub client: Client,
    pub audit_log: PathBuf,
    /// Named as [`REPLICAS`]; `None` once killed.
    pub replicas: Vec<(String, Option<Operator>)>,
    pub watch: PodWatch,
    pub populated: Populated,
    /// Each replica's kubeconfig (its service account's token).
    kubeconfigs: BTreeMap<String, PathBuf>,
    _dir: tempfile::TempDir,
}

/// RSS of `pid` from /proc (MiB); `None` when it is gone.
pub fn rss_mib(pid: u32) -> Option<f64> {
    proc_status_mib(pid, "VmRSS:")
}

/// The most `pid` has had resident since it started (VmHWM, MiB): what a
/// memory limit must cover, which sampling can miss.
pub fn peak_rss_mib(pid: u32) -> Option<f64> {
    proc_status_mib(pid, "VmHWM:")
}

fn proc_status_mib(pid: u32, key: &str) -> Option<f64> {
    crate::agentbench::proc_status_kib(pid, key).map(|kb| kb as f64 / 1024.0)
}

fn rss_of(samples: &[f64]) -> Rss {
    let s = Summary::of(samples);
    Rss {
        median_mib: s.p50_ms,
        max_mib: s.max_ms,
        samples: s.n,
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

/// A kubeconfig that authenticates with `token` only.
fn token_kubeconfig(cp: &ControlPlane, token: &str, path: &std::path::Path) -> Result<(), Error> {
    let ca = cp
        .pki()
        .map(|p| p.ca_cert.display().to_string())
        .ok_or_else(|| Error::Unexpected("the scale run needs a local control plane".into()))?;
    let kc = json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "scale", "cluster": {"server": cp.server_url(), "certificate-authority": ca}}],
        "users": [{"name": "scale", "user": {"token": token}}],
        "contexts": [{"name": "scale", "context": {"cluster": "scale", "user": "scale"}}],
        "current-context": "scale",
    });
    std::fs::write(path, kc.to_string()).map_err(io(format!("writing {}", path.display())))
}

/// A client of that kubeconfig.
async fn client_from(path: &std::path::Path) -> Result<Client, Error> {
    let kc = kube::config::Kubeconfig::read_from(path)
        .map_err(|e| Error::Unexpected(format!("reading {}: {e}", path.display())))?;
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(|e| Error::Unexpected(format!("kubeconfig {}: {e}", path.display())))?;
    Client::try_from(config).map_err(kube_err(format!("a client of {}", path.display())))
}

impl Run {
    /// Starts the control plane (with the audit log), the replicas and the
    /// webhook, then creates the load through it.
    pub async fn start(opts: Options) -> Result<Self, Error> {
        let load = &opts.load;
        let op = load.operator_namespace.clone();
        // Refuse a bad size before starting anything.
        scale::Plan::new(load)?;
        let dir = tempfile::Builder::new()
            .prefix("remora-scale-")
            .tempdir()
            .map_err(io("creating a temp dir"))?;
        let users: Vec<String> = REPLICAS
            .iter()
            .map(|r| audit::service_account_user(&op, r))
            .collect();
        let policy = dir.path().join("audit-policy.json");
        std::fs::write(&policy, audit::policy(&users)).map_err(io("writing the audit policy"))?;
        let audit_log = dir.path().join("audit.log");
        let mut cp_opts = controlplane::Options::without_controller_manager();
        cp_opts.apiserver_args = audit::apiserver_args(&policy, &audit_log);
        let cp = ControlPlane::start(cp_opts).await?;
        let client = cp.client()?;
        crate::chart::install_crds(&client).await?;

        // The operator's namespace (as populate makes it) and identities.
        let labels = BTreeMap::from([
            (RUN_LABEL.to_owned(), load.run.clone()),
            (NAMESPACE_LABEL.0.to_owned(), NAMESPACE_LABEL.1.to_owned()),
        ]);
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(op.clone()),
                labels: Some(labels),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .map_err(kube_err(format!("namespace {op}")))?;
        identities(&client, &op).await?;

        // Both replicas, before any pod.
        let mut starts = Vec::new();
        let mut kubeconfigs = BTreeMap::new();
        for name in REPLICAS {
            let token = service_account_token(&client, &op, name).await?;
            let kc = dir.path().join(format!("{name}.kubeconfig"));
            token_kubeconfig(&cp, &token, &kc)?;
            kubeconfigs.insert(name.to_owned(), kc.clone());
            let mut o = operator::Options::new(&op);
            o.controller = true;
            o.env = vec![("POD_NAME".to_owned(), name.to_owned())];
            o.args = opts.operator_args.clone();
            o.start_timeout = Duration::from_secs(120);
            starts.push(async move { Operator::start(&kc, o).await });
        }
        let [a, b]: [Operator; 2] = futures::future::try_join_all(starts)
            .await?
            .try_into()
            .map_err(|_| Error::Unexpected("two replicas".into()))?;

        // The webhook: the chart's configuration, pointed at a, limited to
        // the load's namespaces and a probe namespace to see it in force.
        let plan = scale::Plan::new(load)?;
        let probe = format!("{}-probe", load.run);
        let mut namespaces: Vec<&str> = plan.namespaces.iter().map(String::as_str).collect();
        namespaces.push(&probe);
        let mwc = crate::webhook::webhook_config(
            &format!("{}-scale", load.run),
            &a,
            &namespaces,
            "Fail",
        )?;
        Api::<MutatingWebhookConfiguration>::all(client.clone())
            .create(&PostParams::default(), &mwc)
            .await
            .map_err(kube_err("the webhook configuration"))?;
        let mut probe_ns = Namespace::default();
        probe_ns.metadata.name = Some(probe.clone());
        probe_ns.metadata.labels = Some(BTreeMap::from([
            (
                remora_contract::annotations::INJECT_LABEL.to_owned(),
                "enabled".to_owned(),
            ),
            (NAMESPACE_LABEL.0.to_owned(), NAMESPACE_LABEL.1.to_owned()),
        ]));
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &probe_ns)
            .await
            .map_err(kube_err("the probe namespace"))?;
        wait_webhook(&client, &probe, &a).await?;

        let watch = PodWatch::start(client.clone(), &format!("{RUN_LABEL}={}", load.run));
        let populated = scale::populate(&client, load).await?;
        Ok(Self {
            opts,
            cp,
            client,
            audit_log,
            replicas: vec![
                (REPLICAS[0].to_owned(), Some(a)),
                (REPLICAS[1].to_owned(), Some(b)),
            ],
            watch,
            populated,
            kubeconfigs,
            _dir: dir,
        })
    }

    fn replica(&self, name: &str) -> Option<&Operator> {
        self.replicas
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, i)| i.as_ref())
    }

    /// The Lease's holder.
    pub async fn leader(&self) -> Result<Option<String>, Error> {
        let api: Api<Lease> =
            Api::namespaced(self.client.clone(), &self.opts.load.operator_namespace);
        Ok(api
            .get_opt(LEASE)
            .await
            .map_err(kube_err("the Lease"))?
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity))
    }

    fn other(&self, name: &str) -> String {
        REPLICAS
            .iter()
            .find(|r| **r != name)
            .map(|r| (*r).to_owned())
            .unwrap_or_default()
    }

    fn user(&self, replica: &str) -> String {
        audit::service_account_user(&self.opts.load.operator_namespace, replica)
    }

    /// The load's SidecarLifecycles as the API server holds them.
    async fn lifecycles(&self) -> Result<Vec<Value>, Error> {
        let api: Api<DynamicObject> =
            Api::all_with(self.client.clone(), &scale::lifecycle_resource());
        let list = api
            .list(
                &kube::api::ListParams::default()
                    .labels(&format!("{RUN_LABEL}={}", self.opts.load.run)),
            )
            .await
            .map_err(kube_err("listing SidecarLifecycles"))?;
        list.items
            .into_iter()
            .map(|o| serde_json::to_value(o).map_err(Error::from))
            .collect()
    }

    /// Every planned pod with what the watch saw the webhook record.
    fn pod_facts(&self) -> Vec<PodFacts> {
        let seen = self.watch.snapshot();
        self.populated
            .plan
            .workloads
            .iter()
            .flat_map(|w| {
                let seen = &seen;
                w.pods.iter().map(move |p| PodFacts {
                    namespace: w.namespace.clone(),
                    name: p.name.clone(),
                    labels: p.labels.clone(),
                    sources: seen
                        .get(&(w.namespace.clone(), p.name.clone()))
                        .and_then(|s| s.sources.clone()),
                })
            })
            .collect()
    }

    /// Compares every status and every pod's drainDuration with what they
    /// should be, now.
    async fn judge(&self) -> Result<Settled, Error> {
        let objects = self.lifecycles().await?;
        let facts: Vec<LifecycleFacts> = objects.iter().map(lifecycle_facts).collect();
        let pods = self.pod_facts();
        let op = &self.opts.load.operator_namespace;
        let want = expect::statuses(&facts, &pods, op);
        let mut problems = Vec::new();
        for o in &objects {
            let key = (
                o["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                o["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            );
            let w: &Expected = match want.get(&key) {
                Some(w) => w,
                None => continue,
            };
            for p in expect::status_problems(w, o) {
                problems.push(format!("{}/{}: {p}", key.0, key.1));
            }
        }
        if objects.len() != self.populated.plan.lifecycles.len() {
            problems.push(format!(
                "{} SidecarLifecycles listed, {} planned",
                objects.len(),
                self.populated.plan.lifecycles.len()
            ));
        }
        let seen = self.watch.snapshot();
        let mut mistuned = 0usize;
        let index_pods = pods.iter().filter(|p| p.sources.is_some()).count();
        let drains = expect::knobs(&facts, &pods, op, "drainDuration");
        for (p, want) in pods.iter().zip(drains) {
            let got = seen.get(&(p.namespace.clone(), p.name.clone()));
            let ok = match (&want, got) {
                (Some(v), Some(s)) => s.carries("drainDuration", v),
                (None, Some(s)) => s.shutdown.contains_key("drainDuration"),
                (_, None) => false,
            };
            if !ok {
                mistuned += 1;
                if mistuned <= 3 {
                    problems.push(format!(
                        "pod {}/{}: drainDuration {:?}, expected {want:?}",
                        p.namespace,
                        p.name,
                        got.and_then(|s| s.shutdown.get("drainDuration"))
                    ));
                }
            }
        }
        if index_pods != pods.len() {
            problems.push(format!("{} of {} pods injected", index_pods, pods.len()));
        }
        let problem_count = problems.len();
        problems.truncate(20);
        Ok(Settled {
            seconds: 0.0,
            pods: pods.len(),
            pods_injected: index_pods,
            pods_mistuned: mistuned,
            lifecycles: objects.len(),
            problems,
            problem_count,
        })
    }

    /// Waits until [`Run::judge`] finds nothing wrong (or the step times
    /// out: then the last judgement, not correct).
    pub async fn settle(&self, since: Instant) -> Result<StepResult<Settled>, Error> {
        let deadline = Instant::now() + self.opts.step_timeout;
        loop {
            let mut s = self.judge().await?;
            s.seconds = since.elapsed().as_secs_f64();
            if s.correct() {
                return Ok(StepResult::Done(s));
            }
            if Instant::now() >= deadline {
                return Ok(StepResult::TimedOut(format!(
                    "{} problems after {:?}, first: {:?}",
                    s.problem_count, self.opts.step_timeout, s.problems
                )));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Waits until neither replica wrote anything but the Lease for 3 s,
    /// then samples both replicas' RSS and counts their requests over the
    /// steady window.
    pub async fn steady(&self, leader: &str) -> Result<StepResult<Steady>, Error> {
        let standby = self.other(leader);
        let users = [self.user(leader), self.user(&standby)];
        let t0 = Instant::now();
        let deadline = t0 + self.opts.step_timeout;
        let quiet = Duration::from_secs(3);
        loop {
            let reqs = audit::read(&self.audit_log)?;
            let to = Timestamp::now();
            let from = to - quiet;
            let writes: usize = users
                .iter()
                .map(|u| audit::count(&reqs, u, from, to).writes)
                .sum();
            if writes == 0 && t0.elapsed() >= quiet {
                break;
            }
            if Instant::now() >= deadline {
                return Ok(StepResult::TimedOut(format!(
                    "still writing ({writes} non-Lease writes in the last 3 s)"
                )));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let quiet_after_s = t0.elapsed().as_secs_f64();
        let (Some(l), Some(s)) = (self.replica(leader), self.replica(&standby)) else {
            return Ok(StepResult::Failed("a replica is gone".into()));
        };
        let from = Timestamp::now();
        let end = Instant::now() + self.opts.steady;
        let (mut lr, mut sr) = (Vec::new(), Vec::new());
        while Instant::now() < end {
            lr.extend(rss_mib(l.pid()));
            sr.extend(rss_mib(s.pid()));
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let to = Timestamp::now();
        let reqs = audit::read(&self.audit_log)?;
        Ok(StepResult::Done(Steady {
            quiet_after_s,
            leader_rss: rss_of(&lr),
            standby_rss: rss_of(&sr),
            leader_peak_mib: peak_rss_mib(l.pid()),
            standby_peak_mib: peak_rss_mib(s.pid()),
            leader: audit::count(&reqs, &users[0], from, to),
            standby: audit::count(&reqs, &users[1], from, to),
        }))
    }

    /// A realistic review: a pod of the first namespace's first workload.
    fn review_pod(&self) -> (Value, String) {
        let plan = &self.populated.plan;
        let Some(w) = plan.workloads.first() else {
            return (json!({}), String::new());
        };
        let p = &w.pods[0];
        let (kind, api_version) = w.kind.pod_owner();
        let owner = w.pod_owner_name();
        let uid = self
            .populated
            .owner_uids
            .get(&(w.namespace.clone(), owner.clone()))
            .cloned()
            .unwrap_or_default();
        let pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "generateName": format!("{owner}-"),
                "namespace": w.namespace,
                "labels": p.labels,
                "ownerReferences": [{"apiVersion": api_version, "kind": kind, "name": owner,
                    "uid": uid, "controller": true, "blockOwnerDeletion": true}],
            },
            "spec": {
                "containers": [{"name": "app", "image": "registry.invalid/app:1",
                    "ports": [{"containerPort": 8080, "protocol": "TCP"}],
                    "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}],
                "restartPolicy": "Always",
                "terminationGracePeriodSeconds": 30,
                "serviceAccountName": "default",
            },
        });
        (pod, w.namespace.clone())
    }

    /// The open-loop webhook client against `replica` for `duration` (or
    /// until `stop`).
    async fn webhook(
        &self,
        replica: &str,
        duration: Duration,
        stop: CancellationToken,
    ) -> Option<webhook_load::Outcome> {
        let inj = self.replica(replica)?;
        let (pod, ns) = self.review_pod();
        Some(
            webhook_load::run(
                inj.addr(),
                inj.ca_pem(),
                &pod,
                &ns,
                self.opts.rate,
                stop,
                duration,
            )
            .await,
        )
    }

    /// The webhook with no reconcile running.
    pub async fn webhook_steady(&self, leader: &str) -> StepResult<webhook_load::Outcome> {
        match self
            .webhook(leader, self.opts.webhook_steady, CancellationToken::new())
            .await
        {
            Some(o) => StepResult::Done(o),
            None => StepResult::Failed(format!("{leader} is gone")),
        }
    }

    /// Edits `shutdown.<knob>` of lifecycle `ns/name` to `value` and times
    /// until every pod that should carry it does.
    async fn retune(
        &self,
        ns: &str,
        name: &str,
        knob: &str,
        value: &str,
        leader: &str,
    ) -> Result<StepResult<Retune>, Error> {
        let mut facts: Vec<LifecycleFacts> = self
            .lifecycles()
            .await?
            .iter()
            .map(lifecycle_facts)
            .collect();
        let Some(edited) = facts
            .iter_mut()
            .find(|l| l.namespace == ns && l.name == name)
        else {
            return Ok(StepResult::Failed(format!(
                "no SidecarLifecycle {ns}/{name}"
            )));
        };
        edited.spec["shutdown"][knob] = json!(value);
        let pods = self.pod_facts();
        let op = &self.opts.load.operator_namespace;
        let expected: BTreeSet<PodKey> = expect::carried_from(&facts, &pods, op, (ns, name), knob);
        self.watch.target(knob, value);
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), ns, &scale::lifecycle_resource());
        let from = Timestamp::now();
        let t0 = Instant::now();
        api.patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"shutdown": {knob: value}}})),
        )
        .await
        .map_err(kube_err(format!("editing {ns}/{name}")))?;
        let times = self
            .watch
            .wait_reached(&expected, t0, self.opts.step_timeout)
            .await;
        let reached: Vec<f64> = times
            .iter()
            .flatten()
            .map(|d| d.as_secs_f64() * 1000.0)
            .collect();
        let to = Timestamp::now();
        let reqs = audit::read(&self.audit_log)?;
        let user = self.user(leader);
        let patches: Vec<&audit::Request> = reqs
            .iter()
            .filter(|r| {
                r.user == user
                    && r.verb == "patch"
                    && r.resource == "pods"
                    && r.received >= from
                    && r.received < to
            })
            .collect();
        let span = match (patches.first(), patches.last()) {
            (Some(a), Some(b)) => {
                (b.received.as_millisecond() - a.received.as_millisecond()) as f64 / 1000.0
            }
            _ => 0.0,
        };
        let r = Retune {
            lifecycle: format!("{ns}/{name}"),
            knob: knob.to_owned(),
            value: value.to_owned(),
            pods_expected: expected.len(),
            pods_reached: reached.len(),
            seconds: Spread::of(&Summary::of(&reached)),
            patches: patches.len(),
            patches_per_s: audit::rate(patches.len().saturating_sub(1), span),
        };
        if r.pods_reached < r.pods_expected {
            return Ok(StepResult::TimedOut(format!(
                "{} of {} pods carried {knob}={value} after {:?}",
                r.pods_reached, r.pods_expected, self.opts.step_timeout
            )));
        }
        Ok(StepResult::Done(r))
    }

    /// The big namespace's lifecycle: drainDuration one second longer.
    pub async fn retune_big(&self, leader: &str) -> Result<StepResult<Retune>, Error> {
        let ns = self.opts.load.big_namespace();
        if self.opts.load.big_namespace_pods == 0 {
            return Ok(StepResult::Skipped("no big namespace".into()));
        }
        let value = self.bumped(&ns, BIG_LIFECYCLE, "drainDuration").await?;
        self.retune(&ns, BIG_LIFECYCLE, "drainDuration", &value, leader)
            .await
    }

    /// A value of `shutdown.<knob>` one second longer than the lifecycle's
    /// (or than the contract's default when it sets none).
    async fn bumped(&self, ns: &str, name: &str, knob: &str) -> Result<String, Error> {
        let objects = self.lifecycles().await?;
        let current = objects
            .iter()
            .find(|o| o["metadata"]["namespace"] == ns && o["metadata"]["name"] == name)
            .and_then(|o| o["spec"]["shutdown"][knob].as_str())
            .and_then(|v| remora_contract::duration::parse(v).ok())
            .unwrap_or(Duration::from_secs(5));
        Ok(format!("{}s", current.as_secs() + 1))
    }

    /// The cluster default gets a terminationDrainDuration (no other layer
    /// sets one, so every pod should carry it) while the webhook client
    /// sends `rate` reviews a second to the leader.
    pub async fn edit_default(&self, leader: &str) -> Result<StepResult<DefaultEdit>, Error> {
        let op = self.opts.load.operator_namespace.clone();
        let name = format!("{}-cluster-default", self.opts.load.run);
        let knob = "terminationDrainDuration";
        let value = self.bumped(&op, &name, knob).await?;
        let stop = CancellationToken::new();
        let load = self.webhook(leader, self.opts.step_timeout, stop.clone());
        let edit = async {
            let r = self.retune(&op, &name, knob, &value, leader).await;
            stop.cancel();
            r
        };
        let (webhook, retune) = tokio::join!(load, edit);
        let webhook = webhook.unwrap_or_default();
        Ok(match retune? {
            StepResult::Done(retune) => StepResult::Done(DefaultEdit { retune, webhook }),
            StepResult::TimedOut(m) => StepResult::TimedOut(m),
            StepResult::Failed(m) => StepResult::Failed(m),
            StepResult::Skipped(m) => StepResult::Skipped(m),
        })
    }

    /// What the API server here accepts, measured the way the cluster
    /// default's edit ran with Remora out of it: the bench patches every
    /// planned pod with an annotation no replica keeps, as the leader's
    /// service account (its flow in the API server's fairness), as many in
    /// flight as the leader keeps and no rate limit, while the webhook
    /// client sends `rate` reviews a second to the leader. The same pods,
    /// watches and review load: the edit's rate against this one is what
    /// Remora leaves on the table, and the webhook's latency here is the
    /// machine's with no reconcile running.
    pub async fn ceiling(&self, leader: &str) -> Result<StepResult<Ceiling>, Error> {
        use futures::StreamExt as _;
        let Some(kubeconfig) = self.kubeconfigs.get(leader) else {
            return Ok(StepResult::Failed(format!("no kubeconfig of {leader}")));
        };
        let client = client_from(kubeconfig).await?;
        let pods = self.pod_facts();
        let stop = CancellationToken::new();
        let load = self.webhook(leader, self.opts.step_timeout, stop.clone());
        let value = Timestamp::now().to_string();
        let patches = async {
            let t0 = Instant::now();
            let results: Vec<Result<(), String>> = futures::stream::iter(&pods)
                .map(|p| {
                    let api: Api<Pod> = Api::namespaced(client.clone(), &p.namespace);
                    let patch = Patch::Merge(
                        json!({"metadata": {"annotations": {CEILING_ANNOTATION: &value}}}),
                    );
                    async move {
                        api.patch_metadata(&p.name, &PatchParams::default(), &patch)
                            .await
                            .map(drop)
                            .map_err(|e| format!("{}/{}: {e}", p.namespace, p.name))
                    }
                })
                .buffer_unordered(CEILING_IN_FLIGHT)
                .collect()
                .await;
            let took = t0.elapsed();
            stop.cancel();
            (results, took)
        };
        let (webhook, (results, took)) = tokio::join!(load, patches);
        let errors: Vec<String> = results.into_iter().filter_map(Result::err).collect();
        let ok = pods.len().saturating_sub(errors.len());
        let seconds = took.as_secs_f64();
        Ok(StepResult::Done(Ceiling {
            patches: ok,
            errors: errors.len(),
            first_errors: errors.into_iter().take(5).collect(),
            in_flight: CEILING_IN_FLIGHT,
            seconds,
            patches_per_s: audit::rate(ok, seconds),
            webhook: webhook.unwrap_or_default(),
        }))
    }

    /// SIGKILL of the leader, then an edit of the first namespace's
    /// namespace-wide lifecycle: until the standby holds the Lease, and
    /// until it has written that lifecycle's status for the new generation.
    pub async fn failover(&mut self, leader: &str) -> Result<StepResult<Failover>, Error> {
        let standby = self.other(leader);
        let Some(ns) = self.populated.plan.namespaces.first().cloned() else {
            return Ok(StepResult::Skipped("no namespace".into()));
        };
        let name = "wide";
        let value = self.bumped(&ns, name, "drainDuration").await?;
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &ns, &scale::lifecycle_resource());
        let leases: Api<Lease> =
            Api::namespaced(self.client.clone(), &self.opts.load.operator_namespace);
        let Some(inj) = self
            .replicas
            .iter_mut()
            .find(|(n, _)| n == leader)
            .and_then(|(_, i)| i.as_mut())
        else {
            return Ok(StepResult::Failed(format!("{leader} is gone")));
        };
        let killed_leader_peak_mib = peak_rss_mib(inj.pid());
        let t0 = Instant::now();
        inj.signal(Signal::SIGKILL);
        let edited = api
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"shutdown": {"drainDuration": value}}})),
            )
            .await
            .map_err(kube_err(format!("editing {ns}/{name}")))?;
        let generation = edited.metadata.generation.unwrap_or_default();
        let deadline = t0 + self.opts.step_timeout;
        let lease = async {
            loop {
                let holder = leases
                    .get_opt(LEASE)
                    .await
                    .ok()
                    .flatten()
                    .and_then(|l| l.spec)
                    .and_then(|s| s.holder_identity);
                if holder.as_deref() == Some(standby.as_str()) {
                    return Some(t0.elapsed());
                }
                if Instant::now() >= deadline {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        let status = async {
            loop {
                let observed = api
                    .get(name)
                    .await
                    .ok()
                    .and_then(|o| o.data["status"]["observedGeneration"].as_i64());
                if observed == Some(generation) {
                    return Some(t0.elapsed());
                }
                if Instant::now() >= deadline {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        let (lease, status) = tokio::join!(lease, status);
        let new_leader_rss_mib = self
            .replica(&standby)
            .and_then(|i| rss_mib(i.pid()))
            .unwrap_or(0.0);
        if let Some((_, i)) = self.replicas.iter_mut().find(|(n, _)| n == leader) {
            // Reaped, and never used again.
            i.take();
        }
        let (Some(lease), Some(status)) = (lease, status) else {
            return Ok(StepResult::TimedOut(format!(
                "after SIGKILL of {leader}: Lease to {standby} {lease:?}, status of {ns}/{name} \
                 generation {generation} {status:?}"
            )));
        };
        Ok(StepResult::Done(Failover {
            killed: leader.to_owned(),
            new_leader: standby,
            lease_takeover_s: lease.as_secs_f64(),
            failover_s: status.as_secs_f64(),
            new_leader_rss_mib,
            killed_leader_peak_mib,
        }))
    }

    /// The operator logs, for a failure's context.
    pub fn logs(&self) -> String {
        self.replicas
            .iter()
            .filter_map(|(n, i)| i.as_ref().map(|i| format!("{n}:\n{}", i.log_tail())))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// The ServiceAccounts of [`REPLICAS`] in `ns`, bound to the chart's own
/// ClusterRole and Role (rendered by helm, as least_privilege does).
async fn identities(client: &Client, ns: &str) -> Result<(), Error> {
    let objects = crate::chart::render(RELEASE, ns, &[])?;
    let subjects: Vec<Value> = REPLICAS
        .iter()
        .map(|r| json!({"kind": "ServiceAccount", "name": r, "namespace": ns}))
        .collect();
    let mut wanted: Vec<Value> = REPLICAS
        .iter()
        .map(|r| json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": r, "namespace": ns}}))
        .collect();
    for o in &objects {
        match o["kind"].as_str() {
            Some("ClusterRole" | "Role") => wanted.push(o.clone()),
            Some("ClusterRoleBinding" | "RoleBinding") => {
                let mut b = o.clone();
                b["subjects"] = json!(subjects);
                wanted.push(b);
            }
            _ => {}
        }
    }
    crate::chart::apply(
        client,
        ns,
        &wanted,
        &[
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
        ],
    )
    .await?;
    Ok(())
}

/// Waits until the API server calls the webhook: a dry-run pod in the probe
/// namespace comes back with the sidecar.
async fn wait_webhook(client: &Client, probe_ns: &str, inj: &Operator) -> Result<(), Error> {
    let api: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), probe_ns);
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let probe = crate::webhook::pod("probe", &[], &[]);
    let r = remora_test_support::wait::wait_until(
        Duration::from_secs(60),
        "the webhook in force",
        || async {
            let p = api.create(&dry, &probe).await?;
            Ok::<_, crate::controlplane::Error>(crate::webhook::sidecar(&p).map(|_| ()))
        },
    )
    .await;
    r.map_err(|e| Error::Unexpected(format!("{e}; the operator's log:\n{}", inj.log_tail())))
}

fn lifecycle_facts(o: &Value) -> LifecycleFacts {
    let m = &o["metadata"];
    let created = m["creationTimestamp"]
        .as_str()
        .and_then(|t| t.parse::<Timestamp>().ok())
        .map(|t| t.to_string())
        .unwrap_or_default();
    let selector = o["spec"]["selector"]["matchLabels"].as_object().map(|m| {
        m.iter()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
            .collect()
    });
    LifecycleFacts {
        namespace: m["namespace"].as_str().unwrap_or_default().to_owned(),
        name: m["name"].as_str().unwrap_or_default().to_owned(),
        created,
        generation: m["generation"].as_i64().unwrap_or_default(),
        selector,
        spec: o["spec"].clone(),
    }
}

/// Runs every step of `opts` and reports. Only the setup is fatal.
pub async fn run(opts: Options) -> Result<(Report, Run), Error> {
    let mut run = Run::start(opts).await?;
    let load_end = Instant::now();
    let checked = scale::check(&run.client, &run.populated).await?;
    let leader = run.leader().await?.unwrap_or_default();
    let settled = run.settle(load_end).await?;
    // The leader may have changed (it should not have).
    let leader = run.leader().await?.unwrap_or(leader);
    let steady = if settled.done().is_some() {
        run.steady(&leader).await?
    } else {
        StepResult::Skipped("not settled".into())
    };
    let big = run.retune_big(&leader).await?;
    let (webhook_steady, cluster_default) = if run.opts.cluster_default_edit {
        (
            run.webhook_steady(&leader).await,
            run.edit_default(&leader).await?,
        )
    } else {
        (
            StepResult::Skipped("not asked".into()),
            StepResult::Skipped("not asked".into()),
        )
    };
    let ceiling = if run.opts.ceiling {
        run.ceiling(&leader).await?
    } else {
        StepResult::Skipped("not asked".into())
    };
    let failover = if run.opts.failover {
        run.failover(&leader).await?
    } else {
        StepResult::Skipped("not asked".into())
    };
    let final_status = run.settle(Instant::now()).await?;
    let plan = &run.populated.plan;
    let report = Report {
        load: run.opts.load.clone(),
        pods_planned: plan.pods(),
        lifecycles_planned: plan.lifecycles.len(),
        populate_phases: run.populated.phases.clone(),
        load_problems: checked.problems.into_iter().take(20).collect(),
        leader,
        settled,
        steady,
        webhook_steady,
        big_namespace_retune: big,
        cluster_default,
        ceiling,
        failover,
        final_status,
    };
    Ok((report, run))
}
