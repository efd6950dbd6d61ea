//! The `SidecarLifecycle` controller. It runs on the elected leader only
//! (the webhook serves on every replica) and, for each resource:
//!
//! - writes `status` (Accepted, Conflicted, Applied, RestartRequired,
//!   `matchedPods`, `observedGeneration`) by server-side apply with the field
//!   manager [`FIELD_MANAGER`], and only when it changed;
//! - retunes running pods: when a setting the agent reads at runtime (drain
//!   settings) changes, it patches the pods' `remora.dev/lifecycle`
//!   annotation, which the agent reads through the downward API;
//! - when a setting only a restart applies changes, reports
//!   `RestartRequired`; with `rolloutPolicy: Automatic` it rolls the owning
//!   Deployment/StatefulSet/DaemonSet through a pod-template annotation,
//!   at most one rollout per `rollout_interval`;
//! - records each decision as a Kubernetes Event on the resource and on the
//!   pods it touched, and counts reconciles, errors and durations.
//!
//! Reconciles are idempotent: they compare what is with what should be and
//! write only the difference, so a replayed or concurrent reconcile changes
//! nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use remora_agent::lifecycle::LIFECYCLE_ANNOTATION;
use remora_crds::{RolloutPolicy, SidecarLifecycle, SidecarLifecycleStatus, condition};
use serde_json::json;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::mutate::STATUS_ANNOTATION;
use crate::sidecar_config::{ChartDefaults, LifecycleEntry};
use crate::status::{
    PodInfo, RestartReport, compute, keep_transition_times, reaches, refreshed_lifecycle,
    restart_condition, restart_report,
};

/// The field manager of every server-side apply the controller makes.
pub const FIELD_MANAGER: &str = "remora-injector";
/// Pod-template annotation that rolls a workload; its value is the restart
/// hash the new pods get, so the same rollout is never asked for twice.
pub const ROLLOUT_ANNOTATION: &str = "remora.dev/restarted-for";
/// How often every resource is reconciled even without a change.
const RESYNC: Duration = Duration::from_secs(300);

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("writing the status of {resource}: {source}")]
    Status {
        resource: String,
        #[source]
        source: kube::Error,
    },
    #[error("patching the lifecycle annotation of pod {pod}: {source}")]
    Retune {
        pod: String,
        #[source]
        source: kube::Error,
    },
    #[error("rolling {workload}: {source}")]
    Rollout {
        workload: String,
        #[source]
        source: kube::Error,
    },
    #[error("the pod store did not sync within {0:?}")]
    NotSynced(Duration),
}

impl ControllerError {
    fn kind(&self) -> &'static str {
        match self {
            Self::Status { .. } => "status",
            Self::Retune { .. } => "retune",
            Self::Rollout { .. } => "rollout",
            Self::NotSynced(_) => "not_synced",
        }
    }
}

/// What the controller is told at start.
#[derive(Debug, Clone)]
pub struct Settings {
    pub chart: ChartDefaults,
    pub operator_namespace: String,
    /// Minimum time between two automatic rollouts, cluster-wide.
    pub rollout_interval: Duration,
    /// Who publishes the Events (the pod name).
    pub identity: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

/// The controller's metrics, registered in the injector's registry.
#[derive(Clone, Debug)]
pub struct ControllerMetrics {
    reconciles: Family<ResultLabels, Counter>,
    duration: Histogram,
    retuned: Counter,
    rollouts: Counter,
    status_writes: Counter,
}

impl ControllerMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let reconciles = Family::<ResultLabels, Counter>::default();
        registry.register(
            "controller_reconciles",
            "SidecarLifecycle reconciles, by result (ok or the error kind)",
            reconciles.clone(),
        );
        // 1ms .. ~16s
        let duration = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        registry.register(
            "controller_reconcile_duration_seconds",
            "Time of one SidecarLifecycle reconcile, API writes included",
            duration.clone(),
        );
        let retuned = Counter::default();
        registry.register(
            "controller_pods_retuned",
            "Pods whose remora.dev/lifecycle annotation the controller updated",
            retuned.clone(),
        );
        let rollouts = Counter::default();
        registry.register(
            "controller_rollouts",
            "Workloads the controller rolled (rolloutPolicy Automatic)",
            rollouts.clone(),
        );
        let status_writes = Counter::default();
        registry.register(
            "controller_status_writes",
            "SidecarLifecycle statuses written (server-side apply)",
            status_writes.clone(),
        );
        Self {
            reconciles,
            duration,
            retuned,
            rollouts,
            status_writes,
        }
    }

    fn observe(&self, result: &'static str, took: Duration) {
        self.reconciles
            .get_or_create(&ResultLabels { result })
            .inc();
        self.duration.observe(took.as_secs_f64());
    }
}

