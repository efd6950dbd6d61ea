//! The top-level README's tables.

use serde_json::Value;

use super::Error;
use super::format::{dec, int, list, num, plain, short, sig3, table, text};

fn ms(x: f64) -> String {
    format!("{} ms", int(x))
}

/// `README.md`, "EDS convergence on the node".
pub fn eds_convergence(files: &[Value]) -> Result<String, Error> {
    let v = &files[0];
    let sizes = list(v, "sizes")?;
    let n = sizes
        .first()
        .map(|s| num(s, "to_every_client.n"))
        .transpose()?
        .unwrap_or(0.0);
    let p99 = format!("to all p99 (= max of {})", plain(n));
    let rows = sizes
        .iter()
        .map(|s| {
            Ok(vec![
                plain(num(s, "clients")?),
                ms(num(s, "to_every_client.p50_ms")?),
                ms(num(s, "to_every_client.p99_ms")?),
                ms(num(s, "to_every_client_lower_bound.p50_ms")?),
                ms(num(s, "per_client.p50_ms")?),
                ms(num(s, "resolution.p50_ms")?),
            ])
        })
        .collect::<Result<Vec<_>, Error>>()?;
    Ok(table(
        &[
            "clients",
            "to all p50",
            &p99,
            "from below p50",
            "per client p50",
            "poll window p50",
        ],
        &rows,
    ))
}

/// A push bench file's settings: `settings[]`, or the file itself when it
/// measured one setting (before `--protocol` and the setting lists).
fn settings(v: &Value) -> Result<Vec<&Value>, Error> {
    match v.get("settings") {
        Some(_) => Ok(list(v, "settings")?.iter().collect()),
        None => Ok(vec![v]),
    }
}

/// A setting's protocol; files from before `--protocol` measured state of
/// the world only.
fn protocol_of(s: &Value) -> &str {
    s.get("protocol").and_then(Value::as_str).unwrap_or("sotw")
}

/// EDS pushes per proxy in a rollout: `2`, or `1–2` when proxies differ.
fn pushes(s: &Value) -> Result<String, Error> {
    let p50 = num(s, "rollout.eds_pushes_per_proxy.p50")?;
    let max = num(s, "rollout.eds_pushes_per_proxy.max")?;
    Ok(if p50 == max {
        plain(p50)
    } else {
        format!("{}–{}", plain(p50), plain(max))
    })
}

/// `README.md`, "Push cost": every setting of every file, one row per case.
pub fn discovery_push(files: &[Value]) -> Result<String, Error> {
    let mut rows = Vec::new();
    for v in files {
        let proxies = num(v, "proxies")?;
        let fleet = format!("{} / {}", int(proxies), int(num(v, "services")?));
        for s in settings(v)? {
            let protocol = protocol_of(s);
            for r in list(s, "rows")? {
                let dependents = num(r, "dependents")?;
                let rollout = if dependents == proxies {
                    format!(
                        "{}, {}",
                        ms(num(s, "rollout.last_change_to_all_acked_ms")?),
                        pushes(s)?
                    )
                } else {
                    String::new()
                };
                rows.push(vec![
                    fleet.clone(),
                    protocol.to_string(),
                    format!("{} dependents", int(dependents)),
                    ms(num(r, "ms.p50")?),
                    ms(num(r, "ms.p99")?),
                    rollout,
                ]);
            }
        }
    }
    Ok(table(
        &[
            "proxies / Services",
            "protocol",
            "change seen by",
            "p50",
            "p99",
            "rollout of 100 pods: last change → all ACKed, EDS pushes per proxy",
        ],
        &rows,
    ))
}

