//! The leader's one pod watch (with `--discovery`, the process's, shared by
//! the leader and the discovery server), and the pod as its readers read it.
//!
//! Not k8s-openapi's `Pod`: its structs hold every field of the API inline,
//! set or not (kilobytes a pod and a container), however much of each pod
//! is trimmed. [`LivePod`] has the same shape, with only what the readers
//! read, and what it leaves out of the API server's JSON is never
//! allocated. Of the metadata it keeps only what kube needs (name,
//! namespace, uid, owners) and Remora's per-pod annotations; labels, the
//! lifecycle and what `remora.dev/status` records move into [`Kept`]. There
//! they cost a few shared allocations rather than `BTreeMap`s and strings
//! per pod (each map of a few entries allocates a node of eleven): the pods
//! of a workload have equal labels, lifecycle and status, and the watch
//! holds each once ([`Slim`]).
//!
//! Whoever may create a pod anywhere writes what this watch reads, so what
//! it keeps of one pod is bounded whatever its owner writes: the leader's
//! memory grows with the number of pods, not their size. Read while the
//! JSON is parsed (what is dropped is never allocated): the annotations
//! Remora reads, by name, each value up to a bound ([`MAX_STATUS`] ..);
//! labels up to [`MAX_LABELS`] and [`MAX_LABEL_BYTES`]; the controlling
//! ownerReference only; up to [`MAX_CONTAINERS`] containers and container
//! statuses. A pod Remora did not inject keeps only its name, namespace,
//! uid and labels: the SidecarLifecycle controller counts it when a
//! selector matches it, nothing else reads it.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, LazyLock};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use k8s_openapi::{Metadata, NamespaceResourceScope, Resource};
use kube::runtime::watcher;
use kube::{Api, Client};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use remora_contract::annotations::{
    INBOUND, INBOUND_TLS, LIFECYCLE, OUTBOUND, PER_FIELD, STATUS, STOP, WORKLOAD_CA,
};
use remora_crds::LabelSet;
use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use tokio_util::sync::CancellationToken;

use crate::cluster::interned::Interned;
use crate::cluster::watch::SharedWatch;

/// Pods still running or about to. Finished pods are neither counted,
/// retuned nor stopped; one that finishes leaves the watch as a deletion.
pub const LIVE_PODS: &str = "status.phase!=Succeeded,status.phase!=Failed";

/// Pods per page of a (re)list. A page's body is held whole while it is
/// parsed (a few times its size at the peak), and a pod may be as large as
/// the API server stores (about 1.5 MiB): a page of such pods must leave a
/// new leader within the chart's memory limit (256 Mi); kube's default of
/// 500 a page would pass it with pods of a few hundred KiB.
pub const LIST_PAGE: u32 = 20;

/// Labels kept of one pod, and the bytes of their keys and values together.
/// A pod over either reads as having no labels (no selector matches it):
/// only its own settings are at stake. Real pods carry a few dozen at most.
pub const MAX_LABELS: usize = 64;
pub const MAX_LABEL_BYTES: usize = 4096;
/// Containers (and container statuses) kept of one pod. A pod with more
/// reads as having none: the Jobs controller leaves it alone.
pub const MAX_CONTAINERS: usize = 64;
/// The longest `remora.dev/status` kept (the webhook's is under 2 KiB); a
/// longer one reads as injected, its record unreadable.
pub const MAX_STATUS: usize = 4096;
/// The longest `remora.dev/lifecycle` kept (the webhook's is under 1 KiB);
/// a longer one reads as absent (the pod is not retuned).
pub const MAX_LIFECYCLE: usize = 2048;
/// The longest `remora.dev/stop` kept; a longer one reads as present and
/// empty (its presence is the request).
pub const MAX_STOP: usize = 1024;
/// The longest per-pod setting (`remora.dev/drain-duration`, ..) kept; no
/// valid one comes close, and a longer one reads as absent.
pub const MAX_SETTING: usize = 128;
/// The longest `remora.dev/outbound` kept (the discovery server reads it):
/// the webhook refuses more than a few dozen entries; a longer one reads
/// as absent (the proxy is given no outbound listeners).
pub const MAX_OUTBOUND: usize = 4096;