/// At most one automatic rollout per interval, so a change to a resource
/// that governs many workloads never restarts them all at once.
#[derive(Debug)]
pub struct RolloutLimiter {
    interval: Duration,
    last: Option<Instant>,
}

impl RolloutLimiter {
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            last: None,
        }
    }

    /// Take the slot, or learn how long until it frees.
    pub fn try_acquire(&mut self, now: Instant) -> Result<(), Duration> {
        if let Some(last) = self.last {
            let free_at = last + self.interval;
            if now < free_at {
                return Err(free_at - now);
            }
        }
        self.last = Some(now);
        Ok(())
    }
}

/// A decision worth an Event on the resource, from a change of condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

/// The Events a status change calls for: each condition that turned True
/// or False since `prev` (a first status reports where it starts).
pub fn decisions(
    prev: Option<&SidecarLifecycleStatus>,
    next: &SidecarLifecycleStatus,
) -> Vec<Decision> {
    let mut out = Vec::new();
    for c in &next.conditions {
        let before = prev
            .and_then(|p| p.conditions.iter().find(|p| p.type_ == c.type_))
            .map(|p| p.status.as_str());
        if before == Some(c.status.as_str()) {
            continue;
        }
        let now_true = c.status == "True";
        let (warning, reason) = match (c.type_.as_str(), now_true) {
            (condition::ACCEPTED, true) => (false, "Accepted"),
            (condition::ACCEPTED, false) => (true, "InvalidSpec"),
            (condition::CONFLICTED, true) => (true, "Conflicted"),
            (condition::CONFLICTED, false) if before.is_some() => (false, "ConflictResolved"),
            (condition::RESTART_REQUIRED, true) => (true, "RestartRequired"),
            (condition::RESTART_REQUIRED, false) if before.is_some() => (false, "PodsRestarted"),
            _ => continue,
        };
        out.push(Decision {
            warning,
            reason,
            note: c.message.clone(),
        });
    }
    out
}

struct Ctx {
    client: Client,
    settings: Settings,
    pods: Store<PartialObjectMeta<Pod>>,
    lifecycles: Store<SidecarLifecycle>,
    recorder: Recorder,
    metrics: ControllerMetrics,
    limiter: Mutex<RolloutLimiter>,
}

impl Ctx {
    /// Every resource (but `except`, one being deleted) and every live pod,
    /// as the stores have them now.
    fn snapshot(&self, except: Option<&SidecarLifecycle>) -> (Vec<LifecycleEntry>, Vec<PodInfo>) {
        let is_except = |r: &SidecarLifecycle| {
            except.is_some_and(|e| e.namespace() == r.namespace() && e.name_any() == r.name_any())
        };
        let all = self
            .lifecycles
            .state()
            .iter()
            .filter(|r| !is_except(r))
            .map(|r| LifecycleEntry::from_resource(r))
            .collect();
        let pods = self
            .pods
            .state()
            .iter()
            .map(|p| PodInfo::from_meta(p))
            .collect();
        (all, pods)
    }

    async fn event(
        &self,
        reference: &ObjectReference,
        d: Decision,
        secondary: Option<ObjectReference>,
    ) {
        let ev = Event {
            type_: if d.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: d.reason.into(),
            note: Some(d.note),
            action: "Reconcile".into(),
            secondary,
        };
        // An Event is a record, not a step: failing to write one changes nothing.
        if let Err(e) = self.recorder.publish(&ev, reference).await {
            tracing::debug!(error = %e, reason = ev.reason, "cannot publish an event");
        }
    }
}

fn pod_ref(p: &PodInfo) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(p.name.clone()),
        namespace: Some(p.namespace.clone()),
        uid: p.uid.clone(),
        ..ObjectReference::default()
    }
}

