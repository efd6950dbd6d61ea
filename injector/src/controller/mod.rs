//! The `SidecarLifecycle` controller. It runs on the elected leader only
//! (the webhook serves on every replica) and, for each resource:
//!
//! - writes `status` (Accepted, Conflicted, Applied, RestartRequired,
//!   `matchedPods`, `observedGeneration`) by server-side apply with the field
//!   manager [`FIELD_MANAGER`], and only when it changed;
//! - retunes running pods: when a setting the agent reads at runtime (drain
//!   settings) changes, it patches the pods' `remora.dev/lifecycle`
//!   annotation, which the agent reads through the downward API;
//! - when a setting only a restart applies changes, reports
//!   `RestartRequired`; with `rolloutPolicy: Automatic` it rolls the owning
//!   Deployment/StatefulSet/DaemonSet through a pod-template annotation,
//!   at most one rollout per `rollout_interval`;
//! - records each decision as a Kubernetes Event on the resource and on the
//!   pods it touched, and counts reconciles, errors and durations.
//!
//! Reconciles are idempotent: they compare what is with what should be and
//! write only the difference, so a replayed or concurrent reconcile changes
//! nothing.

mod context;
mod error;
mod events;
mod metrics;
mod reconcile;
mod retune;
mod rollout;
mod triggers;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::core::PartialObjectMeta;
use kube::runtime::controller::Controller;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use remora_crds::SidecarLifecycle;
use tokio_util::sync::CancellationToken;

pub use error::ControllerError;
pub use events::{Decision, decisions};
pub use metrics::Metrics;
pub use rollout::RolloutLimiter;

use crate::sidecar_config::{ChartDefaults, LifecycleEntry};
use crate::status::{PodInfo, reaches};
use context::Ctx;
use reconcile::{error_policy, reconcile, sweep};
use triggers::{LIVE_PODS, changes, pod_key};

/// The field manager of every server-side apply the controller makes.
pub const FIELD_MANAGER: &str = "remora-injector";
/// Pod-template annotation that rolls a workload; its value is the restart
/// hash the new pods get, so the same rollout is never asked for twice.
pub const ROLLOUT_ANNOTATION: &str = "remora.dev/restarted-for";
/// How often every resource is reconciled even without a change.
const RESYNC: Duration = Duration::from_secs(300);

/// What the controller is told at start.
#[derive(Debug, Clone)]
pub struct Settings {
    pub chart: ChartDefaults,
    pub operator_namespace: String,
    /// Minimum time between two automatic rollouts, cluster-wide.
    pub rollout_interval: Duration,
    /// Who publishes the Events (the pod name).
    pub identity: String,
}

