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

pub fn print_withdrawal_phase(p: &super::withdrawal::Phase) {
    let confirmed = p
        .confirmed
        .map(|c| {
            format!(
                "  confirmed p50/p99/max {:.1}/{:.1}/{:.1} ms (server {:.0} ms p50, {:.0} waited for, {} timed out)",
                c.p50_ms,
                c.p99_ms,
                c.max_ms,
                crate::stats::Summary::of(&p.server_ms).p50_ms,
                p.expected_p50,
                p.timed_out,
            )
        })
        .unwrap_or_default();
    let memory = p
        .memory
        .map(|m| {
            format!(
                "  heap {:.1} → {:.1} → {:.1} MiB ({:.0} B per withdrawn pod)",
                m.heap_bytes_before as f64 / 1_048_576.0,
                m.heap_bytes_withdrawn as f64 / 1_048_576.0,
                m.heap_bytes_gone as f64 / 1_048_576.0,
                m.heap_bytes_per_withdrawn_pod,
            )
        })
        .unwrap_or_default();
    println!(
        "  rollout {} {:<16} N={:<5} {} pods in {:.1} s  all ACKed without p50/p99/max {:.1}/{:.1}/{:.1} ms{confirmed}{memory}",
        p.rollout,
        p.contender.to_string(),
        p.proxies,
        p.pods,
        p.write_seconds,
        p.acked.p50_ms,
        p.acked.p99_ms,
        p.acked.max_ms,
    );
}

/// One row per (N, contender) over every rollout: each rollout's p50, p99
/// and max, as median [min–max] over the rollouts.
pub fn summarize_withdrawal(phases: &[super::withdrawal::Phase]) -> Vec<Value> {
    let mut by: BTreeMap<(usize, Contender), Vec<&super::withdrawal::Phase>> = BTreeMap::new();
    for p in phases {
        by.entry((p.proxies, p.contender)).or_default().push(p);
    }
    let s = |(m, lo, hi): (f64, f64, f64)| json!({"median": m, "min": lo, "max": hi});
    let rows: Vec<Value> = by
        .iter()
        .map(|(&(n, c), ps)| {
            let of = |f: &dyn Fn(&super::withdrawal::Phase) -> Option<f64>| {
                s(spread(&ps.iter().filter_map(|p| f(p)).collect::<Vec<_>>()))
            };
            json!({
                "proxies": n,
                "contender": c,
                "rollouts": ps.len(),
                "pods": ps.first().map(|p| p.pods),
                "confirmed_p50_ms": of(&|p| p.confirmed.map(|q| q.p50_ms)),
                "confirmed_p99_ms": of(&|p| p.confirmed.map(|q| q.p99_ms)),
                "confirmed_max_ms": of(&|p| p.confirmed.map(|q| q.max_ms)),
                "acked_p50_ms": of(&|p| Some(p.acked.p50_ms)),
                "acked_p99_ms": of(&|p| Some(p.acked.p99_ms)),
                "acked_max_ms": of(&|p| Some(p.acked.max_ms)),
                "waited_for_p50": of(&|p| Some(p.expected_p50).filter(|x| x.is_finite())),
                // Only Remora gives up on a withdrawal.
                "timed_out": (c == Contender::Remora).then(|| ps.iter().map(|p| p.timed_out).sum::<usize>()),
                "cpu_seconds_rollout": of(&|p| Some(p.cpu_seconds_rollout)),
                "heap_bytes_per_withdrawn_pod": of(&|p| p.memory.map(|m| m.heap_bytes_per_withdrawn_pod)),
                "heap_mib_withdrawn_minus_before": of(&|p| p.memory.map(|m| (m.heap_bytes_withdrawn as f64 - m.heap_bytes_before as f64) / 1_048_576.0)),
                "heap_mib_gone_minus_before": of(&|p| p.memory.map(|m| (m.heap_bytes_gone as f64 - m.heap_bytes_before as f64) / 1_048_576.0)),
                "rss_mib_withdrawn": of(&|p| p.memory.map(|m| m.rss_mib_withdrawn)),
            })
        })
        .collect();
    // Remora's confirmation p99 over each istiod row's all-ACKed p99, at the same N.
    rows.iter()
        .map(|r| {
            let mut r = r.clone();
            let remora = rows.iter().find(|o| {
                o["proxies"] == r["proxies"] && o["contender"] == json!(Contender::Remora)
            });
            if r["contender"] != json!(Contender::Remora)
                && let Some(remora) = remora
            {
                let a = remora["confirmed_p99_ms"]["median"].as_f64();
                let b = r["acked_p99_ms"]["median"].as_f64();
                if let (Some(a), Some(b)) = (a, b) {
                    r["remora_confirmed_p99_over_this_p99"] = json!(a / b);
                }
            }
            r
        })
        .collect()
}

