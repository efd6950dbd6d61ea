//! The injection itself: a pure function from a pod (as JSON), where it
//! lives and its effective config to a JSON Patch. No I/O. This module
//! decides whether a pod is injected and assembles the patch; the sidecar
//! container is [`crate::container`]'s, its listeners [`crate::traffic`]'s.
//!
//! The pod stays a `serde_json::Value` on purpose: a typed round trip would
//! drop fields this build does not know, and the patch is built from explicit
//! `add` operations, never a diff, so nothing of the user's pod is rewritten.

use std::collections::BTreeMap;
use std::time::Duration;

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation};
use k8s_openapi::api::core::v1::{Container, VolumeMount};
use remora_contract::duration::format as format_duration;
use remora_contract::lifecycle::{
    LifecycleAnnotation, ShutdownAnnotation, SidecarStatus, StartupAnnotation,
};
use remora_contract::pod::{
    HOOK_DIR, HOOK_HELPER_PATH, HOOK_VOLUME, PROXY_CONTAINER, SIDECAR_PORTS,
};
use remora_contract::{annotations as keys, defaults, env as env_name};
use remora_crds::SidecarMode;
use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::container::{env, exec, proxy_container, sidecar_volumes, wire_workload_ca};
use crate::resolve::EffectiveConfig;
use crate::traffic::{PlumbingError, plumb, workload_ca_wiring};

// The contract's names a patch is about, for the patch's callers.
pub use remora_contract::annotations::{
    INJECT_LABEL, LIFECYCLE as LIFECYCLE_ANNOTATION, STATUS as STATUS_ANNOTATION,
};
pub use remora_contract::pod::drain_deadline;
/// Namespaces never injected, whatever their labels say.
pub const SYSTEM_NAMESPACES: [&str; 3] = ["kube-system", "kube-public", "kube-node-lease"];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MutateError {
    #[error("the object is not a JSON object")]
    NotAnObject,
    #[error("{0} is not of the expected shape")]
    BadField(&'static str),
    #[error("spec.containers is missing or empty")]
    NoContainers,
    /// The pod must be refused, not injected differently from what it asks.
    #[error(transparent)]
    Refused(#[from] PlumbingError),
}

/// Who is asking: the webhook follows the selection labels; offline
/// injection was asked for explicitly and only honours opt-outs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selection {
    Webhook,
    Offline,
}

/// Where the pod is going.
#[derive(Debug, Clone)]
pub struct Target<'a> {
    pub namespace: &'a str,
    pub namespace_labels: &'a BTreeMap<String, String>,
    /// Whether the cluster runs native sidecars (every kubelet >= 1.29).
    pub native_sidecars: bool,
    pub selection: Selection,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SkipReason {
    NotSelected,
    OptedOut,
    HostNetwork,
    SystemNamespace,
    AlreadyInjected,
    NameConflict,
}

impl SkipReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::NotSelected => "not-selected",
            Self::OptedOut => "opted-out",
            Self::HostNetwork => "host-network",
            Self::SystemNamespace => "system-namespace",
            Self::AlreadyInjected => "already-injected",
            Self::NameConflict => "name-conflict",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Injected(SidecarMode),
    Skipped(SkipReason),
}

/// The result of [`mutate`]: the patch (empty when skipped) and what the
/// user should hear about.
#[derive(Debug, Clone, PartialEq)]
pub struct Mutation {
    pub patch: Patch,
    pub outcome: Outcome,
    pub warnings: Vec<String>,
}

impl Mutation {
    fn skipped(reason: SkipReason, warnings: Vec<String>) -> Self {
        Self {
            patch: Patch(Vec::new()),
            outcome: Outcome::Skipped(reason),
            warnings,
        }
    }
}

/// The labels and Remora's own (`remora.dev/...`) annotations of a pod (or
/// pod template), ignoring values that are not strings. Other annotations
/// are never read, and may be large (up to the object's size): not copied.
pub fn pod_meta(pod: &Value) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let map = |v: &Value, keep: &dyn Fn(&str) -> bool| -> BTreeMap<String, String> {
        v.as_object()
            .map(|o| {
                o.iter()
                    .filter(|(k, _)| keep(k))
                    .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_string())))
                    .collect()
            })
            .unwrap_or_default()
    };
    (
        map(&pod["metadata"]["labels"], &|_| true),
        map(&pod["metadata"]["annotations"], &|k| {
            k.starts_with(keys::PREFIX)
        }),
    )
}

fn names(list: &Value) -> Vec<&str> {
    list.as_array()
        .map(|a| a.iter().filter_map(|c| c["name"].as_str()).collect())
        .unwrap_or_default()
}

