//! The admission handler: AdmissionReview bytes in, AdmissionReview out.
//! Whatever comes in, the answer is a valid review. It allows the pod (when
//! the injector cannot help it says why in a warning), except when injecting
//! as asked would be unsafe (traffic plumbing onto the sidecar's own ports)
//! or whether to inject is unknown (a namespace neither cached nor readable):
//! then it refuses the pod with the reason.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::core::admission::{AdmissionResponse, AdmissionReview, Operation};
use kube::core::{DynamicObject, GroupVersionKind, PartialObjectMeta};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use remora_inject::patch::{
    INJECT_LABEL, MutateError, Outcome, Selection, Target, mutate, pod_meta,
};
use remora_inject::resolve::{ChartDefaults, LifecycleEntry, resolve};

/// What the handler reads about the cluster; kept in memory (reflectors in
/// the operator, fixed values in tests). The one API call an admission may
/// make is [`ClusterView::lookup_namespace_labels`], for a namespace the
/// cache has not seen yet.
pub trait ClusterView: Send + Sync {
    /// The `SidecarLifecycle`s of these namespaces. A pod's own and the
    /// operator's (the cluster default) are all that can reach it: copying
    /// all of a cluster's thousand for each review cost a millisecond of CPU.
    fn lifecycles_in(&self, namespaces: &[&str]) -> Vec<LifecycleEntry>;
    /// The labels of a namespace; `None` when unknown.
    fn namespace_labels(&self, namespace: &str) -> Option<BTreeMap<String, String>>;
    /// Whether every node runs native sidecars (kubelet >= 1.29).
    fn native_sidecars(&self) -> bool;
    /// The labels of a namespace [`Self::namespace_labels`] does not know
    /// (created a moment ago, not yet in the cache), asked of the source;
    /// `Ok(None)` when it does not exist. A view that holds every namespace
    /// (tests) answers from what it holds.
    fn lookup_namespace_labels<'a>(&'a self, namespace: &'a str) -> BoxFuture<'a, Lookup> {
        Box::pin(std::future::ready(Ok(self.namespace_labels(namespace))))
    }
}

/// What [`ClusterView::lookup_namespace_labels`] answers.
pub type Lookup = Result<Option<BTreeMap<String, String>>, LookupError>;

/// How long an admission waits for a namespace the cache does not know: well
/// inside the webhook's own timeout (the chart's `timeoutSeconds`).
pub const NAMESPACE_LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    #[error("reading namespace {namespace:?} from the API server: {source}")]
    Api {
        namespace: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "namespace {namespace:?} is not in the injector's cache yet and the API server did not \
         answer within {timeout:?}"
    )]
    Timeout {
        namespace: String,
        timeout: Duration,
    },
}

/// A cached view that asks the API server for the namespaces it has not
/// seen yet, each lookup bounded by `timeout`: without it, a pod created
/// right after its (injection-enabled) namespace would silently go without
/// its sidecar.
pub struct LookingUpView<V> {
    cached: V,
    namespaces: Api<Namespace>,
    timeout: Duration,
}

impl<V: ClusterView> LookingUpView<V> {
    pub fn new(cached: V, client: kube::Client, timeout: Duration) -> Self {
        Self {
            cached,
            namespaces: Api::all(client),
            timeout,
        }
    }
}

impl<V: ClusterView> ClusterView for LookingUpView<V> {
    fn lifecycles_in(&self, namespaces: &[&str]) -> Vec<LifecycleEntry> {
        self.cached.lifecycles_in(namespaces)
    }
    fn namespace_labels(&self, namespace: &str) -> Option<BTreeMap<String, String>> {
        self.cached.namespace_labels(namespace)
    }
    fn native_sidecars(&self) -> bool {
        self.cached.native_sidecars()
    }
    fn lookup_namespace_labels<'a>(&'a self, namespace: &'a str) -> BoxFuture<'a, Lookup> {
        Box::pin(bounded_lookup(
            namespace,
            self.timeout,
            self.namespaces.get_metadata_opt(namespace),
        ))
    }
}

