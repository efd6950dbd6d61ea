//! Benchmark of the operator (not run by `cargo test`):
//! - webhook latency p50/p99/max at a fixed rate of AdmissionReviews over
//!   HTTPS keep-alive, against the real server in a child process (so its
//!   RSS is its own); a request held up behind the previous one on its
//!   connection is counted from its scheduled time (no coordinated omission);
//! - offline injection throughput (documents/s) and bare `mutate` throughput;
//! - the server's RSS after the run (VmRSS, VmHWM).
//!
//! `cargo bench -p remora-operator --bench injector` (options after `--`)
//! writes a table to stdout and JSON to `bench/results/injector.json`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use remora_crds::{
    DurationString, ShutdownSpec, SidecarLifecycleSpec, SidecarMode, WorkloadSelector,
};
use remora_inject::offline::{OfflineOptions, inject_stream};
use remora_inject::patch::{Selection, Target, mutate};
use remora_inject::resolve::{ChartDefaults, EffectiveConfig, LifecycleEntry};
use remora_inject::review::encode;
use remora_operator::webhook::handler::Injector;
use remora_operator::webhook::server::{AppState, router, serve_tls};
use remora_operator::webhook::tls::ReloadingCert;
use remora_operator::webhook::view::StaticView;
use remora_test_support::pki::self_signed;
use remora_test_support::results;
use remora_test_support::webhook_client;
use serde_json::{Value, json};

// The webhook allocates and frees many small JSON values per request.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(name = "injector")]
struct Args {
    /// Reviews per second, spread over the connections.
    #[arg(long, default_value_t = 500)]
    rate: u32,
    /// Measured duration of the latency run.
    #[arg(long, value_parser = remora_contract::duration::parse, default_value = "20s")]
    duration: Duration,
    /// Unmeasured warm-up before it.
    #[arg(long, value_parser = remora_contract::duration::parse, default_value = "2s")]
    warmup: Duration,
    /// Keep-alive HTTPS connections.
    #[arg(long, default_value_t = 4)]
    connections: u32,
    /// Documents in the offline throughput run.
    #[arg(long, default_value_t = 2000)]
    documents: usize,
    /// Where the JSON results go (`cargo bench` runs in the crate's directory).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/results/injector.json"))]
    out: PathBuf,
    /// Internal: run as the server child; cert and key files follow.
    #[arg(long, hide = true, num_args = 2)]
    serve_child: Option<Vec<PathBuf>>,
    /// Passed by `cargo bench`; nothing to do.
    #[arg(long, hide = true)]
    bench: bool,
}

fn view() -> StaticView {
    let mut lifecycles = Vec::new();
    // A realistic store: a few dozen resources, one of which matches.
    for i in 0..40 {
        lifecycles.push(LifecycleEntry {
            namespace: if i % 2 == 0 {
                "shop".into()
            } else {
                format!("ns{i}")
            },
            name: format!("slc{i}"),
            created: Some(format!("2026-01-{:02}T00:00:00Z", 1 + i % 28)),
            spec: SidecarLifecycleSpec {
                selector: Some(WorkloadSelector {
                    match_labels: BTreeMap::from([("app".into(), format!("app{i}"))]),
                }),
                shutdown: Some(ShutdownSpec {
                    termination_drain_duration: Some(DurationString::new("3s")),
                    ..Default::default()
                }),
                ..Default::default()
            },
        });
    }
    StaticView {
        lifecycles,
        namespaces: BTreeMap::from([(
            "shop".to_string(),
            BTreeMap::from([("remora.dev/inject".to_string(), "enabled".to_string())]),
        )]),
        native_sidecars: true,
    }
}

fn pod(i: u64) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "web-", "namespace": "shop",
            "labels": {"app": "app2", "pod-template-hash": format!("{i:x}")},
            "annotations": {"prometheus.io/scrape": "true"}},
        "spec": {
            "serviceAccountName": "web",
            "terminationGracePeriodSeconds": 30,
            "containers": [{"name": "app", "image": "example/web:1.2.3",
                "ports": [{"containerPort": 8080, "name": "http"}],
                "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
                "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}}}],
            "volumes": [{"name": "token", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}}]
        }
    })
}

fn review(i: u64) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": format!("00000000-0000-0000-0000-{i:012}"),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "shop",
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": pod(i),
            "dryRun": false
        }
    }))
    .unwrap_or_default()
}

fn serve_child(cert: PathBuf, key: PathBuf) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let cert = ReloadingCert::load(cert, key)?;
        let tls = Arc::new(cert.server_config()?);
        let state = Arc::new(AppState::new(
            Injector {
                chart: ChartDefaults::default(),
                operator_namespace: "remora-system".into(),
                view: Arc::new(view()),
            },
            8 << 20,
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        println!("{}", listener.local_addr()?);
        // The parent closes our stdin to stop us.
        let stop = tokio::task::spawn_blocking(|| {
            let mut s = String::new();
            let _ = std::io::stdin().read_line(&mut s);
        });
        serve_tls(listener, tls, router(state), async move {
            let _ = stop.await;
        })
        .await?;
        anyhow::Ok(())
    })
}

fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// The machine is shared: record how busy it was.
fn load_avg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .next()
        .unwrap_or("?")
        .to_string()
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

struct LatencyRun {
    sent: usize,
    errors: usize,
    /// From the send, or from the scheduled time when the request was held
    /// up by the previous one on its connection (queueing included).
    samples: Vec<Duration>,
    /// From the moment each request was actually written.
    service: Vec<Duration>,
    achieved_rate: f64,
}

async fn latency_run(
    args: &Args,
    addr: std::net::SocketAddr,
    ca: &str,
) -> anyhow::Result<LatencyRun> {
    let bodies: Arc<Vec<Vec<u8>>> = Arc::new((0..64).map(review).collect());
    let per_conn = f64::from(args.rate) / f64::from(args.connections);
    let interval = Duration::from_secs_f64(1.0 / per_conn);
    let total = args.warmup + args.duration;
    let start = Instant::now() + Duration::from_millis(100);
    let mut tasks = Vec::new();
    for c in 0..args.connections {
        let mut conn = webhook_client::connect(addr, "localhost", ca).await?;
        let bodies = Arc::clone(&bodies);
        let warmup = args.warmup;
        // Stagger the connections so the aggregate schedule is even.
        let offset = interval.mul_f64(f64::from(c) / f64::from(args.connections));
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            let (mut sent, mut errors) = (0usize, 0usize);
            let mut k: u32 = 0;
            let mut prev_end = start;
            loop {
                let due = start + offset + interval * k;
                if due.duration_since(start) >= total {
                    break;
                }
                tokio::time::sleep_until(due.into()).await;
                let sent_at = Instant::now();
                let body = bodies[(k as usize) % bodies.len()].clone();
                let ok = matches!(
                    conn.request(http::Method::POST, "/inject", body).await,
                    Ok((s, b)) if s.is_success() && b.windows(9).any(|w| w == b"JSONPatch")
                );
                // Backlogged (the previous answer came after this one was
                // due): count from the due time, so slow answers are not
                // hidden. Otherwise count from the send, leaving out the
                // client's timer lateness (tokio's timer ticks in 1 ms).
                let took = if prev_end > due {
                    due.elapsed()
                } else {
                    sent_at.elapsed()
                };
                prev_end = Instant::now();
                let service = sent_at.elapsed();
                sent += 1;
                if !ok {
                    errors += 1;
                }
                if due.duration_since(start) >= warmup {
                    samples.push((took, service));
                }
                k += 1;
            }
            (samples, sent, errors)
        }));
    }
    let mut run = LatencyRun {
        sent: 0,
        errors: 0,
        samples: Vec::new(),
        service: Vec::new(),
        achieved_rate: 0.0,
    };
    for t in tasks {
        let (s, sent, errors) = t.await?;
        run.samples.extend(s.iter().map(|(t, _)| *t));
        run.service.extend(s.iter().map(|(_, v)| *v));
        run.sent += sent;
        run.errors += errors;
    }
    run.achieved_rate = run.samples.len() as f64 / args.duration.as_secs_f64();
    run.samples.sort();
    run.service.sort();
    Ok(run)
}

fn offline_run(docs: usize) -> anyhow::Result<(f64, f64, f64)> {
    let deployment = "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: web\n  namespace: shop\nspec:\n  replicas: 2\n  selector:\n    matchLabels: {app: web}\n  template:\n    metadata:\n      labels: {app: web}\n    spec:\n      containers:\n      - name: app\n        image: example/web:1\n        ports: [{containerPort: 8080}]\n---\napiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  ports: [{port: 80}]\n";
    let input: String = std::iter::repeat_n(format!("---\n{deployment}"), docs / 2).collect();
    let opts = OfflineOptions {
        mode: Some(SidecarMode::Native),
        ..OfflineOptions::default()
    };
    let t = Instant::now();
    let (out, report) = inject_stream(&input, &opts)?;
    let took = t.elapsed().as_secs_f64();
    anyhow::ensure!(report.injected == docs / 2, "injected {}", report.injected);
    let docs_per_s = report.documents as f64 / took;
    let mib_per_s = (input.len() + out.len()) as f64 / (1 << 20) as f64 / took;

    let cfg = EffectiveConfig::from_defaults(&ChartDefaults::default());
    let labels = BTreeMap::from([("remora.dev/inject".to_string(), "enabled".to_string())]);
    let target = Target {
        namespace: "shop",
        namespace_labels: &labels,
        native_sidecars: true,
        selection: Selection::Webhook,
    };
    let p = pod(1);
    let n = 20_000;
    let t = Instant::now();
    for _ in 0..n {
        std::hint::black_box(mutate(std::hint::black_box(&p), &target, &cfg)?);
    }
    let mutate_per_s = f64::from(n) / t.elapsed().as_secs_f64();
    Ok((docs_per_s, mib_per_s, mutate_per_s))
}

