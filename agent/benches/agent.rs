//! Agent benchmark: RSS, startup overhead over bare Envoy, exit latency in
//! exit-on-zero mode, and `wait` latency. Prints a table and writes
//! `bench/results/agent.json`. Run: `cargo bench -p remora-agent --bench agent`.

#[path = "../tests/support/mod.rs"]
mod support;
#[path = "../tests/support_sds/mod.rs"]
mod support_sds;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use support::*;

const RUNS: usize = 10;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn poll_until_200(port: u16, path: &str, start: Instant) -> Duration {
    loop {
        if let Ok(r) = get(port, path)
            && r.status == 200
        {
            return start.elapsed();
        }
        assert!(start.elapsed() < Duration::from_secs(20), "not up");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Bare Envoy with the agent's own bootstrap: exec → `/ready` 200 (LIVE).
fn bare_envoy_startup(bootstrap: &std::path::Path, admin_port: u16) -> Duration {
    let start = Instant::now();
    let mut child = Command::new(envoy_bin().expect("Envoy binary"))
        .args(["-c"])
        .arg(bootstrap)
        .args([
            "--use-dynamic-base-id",
            "--concurrency",
            "1",
            "--log-level",
            "error",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("envoy");
    let t = poll_until_200(admin_port, "/ready", start);
    let _ = child.kill();
    let _ = child.wait();
    t
}

fn main() {
    // Cargo passes `--bench`; nothing to parse.
    let machine_before = remora_test_support::results::machine();
    let mut rss = Vec::new();
    let mut agent_start = Vec::new();
    let mut envoy_start = Vec::new();
    let mut exit_latency = Vec::new();
    let mut rss_sds = Vec::new();
    let mut wait_latency = Vec::new();

    for _ in 0..RUNS {
        // Agent exec → /healthz/ready 200.
        let start = Instant::now();
        let mut agent = Agent::builder().spawn();
        agent_start
            .push(poll_until_200(agent.ports.health, "/healthz/ready", start).as_secs_f64() * 1e3);
        std::thread::sleep(Duration::from_millis(200));
        rss.push(rss_kib(agent.pid()) as f64 / 1024.0);

        // Ready → `remora-agent wait` returns.
        let t = Instant::now();
        let st = Command::new(agent_bin())
            .args(["wait", "--url"])
            .arg(format!(
                "http://127.0.0.1:{}/healthz/ready",
                agent.ports.health
            ))
            .stderr(Stdio::null())
            .status()
            .expect("wait");
        assert!(st.success());
        wait_latency.push(t.elapsed().as_secs_f64() * 1e3);

        // Bare Envoy on the same bootstrap, with the agent stopped first (same ports).
        let bootstrap = agent.dir.path().join("bench-bootstrap.json");
        std::fs::copy(
            agent.dir.path().join("run/envoy-bootstrap.json"),
            &bootstrap,
        )
        .expect("copy");
        let admin_port = agent.ports.envoy_admin;
        agent.signal(Signal::SIGKILL);
        let _ = agent.child.wait();
        wait_until_blocking(Duration::from_secs(5), "ports free", || {
            std::net::TcpListener::bind(("127.0.0.1", admin_port))
                .ok()
                .map(drop)
        });
        envoy_start.push(bare_envoy_startup(&bootstrap, admin_port).as_secs_f64() * 1e3);
    }

    for _ in 0..RUNS {
        // Exit-on-zero: time from the last connection closing to the agent's exit.
        let mut agent = Agent::builder()
            .args([
                "--exit-on-zero-active-connections",
                "--minimum-drain-duration",
                "200ms",
            ])
            .start();
        let mut conn = Conn::open(agent.ports.inbound).expect("connect");
        conn.get("/").expect("request");
        agent.signal(Signal::SIGTERM);
        std::thread::sleep(Duration::from_millis(400));
        let closed = Instant::now();
        drop(conn);
        agent.wait_exit(Duration::from_secs(10));
        exit_latency.push(closed.elapsed().as_secs_f64() * 1e3);
    }

    for _ in 0..RUNS {
        // With a certificate source: SDS serving the workload cert to an mTLS listener.
        let root = support_sds::Ca::new("bench root");
        let certs = tempfile::tempdir().expect("tempdir");
        support_sds::write_certs(certs.path(), &root.leaf(), &root.pem);
        let agent = Agent::builder()
            .arg("--inbound-tls")
            .arg(format!("--cert-dir={}", certs.path().display()))
            .start();
        std::thread::sleep(Duration::from_millis(200));
        rss_sds.push(rss_kib(agent.pid()) as f64 / 1024.0);
    }

    let rows = [
        ("agent RSS once ready", "MiB", median(rss.clone()), 8.0),
        (
            "agent RSS once ready, SDS serving file certs (mTLS)",
            "MiB",
            median(rss_sds.clone()),
            8.0,
        ),
        (
            "agent exec→ready minus Envoy exec→LIVE",
            "ms",
            median(agent_start.clone()) - median(envoy_start.clone()),
            30.0,
        ),
        (
            "exit after last connection closes (exit-on-zero)",
            "ms",
            median(exit_latency.clone()),
            150.0,
        ),
        (
            "ready → `wait` returns",
            "ms",
            median(wait_latency.clone()),
            f64::NAN,
        ),
    ];
    println!("\nremora-agent benchmark (median of {RUNS} runs; Envoy 1.40.0)");
    println!(
        "| {:<50} | {:>9} | {:>7} | {:>4} |",
        "measure", "value", "goal", "ok"
    );
    println!("|{:-<52}|{:->11}|{:->9}|{:->6}|", "", "", "", "");
    for (name, unit, value, goal) in &rows {
        let ok = if goal.is_nan() {
            "-"
        } else if value <= goal {
            "yes"
        } else {
            "NO"
        };
        let goal_s = if goal.is_nan() {
            "-".to_string()
        } else {
            format!("≤{goal}")
        };
        println!(
            "| {:<50} | {:>5.1} {:<3} | {:>7} | {:>4} |",
            name, value, unit, goal_s, ok
        );
    }
    println!(
        "(agent exec→ready {:.1} ms, bare Envoy exec→LIVE {:.1} ms)",
        median(agent_start.clone()),
        median(envoy_start.clone())
    );

    let json = serde_json::json!({
        "runs": RUNS,
        "envoy": "1.40.0",
        "rss_mib": {"median": median(rss.clone()), "samples": rss, "goal": 8.0},
        "rss_with_sds_certs_mib": {"median": median(rss_sds.clone()), "samples": rss_sds, "goal": 8.0},
        "startup_overhead_ms": {
            "median": median(agent_start.clone()) - median(envoy_start.clone()),
            "agent_exec_to_ready_ms": agent_start,
            "envoy_exec_to_live_ms": envoy_start,
            "goal": 30.0
        },
        "exit_on_zero_exit_latency_ms": {"median": median(exit_latency.clone()), "samples": exit_latency, "goal": 150.0},
        "ready_to_wait_return_ms": {"median": median(wait_latency.clone()), "samples": wait_latency},
    });
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/results/agent.json");
    let doc = remora_test_support::results::document(&machine_before, json);
    remora_test_support::results::write(&out, &doc).expect("write bench/results/agent.json");
    println!("wrote {}", out.display());
}
