//! The injection itself: a pure function from a pod (as JSON), where it
//! lives and its effective config to a JSON Patch. No I/O.
//!
//! The pod stays a `serde_json::Value` on purpose: a typed round trip would
//! drop fields this build does not know, and the patch is built from explicit
//! `add` operations, never a diff, so nothing of the user's pod is rewritten.

use std::collections::BTreeMap;
use std::time::Duration;

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, ContainerPort, DownwardAPIVolumeFile,
    DownwardAPIVolumeSource, EmptyDirVolumeSource, EnvVar, EnvVarSource, ExecAction, HTTPGetAction,
    KeyToPath, Lifecycle, LifecycleHandler, ObjectFieldSelector, Probe, ProjectedVolumeSource,
    SeccompProfile, SecurityContext, ServiceAccountTokenProjection, Volume, VolumeMount,
    VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use remora_contract::duration::format as format_duration;
use remora_contract::lifecycle::{
    LifecycleAnnotation, ShutdownAnnotation, SidecarStatus, StartupAnnotation,
};
use remora_contract::pod::{
    HEALTH_PORT, HOOK_DIR, HOOK_HELPER_PATH, HOOK_VOLUME, INBOUND_PORT, PODINFO_DIR,
    PODINFO_VOLUME, PROXY_CONTAINER, PROXY_UID, READY_PATH, RUN_DIR, RUN_VOLUME, SIDECAR_PORTS,
    sidecar_port_use,
};
use remora_contract::traffic::{
    InboundSpec, MAX_LISTENERS, OutboundSpec, OutboundTlsSpec, check_spiffe_id,
};
use remora_contract::{annotations as keys, defaults, env as env_name, workload_ca};
use remora_crds::SidecarMode;
use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::resolve::{EffectiveConfig, WorkloadCaWiring};

// Names other modules of the injector use; they are the contract's.
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
    let mut our_volumes = vec![RUN_VOLUME, PODINFO_VOLUME, HOOK_VOLUME];
    if workload_ca.is_some() {
        our_volumes.extend([workload_ca::TOKEN_VOLUME, workload_ca::TRUST_BUNDLE_VOLUME]);
    }
    let volume_names = names(&spec["volumes"]);
    if let Some(v) = our_volumes
        .iter()
        .copied()
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
    let plumbed = plumb_traffic(&mut container, &annotations, containers, &mut warnings)?;
    plumb_tls(
        &mut container,
        &annotations,
        &plumbed,
        workload_ca.is_some(),
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
        volumes: our_volumes.iter().map(|v| v.to_string()).collect(),
        config_hash,
        restart_hash: Some(cfg.restart_hash()),
        sources: cfg.sources.clone(),
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
    let mut volumes = vec![run_volume(), podinfo_volume(), hook_volume()];
    if workload_ca.is_some() {
        volumes.extend([token_volume(), trust_bundle_volume()]);
    }
    let volumes: Vec<Value> = volumes.iter().map(to_json).collect();
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

/// A pod whose traffic annotations would turn the sidecar against itself
/// (publish Envoy's admin API, loop through the sidecar, bind a port twice)
/// or ask for more listeners than a sidecar is for: refused, never injected
/// as asked and never silently injected without them.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlumbingError {
    #[error("{key} entry {entry:?}: listener port {port} is the sidecar's own ({use_})")]
    ReservedListener {
        key: &'static str,
        entry: String,
        port: u16,
        use_: &'static str,
    },
    #[error("{key} entry {entry:?}: target port {port} is the sidecar's own ({use_})")]
    ReservedTarget {
        key: &'static str,
        entry: String,
        port: u16,
        use_: &'static str,
    },
    #[error("{key} entry {entry:?}: listener port {port} is already taken by {first:?}")]
    Duplicate {
        key: &'static str,
        entry: String,
        port: u16,
        first: String,
    },
    #[error("{key} lists {count} entries; at most {max} are accepted")]
    TooMany {
        key: &'static str,
        count: usize,
        max: usize,
    },
    #[error("{key}: {reason}")]
    BadValue { key: &'static str, reason: String },
    #[error(
        "{key} entry {entry:?}: port {port} is not a listener of {}",
        keys::OUTBOUND
    )]
    NotOutbound {
        key: &'static str,
        entry: String,
        port: u16,
    },
    #[error("{key} entry {entry:?}: port {port} is already given by {first:?}")]
    TlsTwice {
        key: &'static str,
        entry: String,
        port: u16,
        first: String,
    },
}