/// The handler's own cost, in process: decode, resolve, mutate, encode.
fn review_cost_us() -> f64 {
    let inj = Injector {
        chart: ChartDefaults::default(),
        operator_namespace: "remora-system".into(),
        view: Arc::new(view()),
    };
    let body = review(1);
    let n = 5_000;
    let t = Instant::now();
    for _ in 0..n {
        let (rev, _) = futures::executor::block_on(inj.review(std::hint::black_box(&body)));
        std::hint::black_box(encode(rev).unwrap_or_default());
    }
    t.elapsed().as_secs_f64() * 1e6 / f64::from(n)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(files) = &args.serve_child {
        let [cert, key] = files.as_slice() else {
            anyhow::bail!("--serve-child takes CERT KEY");
        };
        return serve_child(cert.clone(), key.clone());
    }
    let machine_before = results::machine();
    let dir = tempfile::tempdir()?;
    let serving = self_signed(&["localhost"]);
    let (cert_file, key_file) = serving.write_pem(dir.path(), "tls.crt", "tls.key")?;
    let mut child = Command::new(std::env::current_exe()?)
        .arg("--serve-child")
        .arg(cert_file)
        .arg(key_file)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the server child")?;
    let pid = child.id();
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("child stdout")?).read_line(&mut line)?;
    let addr: std::net::SocketAddr = line.trim().parse().context("child address")?;
    let (rss_idle, _) = rss_kib(pid);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let run = rt.block_on(latency_run(&args, addr, &serving.chain))?;
    let (rss, hwm) = rss_kib(pid);
    drop(child.stdin.take()); // stops the child
    let _ = child.wait();

    let (docs_per_s, mib_per_s, mutate_per_s) = offline_run(args.documents)?;
    let review_us = review_cost_us();

    let p50 = pct(&run.samples, 0.50);
    let p90 = pct(&run.samples, 0.90);
    let p99 = pct(&run.samples, 0.99);
    let max = run.samples.last().copied().unwrap_or_default();
    let goal_met = p99 <= Duration::from_millis(2);
    println!("| metric | value |");
    println!("| --- | --- |");
    println!(
        "| target rate (reviews/s, {} keep-alive HTTPS conns) | {} |",
        args.connections, args.rate
    );
    println!("| achieved rate (reviews/s) | {:.1} |", run.achieved_rate);
    println!(
        "| measured reviews / errors | {} / {} |",
        run.samples.len(),
        run.errors
    );
    println!("| latency p50 (ms) | {:.3} |", ms(p50));
    println!("| latency p90 (ms) | {:.3} |", ms(p90));
    println!(
        "| latency p99 (ms) | {:.3} (goal <= 2 ms: {}) |",
        ms(p99),
        if goal_met { "met" } else { "MISSED" }
    );
    println!("| latency max (ms) | {:.3} |", ms(max));
    println!(
        "| service time from actual send p50 / p99 (ms) | {:.3} / {:.3} |",
        ms(pct(&run.service, 0.5)),
        ms(pct(&run.service, 0.99))
    );
    println!(
        "| server RSS idle / after run / peak (MiB) | {:.1} / {:.1} / {:.1} |",
        rss_idle as f64 / 1024.0,
        rss as f64 / 1024.0,
        hwm as f64 / 1024.0
    );
    println!("| offline inject (documents/s, half Deployments) | {docs_per_s:.0} |");
    println!("| offline inject (MiB/s, in + out) | {mib_per_s:.1} |");
    println!("| mutate only (pods/s, one thread) | {mutate_per_s:.0} |");
    println!(
        "| handler cost in process (µs/review: decode+resolve+mutate+encode) | {review_us:.1} |"
    );
    println!("| load average while running (1 min) | {} |", load_avg());

    let result = json!({
        "webhook": {
            "target_rate": args.rate,
            "connections": args.connections,
            "duration_s": args.duration.as_secs_f64(),
            "achieved_rate": run.achieved_rate,
            "measured": run.samples.len(),
            "sent": run.sent,
            "errors": run.errors,
            "latency_ms": {"p50": ms(p50), "p90": ms(p90), "p99": ms(p99), "max": ms(max)},
            "service_ms": {"p50": ms(pct(&run.service, 0.5)), "p99": ms(pct(&run.service, 0.99))},
            "p99_goal_ms": 2.0,
            "p99_goal_met": goal_met,
        },
        "server_rss_kib": {"idle": rss_idle, "after_run": rss, "peak": hwm},
        "offline": {"documents_per_s": docs_per_s, "mib_per_s": mib_per_s, "documents": args.documents},
        "mutate_pods_per_s": mutate_per_s,
        "handler_us_per_review": review_us,
        "load_avg_1m": load_avg(),
    });
    let doc = results::document(&machine_before, result);
    results::write(&args.out, &doc)?;
    println!("\nwrote {}", args.out.display());
    Ok(())
}
