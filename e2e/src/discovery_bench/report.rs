//! The bench's table and its results file: per (N, contender), medians
//! over every cycle with the spread (min–max), and each phase in full.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Value, json};

use super::{Args, Contender, Phase};
use crate::stats::percentile;
use remora_test_support::results;

/// Median, min and max of `v` (NaN when empty).
fn spread(v: &[f64]) -> (f64, f64, f64) {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    s.sort_by(f64::total_cmp);
    (percentile(&s, 0.5), s[0], s[s.len() - 1])
}

fn fmt3((m, lo, hi): (f64, f64, f64), digits: usize) -> String {
    format!("{m:.digits$} [{lo:.digits$}–{hi:.digits$}]")
}

pub fn print_phase(p: &Phase) {
    let (one, _, _) = spread(&p.one_service_ms);
    let (shared, _, _) = spread(&p.shared_ms);
    println!(
        "  cycle {} {:<16} N={:<5} clusters {:>4}  subscribe {:>5.1} s  1 svc p50 {:>7.1} ms  shared p50 {:>7.1} ms  rollout end→all {:>7.1} ms, {} EDS/proxy  CPU {:.2}/{:.2}/{:.2} s  RSS {:.0} MiB{}",
        p.cycle,
        p.contender.to_string(),
        p.proxies,
        p.eds_clusters_per_proxy,
        p.subscribe_seconds,
        one,
        shared,
        p.rollout.last_write_to_all_acked_ms,
        p.rollout.eds_responses_per_proxy_p50,
        p.cpu_seconds.subscribe,
        p.cpu_seconds.changes,
        p.cpu_seconds.rollout,
        p.rss_mib_subscribed,
        p.heap_mib_subscribed
            .map(|h| format!(" (live heap {h:.0} MiB)"))
            .unwrap_or_default(),
    );
}

/// One row of the summary: (N, contender) over every cycle.
pub fn summarize(phases: &[Phase]) -> Vec<Value> {
    let mut by: BTreeMap<(usize, Contender), Vec<&Phase>> = BTreeMap::new();
    for p in phases {
        by.entry((p.proxies, p.contender)).or_default().push(p);
    }
    by.into_iter()
        .map(|((n, c), ps)| {
            let all = |f: &dyn Fn(&Phase) -> Vec<f64>| -> Vec<f64> {
                ps.iter().flat_map(|p| f(p)).collect()
            };
            let one = spread(&all(&|p| p.one_service_ms.clone()));
            let shared = spread(&all(&|p| p.shared_ms.clone()));
            let rollout = spread(&all(&|p| vec![p.rollout.last_write_to_all_acked_ms]));
            let pushes = spread(&all(&|p| vec![p.rollout.eds_responses_per_proxy_p50]));
            let changes = ps
                .first()
                .map_or(1, |p| p.one_service_ms.len() + p.shared_ms.len())
                as f64;
            let cpu_sub = spread(&all(&|p| vec![p.cpu_seconds.subscribe]));
            let cpu_change = spread(&all(&|p| vec![p.cpu_seconds.changes / changes]));
            let cpu_rollout = spread(&all(&|p| vec![p.cpu_seconds.rollout]));
            let rss = spread(&all(&|p| vec![p.rss_mib_subscribed]));
            let peak = ps.iter().map(|p| p.peak_rss_mib).fold(0.0, f64::max);
            let heap = spread(&all(&|p| p.heap_mib_subscribed.into_iter().collect()));
            let subscribe = spread(&all(&|p| vec![p.subscribe_seconds]));
            let conv_mean = spread(&all(&|p| {
                p.istiod_convergence.iter().map(|c| c.mean_ms).collect()
            }));
            let conv_p50 = spread(&all(&|p| {
                p.istiod_convergence
                    .iter()
                    .filter_map(|c| c.p50_at_most_ms)
                    .collect()
            }));
            let s = |(m, lo, hi): (f64, f64, f64)| json!({"median": m, "min": lo, "max": hi});
            json!({
                "proxies": n,
                "contender": c,
                "cycles": ps.len(),
                "eds_clusters_per_proxy": ps.first().map(|p| p.eds_clusters_per_proxy),
                "one_service_dependents": ps.first().map(|p| p.one_service_dependents),
                "subscribe_seconds": s(subscribe),
                "one_service_ms": s(one),
                "shared_ms": s(shared),
                "rollout_last_write_to_all_acked_ms": s(rollout),
                "rollout_eds_responses_per_proxy": s(pushes),
                "cpu_seconds_subscribe": s(cpu_sub),
                "cpu_seconds_per_change": s(cpu_change),
                "cpu_seconds_rollout": s(cpu_rollout),
                "rss_mib_subscribed": s(rss),
                "peak_rss_mib": peak,
                "heap_mib_subscribed": s(heap),
                "istiod_convergence_mean_ms": s(conv_mean),
                "istiod_convergence_p50_at_most_ms": s(conv_p50),
            })
        })
        .collect()
}

