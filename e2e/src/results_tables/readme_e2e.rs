//! `e2e/README.md`'s tables: `discovery-bench`, Remora beside istiod.

use serde_json::Value;

use super::Error;
use super::format::{dec, list, num, plain, table, text};

/// A summary statistic (`{median, min, max}`) as `median [min–max]`, or
/// the median alone; `None` when the contender has no such figure.
fn stat(row: &Value, key: &str, decimals: usize, range: bool) -> Result<Option<String>, Error> {
    let median = match row.get(key).and_then(|s| s.get("median")) {
        None | Some(Value::Null) => return Ok(None),
        Some(_) => num(row, &format!("{key}.median"))?,
    };
    Ok(Some(if range {
        format!(
            "{} [{}–{}]",
            dec(median, decimals),
            dec(num(row, &format!("{key}.min"))?, decimals),
            dec(num(row, &format!("{key}.max"))?, decimals)
        )
    } else {
        dec(median, decimals)
    }))
}

fn need(row: &Value, key: &str, decimals: usize, range: bool) -> Result<String, Error> {
    stat(row, key, decimals, range)?.ok_or_else(|| Error::Missing {
        key: format!("{key}.median"),
    })
}

fn or_dash(s: Option<String>) -> String {
    s.unwrap_or_else(|| "–".to_string())
}

/// `e2e/README.md`, `discovery-bench` at 100 and 1,000 proxies.
pub fn discovery_istiod(files: &[Value]) -> Result<String, Error> {
    let v = &files[0];
    let rows = list(v, "summary")?
        .iter()
        .map(|r| {
            Ok(vec![
                plain(num(r, "proxies")?),
                text(r, "contender")?.to_string(),
                plain(num(r, "eds_clusters_per_proxy")?),
                need(r, "subscribe_seconds", 1, true)?,
                need(r, "one_service_ms", 0, true)?,
                need(r, "shared_ms", 0, true)?,
                need(r, "rollout_last_write_to_all_acked_ms", 0, true)?,
                need(r, "rollout_eds_responses_per_proxy", 0, true)?,
                need(r, "cpu_seconds_subscribe", 2, false)?,
                need(r, "cpu_seconds_per_change", 3, false)?,
                need(r, "cpu_seconds_rollout", 2, false)?,
                format!(
                    "{} ({})",
                    need(r, "rss_mib_subscribed", 0, false)?,
                    plain(num(r, "peak_rss_mib")?)
                ),
                or_dash(stat(r, "istiod_convergence_mean_ms", 0, false)?),
            ])
        })
        .collect::<Result<Vec<_>, Error>>()?;
    Ok(table(
        &[
            "N",
            "contender",
            "EDS clusters/proxy",
            "subscribe s",
            "one Service (N/S deps) ms",
            "`shared` (N deps) ms",
            "rollout: last write → all ACKed ms",
            "EDS responses/proxy in rollout",
            "CPU s: subscribe",
            "CPU s per change",
            "CPU s rollout",
            "RSS MiB subscribed (process peak)",
            "istiod convergence mean ms",
        ],
        &rows,
    ))
}

/// `e2e/README.md`, `discovery-bench` at 10,000 proxies: each file's rows
/// in turn. Per-cycle figures show their spread only over several cycles;
/// the latencies always (each cycle measures several changes).
pub fn discovery_istiod_10000(files: &[Value]) -> Result<String, Error> {
    let mut rows = Vec::new();
    for v in files {
        let cycles = num(v, "cycles")? > 1.0;
        for r in list(v, "summary")? {
            rows.push(vec![
                plain(num(r, "proxies")?),
                text(r, "contender")?.to_string(),
                need(r, "subscribe_seconds", 1, cycles)?,
                need(r, "one_service_ms", 0, true)?,
                need(r, "shared_ms", 0, true)?,
                need(r, "rollout_last_write_to_all_acked_ms", 0, cycles)?,
                need(r, "rollout_eds_responses_per_proxy", 0, cycles)?,
                format!(
                    "{} / {} / {}",
                    need(r, "cpu_seconds_subscribe", 2, false)?,
                    need(r, "cpu_seconds_per_change", 3, false)?,
                    need(r, "cpu_seconds_rollout", 2, false)?
                ),
                format!(
                    "{} ({})",
                    need(r, "rss_mib_subscribed", 0, false)?,
                    plain(num(r, "peak_rss_mib")?)
                ),
                or_dash(stat(r, "heap_mib_subscribed", 0, false)?),
            ]);
        }
    }
    Ok(table(
        &[
            "N",
            "contender",
            "subscribe s",
            "one Service (N/S deps) ms",
            "`shared` (N deps) ms",
            "rollout: last write → all ACKed ms",
            "EDS responses/proxy in rollout",
            "CPU s: subscribe / per change / rollout",
            "RSS MiB subscribed (peak)",
            "live heap MiB",
        ],
        &rows,
    ))
}

/// `e2e/README.md`, `agent-microbench`: each row's medians and p90 for
/// both agents, and remora-agent's median over pilot-agent's.
pub fn agent_microbench(files: &[Value]) -> Result<String, Error> {
    let v = &files[0];
    let mut rows = Vec::new();
    for r in list(v, "rows")? {
        // A contender with no sample (every run failed) has null figures.
        let fig = |who: &str, k: &str| -> String {
            r.get(who)
                .and_then(|c| c.get(k))
                .and_then(Value::as_f64)
                .map_or_else(|| "–".to_string(), |x| dec(x, 1))
        };
        rows.push(vec![
            text(r, "label")?.to_string(),
            text(r, "unit")?.to_string(),
            fig("remora-agent", "p50"),
            fig("remora-agent", "p90"),
            fig("pilot-agent", "p50"),
            fig("pilot-agent", "p90"),
            r.get("ratio_p50_remora_over_pilot")
                .and_then(Value::as_f64)
                .map_or_else(|| "n/a".to_string(), |x| dec(x, 2)),
        ]);
    }
    Ok(table(
        &[
            "agent micro-bench",
            "unit",
            "remora p50",
            "remora p90",
            "pilot p50",
            "pilot p90",
            "remora / pilot (p50)",
        ],
        &rows,
    ))
}
