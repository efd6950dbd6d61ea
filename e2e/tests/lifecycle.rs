//! A short lifecycle bench: rolling replacements of real pods (pod runner,
//! remora-agent, real Envoy, test-app) under load lose no request in any
//! Remora mode, while the unmanaged baseline does.

use std::time::Duration;

#[test]
fn rolling_replacements_lose_nothing_with_remora() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("lifecycle.json");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_lifecycle-bench"))
        .args(["--cycles", "2", "--rate", "200", "--no-extras", "--svg", ""])
        .arg("--out")
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("lifecycle-bench runs");
    // The bench bounds every wait itself; this deadline only guards the test.
    let deadline = std::time::Instant::now() + Duration::from_secs(150);
    loop {
        match child.try_wait().expect("wait") {
            Some(_) => break,
            None if std::time::Instant::now() > deadline => {
                let _ = child.kill();
                panic!("lifecycle-bench did not finish within 150 s");
            }
            None => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    let output = child.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "lifecycle-bench failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("report")).expect("JSON");
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
