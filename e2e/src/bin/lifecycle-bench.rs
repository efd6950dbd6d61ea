//! The lifecycle benchmark on the real node: every contender (plain Envoy,
//! Remora with the chart's defaults in Legacy and Native mode, Remora tuned)
//! through every scenario (rolling update with maxUnavailable 0% and 25%, 5
//! pods deleted at once) at every ingress lag, under clients that never
//! retry: HTTP/1.1 keep-alive through a lagging ingress and through the
//! ClusterIP, h2c, POST with a body, 2-20 s requests, gRPC unary and
//! streaming. One row per (contender, scenario, lag), a table on stdout and
//! JSON in `bench/results/lifecycle-node.json`.
//!
//! `scripts/cluster.sh up && scripts/images.sh` first (root), then
//! `cargo run --release -p e2e --bin lifecycle-bench -- [--only NAME,...] [--lag 0s,2s]`.
//!
//! What it does not cover: one node (kube-proxy and the ingress run on the
//! machine that runs the pods, with 2 cores shared by all replicas), no
//! cloud load balancer (the ingress is the harness's own, with a fixed lag),
//! the test app rather than real apps, and the scenarios listed; every row is
//! one rollout unless `--cycles` says more.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use e2e::node::zero_loss::{Clients, Contender, Run, RunResult, Scenario, run};
use e2e::node::{Node, repo_root};
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "Zero loss on the real node: contenders × scenarios × ingress lags")]
struct Args {
    /// Contenders and scenarios to run (default: all), by name, e.g.
    /// `--only plain-envoy,remora-native-defaults,rolling-update`.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Ingress lags behind the EndpointSlices.
    #[arg(long, value_delimiter = ',', value_parser = remora_contract::duration::parse,
          default_value = "0s,1s,2s,5s,10s")]
    lag: Vec<Duration>,
    /// Runs per (contender, scenario, lag); their counts add up.
    #[arg(long, default_value_t = 1)]
    cycles: u32,
    /// Replicas of the workload.
    #[arg(long, default_value_t = 10)]
    replicas: i32,
    /// Requests per second of each HTTP/1.1 client (the others send a quarter).
    #[arg(long, default_value_t = 50.0)]
    rate: f64,
    /// Only the HTTP/1.1 keep-alive clients.
    #[arg(long)]
    keep_alive_only: bool,
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One row: a (contender, scenario, lag) over its cycles.
#[derive(Debug, Serialize)]
struct Row {
    contender: &'static str,
    scenario: &'static str,
    lag_seconds: f64,
    cycles: u32,
    sent: usize,
    failed: usize,
    failures: BTreeMap<&'static str, usize>,
    /// Latency of the successful HTTP/1.1 requests through the ingress.
    ingress_p50_ms: f64,
    ingress_p99_ms: f64,
    stop_p50_seconds: f64,
    stop_max_seconds: f64,
    /// How the old pods' containers exited.
    endings: BTreeMap<String, usize>,
    runs: Vec<RunResult>,
}

fn row(results: Vec<RunResult>) -> Option<Row> {
    let first = results.first()?;
    let mut failures = BTreeMap::new();
    let mut endings = BTreeMap::new();
    for r in &results {
        for (k, v) in &r.failures {
            *failures.entry(*k).or_insert(0) += v;
        }
        for (k, v) in &r.endings {
            *endings.entry(k.clone()).or_insert(0) += v;
        }
    }
    let mut stops: Vec<f64> = results
        .iter()
        .flat_map(|r| r.stops.iter().filter_map(|s| s.stop_seconds))
        .collect();
    stops.sort_by(f64::total_cmp);
    let ingress = |f: fn(&e2e::stats::Summary) -> f64| {
        let v: Vec<f64> = results
            .iter()
            .flat_map(|r| r.loads.iter())
            .filter(|l| l.load == "ingress-http1")
            .map(|l| f(&l.latency))
            .collect();
        e2e::stats::Summary::of(&v).p50_ms
    };
    Some(Row {
        contender: first.run.contender.name(),
        scenario: first.run.scenario.name(),
        lag_seconds: first.run.ingress_lag.as_secs_f64(),
        cycles: u32::try_from(results.len()).unwrap_or(u32::MAX),
        sent: results.iter().map(|r| r.sent).sum(),
        failed: results.iter().map(|r| r.failed).sum(),
        failures,
        ingress_p50_ms: ingress(|s| s.p50_ms),
        ingress_p99_ms: ingress(|s| s.p99_ms),
        stop_p50_seconds: e2e::stats::percentile(&stops, 0.5),
        stop_max_seconds: stops.last().copied().unwrap_or(0.0),
        endings,
        runs: results,
    })
}

