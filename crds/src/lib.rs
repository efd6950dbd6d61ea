//! Remora's CRD types and the generator of their YAML.
//!
//! `SidecarLifecycle` (`remora.dev/v1alpha1`, namespaced, short name `slc`)
//! tunes how injected sidecars start and stop. Every lifecycle field is
//! optional on purpose: an unset field inherits from the weaker layer
//! (chart defaults < cluster default < namespace-wide < workload < pod
//! annotations), so the schema carries no `default` for them — an API-server
//! default would silently override the weaker layers. The built-in defaults
//! are named in each field's description and live in [`defaults`].

pub mod external;

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

/// API group of Remora's CRDs.
pub const GROUP: &str = "remora.dev";
/// Served and stored version.
pub const VERSION: &str = "v1alpha1";

/// The built-in defaults (the weakest layer, "chart defaults").
pub use remora_contract::defaults;
pub use remora_contract::{DrainMode, LogLevel, SidecarMode};

#[derive(Debug, thiserror::Error)]
pub enum CrdError {
    #[error("cannot render the CRD as YAML: {0}")]
    Yaml(String),
}

/// Spec of a `SidecarLifecycle`: how the Remora sidecar of the selected pods
/// starts and stops.
// Several `printcolumn(type_ = ...)` entries look like duplicates to clippy.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "remora.dev",
    version = "v1alpha1",
    kind = "SidecarLifecycle",
    plural = "sidecarlifecycles",
    singular = "sidecarlifecycle",
    shortname = "slc",
    category = "remora",
    namespaced,
    status = "SidecarLifecycleStatus",
    derive = "PartialEq",
    derive = "Default",
    doc = "SidecarLifecycle tunes how Remora's Envoy sidecar starts and stops in the selected pods: the startup hold, the drain on termination, and the proxy's resources. Without a selector it applies to the whole namespace; in the operator's namespace without a selector it is the cluster default.",
    printcolumn(
        name = "Mode",
        type_ = "string",
        description = "Sidecar mode (Auto, Legacy or Native)",
        json_path = ".spec.mode"
    ),
    printcolumn(
        name = "Drain",
        type_ = "string",
        description = "Envoy listener drain duration",
        json_path = ".spec.shutdown.drainDuration"
    ),
    printcolumn(
        name = "ExitOnZero",
        type_ = "boolean",
        description = "Stop as soon as no connection is left",
        json_path = ".spec.shutdown.exitOnZeroActiveConnections"
    ),
    printcolumn(
        name = "Matched",
        type_ = "integer",
        description = "Pods this resource currently applies to",
        json_path = ".status.matchedPods"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct SidecarLifecycleSpec {
    /// Pods this resource applies to, by label. Absent: every pod of the
    /// namespace (in the operator's namespace: every pod of the cluster, as the
    /// cluster default). When two selectors of a namespace match one pod, the
    /// older resource wins and the other reports the condition Conflicted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<WorkloadSelector>,
    /// How the sidecar is injected. Legacy: first regular container, with a
    /// postStart hold and a preStop drain. Native: a restartable init
    /// container (Kubernetes >= 1.29). Auto: Native where every node supports
    /// it, else Legacy. Default when no layer sets it: Auto.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "mode_schema")]
    pub mode: Option<SidecarMode>,
    /// How the application waits for the proxy at startup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup: Option<StartupSpec>,
    /// How the proxy drains and stops when the pod terminates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown: Option<ShutdownSpec>,
    /// Envoy's own settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<ProxySpec>,
    /// What happens to running pods when this resource changes. Manual: only
    /// new pods get the new settings (drain settings still reach running pods
    /// through the lifecycle annotation). Automatic: the controller restarts
    /// the matched workloads. Default: Manual.
    #[serde(default = "default_rollout_policy")]
    pub rollout_policy: RolloutPolicy,
}

fn default_rollout_policy() -> RolloutPolicy {
    RolloutPolicy::Manual
}

/// Label selector of the pods a `SidecarLifecycle` applies to.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadSelector {
    /// The pod must carry every one of these labels with the same value. An
    /// empty map selects every pod of the namespace.
    #[serde(default)]
    #[schemars(extend("maxProperties" = 64))]
    pub match_labels: BTreeMap<String, String>,
}

