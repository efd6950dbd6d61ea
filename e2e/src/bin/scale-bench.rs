//! `scale-bench`: Remora's operator at cluster scale (issue 14), on a real
//! kube-apiserver and etcd started here, without kube-controller-manager
//! (the load creates the workloads' pods itself) and without a kubelet (the
//! harness's fake kubelets report nodes Ready and pods Running).
//!
//! Two operator replicas (this build's `remora-operator`) with leader
//! election, each under its own ServiceAccount; every pod created through
//! their webhook; then the steps of `e2e::scale_run`. Prints the issue's
//! goals with target, value and pass/fail; writes `bench/results/scale.json`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use e2e::scale::{LifecycleKind, Load, WorkloadKind};
use e2e::scale_run::{self, Options, Report, Spread, StepResult};
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "Remora's operator at cluster scale, on a real kube-apiserver")]
struct Args {
    #[arg(long, default_value_t = Load::default().pods)]
    pods: usize,
    /// SidecarLifecycles in all, the cluster default included.
    #[arg(long, default_value_t = Load::default().lifecycles)]
    lifecycles: usize,
    #[arg(long, default_value_t = Load::default().namespaces)]
    namespaces: usize,
    #[arg(long, default_value_t = Load::default().nodes)]
    nodes: usize,
    /// API requests in flight at once while loading.
    #[arg(long, default_value_t = Load::default().concurrency)]
    concurrency: usize,
    /// Pods of the namespace whose one namespace-wide lifecycle is edited.
    #[arg(long, default_value_t = Load::default().big_namespace_pods)]
    big_namespace_pods: usize,
    /// The steady window, in seconds.
    #[arg(long, default_value_t = 30)]
    steady_s: u64,
    /// AdmissionReviews a second sent to the leader during the
    /// cluster-default edit (and for the steady webhook measurement).
    #[arg(long, default_value_t = 500)]
    rate: u32,
    /// Each step's bound, in seconds.
    #[arg(long, default_value_t = 300)]
    step_timeout: u64,
    #[arg(long, default_value = "bench/results/scale.json")]
    out: PathBuf,
}

/// One of the goals.
#[derive(Serialize)]
struct Goal {
    goal: &'static str,
    target: String,
    /// `None`: the step did not measure it.
    value: Option<f64>,
    unit: &'static str,
    pass: bool,
}

/// What `--out` holds: the headline figures under their own names, the
/// goals, and the whole run.
#[derive(Serialize)]
struct Out {
    operator_binary: String,
    leader_rss_mib: Option<f64>,
    standby_rss_mib: Option<f64>,
    steady_requests_per_s: Option<f64>,
    steady_writes_per_s: Option<f64>,
    steady_lease_writes_per_s: Option<f64>,
    steady_lists: Option<usize>,
    settled_s: Option<f64>,
    retune_1k_pods_s: Option<Spread>,
    retune_pods: Option<usize>,
    retune_patches_per_s: Option<f64>,
    default_all_pods_s: Option<Spread>,
    default_pods: Option<usize>,
    default_patches_per_s: Option<f64>,
    webhook_p50_ms: Option<f64>,
    webhook_p99_ms: Option<f64>,
    webhook_errors: Option<usize>,
    webhook_steady_p50_ms: Option<f64>,
    webhook_steady_p99_ms: Option<f64>,
    /// The operator's own review times during the edit (its histogram's
    /// bucket bounds): the client's p99 less the accept, TLS and the
    /// machine's scheduling around the operator.
    webhook_server_p50_ms_at_most: Option<f64>,
    webhook_server_p99_ms_at_most: Option<f64>,
    webhook_steady_server_p99_ms_at_most: Option<f64>,
    /// The API server's own bound: the bench's pod patches a second, as
    /// the leader's identity and with its in-flight bound, under the same
    /// review load ([`scale_run::Run::ceiling`]).
    api_ceiling_patches_per_s: Option<f64>,
    /// The cluster default's patch rate over that bound.
    default_over_ceiling: Option<f64>,
    /// The webhook meanwhile: the machine's latency with no reconcile.
    webhook_p99_ms_at_ceiling: Option<f64>,
    webhook_errors_at_ceiling: Option<usize>,
    webhook_server_p99_ms_at_most_at_ceiling: Option<f64>,
    failover_s: Option<f64>,
    lease_takeover_s: Option<f64>,
    new_leader_rss_mib: Option<f64>,
    /// The leader's peak RSS over its life, every step before the failover
    /// included: what the chart's memory limit must cover.
    leader_peak_rss_mib: Option<f64>,
    lease_duration_s: f64,
    status_correct: bool,
    goals: Vec<Goal>,
    not_covered: Vec<&'static str>,
    deployments: usize,
    stateful_sets: usize,
    jobs: usize,
    lifecycles_by_kind: Vec<(LifecycleKind, usize)>,
    run: Report,
}

