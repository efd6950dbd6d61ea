//! What every reconcile shares: the client, the stores, the Event recorder,
//! the metrics and the rollout limiter.

use std::sync::Mutex;

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use remora_crds::SidecarLifecycle;

use super::Settings;
use super::events::Decision;
use super::metrics::Metrics;
use super::rollout::RolloutLimiter;
use crate::sidecar_config::LifecycleEntry;
use crate::status::PodInfo;

pub(super) struct Ctx {
    pub(super) client: Client,
    pub(super) settings: Settings,
    pub(super) pods: Store<Pod>,
    pub(super) lifecycles: Store<SidecarLifecycle>,
    pub(super) recorder: Recorder,
    pub(super) metrics: Metrics,
    pub(super) limiter: Mutex<RolloutLimiter>,
}

impl Ctx {
    /// Every resource (but `except`, one being deleted) and every live pod,
    /// as the stores have them now.
    pub(super) fn snapshot(
        &self,
        except: Option<&SidecarLifecycle>,
    ) -> (Vec<LifecycleEntry>, Vec<PodInfo>) {
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
            .map(|p| PodInfo::from_meta(&p.metadata))
            .collect();
        (all, pods)
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
        name: Some(p.name.clone()),
        namespace: Some(p.namespace.clone()),
        uid: p.uid.clone(),
        ..ObjectReference::default()
    }
}