/// The heap profile's parts as the README groups them; a part in no group
/// gets a row of its own under the profile's name.
const HEAP_GROUPS: &[(&str, &[&str])] = &[
    (
        "tonic: the generated ADS service's codec buffers (8 KiB each way, fixed by `ProstCodec::default()`)",
        &["tonic: codec buffers of the generated ADS service (8 KiB each way)"],
    ),
    (
        "h2: write buffer (16 KiB, fixed in h2)",
        &["h2: write buffer (16 KiB)"],
    ),
    (
        "h2: read buffer (8 KiB, tokio-util's codec)",
        &["h2: read buffer (8 KiB)"],
    ),
    ("h2: hpack decoder (4 KiB)", &["h2: hpack decoder (4 KiB)"]),
    (
        "h2: stream state, hpack tables, other",
        &["h2: stream state", "h2: hpack tables", "h2: other"],
    ),
    (
        "rustls: deframer buffer (4 KiB), keys, handshake leftovers",
        &["rustls"],
    ),
    ("hyper", &["hyper"]),
    (
        "Remora: the stream's task (its future)",
        &["remora: the stream's task (spawned future)"],
    ),
    (
        "Remora: delta session (what the proxy holds, by name and version)",
        &["remora: delta session"],
    ),
    (
        "Remora: stream, pod resource, snapshots, connection bounds",
        &[
            "remora: stream (server.rs)",
            "remora: generated resources",
            "remora: push/snapshots",
            "remora: grpc_server (connection bounds)",
        ],
    ),
];

/// `README.md`, "The server's memory per proxy": the server's parts.
pub fn discovery_heap(files: &[Value]) -> Result<String, Error> {
    let v = &files[0];
    let mut parts = Vec::new();
    for p in list(v, "parts")? {
        if text(p, "side")? == "server" {
            parts.push((text(p, "part")?, num(p, "bytes_per_proxy")?));
        }
    }
    let mut rows = Vec::new();
    for (label, names) in HEAP_GROUPS {
        let found: Vec<f64> = parts
            .iter()
            .filter(|(p, _)| names.contains(p))
            .map(|(_, b)| *b)
            .collect();
        if !found.is_empty() {
            rows.push(vec![label.to_string(), int(found.iter().sum())]);
        }
    }
    for (p, b) in &parts {
        if !HEAP_GROUPS.iter().any(|(_, names)| names.contains(p)) {
            rows.push(vec![p.to_string(), int(*b)]);
        }
    }
    rows.push(vec![
        "**total**".to_string(),
        format!("**{}**", int(num(v, "server_bytes_per_proxy")?)),
    ]);
    Ok(table(&["part of the server", "bytes per proxy"], &rows))
}

