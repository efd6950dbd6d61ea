//! Automatic rollouts: the owning workload of outdated pods is rolled
//! through a pod-template annotation, at most one per interval.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{
    ApiResource, DynamicObject, GroupVersionKind, ListParams, ObjectMeta, Patch, PatchParams,
};
use kube::{Api, Client};
use remora_contract::annotations::INJECT_LABEL;
use serde_json::json;
use tokio::time::Instant;

use super::ROLLOUT_ANNOTATION;
use super::context::{Ctx, pod_ref};
use super::error::ControllerError;
use super::events::Decision;
use crate::controllers::lifecycle::status::{PodInfo, PodOwner, RestartReport, governor};
use crate::identity::FIELD_MANAGER;
use remora_inject::patch::STATUS_ANNOTATION;
use remora_inject::resolve::LifecycleEntry;

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

/// The verdict on `owner` (of a pod in `ns`), looked up once per reconcile.
async fn resolve(
    ctx: &Ctx,
    owners: &mut BTreeMap<PodOwner, Owner>,
    ns: &str,
    owner: &PodOwner,
) -> Result<Owner, kube::Error> {
    if let Some(v) = owners.get(owner) {
        return Ok(v.clone());
    }
    let v = owning_workload(ctx, ns, owner).await?;
    owners.insert(owner.clone(), v.clone());
    Ok(v)
}

/// The template opts out of injection (`remora.dev/inject: "false"`).
fn tpl_opted_out(w: &Workload) -> bool {
    w.obj.data["spec"]["template"]["metadata"]["labels"][INJECT_LABEL].as_str() == Some("false")
}

/// Whether the workload's template is out of date: what it would get
/// injected now (`want`) differs from what its pods record. A pod's
/// `remora.dev/status` is its creator's to write, so a pod saying so is
/// believed only against the workload's other pods (owner chain checked
/// against the API server): one that runs with what the template gets now
/// (or cannot be judged) outvotes every pod created after it, by the
/// creation times the API server set. A pod forged to look outdated next
/// to the workload's current pods therefore rolls nothing, while pods left
/// outdated by a settings change still roll their workload when newer pods
/// (a scale-up, a replacement) were injected with the new settings. Where
/// the workload has no pod of its own, rolling it restarts nothing.
/// `Ok(Err(why))`: not out of date.
async fn template_outdated(
    ctx: &Ctx,
    owners: &mut BTreeMap<PodOwner, Owner>,
    ns: &str,
    w: &Workload,
    want: &str,
) -> Result<Result<(), String>, kube::Error> {
    let name = w.obj.metadata.name.as_deref().unwrap_or_default();
    let uid = w.obj.metadata.uid.as_deref().unwrap_or_default();
    // A Deployment's ReplicaSets are named after it ("<name>-<hash>").
    let rs_prefix = format!("{name}-");
    let mut its_pods = Vec::new();
    for pod in ctx.index.namespace(ns) {
        let Some(owner) = pod.owner() else {
            continue;
        };
        let claims = match w.kind.as_str() {
            "Deployment" => owner.kind == "ReplicaSet" && owner.name.starts_with(&rs_prefix),
            kind => owner.kind == kind && owner.name == name,
        };
        if !claims {
            continue;
        }
        let of_it = match w.kind.as_str() {
            "Deployment" => matches!(
                resolve(ctx, owners, ns, &owner).await?,
                Owner::Workload(o) if o.kind == "Deployment" && uid_matches(&o.obj.metadata.uid, uid)
            ),
            _ => !uid.is_empty() && owner.uid == uid,
        };
        if of_it {
            its_pods.push(pod);
        }
    }
    // Creation times (the watch keeps none) only when the pods disagree.
    let mut created: BTreeMap<String, (String, Timestamp)> = BTreeMap::new();
    let (old, rest): (Vec<_>, Vec<_>) = its_pods.iter().partition(|p| outdated(p, want));
    if !old.is_empty() && !rest.is_empty() {
        let selector = w.obj.data["spec"]["selector"]["matchLabels"]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| Some(format!("{k}={}", v.as_str()?)))
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_default();
        let permit = ctx.budget.acquire().await;
        let list = Api::<Pod>::namespaced(ctx.client.clone(), ns)
            .list_metadata(&ListParams::default().labels(&selector))
            .await?;
        drop(permit);
        for m in list.items {
            if let (Some(n), Some(u), Some(t)) = (
                m.metadata.name,
                m.metadata.uid,
                m.metadata.creation_timestamp,
            ) {
                created.insert(n, (u, t.0));
            }
        }
    }
    let dated: Vec<(Arc<PodInfo>, Option<Timestamp>)> = its_pods
        .into_iter()
        .map(|p| {
            let t = created
                .get(p.name())
                .filter(|(u, _)| p.uid() == Some(u.as_str()))
                .map(|(_, t)| *t);
            (p, t)
        })
        .collect();
    Ok(outdated_by_its_pods(
        &format!("{} {ns}/{name}", w.kind),
        &dated,
        want,
    ))
}

/// The pod records a restart hash, not `want`.
fn outdated(pod: &PodInfo, want: &str) -> bool {
    pod.restart_hash().is_some_and(|h| h != want)
}

