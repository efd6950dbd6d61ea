//! What Remora costs and how fast it acts on the real node (kubelet,
//! containerd, the images `scripts/images.sh` built, Remora installed by
//! helm with the chart's defaults):
//!
//! - **startup**: pod create → Ready, the test app alone (`remora.dev/inject:
//!   "false"`) and with a Legacy and a Native sidecar, interleaved pod by pod
//!   so the three see the same machine; the tax is the sidecar's p50/p99
//!   minus the bare pod's.
//! - **jobs**: a Job's app container exits → its pod `Succeeded` (and the
//!   Job `Complete`), Legacy (the controller's stop request through the
//!   downward API) and Native (the kubelet stops the sidecar).
//! - **retune**: a `SidecarLifecycle` edit → every running agent's
//!   `/debug/config` reports the new drain duration, with no restart.
//!
//! Times are seen by this client polling the API (every `--poll`), so each
//! includes up to one poll of lag on both ends. Table on stdout, JSON in
//! `--out`. Needs the node and the images:
//!
//! ```sh
//! scripts/cluster.sh up && scripts/images.sh
//! cargo run --release -p e2e --bin node-bench
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use e2e::node::{self, Check, Node, TestNamespace, wait_for};
use e2e::stats::Summary;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
    PostParams,
};
use kube::{Api, Client};
use remora_contract::annotations::{INBOUND, MODE};
use remora_contract::pod::{INBOUND_PORT, PROXY_CONTAINER};
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;

const APP_PORT: u16 = 8080;
const APP: &str = "app";
const DEADLINE: Duration = Duration::from_secs(180);

#[derive(Debug, Parser)]
#[command(about = "Sidecar startup tax, Job completion and live retune on the real node")]
struct Args {
    /// Which measurements: startup, jobs, retune (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "startup,jobs,retune")]
    only: Vec<String>,
    /// Pods per variant for the startup tax.
    #[arg(long, default_value_t = 20)]
    pods: usize,
    /// Jobs per mode.
    #[arg(long, default_value_t = 10)]
    jobs: usize,
    /// SidecarLifecycle edits.
    #[arg(long, default_value_t = 10)]
    edits: usize,
    /// Running pods the retune edits must reach.
    #[arg(long, default_value_t = 2)]
    retune_pods: usize,
    /// How often the API (or the agent) is polled.
    #[arg(long, value_parser = remora_contract::duration::parse, default_value = "20ms")]
    poll: Duration,
    #[arg(long, default_value = "bench/results/node.json")]
    out: PathBuf,
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// A pod of the test app; `variant` None: not injected, else the mode.
fn app_pod(name: &str, variant: Option<&str>, app_args: &[&str], restart: &str) -> Result<Pod> {
    let mut annotations = BTreeMap::new();
    let mut labels = BTreeMap::from([("app".to_owned(), APP.to_owned())]);
    match variant {
        None => {
            labels.insert("remora.dev/inject".into(), "false".into());
        }
        Some(mode) => {
            annotations.insert(MODE.to_owned(), mode.to_owned());
            annotations.insert(INBOUND.to_owned(), format!("{INBOUND_PORT}:{APP_PORT}"));
        }
    }
    let mut args = vec!["--port".to_owned(), APP_PORT.to_string()];
    args.extend(app_args.iter().map(|s| (*s).to_owned()));
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": 5,
            "securityContext": {"runAsNonRoot": true, "runAsUser": 65532},
            "containers": [node::test_app_container(APP, &args)]
        }
    }))?)
}

fn has_sidecar(pod: &Pod) -> bool {
    let spec = pod.spec.as_ref();
    let names = spec
        .map(|s| {
            s.containers
                .iter()
                .chain(s.init_containers.iter().flatten())
        })
        .into_iter()
        .flatten();
    names.map(|c| c.name.as_str()).any(|n| n == PROXY_CONTAINER)
}

/// Polls `pods/<name>` until `done` says so, returning when it first did
/// (relative to `t0`); fails at once when the pod cannot start.
async fn poll_pod<T>(
    pods: &Api<Pod>,
    name: &str,
    poll: Duration,
    what: &str,
    mut done: impl FnMut(&Pod) -> Option<T>,
) -> Result<T> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(pod) = pods.get_opt(name).await? {
            if let Some(v) = done(&pod) {
                return Ok(v);
            }
            if let Some(why) = node::cannot_start(&pod) {
                bail!("{name} cannot start: {why}");
            }
        }
        if Instant::now() > deadline {
            bail!("{name}: no {what} after {DEADLINE:?}");
        }
        tokio::time::sleep(poll).await;
    }
}