fn ptr(tokens: &[&str]) -> PointerBuf {
    PointerBuf::from_tokens(tokens.iter().copied())
}

fn add(tokens: &[&str], value: Value) -> PatchOperation {
    PatchOperation::Add(AddOperation {
        path: ptr(tokens),
        value,
    })
}

/// Decide and build the injection of one pod.
pub fn mutate(
    pod: &Value,
    target: &Target<'_>,
    cfg: &EffectiveConfig,
) -> Result<Mutation, MutateError> {
    if !pod.is_object() {
        return Err(MutateError::NotAnObject);
    }
    let meta = &pod["metadata"];
    if !(meta.is_null() || meta.is_object()) {
        return Err(MutateError::BadField("metadata"));
    }
    let spec = &pod["spec"];
    if !spec.is_object() {
        return Err(MutateError::BadField("spec"));
    }
    let containers = spec["containers"]
        .as_array()
        .filter(|c| !c.is_empty())
        .ok_or(MutateError::NoContainers)?;
    for (key, what) in [
        ("initContainers", "spec.initContainers"),
        ("volumes", "spec.volumes"),
    ] {
        if !(spec[key].is_null() || spec[key].is_array()) {
            return Err(MutateError::BadField(what));
        }
    }
    if !(meta["annotations"].is_null() || meta["annotations"].is_object()) {
        return Err(MutateError::BadField("metadata.annotations"));
    }
    let (labels, annotations) = pod_meta(pod);

    // Selection. The pod's "false" always wins.
    if labels.get(INJECT_LABEL).map(String::as_str) == Some("false") {
        return Ok(Mutation::skipped(SkipReason::OptedOut, vec![]));
    }
    if annotations.contains_key(STATUS_ANNOTATION) {
        return Ok(Mutation::skipped(SkipReason::AlreadyInjected, vec![]));
    }
    if SYSTEM_NAMESPACES.contains(&target.namespace) {
        return Ok(Mutation::skipped(SkipReason::SystemNamespace, vec![]));
    }
    if spec["hostNetwork"].as_bool() == Some(true) {
        return Ok(Mutation::skipped(SkipReason::HostNetwork, vec![]));
    }
    let selected = labels.get(INJECT_LABEL).map(String::as_str) == Some("true")
        || target
            .namespace_labels
            .get(INJECT_LABEL)
            .map(String::as_str)
            == Some("enabled");
    if target.selection == Selection::Webhook && !selected {
        return Ok(Mutation::skipped(SkipReason::NotSelected, vec![]));
    }
    let init_names = names(&spec["initContainers"]);
    let container_names = names(&spec["containers"]);
    if container_names.contains(&PROXY_CONTAINER) || init_names.contains(&PROXY_CONTAINER) {
        return Ok(Mutation::skipped(
            SkipReason::NameConflict,
            vec![format!(
                "remora: not injected: the pod already has a container named {PROXY_CONTAINER}"
            )],
        ));
    }
    let workload_ca = workload_ca_wiring(cfg, &annotations)?;
    let our_volumes = sidecar_volumes(workload_ca);
    let volume_names = names(&spec["volumes"]);
    if let Some(v) = our_volumes
        .iter()
        .map(|v| v.name.as_str())
        .find(|v| volume_names.contains(v))
    {
        return Ok(Mutation::skipped(
            SkipReason::NameConflict,
            vec![format!(
                "remora: not injected: the pod already has a volume named {v}"
            )],
        ));
    }

    let mut warnings: Vec<String> = cfg
        .problems
        .iter()
        .map(|p| format!("remora: ignored {p}"))
        .collect();
    let mode = match cfg.mode {
        SidecarMode::Auto if target.native_sidecars => SidecarMode::Native,
        SidecarMode::Auto => SidecarMode::Legacy,
        SidecarMode::Native if !target.native_sidecars => {
            warnings.push(
                "remora: Native mode asked for, but not every node runs Kubernetes >= 1.29; \
                 injected in Legacy mode"
                    .into(),
            );
            SidecarMode::Legacy
        }
        m => m,
    };

    let restart = spec["restartPolicy"].as_str().unwrap_or("Always");
    if mode == SidecarMode::Legacy && restart != "Always" {
        warnings.push(format!(
            "remora: Legacy mode with restartPolicy {restart}: the sidecar is a regular container, \
             so the pod completes only when the operator stops it (remora.dev/stop, serve \
             --stop-completed-jobs) after the app containers exit; Native mode does not need this"
        ));
    }
    if annotations.contains_key(keys::STOP) {
        warnings.push(format!(
            "remora: {} is set at creation: the sidecar stops as soon as it starts (the operator \
             sets this annotation on Job pods whose apps have finished; do not put it in a template)",
            keys::STOP
        ));
    }
    let grace = spec["terminationGracePeriodSeconds"]
        .as_i64()
        .unwrap_or(defaults::GRACE_PERIOD_SECONDS);
    let deadline = drain_deadline(grace);
    if grace > remora_contract::duration::MAX.as_secs() as i64 {
        warnings.push(format!(
            "remora: terminationGracePeriodSeconds {grace} is more than {}: the sidecar's drain \
             deadline is capped at {}",
            remora_contract::duration::MAX_TEXT,
            format_duration(deadline)
        ));
    }
    let (needed, what) = if cfg.exit_on_zero_active_connections {
        (cfg.minimum_drain_duration, "minimumDrainDuration")
    } else {
        (cfg.termination_drain_duration, "terminationDrainDuration")
    };
    if needed > deadline {
        warnings.push(format!(
            "remora: {what} {} does not fit terminationGracePeriodSeconds {grace}: the drain will be \
             cut at {}",
            format_duration(needed),
            format_duration(deadline)
        ));
    }
    for c in containers
        .iter()
        .chain(spec["initContainers"].as_array().into_iter().flatten())
    {
        for p in c["ports"].as_array().into_iter().flatten() {
            let port = p["containerPort"].as_i64().unwrap_or(0);
            if let Some((_, use_)) = SIDECAR_PORTS.iter().find(|(sp, _)| i64::from(*sp) == port) {
                warnings.push(format!(
                    "remora: container {} uses port {port}, which the sidecar uses for {use_}",
                    c["name"].as_str().unwrap_or("?")
                ));
            }
        }
    }

    let lifecycle = lifecycle_annotation(cfg, mode, deadline);
    let mut container = proxy_container(cfg, mode, deadline);
    let plumbing = plumb(
        &mut container,
        &annotations,
        containers,
        (
            workload_ca.is_some(),
            workload_ca.is_some_and(|c| c.discovery.is_some()),
        ),
        &mut warnings,
    )?;
    if let Some(ca) = workload_ca {
        wire_workload_ca(&mut container, ca);
    }
    // Only a pod that can complete may have its sidecar stopped by
    // remora.dev/stop; the API server refuses any other value later.
    let restart_policy = match restart {
        "Never" | "OnFailure" => restart,
        _ => "Always",
    };
    container
        .env
        .get_or_insert_with(Vec::new)
        .push(env(env_name::POD_RESTART_POLICY, restart_policy.into()));
    let config_hash = config_hash(&container, &lifecycle);
    let app_hooks = app_prestop_hooks(containers, &mut warnings);
    let only_in = |m: SidecarMode| {
        if mode == m {
            vec![PROXY_CONTAINER.to_string()]
        } else {
            vec![]
        }
    };
    let status = SidecarStatus {
        version: env!("CARGO_PKG_VERSION").into(),
        mode,
        containers: only_in(SidecarMode::Legacy),
        init_containers: only_in(SidecarMode::Native),
        volumes: our_volumes.iter().map(|v| v.name.clone()).collect(),
        config_hash,
        restart_hash: Some(cfg.restart_hash()),
        sources: cfg.sources.clone(),
        mtls_ports: plumbing.mtls_ports,
        inbound: plumbing.inbound,
    };
    let lifecycle_json = serde_json::to_string(&lifecycle).unwrap_or_default();
    let status_json = serde_json::to_string(&status).unwrap_or_default();

    let mut ops = Vec::new();
    if meta.is_null() {
        ops.push(add(&["metadata"], json!({})));
    }
    if meta["annotations"].is_null() {
        ops.push(add(
            &["metadata", "annotations"],
            json!({ STATUS_ANNOTATION: status_json, LIFECYCLE_ANNOTATION: lifecycle_json }),
        ));
    } else {
        ops.push(add(
            &["metadata", "annotations", STATUS_ANNOTATION],
            Value::String(status_json),
        ));
        ops.push(add(
            &["metadata", "annotations", LIFECYCLE_ANNOTATION],
            Value::String(lifecycle_json),
        ));
    }
    let volumes: Vec<Value> = our_volumes.iter().map(to_json).collect();
    if spec["volumes"].is_null() {
        ops.push(add(&["spec", "volumes"], Value::Array(volumes)));
    } else {
        for v in volumes {
            ops.push(add(&["spec", "volumes", "-"], v));
        }
    }
    // Before the Legacy sidecar goes in at index 0: these indexes are the app's.
    ops.extend(app_hooks);
    let container = to_json(&container);
    match mode {
        SidecarMode::Native if spec["initContainers"].is_null() => {
            ops.push(add(&["spec", "initContainers"], json!([container])));
        }
        // Before the user's init containers, so they can reach the network.
        SidecarMode::Native => ops.push(add(&["spec", "initContainers", "0"], container)),
        _ => ops.push(add(&["spec", "containers", "0"], container)),
    }
    Ok(Mutation {
        patch: Patch(ops),
        outcome: Outcome::Injected(mode),
        warnings,
    })
}

