//! What Remora costs and how fast it acts on the real node (kubelet,
//! containerd, the images `scripts/images.sh` built, Remora installed by
//! helm), in each of two installs, one after the other in one run, with the
//! values that matter set explicitly (not the chart's defaults):
//! `off` (workload CA and discovery off: the controller's stop request and
//! SidecarLifecycle settings reach the agent through the downward-API file)
//! and `on` (workload CA and discovery on: they arrive on the xDS stream as
//! the `remora.v1.PodAnnotations` type, the file the fallback).
//!
//! - **startup**: pod create → Ready, the test app alone (`remora.dev/inject:
//!   "false"`), with a Legacy and a Native sidecar, and (`--istio`, the
//!   default) with Istio's real pilot-agent as its template injects it
//!   (`e2e::node::istio`: `istio-defaults`, a native sidecar gated by its
//!   startupProbe, and `istio-legacy-hold`, a regular container held by
//!   `holdApplicationUntilProxyStarts`), interleaved pod by pod so all see
//!   the same machine; the tax is the sidecar's p50/p99 minus the bare pod's.
//! - **jobs**: a Job's app container exits → its pod `Succeeded` (and the
//!   Job `Complete`), Legacy (the controller's stop request), Native (the
//!   kubelet stops the sidecar) and `istio-defaults` (Istio's native
//!   sidecar, stopped by the kubelet the same way). Istio's regular-container
//!   sidecar is left out: its Job never completes unless the app calls
//!   `/quitquitquit` (Istio's documented workaround), which is the app's
//!   work, not the sidecar's.
//! - **retune**: a `SidecarLifecycle` edit → every running agent's
//!   `/debug/config` reports the new drain duration, with no restart.
//! - **convergence** (`on` only; its own results file): a server pod of a
//!   Service deleted → every subscribed client Envoy no longer holds its
//!   endpoint, with 1, 10 and 50 clients (`e2e::eds_convergence`).
//! - **withdrawal** (`on` only; its own results file, not in the default
//!   set): confirmed removal (issue 30) under rollouts of a 10-replica
//!   callee, quiet period 0, called by mesh clients through one client
//!   pod's sidecar: per rolling update and per 5-at-once deletion, calls
//!   lost, each old pod's deletion → its agent learned every subscriber
//!   confirmed, and deletion → pod stopped (`e2e::withdrawal_rollout`).
//!
//! Times are seen by this client polling the API (every `--poll`), so each
//! includes up to one poll of lag on both ends. Table on stdout, JSON in
//! `--out` (and `--convergence-out`). Needs the node and the images:
//!
//! ```sh
//! scripts/cluster.sh up && scripts/images.sh
//! cargo run --release -p e2e --bin node-bench
//! ```
//!
//! It leaves the shared release installed with the last install's values.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use e2e::eds_convergence::{self as conv, RemoraMesh, SizeResult, Watchers};
use e2e::node::istio;
use e2e::node::port_forward::PortForward;
use e2e::node::{self, Check, Node, TestNamespace};
use e2e::stats::Summary;
use e2e::traffic::Traffic;
use e2e::withdrawal_rollout as wr;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, PodTemplateSpec};
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
    PostParams,
};
use kube::{Api, Client};
use remora_contract::annotations::{INBOUND, MODE};
use remora_contract::pod::{INBOUND_PORT, PROXY_CONTAINER};
use remora_test_support::wait::wait_until;
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;

const APP_PORT: u16 = 8080;
const APP: &str = "app";
const DEADLINE: Duration = Duration::from_secs(180);
/// Operator replicas in both installs.
const OPERATORS: usize = 2;

