//! The leader's one pod watch, and the pod as its readers read it.
//!
//! Not k8s-openapi's `Pod`: its structs hold every field of the API inline,
//! set or not (2.4 KB a pod, 2.1 KB a container, 0.75 KB a container
//! status), so a store of 10,000 injected pods cost about 100 MiB however
//! much of each pod was trimmed. [`LivePod`] has the same shape, with only
//! what the readers read, and what it leaves out of the API server's JSON is
//! never allocated. Of the metadata it keeps only what kube needs (name,
//! namespace, uid, owners) and Remora's per-pod annotations; labels, the
//! lifecycle and what `remora.dev/status` records move into [`Kept`]. There
//! they cost a few shared allocations, where the `BTreeMap`s and strings
//! they replace cost 1.4 KB a pod (each map of a few entries allocates a
//! node of eleven): the pods of a workload have equal labels, lifecycle
//! and status, and the watch holds each once ([`Slim`]).

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::{Metadata, NamespaceResourceScope, Resource};
use kube::runtime::watcher;
use kube::{Api, Client};
use remora_contract::annotations::{LIFECYCLE, STATUS};
use remora_crds::LabelSet;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::interned::Interned;
use crate::watch::SharedWatch;

/// Pods still running or about to. Finished pods are neither counted,
/// retuned nor stopped; one that finishes leaves the watch as a deletion.
pub const LIVE_PODS: &str = "status.phase!=Succeeded,status.phase!=Failed";

/// A pod as the leader's controllers read it: metadata (labels, Remora's
/// annotations, owners: the SidecarLifecycle controller), container names,
/// the restart policy, the phase and the containers' exit codes (Jobs).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct LivePod {
    pub metadata: ObjectMeta,
    pub spec: Option<LiveSpec>,
    pub status: Option<LiveStatus>,
    /// What [`Slim::slim`] moved out of `metadata`.
    #[serde(skip)]
    pub kept: Kept,
}

/// The metadata the controllers read, kept compactly by [`Slim::slim`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Kept {
    pub labels: Labels,
    /// `remora.dev/lifecycle`: the settings the sidecar runs with.
    pub lifecycle: Option<Arc<str>>,
    /// What `remora.dev/status` records; `None` when not injected.
    pub injected: Option<Arc<Injected>>,
}

/// What the injector recorded in a pod's `remora.dev/status`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Injected {
    /// The layers its settings came from.
    #[serde(default)]
    pub sources: Box<[Box<str>]>,
    /// The hash of its restart-only settings, when recorded.
    #[serde(default)]
    pub restart_hash: Option<Box<str>>,
}

impl Injected {
    /// A status that does not read as one records no layers (the pod is
    /// still injected).
    fn read(status: &str) -> Self {
        serde_json::from_str(status).unwrap_or_default()
    }
}

type Pairs = [(Box<str>, Box<str>)];

/// A few labels, sorted by key, in one allocation of pairs (shared by the
/// pods that carry the same).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Labels(Arc<Pairs>);

impl Default for Labels {
    /// One empty set for every pod: each pod the watch reads starts with
    /// this before `slim` moves its labels in.
    fn default() -> Self {
        static EMPTY: LazyLock<Arc<Pairs>> = LazyLock::new(|| Arc::new([]));
        Self(Arc::clone(&EMPTY))
    }
}

impl Labels {
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .binary_search_by(|(k, _)| (**k).cmp(key))
            .ok()
            .map(|i| &*self.0[i].1)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (&**k, &**v))
    }

    fn pairs(m: BTreeMap<String, String>) -> Vec<(Box<str>, Box<str>)> {
        // A BTreeMap iterates in key order: the pairs are sorted.
        m.into_iter()
            .map(|(k, v)| (k.into_boxed_str(), v.into_boxed_str()))
            .collect()
    }
}

