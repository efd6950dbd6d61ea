//! The controller's metrics, registered in the operator's registry.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

/// What the controller counts and times.
#[derive(Clone, Debug)]
pub struct Metrics {
    reconciles: Family<ResultLabels, Counter>,
    duration: Histogram,
    pub(super) retuned: Counter,
    pub(super) rollouts: Counter,
    pub(super) rollouts_refused: Counter,
    pub(super) status_writes: Counter,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Self {
        let reconciles = Family::<ResultLabels, Counter>::default();
        registry.register(
            "controller_reconciles",
            "SidecarLifecycle reconciles, by result (ok or the error kind)",
            reconciles.clone(),
        );
        // 1ms .. ~16s
        let duration = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        registry.register(
            "controller_reconcile_duration_seconds",
            "Time of one SidecarLifecycle reconcile, API writes included",
            duration.clone(),
        );
        let retuned = Counter::default();
        registry.register(
            "controller_pods_retuned",
            "Pods whose remora.dev/lifecycle annotation the controller updated",
            retuned.clone(),
        );
        let rollouts = Counter::default();
        registry.register(
            "controller_rollouts",
            "Workloads the controller rolled (rolloutPolicy Automatic)",
            rollouts.clone(),
        );
        let rollouts_refused = Counter::default();
        registry.register(
            "controller_rollouts_refused",
            "Rollouts asked for by a pod whose owner chain or governance the API server does not confirm",
            rollouts_refused.clone(),
        );
        let status_writes = Counter::default();
        registry.register(
            "controller_status_writes",
            "SidecarLifecycle statuses written (server-side apply)",
            status_writes.clone(),
        );
        Self {
            reconciles,
            duration,
            retuned,
            rollouts,
            rollouts_refused,
            status_writes,
        }
    }

    pub(super) fn observe(&self, result: &'static str, took: Duration) {
        self.reconciles
            .get_or_create(&ResultLabels { result })
            .inc();
        self.duration.observe(took.as_secs_f64());
    }
}
