//! The local demo: remora-agent supervising a real Envoy in front of a small
//! app, steady traffic, then a SIGTERM drain while traffic still arrives, and
//! a short report. Run it with `scripts/demo.sh`.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use e2e::traffic::{Kind, Load, LoadSummary, Traffic};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use remora_test_support::bins::{envoy_bin, sibling_bin};
use remora_test_support::ports::try_free_port as free_port;
use tokio::time::Instant;

const RATE: u32 = 200;
/// How long a load balancer keeps sending after readiness fails (endpoint propagation).
const LB_LAG: Duration = Duration::from_millis(500);

struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(child: &Child, sig: Signal) -> anyhow::Result<()> {
    kill(Pid::from_raw(i32::try_from(child.id())?), sig)?;
    Ok(())
}

async fn status(port: u16, path: &str) -> Option<u16> {
    let c = remora_agent::http_client::HttpClient::new(Duration::from_secs(1));
    c.get(&format!("http://127.0.0.1:{port}{path}"))
        .await
        .ok()
        .map(|r| r.status)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let envoy = envoy_bin()?;
    let agent_bin = sibling_bin("remora-agent")?;
    let app_bin = sibling_bin("test-app")?;
    let dir = tempfile::tempdir()?;
    let (app_port, upstream_port) = (free_port()?, free_port()?);
    let (inbound, outbound, admin, health, envoy_admin, stats) = (
        free_port()?,
        free_port()?,
        free_port()?,
        free_port()?,
        free_port()?,
        free_port()?,
    );

    println!(
        "Remora demo — remora-agent + Envoy ({}) in front of test-app\n",
        envoy.display()
    );
    let _upstream = Proc(
        Command::new(&app_bin)
            .args([
                "--address",
                "127.0.0.1",
                "--port",
                &upstream_port.to_string(),
                "--delay",
                "1ms",
            ])
            .stderr(Stdio::null())
            .spawn()?,
    );
    let app = Proc(
        Command::new(&app_bin)
            .args([
                "--address",
                "127.0.0.1",
                "--port",
                &app_port.to_string(),
                "--delay",
                "20ms",
            ])
            .spawn()?,
    );
    let log_path = dir.path().join("agent.log");
    let log = std::fs::File::create(&log_path)?;
    let start = Instant::now();
    let mut agent = Proc(
        Command::new(&agent_bin)
            .arg("run")
            .arg("--envoy-bin")
            .arg(&envoy)
            .arg("--run-dir")
            .arg(dir.path().join("run"))
            .arg("--annotations-file")
            .arg(dir.path().join("annotations"))
            .args(["--health-address", "127.0.0.1", "--concurrency", "1"])
            .args([
                "--exit-on-zero-active-connections",
                "--minimum-drain-duration",
                "300ms",
            ])
            .args(["--drain-duration", "10s", "--drain-deadline", "20s"])
            .arg(format!("--inbound={inbound}:{app_port}"))
            .arg(format!("--outbound={outbound}:127.0.0.1:{upstream_port}"))
            .arg(format!("--admin-port={admin}"))
            .arg(format!("--health-port={health}"))
            .arg(format!("--envoy-admin-port={envoy_admin}"))
            .arg(format!("--stats-port={stats}"))
            .env("POD_NAME", "demo")
            .env("POD_NAMESPACE", "default")
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?,
    );
    let wait = Command::new(&agent_bin)
        .args(["wait", "--period", "5ms", "--timeout", "30s", "--url"])
        .arg(format!("http://127.0.0.1:{health}/healthz/ready"))
        .status()?;
    anyhow::ensure!(
        wait.success(),
        "the agent did not become ready; log: {}",
        log_path.display()
    );
    let ready_after = start.elapsed();
    println!(
        "1. agent ready {:.0} ms after exec (Envoy LIVE, workers started)",
        ready_after.as_secs_f64() * 1e3
    );

    // Steady traffic through the sidecar's inbound listener.
    let target = SocketAddr::from(([127, 0, 0, 1], inbound));
    let load = || vec![Load::new(Kind::Http1KeepAlive, target, f64::from(RATE))];
    let steady = Traffic::start(load(), Instant::now());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let steady = LoadSummary::of(&steady.stop().await);
    println!(
        "2. steady traffic: {} requests at {RATE}/s, {} failed, p50 {:.1} ms, p99 {:.1} ms",
        steady.sent, steady.failed, steady.latency.p50_ms, steady.latency.p99_ms
    );

    // Traffic continues; SIGTERM arrives; the load balancer notices the failed
    // readiness and stops sending only LB_LAG later.
    let during = Traffic::start(load(), Instant::now());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let term_at = Instant::now();
    signal(&agent.0, Signal::SIGTERM)?;
    let mut unready_after = None;
    while term_at.elapsed() < Duration::from_secs(5) {
        if status(health, "/healthz/ready").await == Some(503) {
            unready_after = Some(term_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let outbound_during = status(outbound, "/").await;
    tokio::time::sleep(LB_LAG).await;
    let during = during.stop().await;
    // The load balancer's connections close with its client.
    let last_close = Instant::now();
    let summary = LoadSummary::of(&during);
    let code = tokio::task::spawn_blocking(move || agent.0.wait()).await??;
    let exited_after_close = last_close.elapsed();
    let drain_took = term_at.elapsed();

    let report = std::fs::read_to_string(&log_path)?
        .lines()
        .find_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            let r = v.get("report")?.as_str()?;
            serde_json::from_str::<serde_json::Value>(r).ok()
        })
        .context("the agent logged no drain report")?;
    println!(
        "3. SIGTERM during traffic: readiness 503 after {:.1} ms; load balancer kept sending {} ms",
        unready_after
            .map(|d| d.as_secs_f64() * 1e3)
            .unwrap_or(f64::NAN),
        LB_LAG.as_millis()
    );
    println!(
        "   requests during the drain: {} sent, {} failed (p99 {:.1} ms)",
        summary.sent, summary.failed, summary.latency.p99_ms
    );
    println!(
        "   outbound call through the sidecar during the inbound drain: {}",
        outbound_during
            .map(|s| s.to_string())
            .unwrap_or("failed".into())
    );
    println!(
        "4. drain: outcome {}, {} connection(s) active at start; agent exited {:.0} ms after the last connection closed, {:.2} s after SIGTERM, status {}",
        report["outcome"],
        report["active_at_start"],
        exited_after_close.as_secs_f64() * 1e3,
        drain_took.as_secs_f64(),
        code.code().unwrap_or(-1)
    );
    signal(&app.0, Signal::SIGTERM)?;

    let lost = steady.failed + summary.failed;
    println!(
        "\nresult: {} requests, {lost} lost",
        steady.sent + summary.sent
    );
    anyhow::ensure!(
        lost == 0,
        "requests were lost; agent log: {}",
        log_path.display()
    );
    anyhow::ensure!(code.success(), "agent exit status {code}");
    Ok(())
}
