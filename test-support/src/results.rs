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

/// The machine now: cores, CPU model, memory, kernel, load average.
pub fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0 / 1024.0);
    json!({
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu": cpu,
        "memory_gib": mem_gib,
        "kernel": command_output("uname", &["-r"]),
        "load_average": std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim(),
    })
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
    // The whole checkout, whatever the directory the bench runs in (cargo
    // bench runs in the package's). Results files are written by the
    // benches: they do not make the code measured dirty.
    let status = command_output(
        "git",
        &[
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            ":(top)",
            ":(top,exclude)bench/results",
        ],
    );
    out.insert("dirty".into(), json!(!status.is_empty()));
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
