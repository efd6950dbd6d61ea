//! Bad input: one clear line naming the culprit, a non-zero exit (2 for
//! usage errors), never a panic.

use std::process::{Command, Output};

use crate::support::*;

fn run(args: &[&str]) -> Output {
    Command::new(agent_bin())
        .args(args)
        .env_remove("REMORA_DRAIN_DURATION")
        .output()
        .expect("agent runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn assert_no_panic(o: &Output) {
    assert!(!stderr(o).contains("panicked"), "{}", stderr(o));
}

#[test]
fn unknown_flag_exits_2_naming_it() {
    let o = run(&["run", "--drain-durration", "5s"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--drain-durration"), "{}", stderr(&o));
    assert_no_panic(&o);
}

#[test]
fn bad_duration_exits_2_naming_the_flag() {
    let o = run(&["run", "--drain-duration", "soon"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--drain-duration"), "{}", stderr(&o));
    let o = run(&["wait", "--timeout", "later"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--timeout"), "{}", stderr(&o));
}

/// terminationGracePeriodSeconds 9223372036854775807 as a duration: far past
/// any bound the agent accepts.
const HUGE: &str = "2562047788015215h30m2s";

#[test]
fn durations_past_the_bound_exit_2_naming_the_flag_and_the_bound() {
    for flag in ["--drain-deadline", "--drain-duration", "--restart-window"] {
        let o = run(&["run", "--envoy-bin", "/bin/true", flag, HUGE]);
        assert_eq!(o.status.code(), Some(2), "{flag}: {}", stderr(&o));
        assert!(
            stderr(&o).contains(flag) && stderr(&o).contains("24h"),
            "{}",
            stderr(&o)
        );
        assert_no_panic(&o);
    }
    let o = Command::new(agent_bin())
        .args(["run", "--envoy-bin", "/bin/true"])
        .env("REMORA_DRAIN_DEADLINE", HUGE)
        .output()
        .expect("runs");
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--drain-deadline"), "{}", stderr(&o));
    // A bare number has no unit in the one grammar: refused, with the fix.
    let o = run(&["run", "--envoy-bin", "/bin/true", "--drain-duration", "30"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("30s"), "{}", stderr(&o));
}

#[test]
fn bad_istio_alias_exits_2_naming_the_variable() {
    let o = Command::new(agent_bin())
        .args(["run", "--envoy-bin", "/bin/true"])
        .env("TERMINATION_DRAIN_DURATION_SECONDS", "five")
        .output()
        .expect("runs");
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("TERMINATION_DRAIN_DURATION_SECONDS"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn bad_outbound_tls_exits_2_naming_the_flag() {
    for value in [
        "15001",                                  // not PORT=SPIFFE_ID
        "15001=https://a/b",                      // not a SPIFFE ID
        "15002=spiffe://cluster.local/ns/a/sa/b", // no --outbound on 15002
    ] {
        let o = run(&[
            "run",
            "--envoy-bin",
            "/bin/true",
            "--outbound",
            "15001:api:80",
            "--outbound-tls",
            value,
        ]);
        assert_eq!(o.status.code(), Some(2), "{value}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("--outbound-tls"),
            "{value}: {}",
            stderr(&o)
        );
        assert_no_panic(&o);
    }
    // The same through the contract's variable.
    let o = Command::new(agent_bin())
        .args([
            "run",
            "--envoy-bin",
            "/bin/true",
            "--outbound",
            "15001:api:80",
        ])
        .env(
            remora_contract::env::OUTBOUND_TLS,
            "15001=spiffe://a/b,15001=spiffe://a/c",
        )
        .output()
        .expect("runs");
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--outbound-tls"), "{}", stderr(&o));
}

#[test]
fn missing_envoy_binary_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let o = run(&[
        "run",
        "--envoy-bin",
        "/nonexistent/envoy",
        "--run-dir",
        &path_str(dir.path()),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("/nonexistent/envoy"), "{e}");
    let errors: Vec<&str> = e
        .lines()
        .filter(|l| l.starts_with("remora-agent:"))
        .collect();
    assert_eq!(errors.len(), 1, "one error line: {e}");
    assert_no_panic(&o);
}

#[test]
fn port_in_use_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port().to_string();
    let envoy = envoy_bin().expect("Envoy binary");
    for flag in ["--admin-port", "--envoy-admin-port"] {
        let mut args = vec![
            "run".to_string(),
            "--envoy-bin".into(),
            path_str(&envoy),
            "--run-dir".into(),
            path_str(dir.path()),
            "--health-address".into(),
            "127.0.0.1".into(),
        ];
        for (f, p) in [
            ("--admin-port", free_port()),
            ("--envoy-admin-port", free_port()),
            ("--health-port", free_port()),
            ("--stats-port", free_port()),
        ] {
            args.push(f.into());
            args.push(if f == flag {
                port.clone()
            } else {
                p.to_string()
            });
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = run(&args);
        assert_eq!(o.status.code(), Some(1), "{flag}: {}", stderr(&o));
        assert!(stderr(&o).contains(&port), "{flag}: {}", stderr(&o));
        assert!(stderr(&o).contains("in use"), "{flag}: {}", stderr(&o));
    }
}

#[test]
fn unreadable_override_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let garbage = dir.path().join("garbage.yaml");
    std::fs::write(&garbage, "{ not: [valid").expect("write");
    for file in [dir.path().join("nope.yaml"), garbage] {
        let o = run(&[
            "run",
            "--envoy-bin",
            &path_str(&envoy_bin().expect("Envoy binary")),
            "--run-dir",
            &path_str(dir.path()),
            "--bootstrap-override",
            &path_str(&file),
        ]);
        assert_eq!(o.status.code(), Some(1));
        let name = file
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        assert!(stderr(&o).contains(&name), "{}", stderr(&o));
        assert_no_panic(&o);
    }
}

#[test]
fn drain_helper_without_agent_fails_clearly() {
    let port = free_port();
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("http://127.0.0.1:{port}");
    // No admin token (no agent ever ran here): named, nothing sent.
    let o = run(&[
        "drain",
        "--timeout",
        "1s",
        "--admin-url",
        &url,
        "--run-dir",
        &path_str(dir.path()),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("admin-token"), "{}", stderr(&o));
    assert_no_panic(&o);
    std::fs::write(dir.path().join("admin-token"), "0123abcd").expect("token");
    let o = run(&[
        "drain",
        "--timeout",
        "1s",
        "--admin-url",
        &url,
        "--run-dir",
        &path_str(dir.path()),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains(&port.to_string()), "{}", stderr(&o));
}

#[test]
fn version_prints() {
    let o = run(&["version"]);
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("remora-agent "));
}

#[test]
fn discovery_without_roots_to_verify_the_server_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ports: Vec<String> = (0..4).map(|_| free_port().to_string()).collect();
    let o = run(&[
        "run",
        "--envoy-bin",
        &path_str(&envoy_bin().expect("Envoy binary")),
        "--run-dir",
        &path_str(dir.path()),
        "--health-address",
        "127.0.0.1",
        "--admin-port",
        &ports[0],
        "--envoy-admin-port",
        &ports[1],
        "--health-port",
        &ports[2],
        "--stats-port",
        &ports[3],
        "--discovery-address",
        "discovery.remora:15010",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("--ca-root-cert"), "{}", stderr(&o));
    assert_no_panic(&o);
}