pub fn print_withdrawal_table(rows: &[Value]) {
    let g = |r: &Value, k: &str, d: usize| -> String {
        let v = &r[k];
        let f = |x: &Value| x.as_f64().unwrap_or(f64::NAN);
        if v["median"].is_null() {
            return "–".into();
        }
        fmt3((f(&v["median"]), f(&v["min"]), f(&v["max"])), d)
    };
    println!();
    println!(
        "| N | contender | rollouts × pods | confirmed p50 ms | confirmed p99 ms | confirmed max ms | all ACKed without p50 ms | all ACKed without p99 ms | all ACKed without max ms | timed out | Remora p99 ÷ this p99 | heap per withdrawn pod B | heap withdrawn − before MiB | heap gone − before MiB |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} × {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r["proxies"],
            r["contender"].as_str().unwrap_or(""),
            r["rollouts"],
            r["pods"],
            g(r, "confirmed_p50_ms", 1),
            g(r, "confirmed_p99_ms", 1),
            g(r, "confirmed_max_ms", 1),
            g(r, "acked_p50_ms", 1),
            g(r, "acked_p99_ms", 1),
            g(r, "acked_max_ms", 1),
            r["timed_out"]
                .as_u64()
                .map_or("–".into(), |t| t.to_string()),
            r["remora_confirmed_p99_over_this_p99"]
                .as_f64()
                .map_or("–".into(), |x| format!("{x:.2}")),
            g(r, "heap_bytes_per_withdrawn_pod", 0),
            g(r, "heap_mib_withdrawn_minus_before", 2),
            g(r, "heap_mib_gone_minus_before", 2),
        );
    }
}

pub fn write_withdrawal(
    out: &Path,
    args: &Args,
    phases: &[super::withdrawal::Phase],
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
        "rollouts": args.rollouts,
        "rollout": {"pods": args.rollout_pods, "step_ms": args.rollout_step_ms},
        "api_server": if args.kubeconfig.is_some() { "--kubeconfig" } else { "a local control plane (no controller manager)" },
        "duration_seconds": seconds,
        "measured": "per callee pod, from just before its deletion's API call (the same instant for every contender): confirmed = Remora's Withdrawal subscriber for the pod (as its agent subscribes) told the withdrawal is done; all ACKed without = the last of the N simulated proxies ACKed an EDS response after which it no longer routes to the pod. Per rollout p50/p99/max over its pods; the table gives the median [min–max] over rollouts. Right after each deletion the bench writes the slice as the EndpointSlice controller would (the endpoint terminating).",
        "not_covered": [
            "the real EndpointSlice controller's lag between a deletion and its slice write (none runs here; the bench writes it one API call after the deletion): on a cluster it comes on top of istiod's figure, not Remora's, which withdraws from the pod watch",
            "Envoy's apply time: the simulated proxies ACK at once",
            "Remora's N proxies are put in its registry rather than read from pods, and TokenReview is a double; the callee pods are real pods on a node that does not exist",
            "istiod is dialled on its plaintext port; Remora's proxies use TLS",
            "replacement pods during the rollout: each phase's pods are created before it",
            "memory: the heap's difference also holds what else changed meanwhile (smaller EDS snapshots, push buffers): an upper bound of the tracking's own",
            "one replica of each; the API server, the clients and both contenders share the machine's cores, and the idle contenders follow every write meanwhile",
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