fn print_row(r: &Row) {
    let causes: Vec<String> = r.failures.iter().map(|(k, v)| format!("{k} {v}")).collect();
    println!(
        "| {} | {} | {:.0} s | {} | {} | {} | {:.1} / {:.1} ms | {:.1} / {:.1} s | {} |",
        r.contender,
        r.scenario,
        r.lag_seconds,
        r.sent,
        r.failed,
        if causes.is_empty() {
            "-".to_string()
        } else {
            causes.join(", ")
        },
        r.ingress_p50_ms,
        r.ingress_p99_ms,
        r.stop_p50_seconds,
        r.stop_max_seconds,
        r.endings
            .iter()
            .map(|(k, v)| format!("{v}× {k}"))
            .collect::<Vec<_>>()
            .join("; ")
    );
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let wanted = |name: &str| args.only.is_empty() || args.only.iter().any(|o| o == name);
    let contenders: Vec<Contender> = Contender::ALL
        .into_iter()
        .filter(|c| wanted(c.name()))
        .collect();
    let scenarios: Vec<Scenario> = Scenario::ALL
        .into_iter()
        .filter(|s| wanted(s.name()))
        .collect();
    // `--only` naming just contenders keeps every scenario, and the reverse.
    let contenders = if contenders.is_empty() {
        Contender::ALL.to_vec()
    } else {
        contenders
    };
    let scenarios = if scenarios.is_empty() {
        Scenario::ALL.to_vec()
    } else {
        scenarios
    };
    for o in &args.only {
        anyhow::ensure!(
            Contender::parse(o).is_some() || Scenario::parse(o).is_some(),
            "--only: {o:?} is neither a contender ({}) nor a scenario ({})",
            Contender::ALL.map(Contender::name).join(", "),
            Scenario::ALL.map(Scenario::name).join(", ")
        );
    }

    let machine_before = remora_test_support::results::machine();
    let node = Node::shared().await.context("the real node")?;
    let client = node.client()?;
    let guard_before = node.guard_drops().await?;
    println!(
        "| contender | scenario | ingress lag | sent | failed | failures by cause | ingress p50 / p99 | stop p50 / max | how the old pods ended |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut rows = Vec::new();
    // Contenders interleaved inside each (scenario, lag): the machine's
    // noise falls on all of them alike.
    for scenario in &scenarios {
        for lag in &args.lag {
            let mut by_contender: BTreeMap<usize, Vec<RunResult>> = BTreeMap::new();
            for _ in 0..args.cycles {
                for (i, contender) in contenders.iter().enumerate() {
                    let r = Run {
                        contender: *contender,
                        scenario: *scenario,
                        replicas: args.replicas,
                        ingress_lag: *lag,
                        clients: if args.keep_alive_only {
                            Clients::KeepAlive
                        } else {
                            Clients::All
                        },
                        rate: args.rate,
                        settle: Duration::from_secs(3),
                    };
                    let result = run(node, &client, &r).await.with_context(|| {
                        format!("{} / {} / {lag:?}", contender.name(), scenario.name())
                    })?;
                    by_contender.entry(i).or_default().push(result);
                }
            }
            for (_, results) in by_contender {
                if let Some(r) = row(results) {
                    print_row(&r);
                    rows.push(r);
                }
            }
        }
    }
    let guard = node.guard_drops().await? - guard_before;
    println!("egress guard: {guard} packets dropped during the run");
    let out = args
        .out
        .unwrap_or_else(|| repo_root().join("bench/results/lifecycle-node.json"));
    let mut doc = remora_test_support::results::stamp(&machine_before);
    e2e::node::stamp_images(&mut doc);
    doc.insert(
        "machine_after".into(),
        remora_test_support::results::machine(),
    );
    doc.insert(
        "node".into(),
        serde_json::json!("the project's single real node (kubelet, containerd, kube-proxy, CNI bridge) on the machine above"),
    );
    doc.insert(
        "not_covered".into(),
        serde_json::json!("one node; the ingress is the harness's own with a fixed lag; the test app; one rollout per row unless cycles > 1"),
    );
    doc.insert("egress_guard_drops".into(), serde_json::json!(guard));
    doc.insert("rows".into(), serde_json::to_value(&rows)?);
    std::fs::write(&out, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("writing {}", out.display()))?;
    println!("wrote {}", out.display());
    anyhow::ensure!(guard == 0, "the egress guard dropped {guard} packets");
    Ok(())
}