/// Run until `shutdown`: the controller's own watches of SidecarLifecycles
/// and pod metadata, and the reconciles they trigger.
pub async fn run(
    client: Client,
    settings: Settings,
    metrics: ControllerMetrics,
    shutdown: CancellationToken,
) {
    let lifecycles_api = Api::<SidecarLifecycle>::all(client.clone());
    let (pods, writer) = reflector::store();
    // Finished pods neither count nor get retuned; one that finishes leaves
    // the watch as a deletion.
    let pod_stream = changes(
        watcher(
            Api::<PartialObjectMeta<Pod>>::all(client.clone()),
            watcher::Config::default().fields(LIVE_PODS),
        )
        .default_backoff()
        .reflect(writer),
        pod_key,
    );
    let controller = Controller::new(lifecycles_api.clone(), watcher::Config::default());
    let lifecycles = controller.store();
    let operator_ns = settings.operator_namespace.clone();

    // A pod change concerns every resource that reaches it.
    let store = lifecycles.clone();
    let ns = operator_ns.clone();
    let by_pod = move |p: PartialObjectMeta<Pod>| {
        let pod = PodInfo::from_meta(&p);
        store
            .state()
            .iter()
            .filter(|r| reaches(&LifecycleEntry::from_resource(r), &pod, &ns))
            .map(|r| ObjectRef::from_obj(r.as_ref()))
            .collect::<Vec<_>>()
    };
    // A resource's change (or deletion) moves the conflicts, governors and
    // settings of its siblings: its namespace, and everything when it is a
    // cluster default.
    let store = lifecycles.clone();
    let ns = operator_ns.clone();
    let by_sibling = move |changed: SidecarLifecycle| {
        let changed_ns = changed.namespace().unwrap_or_default();
        let cluster_wide = changed_ns == ns && changed.spec.selector.is_none();
        store
            .state()
            .iter()
            .filter(|r| {
                cluster_wide
                    || r.namespace().as_deref() == Some(changed_ns.as_str())
                    || (r.namespace().as_deref() == Some(ns.as_str()) && r.spec.selector.is_none())
            })
            .map(|r| ObjectRef::from_obj(r.as_ref()))
            .collect::<Vec<_>>()
    };
    // Only spec changes (generation), creations and deletions move the
    // siblings; a status write does not.
    // A deleted resource is never reconciled: its pods are swept back to
    // what the remaining layers say (below), even when no sibling is left.
    let (deleted_tx, mut deleted) = tokio::sync::mpsc::unbounded_channel::<SidecarLifecycle>();
    let siblings = changes(
        watcher(lifecycles_api, watcher::Config::default())
            .default_backoff()
            .inspect(move |ev| {
                if let Ok(watcher::Event::Delete(r)) = ev {
                    let _ = deleted_tx.send(r.clone());
                }
            }),
        |r: &SidecarLifecycle| {
            let key = format!("{}/{}", r.namespace().unwrap_or_default(), r.name_any());
            (key, r.metadata.generation.unwrap_or_default() as u64)
        },
    );

    let ctx = Arc::new(Ctx {
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: FIELD_MANAGER.into(),
                instance: Some(settings.identity.clone()),
            },
        ),
        limiter: Mutex::new(RolloutLimiter::new(settings.rollout_interval)),
        client,
        settings,
        pods,
        lifecycles,
        metrics,
    });
    tracing::info!("SidecarLifecycle controller started");
    let sweeper = {
        let ctx = Arc::clone(&ctx);
        async move {
            while let Some(gone) = deleted.recv().await {
                sweep(&ctx, &gone).await;
            }
        }
    };
    let controller = controller
        .watches_stream(pod_stream, by_pod)
        .watches_stream(siblings, by_sibling)
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "reconcile not run");
            }
        });
    // Both end with `shutdown`: the controller after its reconciles in flight.
    tokio::join!(
        bounded_by(controller, &shutdown),
        shutdown.run_until_cancelled(sweeper)
    );
    tracing::info!("SidecarLifecycle controller stopped");
}

/// How long reconciles in flight get to finish once shutdown begins.
const IN_FLIGHT_GRACE: Duration = Duration::from_secs(2);

