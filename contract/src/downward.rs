//! The kubelet's downward-API file of a pod's annotations
//! (`fieldRef: metadata.annotations`): one `key="value"` a line, the value
//! quoted the way Go's `strconv.Quote` does. The kubelet rewrites it by
//! swapping a `..data` symlink, so a reader always sees a whole file.

use std::collections::BTreeMap;
use std::path::Path;

use crate::annotations;
use crate::lifecycle::LifecycleAnnotation;

#[derive(Debug, thiserror::Error)]
pub enum DownwardError {
    #[error("line {line}: {reason}")]
    Syntax { line: usize, reason: String },
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
pub fn parse_annotations(text: &str) -> Result<BTreeMap<String, String>, DownwardError> {
    let mut out = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let err = |reason: &str| DownwardError::Syntax {
            line: i + 1,
            reason: reason.to_string(),
        };
        let (key, value) = line.split_once('=').ok_or_else(|| err("no '='"))?;
        let value = unquote_go(value).map_err(|r| err(&r))?;
        out.insert(key.to_string(), value);
    }
    Ok(out)
}

/// The value of [`annotations::STOP`] in a downward-API annotations file, if
/// the line is there. Looked up line by line, apart from the rest of the
/// file, so that a line this parser cannot read never hides a stop request
/// (which would leave a Job's pod running forever); a value that does not
/// unquote is returned raw: the presence of the key is what counts.
pub fn stop_request(text: &str) -> Option<String> {
    let prefix = format!("{}=", annotations::STOP);
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
    let prefix = format!("{}=", annotations::LIFECYCLE);
    text.lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| unquote_go(v).ok())
        .is_some_and(|v| lifecycle_is_native(&v))
}

/// Whether a `remora.dev/lifecycle` value says the sidecar is a native one
/// (see [`runs_native`]); unreadable: not native.
pub fn lifecycle_is_native(value: &str) -> bool {
    serde_json::from_str::<LifecycleAnnotation>(value).is_ok_and(|l| l.is_native())
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
    fn native_is_read_from_the_lifecycle_annotation() {
        let line = |mode: &str| {
            format!(
                "{}={}\n",
                annotations::LIFECYCLE,
                serde_json::to_string(&format!("{{\"mode\":\"{mode}\"}}")).expect("quote")
            )
        };
        assert!(runs_native(&line("Native")));
        assert!(!runs_native(&line("Legacy")));
        assert!(!runs_native("remora.dev/stop=\"x\"\n"));
        assert!(!runs_native(&format!(
            "{}=\"not json\"\n",
            annotations::LIFECYCLE
        )));
    }

    #[test]
    fn stop_request_is_found_whatever_else_the_file_holds() {
        let value = r#"{"reason":"AppsCompleted","at":"2026-01-01T00:00:00Z"}"#;
        let line = format!(
            "{}={}\n",
            annotations::STOP,
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
        let missing = std::env::temp_dir().join("remora-contract-no-such-dir/annotations");
        assert!(read_annotations_file(&missing).expect("ok").is_none());
    }
}
