//! `scale-bench`: Remora's operator at cluster scale (issue 14), on a real
//! kube-apiserver and etcd started here, without kube-controller-manager
//! (the load creates the workloads' pods itself) and without a kubelet (the
//! harness's fake kubelets report nodes Ready and pods Running).
//!
//! For now it only loads the API server — namespaces, nodes, pods owned by
//! Deployments, StatefulSets and Jobs, SidecarLifecycles — and reports how
//! long each phase took and what the API server holds, counted by listing.
//! Prints a table; writes `bench/results/scale.json`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use e2e::controlplane::{ControlPlane, Options};
use e2e::scale::{self, Counts, LifecycleKind, Load, Phase, WorkloadKind};
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "Remora's injector at cluster scale, on a real kube-apiserver")]
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
    #[arg(long, default_value = "bench/results/scale.json")]
    out: PathBuf,
}

/// What `--out` holds. Only measured figures: what is not measured yet is
/// named in `not_measured`, never filled in.
#[derive(Serialize)]
struct Report {
    load: Load,
    deployments: usize,
    stateful_sets: usize,
    jobs: usize,
    lifecycles_cluster_default: usize,
    lifecycles_namespace_wide: usize,
    lifecycles_selector: usize,
    lifecycles_overlapping: usize,
    apiserver_start_s: f64,
    populate_phases: Vec<Phase>,
    populate_total_s: f64,
    /// Counted by listing the API server after loading.
    apiserver_objects: Counts,
    list_s: f64,
    /// Differences between the plan and what was listed (none expected).
    load_problems: Vec<String>,
    not_measured: Vec<&'static str>,
}

// TODO(issue 14), each a key of the report once measured, never before:
// - start two injector replicas (e2e::injector::Injector, leader election
//   on) against the loaded API server; `leader_rss_mib`, `standby_rss_mib`
//   at steady state (after the initial list, reconcile done);
// - `steady_requests_per_s` / `steady_writes_per_s` from the injector at
//   steady state (API server audit log or request metrics by user agent);
//   goal: no writes, no periodic full re-list;
// - `retune_1k_pods_s` (p50, max) and its write rate: edit one namespace-wide
//   SidecarLifecycle governing 1,000 running pods, wait (by watching) until
//   every one carries the new `remora.dev/lifecycle` annotation;
// - `default_all_pods_s`: edit the cluster default, until all pods carry it;
// - `webhook_p50_ms`, `webhook_p99_ms` at 500 reviews/s during that reconcile;
// - `failover_s`: SIGKILL the leader, until the standby's first completed
//   reconcile; and the new leader's RSS after its initial list;
// - `status_correct`: matchedPods and conditions (Accepted, Conflicted,
//   Applied) of every SidecarLifecycle against the plan (scale::Plan knows
//   which overlap and which pods each one governs).
const NOT_MEASURED: &[&str] = &[
    "leader_rss_mib",
    "standby_rss_mib",
    "steady_writes_per_s",
    "retune_1k_pods_s",
    "default_all_pods_s",
    "webhook_p99_ms",
    "failover_s",
    "status_correct",
];

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let load = Load {
        namespaces: args.namespaces,
        nodes: args.nodes,
        pods: args.pods,
        lifecycles: args.lifecycles,
        concurrency: args.concurrency,
        ..Load::default()
    };
    // Refuse a bad size before starting anything.
    let plan = scale::Plan::new(&load)?;

    let t = Instant::now();
    let cp = ControlPlane::start(Options::without_controller_manager())
        .await
        .context("starting kube-apiserver and etcd")?;
    let apiserver_start = t.elapsed();
    let client = cp.client()?;
    e2e::chart::install_crds(&client).await?;

    eprintln!(
        "loading {} namespaces, {} nodes, {} pods, {} SidecarLifecycles...",
        load.namespaces, load.nodes, load.pods, load.lifecycles
    );
    let populated = scale::populate(&client, &load).await?;
    let t = Instant::now();
    let checked = scale::check(&client, &populated).await?;
    let list = t.elapsed();

    let report = Report {
        deployments: plan.workloads_of(WorkloadKind::Deployment),
        stateful_sets: plan.workloads_of(WorkloadKind::StatefulSet),
        jobs: plan.workloads_of(WorkloadKind::Job),
        lifecycles_cluster_default: plan.lifecycles_of(LifecycleKind::ClusterDefault),
        lifecycles_namespace_wide: plan.lifecycles_of(LifecycleKind::NamespaceWide),
        lifecycles_selector: plan.lifecycles_of(LifecycleKind::Selector),
        lifecycles_overlapping: plan.lifecycles_of(LifecycleKind::Overlapping),
        load,
        apiserver_start_s: secs(apiserver_start),
        populate_total_s: secs(populated.total()),
        populate_phases: populated.phases,
        apiserver_objects: checked.counts,
        list_s: secs(list),
        load_problems: checked.problems,
        not_measured: NOT_MEASURED.to_vec(),
    };
    print_table(&report);
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)? + "\n")
        .with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!("wrote {}", args.out.display());
    if !report.load_problems.is_empty() {
        bail!(
            "the API server does not hold the load as planned ({} problems)",
            report.load_problems.len()
        );
    }
    Ok(())
}

fn secs(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}

fn print_table(r: &Report) {
    println!(
        "load: {} namespaces, {} nodes, {} pods ({} Deployments, {} StatefulSets, {} Jobs), \
         {} SidecarLifecycles ({} cluster default, {} namespace-wide, {} selector, {} overlapping)",
        r.load.namespaces,
        r.load.nodes,
        r.load.pods,
        r.deployments,
        r.stateful_sets,
        r.jobs,
        r.load.lifecycles,
        r.lifecycles_cluster_default,
        r.lifecycles_namespace_wide,
        r.lifecycles_selector,
        r.lifecycles_overlapping,
    );
    println!("kube-apiserver ready in {:.1} s", r.apiserver_start_s);
    println!();
    println!(
        "{:<14} {:>8} {:>9} {:>9}",
        "phase", "objects", "seconds", "per s"
    );
    for p in &r.populate_phases {
        println!(
            "{:<14} {:>8} {:>9.2} {:>9.0}",
            p.name,
            p.objects,
            p.seconds,
            p.per_second()
        );
    }
    println!("{:<14} {:>8} {:>9.2}", "total", "", r.populate_total_s);
    println!();
    let c = &r.apiserver_objects;
    println!("API server holds (listed in {:.2} s):", r.list_s);
    for (what, n) in [
        ("namespaces", c.namespaces),
        ("nodes", c.nodes),
        ("nodes Ready", c.nodes_ready),
        ("deployments", c.deployments),
        ("replicasets", c.replica_sets),
        ("statefulsets", c.stateful_sets),
        ("jobs", c.jobs),
        ("pods", c.pods),
        ("pods Running", c.pods_running),
        ("sidecarlifecycles", c.sidecar_lifecycles),
    ] {
        println!("  {what:<18} {n:>8}");
    }
    println!();
    if r.load_problems.is_empty() {
        println!("every object as planned (owner, node, phase checked)");
    } else {
        println!("{} problems, first ones:", r.load_problems.len());
        for p in r.load_problems.iter().take(10) {
            println!("  {p}");
        }
    }
    println!("not measured yet: {}", r.not_measured.join(", "));
}
