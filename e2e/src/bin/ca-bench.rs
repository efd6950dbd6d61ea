//! The workload CA under load on the real node: `--requesters` concurrent
//! clients (200 by default), each a ServiceAccount of its own with its own
//! projected-style token (TokenRequest, audience `remora-ca`) and its own
//! TLS connection through the CA's ClusterIP (kube-proxy spreads them over
//! the replicas), each asking for an ECDSA P-256 certificate again as soon
//! as it has the last one, for `--duration` after a warm-up. Every request
//! is a full one: TokenReview by the API server, CSR check, signing.
//!
//! Reports certificates issued per second, latency p50/p99/max as the
//! client sees it, errors by gRPC code, and the operator processes' RSS
//! (before, peak, after; from /proc on this host). Table on stdout, JSON in
//! `--out`.
//!
//! Not covered: each requester reuses one CSR (made before the run), so the
//! clients' key generation is not on the 2 cores the CA shares with them;
//! the API server, etcd, the clients and both replicas share those cores,
//! so the figures are this machine's, not the CA's alone.
//!
//! ```sh
//! scripts/cluster.sh up && scripts/images.sh
//! cargo run --release -p e2e --bin ca-bench
//! ```

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use e2e::node::workload_ca::{self as ca, CaClient};
use e2e::node::{self, Node, TestNamespace};
use e2e::stats::Summary;
use k8s_openapi::api::core::v1::{Service, ServiceAccount};
use kube::api::{Api, PostParams};
use remora_contract::workload_ca::{PORT, TOKEN_AUDIENCE, spiffe_id};
use serde::Serialize;
use tokio::time::Instant;

#[derive(Debug, Parser)]
#[command(about = "Workload CA throughput, latency and memory on the real node")]
struct Args {
    #[arg(long, default_value_t = 200)]
    requesters: usize,
    /// Measured time (after the warm-up).
    #[arg(long, value_parser = remora_contract::duration::parse, default_value = "30s")]
    duration: Duration,
    #[arg(long, value_parser = remora_contract::duration::parse, default_value = "5s")]
    warmup: Duration,
    #[arg(long, default_value = "bench/results/workload-ca.json")]
    out: PathBuf,
}

#[derive(Debug, Serialize)]
struct Report {
    requesters: usize,
    duration_seconds: f64,
    issued: usize,
    issued_per_second: f64,
    latency: Summary,
    errors: BTreeMap<String, usize>,
    replicas: usize,
    rss_mib_before: Vec<f64>,
    rss_mib_peak: Vec<f64>,
    rss_mib_after: Vec<f64>,
    notes: &'static str,
}