/// A namespace read, given up after `timeout`.
pub async fn bounded_lookup<F>(namespace: &str, timeout: Duration, get: F) -> Lookup
where
    F: Future<Output = kube::Result<Option<PartialObjectMeta<Namespace>>>>,
{
    match tokio::time::timeout(timeout, get).await {
        Ok(Ok(ns)) => Ok(ns.map(|n| n.metadata.labels.unwrap_or_default())),
        Ok(Err(source)) => Err(LookupError::Api {
            namespace: namespace.to_string(),
            source,
        }),
        Err(_) => Err(LookupError::Timeout {
            namespace: namespace.to_string(),
            timeout,
        }),
    }
}

/// A fixed view, for tests and benchmarks.
#[derive(Debug, Clone, Default)]
pub struct StaticView {
    pub lifecycles: Vec<LifecycleEntry>,
    pub namespaces: BTreeMap<String, BTreeMap<String, String>>,
    pub native_sidecars: bool,
}

impl ClusterView for StaticView {
    fn lifecycles_in(&self, namespaces: &[&str]) -> Vec<LifecycleEntry> {
        self.lifecycles
            .iter()
            .filter(|e| namespaces.contains(&e.namespace.as_str()))
            .cloned()
            .collect()
    }
    fn namespace_labels(&self, namespace: &str) -> Option<BTreeMap<String, String>> {
        self.namespaces.get(namespace).cloned()
    }
    fn native_sidecars(&self) -> bool {
        self.native_sidecars
    }
}

/// How one admission ended, for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AdmissionOutcome {
    Injected,
    Skipped,
    Ignored,
    Invalid,
    /// Denied: the pod asks for something the sidecar must not do (a
    /// listener on its own ports), or whether it is selected is unknown.
    Refused,
    Error,
    /// Refused with a 503: the reviews in progress hold the memory budget.
    Overloaded,
}

impl AdmissionOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Injected => "injected",
            Self::Skipped => "skipped",
            Self::Ignored => "ignored",
            Self::Invalid => "invalid",
            Self::Refused => "refused",
            Self::Error => "error",
            Self::Overloaded => "overloaded",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

/// What the webhook counts and times: answers by outcome, their latency,
/// and the reviews being answered now.
#[derive(Clone, Debug)]
pub struct Metrics {
    admissions: Family<OutcomeLabels, Counter>,
    latency: Histogram,
    in_flight: Gauge,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Self {
        let admissions = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "admissions",
            "Admission reviews answered, by outcome",
            admissions.clone(),
        );
        // 62.5µs .. ~2s, doubling: whole milliseconds from 1 ms (1, 2, 4 ..),
        // so a 2 ms latency goal is a bucket's bound.
        let latency = Histogram::new(exponential_buckets(0.0000625, 2.0, 16));
        registry.register(
            "admission_duration_seconds",
            "Time to answer one admission review, body read included",
            latency.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "admissions_in_flight",
            "Admission reviews being read or answered now",
            in_flight.clone(),
        );
        Self {
            admissions,
            latency,
            in_flight,
        }
    }

    pub fn observe(&self, outcome: AdmissionOutcome, took: Duration) {
        self.admissions
            .get_or_create(&OutcomeLabels {
                outcome: outcome.as_str(),
            })
            .inc();
        self.latency.observe(took.as_secs_f64());
    }

    /// Counts one review in flight until the guard is dropped (answered or
    /// cut off).
    pub fn in_flight(&self) -> InFlight {
        self.in_flight.inc();
        InFlight(self.in_flight.clone())
    }
}

/// See [`Metrics::in_flight`].
pub struct InFlight(Gauge);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The injector's admission logic, shared by the server's handlers.
pub struct Injector {
    pub chart: ChartDefaults,
    pub operator_namespace: String,
    pub view: Arc<dyn ClusterView>,
}