/// `README.md`, "The debounce, chosen by measurement": a row per quiet
/// window; the latency figures from its fastest rollout's setting, then
/// each rollout pace, slowest first.
pub fn discovery_debounce(files: &[Value]) -> Result<String, Error> {
    let v = &files[0];
    let all = settings(v)?;
    let mut quiets: Vec<f64> = Vec::new();
    let mut steps: Vec<f64> = Vec::new();
    for s in &all {
        let q = num(s, "debounce_ms.quiet")?;
        if !quiets.contains(&q) {
            quiets.push(q);
        }
        let step = num(s, "rollout.step_ms")?;
        if !steps.contains(&step) {
            steps.push(step);
        }
    }
    steps.sort_by(|a, b| b.total_cmp(a));
    let fastest = *steps.last().ok_or_else(|| Error::Shape {
        what: "no settings".to_string(),
    })?;
    let mut protocols: Vec<&str> = Vec::new();
    for s in &all {
        let p = protocol_of(s);
        if !protocols.contains(&p) {
            protocols.push(p);
        }
    }
    let find = |p: &str, q: f64, step: f64| -> Result<Option<&Value>, Error> {
        for s in &all {
            if protocol_of(s) == p
                && num(s, "debounce_ms.quiet")? == q
                && num(s, "rollout.step_ms")? == step
            {
                return Ok(Some(*s));
            }
        }
        Ok(None)
    };
    let first = match (protocols.first(), quiets.first()) {
        (Some(p), Some(q)) => find(p, *q, fastest)?,
        _ => None,
    }
    .ok_or_else(|| Error::Shape {
        what: "no setting at the fastest rollout".to_string(),
    })?;
    let few = format!(
        "{} dependents p50 / p99",
        int(num(first, "rows.0.dependents")?)
    );
    let many = format!("{} dependents p50", int(num(first, "rows.1.dependents")?));
    let mut header = vec!["protocol".to_string(), "quiet".to_string(), few, many];
    for (i, step) in steps.iter().enumerate() {
        let pods = num(first, "rollout.pods")?;
        let over = short(pods * step / 1000.0);
        header.push(if i == 0 {
            format!(
                "rollout over {over} s (a pod every {} ms): EDS pushes per proxy, CPU-seconds",
                plain(*step)
            )
        } else {
            format!(
                "rollout over {over} s (every {} ms): pushes, CPU-seconds",
                plain(*step)
            )
        });
    }
    let mut rows = Vec::new();
    for (p, q) in protocols
        .iter()
        .flat_map(|p| quiets.iter().map(move |q| (*p, q)))
    {
        let lat = find(p, *q, fastest)?.ok_or_else(|| Error::Shape {
            what: format!("no {p} setting for quiet {q} ms at the fastest rollout"),
        })?;
        let mut row = vec![
            p.to_string(),
            format!("{} ms", plain(*q)),
            format!(
                "{} / {} ms",
                plain(num(lat, "rows.0.ms.p50")?),
                plain(num(lat, "rows.0.ms.p99")?)
            ),
            ms(num(lat, "rows.1.ms.p50")?),
        ];
        for step in &steps {
            row.push(match find(p, *q, *step)? {
                Some(s) => format!(
                    "{}, {} s",
                    plain(num(s, "rollout.eds_pushes_per_proxy.p50")?),
                    dec(num(s, "rollout.cpu_seconds")?, 1)
                ),
                None => "–".to_string(),
            });
        }
        rows.push(row);
    }
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    Ok(table(&header, &rows))
}

/// `README.md`, "Push throttling": a row per throttle setting.
pub fn discovery_push_throttle(files: &[Value]) -> Result<String, Error> {
    let v = &files[0];
    let proxies = num(v, "proxies")?;
    let mut rows = Vec::new();
    for s in settings(v)? {
        let throttle = num(s, "push_throttle")?;
        let pair = |path: &str| -> Result<String, Error> {
            Ok(format!(
                "{} / {} ms",
                plain(num(s, &format!("{path}.p50"))?),
                plain(num(s, &format!("{path}.p99"))?)
            ))
        };
        rows.push(vec![
            protocol_of(s).to_string(),
            // A bound at least the fleet never binds.
            if throttle >= proxies {
                "unbounded".to_string()
            } else {
                int(throttle)
            },
            int(num(s, "most_pushes_at_once")?),
            pair("rows.0.ms")?,
            pair("rows.1.ms")?,
            ms(num(s, "rollout.last_change_to_all_acked_ms")?),
        ]);
    }
    let first = settings(v)?
        .into_iter()
        .next()
        .ok_or_else(|| Error::Shape {
            what: "no settings".to_string(),
        })?;
    let few = format!(
        "{} dependents p50 / p99",
        int(num(first, "rows.0.dependents")?)
    );
    let many = format!(
        "{} dependents p50 / p99",
        int(num(first, "rows.1.dependents")?)
    );
    Ok(table(
        &[
            "protocol",
            "throttle",
            "most at once",
            &few,
            &many,
            "rollout: last change → all ACKed",
        ],
        &rows,
    ))
}

/// `README.md`, "Hostile clients": the last run's rows.
pub fn hostile(files: &[Value]) -> Result<String, Error> {
    let v = &files[0];
    let rows = list(v, "rows")?
        .iter()
        .map(|r| {
            let probe = |k: &str| -> Result<String, Error> {
                Ok(format!("{} ms", sig3(num(r, &format!("probes.{k}"))?)))
            };
            Ok(vec![
                text(r, "target")?.to_string(),
                text(r, "attack")?.to_string(),
                dec(num(r, "rss_ratio")?, 2),
                probe("p50_ms")?,
                probe("p99_ms")?,
                probe("max_ms")?,
                int(num(r, "probes_failed")?),
                int(num(r, "reviews_answered")?),
            ])
        })
        .collect::<Result<Vec<_>, Error>>()?;
    Ok(table(
        &[
            "target",
            "attack",
            "peak/idle RSS",
            "probe p50",
            "probe p99",
            "probe max",
            "probes failed",
            "reviews answered",
        ],
        &rows,
    ))
}

