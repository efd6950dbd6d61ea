//! Push cost of the discovery server without Envoys (not run by
//! `cargo test`): N simulated proxies, each a real gRPC ADS client over TLS
//! from a loopback address of its own (as pods have theirs), subscribe to
//! CDS, LDS and EDS and ACK every response as Envoy does. Each proxy
//! declares two Services in `remora.dev/outbound`: `shared` (every proxy)
//! and one of S others (N/S proxies each). Measured, from the registry
//! update to the last dependent's ACK of the new EDS version:
//! - one endpoint change of a Service with N/S dependents;
//! - one endpoint change of `shared` (N dependents).
//!
//! - a rollout of 100 pods of `rollout` (every proxy's), one every
//!   `--rollout-step-ms`: pushes per proxy, last change to all ACKed, CPU.
//!
//! Each debounce of `--debounce-quiet-ms` (default: the operator's, 100 ms
//! quiet, 1 s max) and each push throttle of `--push-throttle` (default:
//! the operator's, 100 pushes at once) is measured in turn in the same run,
//! so a sweep compares them side by side, and so is each protocol of
//! `--protocol` (state of the world, `sotw`; delta, the agent's default,
//! whose clients subscribe to CDS and LDS as a wildcard and to EDS by name,
//! and ACK each response's nonce). The server runs in this process beside its clients,
//! with a test double for TokenReview (every
//! proxy shows the same cached token), and the registry fed directly (no
//! API server, no pod watch). Not covered: the API server's watch latency,
//! Envoy's own apply time, TLS handshakes after the start, and Istio's pilot-discovery
//! (side by side, through a real API server: e2e's `discovery-bench`). CPU
//! seconds and the allocator's bytes are the whole process's: the clients'
//! share is in them.
//!
//! `cargo bench -p remora-operator --bench discovery_push -- --proxies 1000
//! --services 100` prints a table and writes JSON to
//! `bench/results/discovery-push.json`. The process raises its own
//! open-file limit (two sockets per proxy) to what `--proxies` needs, as
//! far as its hard limit allows (raising that takes CAP_SYS_RESOURCE).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use remora_operator::discovery::push::{DEFAULT_PUSH_THROTTLE, Debounce};
use remora_test_support::results;
use serde_json::json;

#[path = "support/discovery_fleet.rs"]
mod fleet;
use fleet::{Fleet, NS, ROLLOUT_PODS, Xds, rollout_ip, service_name, slice};

#[global_allocator]
static ALLOC: cap::Cap<mimalloc::MiMalloc> = cap::Cap::new(mimalloc::MiMalloc, usize::MAX);

#[derive(Debug, Parser)]
#[command(name = "discovery_push")]
struct Args {
    /// Simulated proxies (one ADS stream each).
    #[arg(long, default_value_t = 1000)]
    proxies: usize,
    /// Services besides `shared`; proxy i also declares service i % S.
    #[arg(long, default_value_t = 100)]
    services: usize,
    /// Endpoint changes measured per case.
    #[arg(long, default_value_t = 20)]
    changes: usize,
    /// Debounce quiet windows to measure, side by side in this run (ms,
    /// comma-separated; default: the operator's).
    #[arg(long, value_delimiter = ',', default_values_t = [Debounce::default().quiet.as_millis() as u64])]
    debounce_quiet_ms: Vec<u64>,
    /// Push throttles to measure (pushes at once across all streams,
    /// comma-separated; default: the operator's).
    #[arg(long, value_delimiter = ',', default_values_t = [DEFAULT_PUSH_THROTTLE])]
    push_throttle: Vec<usize>,
    /// The debounce's maximum delay (ms; default: the operator's).
    #[arg(long, default_value_t = Debounce::default().max_delay.as_millis() as u64)]
    debounce_max_ms: u64,
    /// Between two pods of the rollout becoming ready (ms, comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [10u64])]
    rollout_step_ms: Vec<u64>,
    /// The clients' xDS protocols, each measured in turn (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [Xds::Sotw, Xds::Delta])]
    protocol: Vec<Xds>,
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/results/discovery-push.json"))]
    out: PathBuf,
    /// What cargo passes to every bench.
    #[arg(long, hide = true)]
    bench: bool,
}

/// Whose endpoints change.
#[derive(Clone, Copy)]
enum Case {
    /// Service k % S: N/S dependents.
    OneService,
    /// `shared`: every proxy depends on it.
    Shared,
}

impl Case {
    fn label(self) -> &'static str {
        match self {
            Self::OneService => "one Service, N/S dependents",
            Self::Shared => "shared, N dependents",
        }
    }

    /// Change `k`: the Service and the proxies that depend on it.
    fn change(self, k: usize, proxies: usize, services: usize) -> (String, Vec<usize>) {
        match self {
            Self::OneService => (
                service_name(k % services),
                (0..proxies)
                    .filter(|i| i % services == k % services)
                    .collect(),
            ),
            Self::Shared => ("shared".to_string(), (0..proxies).collect()),
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn cpu_seconds() -> f64 {
    // utime + stime of this process, from /proc (clock ticks of 100 Hz).
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
            Some(ticks / 100.0)
        })
        .unwrap_or(f64::NAN)
}