/// The parts of an AdmissionReview the handler reads. The pod stays one
/// JSON tree, read once from the body (no typed copy of it, no second
/// tree); what is not needed (oldObject, userInfo, options) is skipped
/// without being kept.
#[derive(Deserialize)]
struct ReviewIn {
    request: Option<RequestIn>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RequestIn {
    uid: String,
    kind: GroupVersionKind,
    #[serde(default)]
    namespace: Option<String>,
    operation: Operation,
    #[serde(default)]
    sub_resource: Option<String>,
    #[serde(default, deserialize_with = "pruned_pod")]
    object: Option<Value>,
}

/// The pod of a review, keeping only what the injector reads (see [`Keep`]):
/// a pod's bulk (env, volumes' sources, managed fields, big annotations) is
/// skipped while parsing, never held, so a review costs about its body size
/// whatever its shape. `null` is no object.
fn pruned_pod<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    use serde::de::DeserializeSeed;
    let v = Keep::Pod.deserialize(d)?;
    Ok((!v.is_null()).then_some(v))
}

/// Which part of a pod a JSON value is, and so what of it is kept: what
/// [`mutate`] and the selection read, and the shape (object, array, null)
/// of everything the patch paths go through. A value of an unexpected type
/// is kept as it is (scalars) or emptied (arrays where an object belongs),
/// so that [`mutate`] still sees that it is wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keep {
    All,
    Pod,
    Meta,
    Annotations,
    Spec,
    Containers,
    Container,
    Lifecycle,
    Mounts,
    Mount,
    Volumes,
    Volume,
}

impl Keep {
    /// What is kept of the member `key` of an object of this kind.
    fn member(self, key: &str) -> Option<Keep> {
        use Keep::*;
        match (self, key) {
            (All, _) => Some(All),
            (Pod, "metadata") => Some(Meta),
            (Pod, "spec") => Some(Spec),
            (Pod, "apiVersion" | "kind") => Some(All),
            (Meta, "labels" | "namespace" | "name" | "generateName") => Some(All),
            (Meta, "annotations") => Some(Annotations),
            (Annotations, k) if k.starts_with(remora_contract::annotations::PREFIX) => Some(All),
            (Spec, "containers" | "initContainers") => Some(Containers),
            (Spec, "volumes") => Some(Volumes),
            (Spec, "hostNetwork" | "restartPolicy" | "terminationGracePeriodSeconds") => Some(All),
            (Container, "name" | "ports") => Some(All),
            (Container, "lifecycle") => Some(Lifecycle),
            (Lifecycle, "preStop") => Some(All),
            (Container, "volumeMounts") => Some(Mounts),
            (Mount, "mountPath") => Some(All),
            (Volume, "name") => Some(All),
            _ => None,
        }
    }