/// `README.md`, node startup: pod create → Ready per sidecar variant. The
/// file has `startup` at the top (one install, older `node-bench`) or in
/// each of `installs[]`; then each row names its install.
pub fn node_startup(files: &[Value]) -> Result<String, Error> {
    let v = &files[0];
    let mut groups: Vec<(Option<&str>, &[Value])> = Vec::new();
    if v.get("startup").is_some() {
        groups.push((None, list(v, "startup")?));
    } else {
        for i in list(v, "installs")? {
            if i.get("startup").is_some() {
                groups.push((Some(text(i, "install")?), list(i, "startup")?));
            }
        }
    }
    if groups.is_empty() {
        return Err(Error::Missing {
            key: "startup (or installs[].startup)".to_string(),
        });
    }
    let by_install = groups.iter().any(|(i, _)| i.is_some());
    let mut rows = Vec::new();
    for (install, startup) in groups {
        for s in startup {
            let variant = text(s, "variant")?;
            let cell = |stat: &str, tax: &str| -> Result<String, Error> {
                let t = num(s, &format!("create_to_ready.{stat}"))?;
                Ok(if variant == "none" {
                    format!("{} ms", plain(t))
                } else {
                    format!("{} ms (+{})", plain(t), plain(num(s, tax)?))
                })
            };
            let mut row = Vec::new();
            if by_install {
                row.push(install.unwrap_or_default().to_string());
            }
            row.extend([
                if variant == "none" {
                    "pod create → Ready, no sidecar".to_string()
                } else {
                    format!("… with {} (tax)", sidecar_phrase(variant))
                },
                plain(num(s, "create_to_ready.n")?),
                cell("p50_ms", "tax_p50_ms")?,
                cell("p99_ms", "tax_p99_ms")?,
            ]);
            rows.push(row);
        }
    }
    let mut header = Vec::new();
    if by_install {
        header.push("install");
    }
    header.extend(["measurement", "n", "p50", "p99"]);
    Ok(table(&header, &rows))
}

/// A node-bench variant in words: Remora's modes by name, Istio's profiles
/// (`istio-…`, `e2e::node::istio::Profile`) as such.
fn sidecar_phrase(variant: &str) -> String {
    if variant.starts_with("istio-") {
        format!("Istio's sidecar, `{variant}`")
    } else {
        format!("a {variant} sidecar")
    }
}

/// `README.md`, node Jobs and retune: a column pair per install.
pub fn node_jobs_retune(files: &[Value]) -> Result<String, Error> {
    let v = &files[0];
    let installs = list(v, "installs")?;
    let first = installs.first().ok_or_else(|| Error::Shape {
        what: "no installs".to_string(),
    })?;
    let mut header = vec!["measurement".to_string(), "n".to_string()];
    for i in installs {
        let name = text(i, "install")?;
        header.push(format!("{name} p50"));
        header.push(format!("{name} p99"));
    }
    let cells = |stat: &dyn Fn(&Value) -> Result<&Value, Error>| -> Result<Vec<String>, Error> {
        let mut out = Vec::new();
        for i in installs {
            let s = stat(i)?;
            out.push(format!("{} ms", plain(num(s, "p50_ms")?)));
            out.push(format!("{} ms", plain(num(s, "p99_ms")?)));
        }
        Ok(out)
    };
    let mut rows = Vec::new();
    for job in list(first, "jobs")? {
        let mode = text(job, "mode")?.to_string();
        let mut row = vec![
            format!(
                "Job with {}: app exit → pod Succeeded",
                sidecar_phrase(&mode)
            ),
            plain(num(job, "app_exit_to_succeeded.n")?),
        ];
        row.extend(cells(&|i: &Value| {
            list(i, "jobs")?
                .iter()
                .find(|j| j.get("mode").and_then(Value::as_str) == Some(mode.as_str()))
                .and_then(|j| j.get("app_exit_to_succeeded"))
                .ok_or_else(|| Error::Missing {
                    key: format!("jobs[mode={mode}].app_exit_to_succeeded"),
                })
        })?);
        rows.push(row);
    }
    let mut retune = vec![
        "SidecarLifecycle edit → agent's `/debug/config`".to_string(),
        plain(num(first, "retune.edit_to_agent.n")?),
    ];
    retune.extend(cells(&|i: &Value| {
        super::format::at(i, "retune.edit_to_agent")
    })?);
    rows.push(retune);
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    Ok(table(&header, &rows))
}

