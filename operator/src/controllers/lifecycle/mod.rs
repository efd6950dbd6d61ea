//! The `SidecarLifecycle` controller. It runs on the elected leader only
//! (the webhook serves on every replica) and, for each resource:
//!
//! - writes `status` (Accepted, Conflicted, Applied, RestartRequired,
//!   `matchedPods`, `observedGeneration`) by server-side apply with the field
//!   manager [`FIELD_MANAGER`], and only when it changed;
//! - retunes running pods: when a setting the agent reads at runtime (drain
//!   settings) changes, it patches the pods' `remora.dev/lifecycle`
//!   annotation, which the agent reads through the downward API. Each pod
//!   is patched by the reconcile of the one resource that governs it
//!   ([`crate::controllers::lifecycle::status::governed`]), never by every resource that reaches
//!   it; an edit of a cluster default triggers its siblings, which patch
//!   their own pods;
//! - when a setting only a restart applies changes, reports
//!   `RestartRequired`; with `rolloutPolicy: Automatic` it rolls the owning
//!   Deployment/StatefulSet/DaemonSet through a pod-template annotation,
//!   at most one rollout per `rollout_interval`;
//! - records each decision as a Kubernetes Event on the resource and on the
//!   pods it touched, and counts reconciles, errors and durations.
//!
//! It opens no watch of its own: it follows the replica's SidecarLifecycle
//! watch (the webhook's, [`crate::cluster::view`]) and the leader's pod watch
//! ([`crate::cluster::live_pod::live_pods`]), which the Jobs controller shares.
//!
//! Reconciles are idempotent: they compare what is with what should be and
//! write only the difference, so a replayed or concurrent reconcile changes
//! nothing.

mod budget;
mod context;
mod error;
mod events;
mod metrics;
mod pod_index;
mod reconcile;
mod retune;
mod rollout;
mod rollout_limiter;
pub mod status;
mod triggers;
mod unconfirmed;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kube::Client;
use kube::runtime::controller::{self, Controller};
use kube::runtime::events::{Recorder, Reporter};
use remora_crds::SidecarLifecycle;
use tokio_util::sync::CancellationToken;

pub use budget::{Budget, DEFAULT_BURST, DEFAULT_QPS};
pub use error::ControllerError;
pub use events::{Decision, decisions};
pub use metrics::Metrics;
pub use rollout_limiter::RolloutLimiter;

use crate::cluster::live_pod::LivePod;
use crate::cluster::watch::{Change, SharedWatch};
use crate::identity::FIELD_MANAGER;
use context::Ctx;
use pod_index::PodIndex;
use reconcile::{error_policy, reconcile, sweep};
use remora_inject::resolve::ChartDefaults;
use triggers::{changes, generation, pod_key, pod_settings};

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
    /// Whether rolloutPolicy Automatic rolls workloads (`--automatic-rollouts`;
    /// the chart grants the rights on workloads only then).
    pub automatic_rollouts: bool,
    /// Who publishes the Events (the pod name).
    pub identity: String,
    /// Requests per second to the API server, and bursts (`--kube-api-qps`,
    /// `--kube-api-burst`).
    pub qps: u32,
    pub burst: u32,
}

/// Reconciles at once. Each waits mostly on the API server, within the
/// shared [`Budget`]; more would only hold more pod lists in memory.
const CONCURRENT_RECONCILES: u16 = 16;

/// Run until `shutdown`: the reconciles that the changes of the shared
/// SidecarLifecycle and pod watches trigger.
pub async fn run(
    client: Client,
    settings: Settings,
    metrics: Metrics,
    lifecycles: SharedWatch<SidecarLifecycle>,
    pods: SharedWatch<LivePod>,
    shutdown: CancellationToken,
) {
    // Until every live pod is listed, matchedPods would be wrong.
    if shutdown.run_until_cancelled(pods.listed()).await.is_none() {
        return;
    }
    let index = PodIndex::follow(&pods);
    let store = lifecycles.store();
    let ns = &settings.operator_namespace;
    let by_pod = triggers::by_pod(store.clone(), ns.clone());
    let by_governor = triggers::by_governor(store.clone(), ns.clone());
    let by_sibling = triggers::by_sibling(store.clone(), ns.clone());
    // Status-only pod updates (most of them) trigger nothing; a retune's
    // own patch triggers only the pod's governor.
    let pod_changes = changes(pods.subscribe(), pod_key).map(Change::into_object);
    let settings_changes = changes(pods.subscribe(), pod_settings).filter_map(|c| {
        futures::future::ready(match c {
            Change::Applied(p) => Some(p),
            // `pod_changes` has it.
            Change::Deleted(_) => None,
        })
    });
    // A deleted resource is never reconciled: its pods are swept back to
    // what the remaining layers say (below), even when no sibling is left.
    let (deleted_tx, mut deleted) = tokio::sync::mpsc::unbounded_channel();
    let sibling_changes = changes(lifecycles.subscribe(), generation).map(move |c| {
        if let Change::Deleted(r) = &c {
            let _ = deleted_tx.send(Arc::clone(r));
        }
        c.into_object()
    });
    // Every update of a resource, status writes included: a reconcile
    // compares and writes only what differs.
    let own_changes = lifecycles.subscribe().filter_map(|c| {
        futures::future::ready(match c {
            Change::Applied(r) => Some(r),
            Change::Deleted(_) => None,
        })
    });

    let ctx = Arc::new(Ctx {
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: FIELD_MANAGER.into(),
                instance: Some(settings.identity.clone()),
            },
        ),
        limiter: Mutex::new(RolloutLimiter::new(settings.rollout_interval)),
        budget: Budget::new(settings.qps, settings.burst),
        routine_events: retune::routine_event_allowance(),
        client,
        settings,
        index,
        lifecycles: store.clone(),
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
    let controller = Controller::for_shared_stream(own_changes, store)
        .watches_shared_stream(pod_changes, by_pod)
        .watches_shared_stream(settings_changes, by_governor)
        .watches_shared_stream(sibling_changes, by_sibling)
        .with_config(controller::Config::default().concurrency(CONCURRENT_RECONCILES))
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