/// One static listener the sidecar will get.
struct Listener {
    inbound: bool,
    /// Where it comes from, for messages: the annotation, or the default.
    key: &'static str,
    entry: String,
    port: u16,
    /// The port it forwards to when that is on this pod.
    local_target: Option<u16>,
}

/// Reads one entry: its listener port and, when on this pod, its target port.
type ParseEntry = dyn Fn(&str) -> Result<(u16, Option<u16>), String>;

/// The entries of one traffic annotation: at most [`MAX_LISTENERS`]; those
/// the agent would refuse to parse are dropped with a warning, so a typo
/// never gives a sidecar that cannot start.
fn listeners(
    key: &'static str,
    raw: &str,
    parse: &ParseEntry,
    warnings: &mut Vec<String>,
) -> Result<Vec<Listener>, PlumbingError> {
    let items: Vec<&str> = raw
        .split(',')
        .map(str::trim)
        .filter(|i| !i.is_empty())
        .collect();
    if items.len() > MAX_LISTENERS {
        return Err(PlumbingError::TooMany {
            key,
            count: items.len(),
            max: MAX_LISTENERS,
        });
    }
    let mut kept = Vec::new();
    for item in items {
        match parse(item) {
            Ok((port, local_target)) => kept.push(Listener {
                inbound: key == keys::INBOUND,
                key,
                entry: item.to_string(),
                port,
                local_target,
            }),
            Err(e) => warnings.push(format!("remora: ignored {key} entry {item:?}: {e}")),
        }
    }
    Ok(kept)
}

/// Sidecar ports an outbound (loopback) listener may forward to.
const OUTBOUND_MAY_TARGET: [u16; 2] = [HEALTH_PORT, remora_contract::pod::STATS_PORT];

/// Refuse listeners on the sidecar's own ports or on a port taken twice,
/// and forwarding (on this pod) to the sidecar's ports or its listeners.
fn check_listeners(all: &[Listener]) -> Result<(), PlumbingError> {
    let mut taken: BTreeMap<u16, &Listener> = BTreeMap::new();
    for l in all {
        // 15006 is the inbound listener's own: taken only by a duplicate.
        if let Some(use_) = sidecar_port_use(l.port).filter(|_| l.port != INBOUND_PORT) {
            return Err(PlumbingError::ReservedListener {
                key: l.key,
                entry: l.entry.clone(),
                port: l.port,
                use_,
            });
        }
        if let Some(first) = taken.insert(l.port, l) {
            return Err(PlumbingError::Duplicate {
                key: l.key,
                entry: l.entry.clone(),
                port: l.port,
                first: first.entry.clone(),
            });
        }
    }
    for l in all {
        let Some(port) = l.local_target else { continue };
        // An outbound listener is bound on loopback: one onto the health or
        // stats port (served on every address anyway) exposes nothing, and
        // lets an app wait, through Envoy, until its sidecar is ready.
        if !l.inbound && OUTBOUND_MAY_TARGET.contains(&port) {
            continue;
        }
        let use_ = sidecar_port_use(port).or_else(|| {
            taken
                .contains_key(&port)
                .then_some("a static listener of this pod")
        });
        if let Some(use_) = use_ {
            return Err(PlumbingError::ReservedTarget {
                key: l.key,
                entry: l.entry.clone(),
                port,
                use_,
            });
        }
    }
    Ok(())
}