async fn delete_and_wait(pods: &Api<Pod>, name: &str) -> Result<()> {
    let _ = pods.delete(name, &DeleteParams::default()).await;
    wait_for(&format!("pod {name} gone"), DEADLINE, || async {
        Ok(match pods.get_opt(name).await? {
            None => Check::Done(()),
            Some(_) => Check::NotYet("still there".into()),
        })
    })
    .await?;
    Ok(())
}

#[derive(Debug, Serialize)]
struct StartupRow {
    variant: String,
    create_to_ready: Summary,
    tax_p50_ms: f64,
    tax_p99_ms: f64,
}

async fn startup(args: &Args, ns: &TestNamespace) -> Result<Vec<StartupRow>> {
    let pods: Api<Pod> = ns.api();
    let variants = [
        ("none", None),
        ("Legacy", Some("Legacy")),
        ("Native", Some("Native")),
    ];
    let mut samples: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for i in 0..args.pods {
        for (label, variant) in variants {
            let name = format!("start-{}-{i}", label.to_ascii_lowercase());
            let pod = app_pod(&name, variant, &["--delay", "1ms"], "Always")?;
            let t0 = Instant::now();
            let created = pods.create(&PostParams::default(), &pod).await?;
            if has_sidecar(&created) != variant.is_some() {
                bail!("{name}: sidecar injected = {}", has_sidecar(&created));
            }
            let ready = poll_pod(&pods, &name, args.poll, "Ready", |p| {
                node::is_ready(p).then(|| t0.elapsed())
            })
            .await?;
            samples.entry(label).or_default().push(ms(ready));
            delete_and_wait(&pods, &name).await?;
        }
        eprintln!("node-bench: startup {}/{}", i + 1, args.pods);
    }
    let bare = Summary::of(samples.get("none").map_or(&[][..], Vec::as_slice));
    Ok(variants
        .iter()
        .map(|(label, _)| {
            let s = Summary::of(samples.get(label).map_or(&[][..], Vec::as_slice));
            StartupRow {
                variant: (*label).to_owned(),
                create_to_ready: s,
                tax_p50_ms: s.p50_ms - bare.p50_ms,
                tax_p99_ms: s.p99_ms - bare.p99_ms,
            }
        })
        .collect())
}

#[derive(Debug, Serialize)]
struct JobRow {
    mode: String,
    app_exit_to_succeeded: Summary,
    app_exit_to_complete: Summary,
}

fn app_exited(pod: &Pod) -> bool {
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref());
    statuses.into_iter().flatten().any(|c| {
        c.name == APP
            && c.state
                .as_ref()
                .and_then(|s| s.terminated.as_ref())
                .is_some()
    })
}

async fn jobs(args: &Args, ns: &TestNamespace) -> Result<Vec<JobRow>> {
    let jobs: Api<Job> = ns.api();
    let pods: Api<Pod> = ns.api();
    let modes = ["Legacy", "Native"];
    let mut succeeded: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut complete: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for i in 0..args.jobs {
        for mode in modes {
            let name = format!("job-{}-{i}", mode.to_ascii_lowercase());
            let template = app_pod(&name, Some(mode), &["--exit-after", "1s"], "Never")?;
            let job: Job = serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": {
                    "backoffLimit": 0,
                    "template": {"metadata": template.metadata, "spec": template.spec}
                }
            }))?;
            jobs.create(&PostParams::default(), &job).await?;
            let selector = format!("job-name={name}");
            let pod_name = wait_for(&format!("the pod of Job {name}"), DEADLINE, || async {
                let list = pods.list(&ListParams::default().labels(&selector)).await?;
                Ok(
                    match list.items.first().and_then(|p| p.metadata.name.clone()) {
                        Some(n) => Check::Done(n),
                        None => Check::NotYet("no pod yet".into()),
                    },
                )
            })
            .await?;
            poll_pod(&pods, &pod_name, args.poll, "app exit", |p| {
                app_exited(p).then_some(())
            })
            .await?;
            let exited = Instant::now();
            // Both ends polled side by side: the pod's phase and the Job's
            // condition, whichever comes first.
            let (mut pod_done, mut job_done) = (None, None);
            let deadline = exited + DEADLINE;
            while pod_done.is_none() || job_done.is_none() {
                if pod_done.is_none() {
                    let p = pods.get(&pod_name).await?;
                    match p.status.as_ref().and_then(|s| s.phase.as_deref()) {
                        Some("Succeeded") => pod_done = Some(exited.elapsed()),
                        Some("Failed") => bail!("pod {pod_name} Failed"),
                        _ => {}
                    }
                }
                if job_done.is_none() {
                    let j = jobs.get(&name).await?;
                    let conds = j.status.and_then(|s| s.conditions).unwrap_or_default();
                    if conds
                        .iter()
                        .any(|c| c.type_ == "Complete" && c.status == "True")
                    {
                        job_done = Some(exited.elapsed());
                    }
                    if conds
                        .iter()
                        .any(|c| c.type_ == "Failed" && c.status == "True")
                    {
                        bail!("Job {name} Failed");
                    }
                }
                if Instant::now() > deadline {
                    bail!("Job {name}: not Complete {DEADLINE:?} after its app exited");
                }
                tokio::time::sleep(args.poll).await;
            }
            succeeded.entry(mode).or_default().extend(pod_done.map(ms));
            complete.entry(mode).or_default().extend(job_done.map(ms));
            jobs.delete(&name, &DeleteParams::background().grace_period(0))
                .await?;
        }
        eprintln!("node-bench: jobs {}/{}", i + 1, args.jobs);
    }
    Ok(modes
        .iter()
        .map(|mode| JobRow {
            mode: (*mode).to_owned(),
            app_exit_to_succeeded: Summary::of(succeeded.get(mode).map_or(&[][..], Vec::as_slice)),
            app_exit_to_complete: Summary::of(complete.get(mode).map_or(&[][..], Vec::as_slice)),
        })
        .collect())
}