/// The verdict of [`template_outdated`] on the workload's own pods, each
/// with its creation time when known.
fn outdated_by_its_pods(
    workload: &str,
    pods: &[(Arc<PodInfo>, Option<Timestamp>)],
    want: &str,
) -> Result<(), String> {
    // The oldest pod that does not say the template is outdated; one of
    // unknown age counts as the oldest.
    let Some((first, first_at)) = pods
        .iter()
        .filter(|(p, _)| !outdated(p, want))
        .min_by_key(|(_, t)| *t)
    else {
        return Ok(());
    };
    if let Some(first_at) = first_at
        && pods
            .iter()
            .any(|(p, t)| outdated(p, want) && t.is_some_and(|t| t < *first_at))
    {
        return Ok(());
    }
    let says = match first.restart_hash() {
        Some(_) => "runs with the settings its template gets now",
        None if first.sources().is_some() => "has no recorded restart hash",
        None => "was not injected",
    };
    Err(format!(
        "its pod template is not out of date: pod {}/{} of {workload} {says}, and no pod of it \
         that records other settings is older",
        first.namespace(),
        first.name(),
    ))
}

/// Roll the workloads of outdated pods, one per limiter slot. Returns when
/// to look again if the limiter held a rollout back.
///
/// A pod only points at a workload; what is rolled, and to what, is decided
/// from the API server's objects: the owner chain by UID, the governance and
/// the restart hash from the workload's own pod template, which must itself
/// be out of date ([`template_outdated`]). A pod that forged its
/// ownerReference or its `remora.dev/status` can at most make the
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
        let verdict = match resolve(ctx, &mut owners, pod.namespace(), &owner).await {
            Ok(v) => v,
            Err(source) => {
                failed = Some(ControllerError::Rollout {
                    workload: format!("the owner of pod {}/{}", pod.namespace(), pod.name()),
                    source,
                });
                continue;
            }
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
    let mut next = None;
    let mut held_back = BTreeSet::new();
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
            // Injected offline (`remora-operator inject`): the webhook leaves
            // its pods as they are, so a rollout would change nothing.
            tracing::info!(workload = %workload, "injected offline; re-run inject to apply the new settings");
            continue;
        }
        if tpl_opted_out(&w) {
            // Its new pods get no sidecar: a rollout would change nothing.
            continue;
        }
        if held_back.contains(&ns) {
            // This namespace's turn has not come: its next pass looks again.
            continue;
        }
        match template_outdated(ctx, &mut owners, &ns, &w, &want).await {
            Ok(Ok(())) => {}
            Ok(Err(why)) => {
                refuse(ctx, me_ref, asked_by, &why).await;
                continue;
            }
            Err(source) => {
                failed = Some(ControllerError::Rollout { workload, source });
                continue;
            }
        }
        let slot = ctx
            .limiter
            .lock()
            .map(|mut l| l.try_acquire(&ns, Instant::now()))
            .unwrap_or(Ok(()));
        if let Err(wait) = slot {
            // The other namespaces' workloads still ask, each for its turn.
            tracing::info!(workload = %workload, wait = ?wait, "rollout held back by the rate limit");
            next = Some(next.map_or(wait, |n: Duration| n.min(wait)));
            held_back.insert(ns);
            continue;
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
        None => Ok(next),
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
    use std::sync::Arc;

    fn pod(name: &str, status: Option<&str>) -> Arc<PodInfo> {
        Arc::new(PodInfo::from_meta(ObjectMeta {
            namespace: Some("shop".into()),
            name: Some(name.into()),
            annotations: status.map(|s| [(STATUS_ANNOTATION.to_string(), s.to_string())].into()),
            ..ObjectMeta::default()
        }))
    }

    fn injected(name: &str, hash: Option<&str>) -> Arc<PodInfo> {
        let status = serde_json::json!({"sources": ["chart"], "restartHash": hash}).to_string();
        pod(name, Some(&status))
    }

    fn at(secs: i64) -> Option<Timestamp> {
        Timestamp::from_second(secs).ok()
    }

    #[test]
    fn one_pod_claiming_outdated_settings_does_not_outvote_its_workloads_pods() {
        let w = "Deployment shop/web";
        let want = "sha256:new";
        let forged = injected("forged", Some("sha256:old"));
        // Every pod of the workload outdated: its template is.
        let old = [
            (injected("web-a", Some("sha256:old")), at(0)),
            (Arc::clone(&forged), at(100)),
        ];
        assert_eq!(outdated_by_its_pods(w, &old, want), Ok(()));
        // A pod of it injected from the template with what it gets now,
        // older than the one claiming otherwise (or as old, or of unknown
        // age): not.
        for (other, other_at, says) in [
            (
                injected("web-b", Some(want)),
                at(50),
                "runs with the settings",
            ),
            (
                injected("web-b", Some(want)),
                at(100),
                "runs with the settings",
            ),
            (
                injected("web-b", Some(want)),
                None,
                "runs with the settings",
            ),
            (injected("web-b", None), at(50), "no recorded restart hash"),
            (pod("web-b", None), at(50), "was not injected"),
        ] {
            let why = outdated_by_its_pods(
                w,
                &[(Arc::clone(&forged), at(100)), (other, other_at)],
                want,
            )
            .expect_err("a pod of the workload says otherwise");
            assert!(
                why.contains("not out of date") && why.contains("shop/web-b") && why.contains(says),
                "{why}"
            );
        }
        // Pods left outdated by a settings change, and newer ones (a
        // scale-up) injected with the new settings: the template is.
        let scaled = [
            (injected("web-a", Some("sha256:old")), at(0)),
            (injected("web-c", Some(want)), at(200)),
        ];
        assert_eq!(outdated_by_its_pods(w, &scaled, want), Ok(()));
    }
}