/// The preStop hook of every app container: an `exec` of the helper the
/// sidecar puts in the hook volume (mounted read-only here), which asks the
/// agent over the pod's loopback and returns once inbound traffic has gone
/// quiet (adaptive drain), so the kubelet sends the app SIGTERM only when the
/// load balancer has stopped sending to the pod. Its credential is in that
/// volume, never in the spec: reading a pod must not be enough to drain it.
/// A container with its own preStop keeps it (warned): its SIGTERM does not
/// wait for the drain.
fn app_prestop_hooks(containers: &[Value], warnings: &mut Vec<String>) -> Vec<PatchOperation> {
    let hook = to_json(&exec(&[HOOK_HELPER_PATH]));
    let mount = to_json(&VolumeMount {
        name: HOOK_VOLUME.into(),
        mount_path: HOOK_DIR.into(),
        read_only: Some(true),
        ..Default::default()
    });
    let mut ops = Vec::new();
    for (i, c) in containers.iter().enumerate() {
        let i = i.to_string();
        let name = c["name"].as_str().unwrap_or("?");
        let lifecycle = &c["lifecycle"];
        let mounts = &c["volumeMounts"];
        if !lifecycle["preStop"].is_null() {
            warnings.push(format!(
                "remora: container {name} has its own preStop hook: its SIGTERM does not wait \
                 for the sidecar's drain"
            ));
            continue;
        }
        let taken =
            mounts.as_array().into_iter().flatten().any(|m| {
                m["mountPath"].as_str().map(|p| p.trim_end_matches('/')) == Some(HOOK_DIR)
            });
        if taken || !(mounts.is_null() || mounts.is_array()) {
            warnings.push(format!(
                "remora: container {name} already mounts something at {HOOK_DIR}: no preStop \
                 hook, its SIGTERM does not wait for the sidecar's drain"
            ));
            continue;
        }
        if lifecycle.is_object() {
            ops.push(add(
                &["spec", "containers", &i, "lifecycle", "preStop"],
                hook.clone(),
            ));
        } else {
            ops.push(add(
                &["spec", "containers", &i, "lifecycle"],
                json!({ "preStop": hook }),
            ));
        }
        if mounts.is_null() {
            ops.push(add(
                &["spec", "containers", &i, "volumeMounts"],
                json!([mount]),
            ));
        } else {
            ops.push(add(
                &["spec", "containers", &i, "volumeMounts", "-"],
                mount.clone(),
            ));
        }
    }
    ops
}