const NOT_COVERED: &[&str] = &[
    "no kubelet and no agent: a retune is timed until a watch sees the pod's annotation change on the API server, not until a sidecar applies it",
    "the chart's ValidatingAdmissionPolicy is not installed: its per-write check is not in the patch rates",
    "kube-apiserver, etcd, both replicas and the clients share 2 cores: every time includes that contention",
    "webhook latency is the client's, on loopback, without the API server's own webhook call around it",
    "RSS is VmRSS (resident pages, the binary's included), sampled every 500 ms",
    "failover_s ends at the standby's status write of the edited lifecycle, not when every pod it governs is retuned",
    "the cluster-default edit sets terminationDrainDuration, which no other layer sets: every pod changes (an edit of a knob that more specific layers set changes only the pods they leave to the default)",
];

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let machine_before = remora_test_support::results::machine();
    let load = Load {
        namespaces: args.namespaces,
        nodes: args.nodes,
        pods: args.pods,
        lifecycles: args.lifecycles,
        concurrency: args.concurrency,
        big_namespace_pods: args.big_namespace_pods,
        ..Load::default()
    };
    let plan = e2e::scale::Plan::new(&load)?;
    let bin = e2e::operator::operator_bin()?;
    eprintln!(
        "{} namespaces (+1 of {} pods), {} nodes, {} pods, {} SidecarLifecycles; operator {}",
        load.namespaces,
        load.big_namespace_pods,
        load.nodes,
        load.pods,
        load.lifecycles,
        bin.display()
    );
    let mut opts = Options::new(load);
    opts.steady = Duration::from_secs(args.steady_s);
    opts.rate = args.rate;
    opts.step_timeout = Duration::from_secs(args.step_timeout);
    let (report, run) = scale_run::run(opts).await?;
    // Relative to the workspace: the results file names no machine's paths.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap_or(std::path::Path::new("/"));
    let shown = bin.strip_prefix(root).unwrap_or(&bin);
    let out = summarize(&report, &plan, shown.display().to_string());
    print_table(&out);
    let doc = remora_test_support::results::document(&machine_before, serde_json::to_value(&out)?);
    remora_test_support::results::write(&args.out, &doc)
        .with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!("wrote {}", args.out.display());
    drop(run);
    Ok(())
}

