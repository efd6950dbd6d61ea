//! Offline injection for GitOps: multi-document YAML in, injected YAML out,
//! through the same [`mutate`](crate::patch::mutate()) as the webhook.
//!
//! Documents that are not workloads, or that are not changed, are written
//! back byte for byte, comments included; only injected documents are
//! re-rendered.

use std::collections::BTreeMap;

use remora_crds::{SidecarLifecycle, SidecarMode};
use serde_json::{Value, json};

use crate::patch::{Outcome, Selection, Target, mutate, pod_meta};
use crate::resolve::{ChartDefaults, EffectiveConfig};

#[derive(Debug, thiserror::Error)]
pub enum OfflineError {
    #[error("document {index}: invalid YAML: {reason}")]
    Yaml { index: usize, reason: String },
    #[error("document {index}: {reason}")]
    Workload { index: usize, reason: String },
    #[error("--config: {0}")]
    Config(String),
    #[error("cannot render document {index} as YAML: {reason}")]
    Render { index: usize, reason: String },
}

/// Settings of one offline run.
#[derive(Debug, Clone)]
pub struct OfflineOptions {
    pub chart: ChartDefaults,
    /// A `SidecarLifecycle` applied over the chart defaults.
    pub lifecycle: Option<SidecarLifecycle>,
    /// `--mode`, over the config file; the pod's own annotation still wins.
    pub mode: Option<SidecarMode>,
    /// Whether the target cluster runs native sidecars (decides `Auto`).
    pub native_sidecars: bool,
}

impl Default for OfflineOptions {
    fn default() -> Self {
        Self {
            chart: ChartDefaults::default(),
            lifecycle: None,
            mode: None,
            native_sidecars: true,
        }
    }
}

/// Parse a `SidecarLifecycle` from YAML (for `--config`).
pub fn parse_lifecycle(yaml: &str) -> Result<SidecarLifecycle, OfflineError> {
    let value: serde_json::Value =
        serde_saphyr::from_str(yaml).map_err(|e| OfflineError::Config(e.to_string()))?;
    if value["kind"] != "SidecarLifecycle" {
        return Err(OfflineError::Config(
            "the file is not a SidecarLifecycle".into(),
        ));
    }
    serde_json::from_value(value).map_err(|e| OfflineError::Config(e.to_string()))
}

/// What one run did, for the caller's summary and warnings.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Report {
    pub documents: usize,
    pub injected: usize,
    pub warnings: Vec<String>,
}

/// Split a YAML stream into documents: a line starting with `---` (or a
/// `...` end marker) at column 0 always separates documents in YAML.
pub fn split_documents(input: &str) -> Vec<&str> {
    let mut docs = Vec::new();
    let mut start = 0;
    let mut pos = 0;
    for line in input.split_inclusive('\n') {
        let bare = line.trim_end_matches(['\n', '\r']);
        let is_marker = |m: &str| {
            bare == m
                || bare
                    .strip_prefix(m)
                    .is_some_and(|r| r.starts_with([' ', '\t']))
        };
        if is_marker("---") || is_marker("...") {
            docs.push(&input[start..pos]);
            start = pos + line.len();
        }
        pos += line.len();
    }
    docs.push(&input[start..]);
    // Keep only documents with content (not just comments and blanks), but
    // remember there were separators: the caller re-joins with `---`.
    docs.into_iter()
        .filter(|d| {
            d.lines().any(|l| {
                let t = l.trim();
                !t.is_empty() && !t.starts_with('#')
            })
        })
        .collect()
}

