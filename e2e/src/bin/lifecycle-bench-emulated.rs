//! Rolling replacements of emulated pods (pod runner + remora-agent + real
//! Envoy + test-app) under steady load, per sidecar mode; counts every lost
//! request. The real-node benchmark is `lifecycle-bench`; this one stays for
//! what the node does not give cheaply (hot restart, Envoy crash and cert
//! rotation under load, many cycles). Its load balancer, a fixed endpoint lag
//! and client-side balancing, is the emulator's, not a real one.
//!
//! `cargo run -p e2e --release --bin lifecycle-bench-emulated -- --cycles 50`
//! (needs `cargo build --release -p remora-agent -p remora-operator` first).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use e2e::podrunner::{Pod, PodSpec, RunnerOptions, Service, children};
use e2e::traffic::{self, LoadSummary, Sample};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use remora_test_support::bins::{envoy_bin, sibling_bin};
use serde_json::json;
use tokio::time::Instant;

const MODES: [&str; 4] = [
    "baseline",
    "remora-legacy",
    "remora-native",
    "remora-legacy-exit-on-zero",
];
/// Scenarios on a running pod pair, reported separately from the modes.
const EXTRAS: [&str; 3] = ["envoy-crash", "hot-restart", "cert-rotation"];

#[derive(Parser, Debug)]
struct Args {
    /// Rolling replacements per mode.
    #[arg(long, default_value_t = 50)]
    cycles: u32,
    /// Requests per second, spread over the ready pods.
    #[arg(long, default_value_t = 300)]
    rate: u32,
    /// Modes to run (default: all).
    #[arg(long, value_delimiter = ',')]
    modes: Vec<String>,
    /// Endpoint propagation lag (readiness/termination → load balancer).
    #[arg(long, value_parser = remora_contract::duration::parse, default_value = "300ms")]
    endpoint_lag: Duration,
    /// Upper bound of the probe periods (spec periods are 1-2 s).
    #[arg(long, value_parser = remora_contract::duration::parse, default_value = "200ms")]
    probe_period: Duration,
    /// Skip the extra scenarios (Envoy crash, hot restart, cert rotation).
    #[arg(long)]
    no_extras: bool,
    /// Run only these modes and extras (e.g. `--only cert-rotation`);
    /// overrides --modes and --no-extras.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Update the entries that ran in the existing --out JSON and keep the
    /// others (the SVG is redrawn only when a mode ran).
    #[arg(long)]
    merge: bool,
    /// cert-rotation: how many times the serving certificate is rotated.
    #[arg(long, default_value_t = 10)]
    rotations: u32,
    /// cert-rotation: time between rotations.
    #[arg(long, value_parser = remora_contract::duration::parse, default_value = "1s")]
    rotation_interval: Duration,
    /// JSON report.
    #[arg(long, default_value = "bench/results/lifecycle.json")]
    out: PathBuf,
    /// SVG plot of failures over time (skipped when empty).
    #[arg(long, default_value = "bench/results/lifecycle.svg")]
    svg: String,
}

/// The test app's pod template, before injection. The app starts slower than
/// Envoy (300 ms), fetches config through the sidecar's outbound listener at
/// startup, keeps serving 1 s after SIGTERM and calls out during shutdown.
fn app_container() -> &'static str {
    r#"      - name: app
        image: remora/test-app:dev
        command: [test-app]
        args:
          - --port=8080
          - --startup-delay=300ms
          - --delay=5ms
          - --shutdown-delay=1s
          - --startup-call=http://127.0.0.1:15001/
          - --shutdown-call=http://127.0.0.1:15001/
        ports: [{containerPort: 8080}]
        readinessProbe:
          httpGet: {port: 8080, path: /}
          periodSeconds: 1
"#
}

fn deployment(annotations: &str, extra_container: &str) -> String {
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  namespace: bench
spec:
  selector: {{matchLabels: {{app: web}}}}
  template:
    metadata:
      labels: {{app: web, remora.dev/inject: "true"}}
      annotations:
{annotations}    spec:
      terminationGracePeriodSeconds: 10
      containers:
{extra_container}{app}"#,
        app = app_container()
    )
}

