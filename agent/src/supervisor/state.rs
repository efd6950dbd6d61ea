//! What `/debug/config` shows of Envoy: the epochs, the restarts, the drain,
//! and the last configuration Envoy refused.

use std::path::PathBuf;
use std::time::SystemTime;

use serde::Serialize;

/// What `/debug/config` shows of the running Envoy.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EnvoyState {
    pub epoch: u32,
    pub pid: Option<u32>,
    pub base_id: Option<u32>,
    pub crash_restarts: u64,
    pub hot_restarts: u64,
    pub draining: bool,
    /// A new epoch that is starting and has not taken over yet.
    pub starting_epoch: Option<u32>,
    /// The last configuration Envoy refused; cleared when a newer one is
    /// accepted, or when the input is back to what runs.
    pub rejected_config: Option<RejectedConfig>,
}

/// Where a new configuration was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectStage {
    /// The bootstrap could not be generated (a bad override file).
    Render,
    /// `envoy --mode validate` refused it.
    Validate,
    /// The new epoch exited, or never took over, after validation passed.
    Start,
}

/// A configuration Envoy refused, as `/debug/config` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct RejectedConfig {
    pub stage: RejectStage,
    /// The epoch that failed to start (stage `start`).
    pub epoch: Option<u32>,
    /// What asked for the hot restart.
    pub trigger: String,
    pub error: String,
    /// The refused bootstrap, kept for inspection.
    pub bootstrap: Option<PathBuf>,
    pub at_unix_seconds: u64,
    /// Stage `start`: whether the running epoch's admin API still answers.
    /// Envoy closes it as soon as a new epoch begins and cannot reopen it;
    /// without it a drain cannot be graceful, and the shared memory stays
    /// marked as initializing, so Envoy cannot hot restart again until it
    /// starts afresh (envoyproxy/envoy#33446).
    pub running_admin_answers: Option<bool>,
}

impl RejectedConfig {
    pub(super) fn new(stage: RejectStage, trigger: &str, error: impl Into<String>) -> Self {
        Self {
            stage,
            epoch: None,
            trigger: trigger.to_string(),
            error: error.into(),
            bootstrap: None,
            at_unix_seconds: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            running_admin_answers: None,
        }
    }
}
