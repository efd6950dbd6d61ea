//! How long a finished Job's Legacy pod takes to complete: from the last app
//! container's exit to the pod's `Succeeded` in the API, over `--runs` Jobs
//! on the real control plane (the operator's controller, the real agent and
//! Envoy under `e2e::jobpod`), broken down into
//! app exit → stop annotation seen on a pod watch → sidecar exit → Succeeded.
//! Then the same Job with the controller off (`--stop-completed-jobs=false`)
//! and `activeDeadlineSeconds`: it never completes; the Job controller gives
//! up at the deadline. Table on stdout, JSON in `--out`.
//!
//! ```sh
//! cargo build -p remora-agent -p remora-operator
//! cargo run -p e2e --bin jobs-bench -- --runs 10
//! ```

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use e2e::controlplane::ControlPlane;
use e2e::jobpod::{self, JobPodOptions, JobsEnv, PROXY};
use remora_test_support::wait::wait_until;
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;

#[derive(Debug, Parser)]
struct Args {
    /// Jobs measured, one after the other.
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// The app container's script.
    #[arg(long, default_value = "sleep 0.2; exit 0")]
    script: String,
    /// activeDeadlineSeconds of the Job run without the controller.
    #[arg(long, default_value_t = 10)]
    baseline_deadline: i64,
    /// Skip the run without the controller.
    #[arg(long)]
    no_baseline: bool,
    #[arg(long, default_value = "bench/results/jobs.json")]
    out: PathBuf,
}

#[derive(Debug, Clone, Serialize)]
struct Sample {
    app_exit_to_stop_seen_ms: f64,
    stop_seen_to_file_ms: f64,
    stop_seen_to_sidecar_exit_ms: f64,
    sidecar_exit_to_succeeded_ms: f64,
    app_exit_to_succeeded_ms: f64,
}

#[derive(Debug, Clone, Serialize)]
struct Stats {
    p50_ms: f64,
    p90_ms: f64,
    max_ms: f64,
}

fn stats(mut v: Vec<f64>) -> Stats {
    v.sort_by(f64::total_cmp);
    // Nearest rank.
    let at = |q: f64| {
        if v.is_empty() {
            return 0.0;
        }
        let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        v[i]
    };
    Stats {
        p50_ms: at(0.5),
        p90_ms: at(0.9),
        max_ms: v.last().copied().unwrap_or(0.0),
    }
}

fn ms(from: Option<Instant>, to: Option<Instant>) -> anyhow::Result<f64> {
    match (from, to) {
        (Some(a), Some(b)) => {
            let ms = b.saturating_duration_since(a).as_secs_f64() * 1000.0;
            Ok((ms * 10.0).round() / 10.0)
        }
        _ => anyhow::bail!("a step of the timeline is missing"),
    }
}

async fn measured(
    cp: &ControlPlane,
    args: &Args,
    opts: &JobPodOptions,
) -> anyhow::Result<Vec<Sample>> {
    let env = JobsEnv::start(cp, "jobs-bench", &[]).await?;
    let mut samples = Vec::new();
    for i in 0..args.runs {
        let name = format!("bench-{i}");
        let pod = env
            .create_job(&jobpod::job(&name, "Never", &args.script, &[]))
            .await?;
        let o = jobpod::run(env.client.clone(), &env.kubelet, &env.namespace, &pod, opts).await?;
        anyhow::ensure!(
            o.phase == "Succeeded" && o.exit_codes.get(PROXY) == Some(&0),
            "run {i}: {o:?}"
        );
        env.wait_job(&name, "Complete", Duration::from_secs(60))
            .await?;
        let t = &o.timeline;
        let s = Sample {
            app_exit_to_stop_seen_ms: ms(t.last_app_exit, t.stop_seen)?,
            stop_seen_to_file_ms: ms(t.stop_seen, t.stop_written)?,
            stop_seen_to_sidecar_exit_ms: ms(t.stop_seen, t.sidecar_exit)?,
            sidecar_exit_to_succeeded_ms: ms(t.sidecar_exit, t.completed)?,
            app_exit_to_succeeded_ms: ms(t.last_app_exit, t.completed)?,
        };
        eprintln!("run {i}: {s:?}");
        samples.push(s);
    }
    env.cleanup(cp).await?;
    Ok(samples)
}