#[derive(Debug, Parser)]
#[command(
    about = "Sidecar startup tax, Job completion, live retune and EDS convergence on the real node"
)]
struct Args {
    /// Which measurements: startup, jobs, retune, convergence (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "startup,jobs,retune,convergence"
    )]
    only: Vec<String>,
    /// Installs to measure in, in this order: off (no workload CA, no
    /// discovery), on (both).
    #[arg(long, value_delimiter = ',', default_value = "off,on")]
    installs: Vec<Install>,
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
    /// Istio's sidecar (pilot-agent, image from `scripts/images.sh
    /// istio-proxy`) beside Remora's in the startup and Job rows.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    istio: bool,
    #[arg(long, default_value = "bench/results/node.json")]
    out: PathBuf,
    /// Subscribed client sidecars for the convergence, in order.
    #[arg(long, value_delimiter = ',', default_value = "1,10,50")]
    clients: Vec<usize>,
    /// Server pods behind the clients' Service.
    #[arg(long, default_value_t = 3)]
    servers: usize,
    /// Server pods deleted per client count.
    #[arg(long, default_value_t = 10)]
    deletions: usize,
    /// The sidecars' mode in the convergence.
    #[arg(long, default_value = "Legacy")]
    convergence_mode: String,
    /// How often each client Envoy's admin is polled.
    #[arg(long, value_parser = remora_contract::duration::parse, default_value = "50ms")]
    convergence_poll: Duration,
    #[arg(long, default_value = "bench/results/eds-convergence.json")]
    convergence_out: PathBuf,
    /// Rounds of the withdrawal section, each a rolling update and a
    /// deletion of `--withdrawal-at-once` pods at once.
    #[arg(long, default_value_t = 3)]
    rollouts: usize,
    /// The callee's replicas in the withdrawal section.
    #[arg(long, default_value_t = 10)]
    withdrawal_replicas: usize,
    /// Pods deleted in one go in the withdrawal section.
    #[arg(long, default_value_t = 5)]
    withdrawal_at_once: usize,
    /// Each mesh client's calls per second in the withdrawal section.
    #[arg(long, default_value_t = 20.0)]
    withdrawal_rate: f64,
    #[arg(long, default_value = "bench/results/withdrawal-node.json")]
    withdrawal_out: PathBuf,
}

/// The two installs compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Install {
    /// Workload CA and discovery off: lifecycle signals by the downward-API file.
    Off,
    /// Workload CA and discovery on: lifecycle signals on the xDS stream.
    On,
}

impl Install {
    /// Every value this comparison depends on, set whatever the chart's
    /// defaults are.
    fn values(self) -> Vec<String> {
        let on = self == Install::On;
        vec![
            format!("workloadCA.enabled={on}"),
            format!("discovery.enabled={on}"),
            format!("operator.replicas={OPERATORS}"),
        ]
    }

    fn label(self) -> &'static str {
        match self {
            Install::Off => "off",
            Install::On => "on",
        }
    }
}