/// A pod as the leader's controllers read it: metadata (labels, Remora's
/// annotations, owners: the SidecarLifecycle controller), container names,
/// the restart policy, the phase and the containers' exit codes (Jobs).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(from = "WirePod")]
pub struct LivePod {
    pub metadata: ObjectMeta,
    pub spec: Option<LiveSpec>,
    pub status: Option<LiveStatus>,
    /// What [`Slim::slim`] moved out of `metadata`.
    pub kept: Kept,
    /// What was over the bounds, until [`Slim::slim`] reports it.
    trimmed: Trimmed,
}

/// What of a pod was over the bounds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Trimmed {
    /// Its labels (read as none).
    labels: bool,
    /// Values of annotations Remora reads.
    annotations: u32,
}

impl Trimmed {
    fn any(self) -> bool {
        self.labels || self.annotations > 0
    }
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

/// What the operator recorded in a pod's `remora.dev/status`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Injected {
    /// The layers its settings came from.
    #[serde(default)]
    pub sources: Box<[Box<str>]>,
    /// The hash of its restart-only settings, when recorded.
    #[serde(default)]
    pub restart_hash: Option<Box<str>>,
    /// The inbound ports on which its sidecar accepts the mesh's mTLS
    /// (the discovery server reads them: secure naming).
    #[serde(default)]
    pub mtls_ports: Box<[u16]>,
    /// Its inbound listeners as injected (the discovery server serves them
    /// while the pod carries no `remora.dev/inbound`); `None` on a pod
    /// injected before they were recorded, whose agent writes them itself.
    #[serde(default)]
    pub inbound: Option<Box<[Box<str>]>>,
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
    #[serde(default, deserialize_with = "bounded_list")]
    pub containers: Option<Vec<Named>>,
    #[serde(default, deserialize_with = "bounded_list")]
    pub init_containers: Option<Vec<Named>>,
    pub restart_policy: Option<String>,
    /// Whom the discovery server checks a proxy's token against.
    pub service_account_name: Option<String>,
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
    /// The discovery server checks a proxy's node id against it.
    #[serde(rename = "podIP")]
    pub pod_ip: Option<String>,
    /// Its `Ready` condition (`None`: not reported yet): the discovery
    /// server withdraws a pod that stops being Ready from its Services'
    /// endpoints at once.
    #[serde(default, rename = "conditions", deserialize_with = "ready_condition")]
    pub ready: Option<bool>,
    #[serde(default, deserialize_with = "bounded_list")]
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

/// What an over-long value of an annotation Remora reads reads as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TooLong {
    /// Absent: the pod's own setting, or its lifecycle, is not read.
    Absent,
    /// Present and empty: the key's presence is what counts.
    Empty,
}

/// An annotation Remora reads from a live pod, and the longest value kept.
#[derive(Clone, Copy, Debug)]
struct Read {
    key: &'static str,
    max: usize,
    too_long: TooLong,
}

/// `key`, when Remora reads it from a live pod: the status, the lifecycle,
/// the stop request and the pod's own settings.
fn read_annotation(key: &str) -> Option<Read> {
    let (key, max, too_long) = match key {
        STATUS => (STATUS, MAX_STATUS, TooLong::Empty),
        STOP => (STOP, MAX_STOP, TooLong::Empty),
        LIFECYCLE => (LIFECYCLE, MAX_LIFECYCLE, TooLong::Absent),
        WORKLOAD_CA => (WORKLOAD_CA, MAX_SETTING, TooLong::Absent),
        OUTBOUND => (OUTBOUND, MAX_OUTBOUND, TooLong::Absent),
        // Served by the discovery server (a too long one reads as absent:
        // the sidecar keeps the listeners it was injected with).
        INBOUND => (INBOUND, MAX_OUTBOUND, TooLong::Absent),
        INBOUND_TLS => (INBOUND_TLS, MAX_OUTBOUND, TooLong::Absent),
        k => (
            *PER_FIELD.iter().find(|f| **f == k)?,
            MAX_SETTING,
            TooLong::Absent,
        ),
    };
    Some(Read { key, max, too_long })
}

