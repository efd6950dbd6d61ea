//! Automatic rollouts: the owning workload of outdated pods is rolled
//! through a pod-template annotation, at most one per interval.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::time::Instant;

use super::context::Ctx;
use super::error::ControllerError;
use super::events::Decision;
use super::{FIELD_MANAGER, ROLLOUT_ANNOTATION};
use crate::mutate::STATUS_ANNOTATION;
use crate::status::{PodInfo, RestartReport};

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
pub(super) async fn roll(
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