impl LabelSet for Labels {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LiveSpec {
    pub containers: Option<Vec<Named>>,
    pub init_containers: Option<Vec<Named>>,
    pub restart_policy: Option<String>,
}

/// A container, by name.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Named {
    pub name: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LiveStatus {
    pub phase: Option<String>,
    pub container_statuses: Option<Vec<LiveContainerStatus>>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct LiveContainerStatus {
    pub name: String,
    pub state: Option<LiveContainerState>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct LiveContainerState {
    pub terminated: Option<Terminated>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Terminated {
    pub exit_code: i32,
}

impl LivePod {
    /// A pod of these metadata, kept as the watch keeps it.
    pub fn from_meta(metadata: ObjectMeta) -> Self {
        let mut p = Self {
            metadata,
            ..Self::default()
        };
        Slim::default().slim(&mut p);
        p
    }

    pub fn labels(&self) -> &Labels {
        &self.kept.labels
    }

    /// Remora's annotations but the lifecycle and the status (see
    /// [`Kept`]): the pod's own settings, the Jobs controller's stop.
    pub fn annotations(&self) -> &BTreeMap<String, String> {
        static NONE: BTreeMap<String, String> = BTreeMap::new();
        self.metadata.annotations.as_ref().unwrap_or(&NONE)
    }

    pub fn lifecycle(&self) -> Option<&str> {
        self.kept.lifecycle.as_deref()
    }

    pub fn injected(&self) -> Option<&Injected> {
        self.kept.injected.as_deref()
    }

    pub fn containers(&self) -> &[Named] {
        self.spec
            .as_ref()
            .and_then(|s| s.containers.as_deref())
            .unwrap_or_default()
    }

    pub fn init_containers(&self) -> &[Named] {
        self.spec
            .as_ref()
            .and_then(|s| s.init_containers.as_deref())
            .unwrap_or_default()
    }

    pub fn restart_policy(&self) -> Option<&str> {
        self.spec.as_ref()?.restart_policy.as_deref()
    }

    pub fn phase(&self) -> Option<&str> {
        self.status.as_ref()?.phase.as_deref()
    }

    /// The exit code of container `name`, once it has terminated.
    pub fn exit_code(&self, name: &str) -> Option<i32> {
        self.status
            .as_ref()?
            .container_statuses
            .iter()
            .flatten()
            .find(|s| s.name == name)?
            .state
            .as_ref()?
            .terminated
            .as_ref()
            .map(|t| t.exit_code)
    }
}

// The API's own identity of a pod, so that kube's `Api`, watcher and
// reflector (through kube's blanket `Resource` impl) treat this as a Pod.
impl Resource for LivePod {
    const API_VERSION: &'static str = <k8s_openapi::api::core::v1::Pod as Resource>::API_VERSION;
    const GROUP: &'static str = <k8s_openapi::api::core::v1::Pod as Resource>::GROUP;
    const KIND: &'static str = <k8s_openapi::api::core::v1::Pod as Resource>::KIND;
    const VERSION: &'static str = <k8s_openapi::api::core::v1::Pod as Resource>::VERSION;
    const URL_PATH_SEGMENT: &'static str =
        <k8s_openapi::api::core::v1::Pod as Resource>::URL_PATH_SEGMENT;
    type Scope = NamespaceResourceScope;
}

impl Metadata for LivePod {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// The leader's one pod watch, read by the SidecarLifecycle controller and
/// the Jobs controller, until `shutdown`.
pub fn live_pods(client: Client, shutdown: CancellationToken) -> SharedWatch<LivePod> {
    let mut slim = Slim::default();
    SharedWatch::start(
        "pods",
        Api::all(client),
        watcher::Config::default().fields(LIVE_PODS),
        move |p| slim.slim(p),
        shutdown,
    )
}

/// Trims each pod of a watch (see [`Slim::slim`]), holding what equal pods
/// share once.
#[derive(Debug, Default)]
pub struct Slim {
    labels: Interned<Pairs>,
    lifecycles: Interned<str>,
    statuses: Interned<Injected>,
}

impl Slim {
    /// Drops what nobody reads: managed fields, the server's bookkeeping
    /// (the watcher has taken the resourceVersion before this runs),
    /// annotations other than Remora's (a kubectl last-applied copy, say,
    /// can be a pod's largest part), and the containers and their statuses
    /// of a pod that restarts them `Always`: only the Jobs controller reads
    /// those, and it leaves such a pod alone. Labels, the lifecycle and the
    /// status move into [`Kept`]. Idempotent.
    pub fn slim(&mut self, p: &mut LivePod) {
        let meta = &mut p.metadata;
        meta.managed_fields = None;
        meta.resource_version = None;
        meta.generate_name = None;
        meta.creation_timestamp = None;
        if let Some(labels) = meta.labels.take() {
            let pairs = Labels::pairs(labels);
            p.kept.labels = Labels(self.labels.get(&pairs[..], || Arc::from(&pairs[..])));
        }
        if let Some(mut a) = meta.annotations.take() {
            a.retain(|k, _| k.starts_with(remora_contract::annotations::PREFIX));
            if let Some(l) = a.remove(LIFECYCLE) {
                p.kept.lifecycle = Some(self.lifecycles.get(l.as_str(), || Arc::from(l.as_str())));
            }
            if let Some(s) = a.remove(STATUS) {
                let read = Injected::read(&s);
                p.kept.injected = Some(self.statuses.get(&read, || Arc::new(read.clone())));
            }
            meta.annotations = (!a.is_empty()).then_some(a);
        }
        if !matches!(p.restart_policy(), Some(r) if r != "Always") {
            p.spec = p.spec.take().map(|s| LiveSpec {
                restart_policy: s.restart_policy,
                ..LiveSpec::default()
            });
            p.status = None;
        }
    }
}

/// A pod as the watch reads it: through its JSON, as the API server sends it.
#[cfg(test)]
pub(crate) fn read(pod: &k8s_openapi::api::core::v1::Pod) -> LivePod {
    let mut p: LivePod =
        serde_json::from_value(serde_json::to_value(pod).expect("a pod serializes"))
            .expect("a pod reads as a LivePod");
    Slim::default().slim(&mut p);
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        Container, ContainerState, ContainerStateTerminated, ContainerStatus, EnvVar, Pod, PodSpec,
        PodStatus, Volume,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

    #[test]
    fn a_full_pod_reads_as_what_the_controllers_read_and_no_more() {
        let full = Pod {
            metadata: ObjectMeta {
                name: Some("p".into()),
                namespace: Some("ns".into()),
                labels: Some([("app".to_string(), "web".to_string())].into()),
                annotations: Some(
                    [
                        (
                            "remora.dev/status".to_string(),
                            r#"{"version":"0.1.0","sources":["cluster:remora-system/default"],"restartHash":"sha256:1"}"#.to_string(),
                        ),
                        (
                            "remora.dev/lifecycle".to_string(),
                            r#"{"drainDeadline":"9s"}"#.to_string(),
                        ),
                        ("remora.dev/drain-duration".to_string(), "9s".to_string()),
                        (
                            "kubectl.kubernetes.io/last-applied-configuration".to_string(),
                            "{}".to_string(),
                        ),
                    ]
                    .into(),
                ),
                managed_fields: Some(vec![ManagedFieldsEntry::default()]),
                ..Default::default()
            },
            spec: Some(PodSpec {
                containers: vec![
                    Container {
                        name: "app".into(),
                        env: Some(vec![EnvVar {
                            name: "BIG".into(),
                            ..EnvVar::default()
                        }]),
                        ..Container::default()
                    },
                    Container {
                        name: remora_contract::pod::PROXY_CONTAINER.into(),
                        ..Container::default()
                    },
                ],
                restart_policy: Some("Never".into()),
                volumes: Some(vec![Volume::default()]),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".into()),
                container_statuses: Some(vec![ContainerStatus {
                    name: "app".into(),
                    image: "registry.example/app:1".into(),
                    state: Some(ContainerState {
                        terminated: Some(ContainerStateTerminated {
                            exit_code: 3,
                            reason: Some("Error".into()),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    ..Default::default()
                }]),
                ..PodStatus::default()
            }),
        };
        let live = read(&full);
        assert_eq!(
            live.metadata,
            ObjectMeta {
                name: Some("p".into()),
                namespace: Some("ns".into()),
                annotations: Some(
                    [("remora.dev/drain-duration".to_string(), "9s".to_string())].into()
                ),
                ..Default::default()
            }
        );
        assert_eq!(live.labels().iter().collect::<Vec<_>>(), [("app", "web")]);
        assert_eq!(live.lifecycle(), Some(r#"{"drainDeadline":"9s"}"#));
        let injected = live.injected().expect("injected");
        assert_eq!(
            &*injected.sources,
            [Box::from("cluster:remora-system/default")]
        );
        assert_eq!(injected.restart_hash.as_deref(), Some("sha256:1"));
        assert_eq!(&read(&full), &live, "reading twice keeps the same");
        let mut again = live.clone();
        Slim::default().slim(&mut again);
        assert_eq!(again, live, "slim is idempotent");
        let names: Vec<&str> = live.containers().iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["app", remora_contract::pod::PROXY_CONTAINER]);
        assert!(live.init_containers().is_empty());
        assert_eq!(live.restart_policy(), Some("Never"));
        assert_eq!(live.phase(), Some("Running"));
        assert_eq!(live.exit_code("app"), Some(3));
        assert_eq!(live.exit_code(remora_contract::pod::PROXY_CONTAINER), None);
    }

    #[test]
    fn a_pod_that_restarts_always_keeps_no_containers_and_no_status() {
        let full = Pod {
            metadata: ObjectMeta {
                name: Some("web-7d9f-x2".into()),
                generate_name: Some("web-7d9f-".into()),
                resource_version: Some("42".into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "app".into(),
                    ..Container::default()
                }],
                restart_policy: Some("Always".into()),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".into()),
                ..PodStatus::default()
            }),
        };
        let live = read(&full);
        assert_eq!(
            live,
            LivePod {
                metadata: ObjectMeta {
                    name: Some("web-7d9f-x2".into()),
                    ..Default::default()
                },
                spec: Some(LiveSpec {
                    restart_policy: Some("Always".into()),
                    ..LiveSpec::default()
                }),
                status: None,
                kept: Kept::default(),
            }
        );
        // The Jobs controller never looks further into it.
        assert!(!crate::jobs::may_complete(&live));
    }

    #[test]
    fn labels_are_found_by_key_and_shared_by_equal_pods() {
        let meta = |name: &str| ObjectMeta {
            name: Some(name.into()),
            labels: Some(
                [
                    ("app", "web"),
                    ("tier", "front"),
                    ("pod-template-hash", "7d9f"),
                ]
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .into(),
            ),
            annotations: Some([(LIFECYCLE.to_string(), "{}".to_string())].into()),
            ..Default::default()
        };
        let mut slim = Slim::default();
        let (mut a, mut b) = (LivePod::from_meta(meta("a")), LivePod::from_meta(meta("b")));
        for (k, v) in [
            ("app", "web"),
            ("tier", "front"),
            ("pod-template-hash", "7d9f"),
        ] {
            assert_eq!(a.labels().get(k), Some(v));
        }
        assert_eq!(a.labels().get("absent"), None);
        assert_eq!(LivePod::default().labels().get("app"), None);
        // Read again through one watch's Slim, equal pods share one copy.
        (a.kept, b.kept) = (Kept::default(), Kept::default());
        a.metadata = meta("a");
        b.metadata = meta("b");
        slim.slim(&mut a);
        slim.slim(&mut b);
        assert!(Arc::ptr_eq(&a.kept.labels.0, &b.kept.labels.0));
        assert!(Arc::ptr_eq(
            a.kept.lifecycle.as_ref().expect("a lifecycle"),
            b.kept.lifecycle.as_ref().expect("a lifecycle")
        ));
    }

    #[test]
    fn a_pod_without_spec_or_status_reads() {
        let live: LivePod =
            serde_json::from_str(r#"{"metadata":{"name":"p"},"spec":null}"#).expect("reads");
        assert!(live.containers().is_empty());
        assert_eq!((live.restart_policy(), live.phase()), (None, None));
    }

    #[test]
    fn is_a_pod_to_kube() {
        use kube::Resource as _;
        assert_eq!(LivePod::kind(&()), "Pod");
        assert_eq!(LivePod::api_version(&()), "v1");
        assert_eq!(LivePod::plural(&()), "pods");
    }
}
