//! Lifecycle settings that can change while the pod runs.
//!
//! The operator writes the effective lifecycle of a pod into the annotation
//! `remora.dev/lifecycle` (JSON, [`remora_contract::lifecycle::LifecycleAnnotation`]) and the controller
//! patches it when a `SidecarLifecycle` changes. The agent reads the pod's
//! annotations ([`PodAnnotations`]: the discovery stream's copy, else the
//! downward-API file) at the moment a setting is used, so a change reaches a
//! running pod without a restart.
//! Per-field annotations `remora.dev/<kebab-case-field>` win over the JSON.

use std::collections::BTreeMap;
use std::time::Duration;

use remora_contract::{DrainFields, DrainMode, Overlay};
use serde::Serialize;

use crate::config::RunConfig;
use crate::pod_annotations::PodAnnotations;

/// The drain settings in force at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DrainSettings {
    #[serde(with = "secs")]
    pub drain_duration: Duration,
    #[serde(with = "secs")]
    pub termination_drain_duration: Duration,
    pub exit_on_zero_active_connections: bool,
    #[serde(with = "secs")]
    pub minimum_drain_duration: Duration,
    #[serde(with = "secs")]
    pub drain_deadline: Duration,
    pub drain_mode: DrainMode,
    #[serde(with = "secs")]
    pub quiet_period: Duration,
    #[serde(with = "secs")]
    pub withdrawal_timeout: Duration,
}

mod secs {
    use std::time::Duration;
    pub fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
}

impl DrainSettings {
    pub fn from_config(cfg: &RunConfig) -> Self {
        Self {
            drain_duration: cfg.drain_duration,
            termination_drain_duration: cfg.termination_drain_duration,
            exit_on_zero_active_connections: cfg.exit_on_zero_active_connections,
            minimum_drain_duration: cfg.minimum_drain_duration,
            drain_deadline: cfg.drain_deadline,
            drain_mode: cfg.drain_mode,
            quiet_period: cfg.quiet_period,
            withdrawal_timeout: cfg.withdrawal_timeout,
        }
    }

    /// How this drain ends: exit-on-zero always means the fixed model.
    pub fn adaptive(&self) -> bool {
        self.drain_mode == DrainMode::Adaptive && !self.exit_on_zero_active_connections
    }

    /// Whether a drain can last at all: not with a fixed termination drain
    /// of zero, which stops Envoy at once (as pilot-agent's
    /// `terminationDrainDuration: 0s` does).
    pub fn can_wait(&self) -> bool {
        self.adaptive()
            || self.exit_on_zero_active_connections
            || !self.termination_drain_duration.is_zero()
    }

    /// Apply the pod's annotations over these settings with the contract's
    /// [`Overlay::apply_drain`], as the operator does. Each bad value is
    /// reported and skipped; the others still apply.
    pub fn with_annotations(mut self, ann: &BTreeMap<String, String>) -> (Self, Vec<String>) {
        let (o, problems) = Overlay::from_pod_annotations(ann);
        o.apply_drain(DrainFields {
            drain_duration: &mut self.drain_duration,
            termination_drain_duration: &mut self.termination_drain_duration,
            exit_on_zero_active_connections: &mut self.exit_on_zero_active_connections,
            minimum_drain_duration: &mut self.minimum_drain_duration,
            drain_mode: &mut self.drain_mode,
            quiet_period: &mut self.quiet_period,
            withdrawal_timeout: &mut self.withdrawal_timeout,
            drain_deadline: Some(&mut self.drain_deadline),
        });
        (self, problems.iter().map(ToString::to_string).collect())
    }
}

/// Where live settings come from: the flags, overlaid with the pod's
/// annotations when there are any. Read at each use; a broken file never
/// loses the flags.
#[derive(Debug, Clone)]
pub struct LiveSettings {
    base: DrainSettings,
    annotations: PodAnnotations,
}

impl LiveSettings {
    pub fn new(cfg: &RunConfig, annotations: PodAnnotations) -> Self {
        Self {
            base: DrainSettings::from_config(cfg),
            annotations,
        }
    }

    pub fn annotations(&self) -> &PodAnnotations {
        &self.annotations
    }

    /// The settings in force now; bad annotations are logged and skipped.
    pub fn current(&self) -> DrainSettings {
        let (settings, problems) = self.current_quiet();
        for p in problems {
            tracing::warn!(file = %self.annotations.file().display(), problem = %p,
                "ignoring a bad lifecycle annotation");
        }
        settings
    }

    /// The settings in force now, and what was wrong with the annotations,
    /// without logging (for callers that poll).
    pub fn current_quiet(&self) -> (DrainSettings, Vec<String>) {
        match self.annotations.read() {
            Ok(None) => (self.base, Vec::new()),
            Ok(Some(ann)) => self.base.with_annotations(&ann),
            Err(e) => (
                self.base,
                vec![format!(
                    "cannot read the annotations file, using the flags: {e}"
                )],
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use remora_contract::annotations;

    fn base() -> DrainSettings {
        DrainSettings {
            drain_duration: Duration::from_secs(45),
            termination_drain_duration: Duration::from_secs(5),
            exit_on_zero_active_connections: false,
            minimum_drain_duration: Duration::from_secs(5),
            drain_deadline: Duration::from_secs(25),
            drain_mode: DrainMode::Adaptive,
            quiet_period: Duration::from_secs(3),
            withdrawal_timeout: Duration::from_secs(5),
        }
    }

    #[test]
    fn json_then_per_field_keys_win() {
        let mut ann = BTreeMap::new();
        ann.insert(
            annotations::LIFECYCLE.to_string(),
            r#"{"shutdown":{"terminationDrainDuration":"2s","exitOnZeroActiveConnections":true,"minimumDrainDuration":"1s"},"drainDeadline":"50s"}"#.to_string(),
        );
        ann.insert(
            annotations::MINIMUM_DRAIN_DURATION.to_string(),
            "3s".to_string(),
        );
        let (s, problems) = base().with_annotations(&ann);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(s.termination_drain_duration, Duration::from_secs(2));
        assert!(s.exit_on_zero_active_connections);
        assert_eq!(s.minimum_drain_duration, Duration::from_secs(3));
        assert_eq!(s.drain_deadline, Duration::from_secs(50));
        assert_eq!(s.drain_duration, Duration::from_secs(45));
    }

    #[test]
    fn bad_values_are_reported_and_skipped() {
        let mut ann = BTreeMap::new();
        ann.insert(annotations::LIFECYCLE.to_string(), "{not json".to_string());
        ann.insert(
            annotations::EXIT_ON_ZERO_ACTIVE_CONNECTIONS.to_string(),
            "maybe".to_string(),
        );
        ann.insert(
            annotations::TERMINATION_DRAIN_DURATION.to_string(),
            "7s".to_string(),
        );
        let (s, problems) = base().with_annotations(&ann);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert_eq!(s.termination_drain_duration, Duration::from_secs(7));
        assert!(!s.exit_on_zero_active_connections);
    }
}