/// Give the sidecar its static-mode listeners: inbound from the pod's
/// `remora.dev/inbound` annotation or, by default, 15006 in front of the first
/// TCP port of the first app container; outbound from `remora.dev/outbound`.
fn plumb_traffic(
    container: &mut Container,
    annotations: &BTreeMap<String, String>,
    app_containers: &[Value],
    warnings: &mut Vec<String>,
) -> Result<Plumbed, PlumbingError> {
    let inbound_port = |item: &str| {
        item.parse::<InboundSpec>()
            .map(|s| (s.port.unwrap_or(INBOUND_PORT), Some(s.app_port)))
    };
    let inbound = match annotations.get(keys::INBOUND) {
        Some(raw) => listeners(keys::INBOUND, raw, &inbound_port, warnings)?,
        None => {
            // Never the sidecar's own ports: an app port among them was
            // warned about, and forwarding to it would loop or publish admin.
            let app_port = app_containers
                .first()
                .and_then(|c| c["ports"].as_array())
                .into_iter()
                .flatten()
                .filter(|p| p["protocol"].as_str().unwrap_or("TCP") == "TCP")
                .filter_map(|p| p["containerPort"].as_u64())
                .filter_map(|p| u16::try_from(p).ok())
                .find(|p| *p != 0 && sidecar_port_use(*p).is_none());
            app_port
                .map(|p| Listener {
                    inbound: true,
                    key: "the default inbound listener",
                    entry: format!("{INBOUND_PORT}:{p}"),
                    port: INBOUND_PORT,
                    local_target: Some(p),
                })
                .into_iter()
                .collect()
        }
    };
    let outbound_port = |item: &str| {
        item.parse::<OutboundSpec>()
            .map(|s| (s.port, s.targets_this_pod().then_some(s.upstream_port)))
    };
    let outbound = match annotations.get(keys::OUTBOUND) {
        Some(raw) => listeners(keys::OUTBOUND, raw, &outbound_port, warnings)?,
        None => Vec::new(),
    };
    let all: Vec<Listener> = inbound.into_iter().chain(outbound).collect();
    check_listeners(&all)?;
    let join = |inbound: bool| {
        all.iter()
            .filter(|l| l.inbound == inbound)
            .map(|l| l.entry.as_str())
            .collect::<Vec<_>>()
            .join(",")
    };
    let (inbound, outbound) = (join(true), join(false));
    let vars = container.env.get_or_insert_with(Vec::new);
    if !inbound.is_empty() {
        vars.push(env(env_name::INBOUND, inbound));
    }
    if !outbound.is_empty() {
        vars.push(env(env_name::OUTBOUND, outbound));
    }
    let ports = container.ports.get_or_insert_with(Vec::new);
    let inbound_ports = all.iter().filter(|l| l.inbound);
    for (i, l) in inbound_ports.enumerate() {
        ports.push(ContainerPort {
            // Port names are at most 15 characters.
            name: Some(if i == 0 {
                remora_contract::pod::INBOUND_PORT_NAME.into()
            } else {
                format!("remora-in-{i}")
            }),
            container_port: i32::from(l.port),
            protocol: Some("TCP".into()),
            ..Default::default()
        });
    }
    Ok(Plumbed {
        has_inbound: all.iter().any(|l| l.inbound),
        outbound_ports: all.iter().filter(|l| !l.inbound).map(|l| l.port).collect(),
    })
}

/// The static listeners the sidecar got, as the TLS annotations need them.
struct Plumbed {
    has_inbound: bool,
    outbound_ports: Vec<u16>,
}

/// Whether the sidecar gets the workload CA: the chart enables it and the
/// pod does not say `remora.dev/workload-ca: "false"`. A value that is not a
/// boolean is refused: guessing would hand out (or withhold) an identity.
fn workload_ca_wiring<'c>(
    cfg: &'c EffectiveConfig,
    annotations: &BTreeMap<String, String>,
) -> Result<Option<&'c WorkloadCaWiring>, PlumbingError> {
    let wanted = match annotations.get(keys::WORKLOAD_CA) {
        Some(v) => {
            remora_contract::value::parse_bool(v).map_err(|reason| PlumbingError::BadValue {
                key: keys::WORKLOAD_CA,
                reason,
            })?
        }
        None => true,
    };
    Ok(cfg.workload_ca.as_ref().filter(|_| wanted))
}