/// A pod's labels, however they are held.
pub trait LabelSet {
    fn label(&self, key: &str) -> Option<&str>;
}

impl LabelSet for BTreeMap<String, String> {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

impl WorkloadSelector {
    /// Whether a pod with these labels is selected.
    pub fn matches(&self, labels: &(impl LabelSet + ?Sized)) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.label(k) == Some(v.as_str()))
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum RolloutPolicy {
    /// New settings apply to new pods only.
    #[default]
    Manual,
    /// The controller restarts matched workloads to apply new settings.
    Automatic,
}

/// Startup ordering of the application and its proxy.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StartupSpec {
    /// Hold the application's containers until the proxy is ready. Default: true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_application_until_proxy_starts: Option<bool>,
    /// How long the proxy may take to become ready (the postStart wait in
    /// Legacy mode, the startup probe's budget in Native mode). Default: 60s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<DurationString>,
}

/// Graceful shutdown of the proxy when its pod terminates.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new(
    "!has(self.minimumDrainDuration) || !has(self.drainDuration) || duration(self.minimumDrainDuration) <= duration(self.drainDuration)"
).message("minimumDrainDuration must not exceed drainDuration: Envoy's listeners close after drainDuration"))]
#[x_kube(validation = kube::core::Rule::new(
    "!has(self.terminationDrainDuration) || !has(self.drainDuration) || duration(self.terminationDrainDuration) <= duration(self.drainDuration)"
).message("terminationDrainDuration must not exceed drainDuration: Envoy's listeners close after drainDuration"))]
pub struct ShutdownSpec {
    /// How long Envoy's inbound listeners drain (Envoy `--drain-time-s`):
    /// they keep accepting and answer with `connection: close`. Default: 45s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_duration: Option<DurationString>,
    /// Without exitOnZeroActiveConnections: how long the proxy keeps running
    /// after draining starts. Default: 5s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub termination_drain_duration: Option<DurationString>,
    /// Stop the proxy as soon as no downstream connection is left, after
    /// minimumDrainDuration. Default: false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_on_zero_active_connections: Option<bool>,
    /// With exitOnZeroActiveConnections: always drain at least this long.
    /// It must fit in the pod's terminationGracePeriodSeconds (the operator
    /// warns otherwise). Default: 5s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minimum_drain_duration: Option<DurationString>,
    /// How the drain ends. Adaptive: when the pod is no longer used — no new
    /// connection or request (inbound or outbound) for quietPeriod and none
    /// in flight — bounded by the grace period; the app containers' SIGTERM
    /// waits (a preStop hook) until inbound traffic has gone quiet, so the
    /// drain follows the load balancer's real lag. Fixed:
    /// terminationDrainDuration, or exitOnZeroActiveConnections.
    /// exitOnZeroActiveConnections: true always means Fixed. Default: Adaptive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "drain_mode_schema")]
    pub drain_mode: Option<DrainMode>,
    /// Adaptive drain: how long no new connection or request must arrive
    /// before the pod counts as no longer used. Default: 3s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quiet_period: Option<DurationString>,
    /// Adaptive drain with Remora's discovery server: how long the drain
    /// waits for every sidecar that routed to the pod to confirm it no
    /// longer does before the quiet period runs (a sidecar that never
    /// confirms is named in a Warning Event), within the drain deadline.
    /// Default: 5s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub withdrawal_timeout: Option<DurationString>,
}

/// Envoy process settings.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxySpec {
    /// Envoy worker threads; 0 means one per CPU. Default: 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 256))]
    pub concurrency: Option<i32>,
    /// Envoy's log level. Default: warning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "log_level_schema")]
    pub log_level: Option<LogLevel>,
    /// Compute resources of the sidecar container. Default: requests
    /// cpu 100m, memory 128Mi; limits memory 1Gi.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
}