/// Serializing these plain k8s structs cannot fail; null rather than a panic if it did.
fn to_json<T: Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

fn config_hash(container: &Container, lifecycle: &LifecycleAnnotation) -> String {
    let mut h = Sha256::new();
    h.update(serde_json::to_vec(container).unwrap_or_default());
    h.update(serde_json::to_vec(lifecycle).unwrap_or_default());
    let digest = h.finalize();
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// The effective lifecycle in the agent's wire shape.
pub fn lifecycle_annotation(
    cfg: &EffectiveConfig,
    mode: SidecarMode,
    deadline: Duration,
) -> LifecycleAnnotation {
    LifecycleAnnotation {
        mode: Some(mode.as_str().to_string()),
        startup: Some(StartupAnnotation {
            hold_application_until_proxy_starts: Some(cfg.hold_application_until_proxy_starts),
            timeout: Some(format_duration(cfg.startup_timeout)),
        }),
        shutdown: Some(ShutdownAnnotation {
            drain_duration: Some(format_duration(cfg.drain_duration)),
            termination_drain_duration: Some(format_duration(cfg.termination_drain_duration)),
            exit_on_zero_active_connections: Some(cfg.exit_on_zero_active_connections),
            minimum_drain_duration: Some(format_duration(cfg.minimum_drain_duration)),
            drain_mode: Some(cfg.drain_mode),
            quiet_period: Some(format_duration(cfg.quiet_period)),
            withdrawal_timeout: Some(format_duration(cfg.withdrawal_timeout)),
        }),
        drain_deadline: Some(format_duration(deadline)),
    }
}