pub fn print_table(rows: &[Value]) {
    let g = |r: &Value, k: &str, d: usize| -> String {
        let v = &r[k];
        let f = |x: &Value| x.as_f64().unwrap_or(f64::NAN);
        fmt3((f(&v["median"]), f(&v["min"]), f(&v["max"])), d)
    };
    println!();
    println!(
        "| N | contender | EDS clusters/proxy | subscribe s | 1 Service (N/S deps) ms | shared (N deps) ms | rollout last write→all ACKed ms | EDS responses/proxy in rollout | CPU s: subscribe | CPU s per change | CPU s rollout | RSS MiB subscribed (peak) | live heap MiB subscribed | istiod convergence mean ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} ({:.0}) | {} | {} |",
            r["proxies"],
            r["contender"].as_str().unwrap_or(""),
            r["eds_clusters_per_proxy"],
            g(r, "subscribe_seconds", 1),
            g(r, "one_service_ms", 0),
            g(r, "shared_ms", 0),
            g(r, "rollout_last_write_to_all_acked_ms", 0),
            g(r, "rollout_eds_responses_per_proxy", 0),
            g(r, "cpu_seconds_subscribe", 2),
            g(r, "cpu_seconds_per_change", 3),
            g(r, "cpu_seconds_rollout", 2),
            g(r, "rss_mib_subscribed", 0),
            r["peak_rss_mib"].as_f64().unwrap_or(f64::NAN),
            g(r, "heap_mib_subscribed", 0),
            if r["contender"] == "remora" {
                "–".to_string()
            } else {
                g(r, "istiod_convergence_mean_ms", 0)
            },
        );
    }
}

pub fn write(
    out: &Path,
    args: &Args,
    phases: &[Phase],
    rows: &[Value],
    machine_before: Value,
    seconds: f64,
) -> anyhow::Result<()> {
    let mut doc = results::stamp(&machine_before);
    doc.insert("machine_after".into(), results::machine());
    let body = json!({
        "istio_version": std::env::var("ISTIO_VERSION").unwrap_or_else(|_| "v0.0.0-20260827124520-eed52ebb66ad".into()),
        "istiod_env": args.istiod_env,
        "services": args.services,
        "protocol": args.protocol,
        "cycles": args.cycles,
        "changes_per_case": args.changes,
        "rollout": {"writes": args.rollout_pods, "step_ms": args.rollout_step_ms},
        "duration_seconds": seconds,
        "measured": "an EndpointSlice write to the API server → the last dependent proxy ACKed an EDS response carrying the new endpoint; CPU and RSS of each contender's own process (/proc); medians over every cycle with [min–max]",
        "not_covered": [
            "Envoy's apply time: the simulated proxies ACK at once",
            "RDS: not subscribed (endpoint changes do not touch routes)",
            "Remora: the proxies are put in its registry rather than read from pods by its pod watch, and TokenReview is a double (one token for all)",
            "istiod is dialled on its plaintext port; Remora's proxies use TLS",
            "one replica of each; the API server, the clients and both contenders share the machine's cores, and the idle contenders follow every write meanwhile",
            "istiod's debounce at Istio's defaults (PILOT_DEBOUNCE_AFTER 100ms, PILOT_DEBOUNCE_MAX 10s, EDS debounce on) unless istiod_env says otherwise; Remora's at the operator's (100 ms quiet, 1 s max)",
        ],
        "summary": rows,
        "phases": phases,
    });
    if let Value::Object(body) = body {
        doc.extend(body);
    }
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(out, serde_json::to_string_pretty(&doc)? + "\n")?;
    Ok(())
}