fn summarize(r: &Report, plan: &e2e::scale::Plan, bin: String) -> Out {
    let steady = r.steady.done();
    let big = r.big_namespace_retune.done();
    let def = r.cluster_default.done();
    let hook_steady = r.webhook_steady.done();
    let fail = r.failover.done();
    let ceiling = r.ceiling.done();
    let lease = scale_run::DEFAULT_LEASE_DURATION.as_secs_f64();
    let status_correct = r.settled.done().is_some_and(|s| s.correct())
        && r.final_status.done().is_some_and(|s| s.correct());
    let le = |goal, target: f64, unit, value: Option<f64>| Goal {
        goal,
        target: format!("<= {target} {unit}"),
        value,
        unit,
        pass: value.is_some_and(|v| v <= target),
    };
    let goals = vec![
        le(
            "leader RSS at steady state (max)",
            64.0,
            "MiB",
            steady.map(|s| s.leader_rss.max_mib),
        ),
        le(
            "standby RSS at steady state (max)",
            48.0,
            "MiB",
            steady.map(|s| s.standby_rss.max_mib),
        ),
        le(
            "writes/s at steady state (Lease apart)",
            0.0,
            "1/s",
            steady.map(|s| s.leader.writes_per_s() + s.standby.writes_per_s()),
        ),
        le(
            "LISTs in the steady window",
            0.0,
            "",
            steady.map(|s| (s.leader.lists + s.standby.lists) as f64),
        ),
        le(
            "1,000 pods retuned (max)",
            10.0,
            "s",
            big.map(|b| b.seconds.max),
        ),
        le(
            "cluster default on every pod (max)",
            60.0,
            "s",
            def.map(|d| d.retune.seconds.max),
        ),
        le(
            "webhook p99 during that reconcile",
            2.0,
            "ms",
            def.map(|d| d.webhook.latency.p99_ms),
        ),
        le(
            "webhook errors during that reconcile",
            0.0,
            "",
            def.map(|d| d.webhook.errors as f64),
        ),
        le(
            "failover to first completed reconcile",
            lease + 5.0,
            "s",
            fail.map(|f| f.failover_s),
        ),
        Goal {
            goal: "every status correct (after settling and at the end)",
            target: "true".into(),
            value: Some(if status_correct { 1.0 } else { 0.0 }),
            unit: "",
            pass: status_correct,
        },
    ];
    Out {
        operator_binary: bin,
        leader_rss_mib: steady.map(|s| s.leader_rss.max_mib),
        standby_rss_mib: steady.map(|s| s.standby_rss.max_mib),
        steady_requests_per_s: steady.map(|s| s.leader.requests_per_s()),
        steady_writes_per_s: steady.map(|s| s.leader.writes_per_s() + s.standby.writes_per_s()),
        steady_lease_writes_per_s: steady.map(|s| s.leader.lease_writes_per_s()),
        steady_lists: steady.map(|s| s.leader.lists + s.standby.lists),
        settled_s: r.settled.done().map(|s| s.seconds),
        retune_1k_pods_s: big.map(|b| b.seconds),
        retune_pods: big.map(|b| b.pods_reached),
        retune_patches_per_s: big.map(|b| b.patches_per_s),
        default_all_pods_s: def.map(|d| d.retune.seconds),
        default_pods: def.map(|d| d.retune.pods_reached),
        default_patches_per_s: def.map(|d| d.retune.patches_per_s),
        webhook_p50_ms: def.map(|d| d.webhook.latency.p50_ms),
        webhook_p99_ms: def.map(|d| d.webhook.latency.p99_ms),
        webhook_errors: def.map(|d| d.webhook.errors),
        webhook_steady_p50_ms: hook_steady.map(|w| w.latency.p50_ms),
        webhook_steady_p99_ms: hook_steady.map(|w| w.latency.p99_ms),
        webhook_server_p50_ms_at_most: server(def.map(|d| &d.webhook))
            .and_then(|s| s.p50_ms_at_most),
        webhook_server_p99_ms_at_most: server(def.map(|d| &d.webhook))
            .and_then(|s| s.p99_ms_at_most),
        webhook_steady_server_p99_ms_at_most: server(hook_steady).and_then(|s| s.p99_ms_at_most),
        api_ceiling_patches_per_s: ceiling.map(|c| c.patches_per_s),
        default_over_ceiling: def
            .zip(ceiling)
            .filter(|(_, c)| c.patches_per_s > 0.0)
            .map(|(d, c)| d.retune.patches_per_s / c.patches_per_s),
        webhook_p99_ms_at_ceiling: ceiling.map(|c| c.webhook.latency.p99_ms),
        webhook_errors_at_ceiling: ceiling.map(|c| c.webhook.errors),
        webhook_server_p99_ms_at_most_at_ceiling: server(ceiling.map(|c| &c.webhook))
            .and_then(|s| s.p99_ms_at_most),
        failover_s: fail.map(|f| f.failover_s),
        lease_takeover_s: fail.map(|f| f.lease_takeover_s),
        new_leader_rss_mib: fail.map(|f| f.new_leader_rss_mib),
        leader_peak_rss_mib: fail
            .and_then(|f| f.killed_leader_peak_mib)
            .or(steady.and_then(|s| s.leader_peak_mib)),
        lease_duration_s: lease,
        status_correct,
        goals,
        not_covered: NOT_COVERED.to_vec(),
        deployments: plan.workloads_of(WorkloadKind::Deployment),
        stateful_sets: plan.workloads_of(WorkloadKind::StatefulSet),
        jobs: plan.workloads_of(WorkloadKind::Job),
        lifecycles_by_kind: [
            LifecycleKind::ClusterDefault,
            LifecycleKind::NamespaceWide,
            LifecycleKind::Selector,
            LifecycleKind::Overlapping,
        ]
        .into_iter()
        .map(|k| (k, plan.lifecycles_of(k)))
        .collect(),
        run: r.clone(),
    }
}

fn outcome<T>(name: &str, s: &StepResult<T>) {
    match s {
        StepResult::Done(_) => {}
        StepResult::TimedOut(m) => println!("  {name}: TIMED OUT: {m}"),
        StepResult::Failed(m) => println!("  {name}: FAILED: {m}"),
        StepResult::Skipped(m) => println!("  {name}: skipped: {m}"),
    }
}