/// The labels of one pod so far, against [`MAX_LABELS`] and
/// [`MAX_LABEL_BYTES`].
#[derive(Default)]
struct LabelBudget {
    count: usize,
    bytes: usize,
}

impl LabelBudget {
    /// Counts one more label; whether all so far fit.
    fn admit(&mut self, key: &str, value: &str) -> bool {
        self.count = self.count.saturating_add(1);
        self.bytes = self
            .bytes
            .saturating_add(key.len())
            .saturating_add(value.len());
        self.count <= MAX_LABELS && self.bytes <= MAX_LABEL_BYTES
    }
}

/// A pod as the API server sends it, read into what [`LivePod`] keeps.
#[derive(Deserialize)]
struct WirePod {
    #[serde(default)]
    metadata: WireMeta,
    spec: Option<LiveSpec>,
    status: Option<LiveStatus>,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    /// The watcher resumes from it; [`Slim::slim`] drops it after.
    resource_version: Option<String>,
    deletion_timestamp: Option<Time>,
    labels: Option<WireLabels>,
    annotations: Option<WireAnnotations>,
    owner_references: Option<ControllerRef>,
}

impl From<WirePod> for LivePod {
    fn from(w: WirePod) -> Self {
        let m = w.metadata;
        let labels = m.labels.unwrap_or_default();
        let annotations = m.annotations.unwrap_or_default();
        Self {
            metadata: ObjectMeta {
                name: m.name,
                namespace: m.namespace,
                uid: m.uid,
                resource_version: m.resource_version,
                deletion_timestamp: m.deletion_timestamp,
                labels: (!labels.kept.is_empty()).then_some(labels.kept),
                annotations: (!annotations.kept.is_empty()).then_some(annotations.kept),
                owner_references: m.owner_references.and_then(|o| o.0).map(|o| vec![o]),
                ..ObjectMeta::default()
            },
            spec: w.spec,
            status: w.status,
            kept: Kept::default(),
            trimmed: Trimmed {
                labels: labels.over,
                annotations: annotations.too_long,
            },
        }
    }
}

/// A string of at most `.0` bytes, `None` for a longer one (never
/// allocated).
struct Bounded(usize);

impl<'de> DeserializeSeed<'de> for Bounded {
    type Value = Option<String>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for Bounded {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok((v.len() <= self.0).then(|| v.to_owned()))
    }
}

/// A pod's labels, within [`MAX_LABELS`] and [`MAX_LABEL_BYTES`]; none
/// when over.
#[derive(Default)]
struct WireLabels {
    kept: BTreeMap<String, String>,
    over: bool,
}

impl<'de> Deserialize<'de> for WireLabels {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = WireLabels;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of labels")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<WireLabels, A::Error> {
                let mut out = WireLabels::default();
                let mut budget = LabelBudget::default();
                loop {
                    // Once over, the rest is read past, never allocated.
                    let max = if out.over { 0 } else { MAX_LABEL_BYTES };
                    let Some(k) = m.next_key_seed(Bounded(max))? else {
                        break;
                    };
                    let v = m.next_value_seed(Bounded(max))?;
                    match (k, v) {
                        (Some(k), Some(v)) if !out.over && budget.admit(&k, &v) => {
                            out.kept.insert(k, v);
                        }
                        _ => out.over = true,
                    }
                }
                if out.over {
                    out.kept = BTreeMap::new();
                }
                Ok(out)
            }
        }
        d.deserialize_map(V)
    }
}

/// The annotations Remora reads ([`read_annotation`]), each value within
/// its bound; the others are read past, never allocated.
#[derive(Default)]
struct WireAnnotations {
    kept: BTreeMap<String, String>,
    too_long: u32,
}

/// An annotation's key: what Remora reads of it, if anything.
struct AnnotationKey;

