//! Lifecycle settings that can change while the pod runs.
//!
//! The injector writes the effective lifecycle of a pod into the annotation
//! `remora.dev/lifecycle` (JSON, [`LifecycleAnnotation`]) and the controller
//! patches it when a `SidecarLifecycle` changes. The agent sees the pod's
//! annotations through a downward-API file and reads it at the moment a
//! setting is used, so a change reaches a running pod without a restart.
//! Per-field annotations `remora.dev/<kebab-case-field>` win over the JSON.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::{RunConfig, parse_bool, parse_duration};

/// The annotation holding the effective lifecycle as JSON.
pub const LIFECYCLE_ANNOTATION: &str = "remora.dev/lifecycle";
/// Per-field annotation keys the agent honours, strongest of all.
pub const DRAIN_DURATION_ANNOTATION: &str = "remora.dev/drain-duration";
pub const TERMINATION_DRAIN_DURATION_ANNOTATION: &str = "remora.dev/termination-drain-duration";
pub const EXIT_ON_ZERO_ANNOTATION: &str = "remora.dev/exit-on-zero-active-connections";
pub const MINIMUM_DRAIN_DURATION_ANNOTATION: &str = "remora.dev/minimum-drain-duration";
/// Set by the operator on a Legacy-mode pod of a Job (restartPolicy Never or
/// OnFailure) once every app container has terminated: the sidecar stops
/// Envoy and exits 0 so that the pod completes. Its presence is the request;
/// the value (JSON, [`StopRequest`]) only says who asked and when.
pub const STOP_ANNOTATION: &str = "remora.dev/stop";

/// The value of [`STOP_ANNOTATION`] as the operator writes it. Informational:
/// any value, even one that does not parse, is a stop request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StopRequest {
    /// Why, e.g. `AppsCompleted`.
    pub reason: String,
    /// When the operator asked (RFC 3339).
    pub at: String,
}

#[derive(Debug, thiserror::Error)]
pub enum LifecycleError {
    #[error("line {line}: {reason}")]
    Syntax { line: usize, reason: String },
}

/// `remora.dev/lifecycle`: the wire shape shared with the injector. Durations
/// are strings such as `45s`; absent fields keep the agent's own setting.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LifecycleAnnotation {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup: Option<StartupAnnotation>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown: Option<ShutdownAnnotation>,
    /// Hard bound of the drain (the injector derives it from the grace period).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_deadline: Option<String>,
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
}

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
        }
    }

    /// Apply the pod's annotations over these settings. Each bad value is
    /// reported and skipped; the others still apply.
    pub fn with_annotations(mut self, ann: &BTreeMap<String, String>) -> (Self, Vec<String>) {
        let mut problems = Vec::new();
        let dur = |key: &str, raw: &str, slot: &mut Duration| {
            parse_duration(raw)
                .map(|d| *slot = d)
                .map_err(|e| format!("{key}: {e}"))
                .err()
        };
        if let Some(raw) = ann.get(LIFECYCLE_ANNOTATION) {
            match serde_json::from_str::<LifecycleAnnotation>(raw) {
                Ok(l) => {
                    if let Some(s) = l.shutdown {
                        if let Some(v) = s.drain_duration {
                            problems.extend(dur(
                                "shutdown.drainDuration",
                                &v,
                                &mut self.drain_duration,
                            ));
                        }
                        if let Some(v) = s.termination_drain_duration {
                            problems.extend(dur(
                                "shutdown.terminationDrainDuration",
                                &v,
                                &mut self.termination_drain_duration,
                            ));
                        }
                        if let Some(v) = s.minimum_drain_duration {
                            problems.extend(dur(
                                "shutdown.minimumDrainDuration",
                                &v,
                                &mut self.minimum_drain_duration,
                            ));
                        }
                        if let Some(v) = s.exit_on_zero_active_connections {
                            self.exit_on_zero_active_connections = v;
                        }
                    }
                    if let Some(v) = l.drain_deadline {
                        problems.extend(dur("drainDeadline", &v, &mut self.drain_deadline));
                    }
                }
                Err(e) => problems.push(format!("{LIFECYCLE_ANNOTATION}: {e}")),
            }
        }
        let mut dur_problems = Vec::new();
        for (key, slot) in [
            (DRAIN_DURATION_ANNOTATION, &mut self.drain_duration),
            (
                TERMINATION_DRAIN_DURATION_ANNOTATION,
                &mut self.termination_drain_duration,
            ),
            (
                MINIMUM_DRAIN_DURATION_ANNOTATION,
                &mut self.minimum_drain_duration,
            ),
        ] {
            if let Some(raw) = ann.get(key) {
                dur_problems.extend(dur(key, raw, slot));
            }
        }
        if let Some(raw) = ann.get(EXIT_ON_ZERO_ANNOTATION) {
            match parse_bool(raw) {
                Ok(b) => self.exit_on_zero_active_connections = b,
                Err(e) => problems.push(format!("{EXIT_ON_ZERO_ANNOTATION}: {e}")),
            }
        }
        problems.extend(dur_problems);
        (self, problems)
    }
}