/// `README.md`, `lifecycle-bench` on the node: a row per contender and lag
/// (and scenario, when the file holds more than one).
pub fn lifecycle_node(files: &[Value]) -> Result<String, Error> {
    let v = &files[0];
    let all = list(v, "rows")?;
    let mut scenarios: Vec<&str> = Vec::new();
    for r in all {
        let s = text(r, "scenario")?;
        if !scenarios.contains(&s) {
            scenarios.push(s);
        }
    }
    let by_scenario = scenarios.len() > 1;
    let mut rows = Vec::new();
    for r in all {
        let failed = num(r, "failed")?;
        let per_run: Vec<f64> = match r.get("runs").and_then(Value::as_array) {
            Some(runs) => runs
                .iter()
                .map(|run| num(run, "failed"))
                .collect::<Result<_, _>>()?,
            None => Vec::new(),
        };
        let lost = if per_run.len() > 1 {
            let min = per_run.iter().copied().fold(f64::INFINITY, f64::min);
            let max = per_run.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            format!(
                "{} ({}–{} in each of {} rollouts)",
                plain(failed),
                plain(min),
                plain(max),
                per_run.len()
            )
        } else {
            plain(failed)
        };
        let causes: Vec<String> = match r.get("failures").and_then(Value::as_object) {
            Some(map) => map
                .iter()
                .map(|(k, n)| format!("{k} {}", n.as_f64().map(plain).unwrap_or_default()))
                .collect(),
            None => Vec::new(),
        };
        let mut row = Vec::new();
        if by_scenario {
            row.push(text(r, "scenario")?.to_string());
        }
        row.extend([
            text(r, "contender")?.to_string(),
            format!("{} s", short(num(r, "lag_seconds")?)),
            plain(num(r, "sent")?),
            lost,
            if causes.is_empty() {
                "–".to_string()
            } else {
                causes.join(", ")
            },
            format!(
                "{} / {} s",
                dec(num(r, "stop_p50_seconds")?, 1),
                dec(num(r, "stop_max_seconds")?, 1)
            ),
        ]);
        rows.push(row);
    }
    let mut header = Vec::new();
    if by_scenario {
        header.push("scenario");
    }
    header.extend([
        "contender",
        "ingress lag",
        "sent",
        "lost",
        "lost by cause",
        "stop p50 / max",
    ]);
    Ok(table(&header, &rows))
}

