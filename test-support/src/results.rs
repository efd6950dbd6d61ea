//! Where a results file under `bench/results/` came from, read at run time:
//! the command, the commit measured (and whether the tree was dirty), the
//! date and the machine, with its load average before and after the run.

use serde_json::{Map, Value, json};

/// A command's trimmed stdout, or empty when it fails.
pub fn command_output(cmd: &str, args: &[&str]) -> String {
    std::process::Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// `scripts/lib/stamp.sh`, which holds what a stamp records of the machine
/// and of the tree, for the shell scripts and the benches alike.
const STAMP_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/lib/stamp.sh");

/// The machine now (`stamp.sh machine`): cores, CPU model, memory, kernel,
/// load average; `{"error": ...}` if the script could not say.
pub fn machine() -> Value {
    let out = command_output("bash", &[STAMP_SCRIPT, "machine"]);
    serde_json::from_str(&out)
        .unwrap_or_else(|e| json!({"error": format!("{STAMP_SCRIPT} machine: {e}: {out:?}")}))
}

/// Whether the checkout has uncommitted changes to the code a results file
/// could measure (`stamp.sh dirty`: tracked files, bench/results left out).
pub fn dirty() -> bool {
    let top = command_output("git", &["rev-parse", "--show-toplevel"]);
    command_output("bash", &[STAMP_SCRIPT, "dirty", &top]) != "false"
}

/// What every results file starts with: `command`, `commit`, `dirty`,
/// `date` and `machine_before` (the machine as [`machine`] read it when
/// the run started); add `machine_after` with [`machine`] when it ends.
pub fn stamp(machine_before: &Value) -> Map<String, Value> {
    let mut out = Map::new();
    out.insert(
        "command".into(),
        json!(std::env::args().collect::<Vec<_>>().join(" ")),
    );
    out.insert(
        "commit".into(),
        json!(command_output("git", &["rev-parse", "HEAD"])),
    );
    out.insert("dirty".into(), json!(dirty()));
    out.insert(
        "date".into(),
        json!(command_output("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"])),
    );
    out.insert("machine_before".into(), machine_before.clone());
    out
}

/// A results file's whole document: the [`stamp`], then `data`'s keys (an
/// object; anything else goes under `data`), then `machine_after` read now.
pub fn document(machine_before: &Value, data: Value) -> Value {
    let mut doc = stamp(machine_before);
    match data {
        Value::Object(map) => doc.extend(map),
        other => {
            doc.insert("data".into(), other);
        }
    }
    doc.insert("machine_after".into(), machine());
    Value::Object(doc)
}

/// Writes `doc` pretty-printed with a final newline, creating its directory.
pub fn write(path: &std::path::Path, doc: &Value) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let mut text = serde_json::to_string_pretty(doc).map_err(std::io::Error::other)?;
    text.push('\n');
    std::fs::write(path, text)
}