fn rss_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.proxies > 0 && args.proxies <= 62_500 && args.services > 0,
        "--proxies 1..=62500 and --services >= 1"
    );
    // Two sockets per proxy (its client's and the server's, both in this
    // process), and a few for the rest (the listener, the runtime, stdio).
    let open_files =
        remora_test_support::open_files::raise_open_files(2 * args.proxies as u64 + 64)?;
    let started = Instant::now();
    let machine_before = results::machine();
    let mut settings = Vec::new();
    for &xds in &args.protocol {
        for &step in &args.rollout_step_ms {
            for &quiet in &args.debounce_quiet_ms {
                for &throttle in &args.push_throttle {
                    let debounce = Debounce {
                        quiet: Duration::from_millis(quiet),
                        max_delay: Duration::from_millis(args.debounce_max_ms),
                    };
                    println!(
                        "== {xds}; debounce {quiet} ms quiet, {} ms max; rollout step {step} ms; push throttle {throttle}",
                        args.debounce_max_ms
                    );
                    let step = Duration::from_millis(step);
                    settings.push(measure(&args, xds, debounce, throttle, step).await?);
                }
            }
        }
    }
    let mut doc = results::stamp(&machine_before);
    doc.insert("machine_after".into(), results::machine());
    let body = json!({
        "open_files_limit": open_files,
        "proxies": args.proxies,
        "services": args.services,
        "settings": settings,
        "rss_mib": {"now": rss_mib("VmRSS:"), "peak": rss_mib("VmHWM:")},
        "duration_seconds": started.elapsed().as_secs_f64(),
        "measured": "registry update → the last dependent's ACK of an EDS version it had not ACKed before; each setting's debounce is in its figures",
        "not_covered": [
            "server and clients share this process and its 2 cores: CPU, allocation and RSS include the clients",
            "no API server: the registry is fed directly, so watch latency is not in the figures",
            "no Envoy: the clients ACK at once, Envoy's apply time is not in the figures",
            "Istio's pilot-discovery is not in this bench: e2e's discovery-bench runs it side by side",
            "the rollout is 100 endpoint changes a fixed step apart fed to the registry, not pods starting on a node",
            "RSS is the process's peak over every setting",
        ],
    });
    if let serde_json::Value::Object(body) = body {
        doc.extend(body);
    }
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("writing {}", args.out.display()))?;
    println!(
        "RSS peak {:.0} MiB (server and clients); wrote {}",
        rss_mib("VmHWM:"),
        args.out.display()
    );
    Ok(())
}

