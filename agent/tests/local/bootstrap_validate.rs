//! Every shape of generated bootstrap is accepted by the real Envoy
//! (`envoy --mode validate`).

use clap::Parser;
use remora_agent::bootstrap::{self, Extras};
use remora_agent::config::{Cli, Command, RunConfig};

/// A run config from `args`; its run directory exists (Envoy watches the
/// drain-pressure file there, and refuses a directory that is not).
fn cfg(args: &[&str]) -> RunConfig {
    let run_dir = std::env::temp_dir();
    let mut argv = vec!["remora-agent", "run", "--run-dir"];
    argv.push(run_dir.to_str().expect("a UTF-8 temp dir"));
    argv.extend_from_slice(args);
    match Cli::try_parse_from(argv).expect("parses").command {
        Command::Run(c) => *c,
        _ => unreachable!(),
    }
}

fn validate(b: &serde_json::Value) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bootstrap.json");
    bootstrap::write(&path, b).expect("write");
    let out = std::process::Command::new(crate::support::envoy_bin().expect("Envoy binary"))
        .args(["--mode", "validate", "--log-level", "error", "-c"])
        .arg(&path)
        .output()
        .expect("envoy runs");
    assert!(
        out.status.success(),
        "Envoy rejects the bootstrap: {}\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        serde_json::to_string_pretty(b).unwrap_or_default()
    );
}

#[test]
fn static_mode_bootstrap_is_valid() {
    let c = cfg(&[
        "--inbound",
        "15007:8080",
        "--inbound",
        "8081",
        "--outbound",
        "15001:example.org:443",
        "--outbound",
        "15002:10.0.0.1:80",
    ]);
    validate(&bootstrap::generate(&c, &Extras::default(), None, true).expect("generate"));
    validate(&bootstrap::generate(&c, &Extras::default(), None, false).expect("generate"));
}

/// Both directions of mTLS, with the SDS snippets the agent adds.
#[test]
fn static_mode_mtls_bootstrap_is_valid() {
    let c = cfg(&[
        "--inbound",
        "15007:8080",
        "--inbound-tls",
        "--outbound",
        "15001:example.org:443,15002:10.0.0.1:80",
        "--outbound-tls",
        "15001=spiffe://cluster.local/ns/a/sa/b",
    ]);
    let extras = remora_agent::sds::bootstrap::extras(&c, std::path::Path::new("/tmp/sds.sock"));
    validate(&bootstrap::generate(&c, &extras, None, true).expect("generate"));
}

#[test]
fn xds_mode_bootstrap_is_valid() {
    let c = cfg(&["--discovery-address", "istiod.istio-system.svc:15010"]);
    validate(&bootstrap::generate(&c, &Extras::default(), None, true).expect("generate"));
}

#[test]
fn overridden_bootstrap_is_valid() {
    let c = cfg(&["--inbound", "15006:8080"]);
    let patch = serde_json::json!({
        "stats_flush_interval": "7s",
        "node": {"locality": {"zone": "z1"}}
    });
    validate(&bootstrap::generate(&c, &Extras::default(), Some(&patch), true).expect("generate"));
}

#[test]
fn identity_comes_from_the_pod_env() {
    let c = cfg(&[
        "--pod-name",
        "web-1",
        "--pod-namespace",
        "shop",
        "--instance-ip",
        "10.1.2.3",
        "--service-account",
        "web",
    ]);
    let b = bootstrap::generate(&c, &Extras::default(), None, true).expect("generate");
    assert_eq!(
        b["node"]["id"],
        "sidecar~10.1.2.3~web-1.shop~shop.svc.cluster.local"
    );
    assert_eq!(b["node"]["cluster"], "web.shop");
    validate(&b);
}