/// Run until `shutdown`: the controller's own watches of SidecarLifecycles
/// and pod metadata, and the reconciles they trigger.
pub async fn run(
    client: Client,
    settings: Settings,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let lifecycles_api = Api::<SidecarLifecycle>::all(client.clone());
    let (pods, writer) = reflector::store();
    // Finished pods neither count nor get retuned; one that finishes leaves
    // the watch as a deletion.
    let pod_stream = changes(
        watcher(
            Api::<PartialObjectMeta<Pod>>::all(client.clone()),
            watcher::Config::default().fields(LIVE_PODS),
        )
        .default_backoff()
        .reflect(writer),
        pod_key,
    );
    let controller = Controller::new(lifecycles_api.clone(), watcher::Config::default());
    let lifecycles = controller.store();
    let operator_ns = settings.operator_namespace.clone();

    // A pod change concerns every resource that reaches it.
    let store = lifecycles.clone();
    let ns = operator_ns.clone();
    let by_pod = move |p: PartialObjectMeta<Pod>| {
        let pod = PodInfo::from_meta(&p);
        store
            .state()
            .iter()
            .filter(|r| reaches(&LifecycleEntry::from_resource(r), &pod, &ns))
            .map(|r| ObjectRef::from_obj(r.as_ref()))
            .collect::<Vec<_>>()
    };
    // A resource's change (or deletion) moves the conflicts, governors and
    // settings of its siblings: its namespace, and everything when it is a
    // cluster default.
    let store = lifecycles.clone();
    let ns = operator_ns.clone();
    let by_sibling = move |changed: SidecarLifecycle| {
        let changed_ns = changed.namespace().unwrap_or_default();
        let cluster_wide = changed_ns == ns && changed.spec.selector.is_none();
        store
            .state()
            .iter()
            .filter(|r| {
                cluster_wide
                    || r.namespace().as_deref() == Some(changed_ns.as_str())
                    || (r.namespace().as_deref() == Some(ns.as_str()) && r.spec.selector.is_none())
            })
            .map(|r| ObjectRef::from_obj(r.as_ref()))
            .collect::<Vec<_>>()
    };
    // Only spec changes (generation), creations and deletions move the
    // siblings; a status write does not.
    // A deleted resource is never reconciled: its pods are swept back to
    // what the remaining layers say (below), even when no sibling is left.
    let (deleted_tx, mut deleted) = tokio::sync::mpsc::unbounded_channel::<SidecarLifecycle>();
    let siblings = changes(
        watcher(lifecycles_api, watcher::Config::default())
            .default_backoff()
            .inspect(move |ev| {
                if let Ok(watcher::Event::Delete(r)) = ev {
                    let _ = deleted_tx.send(r.clone());
                }
            }),
        |r: &SidecarLifecycle| {
            let key = format!("{}/{}", r.namespace().unwrap_or_default(), r.name_any());
            (key, r.metadata.generation.unwrap_or_default() as u64)
        },
    );

    let ctx = Arc::new(Ctx {
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: FIELD_MANAGER.into(),
                instance: Some(settings.identity.clone()),
            },
        ),
        limiter: Mutex::new(RolloutLimiter::new(settings.rollout_interval)),
        client,
        settings,
        pods,
        lifecycles,
        metrics,
    });
    tracing::info!("SidecarLifecycle controller started");
    let sweeper = {
        let ctx = Arc::clone(&ctx);
        async move {
            while let Some(gone) = deleted.recv().await {
                sweep(&ctx, &gone).await;
            }
        }
    };
    let controller = controller
        .watches_stream(pod_stream, by_pod)
        .watches_stream(siblings, by_sibling)
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "reconcile not run");
            }
        });
    // Both end with `shutdown`: the controller after its reconciles in flight.
    tokio::join!(
        bounded_by(controller, &shutdown),
        shutdown.run_until_cancelled(sweeper)
    );
    tracing::info!("SidecarLifecycle controller stopped");
}

/// How long reconciles in flight get to finish once shutdown begins.
const IN_FLIGHT_GRACE: Duration = Duration::from_secs(2);

/// Run a kube-runtime controller (started with `graceful_shutdown_on`)
/// until it ends, but no longer than [`IN_FLIGHT_GRACE`] after `shutdown`:
/// its graceful stop has been seen to hang when asked while its first
/// watch was starting, and the Lease is released only after the leader's
/// work stops. Dropping it aborts the reconciles; they only make idempotent
/// writes, so an interrupted one is redone by the next leader.
pub(crate) async fn bounded_by(
    controller: impl std::future::Future<Output = ()>,
    shutdown: &CancellationToken,
) {
    tokio::select! {
        () = controller => {}
        () = async {
            shutdown.cancelled().await;
            tokio::time::sleep(IN_FLIGHT_GRACE).await;
        } => tracing::warn!(grace = ?IN_FLIGHT_GRACE, "reconciles still running at shutdown; dropped"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    #[tokio::test(start_paused = true)]
    async fn a_controller_that_does_not_stop_is_dropped_after_the_grace() {
        let shutdown = CancellationToken::new();
        let started = Instant::now();
        let stuck = tokio::spawn({
            let shutdown = shutdown.clone();
            async move { bounded_by(std::future::pending(), &shutdown).await }
        });
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!stuck.is_finished(), "runs until shutdown");
        shutdown.cancel();
        stuck.await.expect("returns");
        assert_eq!(started.elapsed(), Duration::from_secs(60) + IN_FLIGHT_GRACE);
    }
}