/// A figure with at most three significant digits, trailing zeros off.
fn figure(x: f64) -> String {
    let s = sig3(x);
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// `README.md`, "At cluster scale": the goals as `scale-bench` judged them.
pub fn scale(files: &[Value]) -> Result<String, Error> {
    let v = &files[0];
    let unit = |u: &str| {
        if u == "1/s" {
            "/s".to_string()
        } else {
            format!(" {u}")
        }
    };
    let rows = list(v, "goals")?
        .iter()
        .map(|g| {
            let target = text(g, "target")?.trim().replace("<=", "≤");
            let u = text(g, "unit")?.trim();
            let value = num(g, "value")?;
            let shown = if target == "true" {
                if value == 1.0 { "yes" } else { "no" }.to_string()
            } else {
                format!("{}{}", figure(value), unit(u))
                    .trim_end()
                    .to_string()
            };
            let target = if u == "1/s" {
                target.replace(" 1/s", "/s")
            } else {
                target
            };
            let pass = g
                .get("pass")
                .and_then(Value::as_bool)
                .ok_or_else(|| Error::Missing {
                    key: "goals[].pass".to_string(),
                })?;
            Ok(vec![
                text(g, "goal")?.to_string(),
                target,
                shown,
                if pass { "yes" } else { "**no**" }.to_string(),
            ])
        })
        .collect::<Result<Vec<_>, Error>>()?;
    Ok(table(
        &["goal (issue 14)", "target", "this run", "met"],
        &rows,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stat(p50: f64, p99: f64) -> Value {
        json!({"n": 20, "p50_ms": p50, "p99_ms": p99, "max_ms": p99})
    }

    #[test]
    fn node_startup_reads_both_shapes_of_node_bench() {
        let row = |variant: &str, p50: f64, tax: f64| {
            json!({"variant": variant, "create_to_ready": stat(p50, p50 + 100.0),
                   "tax_p50_ms": tax, "tax_p99_ms": tax})
        };
        let old = json!({"startup": [row("none", 600.0, 0.0), row("Legacy", 1000.0, 400.0)]});
        let t = node_startup(&[old]).unwrap();
        assert!(t.starts_with("| measurement | n | p50 | p99 |"), "{t}");
        assert!(
            t.contains("| … with a Legacy sidecar (tax) | 20 | 1000 ms (+400) | 1100 ms (+400) |"),
            "{t}"
        );
        let new = json!({"installs": [
            {"install": "off", "startup": [row("none", 600.0, 0.0)]},
            {"install": "on", "jobs": []},
            {"install": "on2", "startup": [row("Native", 1800.0, 1200.0)]}]});
        let t = node_startup(&[new]).unwrap();
        assert!(
            t.starts_with("| install | measurement | n | p50 | p99 |"),
            "{t}"
        );
        assert!(
            t.contains("| off | pod create → Ready, no sidecar | 20 | 600 ms | 700 ms |"),
            "{t}"
        );
        assert!(t.contains("| on2 | … with a Native sidecar (tax) |"), "{t}");
        let istio = json!({"installs": [{"install": "off", "startup": [
            row("none", 600.0, 0.0), row("istio-defaults", 1700.0, 1100.0)]}]});
        let t = node_startup(&[istio]).unwrap();
        assert!(
            t.contains(
                "| off | … with Istio's sidecar, `istio-defaults` (tax) | 20 | 1700 ms (+1100) |"
            ),
            "{t}"
        );
        assert!(node_startup(&[json!({"installs": []})]).is_err());
    }

    #[test]
    fn lifecycle_node_shows_any_contender_and_the_spread_over_rollouts() {
        let v = json!({"rows": [{
            "contender": "istio-native-hold", "scenario": "rolling-update", "lag_seconds": 2.0,
            "cycles": 3, "sent": 9000, "failed": 3, "failures": {"status": 2, "timeout": 1},
            "stop_p50_seconds": 1.04, "stop_max_seconds": 12.96,
            "runs": [{"failed": 0}, {"failed": 1}, {"failed": 2}]
        }, {
            "contender": "remora-legacy-defaults", "scenario": "rolling-update", "lag_seconds": 2.5,
            "cycles": 1, "sent": 4000, "failed": 0, "failures": {},
            "stop_p50_seconds": 6.0, "stop_max_seconds": 16.0, "runs": [{"failed": 0}]
        }]});
        let t = lifecycle_node(&[v]).unwrap();
        assert!(t.contains("| istio-native-hold | 2 s | 9000 | 3 (0–2 in each of 3 rollouts) | status 2, timeout 1 | 1.0 / 13.0 s |"), "{t}");
        assert!(
            t.contains("| remora-legacy-defaults | 2.5 s | 4000 | 0 | – | 6.0 / 16.0 s |"),
            "{t}"
        );
        assert!(!t.contains("scenario"), "one scenario needs no column: {t}");
    }
}