/// A namespace for pods injected under `install`: with the workload CA,
/// pods wait on the trust bundle's volume, so it is there first.
async fn bench_ns(
    node: &Node,
    client: &Client,
    install: Install,
    prefix: &str,
) -> Result<TestNamespace> {
    let ns = TestNamespace::injected(node, client, prefix).await?;
    node::wait_injected(client, ns.name(), DEADLINE).await?;
    if install == Install::On {
        node::workload_ca::wait_trust_bundle(client, ns.name(), DEADLINE).await?;
    }
    Ok(ns)
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

/// The sidecar containers `pod` has: Remora's, Istio's.
fn sidecars(pod: &Pod) -> Vec<&str> {
    let spec = pod.spec.as_ref();
    let names = spec
        .map(|s| {
            s.containers
                .iter()
                .chain(s.init_containers.iter().flatten())
        })
        .into_iter()
        .flatten();
    names
        .map(|c| c.name.as_str())
        .filter(|n| [PROXY_CONTAINER, istio::PROXY_CONTAINER].contains(n))
        .collect()
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

/// Deletes with a grace period of 1 s, the same for every variant: what a
/// sidecar does at stop is not measured here, and Istio's would hold each
/// pod its 5 s termination drain.
async fn delete_and_wait(pods: &Api<Pod>, name: &str) -> Result<()> {
    let _ = pods
        .delete(name, &DeleteParams::default().grace_period(1))
        .await;
    wait_until(DEADLINE, &format!("pod {name} gone"), || async {
        Ok::<_, anyhow::Error>(match pods.get_opt(name).await? {
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

/// Who injects the sidecar of a measured pod.
#[derive(Debug, Clone, Copy)]
enum Variant {
    /// No sidecar (`remora.dev/inject: "false"`).
    Bare,
    /// Remora's, in this mode.
    Remora(&'static str),
    /// Istio's, as its template shapes it for this profile.
    Istio(istio::Profile),
}

impl Variant {
    fn label(self) -> &'static str {
        match self {
            Variant::Bare => "none",
            Variant::Remora(mode) => mode,
            Variant::Istio(p) => p.name(),
        }
    }

    /// The sidecar container the created pod must have.
    fn container(self) -> Option<&'static str> {
        match self {
            Variant::Bare => None,
            Variant::Remora(_) => Some(PROXY_CONTAINER),
            Variant::Istio(_) => Some(istio::PROXY_CONTAINER),
        }
    }

    /// The variants of a section: Remora's modes, then Istio's `profiles`
    /// when `--istio`.
    fn with_istio(args: &Args, mut v: Vec<Variant>, profiles: &[istio::Profile]) -> Vec<Variant> {
        if args.istio {
            v.extend(profiles.iter().copied().map(Variant::Istio));
        }
        v
    }

    /// The test app's pod under this variant. An Istio pod is the bare
    /// pod (Remora's webhook leaves it alone) through Istio's template.
    fn pod(self, name: &str, app_args: &[&str], restart: &str) -> Result<Pod> {
        match self {
            Variant::Bare => app_pod(name, None, app_args, restart),
            Variant::Remora(mode) => app_pod(name, Some(mode), app_args, restart),
            Variant::Istio(profile) => {
                let bare = app_pod(name, None, app_args, restart)?;
                let template = PodTemplateSpec {
                    metadata: Some(bare.metadata),
                    spec: bare.spec,
                };
                let injected = istio::inject(&template, &istio_sidecar(profile))?;
                Ok(Pod {
                    metadata: injected.template.metadata.unwrap_or_default(),
                    spec: injected.template.spec,
                    ..Pod::default()
                })
            }
        }
    }
}

fn istio_sidecar(profile: istio::Profile) -> istio::Sidecar {
    istio::Sidecar::new(profile.name(), profile, APP_PORT)
}

/// The ConfigMap and Secret every Istio pod of these variants mounts, once
/// per namespace (shared by its pods: they hold no per-pod state).
async fn istio_objects(client: &Client, ns: &TestNamespace, variants: &[Variant]) -> Result<()> {
    for v in variants {
        if let Variant::Istio(profile) = v {
            let bare = app_pod("objects", None, &[], "Never")?;
            let template = PodTemplateSpec {
                metadata: Some(bare.metadata),
                spec: bare.spec,
            };
            istio::inject(&template, &istio_sidecar(*profile))?
                .create_objects(client, ns.name())
                .await?;
        }
    }
    Ok(())
}

/// Creates `pod` and checks it got the sidecar `variant` says.
async fn create_checked(pods: &Api<Pod>, variant: Variant, pod: &Pod) -> Result<()> {
    let created = pods.create(&PostParams::default(), pod).await?;
    let got = sidecars(&created);
    if got != variant.container().into_iter().collect::<Vec<_>>() {
        bail!(
            "{}: {} wants {:?}, got sidecars {got:?}",
            created.metadata.name.as_deref().unwrap_or_default(),
            variant.label(),
            variant.container()
        );
    }
    Ok(())
}

async fn startup(args: &Args, client: &Client, ns: &TestNamespace) -> Result<Vec<StartupRow>> {
    let pods: Api<Pod> = ns.api();
    let variants = Variant::with_istio(
        args,
        vec![
            Variant::Bare,
            Variant::Remora("Legacy"),
            Variant::Remora("Native"),
        ],
        &[istio::Profile::Defaults, istio::Profile::LegacyHold],
    );
    istio_objects(client, ns, &variants).await?;
    let mut samples: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for i in 0..args.pods {
        for &variant in &variants {
            let label = variant.label();
            let name = format!("start-{}-{i}", label.to_ascii_lowercase());
            let pod = variant.pod(&name, &["--delay", "1ms"], "Always")?;
            let t0 = Instant::now();
            create_checked(&pods, variant, &pod).await?;
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
        .map(|v| {
            let s = Summary::of(samples.get(v.label()).map_or(&[][..], Vec::as_slice));
            StartupRow {
                variant: v.label().to_owned(),
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

async fn jobs(args: &Args, client: &Client, ns: &TestNamespace) -> Result<Vec<JobRow>> {
    let jobs: Api<Job> = ns.api();
    let pods: Api<Pod> = ns.api();
    let variants = Variant::with_istio(
        args,
        vec![Variant::Remora("Legacy"), Variant::Remora("Native")],
        &[istio::Profile::Defaults],
    );
    istio_objects(client, ns, &variants).await?;
    let mut succeeded: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut complete: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for i in 0..args.jobs {
        for &variant in &variants {
            let mode = variant.label();
            let name = format!("job-{}-{i}", mode.to_ascii_lowercase());
            let template = variant.pod(&name, &["--exit-after", "1s"], "Never")?;
            let job: Job = serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": {
                    "backoffLimit": 0,
                    "template": {"metadata": template.metadata, "spec": template.spec}
                }
            }))?;
            jobs.create(&PostParams::default(), &job).await?;
            let selector = format!("job-name={name}");
            let pod_name = wait_until(DEADLINE, &format!("the pod of Job {name}"), || async {
                let list = pods.list(&ListParams::default().labels(&selector)).await?;
                Ok::<_, anyhow::Error>(
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
    Ok(variants
        .iter()
        .map(|v| v.label())
        .map(|mode| JobRow {
            mode: mode.to_owned(),
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
        wait_until(
            DEADLINE,
            &format!("{name} reports drainDuration 40s"),
            || async {
                let got = agent_drain_secs(client, ns.name(), name)
                    .await
                    .map_err(|e| node::Error::Failed {
                        what: format!("/debug/config of {name}"),
                        detail: format!("{e:#}"),
                    })?;
                Ok::<_, anyhow::Error>(if got == Some(40.0) {
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
        "{name:<52} {:>3} {:>10.1} {:>10.1} {:>10.1}",
        s.n, s.p50_ms, s.p99_ms, s.max_ms
    )
}

fn header() -> String {
    format!(
        "{:<52} {:>3} {:>10} {:>10} {:>10}",
        "measurement", "n", "p50 ms", "p99 ms", "max ms"
    )
}

fn write(path: &PathBuf, mut out: serde_json::Map<String, serde_json::Value>) -> Result<()> {
    out.insert(
        "machine_after".into(),
        remora_test_support::results::machine(),
    );
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, serde_json::to_string_pretty(&out)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

/// Startup, Jobs and retune in the install in force; rows to `table`.
async fn lifecycle(
    args: &Args,
    node: &Node,
    client: &Client,
    install: Install,
    table: &mut Vec<String>,
) -> Result<serde_json::Value> {
    let want = |m: &str| args.only.iter().any(|o| o == m);
    let tag = install.label();
    let mut out = serde_json::Map::new();
    out.insert("install".into(), json!(tag));
    out.insert("values".into(), json!(install.values()));
    if want("startup") {
        let ns = bench_ns(node, client, install, &format!("bench-startup-{tag}")).await?;
        let rows = startup(args, client, &ns).await;
        ns.delete().await?;
        let rows = rows?;
        for r in &rows {
            table.push(line(
                &format!("[{tag}] create → Ready, sidecar {}", r.variant),
                &r.create_to_ready,
            ));
            if r.variant != "none" {
                table.push(format!(
                    "{:<52}     {:>10.1} {:>10.1}",
                    format!("  tax ({} minus none)", r.variant),
                    r.tax_p50_ms,
                    r.tax_p99_ms
                ));
            }
        }
        out.insert("startup".into(), serde_json::to_value(&rows)?);
    }
    if want("jobs") {
        let ns = bench_ns(node, client, install, &format!("bench-jobs-{tag}")).await?;
        let rows = jobs(args, client, &ns).await;
        ns.delete().await?;
        let rows = rows?;
        for r in &rows {
            table.push(line(
                &format!("[{tag}] Job {}: app exit → pod Succeeded", r.mode),
                &r.app_exit_to_succeeded,
            ));
            table.push(line(
                &format!("[{tag}] Job {}: app exit → Job Complete", r.mode),
                &r.app_exit_to_complete,
            ));
        }
        out.insert("jobs".into(), serde_json::to_value(&rows)?);
    }
    if want("retune") {
        let ns = bench_ns(node, client, install, &format!("bench-retune-{tag}")).await?;
        let row = retune(args, client, &ns).await;
        ns.delete().await?;
        let row = row?;
        table.push(line(
            &format!("[{tag}] SLC edit → an agent's /debug/config"),
            &row.edit_to_agent,
        ));
        table.push(line(
            &format!("[{tag}] SLC edit → all {} agents", row.pods),
            &row.edit_to_all,
        ));
        table.push(format!(
            "[{tag}] container restarts during the edits: {}",
            row.restarts
        ));
        out.insert("retune".into(), serde_json::to_value(&row)?);
    }
    Ok(serde_json::Value::Object(out))
}

/// EDS convergence with each client count in turn, on one mesh scaled up.
async fn convergence(args: &Args, node: &Node, client: &Client) -> Result<Vec<SizeResult>> {
    let mesh = RemoraMesh::start(
        node,
        client,
        args.servers,
        &args.convergence_mode,
        &[],
        DEADLINE,
    )
    .await?;
    let mut rows = Vec::new();
    let res: Result<()> = async {
        for &n in &args.clients {
            // Scaling 50 pods on 2 cores takes minutes: a deadline of its own.
            let scale_deadline = DEADLINE + Duration::from_secs(6 * n as u64);
            let (took, watched) = mesh.scale_clients(client, n, scale_deadline).await?;
            eprintln!(
                "node-bench: convergence: {n} clients Ready in {:.1} s",
                took.as_secs_f64()
            );
            let mut watchers = Watchers::connect(client, watched).await?;
            let seen = conv::measure_deletions(
                client,
                &mut watchers,
                &mesh,
                args.deletions,
                args.convergence_poll,
                DEADLINE,
            )
            .await?;
            let row = SizeResult::of(watchers.len(), &seen, watchers.reopened(), took);
            eprintln!(
                "node-bench: convergence: {n} clients: every client p50 {:.1} ms, max {:.1} ms",
                row.to_every_client.p50_ms, row.to_every_client.max_ms
            );
            rows.push(row);
        }
        Ok(())
    }
    .await;
    mesh.ns.delete().await?;
    res?;
    Ok(rows)
}

/// One disruption of the withdrawal section.
#[derive(Debug, Serialize)]
struct WithdrawalRow {
    round: usize,
    disruption: String,
    /// Calls that failed, of those sent from the disruption's start until
    /// the callee rolled out again and every old pod was gone.
    lost: usize,
    sent: usize,
    /// Per old pod: deletion → the last subscriber confirmed.
    deletion_to_last_confirmation: Summary,
    /// The discovery server's withdrawal → last confirmation.
    server_confirmation: Summary,
    /// Deletion → every container terminated (or the pod gone).
    deletion_to_stop: Summary,
    /// Deletion → the agent let the app stop.
    deletion_to_released: Summary,
    /// Old pods whose withdrawal was not `confirmed`, with the outcome.
    not_confirmed: Vec<String>,
    /// Old pods `confirmed` with no proxy waited for: the discovery
    /// server replica their agent asked knew no subscriber of theirs (a
    /// replica tracks only the streams it serves).
    confirmed_by_nobody: Vec<String>,
    rollout: wr::RolloutResult,
}

/// Confirmed removal under `--rollouts` rounds of a rolling update and a
/// deletion of several pods at once, the mesh clients running throughout.
async fn withdrawal(args: &Args, node: &Node, client: &Client) -> Result<Vec<WithdrawalRow>> {
    let mesh = RemoraMesh::start(
        node,
        client,
        args.withdrawal_replicas,
        "Native",
        &[],
        node::ROLLOUT_TIMEOUT,
    )
    .await?;
    let res: Result<Vec<WithdrawalRow>> = async {
        let (_, watched) = mesh.scale_clients(client, 1, DEADLINE).await?;
        let caller = &watched.first().context("no client pod")?.pod;
        let forward =
            PortForward::start(client, mesh.ns.name(), caller, conv::OUTBOUND_PORT).await?;
        let loads = wr::mesh_clients(forward.local_addr(), args.withdrawal_rate);
        let epoch = Instant::now();
        let traffic = Traffic::start(loads, epoch);
        let mut rows = Vec::new();
        let run: Result<()> = async {
            for round in 0..args.rollouts {
                for how in [
                    wr::Disruption::Rolling,
                    wr::Disruption::DeleteAtOnce(args.withdrawal_at_once),
                ] {
                    let from = epoch.elapsed();
                    let r = wr::disrupt(client, &mesh, how, node::ROLLOUT_TIMEOUT).await?;
                    let to = epoch.elapsed();
                    let during: Vec<_> = traffic
                        .samples()
                        .into_iter()
                        .filter(|s| s.at >= from && s.at <= to)
                        .collect();
                    let s = r.summary();
                    let row = WithdrawalRow {
                        round,
                        disruption: how.label(),
                        lost: during.iter().filter(|s| !s.outcome.is_ok()).count(),
                        sent: during.len(),
                        deletion_to_last_confirmation: s["deletion_to_confirmation"],
                        server_confirmation: s["server_confirmation"],
                        deletion_to_stop: s["deletion_to_stopped"],
                        deletion_to_released: s["deletion_to_released"],
                        not_confirmed: r
                            .pods
                            .iter()
                            .filter(|p| p.outcome() != Some("confirmed"))
                            .map(|p| format!("{}: {:?}", p.pod, p.outcome()))
                            .collect(),
                        confirmed_by_nobody: r
                            .pods
                            .iter()
                            .filter(|p| p.outcome() == Some("confirmed"))
                            .filter(|p| {
                                p.withdrawal.as_ref().and_then(|w| w["expected"].as_u64())
                                    == Some(0)
                            })
                            .map(|p| p.pod.clone())
                            .collect(),
                        rollout: r,
                    };
                    eprintln!(
                        "node-bench: withdrawal round {round} {}: lost {}/{}, confirmed p50 {:.0} ms, stop p50 {:.0} ms max {:.0} ms\n{}",
                        row.disruption,
                        row.lost,
                        row.sent,
                        row.deletion_to_last_confirmation.p50_ms,
                        row.deletion_to_stop.p50_ms,
                        row.deletion_to_stop.max_ms,
                        row.rollout.table()
                    );
                    rows.push(row);
                }
            }
            Ok(())
        }
        .await;
        traffic.stop().await;
        drop(forward);
        run?;
        Ok(rows)
    }
    .await;
    mesh.ns.delete().await?;
    res
}

fn write_withdrawal(
    args: &Args,
    rows: Vec<WithdrawalRow>,
    machine_before: &serde_json::Value,
    guard: u64,
) -> Result<()> {
    println!();
    println!(
        "Confirmed removal: {} replicas, quiet period 0, mesh clients through one client pod's sidecar",
        args.withdrawal_replicas
    );
    println!(
        "{:>5} {:<12} {:>9} {:>30} {:>30}",
        "round",
        "disruption",
        "lost",
        "deletion → confirmed p50/p99/max",
        "deletion → stop p50/p99/max"
    );
    for r in &rows {
        let c = &r.deletion_to_last_confirmation;
        let st = &r.deletion_to_stop;
        println!(
            "{:>5} {:<12} {:>9} {:>30} {:>30}",
            r.round,
            r.disruption,
            format!("{}/{}", r.lost, r.sent),
            format!("{:.0}/{:.0}/{:.0} ms", c.p50_ms, c.p99_ms, c.max_ms),
            format!("{:.0}/{:.0}/{:.0} ms", st.p50_ms, st.p99_ms, st.max_ms),
        );
    }
    let mut out = remora_test_support::results::stamp(machine_before);
    e2e::node::stamp_images(&mut out);
    out.insert(
        "measured".into(),
        json!(
            "per rollout of the callee (a rolling update, maxSurge 25% maxUnavailable 0; or pods \
             deleted in one go), per old pod: its deletion (the delete request, or the pod watch \
             first showing the ReplicaSet's deletion) → the last proxy that routed to it confirmed \
             (deletion_to_last_confirmation: this host's pod watch seeing the deletion, as the \
             discovery server's watch does, plus the server's own withdrawal → last confirmation, \
             which is server_confirmation), → the agent let the app stop, \
             → the pod watch first showed every container terminated (deletion_to_stop: includes \
             the kubelet's relist, up to 1 s). lost: calls of the mesh clients that failed from \
             the rollout's start until it was done and every old pod gone. Host clock throughout"
        ),
    );
    out.insert(
        "setup".into(),
        json!({
            "install": Install::On.values(),
            "callee": format!("{} replicas of the test app, Native sidecars, remora.dev/quiet-period 0s, withdrawal timeout default (5 s), terminationGracePeriodSeconds 5; namespace-wide SidecarLifecycle: Envoy concurrency 1, requests cpu 5m memory 48Mi", args.withdrawal_replicas),
            "clients": format!("one client pod (remora.dev/outbound names the Service); on the host through a port-forward to its outbound listener: HTTP/1.1 keep-alive, h2c (1 connection), gRPC unary at {} calls/s each, gRPC server-streaming (500 ms streams) at a quarter of that; none retries", args.withdrawal_rate),
            "rounds": args.rollouts,
            "at_once": args.withdrawal_at_once,
        }),
    );
    out.insert("rollouts".into(), serde_json::to_value(&rows)?);
    out.insert("egress_guard_dropped".into(), json!(guard));
    write(&args.withdrawal_out, out)
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    for o in &args.only {
        if !matches!(
            o.as_str(),
            "startup" | "jobs" | "retune" | "convergence" | "withdrawal"
        ) {
            bail!(
                "--only: unknown measurement {o:?} (startup, jobs, retune, convergence, withdrawal)"
            );
        }
    }
    let want = |m: &str| args.only.iter().any(|o| o == m);
    for m in ["convergence", "withdrawal"] {
        if want(m) && !args.installs.contains(&Install::On) {
            bail!("--only {m} needs discovery: --installs must include on");
        }
    }
    let lifecycle_wanted = ["startup", "jobs", "retune"].iter().any(|m| want(m));
    let istio_wanted = args.istio && (want("startup") || want("jobs"));
    if istio_wanted {
        istio::require_image().await?;
    }
    let machine_before = remora_test_support::results::machine();
    let node = Node::shared().await?;
    let client = node.client()?;
    let guard_before = node.guard_drops().await?;
    let mut table = vec![header()];
    let mut installs = Vec::new();
    let mut conv_rows = None;
    let mut withdrawal_rows = None;
    for &install in &args.installs {
        let t = Instant::now();
        let remora = node
            .install_remora(&client, node::RELEASE_NAMESPACE, &install.values())
            .await?;
        // helm's --wait returns with the old replicas still terminating
        // (and answering the webhook): a pod injected by one of them gets
        // the previous install's sidecar.
        remora.wait_ready(&client, OPERATORS).await?;
        eprintln!(
            "node-bench: Remora installed with {:?} ({:.1} s)",
            install.values(),
            t.elapsed().as_secs_f64()
        );
        if lifecycle_wanted {
            installs.push(lifecycle(&args, node, &client, install, &mut table).await?);
        }
        if install == Install::On && want("convergence") {
            conv_rows = Some(convergence(&args, node, &client).await?);
        }
        if install == Install::On && want("withdrawal") {
            withdrawal_rows = Some(withdrawal(&args, node, &client).await?);
        }
    }
    let guard = node.guard_drops().await? - guard_before;
    if lifecycle_wanted {
        println!("{}", table.join("\n"));
    }
    println!("egress guard dropped: {guard}");
    if lifecycle_wanted {
        let mut out = remora_test_support::results::stamp(&machine_before);
        e2e::node::stamp_images(&mut out);
        out.insert(
            "method".into(),
            json!(format!(
                "one node (kubelet, containerd, runc, CNI bridge) on this machine; Remora by helm \
                 upgraded between installs, each with the values it lists set explicitly (the \
                 local images and rollouts.automatic=true as every node test has them); times \
                 seen by polling the API every {:?} (each end up to one poll late); pods and \
                 Jobs one at a time, variants interleaved. off: the stop request and \
                 SidecarLifecycle settings reach the agent through the downward-API file; on: on \
                 the xDS stream (remora.v1.PodAnnotations), the file the fallback. Every \
                 measured pod is deleted with a 1 s grace period before the next",
                args.poll
            )),
        );
        if istio_wanted {
            out.insert(
                "istio".into(),
                json!({
                    "pilot_agent": format!("istio.io/istio {} (scripts/build-pilot-agent.sh), on the same Envoy", istio::version()),
                    "image": format!("{}:{}", istio::IMAGE, node::image_tag()),
                    "shapes": "e2e::node::istio: Istio 1.31's injection template, no istiod (file-based LDS/CDS, file certificates), CLOUD_PLATFORM=none; measured in each install beside Remora's variants though it does not depend on the install",
                    "startup": [istio::Profile::Defaults.name(), istio::Profile::LegacyHold.name()],
                    "jobs": [istio::Profile::Defaults.name()],
                    "not_measured": "istio-legacy-* Jobs: a regular-container istio-proxy never exits on its own, so the pod never Succeeds unless the app POSTs /quitquitquit",
                }),
            );
        }
        out.insert("installs".into(), json!(installs));
        out.insert("egress_guard_dropped".into(), json!(guard));
        write(&args.out, out)?;
    }
    if let Some(rows) = conv_rows {
        println!();
        println!("EDS convergence: server pod deleted → every subscribed client Envoy without it");
        println!(
            "{:>7} {:>9} {:>10} {:>10} {:>10} {:>16} {:>14} {:>15}",
            "clients",
            "deletions",
            "p50 ms",
            "p99 ms",
            "max ms",
            "from below p50",
            "per-client p50",
            "poll window p50"
        );
        for r in &rows {
            println!(
                "{:>7} {:>9} {:>10.1} {:>10.1} {:>10.1} {:>16.1} {:>14.1} {:>15.1}",
                r.clients,
                r.deletions,
                r.to_every_client.p50_ms,
                r.to_every_client.p99_ms,
                r.to_every_client.max_ms,
                r.to_every_client_lower_bound.p50_ms,
                r.per_client.p50_ms,
                r.resolution.p50_ms
            );
        }
        let mut out = remora_test_support::results::stamp(&machine_before);
        e2e::node::stamp_images(&mut out);
        out.insert(
            "measured".into(),
            json!(format!(
                "a server pod's delete request (default grace) → every subscribed client's Envoy no \
                 longer lists the pod's endpoint in the Service's cluster in its admin /clusters. \
                 Envoy applies an EDS response before it ACKs it, so this is the observable form of \
                 \"every subscribed sidecar has ACKed an EDS version without it\" (the ACK itself \
                 reaches the operator a round trip later). Each client's admin is read through one \
                 kept-alive port-forward connection, all clients concurrently, every {:?}; a \
                 sample is the first answer without the endpoint (an upper bound), `resolution` the \
                 window from the poll before, which still had it",
                args.convergence_poll
            )),
        );
        out.insert(
            "setup".into(),
            json!({
                "install": Install::On.values(),
                "servers": args.servers,
                "mode": args.convergence_mode,
                "clients": "one Deployment of the test app (idle), scaled up in turn; remora.dev/outbound names the Service; namespace-wide SidecarLifecycle: Envoy concurrency 1, requests cpu 5m memory 48Mi",
                "server_deletion": "round robin over the Ready servers; before each, every client holds exactly the Ready servers' endpoints (the replacement included)",
            }),
        );
        out.insert("sizes".into(), serde_json::to_value(&rows)?);
        out.insert("egress_guard_dropped".into(), json!(guard));
        write(&args.convergence_out, out)?;
    }
    if let Some(rows) = withdrawal_rows {
        write_withdrawal(&args, rows, &machine_before, guard)?;
    }
    if guard > 0 {
        bail!("the egress guard dropped {guard} packets");
    }
    Ok(())
}
