//! `hostile-bench`: what hostile clients cost remora-agent and
//! remora-operator, as processes. Slow-loris connections (each starts a
//! request head, adds a byte a second, never finishes, and comes back when
//! closed) against the agent's health port and the operator's webhook port;
//! concurrent maximum-size AdmissionReviews against the operator. Meanwhile
//! a kubelet-like probe (fresh connection every 100 ms, 1 s timeout) and the
//! process's peak RSS. Prints a table; writes `bench/results/hostile.json`.
//!
//! The attackers connect from 127.0.0.2, the probes from 127.0.0.1.
//!
//! Not covered: Envoy's own listeners (Envoy has its own overload manager),
//! attacks from many source addresses at once, CPU exhaustion; the operator
//! runs against the test control plane with an empty cluster, so its idle
//! RSS is that of a small cluster.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use e2e::agentbench::{self, Drain, Settings, Setup};
use e2e::controlplane::ControlPlane;
use e2e::hostile::{self, mib};
use e2e::operator::{Operator, Options};
use e2e::stats::Summary;
use remora_test_support::bins::{envoy_bin, workspace_bin};
use remora_test_support::wait::wait_until;
use remora_test_support::webhook_client;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

/// The attackers' source address; probes come from 127.0.0.1, the way a
/// kubelet's come from the node and an attacker's from its pod.
const ATTACKER: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 2));

#[derive(Parser, Debug)]
#[command(
    about = "RSS and probe latency of remora-agent and remora-operator under hostile clients"
)]
struct Args {
    /// Slow-loris connections held open at once.
    #[arg(long, default_value_t = 3000)]
    slow_connections: usize,
    /// AdmissionReviews in flight at once.
    #[arg(long, default_value_t = 64)]
    reviews: usize,
    /// Size of each review; default: the operator's limit minus 1 KiB.
    #[arg(long)]
    review_bytes: Option<usize>,
    /// How long each attack lasts.
    #[arg(long, value_parser = remora_contract::duration::parse, default_value = "15s")]
    duration: Duration,
    /// `agent`, `operator` (default both).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// remora-agent to run (default: next to this binary).
    #[arg(long)]
    agent_bin: Option<PathBuf>,
    #[arg(long, default_value = "bench/results/hostile.json")]
    out: PathBuf,
}

/// One attack's outcome.
#[derive(Debug, Serialize)]
struct Attack {
    target: &'static str,
    attack: String,
    idle_rss_mib: f64,
    peak_rss_mib: f64,
    /// peak / idle.
    rss_ratio: f64,
    probes: Summary,
    probes_failed: u64,
    probe_failures: std::collections::BTreeMap<&'static str, u64>,
    /// Slow-loris: connections opened in all (the server closing them is
    /// what makes the attackers reconnect).
    connections_opened: u64,
    /// Reviews: answered 200, refused 503 (over the memory budget), other.
    reviews_answered: u64,
    reviews_shed: u64,
    reviews_failed: u64,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    if cfg!(debug_assertions) && args.agent_bin.is_none() {
        bail!("run with --release (the binaries next to this one would be debug builds)");
    }
    let machine_before = remora_test_support::results::machine();
    let want = |t: &str| args.only.is_empty() || args.only.iter().any(|o| o == t);
    let mut rows = Vec::new();
    if want("agent") {
        rows.push(agent_attack(&args).await?);
    }
    if want("operator") {
        rows.extend(operator_attacks(&args).await?);
    }
    println!(
        "\n{:<9} {:<28} {:>9} {:>9} {:>6} {:>9} {:>9} {:>8} {:>7}",
        "target",
        "attack",
        "idle MiB",
        "peak MiB",
        "ratio",
        "probe p50",
        "probe p99",
        "probe max",
        "failed"
    );
    for r in &rows {
        println!(
            "{:<9} {:<28} {:>9.1} {:>9.1} {:>6.2} {:>8.2}ms {:>8.2}ms {:>7.1}ms {:>7}",
            r.target,
            r.attack,
            r.idle_rss_mib,
            r.peak_rss_mib,
            r.rss_ratio,
            r.probes.p50_ms,
            r.probes.p99_ms,
            r.probes.max_ms,
            r.probes_failed
        );
    }
    for r in rows.iter().filter(|r| r.probes_failed > 0) {
        println!(
            "{} / {}: probe failures {:?}",
            r.target, r.attack, r.probe_failures
        );
    }
    for r in rows
        .iter()
        .filter(|r| r.reviews_answered + r.reviews_shed + r.reviews_failed > 0)
    {
        println!(
            "{}: reviews answered {}, shed (503) {}, failed {}",
            r.attack, r.reviews_answered, r.reviews_shed, r.reviews_failed
        );
    }
    let json = serde_json::json!({
        "bench": "hostile",
        "duration_s": args.duration.as_secs_f64(),
        "rows": rows,
    });
    remora_test_support::results::write(
        &args.out,
        &remora_test_support::results::document(&machine_before, json),
    )?;
    println!("wrote {}", args.out.display());
    Ok(())
}

