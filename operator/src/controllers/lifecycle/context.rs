//! What every reconcile shares: the client, the stores, the Event recorder,
//! the metrics and the rollout limiter.

use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use remora_crds::SidecarLifecycle;

use super::Settings;
use super::budget::Budget;
use super::events::Decision;
use super::metrics::Metrics;
use super::pod_index::PodIndex;
use super::rollout_limiter::RolloutLimiter;
use crate::controllers::lifecycle::status::{PodInfo, Scope};
use remora_inject::resolve::LifecycleEntry;

pub(super) struct Ctx {
    pub(super) client: Client,
    pub(super) settings: Settings,
    pub(super) index: Arc<PodIndex>,
    pub(super) lifecycles: Store<SidecarLifecycle>,
    pub(super) recorder: Recorder,
    pub(super) metrics: Metrics,
    pub(super) limiter: Mutex<RolloutLimiter>,
    /// Every request the controller makes waits for it.
    pub(super) budget: Budget,
    /// Routine Events left to write ([`super::retune::routine_event_allowance`]).
    pub(super) routine_events: leaky_bucket::RateLimiter,
}

impl Ctx {
    /// What `entry`'s status and pods are computed from (without `except`,
    /// a resource being deleted): its own namespace's pods, or every
    /// namespace's for a cluster default, each with the resources that can
    /// reach it.
    pub(super) fn scope(&self, entry: &LifecycleEntry, except: Option<&SidecarLifecycle>) -> Scope {
        let operator_ns = self.settings.operator_namespace.as_str();
        let is_except = |r: &SidecarLifecycle| {
            except.is_some_and(|e| e.namespace() == r.namespace() && e.name_any() == r.name_any())
        };
        let cluster_wide = entry.namespace == operator_ns && entry.spec.selector.is_none();
        let entries = self
            .lifecycles
            .state()
            .iter()
            .filter(|r| !is_except(r))
            // Skipped unread: resources that can reach none of its pods.
            .filter(|r| {
                cluster_wide || {
                    let ns = r.metadata.namespace.as_deref().unwrap_or_default();
                    ns == entry.namespace || ns == operator_ns
                }
            })
            .map(|r| LifecycleEntry::from_resource(r))
            .collect();
        Scope::of(entry, entries, operator_ns, |ns| match ns {
            Some(ns) => vec![(ns.to_owned(), self.index.namespace(ns))],
            None => self.index.all(),
        })
    }

    /// Every resource: what a workload's template is resolved against.
    pub(super) fn all_lifecycles(&self) -> Vec<LifecycleEntry> {
        self.lifecycles
            .state()
            .iter()
            .map(|r| LifecycleEntry::from_resource(r))
            .collect()
    }

    pub(super) async fn event(
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
        let _permit = self.budget.acquire().await;
        // An Event is a record, not a step: failing to write one changes nothing.
        if let Err(e) = self.recorder.publish(&ev, reference).await {
            tracing::debug!(error = %e, reason = ev.reason, "cannot publish an event");
        }
    }
}

pub(super) fn pod_ref(p: &PodInfo) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(p.name().to_string()),
        namespace: Some(p.namespace().to_string()),
        uid: p.uid().map(str::to_string),
        ..ObjectReference::default()
    }
}
