//! Automatic rollouts: the owning workload of outdated pods is rolled
//! through a pod-template annotation, at most one per interval.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ObjectMeta, Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::time::Instant;

use super::context::{Ctx, pod_ref};
use super::error::ControllerError;
use super::events::Decision;
use super::{FIELD_MANAGER, ROLLOUT_ANNOTATION};
use crate::mutate::STATUS_ANNOTATION;
use crate::sidecar_config::LifecycleEntry;
use crate::status::{PodInfo, PodOwner, RestartReport, governor};

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

fn workload_api(client: &Client, ns: &str, kind: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("apps", "v1", kind);
    Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk))
}

/// A workload the controller may roll, as the API server has it.
#[derive(Debug, Clone)]
struct Workload {
    kind: String,
    obj: DynamicObject,
}

/// What the owner chain of a pod leads to.
#[derive(Debug, Clone)]
enum Owner {
    Workload(Box<Workload>),
    /// Nothing to roll: a bare pod, a Job, a ReplicaSet without Deployment,
    /// or an owner that is gone (its pods are on their way out).
    None,
    /// The pod's ownerReference does not match the API server: whoever
    /// created the pod wrote it. Never acted on.
    Forged(String),
}

/// Same object, not only same name: a pod's ownerReference is written by
/// whoever creates the pod, the UID is what the API server assigned.
fn uid_matches(obj: &Option<String>, claimed: &str) -> bool {
    obj.as_deref()
        .is_some_and(|u| !u.is_empty() && u == claimed)
}

/// Follow `pod`'s ownerReference to the workload that can be rolled,
/// checking each link's UID against the API server.
async fn owning_workload(ctx: &Ctx, ns: &str, owner: &PodOwner) -> Result<Owner, kube::Error> {
    let (kind, name, uid) = match owner.kind.as_str() {
        "StatefulSet" | "DaemonSet" => (owner.kind.clone(), owner.name.clone(), owner.uid.clone()),
        "ReplicaSet" => {
            let rs: Api<ReplicaSet> = Api::namespaced(ctx.client.clone(), ns);
            let permit = ctx.budget.acquire().await;
            let meta = rs.get_metadata_opt(&owner.name).await?;
            drop(permit);
            let Some(meta) = meta else {
                return Ok(Owner::None);
            };
            if !uid_matches(&meta.metadata.uid, &owner.uid) {
                return Ok(Owner::Forged(format!(
                    "its ownerReference names ReplicaSet {ns}/{} with UID {:?}, which is not that ReplicaSet's",
                    owner.name, owner.uid
                )));
            }
            match meta
                .metadata
                .owner_references
                .iter()
                .flatten()
                .find(|o| o.controller == Some(true) && o.kind == "Deployment")
            {
                Some(d) => ("Deployment".to_string(), d.name.clone(), d.uid.clone()),
                None => return Ok(Owner::None),
            }
        }
        // Bare pods and Jobs cannot be rolled: they keep RestartRequired.
        _ => return Ok(Owner::None),
    };
    let permit = ctx.budget.acquire().await;
    let obj = workload_api(&ctx.client, ns, &kind).get_opt(&name).await?;
    drop(permit);
    let Some(obj) = obj else {
        return Ok(Owner::None);
    };
    if !uid_matches(&obj.metadata.uid, &uid) {
        return Ok(Owner::Forged(format!(
            "its owner chain names {kind} {ns}/{name} with UID {uid:?}, which is not that {kind}'s"
        )));
    }
    Ok(Owner::Workload(Box::new(Workload { kind, obj })))
}

/// The workload's pod template as the webhook will see its new pods.
fn template_pod(ns: &str, obj: &DynamicObject) -> PodInfo {
    let meta = &obj.data["spec"]["template"]["metadata"];
    let map = |v: &serde_json::Value| -> BTreeMap<String, String> {
        serde_json::from_value(v.clone()).unwrap_or_default()
    };
    PodInfo::from_meta(ObjectMeta {
        namespace: Some(ns.to_string()),
        name: obj.metadata.name.clone(),
        labels: Some(map(&meta["labels"])),
        annotations: Some(map(&meta["annotations"])),
        ..ObjectMeta::default()
    })
}