/// RSS (MiB) of every `remora-operator` process on this host, by pid.
fn operator_rss() -> BTreeMap<u32, f64> {
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        // comm holds 15 bytes: the whole name, just.
        if comm.trim() != "remora-operator" {
            continue;
        }
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        if let Some(kb) = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        {
            out.insert(pid, kb / 1024.0);
        }
    }
    out
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let machine_before = remora_test_support::results::machine();
    let node = Node::shared().await?;
    let client = node.client()?;
    let values: Vec<String> = vec!["workloadCA.enabled=true".into()];
    let remora = node
        .install_remora(&client, node::RELEASE_NAMESPACE, &values)
        .await?;
    let ns = TestNamespace::injected(node, &client, "ca-bench").await?;
    let n = ns.name().to_string();
    let bundle = ca::wait_trust_bundle(&client, &n, Duration::from_secs(120)).await?;
    let svc = Api::<Service>::namespaced(client.clone(), &remora.namespace)
        .get(&remora.operator())
        .await?;
    let ip: IpAddr = svc
        .spec
        .and_then(|s| s.cluster_ip)
        .context("no ClusterIP")?
        .parse()?;
    node::pods::wait_kube_proxy(ip, PORT, Duration::from_secs(60)).await?;
    let server_name = format!("{}.{}.svc", remora.operator(), remora.namespace);

    eprintln!(
        "ca-bench: {} ServiceAccounts and tokens in {n}",
        args.requesters
    );
    let sas: Api<ServiceAccount> = ns.api();
    let mut requesters = Vec::with_capacity(args.requesters);
    for i in 0..args.requesters {
        let name = format!("sa-{i}");
        let sa: ServiceAccount =
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
        sas.create(&PostParams::default(), &sa).await?;
        let token = ca::token(&client, &n, &name, TOKEN_AUDIENCE, None).await?;
        let csr = ca::csr(&spiffe_id("cluster.local", &n, &name))?;
        // A connection of its own, as each sidecar has.
        let ca = CaClient::connect_addr(SocketAddr::new(ip, PORT), &server_name, &bundle)?;
        requesters.push((ca, token, csr));
    }

    let rss_before = operator_rss();
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = tokio::task::JoinSet::new();
    for (ca, token, csr) in requesters {
        let (measuring, stop) = (measuring.clone(), stop.clone());
        tasks.spawn(async move {
            let mut lat = Vec::new();
            let mut errors: BTreeMap<String, usize> = BTreeMap::new();
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let r = ca
                    .create(Some(&token), csr.clone(), Duration::from_secs(3600))
                    .await;
                let ms = t.elapsed().as_secs_f64() * 1000.0;
                if !measuring.load(Ordering::Relaxed) || stop.load(Ordering::Relaxed) {
                    continue;
                }
                match r {
                    Ok(_) => lat.push(ms),
                    Err(s) => *errors.entry(format!("{:?}", s.code())).or_default() += 1,
                }
            }
            (lat, errors)
        });
    }
    tokio::time::sleep(args.warmup).await;
    measuring.store(true, Ordering::Relaxed);
    let t0 = Instant::now();
    let mut peak: BTreeMap<u32, f64> = BTreeMap::new();
    while t0.elapsed() < args.duration {
        for (pid, mib) in operator_rss() {
            let e = peak.entry(pid).or_default();
            *e = e.max(mib);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let elapsed = t0.elapsed().as_secs_f64();
    let mut lat = Vec::new();
    let mut errors: BTreeMap<String, usize> = BTreeMap::new();
    while let Some(r) = tasks.join_next().await {
        let (l, e) = r?;
        lat.extend(l);
        for (k, v) in e {
            *errors.entry(k).or_default() += v;
        }
    }
    let rss_after = operator_rss();
    // Only the replicas that served (a helm upgrade may leave old ones
    // terminating in the first sample).
    let serving = |m: &BTreeMap<u32, f64>| -> Vec<f64> {
        peak.keys().filter_map(|pid| m.get(pid).copied()).collect()
    };
    let report = Report {
        requesters: args.requesters,
        duration_seconds: elapsed,
        issued: lat.len(),
        issued_per_second: lat.len() as f64 / elapsed,
        latency: Summary::of(&lat),
        errors,
        replicas: peak.len(),
        rss_mib_before: serving(&rss_before),
        rss_mib_peak: peak.values().copied().collect(),
        rss_mib_after: serving(&rss_after),
        notes: "each requester reuses one CSR made before the run (the clients' key generation is not measured); the API server (a TokenReview per request), etcd, the clients and both replicas share 2 cores",
    };
    println!(
        "| requesters | issued/s | p50 ms | p99 ms | max ms | errors | RSS MiB before / peak / after (per replica) |"
    );
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| {} | {:.0} | {:.1} | {:.1} | {:.1} | {:?} | {:.1?} / {:.1?} / {:.1?} |",
        report.requesters,
        report.issued_per_second,
        report.latency.p50_ms,
        report.latency.p99_ms,
        report.latency.max_ms,
        report.errors,
        report.rss_mib_before,
        report.rss_mib_peak,
        report.rss_mib_after
    );
    let doc =
        remora_test_support::results::document(&machine_before, serde_json::to_value(&report)?);
    remora_test_support::results::write(&args.out, &doc)?;
    eprintln!("ca-bench: wrote {}", args.out.display());
    ns.delete().await?;
    Ok(())
}