/// Run a kube-runtime controller (started with `graceful_shutdown_on`)
/// until it ends, but no longer than [`IN_FLIGHT_GRACE`] after `shutdown`:
/// its graceful stop has been seen to hang when asked while its first
/// watch was starting, and the Lease is released only after the leader's
/// work stops. Dropping it aborts the reconciles; they only make idempotent
/// writes, so an interrupted one is redone by the next leader.
pub(crate) async fn bounded_by(
    controller: impl std::future::Future<Output = ()>,
    shutdown: &CancellationToken,
) {
    tokio::select! {
        () = controller => {}
        () = async {
            shutdown.cancelled().await;
            tokio::time::sleep(IN_FLIGHT_GRACE).await;
        } => tracing::warn!(grace = ?IN_FLIGHT_GRACE, "reconciles still running at shutdown; dropped"),
    }
}

/// Retune the pods a deleted resource reached to what the remaining layers
/// say now (down to the chart defaults when nothing else reaches them).
async fn sweep(ctx: &Ctx, gone: &SidecarLifecycle) {
    if tokio::time::timeout(Duration::from_secs(30), ctx.pods.wait_until_ready())
        .await
        .is_err()
    {
        return;
    }
    let entry = LifecycleEntry::from_resource(gone);
    let (all, pods) = ctx.snapshot(Some(gone));
    match retune(ctx, &entry, &all, &pods).await {
        Ok(n) => {
            tracing::info!(resource = %format!("{}/{}", entry.namespace, entry.name), pods = n,
            "deleted; its pods retuned to the remaining layers")
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot retune the pods of a deleted SidecarLifecycle")
        }
    }
}

/// Pods still running or about to: the controller's whole view.
const LIVE_PODS: &str = "status.phase!=Succeeded,status.phase!=Failed";

/// What of a pod decides which resources reach it and what it should carry:
/// labels, annotations, its controlling owner. Status-only updates (most of
/// a pod's updates) leave it unchanged.
fn pod_key(p: &PartialObjectMeta<Pod>) -> (String, u64) {
    use std::hash::{Hash, Hasher};
    let key = format!(
        "{}/{}",
        p.metadata.namespace.as_deref().unwrap_or_default(),
        p.metadata.name.as_deref().unwrap_or_default()
    );
    let mut h = std::collections::hash_map::DefaultHasher::new();
    p.metadata.labels.hash(&mut h);
    p.metadata.annotations.hash(&mut h);
    for o in p.metadata.owner_references.iter().flatten() {
        (&o.kind, &o.name, o.controller).hash(&mut h);
    }
    (key, h.finish())
}

/// The objects of a watch whose fingerprint (`key` gives name and
/// fingerprint) changed since last seen, and every deletion. A relist of
/// unchanged objects passes nothing.
fn changes<K, S>(
    events: S,
    key: impl Fn(&K) -> (String, u64) + Send + 'static,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send
where
    K: Send + 'static,
    S: futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
{
    let mut seen: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    events.filter_map(move |ev| {
        let out = match ev {
            Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                let (k, fingerprint) = key(&o);
                (seen.insert(k, fingerprint) != Some(fingerprint)).then_some(Ok(o))
            }
            Ok(watcher::Event::Delete(o)) => {
                seen.remove(&key(&o).0);
                Some(Ok(o))
            }
            Ok(watcher::Event::Init | watcher::Event::InitDone) => None,
            Err(e) => Some(Err(e)),
        };
        futures::future::ready(out)
    })
}