/// The schema of a string enum whose values come from the contract crate
/// (which stays free of schemars): a plain `enum`, nullable because every
/// lifecycle field is optional.
fn string_enum(values: &[&str]) -> Schema {
    json_schema!({
        "type": "string",
        "enum": values,
        "nullable": true,
    })
}

fn mode_schema(_: &mut SchemaGenerator) -> Schema {
    string_enum(&SidecarMode::ALL.map(SidecarMode::as_str))
}

fn drain_mode_schema(_: &mut SchemaGenerator) -> Schema {
    string_enum(&DrainMode::ALL.map(DrainMode::as_str))
}

fn log_level_schema(_: &mut SchemaGenerator) -> Schema {
    string_enum(&LogLevel::ALL.map(LogLevel::as_str))
}

/// A duration such as `45s`, `1m30s` or `250ms`: whole numbers with the units
/// h, m, s, ms — the format both CEL's `duration()` and the agent accept.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
#[serde(transparent)]
pub struct DurationString(pub String);

/// The format of a [`DurationString`]: the contract's one grammar.
pub const DURATION_PATTERN: &str = remora_contract::duration::PATTERN;

impl DurationString {
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Parse to a std duration, accepting exactly what the schema accepts.
    pub fn parse(&self) -> Result<std::time::Duration, remora_contract::DurationError> {
        remora_contract::duration::parse(&self.0)
    }
}

impl std::fmt::Display for DurationString {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl JsonSchema for DurationString {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        "DurationString".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "pattern": DURATION_PATTERN,
            "maxLength": remora_contract::duration::MAX_LEN,
            "x-kubernetes-validations": [{
                "rule": remora_contract::duration::CEL_RULE,
                "message": remora_contract::duration::CEL_MESSAGE,
            }]
        })
    }
}

/// Observed state of a `SidecarLifecycle`, written by the controller.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SidecarLifecycleStatus {
    /// The metadata.generation the controller last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// How many pods this resource currently applies to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matched_pods: Option<i32>,
    /// Accepted (the spec is valid), Conflicted (an older resource selects the
    /// same pods and wins), Applied (matched pods run with these settings),
    /// RestartRequired (governed pods run with settings only a restart applies).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// Condition types reported in `status.conditions`.
pub mod condition {
    pub const ACCEPTED: &str = "Accepted";
    pub const CONFLICTED: &str = "Conflicted";
    pub const APPLIED: &str = "Applied";
    pub const RESTART_REQUIRED: &str = "RestartRequired";
}

/// Every CRD this crate defines.
pub fn crds()
-> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>
{
    vec![
        SidecarLifecycle::crd(),
        external::ExternalService::crd(),
        external::ExternalWorkload::crd(),
    ]
}

/// The CRDs as multi-document YAML (`remora-operator crds`).
pub fn crd_yaml() -> Result<String, CrdError> {
    Ok(crd_files()?.into_iter().map(|(_, y)| y).collect())
}

/// Each CRD's YAML document and its file under `charts/remora/crds/`
/// (`<plural>.<group>.yaml`).
pub fn crd_files() -> Result<Vec<(String, String)>, CrdError> {
    crds()
        .into_iter()
        .map(|crd| {
            let name = format!("{}.yaml", crd.metadata.name.as_deref().unwrap_or_default());
            let yaml = serde_saphyr::to_string(&crd).map_err(|e| CrdError::Yaml(e.to_string()))?;
            Ok((name, format!("---\n{yaml}")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selector_matches_all_labels() {
        let sel = WorkloadSelector {
            match_labels: [("app".to_string(), "web".to_string())].into(),
        };
        let mut labels = BTreeMap::new();
        assert!(!sel.matches(&labels));
        labels.insert("app".into(), "web".into());
        labels.insert("tier".into(), "x".into());
        assert!(sel.matches(&labels));
        assert!(WorkloadSelector::default().matches(&BTreeMap::new()));
    }
}