/// Run `attack` against `pid` for the bench's duration while probing with
/// `probe` and sampling RSS.
async fn measure<F, Fut>(
    args: &Args,
    pid: i32,
    stop: CancellationToken,
    probe: F,
) -> (f64, f64, e2e::hostile::Probes)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), &'static str>>,
{
    let idle = mib(agentbench::rss(pid));
    let peak = tokio::spawn(hostile::peak_rss_mib(
        pid,
        Duration::from_millis(50),
        stop.clone(),
    ));
    let stopper = {
        let stop = stop.clone();
        let d = args.duration;
        tokio::spawn(async move {
            tokio::time::sleep(d).await;
            stop.cancel();
        })
    };
    let probes = hostile::probe_every(Duration::from_millis(100), stop.clone(), probe).await;
    let _ = stopper.await;
    let peak = peak.await.unwrap_or(0.0);
    (idle, peak, probes)
}

async fn agent_attack(args: &Args) -> Result<Attack> {
    let agent = match &args.agent_bin {
        Some(p) => p.clone(),
        None => workspace_bin("remora-agent", "REMORA_AGENT_BIN")?,
    };
    let base = tempfile::Builder::new()
        .prefix("hostile-bench-")
        .tempdir()?;
    let setup = Setup {
        envoy: envoy_bin()?.canonicalize()?,
        remora_agent: agent,
        pilot_agent: PathBuf::new(),
        pilot_template: PathBuf::new(),
        // Nothing needs to answer behind the inbound listener here.
        app_port: remora_test_support::ports::free_port(),
        base: base.path().to_path_buf(),
    };
    let dir = base.path().join("agent");
    std::fs::create_dir_all(&dir)?;
    let prepared = agentbench::remora::prepare(
        &setup,
        &dir,
        Settings {
            drain: Drain::Defaults,
            tls: false,
        },
    )?;
    let mut cmd = prepared.command;
    let log = std::fs::File::create(dir.join("agent.log"))?;
    cmd.stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log))
        .kill_on_drop(true);
    let child = cmd.spawn().context("starting remora-agent")?;
    let pid = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
    let health: SocketAddr = prepared
        .ready_url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default()
        .parse()
        .with_context(|| format!("health address of {}", prepared.ready_url))?;
    wait_until(Duration::from_secs(30), "the agent to be ready", || async {
        hostile::plain_get(health, "/healthz/ready").await.ok()
    })
    .await?;
    // Let the first allocations settle before taking the idle figure.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stop = CancellationToken::new();
    let (counts, attackers) =
        hostile::slow_loris(health, ATTACKER, args.slow_connections, stop.clone());
    let (idle, peak, probes) = measure(args, pid, stop, || {
        hostile::plain_get(health, "/healthz/ready")
    })
    .await;
    attackers.join_all().await;
    drop(child);
    Ok(Attack {
        target: "agent",
        attack: format!("{} slow connections", args.slow_connections),
        idle_rss_mib: idle,
        peak_rss_mib: peak,
        rss_ratio: peak / idle.max(f64::MIN_POSITIVE),
        probes: probes.summary(),
        probes_failed: probes.failed,
        probe_failures: probes.failures.clone(),
        connections_opened: counts.opened.load(Ordering::Relaxed),
        reviews_answered: 0,
        reviews_shed: 0,
        reviews_failed: 0,
    })
}

