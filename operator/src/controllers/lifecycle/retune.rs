//! Live retuning: the `remora.dev/lifecycle` annotation of running pods,
//! which the agent reads through the downward API at its next drain.

use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{Patch, PatchParams};
use leaky_bucket::RateLimiter;
use remora_contract::annotations::LIFECYCLE as LIFECYCLE_ANNOTATION;
use serde_json::json;

use super::context::{Ctx, pod_ref};
use super::error::ControllerError;
use super::events::Decision;
use crate::controllers::lifecycle::status::{Governed, PodInfo, refreshed_lifecycle};
use remora_inject::resolve::LifecycleEntry;

/// Patches one reconcile keeps in flight: as many as the budget lets out,
/// so that a reconcile alone (a cluster default's, reaching thousands of
/// pods) can use all of it; the budget shares it out when several run.
const CONCURRENT_PATCHES: usize = super::budget::MAX_IN_FLIGHT;

/// Pods of one reconcile that get their own `LifecycleRetuned` Event. A
/// change reaching thousands of pods would otherwise write as many Events
/// as patches; the resource's `PodsRetuned` Event counts them all.
pub(super) const POD_EVENTS: usize = 10;

/// Routine Events controller-wide (a resource's `PodsRetuned`, a pod's
/// `LifecycleRetuned`): a burst, then a few a second. An edit of a cluster
/// default retunes its pods through the reconciles of a thousand siblings,
/// each with a handful of pods: an Event for each would be half the writes
/// of the edit, and kube's `Recorder` keeps every Event it wrote for six
/// minutes (to count repeats), in the leader's memory. Status
/// decisions (Accepted, Conflicted, RestartRequired...) are not routine:
/// they are always written.
const ROUTINE_EVENT_BURST: usize = 50;
const ROUTINE_EVENTS_PER_S: usize = 5;

/// The controller-wide allowance of routine Events (taken without waiting:
/// an Event over it is not written; the log line and the metrics still
/// count what it would have said).
pub(super) fn routine_event_allowance() -> RateLimiter {
    RateLimiter::builder()
        .max(ROUTINE_EVENT_BURST)
        .initial(ROUTINE_EVENT_BURST)
        .refill(ROUTINE_EVENTS_PER_S)
        .interval(Duration::from_secs(1))
        .build()
}

/// Bring the lifecycle annotation of each of `pods` (with the settings it
/// should run with) up to date. Returns how many were patched.
pub(super) async fn retune(
    ctx: &Ctx,
    entry: &LifecycleEntry,
    pods: &[Governed],
) -> Result<usize, ControllerError> {
    // Owned, so the patches' futures borrow nothing from the loop. A value
    // this controller is writing, or wrote and the watch has not shown yet,
    // is not written again (by this reconcile or a concurrent one).
    let unconfirmed = &ctx.index.unconfirmed;
    let stale: Vec<(String, Arc<PodInfo>, String)> = pods
        .iter()
        .filter_map(|g| {
            let current = g.pod.lifecycle()?;
            let fresh = refreshed_lifecycle(current, &g.cfg)?;
            let key = format!("{}/{}", g.pod.namespace(), g.pod.name());
            if unconfirmed.pending(&key, &fresh) {
                return None;
            }
            unconfirmed.expect(&key, &fresh);
            Some((key, Arc::clone(&g.pod), fresh))
        })
        .collect();
    let keys: Vec<String> = stale.iter().map(|(k, _, _)| k.clone()).collect();
    let patched: Result<Vec<bool>, _> = stream::iter(stale.into_iter().enumerate())
        .map(|(i, (key, g, fresh))| patch(ctx, entry, key, g, fresh, i < POD_EVENTS))
        .buffer_unordered(CONCURRENT_PATCHES)
        .try_collect()
        .await;
    match patched {
        Ok(p) => Ok(p.into_iter().filter(|p| *p).count()),
        Err(e) => {
            // The failed patch and those not sent are written by the retry,
            // not skipped as pending (a sent one may be written twice).
            for k in &keys {
                unconfirmed.forget(k);
            }
            Err(e)
        }
    }
}

/// Returns whether the pod was patched (it may be gone).
async fn patch(
    ctx: &Ctx,
    entry: &LifecycleEntry,
    who: String,
    pod: Arc<PodInfo>,
    fresh: String,
    with_event: bool,
) -> Result<bool, ControllerError> {
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), pod.namespace());
    let patch = Patch::Merge(json!({"metadata": {"annotations": {LIFECYCLE_ANNOTATION: &fresh}}}));
    let permit = ctx.budget.acquire().await;
    match api
        .patch_metadata(pod.name(), &PatchParams::default(), &patch)
        .await
    {
        Ok(_) => {}
        // Gone since the store saw it: nothing to retune (nor to expect,
        // if the watch has shown the deletion already).
        Err(kube::Error::Api(e)) if e.code == 404 => {
            ctx.index.unconfirmed.forget(&who);
            return Ok(false);
        }
        Err(source) => return Err(ControllerError::Retune { pod: who, source }),
    }
    drop(permit);
    ctx.metrics.retuned.inc();
    tracing::debug!(pod = %who, lifecycle = %fresh, "lifecycle annotation updated");
    if with_event && ctx.routine_events.try_acquire(1) {
        ctx.event(
            &pod_ref(&pod),
            Decision {
                warning: false,
                reason: "LifecycleRetuned",
                note: format!(
                    "SidecarLifecycle {}/{} changed; the sidecar reads the new settings at its next drain: {fresh}",
                    entry.namespace, entry.name
                ),
            },
            None,
        )
        .await;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn routine_events_are_a_burst_then_a_few_a_second() {
        let allowance = routine_event_allowance();
        let taken = |n: usize| (0..n).filter(|_| allowance.try_acquire(1)).count();
        assert_eq!(taken(ROUTINE_EVENT_BURST + 10), ROUTINE_EVENT_BURST);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(taken(100), ROUTINE_EVENTS_PER_S);
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(
            taken(1_000),
            ROUTINE_EVENT_BURST,
            "never more than the burst"
        );
    }
}
