//! A cluster-sized load on the API server for `scale-bench` (issue 14):
//! namespaces labelled for injection, Ready fake nodes, pods owned by
//! Deployments (through their ReplicaSets), StatefulSets and Jobs, bound to
//! those nodes and reported Running, and SidecarLifecycles of every kind
//! (namespace-wide, selector-based, overlapping, one cluster default).
//!
//! The workloads' pods are created here, with the ownerReferences their
//! controllers would set: the control plane must run without
//! kube-controller-manager, or its controllers would create pods of their
//! own next to these. Nothing runs; only API objects exist.
//!
//! [`Plan`] is what will be created (pure, decided up front), [`populate`]
//! creates it, [`check`] lists what the API server holds and compares.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Debug;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::apps::v1::{
    Deployment, ReplicaSet, ReplicaSetSpec, StatefulSet, StatefulSetSpec,
};
use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{Container, Namespace, Node, Pod, PodSpec, PodTemplateSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, OwnerReference};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ListParams, ObjectMeta, PostParams};
use kube::{Api, Client, Resource};
use remora_contract::annotations::INJECT_LABEL;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::controlplane::{self, FakeKubelet, NAMESPACE_LABEL};

/// Label on every object of a load (value: [`Load::run`]), so that it can be
/// listed (and deleted) apart from anything else on the API server.
pub const RUN_LABEL: &str = "remora.dev/scale-run";

/// Workload kinds, in the proportion they are created: three Deployments
/// for one StatefulSet and one Job.
const KIND_CYCLE: [WorkloadKind; 5] = [
    WorkloadKind::Deployment,
    WorkloadKind::Deployment,
    WorkloadKind::Deployment,
    WorkloadKind::StatefulSet,
    WorkloadKind::Job,
];

/// The one SidecarLifecycle of the big namespace (namespace-wide).
pub const BIG_LIFECYCLE: &str = "wide";

/// A Deployment's pods carry its template's hash (here a fixed one: no
/// controller computes it).
const TEMPLATE_HASH: &str = "6f8b7c9d4";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid load: {0}")]
    Invalid(String),
    #[error(transparent)]
    ControlPlane(#[from] controlplane::Error),
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("{0}: {1}")]
    Json(String, #[source] serde_json::Error),
    #[error("{0} came back without a uid")]
    NoUid(String),
}

fn kube_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let what = what.into();
    move |source| Error::Kube { what, source }
}

/// How big a load to create.
#[derive(Debug, Clone, Serialize)]
pub struct Load {
    pub namespaces: usize,
    pub nodes: usize,
    pub pods: usize,
    /// SidecarLifecycles in all, the cluster default included.
    pub lifecycles: usize,
    /// Replicas of each workload (the last of a namespace may have fewer).
    pub pods_per_workload: usize,
    /// Names the load's objects and is the value of [`RUN_LABEL`].
    pub run: String,
    /// Where the cluster default lives: the operator's own namespace.
    pub operator_namespace: String,
    /// Requests in flight at once: the API server and etcd share the cores
    /// with the client, so more only queues.
    pub concurrency: usize,
    /// Pods of one more namespace, [`Load::big_namespace`], governed by its
    /// one namespace-wide SidecarLifecycle ([`BIG_LIFECYCLE`]); 0: none.
    /// Neither counted in `pods` nor in `lifecycles`.
    pub big_namespace_pods: usize,
}

impl Default for Load {
    /// The size issue 14 measures at.
    fn default() -> Self {
        Self {
            namespaces: 200,
            nodes: 500,
            pods: 10_000,
            lifecycles: 1_000,
            pods_per_workload: 5,
            run: "scale".into(),
            operator_namespace: "remora-system".into(),
            concurrency: 32,
            big_namespace_pods: 1_000,
        }
    }
}

impl Load {
    /// The namespace of [`Load::big_namespace_pods`].
    pub fn big_namespace(&self) -> String {
        format!("{}-big", self.run)
    }