fn print_table(o: &Out) {
    let r = &o.run;
    println!(
        "load: {} pods (+{} in the big namespace) in {} namespaces on {} nodes, {} SidecarLifecycles; leader {}",
        r.load.pods,
        r.load.big_namespace_pods,
        r.load.namespaces,
        r.load.nodes,
        r.lifecycles_planned,
        r.leader
    );
    for p in &r.populate_phases {
        println!("  {:<14} {:>6} in {:>7.2} s", p.name, p.objects, p.seconds);
    }
    println!();
    println!("{:<48} {:>12} {:>12} {:>6}", "goal", "target", "value", "");
    for g in &o.goals {
        let v = g
            .value
            .map_or_else(|| "-".to_owned(), |v| format!("{v:.2} {}", g.unit));
        println!(
            "{:<48} {:>12} {:>12} {:>6}",
            g.goal,
            g.target,
            v,
            if g.pass { "pass" } else { "FAIL" }
        );
    }
    println!();
    let f = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}"));
    println!("settled after the load: {} s", f(o.settled_s));
    println!(
        "steady: {} req/s from the leader, Lease writes {} /s",
        f(o.steady_requests_per_s),
        f(o.steady_lease_writes_per_s)
    );
    println!(
        "retune of the big namespace: p50 {} s, {} pods, {} patches/s",
        f(o.retune_1k_pods_s.map(|s| s.p50)),
        o.retune_pods.unwrap_or(0),
        f(o.retune_patches_per_s)
    );
    println!(
        "cluster default: p50 {} s, {} pods, {} patches/s",
        f(o.default_all_pods_s.map(|s| s.p50)),
        o.default_pods.unwrap_or(0),
        f(o.default_patches_per_s)
    );
    println!(
        "webhook at {}/s: during the reconcile p50 {} ms; no reconcile p50 {} / p99 {} ms",
        o.run_rate(),
        f(o.webhook_p50_ms),
        f(o.webhook_steady_p50_ms),
        f(o.webhook_steady_p99_ms)
    );
    println!(
        "webhook as the operator timed it: during the reconcile p50 <= {} / p99 <= {} ms; no reconcile p99 <= {} ms",
        f(o.webhook_server_p50_ms_at_most),
        f(o.webhook_server_p99_ms_at_most),
        f(o.webhook_steady_server_p99_ms_at_most)
    );
    println!(
        "API server's own bound (the bench's patches, {} in flight, same review load): {} patches/s; the cluster default ran at {} of it",
        scale_run::CEILING_IN_FLIGHT,
        f(o.api_ceiling_patches_per_s),
        f(o.default_over_ceiling)
    );
    println!(
        "webhook meanwhile (no reconcile): p99 {} ms, {} errors; as the operator timed it p99 <= {} ms",
        f(o.webhook_p99_ms_at_ceiling),
        o.webhook_errors_at_ceiling.unwrap_or(0),
        f(o.webhook_server_p99_ms_at_most_at_ceiling)
    );
    println!(
        "failover: Lease after {} s, new leader's RSS {} MiB (lease duration {} s)",
        f(o.lease_takeover_s),
        f(o.new_leader_rss_mib),
        o.lease_duration_s
    );
    println!(
        "leader peak RSS over every step: {} MiB",
        f(o.leader_peak_rss_mib)
    );
    outcome("settling", &r.settled);
    outcome("steady window", &r.steady);
    outcome("webhook (no reconcile)", &r.webhook_steady);
    outcome("big namespace retune", &r.big_namespace_retune);
    outcome("cluster default edit", &r.cluster_default);
    outcome("API server's bound", &r.ceiling);
    outcome("failover", &r.failover);
    outcome("final statuses", &r.final_status);
    if !r.load_problems.is_empty() {
        println!("load problems: {:?}", r.load_problems);
    }
    println!("not covered:");
    for n in &o.not_covered {
        println!("  - {n}");
    }
}

impl Out {
    fn run_rate(&self) -> u32 {
        self.run
            .cluster_default
            .done()
            .map_or(0, |d| d.webhook.rate)
    }
}

/// The operator's own timing of a webhook run, when it was read.
fn server(
    o: Option<&scale_run::webhook_load::Outcome>,
) -> Option<&scale_run::webhook_load::ServerSide> {
    o?.server.as_ref()
}