/// The same Job without the controller: the pod stays Running after its app
/// exits; the Job controller ends it at activeDeadlineSeconds.
async fn baseline(
    cp: &ControlPlane,
    args: &Args,
    opts: &JobPodOptions,
) -> anyhow::Result<serde_json::Value> {
    let env = JobsEnv::start(cp, "jobs-bench-off", &["--stop-completed-jobs=false"]).await?;
    let mut job = jobpod::job("baseline", "Never", &args.script, &[]);
    if let Some(spec) = job.spec.as_mut() {
        spec.active_deadline_seconds = Some(args.baseline_deadline);
    }
    let pod = env.create_job(&job).await?;
    let started = Instant::now();
    let mut opts = opts.clone();
    opts.timeout = Duration::from_secs(u64::try_from(args.baseline_deadline).unwrap_or(10) + 30);
    let bridge = {
        let (client, kubelet, ns, pod) = (
            env.client.clone(),
            env.kubelet.clone(),
            env.namespace.clone(),
            pod.clone(),
        );
        tokio::spawn(async move { jobpod::run(client, &kubelet, &ns, &pod, &opts).await })
    };
    let jobs = env.jobs();
    let pods = env.pods();
    // The Job controller's verdict at the deadline; the pod, still Running,
    // is what made it necessary.
    let (condition, reason, phase) = wait_until(
        Duration::from_secs(u64::try_from(args.baseline_deadline).unwrap_or(10) + 30),
        "the Job controller to give up at activeDeadlineSeconds",
        || async {
            let j = jobs.get("baseline").await?;
            let c = j
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .into_iter()
                .find(|c| {
                    (c.type_ == "FailureTarget" || c.type_ == "Failed") && c.status == "True"
                });
            let Some(c) = c else {
                return Ok::<_, anyhow::Error>(None);
            };
            let phase = pods
                .get(&pod)
                .await?
                .status
                .and_then(|s| s.phase)
                .unwrap_or_default();
            Ok(Some((c.type_, c.reason.unwrap_or_default(), phase)))
        },
    )
    .await?;
    let waited = started.elapsed();
    anyhow::ensure!(
        !bridge.is_finished(),
        "the baseline pod completed on its own"
    );
    bridge.abort();
    env.cleanup(cp).await?;
    Ok(json!({
        "active_deadline_seconds": args.baseline_deadline,
        "job_condition": condition,
        "job_reason": reason,
        "pod_phase_then": phase,
        "pod_completed": false,
        "seconds_until_the_job_controller_gave_up": waited.as_secs_f64(),
    }))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let machine_before = remora_test_support::results::machine();
    let cp = ControlPlane::shared().await?;
    anyhow::ensure!(cp.has_controller_manager(), "needs the Job controller");
    let dir = tempfile::tempdir()?;
    let opts = JobPodOptions {
        agent_bin: jobpod::agent_bin()?,
        envoy_bin: remora_test_support::bins::envoy_bin()?,
        base_dir: dir.path().to_path_buf(),
        timeout: Duration::from_secs(60),
    };
    let samples = measured(cp, &args, &opts).await?;
    let base = if args.no_baseline {
        serde_json::Value::Null
    } else {
        baseline(cp, &args, &opts).await?
    };
    let col = |f: fn(&Sample) -> f64| stats(samples.iter().map(f).collect());
    let rows = [
        (
            "app exit -> stop annotation seen",
            col(|s| s.app_exit_to_stop_seen_ms),
        ),
        (
            "stop seen -> sidecar exit",
            col(|s| s.stop_seen_to_sidecar_exit_ms),
        ),
        (
            "  of which: seen -> file swapped",
            col(|s| s.stop_seen_to_file_ms),
        ),
        (
            "sidecar exit -> Succeeded",
            col(|s| s.sidecar_exit_to_succeeded_ms),
        ),
        (
            "app exit -> Succeeded (total)",
            col(|s| s.app_exit_to_succeeded_ms),
        ),
    ];
    println!(
        "{} Jobs (Legacy mode, restartPolicy Never, app `{}`)",
        samples.len(),
        args.script
    );
    println!(
        "{:<36} {:>9} {:>9} {:>9}",
        "step", "p50 ms", "p90 ms", "max ms"
    );
    for (name, s) in &rows {
        println!(
            "{name:<36} {:>9.1} {:>9.1} {:>9.1}",
            s.p50_ms, s.p90_ms, s.max_ms
        );
    }
    if !base.is_null() {
        println!(
            "without the controller: pod {} when the Job controller set {} ({}) after {:.1} s; it never completes",
            base["pod_phase_then"].as_str().unwrap_or("?"),
            base["job_condition"].as_str().unwrap_or("?"),
            base["job_reason"].as_str().unwrap_or("?"),
            base["seconds_until_the_job_controller_gave_up"]
                .as_f64()
                .unwrap_or(0.0)
        );
    }
    let summary: serde_json::Map<String, serde_json::Value> = rows
        .iter()
        .map(|(n, s)| (n.trim().to_owned(), json!(s)))
        .collect();
    let doc = json!({
        "runs": samples.len(),
        "script": args.script,
        "emulation": "e2e::jobpod plays the kubelet: the downward-API file is rewritten as soon as its pod watch shows the annotation (a real kubelet does it on its next pod sync, typically within seconds); the agent polls the file every 100 ms",
        "summary": summary,
        "samples": samples,
        "without_controller": base,
    });
    remora_test_support::results::write(
        &args.out,
        &remora_test_support::results::document(&machine_before, doc),
    )?;
    Ok(())
}