/// Inject every workload of a YAML stream.
pub fn inject_stream(input: &str, opts: &OfflineOptions) -> Result<(String, Report), OfflineError> {
    let mut out = String::new();
    let mut report = Report::default();
    for (index, doc) in split_documents(input).into_iter().enumerate() {
        report.documents += 1;
        let mut value: Value = serde_saphyr::from_str(doc).map_err(|e| OfflineError::Yaml {
            index,
            reason: e.to_string(),
        })?;
        let changed = inject_object(&mut value, opts, &mut report)
            .map_err(|reason| OfflineError::Workload { index, reason })?;
        out.push_str("---\n");
        if changed {
            out.push_str(
                &serde_saphyr::to_string(&value).map_err(|e| OfflineError::Render {
                    index,
                    reason: e.to_string(),
                })?,
            );
        } else {
            out.push_str(doc);
            if !doc.ends_with('\n') {
                out.push('\n');
            }
        }
    }
    Ok((out, report))
}

/// Inject one object (a workload, a Pod or a List) in place. `Ok(true)` when
/// it changed.
pub fn inject_object(
    obj: &mut Value,
    opts: &OfflineOptions,
    report: &mut Report,
) -> Result<bool, String> {
    let kind = obj["kind"].as_str().unwrap_or_default().to_string();
    let api_version = obj["apiVersion"].as_str().unwrap_or_default().to_string();
    let label = format!("{kind}/{}", obj_name(obj).unwrap_or_default());
    let namespace = obj["metadata"]["namespace"]
        .as_str()
        .unwrap_or("default")
        .to_string();
    let path: &[&str] = match (api_version.as_str(), kind.as_str()) {
        ("v1", "Pod") => &[],
        ("apps/v1", "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet")
        | ("batch/v1", "Job") => &["spec", "template"],
        ("batch/v1", "CronJob") => &["spec", "jobTemplate", "spec", "template"],
        ("v1", "List") => {
            let mut changed = false;
            if let Some(items) = obj["items"].as_array_mut() {
                for item in items {
                    changed |= inject_object(item, opts, report)?;
                }
            }
            return Ok(changed);
        }
        _ => return Ok(false),
    };
    let mut slot = &mut *obj;
    for key in path {
        slot = slot
            .get_mut(*key)
            .ok_or_else(|| format!("{kind}: {} is missing", path.join(".")))?;
    }
    // A template has only metadata and spec; treat it as the pod it makes.
    let mut pod = if path.is_empty() {
        slot.clone()
    } else {
        json!({
            "metadata": slot.get("metadata").cloned().unwrap_or_else(|| json!({})),
            "spec": slot.get("spec").cloned().unwrap_or(Value::Null),
        })
    };
    let (_, annotations) = pod_meta(&pod);
    let mut cfg = EffectiveConfig::from_defaults(&opts.chart);
    if let Some(slc) = &opts.lifecycle {
        let src = format!(
            "config:{}",
            slc.metadata.name.as_deref().unwrap_or("sidecarlifecycle")
        );
        cfg.apply_spec(&slc.spec, &src);
    }
    if let Some(m) = opts.mode {
        cfg.mode = m;
        cfg.sources.push("flag:--mode".into());
    }
    cfg.apply_annotations(&annotations);
    let ns_labels = BTreeMap::new();
    let target = Target {
        namespace: &namespace,
        namespace_labels: &ns_labels,
        native_sidecars: opts.native_sidecars,
        selection: Selection::Offline,
    };
    let m = mutate(&pod, &target, &cfg).map_err(|e| format!("{label}: {e}"))?;
    report
        .warnings
        .extend(m.warnings.iter().map(|w| format!("{label}: {w}")));
    if !matches!(m.outcome, Outcome::Injected(_)) {
        return Ok(false);
    }
    json_patch::patch(&mut pod, &m.patch).map_err(|e| format!("{label}: {e}"))?;
    if path.is_empty() {
        *slot = pod;
    } else if let (Some(t), Value::Object(mut p)) = (slot.as_object_mut(), pod) {
        for key in ["metadata", "spec"] {
            if let Some(v) = p.remove(key) {
                t.insert(key.to_string(), v);
            }
        }
    }
    report.injected += 1;
    Ok(true)
}

fn obj_name(v: &Value) -> Option<String> {
    v["metadata"]["name"].as_str().map(str::to_string)
}
