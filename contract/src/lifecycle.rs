//! The JSON shapes of `remora.dev/lifecycle`, `remora.dev/status` and
//! `remora.dev/stop`.

use serde::{Deserialize, Serialize};

use crate::SidecarMode;

/// `remora.dev/lifecycle`: the effective lifecycle of the pod. Durations are
/// in the grammar of [`crate::duration`]; an absent field keeps the agent's
/// own setting.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LifecycleAnnotation {
    /// The concrete mode the pod was injected in (`Legacy` or `Native`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup: Option<StartupAnnotation>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown: Option<ShutdownAnnotation>,
    /// Hard bound of the drain (the operator derives it from the grace period).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_deadline: Option<String>,
}

impl LifecycleAnnotation {
    /// Whether the pod's sidecar is a native one (an init container with
    /// `restartPolicy: Always`), which the kubelet stops itself.
    pub fn is_native(&self) -> bool {
        self.mode.as_deref() == Some(SidecarMode::Native.as_str())
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartupAnnotation {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_application_until_proxy_starts: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShutdownAnnotation {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_duration: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub termination_drain_duration: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_on_zero_active_connections: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minimum_drain_duration: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_mode: Option<crate::DrainMode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quiet_period: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub withdrawal_timeout: Option<String>,
}

/// The value of `remora.dev/stop` as the operator writes it. Informational:
/// any value, even one that does not parse, is a stop request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StopRequest {
    /// Why, e.g. `AppsCompleted`.
    pub reason: String,
    /// When the operator asked (RFC 3339).
    pub at: String,
}

/// `remora.dev/status`: what the operator did to the pod.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SidecarStatus {
    /// The operator's version.
    pub version: String,
    /// The concrete mode injected.
    pub mode: SidecarMode,
    pub containers: Vec<String>,
    pub init_containers: Vec<String>,
    pub volumes: Vec<String>,
    /// A digest of the whole injected sidecar.
    pub config_hash: String,
    /// A digest of the settings only a restart applies; the controller
    /// compares it to decide `RestartRequired` and rollouts. Absent on pods
    /// injected before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_hash: Option<String>,
    /// Which layers contributed, weakest first.
    #[serde(default)]
    pub sources: Vec<String>,
    /// The sidecar's inbound listener ports on which it accepts the mesh's
    /// mTLS besides plain text: every inbound port when the workload CA is
    /// wired, else none. A client's sidecar originates mTLS to an endpoint
    /// only on these ports; a pod injected before this existed has none
    /// (its sidecar takes plain text only), so upgrades keep working.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mtls_ports: Vec<u16>,
    /// Its inbound listeners as injected (`PORT:APP_PORT` or `APP_PORT`,
    /// the default one included): with discovery on, the server serves
    /// them while the pod carries no `remora.dev/inbound`. Always written,
    /// empty too: its presence says the pod's agent expects its inbound
    /// listeners served (an older one writes them into Envoy's bootstrap).
    #[serde(default)]
    pub inbound: Vec<String>,
}