async fn operator_attacks(args: &Args) -> Result<Vec<Attack>> {
    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "hostile").await?;
    let operator = Operator::start(cp.kubeconfig(), Options::new(&ns)).await?;
    let pid = i32::try_from(operator.pid()).unwrap_or(0);
    let addr = operator.addr();
    let ca = Arc::new(operator.ca_pem().to_string());
    let probe = || {
        let ca = Arc::clone(&ca);
        async move {
            let mut c = webhook_client::connect(addr, "localhost", &ca)
                .await
                .map_err(|_| "connect or TLS handshake")?;
            match c.request(http::Method::GET, "/healthz", vec![]).await {
                Ok((s, _)) if s == http::StatusCode::OK => Ok(()),
                Ok(_) => Err("not 200"),
                Err(_) => Err("closed without an answer"),
            }
        }
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut rows = Vec::new();

    // Slow connections against the TLS port: the handshake never completes.
    let stop = CancellationToken::new();
    let (counts, attackers) =
        hostile::slow_loris(addr, ATTACKER, args.slow_connections, stop.clone());
    let (idle, peak, probes) = measure(args, pid, stop, probe).await;
    attackers.join_all().await;
    rows.push(Attack {
        target: "operator",
        attack: format!("{} slow connections", args.slow_connections),
        idle_rss_mib: idle,
        peak_rss_mib: peak,
        rss_ratio: peak / idle.max(f64::MIN_POSITIVE),
        probes: probes.summary(),
        probes_failed: probes.failed,
        probe_failures: probes.failures.clone(),
        connections_opened: counts.opened.load(Ordering::Relaxed),
        reviews_answered: 0,
        reviews_shed: 0,
        reviews_failed: 0,
    });

    // Maximum-size reviews, `reviews` at once, each client sending again as
    // soon as it has its answer.
    let size = args.review_bytes.unwrap_or((4 << 20) - 1024);
    let body = Arc::new(hostile::review_of_size(size, "hostile-review"));
    let (answered, shed, failed) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let stop = CancellationToken::new();
    let mut senders = tokio::task::JoinSet::new();
    for _ in 0..args.reviews {
        let (ca, body, stop) = (Arc::clone(&ca), Arc::clone(&body), stop.clone());
        let (answered, shed, failed) = (
            Arc::clone(&answered),
            Arc::clone(&shed),
            Arc::clone(&failed),
        );
        senders.spawn(async move {
            while !stop.is_cancelled() {
                let Ok(mut c) = webhook_client::connect(addr, "localhost", &ca).await else {
                    failed.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                while !stop.is_cancelled() {
                    match c
                        .request(http::Method::POST, "/inject", body.to_vec())
                        .await
                    {
                        Ok((s, _)) if s == http::StatusCode::OK => {
                            answered.fetch_add(1, Ordering::Relaxed)
                        }
                        Ok((s, _)) if s == http::StatusCode::SERVICE_UNAVAILABLE => {
                            // A 503 closes the connection.
                            shed.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        _ => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                    };
                }
            }
        });
    }
    let (idle, peak, probes) = measure(args, pid, stop, probe).await;
    senders.join_all().await;
    rows.push(Attack {
        target: "operator",
        attack: format!("{} x {} KiB reviews", args.reviews, size / 1024),
        idle_rss_mib: idle,
        peak_rss_mib: peak,
        rss_ratio: peak / idle.max(f64::MIN_POSITIVE),
        probes: probes.summary(),
        probes_failed: probes.failed,
        probe_failures: probes.failures.clone(),
        connections_opened: 0,
        reviews_answered: answered.load(Ordering::Relaxed),
        reviews_shed: shed.load(Ordering::Relaxed),
        reviews_failed: failed.load(Ordering::Relaxed),
    });
    drop(operator);
    cp.delete_namespace(&client, &ns).await?;
    Ok(rows)
}