impl<'de> DeserializeSeed<'de> for AnnotationKey {
    type Value = Option<Read>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for AnnotationKey {
    type Value = Option<Read>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an annotation key")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(read_annotation(v))
    }
}

impl<'de> Deserialize<'de> for WireAnnotations {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = WireAnnotations;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of annotations")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<WireAnnotations, A::Error> {
                let mut out = WireAnnotations::default();
                while let Some(read) = m.next_key_seed(AnnotationKey)? {
                    let Some(read) = read else {
                        m.next_value::<IgnoredAny>()?;
                        continue;
                    };
                    match m.next_value_seed(Bounded(read.max))? {
                        Some(v) => {
                            out.kept.insert(read.key.to_owned(), v);
                        }
                        None => {
                            out.too_long = out.too_long.saturating_add(1);
                            if read.too_long == TooLong::Empty {
                                out.kept.insert(read.key.to_owned(), String::new());
                            }
                        }
                    }
                }
                Ok(out)
            }
        }
        d.deserialize_map(V)
    }
}

/// Of a pod's ownerReferences, the controlling one (the API allows one):
/// the only one read.
struct ControllerRef(Option<OwnerReference>);

impl<'de> Deserialize<'de> for ControllerRef {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ControllerRef;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of ownerReferences")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<ControllerRef, A::Error> {
                let mut found = None;
                while let Some(o) = s.next_element::<OwnerReference>()? {
                    if found.is_none() && o.controller == Some(true) {
                        found = Some(o);
                    }
                }
                Ok(ControllerRef(found))
            }
        }
        d.deserialize_seq(V)
    }
}

/// Of a pod's conditions, its `Ready` one's status; the others (and every
/// message) are read past, never allocated.
fn ready_condition<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    #[derive(Deserialize)]
    struct Condition {
        #[serde(rename = "type")]
        type_: Option<ConditionWord>,
        status: Option<ConditionWord>,
    }
    /// A short word (`Ready`, `True`): anything longer reads as none.
    struct ConditionWord(Option<String>);
    impl<'de> Deserialize<'de> for ConditionWord {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            Bounded(32).deserialize(d).map(ConditionWord)
        }
    }
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Option<bool>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a list of conditions")
        }

        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_seq(self)
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Self::Value, A::Error> {
            let mut ready = None;
            while let Some(c) = s.next_element::<Condition>()? {
                if c.type_.and_then(|t| t.0).as_deref() == Some("Ready") {
                    ready = Some(c.status.and_then(|s| s.0).as_deref() == Some("True"));
                }
            }
            Ok(ready)
        }
    }
    d.deserialize_option(V)
}

/// A list of at most [`MAX_CONTAINERS`] elements; a longer one reads as
/// absent, the rest read past, never allocated.
fn bounded_list<'de, D, T>(d: D) -> Result<Option<Vec<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct V<T>(PhantomData<T>);
    impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
        type Value = Option<Vec<T>>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a list")
        }

        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_seq(self)
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while out.len() < MAX_CONTAINERS {
                match s.next_element()? {
                    Some(e) => out.push(e),
                    None => return Ok(Some(out)),
                }
            }
            let mut over = false;
            while s.next_element::<IgnoredAny>()?.is_some() {
                over = true;
            }
            Ok((!over).then_some(out))
        }
    }
    d.deserialize_option(V(PhantomData))
}