    /// What is kept of the elements of an array of this kind; `None`: an
    /// array where an object belongs, kept empty.
    fn element(self) -> Option<Keep> {
        match self {
            Keep::All => Some(Keep::All),
            Keep::Containers => Some(Keep::Container),
            Keep::Mounts => Some(Keep::Mount),
            Keep::Volumes => Some(Keep::Volume),
            _ => None,
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for Keep {
    type Value = Value;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        if self == Keep::All {
            return Value::deserialize(d);
        }
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Keep {
    type Value = Value;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(v.into())
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(v.into())
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(v.into())
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        match self.element() {
            Some(keep) => {
                while let Some(v) = seq.next_element_seed(keep)? {
                    out.push(v);
                }
            }
            None => while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {},
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            match self.member(&key) {
                Some(keep) => {
                    let v = map.next_value_seed(keep)?;
                    out.insert(key, v);
                }
                None => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(Value::Object(out))
    }
}

/// A review read by [`Injector::parse`], to be answered by [`Injector::answer`].
pub struct ParsedReview(RequestIn);

/// Only the uid, to answer a review that cannot be read otherwise.
#[derive(Deserialize)]
struct UidOnly {
    request: Option<UidIn>,
}

#[derive(Deserialize)]
struct UidIn {
    uid: Option<String>,
}

/// A review answering a request that could not be read: allowed, with the
/// reason as a warning, and the uid if it could be found at all.
pub fn unreadable(uid: String, reason: &str) -> AdmissionReview<DynamicObject> {
    let mut resp = AdmissionResponse::invalid(reason);
    resp.allowed = true;
    resp.uid = uid;
    resp.result.message = format!("remora: not injected: {reason}");
    resp.warnings = Some(vec![truncate(format!("remora: not injected: {reason}"))]);
    resp.into_review()
}

/// The most warnings one answer carries; the API server caps them too
/// (and each one's length), so more would be lost without saying so.
pub const MAX_WARNINGS: usize = 10;
/// The longest warning, in bytes (the API server truncates at 256).
pub const MAX_WARNING_BYTES: usize = 256;

/// Kubernetes truncates long warnings; keep them readable.
fn truncate(mut s: String) -> String {
    if s.len() > MAX_WARNING_BYTES {
        let mut cut = MAX_WARNING_BYTES - 3;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

/// At most [`MAX_WARNINGS`] warnings of at most [`MAX_WARNING_BYTES`]; the
/// last one says how many were left out.
pub fn cap_warnings(warnings: Vec<String>) -> Vec<String> {
    let total = warnings.len();
    if total <= MAX_WARNINGS {
        return warnings.into_iter().map(truncate).collect();
    }
    let mut kept: Vec<String> = warnings
        .into_iter()
        .take(MAX_WARNINGS - 1)
        .map(truncate)
        .collect();
    kept.push(format!(
        "remora: {} more warnings not shown",
        total - (MAX_WARNINGS - 1)
    ));
    kept
}

impl Injector {
    /// Answer one AdmissionReview body. It waits only when the pod's
    /// namespace is not in the cache (see [`ClusterView::lookup_namespace_labels`]).
    pub async fn review(&self, body: &[u8]) -> (AdmissionReview<DynamicObject>, AdmissionOutcome) {
        match Self::parse(body) {
            Ok(req) => self.answer(req).await,
            Err(answer) => *answer,
        }
    }

    /// The first half of [`Self::review`]: the parts of the review the
    /// answer needs, read from the body (which may then be freed), or the
    /// answer to a review that cannot be read.
    pub fn parse(
        body: &[u8],
    ) -> Result<ParsedReview, Box<(AdmissionReview<DynamicObject>, AdmissionOutcome)>> {
        let review: ReviewIn = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(e) => {
                // Find the uid leniently so the API server can match the answer.
                let uid = serde_json::from_slice::<UidOnly>(body)
                    .ok()
                    .and_then(|r| r.request?.uid)
                    .unwrap_or_default();
                return Err(Box::new((
                    unreadable(uid, &format!("unreadable AdmissionReview: {e}")),
                    AdmissionOutcome::Invalid,
                )));
            }
        };
        match review.request {
            Some(req) => Ok(ParsedReview(req)),
            None => Err(Box::new((
                unreadable(String::new(), "the AdmissionReview has no request"),
                AdmissionOutcome::Invalid,
            ))),
        }
    }

    /// The second half of [`Self::review`].
    pub async fn answer(
        &self,
        req: ParsedReview,
    ) -> (AdmissionReview<DynamicObject>, AdmissionOutcome) {
        let (resp, outcome) = self.admit(req.0).await;
        (resp.into_review(), outcome)
    }

    async fn admit(&self, req: RequestIn) -> (AdmissionResponse, AdmissionOutcome) {
        let mut resp = AdmissionResponse::invalid("");
        resp.allowed = true;
        resp.uid = req.uid;
        resp.result = Default::default();
        if !req.kind.group.is_empty() || req.kind.kind != "Pod" {
            let msg = format!(
                "remora: not injected: {}/{} is not a Pod",
                req.kind.group, req.kind.kind
            );
            return (with_message(resp, msg, false), AdmissionOutcome::Ignored);
        }
        if req.operation != Operation::Create || req.sub_resource.is_some() {
            return (resp, AdmissionOutcome::Ignored);
        }
        let Some(pod) = req.object else {
            return (
                with_message(
                    resp,
                    "remora: not injected: no object in the request".into(),
                    true,
                ),
                AdmissionOutcome::Invalid,
            );
        };
        let namespace = req
            .namespace
            .or_else(|| pod["metadata"]["namespace"].as_str().map(str::to_string))
            .unwrap_or_else(|| "default".into());
        let (labels, annotations) = pod_meta(&pod);
        let ns_labels = match self.namespace_labels(&namespace, &labels).await {
            Ok(l) => l,
            // Whether the pod should get a sidecar is unknown: refused, as
            // failurePolicy Fail would, never admitted without it unasked.
            Err(e) => {
                return (
                    resp.deny(format!("remora: refused: {e}; try again")),
                    AdmissionOutcome::Refused,
                );
            }
        };
        let cfg = resolve(
            &self.chart,
            &self
                .view
                .lifecycles_in(&[namespace.as_str(), self.operator_namespace.as_str()]),
            &self.operator_namespace,
            &namespace,
            &labels,
            &annotations,
        );
        let target = Target {
            namespace: &namespace,
            namespace_labels: &ns_labels,
            native_sidecars: self.view.native_sidecars(),
            selection: Selection::Webhook,
        };
        let m = match mutate(&pod, &target, &cfg) {
            Ok(m) => m,
            Err(MutateError::Refused(e)) => {
                return (
                    resp.deny(format!("remora: refused: {e}")),
                    AdmissionOutcome::Refused,
                );
            }
            Err(e) => {
                return (
                    with_message(resp, format!("remora: not injected: {e}"), true),
                    AdmissionOutcome::Invalid,
                );
            }
        };
        let outcome = match m.outcome {
            Outcome::Injected(_) => AdmissionOutcome::Injected,
            Outcome::Skipped(_) => AdmissionOutcome::Skipped,
        };
        if !m.warnings.is_empty() {
            resp.warnings = Some(cap_warnings(m.warnings));
        }
        if m.patch.0.is_empty() {
            return (resp, outcome);
        }
        // kube's AdmissionResponse takes the Patch type of its own json-patch
        // version; the JSON form is the same, so convert through it.
        let patched = serde_json::to_value(&m.patch)
            .and_then(serde_json::from_value)
            .map_err(|e| e.to_string())
            .and_then(|p| resp.clone().with_patch(p).map_err(|e| e.to_string()));
        match patched {
            Ok(r) => (r, outcome),
            Err(e) => (
                with_message(resp, format!("remora: not injected: {e}"), true),
                AdmissionOutcome::Error,
            ),
        }
    }
}

impl Injector {
    /// The labels of the pod's namespace, looked up when the cache does not
    /// know it, unless the pod's own label decides alone.
    async fn namespace_labels(
        &self,
        namespace: &str,
        pod_labels: &BTreeMap<String, String>,
    ) -> Result<BTreeMap<String, String>, LookupError> {
        if let Some(l) = self.view.namespace_labels(namespace) {
            return Ok(l);
        }
        if matches!(
            pod_labels.get(INJECT_LABEL).map(String::as_str),
            Some("true" | "false")
        ) {
            return Ok(BTreeMap::new());
        }
        let found = self.view.lookup_namespace_labels(namespace).await?;
        if found.is_some() {
            tracing::debug!(
                namespace,
                "namespace not in the cache yet; read from the API"
            );
        }
        Ok(found.unwrap_or_default())
    }
}

/// Serialize a review for the wire. The patch goes out as base64, the way
/// Go encodes `[]byte` (kube would write an array of numbers, which the API
/// server also reads, at about three times the size).
pub fn encode_review(mut review: AdmissionReview<DynamicObject>) -> serde_json::Result<Vec<u8>> {
    let patch = review.response.as_mut().and_then(|r| r.patch.take());
    let mut v = serde_json::to_value(&review)?;
    if let Some(p) = patch {
        v["response"]["patch"] = serde_json::to_value(k8s_openapi::ByteString(p))?;
    }
    serde_json::to_vec(&v)
}

fn with_message(mut resp: AdmissionResponse, msg: String, warn: bool) -> AdmissionResponse {
    if warn {
        resp.warnings
            .get_or_insert_with(Vec::new)
            .push(truncate(msg.clone()));
    }
    resp.result.message = msg;
    resp
}
