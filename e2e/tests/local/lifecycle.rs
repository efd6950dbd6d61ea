//! A short lifecycle bench: rolling replacements of real pods (pod runner,
//! remora-agent, real Envoy, test-app) under load lose no request in any
//! Remora mode, while the unmanaged baseline does; certificate rotations
//! under mTLS load take effect without a lost request or an Envoy restart.

use std::time::Duration;

use remora_test_support::wait::Wait;

/// Run `lifecycle-bench-emulated` with `args`, within `deadline`; its JSON report and stdout.
fn bench(args: &[&str], deadline: Duration) -> (serde_json::Value, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("lifecycle.json");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_lifecycle-bench-emulated"))
        .args(args)
        .args(["--svg", ""])
        .arg("--out")
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("lifecycle-bench-emulated runs");
    // The bench bounds every wait itself; this deadline only guards the test.
    let finished = Wait::new(deadline, "lifecycle-bench-emulated to finish")
        .every(Duration::from_millis(100))
        .until_blocking(|| child.try_wait().expect("wait"));
    if let Err(e) = finished {
        let _ = child.kill();
        panic!("{e}");
    }
    let output = child.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "lifecycle-bench-emulated failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let doc = serde_json::from_str(&std::fs::read_to_string(&out).expect("report")).expect("JSON");
    (doc, stdout)
}

#[test]
fn rolling_replacements_lose_nothing_with_remora() {
    let (doc, stdout) = bench(
        &["--cycles", "2", "--rate", "200", "--no-extras"],
        Duration::from_secs(150),
    );
    let modes = doc["modes"].as_array().expect("modes");
    assert_eq!(modes.len(), 4, "{stdout}");
    for m in modes {
        let name = m["mode"].as_str().unwrap_or_default();
        assert!(
            m["inbound_sent"].as_u64().unwrap_or(0) > 0,
            "{name}: no traffic\n{stdout}"
        );
        if name == "baseline" {
            // The unmanaged sidecar: the app's startup call races Envoy and
            // Envoy dies at SIGTERM while the endpoint is still in use.
            assert!(
                m["failed"].as_u64().unwrap_or(0) > 0,
                "baseline lost nothing?\n{stdout}"
            );
        } else {
            assert_eq!(
                m["failed"].as_u64(),
                Some(0),
                "{name} lost requests:\n{stdout}\n{m}"
            );
        }
    }
}

#[test]
fn cert_rotation_under_load_is_seen_by_new_handshakes_and_loses_nothing() {
    let (doc, stdout) = bench(
        &[
            "--only",
            "cert-rotation",
            "--rotations",
            "4",
            "--rotation-interval",
            "500ms",
            "--rate",
            "200",
        ],
        Duration::from_secs(120),
    );
    assert_eq!(doc["modes"].as_array().map(Vec::len), Some(0), "{stdout}");
    let r = &doc["disruptions"][0];
    assert_eq!(r["mode"], "cert-rotation", "{stdout}");
    assert!(
        r["inbound_sent"].as_u64().unwrap_or(0) > 0,
        "no traffic\n{stdout}"
    );
    assert_eq!(
        r["failed"].as_u64(),
        Some(0),
        "requests lost:\n{stdout}\n{r}"
    );
    let rot = &r["rotation"];
    assert_eq!(rot["rotations"].as_u64(), Some(4), "{rot}");
    // Every rotation reached every pod: a fresh handshake saw the new
    // certificate, and none after it saw an older one.
    assert_eq!(rot["expected"].as_u64(), Some(8), "{rot}");
    assert_eq!(rot["observed"], rot["expected"], "{stdout}\n{rot}");
    assert_eq!(rot["stale_after_seen"].as_u64(), Some(0), "{rot}");
    assert_eq!(rot["handshakes_failed"].as_u64(), Some(0), "{rot}");
    // Both kinds of rotation happened, and Envoy was never restarted.
    assert_eq!(rot["kinds"]["rekey"].as_u64(), Some(2), "{rot}");
    assert_eq!(rot["kinds"]["renew"].as_u64(), Some(2), "{rot}");
    assert_eq!(rot["envoy_restarts"].as_u64(), Some(0), "{rot}");
    assert_eq!(rot["envoy_epochs"], serde_json::json!([0, 0]), "{rot}");
}
