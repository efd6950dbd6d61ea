//! The README's demo runs end to end and loses no request.

#[test]
fn demo_loses_no_request() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_demo"))
        .output()
        .expect("demo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(" 0 lost"), "{stdout}");
    assert!(stdout.contains("outcome \"drained\""), "{stdout}");
    assert!(
        stdout.contains("outbound call through the sidecar during the inbound drain: 200"),
        "{stdout}"
    );
}
