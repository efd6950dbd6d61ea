//! One reconcile of a SidecarLifecycle: its status, the pods it retunes and
//! the workloads it rolls; and the sweep of a deleted one's pods.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};
use remora_crds::{RolloutPolicy, SidecarLifecycle};
use serde_json::json;
use tokio::time::Instant;

use super::RESYNC;
use super::context::Ctx;
use super::error::ControllerError;
use super::events::{Decision, decisions};
use super::retune::{POD_EVENTS, retune};
use super::rollout::roll;
use crate::controllers::lifecycle::status::{
    Restarts, compute, governed, keep_transition_times, reached, restart_condition, restart_report,
};
use crate::identity::FIELD_MANAGER;
use remora_inject::resolve::LifecycleEntry;

pub(super) fn error_policy(_: Arc<SidecarLifecycle>, err: &ControllerError, _: Arc<Ctx>) -> Action {
    tracing::warn!(error = %err, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

pub(super) async fn reconcile(
    slc: Arc<SidecarLifecycle>,
    ctx: Arc<Ctx>,
) -> Result<Action, ControllerError> {
    let started = Instant::now();
    let res = reconcile_inner(&slc, &ctx).await;
    let result = match &res {
        Ok(_) => "ok",
        Err(e) => e.kind(),
    };
    ctx.metrics.observe(result, started.elapsed());
    res
}

async fn reconcile_inner(slc: &SidecarLifecycle, ctx: &Ctx) -> Result<Action, ControllerError> {
    let s = &ctx.settings;
    let name = slc.name_any();
    let ns = slc.namespace().unwrap_or_default();
    let resource = format!("{ns}/{name}");
    let entry = LifecycleEntry::from_resource(slc);
    let scope = ctx.scope(&entry, None);
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let generation = slc.metadata.generation;
    let previous = slc.status.as_ref();

    let mut status = compute(
        &entry,
        generation,
        &scope,
        &s.operator_namespace,
        previous,
        now.clone(),
    );
    let governed = governed(&entry, &scope, &s.chart, &s.operator_namespace);
    drop(scope);
    let report = restart_report(&governed);
    // Without the chart's rights on workloads, never try: the status says
    // why nothing is rolled instead of the reconcile failing on a 403.
    let restarts = match slc.spec.rollout_policy {
        RolloutPolicy::Manual => Restarts::Manual,
        RolloutPolicy::Automatic if s.automatic_rollouts => Restarts::Automatic,
        RolloutPolicy::Automatic => Restarts::AutomaticDisabled,
    };
    let mut restart = [restart_condition(&report, restarts, generation, &now)];
    keep_transition_times(&mut restart, previous);
    status.conditions.extend(restart);

    let me = slc.object_ref(&());
    if previous != Some(&status) {
        let api: Api<SidecarLifecycle> = Api::namespaced(ctx.client.clone(), &ns);
        let patch = Patch::Apply(json!({
            "apiVersion": SidecarLifecycle::api_version(&()),
            "kind": SidecarLifecycle::kind(&()),
            "status": status,
        }));
        let permit = ctx.budget.acquire().await;
        api.patch_status(&name, &PatchParams::apply(FIELD_MANAGER).force(), &patch)
            .await
            .map_err(|source| ControllerError::Status {
                resource: resource.clone(),
                source,
            })?;
        drop(permit);
        ctx.metrics.status_writes.inc();
        for d in decisions(previous, &status) {
            tracing::info!(resource = %resource, reason = d.reason, note = %d.note, "decision");
            ctx.event(&me, d, None).await;
        }
    }

    let retuned = retune(ctx, &entry, &governed).await?;
    drop(governed);
    if retuned > 0 {
        tracing::info!(resource = %resource, pods = retuned, "running pods retuned");
        if ctx.routine_events.try_acquire(1) {
            ctx.event(
                &me,
                Decision {
                    warning: false,
                    reason: "PodsRetuned",
                    note: format!(
                        "updated remora.dev/lifecycle of {retuned} running pods (up to {POD_EVENTS} of them, within the controller's allowance, have their own Event)"
                    ),
                },
                None,
            )
            .await;
        }
    }

    let mut next = RESYNC;
    if restarts == Restarts::Automatic
        && !report.outdated.is_empty()
        && let Some(wait) = roll(ctx, &me, &entry, &ctx.all_lifecycles(), &report).await?
    {
        next = wait;
    }
    Ok(Action::requeue(next))
}

/// Retune the pods a deleted resource reached to what the remaining layers
/// say now (down to the chart defaults when nothing else reaches them).
pub(super) async fn sweep(ctx: &Ctx, gone: &SidecarLifecycle) {
    let entry = LifecycleEntry::from_resource(gone);
    let s = &ctx.settings;
    let pods = reached(
        &entry,
        &ctx.scope(&entry, Some(gone)),
        &s.chart,
        &s.operator_namespace,
    );
    match retune(ctx, &entry, &pods).await {
        Ok(n) => {
            tracing::info!(resource = %format!("{}/{}", entry.namespace, entry.name), pods = n,
            "deleted; its pods retuned to the remaining layers")
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot retune the pods of a deleted SidecarLifecycle")
        }
    }
}
