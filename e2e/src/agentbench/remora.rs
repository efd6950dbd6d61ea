//! remora-agent as a contender: `remora-agent run` in static mode with one
//! inbound listener to the app, its own ports and run directory, and the
//! workload certificate from files (`--cert-dir`) when the listener is mTLS.

use std::path::Path;

use remora_contract::duration;
use remora_test_support::ports::free_port;
use tokio::process::Command;

use super::{AgentBenchError, Drain, Prepared, Settings, Setup, clean_env};

pub fn prepare(setup: &Setup, dir: &Path, settings: Settings) -> Result<Prepared, AgentBenchError> {
    let (inbound, envoy_admin, admin, health, stats) = (
        free_port(),
        free_port(),
        free_port(),
        free_port(),
        free_port(),
    );
    let cert_dir = dir.join("certs");
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut cmd = Command::new(&setup.remora_agent);
    clean_env(&mut cmd, dir);
    cmd.env("POD_NAME", &name).arg("run").args([
        "--envoy-bin".into(),
        setup.envoy.display().to_string(),
        "--run-dir".into(),
        dir.join("run").display().to_string(),
        // Absent: no live overrides from a host file at the default path.
        "--annotations-file".into(),
        dir.join("annotations").display().to_string(),
        "--inbound".into(),
        format!("{inbound}:{}", setup.app_port),
        "--envoy-admin-port".into(),
        envoy_admin.to_string(),
        "--admin-port".into(),
        admin.to_string(),
        "--health-port".into(),
        health.to_string(),
        "--stats-port".into(),
        stats.to_string(),
    ]);
    match settings.drain {
        Drain::Defaults => {}
        Drain::TerminationDrain(d) => {
            cmd.args(["--termination-drain-duration", &duration::format(d)]);
        }
        Drain::ExitOnZero { minimum } => {
            cmd.args([
                "--exit-on-zero-active-connections=true",
                "--minimum-drain-duration",
                &duration::format(minimum),
            ]);
        }
    }
    if settings.tls {
        cmd.arg("--inbound-tls=true")
            .arg("--cert-dir")
            .arg(&cert_dir);
    }
    Ok(Prepared {
        command: cmd,
        inbound,
        envoy_admin,
        ready_url: format!("http://127.0.0.1:{health}/healthz/ready"),
        cert_dir,
    })
}