/// The pod spec for a mode: Remora modes go through `remora-operator inject`.
fn pod_yaml(mode: &str) -> anyhow::Result<String> {
    let mut ann = String::from(
        "        remora.dev/termination-drain-duration: 1s\n        remora.dev/drain-duration: 3s\n",
    );
    if mode == "baseline" {
        // A plain Envoy sidecar: no ordering, no hold, no hooks; Envoy gets
        // SIGTERM with everything else and exits at once.
        let envoy = r#"      - name: envoy
        image: envoyproxy/envoy:v1.40.0
        readinessProbe:
          httpGet: {port: 15000, path: /ready}
          periodSeconds: 1
"#;
        return Ok(deployment("        bench: baseline\n", envoy));
    }
    if mode == "remora-legacy-exit-on-zero" {
        ann.push_str(
            "        remora.dev/exit-on-zero-active-connections: \"true\"\n        remora.dev/minimum-drain-duration: 500ms\n",
        );
    }
    let inj_mode = if mode == "remora-native" {
        "Native"
    } else {
        "Legacy"
    };
    let mut child = std::process::Command::new(sibling_bin("remora-operator")?)
        .args(["inject", "-f", "-", "--mode", inj_mode])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(deployment(&ann, "").as_bytes())?;
    let out = child.wait_with_output()?;
    anyhow::ensure!(
        out.status.success(),
        "remora-operator inject failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

#[derive(Default, Clone, serde::Serialize, serde::Deserialize)]
#[serde(default)]
struct ModeReport {
    mode: String,
    cycles: u32,
    rate: u32,
    sent: usize,
    failed: usize,
    failed_at_start: usize,
    failed_at_stop: usize,
    failed_other: usize,
    inbound_sent: usize,
    inbound_failed: usize,
    outbound_calls: usize,
    outbound_failed_at_start: usize,
    outbound_failed_at_stop: usize,
    p50_ms: f64,
    p99_ms: f64,
    shutdown_p50_ms: f64,
    shutdown_max_ms: f64,
    /// Seconds (since the load started) of each failed request.
    failure_times_s: Vec<f64>,
    errors: BTreeMap<String, usize>,
    /// cert-rotation only.
    #[serde(skip_serializing_if = "Option::is_none")]
    rotation: Option<cert_rotation::RotationReport>,
}

struct Run {
    opts: RunnerOptions,
    spec: PodSpec,
    service: Service,
    epoch: Instant,
    /// pod name → (ready at, stop requested at), since `epoch`.
    events: BTreeMap<String, (Option<Duration>, Option<Duration>)>,
    logs: Vec<PathBuf>,
    shutdowns: Vec<Duration>,
    serial: u32,
}

impl Run {
    /// A run of `mode`'s pod spec, its pods' directories under `base`.
    fn new(mode: &str, args: &Args, base: &std::path::Path, upstream: u16) -> anyhow::Result<Self> {
        Ok(Self {
            opts: options(args, base, upstream)?,
            spec: PodSpec::from_yaml(&pod_yaml(mode)?)?,
            service: Service::new(args.endpoint_lag),
            epoch: Instant::now(),
            events: BTreeMap::new(),
            logs: Vec::new(),
            shutdowns: Vec::new(),
            serial: 0,
        })
    }

    async fn start_pod(&mut self) -> anyhow::Result<Arc<Pod>> {
        self.serial += 1;
        let mut spec = self.spec.clone();
        spec.name = format!("web-{}", self.serial);
        let name = spec.name.clone();
        let pod = Pod::start(spec, &self.opts)
            .await
            .with_context(|| format!("starting {name}"))?;
        self.service.track(&pod, 15006);
        if !self
            .service
            .wait_endpoint(&name, true, Duration::from_secs(30))
            .await
        {
            let mut logs = String::new();
            for c in ["remora-proxy", "remora-proxy.hooks", "envoy", "app"] {
                let text = std::fs::read_to_string(pod.log_path(c)).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(8).collect();
                logs.push_str(&format!("--- {c}\n"));
                for l in tail.into_iter().rev() {
                    logs.push_str(l);
                    logs.push('\n');
                }
            }
            anyhow::bail!("{name} never became an endpoint; last log lines:\n{logs}");
        }
        self.events.insert(name, (Some(self.epoch.elapsed()), None));
        self.logs.push(pod.log_path("app"));
        Ok(pod)
    }

    fn stop_pod(&mut self, pod: Arc<Pod>) -> tokio::task::JoinHandle<Duration> {
        if let Some(e) = self.events.get_mut(&pod.spec.name) {
            e.1 = Some(self.epoch.elapsed());
        }
        tokio::spawn(async move { pod.stop().await.duration })
    }
}

fn options(args: &Args, base: &std::path::Path, upstream: u16) -> anyhow::Result<RunnerOptions> {
    Ok(RunnerOptions {
        agent_bin: sibling_bin("remora-agent")?,
        envoy_bin: envoy_bin()?,
        images: vec![("test-app".into(), sibling_bin("test-app")?)],
        inbound: vec![(15006, 8080)],
        outbound_upstream: Some(([127, 0, 0, 1], upstream).into()),
        max_probe_period: args.probe_period,
        base_dir: base.to_path_buf(),
        secrets: Default::default(),
        restart_backoff: RunnerOptions::KUBELET_BACKOFF.0,
        max_restart_backoff: RunnerOptions::KUBELET_BACKOFF.1,
    })
}

/// What the app's own log says about its outbound calls: (calls, failed at
/// start, failed at stop).
fn outbound_calls(logs: &[PathBuf]) -> (usize, usize, usize) {
    let (mut calls, mut start, mut stop) = (0, 0, 0);
    for l in logs {
        let text = std::fs::read_to_string(l).unwrap_or_default();
        for line in text.lines() {
            let failed = line.contains(" failed");
            if line.starts_with("test-app: startup call") {
                calls += 1;
                start += usize::from(failed);
            } else if line.starts_with("test-app: shutdown call") {
                calls += 1;
                stop += usize::from(failed);
            }
        }
    }
    (calls, start, stop)
}

fn report(mode: &str, args: &Args, cycles: u32, run: &Run, samples: &[Sample]) -> ModeReport {
    let s = LoadSummary::of(samples);
    let (mut at_start, mut at_stop, mut other) = (0, 0, 0);
    let mut errors = BTreeMap::new();
    let mut times = Vec::new();
    for x in samples.iter().filter(|x| !x.outcome.is_ok()) {
        times.push(x.at.as_secs_f64());
        let err = x.outcome.to_string();
        *errors.entry(err).or_insert(0) += 1;
        let ev = x.pod.as_ref().and_then(|p| run.events.get(p));
        match ev {
            Some((_, Some(stop))) if x.at + Duration::from_millis(50) >= *stop => at_stop += 1,
            Some((Some(ready), _)) if x.at <= *ready + Duration::from_secs(2) => at_start += 1,
            _ => other += 1,
        }
    }
    let (calls, out_start, out_stop) = outbound_calls(&run.logs);
    let mut sd: Vec<f64> = run
        .shutdowns
        .iter()
        .map(|d| d.as_secs_f64() * 1e3)
        .collect();
    sd.sort_by(|a, b| a.total_cmp(b));
    ModeReport {
        mode: mode.into(),
        cycles,
        rate: args.rate,
        sent: s.sent + calls,
        failed: s.failed + out_start + out_stop,
        failed_at_start: at_start + out_start,
        failed_at_stop: at_stop + out_stop,
        failed_other: other,
        inbound_sent: s.sent,
        inbound_failed: s.failed,
        outbound_calls: calls,
        outbound_failed_at_start: out_start,
        outbound_failed_at_stop: out_stop,
        p50_ms: s.latency.p50_ms,
        p99_ms: s.latency.p99_ms,
        shutdown_p50_ms: sd.get(sd.len() / 2).copied().unwrap_or(0.0),
        shutdown_max_ms: sd.last().copied().unwrap_or(0.0),
        failure_times_s: times,
        errors,
        rotation: None,
    }
}

/// Two replicas, then `cycles` rolling replacements: start a new pod, wait
/// until it is an endpoint, stop the oldest (the next cycle's start overlaps
/// that stop; two stops never overlap).
async fn rolling(mode: &str, args: &Args, upstream: u16) -> anyhow::Result<ModeReport> {
    let base = tempfile::Builder::new().prefix("remora-pods-").tempdir()?;
    let mut run = Run::new(mode, args, base.path(), upstream)?;
    let mut pods = std::collections::VecDeque::new();
    for _ in 0..2 {
        pods.push_back(run.start_pod().await?);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let svc = run.service.clone();
    let load = tokio::spawn(traffic::run_balanced(
        move || svc.snapshot(),
        args.rate,
        Duration::from_secs(1),
        run.epoch,
        stop.clone(),
    ));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut stopping: Option<tokio::task::JoinHandle<Duration>> = None;
    let result = async {
        for _ in 0..args.cycles {
            let new = run.start_pod().await?;
            if let Some(h) = stopping.take() {
                run.shutdowns.push(h.await?);
            }
            if let Some(old) = pods.pop_front() {
                stopping = Some(run.stop_pod(old));
            }
            pods.push_back(new);
        }
        if let Some(h) = stopping.take() {
            run.shutdowns.push(h.await?);
        }
        anyhow::Ok(())
    }
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let samples = load.await?;
    result?;
    for p in pods.drain(..) {
        run.stop_pod(p).await?;
    }
    if std::env::var_os("REMORA_E2E_KEEP").is_some() {
        eprintln!("pod directories kept in {}", base.keep().display());
    }
    Ok(report(mode, args, args.cycles, &run, &samples))
}

/// Disruptions of a running Remora pod under load: `kill -9` of Envoy (the
/// agent restarts it) or SIGHUP to the agent (hot restart).
async fn disrupt(kind: &str, args: &Args, upstream: u16, times: u32) -> anyhow::Result<ModeReport> {
    let base = tempfile::Builder::new().prefix("remora-pods-").tempdir()?;
    let mut run = Run::new("remora-legacy", args, base.path(), upstream)?;
    let pods = vec![run.start_pod().await?, run.start_pod().await?];
    let stop = Arc::new(AtomicBool::new(false));
    let svc = run.service.clone();
    let load = tokio::spawn(traffic::run_balanced(
        move || svc.snapshot(),
        args.rate,
        Duration::from_secs(1),
        run.epoch,
        stop.clone(),
    ));
    for i in 0..times {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let pod = &pods[i as usize % pods.len()];
        let agent = pod.pid("remora-proxy").context("no agent")?;
        match kind {
            "envoy-crash" => {
                for envoy in children(agent) {
                    let _ = kill(Pid::from_raw(envoy), Signal::SIGKILL);
                }
            }
            _ => {
                let _ = kill(Pid::from_raw(agent), Signal::SIGHUP);
            }
        }
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::SeqCst);
    let samples = load.await?;
    for p in pods {
        run.stop_pod(p).await?;
    }
    // The pods were not replaced: every failure is "other".
    run.events.clear();
    Ok(report(kind, args, times, &run, &samples))
}

fn svg(reports: &[ModeReport]) -> String {
    let max_t = reports
        .iter()
        .flat_map(|r| r.failure_times_s.iter().copied())
        .fold(1.0_f64, f64::max);
    let (w, row) = (900.0, 40.0);
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" font-size="12">"#,
        w + 220.0,
        row * reports.len() as f64 + 40.0
    );
    s.push_str(r#"<rect width="100%" height="100%" fill="white"/>"#);
    for (i, r) in reports.iter().enumerate() {
        let y = 20.0 + row * i as f64 + row / 2.0;
        s.push_str(&format!(
            r#"<text x="5" y="{:.0}">{} ({} failed)</text><line x1="210" x2="{}" y1="{y}" y2="{y}" stroke="lightgray"/>"#,
            y + 4.0,
            r.mode,
            r.failed,
            210.0 + w
        ));
        for t in &r.failure_times_s {
            s.push_str(&format!(
                r#"<circle cx="{:.1}" cy="{y}" r="2" fill="red"/>"#,
                210.0 + w * t / max_t
            ));
        }
    }
    s.push_str(&format!(
        r#"<text x="210" y="{:.0}">0 s</text><text x="{:.0}" y="{:.0}">{max_t:.0} s (failed requests over time)</text></svg>"#,
        row * reports.len() as f64 + 35.0,
        w - 60.0,
        row * reports.len() as f64 + 35.0
    ));
    s
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let machine_before = remora_test_support::results::machine();
    let (modes, extras_to_run): (Vec<String>, Vec<String>) = if !args.only.is_empty() {
        for n in &args.only {
            anyhow::ensure!(
                MODES.contains(&n.as_str()) || EXTRAS.contains(&n.as_str()),
                "unknown mode or scenario {n:?} (modes: {MODES:?}, extras: {EXTRAS:?})"
            );
        }
        let pick = |set: &[&str]| {
            args.only
                .iter()
                .filter(|n| set.contains(&n.as_str()))
                .cloned()
                .collect()
        };
        (pick(&MODES), pick(&EXTRAS))
    } else {
        let modes = if args.modes.is_empty() {
            MODES.iter().map(|m| m.to_string()).collect()
        } else {
            args.modes.clone()
        };
        let extras = if args.no_extras {
            Vec::new()
        } else {
            EXTRAS.iter().map(|m| m.to_string()).collect()
        };
        (modes, extras)
    };
    // The outbound upstream the apps call through their sidecars.
    let upstream = e2e::podrunner::free_port()?;
    let mut upstream_proc = tokio::process::Command::new(sibling_bin("test-app")?)
        .args([
            "--address",
            "127.0.0.1",
            "--port",
            &upstream.to_string(),
            "--delay",
            "1ms",
        ])
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let mut reports = Vec::new();
    for m in &modes {
        anyhow::ensure!(MODES.contains(&m.as_str()), "unknown mode {m:?}");
        eprintln!("running {m}: {} cycles at {} rps", args.cycles, args.rate);
        reports.push(rolling(m, &args, upstream).await?);
    }
    let mut extras = Vec::new();
    for kind in &extras_to_run {
        eprintln!("running {kind}");
        extras.push(match kind.as_str() {
            "cert-rotation" => cert_rotation::run(&args, upstream).await?,
            _ => disrupt(kind, &args, upstream, 3).await?,
        });
    }
    let _ = upstream_proc.kill().await;

    println!(
        "{:<28} {:>6} {:>7} {:>7} {:>6} {:>6} {:>6} {:>8} {:>8} {:>10} {:>10}",
        "mode",
        "cycles",
        "sent",
        "failed",
        "start",
        "stop",
        "other",
        "p50 ms",
        "p99 ms",
        "stop p50",
        "stop max"
    );
    for r in reports.iter().chain(&extras) {
        println!(
            "{:<28} {:>6} {:>7} {:>7} {:>6} {:>6} {:>6} {:>8.1} {:>8.1} {:>9.0}ms {:>9.0}ms",
            r.mode,
            r.cycles,
            r.sent,
            r.failed,
            r.failed_at_start,
            r.failed_at_stop,
            r.failed_other,
            r.p50_ms,
            r.p99_ms,
            r.shutdown_p50_ms,
            r.shutdown_max_ms
        );
    }
    for r in &extras {
        if let Some(rot) = &r.rotation {
            println!("\n{}", rot.table());
        }
    }
    let data = json!({
        "rate_rps": args.rate,
        "cycles": args.cycles,
        "endpoint_lag_ms": args.endpoint_lag.as_millis() as u64,
        "probe_period_ms": args.probe_period.as_millis() as u64,
        "modes": reports,
        "disruptions": extras,
    });
    let doc = if args.merge && args.out.exists() {
        let old = read_doc(&std::fs::read_to_string(&args.out)?)
            .with_context(|| format!("{} is not JSON", args.out.display()))?;
        let mut update = remora_test_support::results::stamp(&machine_before);
        update.insert(
            "machine_after".into(),
            remora_test_support::results::machine(),
        );
        merge(old, &reports, &extras, update)?
    } else {
        remora_test_support::results::document(&machine_before, data)
    };
    remora_test_support::results::write(&args.out, &doc)?;
    if !args.svg.is_empty() && !reports.is_empty() {
        let all: Vec<ModeReport> = serde_json::from_value(doc["modes"].clone())?;
        std::fs::write(&args.svg, svg(&all))?;
    }
    Ok(())
}

/// A results document, read so that writing it back changes nothing:
/// serde_json's default float parsing can be one ulp off, serde-saphyr
/// (YAML is a superset of JSON) parses floats exactly.
fn read_doc(text: &str) -> anyhow::Result<serde_json::Value> {
    Ok(serde_saphyr::from_str(text)?)
}

/// `old` with the entries that ran replaced (or added), and the stamp of the
/// run that produced them listed under `updates`; everything else kept as it
/// was, the top-level stamp included: the file is as old as its last full run.
fn merge(
    mut old: serde_json::Value,
    reports: &[ModeReport],
    extras: &[ModeReport],
    mut update: serde_json::Map<String, serde_json::Value>,
) -> anyhow::Result<serde_json::Value> {
    let mut names = Vec::new();
    for (key, list) in [("modes", reports), ("disruptions", extras)] {
        if !old[key].is_array() {
            old[key] = json!([]);
        }
        let arr = old[key].as_array_mut().context("array")?;
        for r in list {
            let v = serde_json::to_value(r)?;
            match arr.iter_mut().find(|e| e["mode"] == r.mode.as_str()) {
                Some(e) => *e = v,
                None => arr.push(v),
            }
            names.push(r.mode.clone());
        }
    }
    if !old["updates"].is_array() {
        old["updates"] = json!([]);
    }
    if let Some(u) = old["updates"].as_array_mut() {
        update.insert("entries".into(), json!(names));
        u.push(serde_json::Value::Object(update));
    }
    Ok(old)
}

/// `cert-rotation`: a Legacy pod pair whose sidecars terminate inbound mTLS
/// (`REMORA_INBOUND_TLS`) with the certificate of a Secret volume mounted at
/// `/etc/certs` (`REMORA_CERT_DIR`). Under TLS load, the Secret is updated
/// `--rotations` times and each pod's volume swapped the way the kubelet
/// does (`..data` symlink); after each swap, fresh handshakes to each pod
/// must show the new certificate.
mod cert_rotation {
    use std::net::SocketAddr;

    use e2e::certs::Pki;
    use e2e::podrunner::EnvValue;
    use e2e::traffic::{TlsClient, TlsConnector};
    use remora_agent::certs::DEFAULT_CERT_DIR;
    use remora_test_support::pki::new_key;

    use super::*;

    const SECRET: &str = "web-tls";
    const VOLUME: &str = "remora-certs";
    /// What the client verifies the server certificate against (the
    /// endpoints are addresses; the certificate names the Service).
    const SERVER_NAME: &str = "web.bench.svc";
    const SERVER_ID: &str = "spiffe://cluster.local/ns/bench/sa/default";
    /// The load generator's identity, the only one the sidecars admit.
    const CLIENT_ID: &str = "spiffe://cluster.local/ns/bench/sa/load";
    /// A rotation not seen by a fresh handshake within this counts as missed.
    const OBSERVE_DEADLINE: Duration = Duration::from_secs(10);
    /// Fresh handshakes after the first one that saw the new certificate,
    /// which must all see it too.
    const CONFIRM: usize = 3;

    #[derive(Default, Clone, Debug, serde::Serialize, serde::Deserialize)]
    #[serde(default)]
    pub struct RotationReport {
        pub rotations: u32,
        pub pods: u32,
        /// `rekey` (new key pair) and `renew` (same key, new certificate).
        pub kinds: BTreeMap<String, u32>,
        pub swap: String,
        /// (rotation, pod) pairs whose fresh handshakes saw the new certificate in time.
        pub observed: u32,
        pub expected: u32,
        /// From the `..data` swap to the start of the first fresh handshake
        /// that saw the new certificate.
        pub latency_p50_ms: f64,
        pub latency_max_ms: f64,
        pub latencies_ms: Vec<f64>,
        /// Fresh-connection requests (one full TLS handshake each, included in `sent`).
        pub handshakes: usize,
        pub handshakes_failed: usize,
        pub handshake_p50_ms: f64,
        /// Fresh handshakes that showed another certificate after the new one had been seen.
        pub stale_after_seen: usize,
        /// Envoy restarts of any kind during the load (epoch or pid changed), over all pods.
        pub envoy_restarts: u32,
        pub envoy_epochs: Vec<u32>,
        /// Steady-load requests by the serial of the certificate on their
        /// (keep-alive) connection: connections opened before a rotation
        /// keep their certificate and keep serving.
        pub load_requests_by_serial: BTreeMap<String, usize>,
    }

    impl RotationReport {
        pub fn table(&self) -> String {
            format!(
                "{:<14} {:>9} {:>5} {:>7} {:>9} {:>9} {:>10} {:>7} {:>6} {:>8}\n{:<14} {:>9} {:>5} {:>7} {:>7.1}ms {:>7.1}ms {:>10} {:>7} {:>6} {:>8}\n({}, each a `..data` swap of the pods' Secret volume; seen: a fresh handshake \
                 to the pod got the new certificate, timed from the swap)",
                "scenario",
                "rotations",
                "pods",
                "seen",
                "seen p50",
                "seen max",
                "handshakes",
                "failed",
                "stale",
                "restarts",
                "cert-rotation",
                self.rotations,
                self.pods,
                format!("{}/{}", self.observed, self.expected),
                self.latency_p50_ms,
                self.latency_max_ms,
                self.handshakes,
                self.handshakes_failed,
                self.stale_after_seen,
                self.envoy_restarts,
                self.kinds
                    .iter()
                    .map(|(k, n)| format!("{n} {k}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            )
        }
    }

    /// Mount the Secret into the sidecar at the contract's path and turn
    /// on inbound mTLS, admitting only the load generator's identity.
    fn with_certs(spec: &mut PodSpec) -> anyhow::Result<()> {
        spec.secret_volumes.push((VOLUME.into(), SECRET.into()));
        let sidecar = spec
            .init_containers
            .iter_mut()
            .chain(spec.containers.iter_mut())
            .find(|c| c.image.contains("remora-agent"))
            .context("no remora-agent container in the injected spec")?;
        sidecar
            .mounts
            .push((VOLUME.into(), DEFAULT_CERT_DIR.into()));
        for (k, v) in [
            ("REMORA_INBOUND_TLS", "true"),
            ("REMORA_CERT_DIR", DEFAULT_CERT_DIR),
            ("REMORA_INBOUND_TLS_SAN", CLIENT_ID),
        ] {
            sidecar.env.push((k.into(), EnvValue::Literal(v.into())));
        }
        Ok(())
    }

    /// Envoy's epoch and pid, from the agent's `/debug/config`.
    async fn envoy_state(pod: &Pod) -> anyhow::Result<(u32, Option<u64>)> {
        let port = pod.host_port(15020).context("no agent admin port")?;
        let r = remora_agent::http_client::HttpClient::new(Duration::from_secs(2))
            .get(&format!("http://127.0.0.1:{port}/debug/config"))
            .await?;
        let v: serde_json::Value = serde_json::from_str(&r.body)?;
        let epoch = v["envoy"]["epoch"].as_u64().context("no Envoy epoch")?;
        Ok((u32::try_from(epoch)?, v["envoy"]["pid"].as_u64()))
    }

    struct Observation {
        /// Swap → start of the first fresh handshake that saw the certificate.
        seen: Option<Duration>,
        stale: usize,
        samples: Vec<Sample>,
    }

    /// Fresh handshakes to `addr` until one shows `want` (or the deadline
    /// after `since`), then `CONFIRM` more that must show it too.
    async fn observe(
        client: TlsClient,
        pod: String,
        addr: SocketAddr,
        want: u64,
        since: Instant,
        epoch: Instant,
    ) -> Observation {
        let mut o = Observation {
            seen: None,
            stale: 0,
            samples: Vec::new(),
        };
        while o.seen.is_none() && since.elapsed() < OBSERVE_DEADLINE {
            let s = traffic::get(&client, "https", &pod, addr, epoch).await;
            let ok = s.outcome.is_ok();
            if ok && s.peer == Some(want) {
                o.seen = Some((epoch + s.at).saturating_duration_since(since));
            }
            o.samples.push(s);
            if !ok {
                // Counted as a failure; do not spin on a refused port.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        if o.seen.is_some() {
            for _ in 0..CONFIRM {
                let s = traffic::get(&client, "https", &pod, addr, epoch).await;
                o.stale += usize::from(s.outcome.is_ok() && s.peer != Some(want));
                o.samples.push(s);
            }
        }
        o
    }

    fn percentile(sorted: &[f64], p: f64) -> f64 {
        if sorted.is_empty() {
            return 0.0;
        }
        let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
        sorted[i.min(sorted.len() - 1)]
    }

    pub async fn run(args: &Args, upstream: u16) -> anyhow::Result<ModeReport> {
        let base = tempfile::Builder::new().prefix("remora-pods-").tempdir()?;
        let mut run = Run::new("remora-legacy", args, base.path(), upstream)?;
        with_certs(&mut run.spec)?;
        let pki = Pki::new("remora bench workload root", CLIENT_ID);
        let mut key = new_key();
        let first = pki.serving(0, &key, &[SERVER_NAME], SERVER_ID);
        let mut serials =
            std::collections::HashMap::from([(first.fingerprint, first.serial.clone())]);
        run.opts.secrets.set(SECRET, first.files.clone());
        let pods = vec![run.start_pod().await?, run.start_pod().await?];
        let connector = TlsConnector::new(pki.client_config()?, SERVER_NAME)?;
        let fresh = traffic::fresh_tls_client(connector.clone());
        let addr =
            |pod: &Pod| SocketAddr::from(([127, 0, 0, 1], pod.host_port(15006).unwrap_or(0)));

        // Both pods serve the first certificate before the load starts
        // (these handshakes are a precondition, not counted).
        for pod in &pods {
            let name = pod.spec.name.clone();
            let o = observe(
                fresh.clone(),
                name.clone(),
                addr(pod),
                first.fingerprint,
                Instant::now(),
                run.epoch,
            )
            .await;
            let last = o
                .samples
                .last()
                .map(|s| s.outcome.to_string())
                .unwrap_or_default();
            anyhow::ensure!(
                o.seen.is_some(),
                "{name} never served the first certificate (last error: {last})"
            );
        }
        let mut before = Vec::new();
        for pod in &pods {
            before.push(envoy_state(pod).await?);
        }

        let stop = Arc::new(AtomicBool::new(false));
        let svc = run.service.clone();
        let load = tokio::spawn(traffic::run_balanced_tls(
            move || svc.snapshot(),
            args.rate,
            Duration::from_secs(1),
            connector,
            run.epoch,
            stop.clone(),
        ));
        let mut rot = RotationReport {
            rotations: args.rotations,
            pods: u32::try_from(pods.len())?,
            swap: "kubelet AtomicWriter: ..<ts> directory, ..data symlink renamed over, old directory removed".into(),
            ..Default::default()
        };
        let mut latencies = Vec::new();
        let mut probes = Vec::new();
        let mut tick = tokio::time::interval(args.rotation_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        let result = async {
            for i in 1..=args.rotations {
                tick.tick().await;
                // Alternate a new key pair (cert-manager's `rotationPolicy:
                // Always`) with a renewal that keeps the key (`Never`).
                let kind = if i % 2 == 1 {
                    key = new_key();
                    "rekey"
                } else {
                    "renew"
                };
                *rot.kinds.entry(kind.into()).or_default() += 1;
                let next = pki.serving(u64::from(i), &key, &[SERVER_NAME], SERVER_ID);
                eprintln!("  rotation {i}: {kind}, serial {}", next.serial);
                serials.insert(next.fingerprint, next.serial.clone());
                run.opts.secrets.set(SECRET, next.files);
                let mut watches = tokio::task::JoinSet::new();
                for pod in &pods {
                    // Each pod's kubelet syncs its volume.
                    let swapped = Instant::now();
                    anyhow::ensure!(
                        !pod.sync_secrets()?.is_empty(),
                        "{}: the Secret volume did not change",
                        pod.spec.name
                    );
                    watches.spawn(observe(
                        fresh.clone(),
                        pod.spec.name.clone(),
                        addr(pod),
                        next.fingerprint,
                        swapped,
                        run.epoch,
                    ));
                }
                while let Some(o) = watches.join_next().await {
                    let o = o?;
                    rot.expected += 1;
                    if let Some(d) = o.seen {
                        rot.observed += 1;
                        latencies.push(d.as_secs_f64() * 1e3);
                    }
                    rot.stale_after_seen += o.stale;
                    probes.extend(o.samples);
                }
            }
            anyhow::Ok(())
        }
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.store(true, Ordering::SeqCst);
        let steady = load.await?;
        result?;
        for (pod, b) in pods.iter().zip(&before) {
            let after = envoy_state(pod).await?;
            // A hot restart bumps the epoch; a crash restart changes the pid.
            if after != *b {
                rot.envoy_restarts += after.0.saturating_sub(b.0).max(1);
            }
            rot.envoy_epochs.push(after.0);
        }
        for p in pods {
            run.stop_pod(p).await?;
        }
        // The pods were not replaced: every failure is "other".
        run.events.clear();

        rot.latencies_ms = latencies.clone();
        latencies.sort_by(|a, b| a.total_cmp(b));
        rot.latency_p50_ms = percentile(&latencies, 0.5);
        rot.latency_max_ms = latencies.last().copied().unwrap_or(0.0);
        let hs = LoadSummary::of(&probes);
        rot.handshakes = hs.sent;
        rot.handshakes_failed = hs.failed;
        rot.handshake_p50_ms = hs.latency.p50_ms;

        for s in steady.iter().filter(|s| s.outcome.is_ok()) {
            let serial = s
                .peer
                .and_then(|p| serials.get(&p).cloned())
                .unwrap_or_else(|| "unknown".into());
            *rot.load_requests_by_serial.entry(serial).or_default() += 1;
        }
        let mut all = steady.clone();
        all.extend(probes);
        all.sort_by_key(|s| s.at);
        let mut r = report("cert-rotation", args, args.rotations, &run, &all);
        // Latency of the steady (keep-alive) load, comparable with the other rows.
        let s = LoadSummary::of(&steady);
        r.p50_ms = s.latency.p50_ms;
        r.p99_ms = s.latency.p99_ms;
        r.rotation = Some(rot);
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(mode: &str, failed: usize) -> ModeReport {
        ModeReport {
            mode: mode.into(),
            failed,
            ..Default::default()
        }
    }

    #[test]
    fn merge_replaces_what_ran_and_keeps_the_rest() {
        // A float serde_json's fast parser would round differently.
        let text = r#"{
  "command": "lifecycle-bench --cycles 50",
  "cycles": 50,
  "disruptions": [
    {
      "failed": 160,
      "mode": "envoy-crash"
    },
    {
      "failed": 9,
      "mode": "cert-rotation"
    }
  ],
  "modes": [
    {
      "cycles": 50,
      "failed": 1606,
      "failure_times_s": [
        3.8782662500000002
      ],
      "mode": "baseline"
    }
  ]
}"#;
        let old = read_doc(text).expect("read");
        assert_eq!(serde_json::to_string_pretty(&old).expect("JSON"), text);
        let doc = merge(
            old,
            &[],
            &[entry("cert-rotation", 0), entry("new-one", 0)],
            serde_json::Map::from_iter([(
                "command".to_string(),
                json!("lifecycle-bench --only cert-rotation --merge"),
            )]),
        )
        .expect("merge");
        assert_eq!(doc["command"], "lifecycle-bench --cycles 50");
        assert_eq!(doc["cycles"], 50);
        assert_eq!(doc["modes"][0]["failed"], 1606);
        let d = doc["disruptions"].as_array().expect("disruptions");
        assert_eq!(d.len(), 3);
        assert_eq!(d[0]["failed"], 160);
        assert_eq!(d[1]["mode"], "cert-rotation");
        assert_eq!(d[1]["failed"], 0);
        assert!(d[1].get("rotation").is_none(), "absent, not null");
        assert_eq!(d[2]["mode"], "new-one");
        assert_eq!(
            doc["updates"][0]["entries"],
            json!(["cert-rotation", "new-one"])
        );
        assert_eq!(
            doc["updates"][0]["command"],
            "lifecycle-bench --only cert-rotation --merge"
        );
        // The merged modes still read back for the SVG.
        let modes: Vec<ModeReport> = serde_json::from_value(doc["modes"].clone()).expect("modes");
        assert_eq!(modes[0].mode, "baseline");
    }
}
