//! The AdmissionReview, pure: a body read ([`parse`]), the pod decided
//! ([`PodCreate::admit`]) and the answer written ([`encode`]). Whatever comes
//! in, the answer is a valid review. It allows the pod (when injection cannot
//! help it says why in a warning), except when injecting as asked would be
//! unsafe (traffic plumbing onto the sidecar's own ports) or whether to
//! inject is unknown (a namespace the caller could not read): then it
//! refuses the pod with the reason.
//!
//! What needs the cluster (the pod's namespace, its lifecycles) is the
//! caller's to fetch between [`ParsedReview::pod_create`] and
//! [`PodCreate::admit`]; [`StaticView::review`] runs the whole path over a
//! cluster held in memory.

mod pruned;

use std::collections::BTreeMap;
use std::fmt::Display;

use kube_core::admission::{AdmissionResponse, AdmissionReview, Operation};
use kube_core::{DynamicObject, GroupVersionKind};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use remora_contract::annotations::INJECT_LABEL;

use crate::patch::{MutateError, Outcome, Selection, Target, mutate, pod_meta};
use crate::resolve::{ChartDefaults, LifecycleEntry, resolve};

/// A review to send back, and how it ended.
pub type Answer = (AdmissionReview<DynamicObject>, AdmissionOutcome);

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
    /// Refused with a 503 by the server: the reviews in progress hold the
    /// memory budget.
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

/// The parts of an AdmissionReview the decision reads. The pod stays one
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
    #[serde(default, deserialize_with = "pruned::pruned_pod")]
    object: Option<Value>,
}

/// A review read by [`parse`]; the body it came from may be freed.
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

/// The parts of the review the answer needs, read from `body`, or the
/// answer to a review that cannot be read.
pub fn parse(body: &[u8]) -> Result<ParsedReview, Box<Answer>> {
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

/// A review asking to create a pod: what is left to decide needs the
/// cluster ([`Cluster`]).
pub struct PodCreate {
    /// The answer so far: allowed, the uid set.
    resp: AdmissionResponse,
    pod: Value,
    namespace: String,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
}

impl ParsedReview {
    /// The pod this review asks to create, or the answer when it asks
    /// nothing injection acts on (not a pod, not a create, no object).
    pub fn pod_create(self) -> Result<PodCreate, Box<Answer>> {
        let req = self.0;
        let mut resp = AdmissionResponse::invalid("");
        resp.allowed = true;
        resp.uid = req.uid;
        resp.result = Default::default();
        if !req.kind.group.is_empty() || req.kind.kind != "Pod" {
            let msg = format!(
                "remora: not injected: {}/{} is not a Pod",
                req.kind.group, req.kind.kind
            );
            return Err(answered(
                with_message(resp, msg, false),
                AdmissionOutcome::Ignored,
            ));
        }
        if req.operation != Operation::Create || req.sub_resource.is_some() {
            return Err(answered(resp, AdmissionOutcome::Ignored));
        }
        let Some(pod) = req.object else {
            return Err(answered(
                with_message(
                    resp,
                    "remora: not injected: no object in the request".into(),
                    true,
                ),
                AdmissionOutcome::Invalid,
            ));
        };
        let namespace = req
            .namespace
            .or_else(|| pod["metadata"]["namespace"].as_str().map(str::to_string))
            .unwrap_or_else(|| "default".into());
        let (labels, annotations) = pod_meta(&pod);
        Ok(PodCreate {
            resp,
            pod,
            namespace,
            labels,
            annotations,
        })
    }
}

/// What deciding one pod reads of its cluster.
pub struct Cluster<'a> {
    pub chart: &'a ChartDefaults,
    pub operator_namespace: &'a str,
    /// The `SidecarLifecycle`s of the pod's namespace and the operator's
    /// (the cluster default): the only ones that can reach it.
    pub lifecycles: &'a [LifecycleEntry],
    /// The labels of the pod's namespace; empty when unknown and
    /// [`PodCreate::selects_itself`].
    pub namespace_labels: &'a BTreeMap<String, String>,
    /// Whether every node runs native sidecars (kubelet >= 1.29).
    pub native_sidecars: bool,
}