#[derive(Debug, Serialize)]
struct RetuneRow {
    pods: usize,
    edits: usize,
    /// One sample per (edit, pod): the edit → that agent reporting it.
    edit_to_agent: Summary,
    /// One sample per edit: the edit → the last agent reporting it.
    edit_to_all: Summary,
    restarts: i32,
}

fn slc_api(client: &Client, ns: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("remora.dev", "v1alpha1", "SidecarLifecycle");
    let ar = ApiResource::from_gvk_with_plural(&gvk, "sidecarlifecycles");
    Api::namespaced_with(client.clone(), ns, &ar)
}

async fn agent_drain_secs(client: &Client, ns: &str, pod: &str) -> Result<Option<f64>> {
    let (status, body) = node::pod_http_get(
        client,
        ns,
        pod,
        remora_contract::pod::AGENT_ADMIN_PORT,
        "/debug/config",
    )
    .await?;
    if !status.is_success() {
        return Ok(None);
    }
    let v: serde_json::Value = serde_json::from_str(&body).context("/debug/config")?;
    Ok(v["effective_drain_settings"]["drain_duration"].as_f64())
}

fn restarts(pods: &[Pod]) -> i32 {
    pods.iter()
        .flat_map(|p| {
            p.status
                .iter()
                .flat_map(|s| s.container_statuses.iter().flatten())
        })
        .map(|c| c.restart_count)
        .sum()
}

async fn retune(args: &Args, client: &Client, ns: &TestNamespace) -> Result<RetuneRow> {
    let slcs = slc_api(client, ns.name());
    let pods: Api<Pod> = ns.api();
    // Namespace-wide (no selector), so it is the one that applies.
    let slc: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "remora.dev/v1alpha1",
        "kind": "SidecarLifecycle",
        "metadata": {"name": "bench"},
        "spec": {"shutdown": {"drainDuration": "40s"}}
    }))?;
    slcs.create(&PostParams::default(), &slc).await?;
    let mut names = Vec::new();
    for i in 0..args.retune_pods {
        let name = format!("retune-{i}");
        pods.create(
            &PostParams::default(),
            &app_pod(&name, Some("Legacy"), &["--delay", "1ms"], "Always")?,
        )
        .await?;
        names.push(name);
    }
    for name in &names {
        poll_pod(&pods, name, args.poll, "Ready", |p| {
            node::is_ready(p).then_some(())
        })
        .await?;
        wait_for(
            &format!("{name} reports drainDuration 40s"),
            DEADLINE,
            || async {
                let got = agent_drain_secs(client, ns.name(), name)
                    .await
                    .map_err(|e| node::Error::Failed {
                        what: format!("/debug/config of {name}"),
                        detail: format!("{e:#}"),
                    })?;
                Ok(if got == Some(40.0) {
                    Check::Done(())
                } else {
                    Check::NotYet(format!("drain_duration {got:?}"))
                })
            },
        )
        .await?;
    }
    let before = pods.list(&ListParams::default()).await?.items;
    let (mut per_agent, mut per_edit) = (Vec::new(), Vec::new());
    for e in 0..args.edits {
        let want = 41 + e as u64;
        let t0 = Instant::now();
        slcs.patch(
            "bench",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"shutdown": {"drainDuration": format!("{want}s")}}})),
        )
        .await?;
        let mut pending: Vec<&String> = names.iter().collect();
        let deadline = t0 + DEADLINE;
        while !pending.is_empty() {
            let mut still = Vec::new();
            for name in pending {
                if agent_drain_secs(client, ns.name(), name).await? == Some(want as f64) {
                    per_agent.push(ms(t0.elapsed()));
                } else {
                    still.push(name);
                }
            }
            pending = still;
            if Instant::now() > deadline {
                bail!("edit to {want}s: {pending:?} still report the old value");
            }
            if !pending.is_empty() {
                tokio::time::sleep(args.poll).await;
            }
        }
        per_edit.push(ms(t0.elapsed()));
        eprintln!("node-bench: retune {}/{}", e + 1, args.edits);
    }
    let after = pods.list(&ListParams::default()).await?.items;
    let uid = |p: &Pod| p.metadata.uid.clone();
    if before.iter().map(uid).collect::<Vec<_>>() != after.iter().map(uid).collect::<Vec<_>>() {
        bail!("the retune replaced pods");
    }
    Ok(RetuneRow {
        pods: names.len(),
        edits: args.edits,
        edit_to_agent: Summary::of(&per_agent),
        edit_to_all: Summary::of(&per_edit),
        restarts: restarts(&after) - restarts(&before),
    })
}