/// Where live settings come from: the flags, overlaid with the annotations
/// file when it exists. Read at each use; a broken file never loses the flags.
#[derive(Debug, Clone)]
pub struct LiveSettings {
    base: DrainSettings,
    annotations_file: std::path::PathBuf,
}

impl LiveSettings {
    pub fn new(cfg: &RunConfig) -> Self {
        Self {
            base: DrainSettings::from_config(cfg),
            annotations_file: cfg.annotations_file.clone(),
        }
    }

    /// The settings in force now; bad annotations are logged and skipped.
    pub fn current(&self) -> DrainSettings {
        let (settings, problems) = self.current_quiet();
        for p in problems {
            tracing::warn!(file = %self.annotations_file.display(), problem = %p,
                "ignoring a bad lifecycle annotation");
        }
        settings
    }

    /// The settings in force now, and what was wrong with the annotations,
    /// without logging (for callers that poll).
    pub fn current_quiet(&self) -> (DrainSettings, Vec<String>) {
        match read_annotations_file(&self.annotations_file) {
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

/// Read a downward-API annotations file. `Ok(None)` when it does not exist.
pub fn read_annotations_file(
    path: &Path,
) -> Result<Option<BTreeMap<String, String>>, std::io::Error> {
    match std::fs::read_to_string(path) {
        Ok(text) => parse_annotations(&text)
            .map(Some)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Parse the kubelet's downward-API format: one `key="value"` a line, the
/// value quoted the way Go's `strconv.Quote` does.
pub fn parse_annotations(text: &str) -> Result<BTreeMap<String, String>, LifecycleError> {
    let mut out = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let err = |reason: &str| LifecycleError::Syntax {
            line: i + 1,
            reason: reason.to_string(),
        };
        let (key, value) = line.split_once('=').ok_or_else(|| err("no '='"))?;
        let value = unquote_go(value).map_err(|r| err(&r))?;
        out.insert(key.to_string(), value);
    }
    Ok(out)
}

/// The value of [`STOP_ANNOTATION`] in a downward-API annotations file, if
/// the line is there. Looked up line by line, apart from the rest of the
/// file, so that a line this parser cannot read never hides a stop request
/// (which would leave a Job's pod running forever); a value that does not
/// unquote is returned raw: the presence of the key is what counts.
pub fn stop_request(text: &str) -> Option<String> {
    let prefix = format!("{STOP_ANNOTATION}=");
    text.lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix(&prefix))
        .map(|v| unquote_go(v).unwrap_or_else(|_| v.to_string()))
}

/// Whether the pod's `remora.dev/lifecycle` says this sidecar is a native
/// one (an init container with `restartPolicy: Always`): the kubelet stops
/// those itself once the apps are done, and one that exited on its own would
/// only be restarted. Unreadable or absent: not native.
pub fn runs_native(text: &str) -> bool {
    let prefix = format!("{LIFECYCLE_ANNOTATION}=");
    text.lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| unquote_go(v).ok())
        .and_then(|v| serde_json::from_str::<LifecycleAnnotation>(&v).ok())
        .is_some_and(|l| l.mode.as_deref() == Some("Native"))
}

/// Undo Go's `strconv.Quote`.
fn unquote_go(s: &str) -> Result<String, String> {
    let inner = s
        .strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
        .ok_or("value is not a quoted string")?;
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    let hex = |chars: &mut std::str::Chars<'_>, n: usize| -> Result<u32, String> {
        let digits: String = chars.by_ref().take(n).collect();
        if digits.len() != n {
            return Err("short escape".into());
        }
        u32::from_str_radix(&digits, 16).map_err(|_| format!("bad hex escape {digits:?}"))
    };
    let mut bytes: Vec<u8> = Vec::new();
    // \xNN escapes are bytes that may form UTF-8 together: collect them first.
    let flush = |bytes: &mut Vec<u8>, out: &mut String| {
        if !bytes.is_empty() {
            out.push_str(&String::from_utf8_lossy(bytes));
            bytes.clear();
        }
    };
    while let Some(c) = chars.next() {
        if c != '\\' {
            flush(&mut bytes, &mut out);
            out.push(c);
            continue;
        }
        let e = chars.next().ok_or("trailing backslash")?;
        if e == 'x' {
            bytes.push(hex(&mut chars, 2)? as u8);
            continue;
        }
        flush(&mut bytes, &mut out);
        let ch = match e {
            'n' => '\n',
            't' => '\t',
            'r' => '\r',
            'a' => '\u{7}',
            'b' => '\u{8}',
            'f' => '\u{c}',
            'v' => '\u{b}',
            '\\' => '\\',
            '"' => '"',
            '\'' => '\'',
            'u' => char::from_u32(hex(&mut chars, 4)?).ok_or("bad \\u escape")?,
            'U' => char::from_u32(hex(&mut chars, 8)?).ok_or("bad \\U escape")?,
            other => return Err(format!("unknown escape \\{other}")),
        };
        out.push(ch);
    }
    flush(&mut bytes, &mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> DrainSettings {
        DrainSettings {
            drain_duration: Duration::from_secs(45),
            termination_drain_duration: Duration::from_secs(5),
            exit_on_zero_active_connections: false,
            minimum_drain_duration: Duration::from_secs(5),
            drain_deadline: Duration::from_secs(25),
        }
    }

    #[test]
    fn parses_downward_api_quoting() {
        let text = "remora.dev/lifecycle=\"{\\\"shutdown\\\":{\\\"terminationDrainDuration\\\":\\\"2s\\\"}}\"\nother=\"a\\nb\\u00e9\\xc3\\xa9\"\n";
        let m = parse_annotations(text).expect("parses");
        assert_eq!(
            m["remora.dev/lifecycle"],
            r#"{"shutdown":{"terminationDrainDuration":"2s"}}"#
        );
        assert_eq!(m["other"], "a\nbéé");
        assert!(parse_annotations("k=unquoted").is_err());
        assert!(parse_annotations("novalue").is_err());
        assert!(parse_annotations("k=\"\\q\"").is_err());
    }

    #[test]
    fn json_then_per_field_keys_win() {
        let mut ann = BTreeMap::new();
        ann.insert(
            LIFECYCLE_ANNOTATION.to_string(),
            r#"{"shutdown":{"terminationDrainDuration":"2s","exitOnZeroActiveConnections":true,"minimumDrainDuration":"1s"},"drainDeadline":"50s"}"#.to_string(),
        );
        ann.insert(
            MINIMUM_DRAIN_DURATION_ANNOTATION.to_string(),
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
        ann.insert(LIFECYCLE_ANNOTATION.to_string(), "{not json".to_string());
        ann.insert(EXIT_ON_ZERO_ANNOTATION.to_string(), "maybe".to_string());
        ann.insert(
            TERMINATION_DRAIN_DURATION_ANNOTATION.to_string(),
            "7s".to_string(),
        );
        let (s, problems) = base().with_annotations(&ann);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert_eq!(s.termination_drain_duration, Duration::from_secs(7));
        assert!(!s.exit_on_zero_active_connections);
    }

    #[test]
    fn native_is_read_from_the_lifecycle_annotation() {
        let line = |mode: &str| {
            format!(
                "{LIFECYCLE_ANNOTATION}={}\n",
                serde_json::to_string(&format!("{{\"mode\":\"{mode}\"}}")).expect("quote")
            )
        };
        assert!(runs_native(&line("Native")));
        assert!(!runs_native(&line("Legacy")));
        assert!(!runs_native("remora.dev/stop=\"x\"\n"));
        assert!(!runs_native(&format!(
            "{LIFECYCLE_ANNOTATION}=\"not json\"\n"
        )));
    }

    #[test]
    fn stop_request_is_found_whatever_else_the_file_holds() {
        let value = r#"{"reason":"AppsCompleted","at":"2026-01-01T00:00:00Z"}"#;
        let line = format!(
            "{STOP_ANNOTATION}={}\n",
            serde_json::Value::String(value.into())
        );
        assert_eq!(stop_request(&line).as_deref(), Some(value));
        // A line the parser refuses does not hide it.
        let text = format!("weird=unquoted\n{line}");
        assert!(parse_annotations(&text).is_err());
        assert_eq!(stop_request(&text).as_deref(), Some(value));
        // Any value is a request, even a broken one (returned raw).
        assert_eq!(
            stop_request("remora.dev/stop=\"\\q\"").as_deref(),
            Some("\"\\q\"")
        );
        assert_eq!(stop_request("remora.dev/stop=\"\"").as_deref(), Some(""));
        assert_eq!(stop_request("remora.dev/stopped=\"x\"\nother=\"y\""), None);
        assert_eq!(stop_request(""), None);
    }

    #[test]
    fn missing_file_is_none() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(
            read_annotations_file(&dir.path().join("nope"))
                .expect("ok")
                .is_none()
        );
    }
}