    fn validate(&self) -> Result<(), Error> {
        let bad = |m: String| Err(Error::Invalid(m));
        if self.namespaces == 0 || self.nodes == 0 {
            return bad("at least one namespace and one node".into());
        }
        if self.pods_per_workload == 0 || self.concurrency == 0 {
            return bad("pods per workload and concurrency must be at least 1".into());
        }
        let label = |s: &str, max: usize| {
            !s.is_empty()
                && s.len() <= max
                && s.starts_with(|c: char| c.is_ascii_lowercase())
                && s.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !s.ends_with('-')
        };
        // Room for the suffixes the plan adds (`-cluster-default`).
        if !label(&self.run, 20) {
            return bad(format!(
                "run {:?}: 1-20 lowercase letters, digits or dashes, starting with a letter",
                self.run
            ));
        }
        if !label(&self.operator_namespace, 63) {
            return bad(format!(
                "operator namespace {:?} is not a DNS label",
                self.operator_namespace
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum WorkloadKind {
    Deployment,
    StatefulSet,
    Job,
}

impl WorkloadKind {
    /// The kind and apiVersion of the pods' controller (a Deployment's pods
    /// belong to its ReplicaSet).
    pub fn pod_owner(self) -> (&'static str, &'static str) {
        match self {
            Self::Deployment => ("ReplicaSet", "apps/v1"),
            Self::StatefulSet => ("StatefulSet", "apps/v1"),
            Self::Job => ("Job", "batch/v1"),
        }
    }

    fn short(self) -> &'static str {
        match self {
            Self::Deployment => "d",
            Self::StatefulSet => "s",
            Self::Job => "j",
        }
    }
}

#[derive(Debug, Clone)]
pub struct PlannedPod {
    pub name: String,
    pub node: String,
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone)]
pub struct Workload {
    pub namespace: String,
    pub kind: WorkloadKind,
    pub name: String,
    /// Labels of its pod template (and its selector).
    pub labels: BTreeMap<String, String>,
    pub pods: Vec<PlannedPod>,
}

impl Workload {
    /// The name of the pods' owner: the ReplicaSet for a Deployment.
    pub fn pod_owner_name(&self) -> String {
        match self.kind {
            WorkloadKind::Deployment => format!("{}-{TEMPLATE_HASH}", self.name),
            _ => self.name.clone(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LifecycleKind {
    /// No selector, in the operator's namespace.
    ClusterDefault,
    /// No selector, in an application namespace.
    NamespaceWide,
    /// A selector sharing no pod with another selector of its namespace.
    Selector,
    /// A selector sharing a pod with another one of its namespace (the
    /// older wins; the other reports Conflicted).
    Overlapping,
}

#[derive(Debug, Clone)]
pub struct PlannedLifecycle {
    pub namespace: String,
    pub name: String,
    pub kind: LifecycleKind,
    pub selector: Option<BTreeMap<String, String>>,
    pub spec: serde_json::Value,
}

/// Everything a [`Load`] creates, decided before anything is.
#[derive(Debug, Clone)]
pub struct Plan {
    pub load: Load,
    pub namespaces: Vec<String>,
    pub nodes: Vec<String>,
    pub workloads: Vec<Workload>,
    pub lifecycles: Vec<PlannedLifecycle>,
}

impl Plan {
    pub fn new(load: &Load) -> Result<Self, Error> {
        load.validate()?;
        let run = &load.run;
        let namespaces: Vec<String> = (0..load.namespaces)
            .map(|i| format!("{run}-ns-{i}"))
            .collect();
        let nodes: Vec<String> = (0..load.nodes).map(|i| format!("{run}-node-{i}")).collect();
        let mut workloads = Vec::new();
        // Pods round-robin over the nodes, in creation order.
        let mut next_node = 0usize;
        for (i, ns) in namespaces.iter().enumerate() {
            let count = load.pods / load.namespaces + usize::from(i < load.pods % load.namespaces);
            workloads.extend(plan_namespace(load, ns, count, &nodes, &mut next_node));
        }
        let mut lifecycles = plan_lifecycles(load, &namespaces, &workloads);
        let mut namespaces = namespaces;
        // The big namespace: its pods are governed by its one namespace-wide
        // SidecarLifecycle (no selector there), whose edit retunes them all.
        if load.big_namespace_pods > 0 {
            let big = load.big_namespace();
            workloads.extend(plan_namespace(
                load,
                &big,
                load.big_namespace_pods,
                &nodes,
                &mut next_node,
            ));
            lifecycles.push(PlannedLifecycle {
                namespace: big.clone(),
                name: BIG_LIFECYCLE.to_owned(),
                kind: LifecycleKind::NamespaceWide,
                selector: None,
                spec: json!({"shutdown": {"drainDuration": "30s"}}),
            });
            namespaces.push(big);
        }
        Ok(Self {
            load: load.clone(),
            namespaces,
            nodes,
            workloads,
            lifecycles,
        })
    }

    pub fn pods(&self) -> usize {
        self.workloads.iter().map(|w| w.pods.len()).sum()
    }

    pub fn workloads_of(&self, kind: WorkloadKind) -> usize {
        self.workloads.iter().filter(|w| w.kind == kind).count()
    }

    pub fn lifecycles_of(&self, kind: LifecycleKind) -> usize {
        self.lifecycles.iter().filter(|l| l.kind == kind).count()
    }
}

/// The workloads of namespace `ns`, `count` pods in all, placed round-robin
/// from `*next_node` on.
fn plan_namespace(
    load: &Load,
    ns: &str,
    count: usize,
    nodes: &[String],
    next_node: &mut usize,
) -> Vec<Workload> {
    let run = &load.run;
    let mut workloads = Vec::new();
    let mut left = count;
    let mut w = 0usize;
    while left > 0 {
        let replicas = left.min(load.pods_per_workload);
        left -= replicas;
        let kind = KIND_CYCLE[w % KIND_CYCLE.len()];
        let name = format!("{}{w}", kind.short());
        let labels = BTreeMap::from([
            (RUN_LABEL.to_owned(), run.clone()),
            ("app".to_owned(), name.clone()),
            (
                "tier".to_owned(),
                if w.is_multiple_of(2) {
                    "frontend"
                } else {
                    "backend"
                }
                .to_owned(),
            ),
        ]);
        let pods = (0..replicas)
            .map(|r| {
                let mut labels = labels.clone();
                let pod_name = match kind {
                    WorkloadKind::Deployment => {
                        labels.insert("pod-template-hash".into(), TEMPLATE_HASH.into());
                        format!("{name}-{TEMPLATE_HASH}-{r:05}")
                    }
                    WorkloadKind::StatefulSet => {
                        let p = format!("{name}-{r}");
                        labels.insert("statefulset.kubernetes.io/pod-name".into(), p.clone());
                        labels.insert("apps.kubernetes.io/pod-index".into(), r.to_string());
                        p
                    }
                    WorkloadKind::Job => {
                        labels.insert("batch.kubernetes.io/job-name".into(), name.clone());
                        labels.insert("job-name".into(), name.clone());
                        format!("{name}-{r:05}")
                    }
                };
                let node = nodes[*next_node % nodes.len()].clone();
                *next_node += 1;
                PlannedPod {
                    name: pod_name,
                    node,
                    labels,
                }
            })
            .collect();
        workloads.push(Workload {
            namespace: ns.to_owned(),
            kind,
            name,
            labels,
            pods,
        });
        w += 1;
    }
    workloads
}

/// One cluster default, then round-robin over the namespaces: a
/// namespace-wide one first, then `tier=frontend` (which overlaps every
/// frontend workload's own), then one per workload by `app`.
fn plan_lifecycles(
    load: &Load,
    namespaces: &[String],
    workloads: &[Workload],
) -> Vec<PlannedLifecycle> {
    let mut out = Vec::with_capacity(load.lifecycles);
    if load.lifecycles == 0 {
        return out;
    }
    out.push(PlannedLifecycle {
        namespace: load.operator_namespace.clone(),
        name: format!("{}-cluster-default", load.run),
        kind: LifecycleKind::ClusterDefault,
        selector: None,
        spec: json!({"shutdown": {"drainDuration": "45s"}}),
    });
    let mut by_ns: HashMap<&str, Vec<&Workload>> = HashMap::new();
    for w in workloads {
        by_ns.entry(w.namespace.as_str()).or_default().push(w);
    }
    let mut per_ns: Vec<Vec<PlannedLifecycle>> = vec![Vec::new(); namespaces.len()];
    for j in 0..load.lifecycles - 1 {
        let (i, slot) = (j % namespaces.len(), j / namespaces.len());
        let ns = &namespaces[i];
        let spec = |selector: Option<&BTreeMap<String, String>>| {
            // Distinct values, so a retune of one is visible on its pods.
            let mut s = json!({"shutdown": {"drainDuration": format!("{}s", 10 + slot)}});
            if let Some(sel) = selector {
                s["selector"] = json!({"matchLabels": sel});
            }
            s
        };
        let (name, selector) = match slot {
            0 => ("wide".to_owned(), None),
            1 => (
                "frontend".to_owned(),
                Some(BTreeMap::from([("tier".to_owned(), "frontend".to_owned())])),
            ),
            k => {
                let ws = by_ns.get(ns.as_str()).map(Vec::as_slice).unwrap_or(&[]);
                let app = ws
                    .get((k - 2) % ws.len().max(1))
                    .map_or_else(|| "none".to_owned(), |w| w.name.clone());
                (
                    format!("app-{k}"),
                    Some(BTreeMap::from([("app".to_owned(), app)])),
                )
            }
        };
        per_ns[i].push(PlannedLifecycle {
            namespace: ns.clone(),
            name,
            kind: if selector.is_some() {
                LifecycleKind::Selector
            } else {
                LifecycleKind::NamespaceWide
            },
            spec: spec(selector.as_ref()),
            selector,
        });
    }
    // Overlap, decided on the planned pods' labels.
    for (i, lcs) in per_ns.iter_mut().enumerate() {
        let pods: Vec<&BTreeMap<String, String>> = by_ns
            .get(namespaces[i].as_str())
            .into_iter()
            .flatten()
            .flat_map(|w| w.pods.iter().map(|p| &p.labels))
            .collect();
        let matches = |sel: &BTreeMap<String, String>, labels: &BTreeMap<String, String>| {
            sel.iter().all(|(k, v)| labels.get(k) == Some(v))
        };
        let overlapping: Vec<bool> = lcs
            .iter()
            .enumerate()
            .map(|(a, la)| {
                let Some(sa) = &la.selector else { return false };
                lcs.iter().enumerate().any(|(b, lb)| {
                    let Some(sb) = &lb.selector else { return false };
                    a != b && pods.iter().any(|p| matches(sa, p) && matches(sb, p))
                })
            })
            .collect();
        for (lc, o) in lcs.iter_mut().zip(overlapping) {
            if o {
                lc.kind = LifecycleKind::Overlapping;
            }
        }
    }
    out.extend(per_ns.into_iter().flatten());
    out
}

/// How long one phase of [`populate`] took.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    pub name: &'static str,
    /// Objects created (or written) in it.
    pub objects: usize,
    pub seconds: f64,
}

impl Phase {
    pub fn per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.objects as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// What [`populate`] did.
#[derive(Debug, Clone)]
pub struct Populated {
    pub plan: Plan,
    pub phases: Vec<Phase>,
    /// uid of each pod owner, by (namespace, owner name).
    pub owner_uids: HashMap<(String, String), String>,
}

impl Populated {
    pub fn total(&self) -> Duration {
        Duration::from_secs_f64(self.phases.iter().map(|p| p.seconds).sum())
    }
}

/// The SidecarLifecycle API (untyped: the e2e crate does not depend on the
/// operator's types).
pub fn lifecycle_resource() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(
        "remora.dev",
        "v1alpha1",
        "SidecarLifecycle",
    ))
}

fn meta(name: &str, namespace: Option<&str>, labels: BTreeMap<String, String>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: namespace.map(str::to_owned),
        labels: Some(labels),
        ..ObjectMeta::default()
    }
}

fn controller_ref(api_version: &str, kind: &str, name: &str, uid: &str) -> OwnerReference {
    OwnerReference {
        api_version: api_version.to_owned(),
        kind: kind.to_owned(),
        name: name.to_owned(),
        uid: uid.to_owned(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

fn pod_spec(kind: WorkloadKind) -> PodSpec {
    PodSpec {
        containers: vec![Container {
            name: "app".into(),
            image: Some("registry.invalid/app:1".into()),
            ..Container::default()
        }],
        restart_policy: (kind == WorkloadKind::Job).then(|| "Never".to_owned()),
        ..PodSpec::default()
    }
}

fn template(labels: &BTreeMap<String, String>, kind: WorkloadKind) -> PodTemplateSpec {
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels.clone()),
            ..ObjectMeta::default()
        }),
        spec: Some(pod_spec(kind)),
    }
}

fn uid_of<K: Resource>(obj: &K, what: &str) -> Result<String, Error> {
    obj.meta()
        .uid
        .clone()
        .ok_or_else(|| Error::NoUid(what.to_owned()))
}

/// Runs `f` on every item, `concurrency` at a time; stops at the first error.
async fn each<T, R, F, Fut>(items: Vec<T>, concurrency: usize, f: F) -> Result<Vec<R>, Error>
where
    F: Fn(T) -> Fut,
    Fut: Future<Output = Result<R, Error>>,
{
    stream::iter(items.into_iter().map(f))
        .buffer_unordered(concurrency)
        .try_collect()
        .await
}

/// Creates the object; one that already exists (a rerun on the same API
/// server) is an error, since its owner uids would not be this run's.
async fn create<K>(api: &Api<K>, obj: &K, what: String) -> Result<K, Error>
where
    K: Resource + Clone + DeserializeOwned + Serialize + Debug,
{
    api.create(&PostParams::default(), obj)
        .await
        .map_err(kube_err(what))
}

/// Creates `load` on the API server, phase by phase, and says how long each
/// phase took. The SidecarLifecycle CRD must be installed
/// ([`crate::chart::install_crds`]).
pub async fn populate(client: &Client, load: &Load) -> Result<Populated, Error> {
    let plan = Plan::new(load)?;
    let c = load.concurrency;
    let run_labels = || BTreeMap::from([(RUN_LABEL.to_owned(), load.run.clone())]);
    let mut phases = Vec::new();

    // Namespaces: labelled for injection as webhook::label_namespace does,
    // and for the harness's bulk cleanup. The operator's is not injected.
    let t = Instant::now();
    let ns_api: Api<Namespace> = Api::all(client.clone());
    let mut labels = run_labels();
    labels.insert(NAMESPACE_LABEL.0.into(), NAMESPACE_LABEL.1.into());
    let operator = Namespace {
        metadata: meta(&load.operator_namespace, None, labels.clone()),
        ..Namespace::default()
    };
    match ns_api.create(&PostParams::default(), &operator).await {
        Err(kube::Error::Api(s)) if s.is_already_exists() => {}
        r => {
            r.map_err(kube_err(format!("namespace {}", load.operator_namespace)))?;
        }
    }
    labels.insert(INJECT_LABEL.into(), "enabled".into());
    each(plan.namespaces.clone(), c, |name| {
        let ns = Namespace {
            metadata: meta(&name, None, labels.clone()),
            ..Namespace::default()
        };
        let api = ns_api.clone();
        async move { create(&api, &ns, format!("namespace {name}")).await }
    })
    .await?;
    phases.push(Phase {
        name: "namespaces",
        objects: plan.namespaces.len() + 1,
        seconds: t.elapsed().as_secs_f64(),
    });

    // Nodes: created and reported Ready by their fake kubelets.
    let t = Instant::now();
    let kubelets: HashMap<String, FakeKubelet> = each(plan.nodes.clone(), c, |name| {
        let client = client.clone();
        async move {
            let k = FakeKubelet::register(client, &name).await?;
            Ok((name, k))
        }
    })
    .await?
    .into_iter()
    .collect();
    phases.push(Phase {
        name: "nodes",
        objects: plan.nodes.len(),
        seconds: t.elapsed().as_secs_f64(),
    });

    // Workloads, and a ReplicaSet per Deployment: the pods' owners.
    let t = Instant::now();
    let owners: Vec<((String, String), String)> = each(plan.workloads.clone(), c, |w| {
        create_workload(client, w, load)
    })
    .await?;
    let objects = owners.len() + plan.workloads_of(WorkloadKind::Deployment);
    let owner_uids: HashMap<(String, String), String> = owners.into_iter().collect();
    phases.push(Phase {
        name: "workloads",
        objects,
        seconds: t.elapsed().as_secs_f64(),
    });

    // Pods, already bound: `nodeName` at creation is what a binding sets,
    // one write fewer per pod than creating then binding.
    let t = Instant::now();
    let pods: Vec<(&Workload, &PlannedPod)> = plan
        .workloads
        .iter()
        .flat_map(|w| w.pods.iter().map(move |p| (w, p)))
        .collect();
    let created: Vec<Pod> = each(pods, c, |(w, p)| {
        let owner_name = w.pod_owner_name();
        let uid = owner_uids
            .get(&(w.namespace.clone(), owner_name.clone()))
            .cloned();
        let api: Api<Pod> = Api::namespaced(client.clone(), &w.namespace);
        async move {
            let uid = uid.ok_or_else(|| Error::NoUid(format!("{}/{owner_name}", w.namespace)))?;
            let (kind, api_version) = w.kind.pod_owner();
            let mut labels = p.labels.clone();
            if w.kind == WorkloadKind::Job {
                // The selector the API server generated for the Job.
                labels.insert("batch.kubernetes.io/controller-uid".into(), uid.clone());
                labels.insert("controller-uid".into(), uid.clone());
            }
            let mut metadata = meta(&p.name, Some(&w.namespace), labels);
            metadata.owner_references =
                Some(vec![controller_ref(api_version, kind, &owner_name, &uid)]);
            let mut spec = pod_spec(w.kind);
            spec.node_name = Some(p.node.clone());
            let pod = Pod {
                metadata,
                spec: Some(spec),
                ..Pod::default()
            };
            create(&api, &pod, format!("pod {}/{}", w.namespace, p.name)).await
        }
    })
    .await?;
    phases.push(Phase {
        name: "pods",
        objects: created.len(),
        seconds: t.elapsed().as_secs_f64(),
    });

    // Their kubelets report them Running: one status write per pod.
    let t = Instant::now();
    let n = created.len();
    each(created, c, |pod| {
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        let kubelet = kubelets.get(&node).cloned();
        async move {
            let kubelet = kubelet.ok_or_else(|| {
                Error::Invalid(format!(
                    "pod {:?} is on unknown node {node:?}",
                    pod.metadata.name
                ))
            })?;
            kubelet.start_known(&pod).await?;
            Ok(())
        }
    })
    .await?;
    phases.push(Phase {
        name: "pods running",
        objects: n,
        seconds: t.elapsed().as_secs_f64(),
    });

    // SidecarLifecycles, in plan order (the cluster default first; of two
    // overlapping ones, creation order decides which is older only up to
    // the API server's one-second timestamps).
    let t = Instant::now();
    let ar = lifecycle_resource();
    each(plan.lifecycles.clone(), c, |lc| {
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &lc.namespace, &ar);
        let labels = run_labels();
        async move {
            let obj: DynamicObject = serde_json::from_value(json!({
                "apiVersion": "remora.dev/v1alpha1",
                "kind": "SidecarLifecycle",
                "metadata": {"name": lc.name, "namespace": lc.namespace, "labels": labels},
                "spec": lc.spec,
            }))
            .map_err(|e| Error::Json(format!("lifecycle {}/{}", lc.namespace, lc.name), e))?;
            create(
                &api,
                &obj,
                format!("SidecarLifecycle {}/{}", lc.namespace, lc.name),
            )
            .await
        }
    })
    .await?;
    phases.push(Phase {
        name: "lifecycles",
        objects: plan.lifecycles.len(),
        seconds: t.elapsed().as_secs_f64(),
    });

    Ok(Populated {
        plan,
        phases,
        owner_uids,
    })
}

/// Creates one workload (and a Deployment's ReplicaSet); returns the pods'
/// owner as ((namespace, name), uid).
async fn create_workload(
    client: &Client,
    w: Workload,
    load: &Load,
) -> Result<((String, String), String), Error> {
    let ns = w.namespace.as_str();
    let selector = LabelSelector {
        match_labels: Some(w.labels.clone()),
        ..LabelSelector::default()
    };
    let replicas = i32::try_from(w.pods.len())
        .map_err(|_| Error::Invalid(format!("{} replicas", w.pods.len())))?;
    let labels = || {
        BTreeMap::from([
            (RUN_LABEL.to_owned(), load.run.clone()),
            ("app".to_owned(), w.name.clone()),
        ])
    };
    let what = format!("{:?} {ns}/{}", w.kind, w.name);
    let uid = match w.kind {
        WorkloadKind::Deployment => {
            let mut d = controlplane::deployment(
                &w.name,
                replicas,
                w.labels.clone(),
                Some(pod_spec(w.kind)),
            );
            d.metadata.namespace = Some(ns.to_owned());
            d.metadata.labels = Some(labels());
            let d = create(&Api::namespaced(client.clone(), ns), &d, what.clone()).await?;
            let d_uid = uid_of(&d, &what)?;
            let mut rs_labels = w.labels.clone();
            rs_labels.insert("pod-template-hash".into(), TEMPLATE_HASH.into());
            let rs_name = w.pod_owner_name();
            let mut metadata = meta(&rs_name, Some(ns), rs_labels.clone());
            metadata.owner_references = Some(vec![controller_ref(
                "apps/v1",
                "Deployment",
                &w.name,
                &d_uid,
            )]);
            let rs = ReplicaSet {
                metadata,
                spec: Some(ReplicaSetSpec {
                    replicas: Some(replicas),
                    selector: LabelSelector {
                        match_labels: Some(rs_labels.clone()),
                        ..LabelSelector::default()
                    },
                    template: Some(template(&rs_labels, w.kind)),
                    ..ReplicaSetSpec::default()
                }),
                ..ReplicaSet::default()
            };
            let what = format!("ReplicaSet {ns}/{rs_name}");
            let rs = create(&Api::namespaced(client.clone(), ns), &rs, what.clone()).await?;
            return Ok(((ns.to_owned(), rs_name), uid_of(&rs, &what)?));
        }
        WorkloadKind::StatefulSet => {
            let s = StatefulSet {
                metadata: meta(&w.name, Some(ns), labels()),
                spec: Some(StatefulSetSpec {
                    replicas: Some(replicas),
                    selector,
                    service_name: Some(w.name.clone()),
                    template: template(&w.labels, w.kind),
                    ..StatefulSetSpec::default()
                }),
                ..StatefulSet::default()
            };
            let s = create(&Api::namespaced(client.clone(), ns), &s, what.clone()).await?;
            uid_of(&s, &what)?
        }
        WorkloadKind::Job => {
            // No selector: the API server generates one from the Job's uid.
            let j = Job {
                metadata: meta(&w.name, Some(ns), labels()),
                spec: Some(JobSpec {
                    parallelism: Some(replicas),
                    completions: Some(replicas),
                    template: template(&w.labels, w.kind),
                    ..JobSpec::default()
                }),
                ..Job::default()
            };
            let j = create(&Api::namespaced(client.clone(), ns), &j, what.clone()).await?;
            uid_of(&j, &what)?
        }
    };
    Ok(((ns.to_owned(), w.name.clone()), uid))
}

/// What the API server holds of a load, counted by listing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub namespaces: usize,
    pub nodes: usize,
    pub nodes_ready: usize,
    pub deployments: usize,
    pub replica_sets: usize,
    pub stateful_sets: usize,
    pub jobs: usize,
    pub pods: usize,
    pub pods_running: usize,
    pub sidecar_lifecycles: usize,
}

/// The load as listed back from the API server, and every way it differs
/// from the plan (empty: all there, with the right owners, nodes, phases).
#[derive(Debug, Clone)]
pub struct Checked {
    pub counts: Counts,
    pub problems: Vec<String>,
}

/// Every object of a kind carrying `labels`, a page at a time (a 10,000-pod
/// answer in one piece costs the API server a large buffer).
async fn list_all<K>(api: &Api<K>, labels: &str) -> Result<Vec<K>, Error>
where
    K: Clone + DeserializeOwned + Debug,
{
    let mut out = Vec::new();
    let mut lp = ListParams::default().labels(labels).limit(500);
    loop {
        let page = api.list(&lp).await.map_err(kube_err("listing"))?;
        let next = page.metadata.continue_.clone().filter(|c| !c.is_empty());
        out.extend(page.items);
        match next {
            Some(c) => lp = lp.continue_token(&c),
            None => return Ok(out),
        }
    }
}

/// Lists what the API server holds of `populated` and compares it with the
/// plan.
pub async fn check(client: &Client, populated: &Populated) -> Result<Checked, Error> {
    let plan = &populated.plan;
    let sel = format!("{RUN_LABEL}={}", plan.load.run);
    let mut problems = Vec::new();
    let names = |v: Vec<Option<String>>| v.into_iter().flatten().collect::<BTreeSet<_>>();

    let namespaces = list_all(&Api::<Namespace>::all(client.clone()), &sel).await?;
    let got = names(namespaces.iter().map(|n| n.metadata.name.clone()).collect());
    for ns in plan
        .namespaces
        .iter()
        .chain([&plan.load.operator_namespace])
    {
        if !got.contains(ns) {
            problems.push(format!("namespace {ns} missing"));
        }
    }
    // Nodes carry no run label (FakeKubelet registers them): by name.
    let nodes = list_all(&Api::<Node>::all(client.clone()), "").await?;
    let planned: BTreeSet<&String> = plan.nodes.iter().collect();
    let nodes: Vec<&Node> = nodes
        .iter()
        .filter(|n| {
            n.metadata
                .name
                .as_ref()
                .is_some_and(|m| planned.contains(m))
        })
        .collect();
    let ready = |n: &Node| {
        n.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    };
    let nodes_ready = nodes.iter().filter(|n| ready(n)).count();
    if nodes.len() != plan.nodes.len() || nodes_ready != nodes.len() {
        problems.push(format!(
            "{} of {} nodes exist, {nodes_ready} Ready",
            nodes.len(),
            plan.nodes.len()
        ));
    }

    let deployments = list_all(&Api::<Deployment>::all(client.clone()), &sel).await?;
    let replica_sets = list_all(&Api::<ReplicaSet>::all(client.clone()), &sel).await?;
    let stateful_sets = list_all(&Api::<StatefulSet>::all(client.clone()), &sel).await?;
    let jobs = list_all(&Api::<Job>::all(client.clone()), &sel).await?;
    let key = |m: &ObjectMeta| {
        (
            m.namespace.clone().unwrap_or_default(),
            m.name.clone().unwrap_or_default(),
        )
    };
    let mut workloads: BTreeSet<(WorkloadKind, String, String)> = BTreeSet::new();
    for (kind, metas) in [
        (
            WorkloadKind::Deployment,
            deployments.iter().map(|o| &o.metadata).collect::<Vec<_>>(),
        ),
        (
            WorkloadKind::StatefulSet,
            stateful_sets.iter().map(|o| &o.metadata).collect(),
        ),
        (
            WorkloadKind::Job,
            jobs.iter().map(|o| &o.metadata).collect(),
        ),
    ] {
        for m in metas {
            let (ns, name) = key(m);
            workloads.insert((kind, ns, name));
        }
    }
    let rs_owner: HashMap<(String, String), (String, Option<OwnerReference>)> = replica_sets
        .iter()
        .map(|rs| {
            let owner = rs
                .metadata
                .owner_references
                .iter()
                .flatten()
                .find(|o| o.controller == Some(true))
                .cloned();
            (
                key(&rs.metadata),
                (rs.metadata.uid.clone().unwrap_or_default(), owner),
            )
        })
        .collect();
    let d_uids: HashMap<(String, String), String> = deployments
        .iter()
        .map(|d| (key(&d.metadata), d.metadata.uid.clone().unwrap_or_default()))
        .collect();

    let pods = list_all(&Api::<Pod>::all(client.clone()), &sel).await?;
    let by_key: HashMap<(String, String), &Pod> =
        pods.iter().map(|p| (key(&p.metadata), p)).collect();
    let mut planned_pods = 0usize;
    for w in &plan.workloads {
        let ns = &w.namespace;
        if !workloads.contains(&(w.kind, ns.clone(), w.name.clone())) {
            problems.push(format!("{:?} {ns}/{} missing", w.kind, w.name));
        }
        let owner_name = w.pod_owner_name();
        let owner_uid = populated.owner_uids.get(&(ns.clone(), owner_name.clone()));
        if w.kind == WorkloadKind::Deployment {
            match rs_owner.get(&(ns.clone(), owner_name.clone())) {
                None => problems.push(format!("ReplicaSet {ns}/{owner_name} missing")),
                Some((uid, owner)) => {
                    let d_uid = d_uids.get(&(ns.clone(), w.name.clone()));
                    if Some(uid) != owner_uid
                        || owner.as_ref().map(|o| (&o.kind, &o.name, Some(&o.uid)))
                            != Some((&"Deployment".to_owned(), &w.name, d_uid))
                    {
                        problems.push(format!("ReplicaSet {ns}/{owner_name}: wrong uid or owner"));
                    }
                }
            }
        }
        for p in &w.pods {
            planned_pods += 1;
            let Some(pod) = by_key.get(&(ns.clone(), p.name.clone())) else {
                problems.push(format!("pod {ns}/{} missing", p.name));
                continue;
            };
            let owner = pod
                .metadata
                .owner_references
                .iter()
                .flatten()
                .find(|o| o.controller == Some(true));
            let (kind, _) = w.kind.pod_owner();
            if owner.map(|o| (o.kind.as_str(), &o.name, Some(&o.uid)))
                != Some((kind, &owner_name, owner_uid))
            {
                problems.push(format!(
                    "pod {ns}/{}: owner {:?}, expected {kind} {owner_name}",
                    p.name,
                    owner.map(|o| (&o.kind, &o.name))
                ));
            }
            let node = pod.spec.as_ref().and_then(|s| s.node_name.as_ref());
            if node != Some(&p.node) {
                problems.push(format!(
                    "pod {ns}/{}: on node {node:?}, expected {}",
                    p.name, p.node
                ));
            }
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            if phase != Some("Running") {
                problems.push(format!("pod {ns}/{}: phase {phase:?}", p.name));
            }
        }
    }
    if pods.len() != planned_pods {
        problems.push(format!(
            "{} pods listed, {planned_pods} planned",
            pods.len()
        ));
    }
    let pods_running = pods
        .iter()
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .count();

    let lcs = list_all(
        &Api::<DynamicObject>::all_with(client.clone(), &lifecycle_resource()),
        &sel,
    )
    .await?;
    let got: BTreeSet<(String, String)> = lcs.iter().map(|l| key(&l.metadata)).collect();
    for lc in &plan.lifecycles {
        if !got.contains(&(lc.namespace.clone(), lc.name.clone())) {
            problems.push(format!(
                "SidecarLifecycle {}/{} missing",
                lc.namespace, lc.name
            ));
        }
    }
    if lcs.len() != plan.lifecycles.len() {
        problems.push(format!(
            "{} SidecarLifecycles listed, {} planned",
            lcs.len(),
            plan.lifecycles.len()
        ));
    }

    Ok(Checked {
        counts: Counts {
            namespaces: namespaces.len(),
            nodes: nodes.len(),
            nodes_ready,
            deployments: deployments.len(),
            replica_sets: replica_sets.len(),
            stateful_sets: stateful_sets.len(),
            jobs: jobs.len(),
            pods: pods.len(),
            pods_running,
            sidecar_lifecycles: lcs.len(),
        },
        problems,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Load {
        Load {
            namespaces: 3,
            nodes: 4,
            pods: 75,
            lifecycles: 10,
            big_namespace_pods: 0,
            ..Load::default()
        }
    }

    #[test]
    fn plan_places_every_pod_once_over_all_nodes() {
        let plan = Plan::new(&small()).unwrap();
        assert_eq!(plan.pods(), 75);
        let mut names = BTreeSet::new();
        let mut per_node: BTreeMap<&str, usize> = BTreeMap::new();
        for w in &plan.workloads {
            assert!(w.pods.len() <= 5 && !w.pods.is_empty());
            for p in &w.pods {
                assert!(
                    names.insert((w.namespace.clone(), p.name.clone())),
                    "{} twice",
                    p.name
                );
                *per_node.entry(&p.node).or_default() += 1;
                // The pod matches its workload's selector.
                assert!(w.labels.iter().all(|(k, v)| p.labels.get(k) == Some(v)));
            }
        }
        // Round-robin: nodes differ by at most one pod.
        assert_eq!(per_node.len(), 4);
        let (min, max) = (
            per_node.values().min().unwrap(),
            per_node.values().max().unwrap(),
        );
        assert!(max - min <= 1, "{per_node:?}");
        for kind in [
            WorkloadKind::Deployment,
            WorkloadKind::StatefulSet,
            WorkloadKind::Job,
        ] {
            assert!(plan.workloads_of(kind) > 0, "no {kind:?}");
        }
    }

    #[test]
    fn plan_has_every_kind_of_lifecycle() {
        let plan = Plan::new(&small()).unwrap();
        assert_eq!(plan.lifecycles.len(), 10);
        assert_eq!(plan.lifecycles_of(LifecycleKind::ClusterDefault), 1);
        let default = &plan.lifecycles[0];
        assert_eq!(default.namespace, "remora-system");
        assert!(default.selector.is_none());
        assert_eq!(plan.lifecycles_of(LifecycleKind::NamespaceWide), 3);
        assert!(plan.lifecycles_of(LifecycleKind::Overlapping) > 0);
        // Names are unique per namespace.
        let keys: BTreeSet<_> = plan
            .lifecycles
            .iter()
            .map(|l| (&l.namespace, &l.name))
            .collect();
        assert_eq!(keys.len(), 10);
        // `frontend` overlaps the app-selector of the namespace's d0
        // (tier=frontend); an app-selector of a backend workload alone does not.
        let ns0: Vec<_> = plan
            .lifecycles
            .iter()
            .filter(|l| l.namespace == "scale-ns-0")
            .collect();
        let frontend = ns0.iter().find(|l| l.name == "frontend").unwrap();
        assert_eq!(frontend.kind, LifecycleKind::Overlapping);
        let app2 = ns0.iter().find(|l| l.name == "app-2").unwrap();
        assert_eq!(app2.selector.as_ref().unwrap()["app"], "d0");
        assert_eq!(app2.kind, LifecycleKind::Overlapping);
    }

    #[test]
    fn a_selector_alone_on_its_pods_is_not_overlapping() {
        // Enough lifecycles for app-3 (d1, a backend workload) in ns 0.
        let load = Load {
            namespaces: 1,
            lifecycles: 5,
            ..small()
        };
        let plan = Plan::new(&load).unwrap();
        let app3 = plan.lifecycles.iter().find(|l| l.name == "app-3").unwrap();
        assert_eq!(app3.selector.as_ref().unwrap()["app"], "d1");
        assert_eq!(app3.kind, LifecycleKind::Selector);
    }

    #[test]
    fn the_big_namespace_has_its_pods_and_one_namespace_wide_lifecycle() {
        let load = Load {
            big_namespace_pods: 12,
            ..small()
        };
        let plan = Plan::new(&load).unwrap();
        assert_eq!(plan.pods(), 75 + 12);
        assert_eq!(plan.lifecycles.len(), 11);
        let big = load.big_namespace();
        assert_eq!(plan.namespaces.last(), Some(&big));
        let in_big: Vec<_> = plan
            .lifecycles
            .iter()
            .filter(|l| l.namespace == big)
            .collect();
        assert_eq!(in_big.len(), 1);
        assert_eq!(in_big[0].name, BIG_LIFECYCLE);
        assert_eq!(in_big[0].kind, LifecycleKind::NamespaceWide);
        let pods: usize = plan
            .workloads
            .iter()
            .filter(|w| w.namespace == big)
            .map(|w| w.pods.len())
            .sum();
        assert_eq!(pods, 12);
        // The round-robin over nodes goes on through the big namespace.
        let nodes: BTreeSet<_> = plan
            .workloads
            .iter()
            .filter(|w| w.namespace == big)
            .flat_map(|w| w.pods.iter().map(|p| &p.node))
            .collect();
        assert_eq!(nodes.len(), 4);
    }

    #[test]
    fn bad_loads_are_refused() {
        for load in [
            Load {
                namespaces: 0,
                ..small()
            },
            Load {
                nodes: 0,
                ..small()
            },
            Load {
                pods_per_workload: 0,
                ..small()
            },
            Load {
                concurrency: 0,
                ..small()
            },
            Load {
                run: "Bad_Run".into(),
                ..small()
            },
            Load {
                run: String::new(),
                ..small()
            },
        ] {
            assert!(
                matches!(Plan::new(&load), Err(Error::Invalid(_))),
                "{load:?}"
            );
        }
        // No pods and no lifecycles is a valid (empty) load.
        let plan = Plan::new(&Load {
            pods: 0,
            lifecycles: 0,
            ..small()
        })
        .unwrap();
        assert_eq!(plan.pods(), 0);
        assert!(plan.lifecycles.is_empty());
    }
}
