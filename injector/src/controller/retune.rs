//! Live retuning: the `remora.dev/lifecycle` annotation of running pods,
//! which the agent reads through the downward API at its next drain.

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{Patch, PatchParams};
use remora_contract::annotations::LIFECYCLE as LIFECYCLE_ANNOTATION;
use serde_json::json;

use super::context::{Ctx, pod_ref};
use super::error::ControllerError;
use super::events::Decision;
use crate::sidecar_config::LifecycleEntry;
use crate::status::{PodInfo, reaches, refreshed_lifecycle};

/// Bring the lifecycle annotation of every injected pod `entry` reaches up
/// to date. Returns how many pods were patched.
pub(super) async fn retune(
    ctx: &Ctx,
    entry: &LifecycleEntry,
    all: &[LifecycleEntry],
    pods: &[PodInfo],
) -> Result<usize, ControllerError> {
    let s = &ctx.settings;
    let mut patched = 0;
    for pod in pods
        .iter()
        .filter(|p| p.sources.is_some() && reaches(entry, p, &s.operator_namespace))
    {
        let Some(current) = pod.annotations.get(LIFECYCLE_ANNOTATION) else {
            continue;
        };
        let cfg = pod.effective(&s.chart, all, &s.operator_namespace);
        let Some(fresh) = refreshed_lifecycle(current, &cfg) else {
            continue;
        };
        let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &pod.namespace);
        let patch =
            Patch::Merge(json!({"metadata": {"annotations": {LIFECYCLE_ANNOTATION: fresh}}}));
        let who = format!("{}/{}", pod.namespace, pod.name);
        match api
            .patch_metadata(&pod.name, &PatchParams::default(), &patch)
            .await
        {
            Ok(_) => {}
            // Gone since the store saw it: nothing to retune.
            Err(kube::Error::Api(e)) if e.code == 404 => continue,
            Err(source) => return Err(ControllerError::Retune { pod: who, source }),
        }
        patched += 1;
        ctx.metrics.retuned.inc();
        tracing::info!(pod = %who, lifecycle = %fresh, "lifecycle annotation updated");
        ctx.event(
            &pod_ref(pod),
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
    Ok(patched)
}