/// The static-mode mTLS annotations, checked against the listeners the
/// sidecar got: `remora.dev/inbound-tls` (`true`, or the SPIFFE IDs allowed
/// to call) and `remora.dev/outbound-tls` (`PORT=SPIFFE_ID,...`, each PORT an
/// outbound listener, at most once). Anything else is refused: a pod that
/// asked for mTLS must not start without it.
fn plumb_tls(
    container: &mut Container,
    annotations: &BTreeMap<String, String>,
    plumbed: &Plumbed,
    ca_wired: bool,
    warnings: &mut Vec<String>,
) -> Result<(), PlumbingError> {
    let items = |raw: &str| -> Vec<String> {
        raw.split(',')
            .map(str::trim)
            .filter(|i| !i.is_empty())
            .map(str::to_string)
            .collect()
    };
    let mut asked = Vec::new();
    let mut vars = Vec::new();
    if let Some(raw) = annotations.get(keys::INBOUND_TLS) {
        let sans = match remora_contract::value::parse_bool(raw) {
            Ok(false) => None,
            Ok(true) => Some(Vec::new()),
            Err(_) => {
                let ids = items(raw);
                if ids.len() > MAX_LISTENERS {
                    return Err(PlumbingError::TooMany {
                        key: keys::INBOUND_TLS,
                        count: ids.len(),
                        max: MAX_LISTENERS,
                    });
                }
                for id in &ids {
                    check_spiffe_id(id).map_err(|e| PlumbingError::BadValue {
                        key: keys::INBOUND_TLS,
                        reason: format!("expected true, false or SPIFFE IDs: {e}"),
                    })?;
                }
                Some(ids)
            }
        };
        if let Some(sans) = sans {
            asked.push(keys::INBOUND_TLS);
            if !plumbed.has_inbound {
                warnings.push(format!(
                    "remora: {} is set but the sidecar has no inbound listener",
                    keys::INBOUND_TLS
                ));
            }
            vars.push(env(env_name::INBOUND_TLS, "true".into()));
            if !sans.is_empty() {
                vars.push(env(env_name::INBOUND_TLS_SAN, sans.join(",")));
            }
        }
    }
    if let Some(raw) = annotations.get(keys::OUTBOUND_TLS) {
        let entries = items(raw);
        let mut given: BTreeMap<u16, &str> = BTreeMap::new();
        for entry in &entries {
            let spec = entry
                .parse::<OutboundTlsSpec>()
                .map_err(|e| PlumbingError::BadValue {
                    key: keys::OUTBOUND_TLS,
                    reason: format!("entry {entry:?}: {e}"),
                })?;
            if !plumbed.outbound_ports.contains(&spec.port) {
                return Err(PlumbingError::NotOutbound {
                    key: keys::OUTBOUND_TLS,
                    entry: entry.clone(),
                    port: spec.port,
                });
            }
            if let Some(first) = given.insert(spec.port, entry) {
                return Err(PlumbingError::TlsTwice {
                    key: keys::OUTBOUND_TLS,
                    entry: entry.clone(),
                    port: spec.port,
                    first: first.to_string(),
                });
            }
        }
        if !entries.is_empty() {
            asked.push(keys::OUTBOUND_TLS);
            vars.push(env(env_name::OUTBOUND_TLS, entries.join(",")));
        }
    }
    if !ca_wired && let Some(key) = asked.first() {
        // Not refused: certificates may come from a mounted --cert-dir.
        warnings.push(format!(
            "remora: {key} without the workload CA (not enabled, or {} is \"false\"): the \
             sidecar needs its certificates in its --cert-dir",
            keys::WORKLOAD_CA
        ));
    }
    container.env.get_or_insert_with(Vec::new).extend(vars);
    Ok(())
}