impl LivePod {
    /// A pod of these metadata (a workload's pod template, say), trimmed
    /// as the watch trims it (but kept whole when not injected).
    pub fn from_meta(metadata: ObjectMeta) -> Self {
        let mut p = Self {
            metadata,
            ..Self::default()
        };
        Slim::default().trim(&mut p);
        p.trimmed = Trimmed::default();
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

    pub fn service_account(&self) -> Option<&str> {
        self.spec.as_ref()?.service_account_name.as_deref()
    }

    pub fn ip(&self) -> Option<&str> {
        self.status.as_ref()?.pod_ip.as_deref()
    }

    pub fn outbound(&self) -> Option<&str> {
        self.annotations().get(OUTBOUND).map(String::as_str)
    }

    pub fn inbound_tls(&self) -> Option<&str> {
        self.annotations().get(INBOUND_TLS).map(String::as_str)
    }

    /// Its `Ready` condition, once reported.
    pub fn ready(&self) -> Option<bool> {
        self.status.as_ref()?.ready
    }

    /// Whether it has been asked to stop (a deletion timestamp).
    pub fn deleting(&self) -> bool {
        self.metadata.deletion_timestamp.is_some()
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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TrimmedLabels {
    what: &'static str,
}

/// What the pod watch dropped for being over its bounds.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    trimmed: Family<TrimmedLabels, Counter>,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Self {
        let me = Self::default();
        registry.register(
            "pod_watch_trimmed",
            "Pods read by the leader's pod watch (listed or changed) with something over its \
             bounds, dropped: what=labels (read as none), what=annotation (a value of an \
             annotation Remora reads)",
            me.trimmed.clone(),
        );
        me
    }

    /// Pods read with `what` over the bounds, so far.
    pub fn trimmed(&self, what: &'static str) -> u64 {
        self.trimmed.get_or_create(&TrimmedLabels { what }).get()
    }
}

/// The pod watch, read by the SidecarLifecycle controller, the Jobs
/// controller and (on every replica, when on) the discovery server, until
/// `shutdown`.
pub fn live_pods(
    client: Client,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> SharedWatch<LivePod> {
    let mut slim = Slim::new(metrics);
    SharedWatch::start(
        "pods",
        Api::all(client),
        watcher::Config::default()
            .fields(LIVE_PODS)
            .page_size(LIST_PAGE),
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
    metrics: Metrics,
}

impl Slim {
    /// A `Slim` counting what it drops in `metrics`.
    pub fn new(metrics: Metrics) -> Self {
        Self {
            metrics,
            ..Self::default()
        }
    }

    /// Drops what nobody reads: managed fields, the server's bookkeeping
    /// (the watcher has taken the resourceVersion before this runs),
    /// annotations Remora does not read (a kubectl last-applied copy, say,
    /// can be a pod's largest part), what is over the bounds, and the
    /// containers and their statuses of a pod that restarts them `Always`:
    /// only the Jobs controller reads those, and it leaves such a pod
    /// alone. Of a pod Remora did not inject, only its name, namespace,
    /// uid and labels stay. Labels, the lifecycle and the status move into
    /// [`Kept`]. Idempotent.
    pub fn slim(&mut self, p: &mut LivePod) {
        self.trim(p);
        if p.kept.injected.is_none() {
            let meta = &mut p.metadata;
            meta.annotations = None;
            meta.owner_references = None;
            meta.deletion_timestamp = None;
            p.kept.lifecycle = None;
            p.spec = None;
            p.status = None;
        }
        if p.trimmed.any() {
            // Debug, not warn: whoever writes the pods would write the log.
            tracing::debug!(
                pod = %format_args!(
                    "{}/{}",
                    p.metadata.namespace.as_deref().unwrap_or_default(),
                    p.metadata.name.as_deref().unwrap_or_default()
                ),
                labels_dropped = p.trimmed.labels,
                annotations_too_long = p.trimmed.annotations,
                "pod over the watch's bounds: what is over is not kept"
            );
            for (what, over) in [
                ("labels", p.trimmed.labels),
                ("annotation", p.trimmed.annotations > 0),
            ] {
                if over {
                    self.metrics
                        .trimmed
                        .get_or_create(&TrimmedLabels { what })
                        .inc();
                }
            }
            p.trimmed = Trimmed::default();
        }
    }

    /// [`Slim::slim`] but for pods not injected: the same bounds, on
    /// metadata given whole.
    fn trim(&mut self, p: &mut LivePod) {
        let meta = &mut p.metadata;
        meta.managed_fields = None;
        meta.resource_version = None;
        meta.generate_name = None;
        meta.creation_timestamp = None;
        if let Some(owners) = meta.owner_references.take() {
            meta.owner_references = owners
                .into_iter()
                .find(|o| o.controller == Some(true))
                .map(|o| vec![o]);
        }
        if let Some(labels) = meta.labels.take() {
            let mut budget = LabelBudget::default();
            if labels.iter().all(|(k, v)| budget.admit(k, v)) {
                let pairs = Labels::pairs(labels);
                p.kept.labels = Labels(self.labels.get(&pairs[..], || Arc::from(&pairs[..])));
            } else {
                p.trimmed.labels = true;
                p.kept.labels = Labels::default();
            }
        }
        if let Some(mut a) = meta.annotations.take() {
            let trimmed = &mut p.trimmed;
            a.retain(|k, v| {
                let Some(read) = read_annotation(k) else {
                    return false;
                };
                if v.len() <= read.max {
                    return true;
                }
                trimmed.annotations = trimmed.annotations.saturating_add(1);
                *v = String::new();
                read.too_long == TooLong::Empty
            });
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
                service_account_name: s.service_account_name,
                ..LiveSpec::default()
            });
            // What the discovery server reads of a pod it serves.
            p.status = p
                .status
                .take()
                .filter(|s| s.pod_ip.is_some() || s.ready.is_some())
                .map(|s| LiveStatus {
                    pod_ip: s.pod_ip,
                    ready: s.ready,
                    ..LiveStatus::default()
                });
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
    use remora_contract::annotations;

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
    fn a_pod_that_restarts_always_keeps_no_containers_and_of_its_status_its_ip_only() {
        let full = Pod {
            metadata: ObjectMeta {
                name: Some("web-7d9f-x2".into()),
                generate_name: Some("web-7d9f-".into()),
                resource_version: Some("42".into()),
                annotations: Some(
                    [
                        (STATUS.to_string(), "{}".to_string()),
                        (OUTBOUND.to_string(), "15001:cart.shop:80".to_string()),
                    ]
                    .into(),
                ),
                ..Default::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "app".into(),
                    ..Container::default()
                }],
                restart_policy: Some("Always".into()),
                service_account_name: Some("web".into()),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".into()),
                pod_ip: Some("10.0.0.7".into()),
                ..PodStatus::default()
            }),
        };
        let live = read(&full);
        // What the discovery server reads stays.
        assert_eq!(live.outbound(), Some("15001:cart.shop:80"));
        assert_eq!(
            live,
            LivePod {
                metadata: ObjectMeta {
                    name: Some("web-7d9f-x2".into()),
                    annotations: Some(
                        [(OUTBOUND.to_string(), "15001:cart.shop:80".to_string())].into()
                    ),
                    ..Default::default()
                },
                spec: Some(LiveSpec {
                    restart_policy: Some("Always".into()),
                    service_account_name: Some("web".into()),
                    ..LiveSpec::default()
                }),
                status: Some(LiveStatus {
                    pod_ip: Some("10.0.0.7".into()),
                    ..LiveStatus::default()
                }),
                kept: Kept {
                    injected: Some(Arc::new(Injected::default())),
                    ..Kept::default()
                },
                trimmed: Trimmed::default(),
            }
        );
        // The Jobs controller never looks further into it.
        assert!(!crate::controllers::jobs::may_complete(&live));
    }