/// One setting: a server with `debounce`, every proxy subscribed, the
/// changes of each case, then the rollout with `step` between pods.
async fn measure(
    args: &Args,
    xds: Xds,
    debounce: Debounce,
    push_throttle: usize,
    step: Duration,
) -> anyhow::Result<serde_json::Value> {
    let cpu_at_start = cpu_seconds();
    let Fleet {
        discovery,
        acks,
        mut endpoints,
        tasks,
        stop,
        subscribe_seconds,
        ..
    } = Fleet::start(args.proxies, args.services, xds, debounce, push_throttle).await?;
    let cpu_after_subscribe = cpu_seconds() - cpu_at_start;
    let alloc_after_subscribe = ALLOC.allocated() as f64 / 1048576.0;

    let cases = [Case::OneService, Case::Shared];
    let mut rows = Vec::new();
    println!(
        "{:<28} {:>10} {:>8} {:>9} {:>9} {:>9} {:>9}",
        "case", "dependents", "changes", "p50 ms", "p99 ms", "max ms", "min ms"
    );
    for case in cases {
        let label = case.label();
        let cpu_before = cpu_seconds();
        let mut ms = Vec::new();
        let mut deps = 0;
        for k in 0..args.changes {
            let (name, who) = case.change(k, args.proxies, args.services);
            deps = who.len();
            let eps = endpoints.fresh(3);
            let before: std::collections::BTreeSet<(usize, String)> =
                acks.at.lock().expect("lock").keys().cloned().collect();
            let t0 = Instant::now();
            discovery
                .update(|r| r.apply_slice((NS.into(), format!("{name}-1")), slice(&name, &eps)));
            // Done when every dependent has ACKed an EDS version it had not before.
            let deadline = Instant::now() + Duration::from_secs(60);
            let last = loop {
                let newest: Option<Instant> = {
                    let at = acks.at.lock().expect("lock");
                    let mut latest = None;
                    let mut all = true;
                    for i in &who {
                        let fresh = at
                            .range((*i, String::new())..(*i + 1, String::new()))
                            .filter(|(key, when)| !before.contains(*key) && **when >= t0)
                            .map(|(_, when)| *when)
                            .min();
                        match fresh {
                            Some(w) => latest = Some(latest.map_or(w, |l: Instant| l.max(w))),
                            None => {
                                all = false;
                                break;
                            }
                        }
                    }
                    if all { latest } else { None }
                };
                if let Some(l) = newest {
                    break l;
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "{label}: change {k} not ACKed by all in 60 s"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            };
            ms.push((last - t0).as_secs_f64() * 1000.0);
            // Let the debounce window close before the next change.
            tokio::time::sleep(debounce.quiet + Duration::from_millis(50)).await;
        }
        let cpu = cpu_seconds() - cpu_before;
        ms.sort_by(f64::total_cmp);
        let (p50, p99, max, min) = (
            percentile(&ms, 50.0),
            percentile(&ms, 99.0),
            ms.last().copied().unwrap_or(f64::NAN),
            ms.first().copied().unwrap_or(f64::NAN),
        );
        println!(
            "{label:<28} {deps:>10} {:>8} {p50:>9.1} {p99:>9.1} {max:>9.1} {min:>9.1}",
            ms.len()
        );
        rows.push(json!({
            "case": label, "dependents": deps, "changes": ms.len(),
            "ms": {"p50": p50, "p99": p99, "max": max, "min": min, "all": ms},
            "cpu_seconds": cpu,
        }));
    }
    // A rollout of `rollout`'s 100 pods, one every 10 ms, all proxies
    // depending on it: the debounce gathers the steps into a few pushes.
    let versions_before: BTreeMap<usize, usize> = {
        let at = acks.at.lock().expect("lock");
        (0..args.proxies)
            .map(|i| {
                (
                    i,
                    at.range((i, String::new())..(i + 1, String::new())).count(),
                )
            })
            .collect()
    };
    let cpu_before = cpu_seconds();
    let t0 = Instant::now();
    let mut pods: Vec<String> = (0..ROLLOUT_PODS).map(|r| rollout_ip(0, r)).collect();
    for pod in 1..=ROLLOUT_PODS {
        pods[pod - 1] = rollout_ip(pod, pod - 1);
        let eps = pods.clone();
        discovery
            .update(|r| r.apply_slice((NS.into(), "rollout-1".into()), slice("rollout", &eps)));
        tokio::time::sleep(step).await;
    }
    let last_change = Instant::now();
    let deadline = last_change + Duration::from_secs(60);
    let done = loop {
        let latest = {
            let r = acks.rollout.lock().expect("lock");
            let all = (0..args.proxies).all(|i| {
                r.get(&i)
                    .is_some_and(|(s, _)| usize::from(*s) == ROLLOUT_PODS)
            });
            all.then(|| r.values().map(|(_, t)| *t).max()).flatten()
        };
        if let Some(t) = latest {
            break t;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the rollout's end not ACKed by all in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    let mut pushes: Vec<f64> = {
        let at = acks.at.lock().expect("lock");
        (0..args.proxies)
            .map(|i| {
                let n = at.range((i, String::new())..(i + 1, String::new())).count();
                (n - versions_before.get(&i).copied().unwrap_or(0)) as f64
            })
            .collect()
    };
    pushes.sort_by(f64::total_cmp);
    let rollout = json!({
        "pods": ROLLOUT_PODS,
        "step_ms": step.as_millis() as u64,
        "dependents": args.proxies,
        "rollout_seconds": (last_change - t0).as_secs_f64(),
        "last_change_to_all_acked_ms": (done.max(last_change) - last_change).as_secs_f64() * 1000.0,
        "eds_pushes_per_proxy": {"p50": percentile(&pushes, 50.0), "max": pushes.last().copied().unwrap_or(f64::NAN)},
        "cpu_seconds": cpu_seconds() - cpu_before,
    });
    println!(
        "rollout of {ROLLOUT_PODS} pods over {:.1} s, {} dependents: all ACKed the end {:.0} ms after the last change; EDS pushes per proxy p50 {} max {}",
        (last_change - t0).as_secs_f64(),
        args.proxies,
        (done.max(last_change) - last_change).as_secs_f64() * 1000.0,
        percentile(&pushes, 50.0),
        pushes.last().copied().unwrap_or(f64::NAN)
    );
    stop.cancel();
    // Every client gone before the next setting starts its own.
    for t in tasks {
        let _ = t.await;
    }
    println!(
        "subscribed {} proxies in {subscribe_seconds:.1} s; allocated {alloc_after_subscribe:.0} MiB (server and clients)",
        args.proxies,
    );
    Ok(json!({
        "protocol": xds.label(),
        "debounce_ms": {"quiet": debounce.quiet.as_millis() as u64, "max": debounce.max_delay.as_millis() as u64},
        "push_throttle": push_throttle,
        "most_pushes_at_once": discovery.throttle.most(),
        "subscribe_seconds": subscribe_seconds,
        "cpu_seconds_to_subscribe": cpu_after_subscribe,
        "allocated_mib_after_subscribe": alloc_after_subscribe,
        "rows": rows,
        "rollout": rollout,
    }))
}