/// Point the sidecar at the workload CA: its address and trust domain, the
/// projected token it proves its service account with, and the trust bundle
/// that verifies the CA (and, in mTLS, its peers).
fn wire_workload_ca(container: &mut Container, ca: &WorkloadCaWiring) {
    container.env.get_or_insert_with(Vec::new).extend([
        env(env_name::CA_ADDRESS, ca.address.clone()),
        env(
            env_name::CA_ROOT_CERT,
            workload_ca::TRUST_BUNDLE_PATH.into(),
        ),
        env(env_name::TOKEN_PATH, workload_ca::TOKEN_PATH.into()),
        env(env_name::TRUST_DOMAIN, ca.trust_domain.clone()),
        env(env_name::CERT_TTL, format_duration(ca.cert_ttl)),
    ]);
    if let Some(name) = &ca.server_name {
        container
            .env
            .get_or_insert_with(Vec::new)
            .push(env(env_name::CA_SERVER_NAME, name.clone()));
    }
    container
        .volume_mounts
        .get_or_insert_with(Vec::new)
        .extend([
            VolumeMount {
                name: workload_ca::TOKEN_VOLUME.into(),
                mount_path: workload_ca::TOKEN_DIR.into(),
                read_only: Some(true),
                ..Default::default()
            },
            VolumeMount {
                name: workload_ca::TRUST_BUNDLE_VOLUME.into(),
                mount_path: workload_ca::TRUST_BUNDLE_DIR.into(),
                read_only: Some(true),
                ..Default::default()
            },
        ]);
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
        }),
        drain_deadline: Some(format_duration(deadline)),
    }
}

fn field_env(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn env(name: &str, value: String) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value),
        ..Default::default()
    }
}

fn ready_probe() -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(READY_PATH.into()),
            port: IntOrString::Int(i32::from(HEALTH_PORT)),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn exec(cmd: &[&str]) -> LifecycleHandler {
    LifecycleHandler {
        exec: Some(ExecAction {
            command: Some(cmd.iter().map(|s| s.to_string()).collect()),
        }),
        ..Default::default()
    }
}

/// The `remora-proxy` container for the chosen (concrete) mode.
pub fn proxy_container(cfg: &EffectiveConfig, mode: SidecarMode, deadline: Duration) -> Container {
    let d = format_duration;
    let startup_timeout = d(cfg.startup_timeout);
    let env = vec![
        field_env(env_name::POD_NAME, "metadata.name"),
        field_env(env_name::POD_NAMESPACE, "metadata.namespace"),
        field_env(env_name::INSTANCE_IP, "status.podIP"),
        field_env(env_name::SERVICE_ACCOUNT, "spec.serviceAccountName"),
        env(env_name::CONCURRENCY, cfg.concurrency.to_string()),
        env(env_name::LOG_LEVEL, cfg.log_level.as_str().to_string()),
        env(env_name::DRAIN_DURATION, d(cfg.drain_duration)),
        env(
            env_name::TERMINATION_DRAIN_DURATION,
            d(cfg.termination_drain_duration),
        ),
        env(
            env_name::EXIT_ON_ZERO_ACTIVE_CONNECTIONS,
            cfg.exit_on_zero_active_connections.to_string(),
        ),
        env(
            env_name::MINIMUM_DRAIN_DURATION,
            d(cfg.minimum_drain_duration),
        ),
        env(env_name::DRAIN_MODE, cfg.drain_mode.as_str().to_string()),
        env(env_name::QUIET_PERIOD, d(cfg.quiet_period)),
        env(env_name::DRAIN_DEADLINE, d(deadline)),
        env(env_name::RUN_DIR, RUN_DIR.into()),
        env(
            env_name::ANNOTATIONS_FILE,
            remora_contract::pod::ANNOTATIONS_FILE.into(),
        ),
        env(env_name::HOOK_DIR, HOOK_DIR.into()),
    ];
    let mut c = Container {
        name: PROXY_CONTAINER.into(),
        image: Some(cfg.image.clone()),
        image_pull_policy: Some(cfg.image_pull_policy.clone()),
        command: Some(vec!["remora-agent".into()]),
        args: Some(vec!["run".into()]),
        env: Some(env),
        ports: Some(vec![
            ContainerPort {
                name: Some(remora_contract::pod::HEALTH_PORT_NAME.into()),
                container_port: i32::from(HEALTH_PORT),
                protocol: Some("TCP".into()),
                ..Default::default()
            },
            ContainerPort {
                name: Some(remora_contract::pod::STATS_PORT_NAME.into()),
                container_port: i32::from(remora_contract::pod::STATS_PORT),
                protocol: Some("TCP".into()),
                ..Default::default()
            },
        ]),
        readiness_probe: Some(Probe {
            period_seconds: Some(2),
            timeout_seconds: Some(1),
            failure_threshold: Some(3),
            ..ready_probe()
        }),
        resources: Some(cfg.resources.clone()),
        security_context: Some(SecurityContext {
            run_as_user: Some(PROXY_UID),
            run_as_group: Some(PROXY_UID),
            run_as_non_root: Some(true),
            read_only_root_filesystem: Some(true),
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Default::default()
            }),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        volume_mounts: Some(vec![
            VolumeMount {
                name: RUN_VOLUME.into(),
                mount_path: RUN_DIR.into(),
                ..Default::default()
            },
            VolumeMount {
                name: PODINFO_VOLUME.into(),
                mount_path: PODINFO_DIR.into(),
                read_only: Some(true),
                ..Default::default()
            },
            VolumeMount {
                name: HOOK_VOLUME.into(),
                mount_path: HOOK_DIR.into(),
                ..Default::default()
            },
        ]),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        ..Default::default()
    };
    match mode {
        SidecarMode::Native => {
            c.restart_policy = Some("Always".into());
            if cfg.hold_application_until_proxy_starts {
                // The kubelet starts the next container only once this probe
                // passes: its budget (period x threshold) is startup.timeout.
                let secs = cfg.startup_timeout.as_secs().max(1);
                c.startup_probe = Some(Probe {
                    period_seconds: Some(1),
                    timeout_seconds: Some(1),
                    failure_threshold: Some(i32::try_from(secs).unwrap_or(i32::MAX)),
                    ..ready_probe()
                });
            }
        }
        _ => {
            c.lifecycle = Some(Lifecycle {
                // The kubelet runs the next container only after this hook
                // returns: that is what holds the application.
                post_start: cfg
                    .hold_application_until_proxy_starts
                    .then(|| exec(&["remora-agent", "wait", "--timeout", &startup_timeout])),
                pre_stop: Some(exec(&["remora-agent", "drain", "--timeout", &d(deadline)])),
                ..Default::default()
            });
        }
    }
    c
}