/// Decide, from the workload itself, whether `me` may roll it and to what:
/// its template must be governed by `me` (a pod's labels and its
/// `remora.dev/status` are the pod creator's to write, the template is the
/// workload owner's), and the restart hash is the one its new pods will get.
fn rollout_target(
    ctx: &Ctx,
    me: &LifecycleEntry,
    all: &[LifecycleEntry],
    ns: &str,
    w: &Workload,
) -> Result<String, String> {
    let s = &ctx.settings;
    let tpl = template_pod(ns, &w.obj);
    match governor(all, &tpl, &s.operator_namespace) {
        Some(g) if g.namespace == me.namespace && g.name == me.name => {}
        Some(g) => {
            return Err(format!(
                "the pod template of {} {ns}/{} is governed by SidecarLifecycle {}/{}, not by this one",
                w.kind,
                tpl.name(),
                g.namespace,
                g.name
            ));
        }
        None => {
            return Err(format!(
                "no SidecarLifecycle governs the pod template of {} {ns}/{}",
                w.kind,
                tpl.name()
            ));
        }
    }
    Ok(tpl
        .effective(&s.chart, all, &s.operator_namespace)
        .restart_hash())
}

/// Roll the workloads of outdated pods, one per limiter slot. Returns when
/// to look again if the limiter held a rollout back.
///
/// A pod only points at a workload; what is rolled, and to what, is decided
/// from the API server's objects: the owner chain by UID, the governance and
/// the restart hash from the workload's own pod template. A pod that forged
/// its ownerReference or its `remora.dev/status` can at most make the
/// controller look at a workload this resource already governs.
pub(super) async fn roll(
    ctx: &Ctx,
    me_ref: &ObjectReference,
    me: &LifecycleEntry,
    all: &[LifecycleEntry],
    report: &RestartReport,
) -> Result<Option<Duration>, ControllerError> {
    // One lookup per owner. A failed lookup or write skips that workload
    // only; the reconcile then fails so that it is retried.
    let mut owners: BTreeMap<PodOwner, Owner> = BTreeMap::new();
    let mut targets: BTreeMap<(String, String, String), (Workload, &PodInfo)> = BTreeMap::new();
    let mut failed = None;
    for (pod, _) in &report.outdated {
        let Some(owner) = pod.owner() else {
            continue;
        };
        let verdict = match owners.get(&owner) {
            Some(v) => v.clone(),
            None => match owning_workload(ctx, pod.namespace(), &owner).await {
                Ok(v) => {
                    owners.insert(owner.clone(), v.clone());
                    v
                }
                Err(source) => {
                    failed = Some(ControllerError::Rollout {
                        workload: format!("the owner of pod {}/{}", pod.namespace(), pod.name()),
                        source,
                    });
                    continue;
                }
            },
        };
        match verdict {
            Owner::Workload(w) => {
                let name = w.obj.metadata.name.clone().unwrap_or_default();
                targets
                    .entry((pod.namespace().to_string(), w.kind.clone(), name))
                    .or_insert((*w, pod));
            }
            Owner::None => {}
            Owner::Forged(why) => refuse(ctx, me_ref, pod, &why).await,
        }
    }
    for ((ns, kind, name), (w, asked_by)) in targets {
        let workload = format!("{kind} {ns}/{name}");
        let want = match rollout_target(ctx, me, all, &ns, &w) {
            Ok(want) => want,
            Err(why) => {
                // Once per workload, naming the first pod that pointed at it.
                refuse(ctx, me_ref, asked_by, &why).await;
                continue;
            }
        };
        let template = &w.obj.data["spec"]["template"]["metadata"]["annotations"];
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
        // The UID precondition: if the workload was replaced by another of
        // the same name since it was checked, the write fails.
        let patch = Patch::Apply(json!({
            "apiVersion": "apps/v1",
            "kind": kind,
            "metadata": {"name": name, "namespace": ns, "uid": w.obj.metadata.uid},
            "spec": {"template": {"metadata": {"annotations": {ROLLOUT_ANNOTATION: want}}}},
        }));
        let api = workload_api(&ctx.client, &ns, &kind);
        let permit = ctx.budget.acquire().await;
        let written = api
            .patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &patch)
            .await;
        drop(permit);
        if let Err(source) = written {
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
            uid: w.obj.metadata.uid.clone(),
            ..ObjectReference::default()
        };
        ctx.event(
            me_ref,
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

/// A rollout the controller will not make: counted, logged and recorded as
/// a Warning Event on the resource, naming the pod that asked for it.
async fn refuse(ctx: &Ctx, me_ref: &ObjectReference, pod: &PodInfo, why: &str) {
    ctx.metrics.rollouts_refused.inc();
    let note = format!(
        "not rolling the workload of pod {}/{}: {why}",
        pod.namespace(),
        pod.name()
    );
    tracing::warn!(pod = %format!("{}/{}", pod.namespace(), pod.name()), reason = why, "rollout refused");
    ctx.event(
        me_ref,
        Decision {
            warning: true,
            reason: "RolloutRefused",
            note,
        },
        Some(pod_ref(pod)),
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

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