fn error_policy(_: Arc<SidecarLifecycle>, err: &ControllerError, _: Arc<Ctx>) -> Action {
    tracing::warn!(error = %err, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

async fn reconcile(slc: Arc<SidecarLifecycle>, ctx: Arc<Ctx>) -> Result<Action, ControllerError> {
    let started = Instant::now();
    let res = reconcile_inner(&slc, &ctx).await;
    let result = match &res {
        Ok(_) => "ok",
        Err(e) => e.kind(),
    };
    ctx.metrics.observe(result, started.elapsed());
    res
}

async fn reconcile_inner(slc: &SidecarLifecycle, ctx: &Ctx) -> Result<Action, ControllerError> {
    const SYNC: Duration = Duration::from_secs(30);
    // Until every pod is listed, matchedPods would be wrong.
    if tokio::time::timeout(SYNC, ctx.pods.wait_until_ready())
        .await
        .is_err()
    {
        return Err(ControllerError::NotSynced(SYNC));
    }
    let s = &ctx.settings;
    let name = slc.name_any();
    let ns = slc.namespace().unwrap_or_default();
    let resource = format!("{ns}/{name}");
    let entry = LifecycleEntry::from_resource(slc);
    let (all, pods) = ctx.snapshot(None);
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let generation = slc.metadata.generation;
    let previous = slc.status.as_ref();

    let mut status = compute(
        &entry,
        generation,
        &all,
        &pods,
        &s.operator_namespace,
        previous,
        now.clone(),
    );
    let report = restart_report(&entry, &all, &pods, &s.chart, &s.operator_namespace);
    let automatic = slc.spec.rollout_policy == RolloutPolicy::Automatic;
    let mut restart = [restart_condition(&report, automatic, generation, &now)];
    keep_transition_times(&mut restart, previous);
    status.conditions.extend(restart);

    let me = slc.object_ref(&());
    if previous != Some(&status) {
        let api: Api<SidecarLifecycle> = Api::namespaced(ctx.client.clone(), &ns);
        let patch = Patch::Apply(json!({
            "apiVersion": SidecarLifecycle::api_version(&()),
            "kind": SidecarLifecycle::kind(&()),
            "status": status,
        }));
        api.patch_status(&name, &PatchParams::apply(FIELD_MANAGER).force(), &patch)
            .await
            .map_err(|source| ControllerError::Status {
                resource: resource.clone(),
                source,
            })?;
        ctx.metrics.status_writes.inc();
        for d in decisions(previous, &status) {
            tracing::info!(resource = %resource, reason = d.reason, note = %d.note, "decision");
            ctx.event(&me, d, None).await;
        }
    }

    let retuned = retune(ctx, &entry, &all, &pods).await?;
    if retuned > 0 {
        ctx.event(
            &me,
            Decision {
                warning: false,
                reason: "PodsRetuned",
                note: format!("updated remora.dev/lifecycle of {retuned} running pods"),
            },
            None,
        )
        .await;
    }

    let mut next = RESYNC;
    if automatic
        && !report.outdated.is_empty()
        && let Some(wait) = roll(ctx, &me, &report).await?
    {
        next = wait;
    }
    Ok(Action::requeue(next))
}

/// Bring the lifecycle annotation of every injected pod `entry` reaches up
/// to date. Returns how many pods were patched.
async fn retune(
    ctx: &Ctx,
    entry: &LifecycleEntry,
    all: &[LifecycleEntry],
    pods: &[PodInfo],
) -> Result<usize, ControllerError> {
    let s = &ctx.settings;
    let mut patched = 0;
    for pod in pods
        .iter()
        .filter(|p| p.sources.is_some() && reaches(entry, p, &s.operator_namespace))
    {
        let Some(current) = pod.annotations.get(LIFECYCLE_ANNOTATION) else {
            continue;
        };
        let cfg = pod.effective(&s.chart, all, &s.operator_namespace);
        let Some(fresh) = refreshed_lifecycle(current, &cfg) else {
            continue;
        };
        let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &pod.namespace);
        let patch =
            Patch::Merge(json!({"metadata": {"annotations": {LIFECYCLE_ANNOTATION: fresh}}}));
        let who = format!("{}/{}", pod.namespace, pod.name);
        match api
            .patch_metadata(&pod.name, &PatchParams::default(), &patch)
            .await
        {
            Ok(_) => {}
            // Gone since the store saw it: nothing to retune.
            Err(kube::Error::Api(e)) if e.code == 404 => continue,
            Err(source) => return Err(ControllerError::Retune { pod: who, source }),
        }
        patched += 1;
        ctx.metrics.retuned.inc();
        tracing::info!(pod = %who, lifecycle = %fresh, "lifecycle annotation updated");
        ctx.event(
            &pod_ref(pod),
            Decision {
                warning: false,
                reason: "LifecycleRetuned",
                note: format!(
                    "SidecarLifecycle {}/{} changed; the sidecar reads the new settings at its next drain: {fresh}",
                    entry.namespace, entry.name
                ),
            },
            None,
        )
        .await;
    }
    Ok(patched)
}

fn workload_api(client: &Client, ns: &str, kind: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("apps", "v1", kind);
    Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk))
}