/// The app hook's volume: the helper binary and the file with its token,
/// written by the sidecar at start. On disk (the helper is not small), not
/// counted against the pod's memory.
fn hook_volume() -> Volume {
    Volume {
        name: HOOK_VOLUME.into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    }
}

fn run_volume() -> Volume {
    Volume {
        name: RUN_VOLUME.into(),
        empty_dir: Some(EmptyDirVolumeSource {
            medium: Some("Memory".into()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The pod's service-account token for the CA only: its audience is one
/// the API server (and everything else) refuses, and the kubelet renews it.
/// Projected, so it is there even with `automountServiceAccountToken: false`.
fn token_volume() -> Volume {
    Volume {
        name: workload_ca::TOKEN_VOLUME.into(),
        projected: Some(ProjectedVolumeSource {
            sources: Some(vec![VolumeProjection {
                service_account_token: Some(ServiceAccountTokenProjection {
                    audience: Some(workload_ca::TOKEN_AUDIENCE.into()),
                    expiration_seconds: Some(workload_ca::TOKEN_EXPIRATION_SECONDS),
                    path: workload_ca::TOKEN_FILE.into(),
                }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The namespace's trust-bundle ConfigMap. Not optional: the pod waits for
/// it rather than start a sidecar that cannot verify the CA.
fn trust_bundle_volume() -> Volume {
    Volume {
        name: workload_ca::TRUST_BUNDLE_VOLUME.into(),
        config_map: Some(ConfigMapVolumeSource {
            name: workload_ca::TRUST_BUNDLE_CONFIGMAP.into(),
            items: Some(vec![KeyToPath {
                key: workload_ca::TRUST_BUNDLE_KEY.into(),
                path: workload_ca::TRUST_BUNDLE_KEY.into(),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn podinfo_volume() -> Volume {
    Volume {
        name: PODINFO_VOLUME.into(),
        downward_api: Some(DownwardAPIVolumeSource {
            items: Some(vec![DownwardAPIVolumeFile {
                path: "annotations".into(),
                field_ref: Some(ObjectFieldSelector {
                    field_path: "metadata.annotations".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}
