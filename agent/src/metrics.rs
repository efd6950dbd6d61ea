//! The agent's Prometheus metrics (one registry for the agent; other modules
//! get a sub-registry).

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum RestartKind {
    /// Envoy exited abnormally and was started again.
    Crash,
    /// A new epoch took over from a running Envoy.
    Hot,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RestartLabels {
    pub kind: RestartKind,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum DrainOutcomeLabel {
    /// Adaptive: the pod was no longer used.
    Quiet,
    /// Active connections reached zero (exit-on-zero).
    Drained,
    /// The termination drain duration elapsed.
    Elapsed,
    /// The drain deadline came first.
    DeadlineExceeded,
    /// A second signal cut the drain short.
    Aborted,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DrainLabels {
    pub outcome: DrainOutcomeLabel,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WithdrawalLabels {
    /// `confirmed`, `timed_out` or `fell_back` ([`crate::withdrawal::Outcome::label`]).
    pub outcome: &'static str,
}

#[derive(Clone, Debug)]
pub struct Metrics {
    pub envoy_restarts: Family<RestartLabels, Counter>,
    pub envoy_starts_failed: Counter,
    pub config_rejected: Gauge,
    pub drain_duration: Histogram,
    pub drain_active_connections_at_start: Gauge,
    pub drains: Family<DrainLabels, Counter>,
    pub drain_withdrawals: Family<WithdrawalLabels, Counter>,
    pub drain_withdrawal_wait: Histogram,
    pub drain_withdrawal_unconfirmed: Counter,
    pub ready: Gauge,
}

impl Metrics {
    pub fn new(registry: &mut Registry) -> Self {
        let m = Self {
            envoy_restarts: Family::default(),
            envoy_starts_failed: Counter::default(),
            config_rejected: Gauge::default(),
            drain_duration: Histogram::new([
                0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 120.0,
            ]),
            drain_active_connections_at_start: Gauge::default(),
            drains: Family::default(),
            drain_withdrawals: Family::default(),
            drain_withdrawal_wait: Histogram::new([
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ]),
            drain_withdrawal_unconfirmed: Counter::default(),
            ready: Gauge::default(),
        };
        registry.register(
            "envoy_restarts",
            "Envoy restarts by kind (crash, hot)",
            m.envoy_restarts.clone(),
        );
        registry.register(
            "envoy_start_failures",
            "Envoy starts that failed, including rejected hot-restart configurations",
            m.envoy_starts_failed.clone(),
        );
        registry.register(
            "config_rejected",
            "1 while Envoy runs an older configuration because it refused the \
             latest input (see /debug/config); 0 once one is accepted",
            m.config_rejected.clone(),
        );
        registry.register(
            "drain_duration_seconds",
            "Time from the start of a drain to its end",
            m.drain_duration.clone(),
        );
        registry.register(
            "drain_active_connections_at_start",
            "Active downstream connections when the last drain started",
            m.drain_active_connections_at_start.clone(),
        );
        registry.register("drains", "Drains by outcome", m.drains.clone());
        registry.register(
            "drain_withdrawals",
            "Discovery mode: adaptive drains by how the wait for the confirmed removal of the \
             pod's endpoints ended (confirmed; timed_out: a proxy never confirmed; fell_back: \
             the discovery stream was down or said nothing, the quiet period alone decided)",
            m.drain_withdrawals.clone(),
        );
        registry.register(
            "drain_withdrawal_wait_seconds",
            "Discovery mode: how long a drain waited for the confirmed removal of the pod's endpoints",
            m.drain_withdrawal_wait.clone(),
        );
        registry.register(
            "drain_withdrawal_unconfirmed",
            "Proxies still routing to the pod when a drain stopped waiting for them",
            m.drain_withdrawal_unconfirmed.clone(),
        );
        registry.register(
            "ready",
            "1 while /healthz/ready answers 200",
            m.ready.clone(),
        );
        m
    }

    /// How a drain's wait for the confirmed removal ended.
    pub fn record_withdrawal(&self, w: &crate::withdrawal::Outcome) {
        use crate::withdrawal::Outcome;
        self.drain_withdrawals
            .get_or_create(&WithdrawalLabels { outcome: w.label() })
            .inc();
        match w {
            Outcome::Confirmed { waited_ms, .. } => {
                self.drain_withdrawal_wait.observe(*waited_ms as f64 / 1e3);
            }
            Outcome::TimedOut {
                pending, waited_ms, ..
            } => {
                self.drain_withdrawal_wait.observe(*waited_ms as f64 / 1e3);
                self.drain_withdrawal_unconfirmed
                    .inc_by(u64::from(*pending));
            }
            Outcome::FellBack { .. } => {}
        }
    }
}