/// The workload that owns `pod` and can be rolled: (kind, name).
async fn owning_workload(
    ctx: &Ctx,
    pod: &PodInfo,
) -> Result<Option<(String, String)>, kube::Error> {
    let Some((kind, name)) = &pod.owner else {
        return Ok(None);
    };
    match kind.as_str() {
        "StatefulSet" | "DaemonSet" => Ok(Some((kind.clone(), name.clone()))),
        "ReplicaSet" => {
            let rs: Api<ReplicaSet> = Api::namespaced(ctx.client.clone(), &pod.namespace);
            let meta = match rs.get_metadata_opt(name).await? {
                Some(m) => m,
                None => return Ok(None),
            };
            Ok(meta
                .metadata
                .owner_references
                .iter()
                .flatten()
                .find(|o| o.controller == Some(true) && o.kind == "Deployment")
                .map(|o| ("Deployment".to_string(), o.name.clone())))
        }
        // Bare pods and Jobs cannot be rolled: they keep RestartRequired.
        _ => Ok(None),
    }
}

/// Roll the workloads of outdated pods, one per limiter slot. Returns when
/// to look again if the limiter held a rollout back.
async fn roll(
    ctx: &Ctx,
    me: &ObjectReference,
    report: &RestartReport,
) -> Result<Option<Duration>, ControllerError> {
    // One lookup per ReplicaSet. A failed lookup or write skips that
    // workload only; the reconcile then fails so that it is retried.
    let mut owners: BTreeMap<(String, String, String), Option<(String, String)>> = BTreeMap::new();
    let mut targets: BTreeMap<(String, String, String), BTreeSet<String>> = BTreeMap::new();
    let mut failed = None;
    for (pod, want) in &report.outdated {
        let Some((owner_kind, owner_name)) = pod.owner.clone() else {
            continue;
        };
        let key = (pod.namespace.clone(), owner_kind, owner_name);
        let workload = match owners.get(&key) {
            Some(w) => w.clone(),
            None => match owning_workload(ctx, pod).await {
                Ok(w) => {
                    owners.insert(key, w.clone());
                    w
                }
                Err(source) => {
                    failed = Some(ControllerError::Rollout {
                        workload: format!("the owner of pod {}/{}", pod.namespace, pod.name),
                        source,
                    });
                    continue;
                }
            },
        };
        if let Some((kind, name)) = workload {
            targets
                .entry((pod.namespace.clone(), kind, name))
                .or_default()
                .insert(want.clone());
        }
    }
    for ((ns, kind, name), wants) in targets {
        let workload = format!("{kind} {ns}/{name}");
        // Pods of one workload that would get different settings (a selector
        // on a per-pod label): no single rollout settles them.
        let [want]: [String; 1] = match Vec::from_iter(wants).try_into() {
            Ok(one) => one,
            Err(many) => {
                tracing::warn!(workload = %workload, hashes = ?many,
                    "its pods would get different proxy settings; not rolled");
                continue;
            }
        };
        let api = workload_api(&ctx.client, &ns, &kind);
        let obj = match api.get_opt(&name).await {
            Ok(Some(obj)) => obj,
            Ok(None) => continue,
            Err(source) => {
                failed = Some(ControllerError::Rollout { workload, source });
                continue;
            }
        };
        let template = &obj.data["spec"]["template"]["metadata"]["annotations"];
        if template[ROLLOUT_ANNOTATION].as_str() == Some(want.as_str()) {
            // Already rolling to these settings; old pods are on their way out.
            continue;
        }
        if template.get(STATUS_ANNOTATION).is_some() {
            // Injected offline (`remora-injector inject`): the webhook leaves
            // its pods as they are, so a rollout would change nothing.
            tracing::info!(workload = %workload, "injected offline; re-run inject to apply the new settings");
            continue;
        }
        let slot = ctx
            .limiter
            .lock()
            .map(|mut l| l.try_acquire(Instant::now()))
            .unwrap_or(Ok(()));
        if let Err(wait) = slot {
            tracing::info!(workload = %workload, wait = ?wait, "rollout held back by the rate limit");
            return Ok(Some(wait));
        }
        let patch = Patch::Apply(json!({
            "apiVersion": "apps/v1",
            "kind": kind,
            "metadata": {"name": name, "namespace": ns},
            "spec": {"template": {"metadata": {"annotations": {ROLLOUT_ANNOTATION: want}}}},
        }));
        if let Err(source) = api
            .patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &patch)
            .await
        {
            failed = Some(ControllerError::Rollout { workload, source });
            continue;
        }
        ctx.metrics.rollouts.inc();
        tracing::info!(workload = %workload, restart_hash = %want, "workload rolled");
        let secondary = ObjectReference {
            api_version: Some("apps/v1".into()),
            kind: Some(kind.clone()),
            name: Some(name.clone()),
            namespace: Some(ns.clone()),
            uid: obj.metadata.uid.clone(),
            ..ObjectReference::default()
        };
        ctx.event(
            me,
            Decision {
                warning: false,
                reason: "RolloutTriggered",
                note: format!("rolling {workload} so its pods get the new proxy settings"),
            },
            Some(secondary),
        )
        .await;
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

    fn status(conds: &[(&str, &str)]) -> SidecarLifecycleStatus {
        SidecarLifecycleStatus {
            observed_generation: Some(1),
            matched_pods: Some(0),
            conditions: conds
                .iter()
                .map(|(t, s)| Condition {
                    type_: (*t).into(),
                    status: (*s).into(),
                    reason: "R".into(),
                    message: format!("{t} is {s}"),
                    observed_generation: Some(1),
                    last_transition_time: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
                })
                .collect(),
        }
    }

    #[test]
    fn first_status_reports_acceptance_and_problems_only() {
        let next = status(&[
            ("Accepted", "True"),
            ("Conflicted", "False"),
            ("Applied", "True"),
            ("RestartRequired", "False"),
        ]);
        let d = decisions(None, &next);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].reason, "Accepted");
        assert!(!d[0].warning);
    }

    #[test]
    fn transitions_become_events_and_steady_state_none() {
        let before = status(&[
            ("Accepted", "True"),
            ("Conflicted", "False"),
            ("RestartRequired", "False"),
        ]);
        let after = status(&[
            ("Accepted", "True"),
            ("Conflicted", "True"),
            ("RestartRequired", "True"),
        ]);
        let d = decisions(Some(&before), &after);
        let reasons: Vec<_> = d.iter().map(|d| d.reason).collect();
        assert_eq!(reasons, ["Conflicted", "RestartRequired"]);
        assert!(d.iter().all(|d| d.warning));
        assert!(decisions(Some(&after), &after).is_empty());
        let back = decisions(Some(&after), &before);
        let reasons: Vec<_> = back.iter().map(|d| d.reason).collect();
        assert_eq!(reasons, ["ConflictResolved", "PodsRestarted"]);
    }

    #[test]
    fn an_invalid_spec_is_a_warning() {
        let d = decisions(None, &status(&[("Accepted", "False")]));
        assert_eq!(d[0].reason, "InvalidSpec");
        assert!(d[0].warning);
        assert_eq!(d[0].note, "Accepted is False");
    }

    #[tokio::test(start_paused = true)]
    async fn a_controller_that_does_not_stop_is_dropped_after_the_grace() {
        let shutdown = CancellationToken::new();
        let started = Instant::now();
        let stuck = tokio::spawn({
            let shutdown = shutdown.clone();
            async move { bounded_by(std::future::pending(), &shutdown).await }
        });
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!stuck.is_finished(), "runs until shutdown");
        shutdown.cancel();
        stuck.await.expect("returns");
        assert_eq!(started.elapsed(), Duration::from_secs(60) + IN_FLIGHT_GRACE);
    }

    #[tokio::test(start_paused = true)]
    async fn limiter_spaces_rollouts_by_the_interval() {
        let mut l = RolloutLimiter::new(Duration::from_secs(30));
        assert_eq!(l.try_acquire(Instant::now()), Ok(()));
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(l.try_acquire(Instant::now()), Err(Duration::from_secs(20)));
        // A refused attempt does not take the slot.
        tokio::time::advance(Duration::from_secs(20)).await;
        assert_eq!(l.try_acquire(Instant::now()), Ok(()));
        assert_eq!(l.try_acquire(Instant::now()), Err(Duration::from_secs(30)));
    }
}
