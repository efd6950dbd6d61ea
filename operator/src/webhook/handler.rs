//! The admission handler: AdmissionReview bytes in, AdmissionReview out.
//! The decision is [`remora_inject::review`]'s; the handler adds what needs
//! the cluster and the clock: the namespace lookup (the one wait) and the
//! metrics.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use remora_inject::resolve::ChartDefaults;
use remora_inject::review::{self, Cluster, PodCreate};
pub use remora_inject::review::{AdmissionOutcome, Answer, ParsedReview};

use crate::webhook::view::{ClusterView, LookupError};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

/// What the webhook counts and times: answers by outcome, their latency,
/// and the reviews being answered now.
#[derive(Clone, Debug)]
pub struct Metrics {
    admissions: Family<OutcomeLabels, Counter>,
    latency: Histogram,
    in_flight: Gauge,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Self {
        let admissions = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "admissions",
            "Admission reviews answered, by outcome",
            admissions.clone(),
        );
        // 62.5µs .. ~2s, doubling: whole milliseconds from 1 ms (1, 2, 4 ..),
        // so a 2 ms latency goal is a bucket's bound.
        let latency = Histogram::new(exponential_buckets(0.0000625, 2.0, 16));
        registry.register(
            "admission_duration_seconds",
            "Time to answer one admission review, body read included",
            latency.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "admissions_in_flight",
            "Admission reviews being read or answered now",
            in_flight.clone(),
        );
        Self {
            admissions,
            latency,
            in_flight,
        }
    }

    pub fn observe(&self, outcome: AdmissionOutcome, took: Duration) {
        self.admissions
            .get_or_create(&OutcomeLabels {
                outcome: outcome.as_str(),
            })
            .inc();
        self.latency.observe(took.as_secs_f64());
    }

    /// Counts one review in flight until the guard is dropped (answered or
    /// cut off).
    pub fn in_flight(&self) -> InFlight {
        self.in_flight.inc();
        InFlight(self.in_flight.clone())
    }
}

/// See [`Metrics::in_flight`].
pub struct InFlight(Gauge);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The operator's admission logic, shared by the server's handlers.
pub struct Injector {
    pub chart: ChartDefaults,
    pub operator_namespace: String,
    pub view: Arc<dyn ClusterView>,
}

impl Injector {
    /// Answer one AdmissionReview body. It waits only when the pod's
    /// namespace is not in the cache (see [`ClusterView::lookup_namespace_labels`]).
    pub async fn review(&self, body: &[u8]) -> Answer {
        match review::parse(body) {
            Ok(req) => self.answer(req).await,
            Err(answer) => *answer,
        }
    }

    /// The second half of [`Self::review`], after [`review::parse`].
    pub async fn answer(&self, req: ParsedReview) -> Answer {
        let pod = match req.pod_create() {
            Ok(pod) => pod,
            Err(answer) => return *answer,
        };
        let namespace_labels = match self.namespace_labels(&pod).await {
            Ok(l) => l,
            Err(e) => return pod.refuse(&e),
        };
        let lifecycles = self
            .view
            .lifecycles_in(&[pod.namespace(), self.operator_namespace.as_str()]);
        pod.admit(&Cluster {
            chart: &self.chart,
            operator_namespace: &self.operator_namespace,
            lifecycles: &lifecycles,
            namespace_labels: &namespace_labels,
            native_sidecars: self.view.native_sidecars(),
        })
    }

    /// The labels of the pod's namespace, looked up when the cache does not
    /// know it, unless the pod's own label decides alone.
    async fn namespace_labels(
        &self,
        pod: &PodCreate,
    ) -> Result<BTreeMap<String, String>, LookupError> {
        let namespace = pod.namespace();
        if let Some(l) = self.view.namespace_labels(namespace) {
            return Ok(l);
        }
        if pod.selects_itself() {
            return Ok(BTreeMap::new());
        }
        let found = self.view.lookup_namespace_labels(namespace).await?;
        if found.is_some() {
            tracing::debug!(
                namespace,
                "namespace not in the cache yet; read from the API"
            );
        }
        Ok(found.unwrap_or_default())
    }
}