impl PodCreate {
    /// The namespace the pod is created in.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Whether the pod's own label decides alone whether it is injected, so
    /// that its namespace's labels need not be known.
    pub fn selects_itself(&self) -> bool {
        matches!(
            self.labels.get(INJECT_LABEL).map(String::as_str),
            Some("true" | "false")
        )
    }

    /// Refuse the pod: whether it should get a sidecar is unknown
    /// (`reason`), so, as failurePolicy Fail would, it is never admitted
    /// without one unasked.
    pub fn refuse(self, reason: &dyn Display) -> Answer {
        (
            self.resp
                .deny(format!("remora: refused: {reason}; try again"))
                .into_review(),
            AdmissionOutcome::Refused,
        )
    }

    /// Decide the pod: the patch that injects it, or why not.
    pub fn admit(self, cluster: &Cluster<'_>) -> Answer {
        let (resp, outcome) = self.decide(cluster);
        (resp.into_review(), outcome)
    }

    fn decide(self, cluster: &Cluster<'_>) -> (AdmissionResponse, AdmissionOutcome) {
        let Self {
            mut resp,
            pod,
            namespace,
            labels,
            annotations,
        } = self;
        let cfg = resolve(
            cluster.chart,
            cluster.lifecycles,
            cluster.operator_namespace,
            &namespace,
            &labels,
            &annotations,
        );
        let target = Target {
            namespace: &namespace,
            namespace_labels: cluster.namespace_labels,
            native_sidecars: cluster.native_sidecars,
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

/// A cluster held in full in memory (tests, benchmarks, fuzzing): nothing
/// to look up.
#[derive(Debug, Clone, Default)]
pub struct StaticView {
    pub lifecycles: Vec<LifecycleEntry>,
    pub namespaces: BTreeMap<String, BTreeMap<String, String>>,
    pub native_sidecars: bool,
}

impl StaticView {
    /// The `SidecarLifecycle`s of these namespaces.
    pub fn lifecycles_in(&self, namespaces: &[&str]) -> Vec<LifecycleEntry> {
        self.lifecycles
            .iter()
            .filter(|e| namespaces.contains(&e.namespace.as_str()))
            .cloned()
            .collect()
    }

    /// Answer one AdmissionReview body over this cluster: [`parse`], then
    /// [`PodCreate::admit`]. A namespace it does not hold has no labels.
    pub fn review(&self, body: &[u8], chart: &ChartDefaults, operator_namespace: &str) -> Answer {
        let pod = match parse(body).and_then(ParsedReview::pod_create) {
            Ok(pod) => pod,
            Err(answer) => return *answer,
        };
        let namespace_labels = self
            .namespaces
            .get(pod.namespace())
            .cloned()
            .unwrap_or_default();
        let lifecycles = self.lifecycles_in(&[pod.namespace(), operator_namespace]);
        pod.admit(&Cluster {
            chart,
            operator_namespace,
            lifecycles: &lifecycles,
            namespace_labels: &namespace_labels,
            native_sidecars: self.native_sidecars,
        })
    }
}

fn answered(resp: AdmissionResponse, outcome: AdmissionOutcome) -> Box<Answer> {
    Box::new((resp.into_review(), outcome))
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

/// Serialize a review for the wire. The patch goes out as base64, the way
/// Go encodes `[]byte` (kube would write an array of numbers, which the API
/// server also reads, at about three times the size).
pub fn encode(mut review: AdmissionReview<DynamicObject>) -> serde_json::Result<Vec<u8>> {
    let patch = review.response.as_mut().and_then(|r| r.patch.take());
    let mut v = serde_json::to_value(&review)?;
    if let Some(p) = patch {
        v["response"]["patch"] = serde_json::to_value(k8s_openapi::ByteString(p))?;
    }
    serde_json::to_vec(&v)
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

fn with_message(mut resp: AdmissionResponse, msg: String, warn: bool) -> AdmissionResponse {
    if warn {
        resp.warnings
            .get_or_insert_with(Vec::new)
            .push(truncate(msg.clone()));
    }
    resp.result.message = msg;
    resp
}