    #[test]
    fn an_injected_pod_keeps_its_ready_condition_and_deletion() {
        use k8s_openapi::api::core::v1::PodCondition;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let pod = |conditions: Option<Vec<(&str, &str)>>, deleting: bool| Pod {
            metadata: ObjectMeta {
                name: Some("web-0".into()),
                annotations: Some([(STATUS.to_string(), "{}".to_string())].into()),
                deletion_timestamp: deleting.then(|| Time(Default::default())),
                ..Default::default()
            },
            spec: Some(PodSpec {
                restart_policy: Some("Always".into()),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                conditions: conditions.map(|cs| {
                    cs.into_iter()
                        .map(|(t, s)| PodCondition {
                            type_: t.into(),
                            status: s.into(),
                            message: Some("x".repeat(10_000)),
                            ..Default::default()
                        })
                        .collect()
                }),
                ..PodStatus::default()
            }),
        };
        let read_back = |p: &Pod| {
            let live = read(p);
            (live.ready(), live.deleting())
        };
        assert_eq!(read_back(&pod(None, false)), (None, false));
        let ready = vec![("PodScheduled", "True"), ("Ready", "True")];
        assert_eq!(read_back(&pod(Some(ready), false)), (Some(true), false));
        let unready = vec![("Ready", "False"), ("ContainersReady", "True")];
        assert_eq!(read_back(&pod(Some(unready), true)), (Some(false), true));
        assert_eq!(
            read_back(&pod(Some(vec![("Ready", "Unknown")]), false)),
            (Some(false), false)
        );
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
            annotations: Some(
                [(LIFECYCLE, "{}"), (STATUS, "{}")]
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .into(),
            ),
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

    /// A pod as JSON, read and trimmed by a watch's `Slim` counting into
    /// `metrics`.
    fn through_watch(metrics: &Metrics, pod: &serde_json::Value) -> LivePod {
        let mut p: LivePod =
            serde_json::from_str(&pod.to_string()).expect("a pod reads as a LivePod");
        Slim::new(metrics.clone()).slim(&mut p);
        p
    }

    /// A pod with `meta` merged into its metadata and `spec` as its spec.
    fn pod_json(meta: serde_json::Value, spec: serde_json::Value) -> serde_json::Value {
        let mut m = serde_json::json!({"name": "p", "namespace": "tenant", "uid": "u-1",
            "resourceVersion": "7"});
        if let (Some(m), Some(extra)) = (m.as_object_mut(), meta.as_object()) {
            m.extend(extra.clone());
        }
        serde_json::json!({"apiVersion": "v1", "kind": "Pod", "metadata": m, "spec": spec,
            "status": {"phase": "Running"}})
    }

    #[test]
    fn a_pod_not_injected_keeps_its_name_and_labels_only() {
        let metrics = Metrics::default();
        let p = through_watch(
            &metrics,
            &pod_json(
                serde_json::json!({
                    "labels": {"app": "web"},
                    "annotations": {LIFECYCLE: "{}", annotations::DRAIN_DURATION: "9s",
                        "remora.dev/pad": "x"},
                    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                        "name": "web-1", "uid": "o-1", "controller": true}],
                }),
                serde_json::json!({"restartPolicy": "Never",
                    "containers": [{"name": "app"}]}),
            ),
        );
        assert_eq!(
            p.metadata,
            ObjectMeta {
                name: Some("p".into()),
                namespace: Some("tenant".into()),
                uid: Some("u-1".into()),
                ..ObjectMeta::default()
            }
        );
        assert_eq!(p.labels().get("app"), Some("web"));
        assert_eq!((p.lifecycle(), p.injected()), (None, None));
        assert_eq!((&p.spec, &p.status), (&None, &None));
        assert!(!crate::controllers::jobs::may_complete(&p));
    }

    #[test]
    fn only_the_annotations_remora_reads_are_kept_each_within_its_bound() {
        let metrics = Metrics::default();
        let big = |n: usize| "x".repeat(n);
        let read = |a: serde_json::Value| {
            let mut a = a;
            if a.get(STATUS).is_none() {
                a[STATUS] = "{}".into();
            }
            through_watch(
                &metrics,
                &pod_json(serde_json::json!({"annotations": a}), serde_json::json!({})),
            )
        };
        // Within the bounds: kept.
        let ok = read(serde_json::json!({
            LIFECYCLE: big(MAX_LIFECYCLE), annotations::DRAIN_DURATION: "9s",
            WORKLOAD_CA: "false", STOP: "{}",
            "remora.dev/pad": big(200 << 10),
            "kubectl.kubernetes.io/last-applied-configuration": big(1000),
        }));
        assert_eq!(ok.lifecycle().map(str::len), Some(MAX_LIFECYCLE));
        assert_eq!(
            ok.annotations()
                .keys()
                .map(String::as_str)
                .collect::<Vec<_>>(),
            [annotations::DRAIN_DURATION, STOP, WORKLOAD_CA],
            "no pad, no kubectl copy: only what Remora reads"
        );
        assert_eq!(metrics.trimmed("annotation"), 0);
        // Over them: the settings and the lifecycle read as absent, the
        // status and the stop request as present and empty.
        let over = read(serde_json::json!({
            STATUS: format!(r#"{{"sources":["{}"]}}"#, big(MAX_STATUS)),
            LIFECYCLE: big(MAX_LIFECYCLE + 1),
            annotations::DRAIN_DURATION: big(MAX_SETTING + 1),
            STOP: big(200 << 10),
        }));
        assert_eq!(over.injected(), Some(&Injected::default()));
        assert_eq!(over.lifecycle(), None);
        assert_eq!(
            over.annotations(),
            &BTreeMap::from([(STOP.to_string(), String::new())])
        );
        assert_eq!(metrics.trimmed("annotation"), 1, "one pod");
        assert_eq!(metrics.trimmed("labels"), 0);
    }

    #[test]
    fn labels_over_the_bounds_read_as_none() {
        let metrics = Metrics::default();
        let read = |labels: serde_json::Value| {
            through_watch(
                &metrics,
                &pod_json(serde_json::json!({"labels": labels}), serde_json::json!({})),
            )
        };
        let many = |n: usize| -> serde_json::Value {
            (0..n)
                .map(|i| (format!("k{i:03}"), serde_json::Value::from("v")))
                .collect::<serde_json::Map<_, _>>()
                .into()
        };
        assert_eq!(read(many(MAX_LABELS)).labels().iter().count(), MAX_LABELS);
        assert_eq!(metrics.trimmed("labels"), 0);
        assert_eq!(read(many(MAX_LABELS + 1)).labels().iter().count(), 0);
        assert_eq!(read(many(1_000)).labels().iter().count(), 0);
        let long = read(serde_json::json!({"app": "web", "pad": "x".repeat(1 << 20)}));
        assert_eq!(long.labels().get("app"), None);
        assert_eq!(metrics.trimmed("labels"), 3);
        // Templates (not from the watch) are bounded alike.
        let template = LivePod::from_meta(ObjectMeta {
            labels: Some(
                (0..=MAX_LABELS)
                    .map(|i| (format!("k{i}"), "v".to_string()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        });
        assert_eq!(template.labels().iter().count(), 0);
    }

    #[test]
    fn only_the_controlling_owner_and_a_bounded_list_of_containers_are_kept() {
        let metrics = Metrics::default();
        let owner = |i: usize, controller: bool| {
            serde_json::json!({"apiVersion": "apps/v1", "kind": "ReplicaSet",
                "name": format!("rs-{i}"), "uid": format!("o-{i}"), "controller": controller})
        };
        let mut owners: Vec<_> = (0..10_000).map(|i| owner(i, false)).collect();
        owners.insert(5_000, owner(5_000, true));
        let containers = |n: usize| -> Vec<serde_json::Value> {
            (0..n)
                .map(|i| serde_json::json!({"name": format!("c{i}"), "image": "i"}))
                .collect()
        };
        let meta = serde_json::json!({"ownerReferences": owners,
            "annotations": {STATUS: "{}"}});
        let p = through_watch(
            &metrics,
            &pod_json(
                meta.clone(),
                serde_json::json!({"restartPolicy": "Never",
                    "containers": containers(MAX_CONTAINERS)}),
            ),
        );
        assert_eq!(
            p.metadata
                .owner_references
                .iter()
                .flatten()
                .map(|o| o.name.as_str())
                .collect::<Vec<_>>(),
            ["rs-5000"]
        );
        assert_eq!(p.containers().len(), MAX_CONTAINERS);
        let p = through_watch(
            &metrics,
            &pod_json(
                meta,
                serde_json::json!({"restartPolicy": "Never",
                    "containers": containers(10_000)}),
            ),
        );
        assert!(p.containers().is_empty());
        assert_eq!(
            crate::controllers::jobs::decide(&p),
            crate::controllers::jobs::Decision::Leave(crate::controllers::jobs::Skip::NotLegacy),
            "the Jobs controller leaves it alone"
        );
    }
}