fn line(name: &str, s: &Summary) -> String {
    format!(
        "{name:<44} {:>3} {:>10.1} {:>10.1} {:>10.1}",
        s.n, s.p50_ms, s.p99_ms, s.max_ms
    )
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    for o in &args.only {
        if !matches!(o.as_str(), "startup" | "jobs" | "retune") {
            bail!("--only: unknown measurement {o:?} (startup, jobs, retune)");
        }
    }
    let want = |m: &str| args.only.iter().any(|o| o == m);
    let node = Node::shared().await?;
    let client = node.client()?;
    let t = Instant::now();
    node.remora(&client).await?;
    eprintln!(
        "node-bench: Remora installed ({:.1} s)",
        t.elapsed().as_secs_f64()
    );
    let guard_before = node.guard_drops().await?;
    let mut out = serde_json::Map::new();
    out.insert(
        "command".into(),
        json!(std::env::args().collect::<Vec<_>>().join(" ")),
    );
    out.insert(
        "method".into(),
        json!(format!(
            "one node (kubelet, containerd, runc, CNI bridge) on this machine; Remora by helm with \
             chart defaults; times seen by polling the API every {:?} (each end up to one poll \
             late); pods and Jobs one at a time, variants interleaved",
            args.poll
        )),
    );
    let mut table = vec![format!(
        "{:<44} {:>3} {:>10} {:>10} {:>10}",
        "measurement", "n", "p50 ms", "p99 ms", "max ms"
    )];
    if want("startup") {
        let ns = TestNamespace::injected(node, &client, "bench-startup").await?;
        let rows = startup(&args, &ns).await;
        ns.delete().await?;
        let rows = rows?;
        for r in &rows {
            table.push(line(
                &format!("create → Ready, sidecar {}", r.variant),
                &r.create_to_ready,
            ));
            if r.variant != "none" {
                table.push(format!(
                    "{:<44}     {:>10.1} {:>10.1}",
                    format!("  tax ({} minus none)", r.variant),
                    r.tax_p50_ms,
                    r.tax_p99_ms
                ));
            }
        }
        out.insert("startup".into(), serde_json::to_value(&rows)?);
    }
    if want("jobs") {
        let ns = TestNamespace::injected(node, &client, "bench-jobs").await?;
        let rows = jobs(&args, &ns).await;
        ns.delete().await?;
        let rows = rows?;
        for r in &rows {
            table.push(line(
                &format!("Job {}: app exit → pod Succeeded", r.mode),
                &r.app_exit_to_succeeded,
            ));
            table.push(line(
                &format!("Job {}: app exit → Job Complete", r.mode),
                &r.app_exit_to_complete,
            ));
        }
        out.insert("jobs".into(), serde_json::to_value(&rows)?);
    }
    if want("retune") {
        let ns = TestNamespace::injected(node, &client, "bench-retune").await?;
        let row = retune(&args, &client, &ns).await;
        ns.delete().await?;
        let row = row?;
        table.push(line(
            "SLC edit → an agent's /debug/config",
            &row.edit_to_agent,
        ));
        table.push(line(
            &format!("SLC edit → all {} agents", row.pods),
            &row.edit_to_all,
        ));
        table.push(format!(
            "container restarts during the edits: {}",
            row.restarts
        ));
        out.insert("retune".into(), serde_json::to_value(&row)?);
    }
    let guard = node.guard_drops().await? - guard_before;
    out.insert("egress_guard_dropped".into(), json!(guard));
    println!("{}", table.join("\n"));
    println!("egress guard dropped: {guard}");
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&out)? + "\n")
        .with_context(|| format!("writing {}", args.out.display()))?;
    println!("wrote {}", args.out.display());
    if guard > 0 {
        bail!("the egress guard dropped {guard} packets");
    }
    Ok(())
}
