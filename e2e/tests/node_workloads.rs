//! Workloads on the real node, under Remora installed by helm: Jobs and
//! CronJobs in both sidecar modes (the pod completes although a sidecar
//! runs beside the app), and Deployments governed by a SidecarLifecycle
//! (a drain setting retuned live in every running agent; a restart-only
//! setting rolled out by the controller under `rolloutPolicy: Automatic`).
//!
//! Each test has its own namespace and may run beside the others. Runs with
//! `REMORA_NODE_TESTS=1` (see `e2e::node`); timings are printed, not asserted.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use e2e::node::workloads::{
    Recording, agent_debug_config, container_status, job_condition, sidecar_status, terminated,
    wait_deployment_rolled_out, wait_layer_in_force,
};
use e2e::node::{self, Check, Node, TEST_APP_IMAGE, TestNamespace, image_tag, report};
use e2e::webhook::{lifecycle, lifecycles};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::{CronJob, Job};
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{DynamicObject, ListParams, LogParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use remora_contract::annotations::{INBOUND, LIFECYCLE, MODE, RESTARTED_FOR, STOP};
use remora_contract::lifecycle::{LifecycleAnnotation, StopRequest};
use remora_contract::pod::{INBOUND_PORT, PROXY_CONTAINER};
use remora_operator::identity::FIELD_MANAGER;
use remora_test_support::wait::wait_until;
use serde_json::{Value, json};

const APP_PORT: u16 = 8080;
/// The app container's name in every workload here.
const APP: &str = "app";
/// A Job's run: the sidecar starts, the app runs 2 s, both stop. In Legacy
/// mode the stop request reaches the agent when the kubelet rewrites the
/// downward-API file: usually at once, but sometimes only at the pod
/// worker's periodic resync, `syncFrequency` (1 min) plus up to 50% jitter
/// (72 s was seen here).
const JOB_DEADLINE: Duration = Duration::from_secs(150);
/// The CronJob controller creates the first Job at the next minute
/// boundary: at most 60 s, plus its own sync.
const CRON_DEADLINE: Duration = Duration::from_secs(90);
/// The controller patches the annotation at once; the kubelet rewrites the
/// downward-API file on its next sync of the pod, at worst at the periodic
/// resync (`syncFrequency` 1 min plus up to 50% jitter).
const RETUNE_DEADLINE: Duration = Duration::from_secs(120);
const ROLLOUT_DEADLINE: Duration = node::ROLLOUT_TIMEOUT;
/// What the agent logs when it obeys `remora.dev/stop` (agent/src/app.rs).
const STOP_LOG: &str = "stop requested through the pod's annotations";
/// What the agent logs on SIGTERM (agent/src/app.rs).
const SIGNAL_LOG: &str = "signal received";
/// What the agent logs last, with its exit code (agent/src/main.rs).
const EXIT_LOG: &str = "remora-agent exiting";

/// The egress guard's counter is 0 (it is the whole node's: the message
/// says how many drops happened while this test ran).
async fn guard_untouched(node: &Node, before: u64) -> anyhow::Result<()> {
    let drops = node.guard_drops().await?;
    ensure!(
        drops == 0,
        "the egress guard dropped {drops} packets, {} of them while this test ran",
        drops.saturating_sub(before)
    );
    Ok(())
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// `b - a` in ms, when both happened.
fn span(a: Option<Instant>, b: Option<Instant>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b >= a => format!("{} ms", ms(b - a)),
        (Some(a), Some(b)) => format!("-{} ms", ms(a - b)),
        _ => "not seen".into(),
    }
}

fn app_image() -> String {
    format!("{TEST_APP_IMAGE}:{}", image_tag())
}

/// The pod template of a Job: the test app serving on [`APP_PORT`] behind
/// the sidecar's inbound listener, exiting 0 after 2 s, as a batch job does.
fn job_template(labels: Value, mode: &str) -> Value {
    json!({
        "metadata": {
            "labels": labels,
            "annotations": {MODE: mode, INBOUND: format!("{INBOUND_PORT}:{APP_PORT}")}
        },
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 10,
            "containers": [{
                "name": APP,
                "image": app_image(),
                "imagePullPolicy": "Never",
                "args": ["--port", APP_PORT.to_string(), "--exit-after", "2s"]
            }]
        }
    })
}

fn job_spec(labels: Value, mode: &str) -> Value {
    json!({"backoffLimit": 0, "template": job_template(labels, mode)})
}

/// A Deployment of the test app, selected by `app=<name>`.
fn deployment(name: &str, replicas: i32) -> anyhow::Result<Deployment> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": {"app": name},
                    "annotations": {INBOUND: format!("{INBOUND_PORT}:{APP_PORT}")}
                },
                "spec": {
                    "terminationGracePeriodSeconds": 10,
                    "containers": [{
                        "name": APP,
                        "image": app_image(),
                        "imagePullPolicy": "Never",
                        "args": ["--port", APP_PORT.to_string()]
                    }]
                }
            }
        }
    }))?)
}

/// One line per container: state, exit code, restarts (for failure messages).
fn describe(pod: &Pod) -> String {
    let name = pod.metadata.name.as_deref().unwrap_or("?");
    let phase = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("?");
    let status = pod.status.clone().unwrap_or_default();
    let containers: Vec<String> = status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten())
        .map(|c| {
            let st = c.state.clone().unwrap_or_default();
            let state = if let Some(t) = st.terminated {
                format!(
                    "terminated {} (exit {})",
                    t.reason.unwrap_or_default(),
                    t.exit_code
                )
            } else if let Some(w) = st.waiting {
                format!("waiting {}", w.reason.unwrap_or_default())
            } else {
                "running".into()
            };
            format!("{}: {state}, restarts {}", c.name, c.restart_count)
        })
        .collect();
    format!("pod {name} {phase} [{}]", containers.join("; "))
}

/// The whole-second API timestamp of a container's end.
fn finished_at(pod: &Pod, container: &str) -> Option<Timestamp> {
    terminated(pod, container)?
        .finished_at
        .as_ref()
        .map(|t| t.0)
}

/// The `timestamp` of the first JSON log line whose message contains `needle`.
fn log_time(log: &str, needle: &str) -> Option<Timestamp> {
    log.lines()
        .filter(|l| l.contains(needle))
        .find_map(|l| serde_json::from_str::<Value>(l).ok())
        .and_then(|v| v["timestamp"].as_str()?.parse().ok())
}

fn ts_ms(from: Timestamp, to: Timestamp) -> i128 {
    (to.as_nanosecond() - from.as_nanosecond()) / 1_000_000
}

/// Waits for Job `job` (one pod, backoffLimit 0, in sidecar `mode`) to
/// complete, then checks how it completed and reports the timeline.
/// `pods` and `jobs` record the namespace since before the Job existed.
async fn check_job(
    client: &Client,
    ns: &str,
    job: &str,
    mode: &str,
    pods: &Recording<Pod>,
    jobs: &Recording<Job>,
) -> anyhow::Result<()> {
    let jobs_api: Api<Job> = Api::namespaced(client.clone(), ns);
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let of_job = format!("batch.kubernetes.io/job-name={job}");
    let done = wait_until(
        JOB_DEADLINE,
        &format!("Job {ns}/{job} Complete"),
        || async {
            let j = jobs_api.get(job).await?;
            let list = pods_api
                .list(&ListParams::default().labels(&of_job))
                .await?
                .items;
            if let Some(reason) = list.iter().find_map(node::cannot_start) {
                return Err(node::Error::Failed {
                    what: format!("a pod of Job {job} cannot start"),
                    detail: reason,
                });
            }
            let seen: Vec<String> = list.iter().map(describe).collect();
            if let Some(c) = job_condition(&j, "Failed") {
                return Err(node::Error::Failed {
                    what: format!("Job {job} failed"),
                    detail: format!("{:?}: {:?}; {seen:?}", c.reason, c.message),
                });
            }
            Ok::<_, node::Error>(match job_condition(&j, "Complete") {
                Some(_) => Check::Done(j),
                None => Check::NotYet(format!("{seen:?}")),
            })
        },
    )
    .await?;

    // The Job: one pod succeeded, Complete.
    let st = done.status.clone().unwrap_or_default();
    ensure!(
        st.succeeded == Some(1),
        "Job {job}: succeeded {:?}",
        st.succeeded
    );
    ensure!(
        st.failed.unwrap_or(0) == 0,
        "Job {job}: failed {:?}",
        st.failed
    );
    let list = pods_api
        .list(&ListParams::default().labels(&of_job))
        .await?
        .items;
    let [pod] = list.as_slice() else {
        bail!("Job {job} has {} pods, want 1", list.len());
    };
    let name = pod.metadata.name.clone().unwrap_or_default();
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    ensure!(phase == Some("Succeeded"), "{}", describe(pod));

    // The sidecar where the mode puts it.
    let spec = pod.spec.clone().unwrap_or_default();
    let init = spec.init_containers.clone().unwrap_or_default();
    match mode {
        "Legacy" => ensure!(
            spec.containers.iter().any(|c| c.name == PROXY_CONTAINER)
                && !init.iter().any(|c| c.name == PROXY_CONTAINER),
            "Legacy: {PROXY_CONTAINER} is not a regular container of {name}"
        ),
        _ => ensure!(
            init.iter().any(|c| c.name == PROXY_CONTAINER
                && c.restart_policy.as_deref() == Some("Always")),
            "Native: {PROXY_CONTAINER} is not a restartable init container of {name}"
        ),
    }
    let injected = sidecar_status(pod).context("no remora.dev/status")?;
    ensure!(
        injected.mode.as_str() == mode,
        "injected in mode {:?}, want {mode}",
        injected.mode
    );

    // Every container ended, the app and the sidecar with 0, none restarted.
    for c in init.iter().chain(&spec.containers) {
        let t = terminated(pod, &c.name).with_context(|| {
            format!("container {} has not terminated: {}", c.name, describe(pod))
        })?;
        let restarts = container_status(pod, &c.name).map_or(0, |s| s.restart_count);
        ensure!(restarts == 0, "{} restarted {restarts} times", c.name);
        if c.name == APP || c.name == PROXY_CONTAINER {
            ensure!(
                t.exit_code == 0,
                "container {} exited {} ({:?}): {}",
                c.name,
                t.exit_code,
                t.reason,
                describe(pod)
            );
        }
    }

    let log = pods_api
        .logs(
            &name,
            &LogParams {
                container: Some(PROXY_CONTAINER.into()),
                ..LogParams::default()
            },
        )
        .await?;
    let app_end = finished_at(pod, APP).context("app finishedAt")?;
    let proxy_end = finished_at(pod, PROXY_CONTAINER).context("sidecar finishedAt")?;
    let annotations = pod.metadata.annotations.clone().unwrap_or_default();
    // The agent's last word (agent/src/main.rs), with its exit code.
    let exiting = log_time(&log, EXIT_LOG);
    ensure!(
        log.lines()
            .filter(|l| l.contains(EXIT_LOG))
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .any(|v| v["code"] == 0),
        "the agent did not log {EXIT_LOG:?} with code 0; its log:\n{log}"
    );
    let how;
    if mode == "Legacy" {
        // The controller asked, through the annotation, after the app ended;
        // the agent read it from its downward-API file and quit.
        let raw = annotations
            .get(STOP)
            .with_context(|| format!("Legacy pod {name} completed without {STOP}"))?;
        let req: StopRequest =
            serde_json::from_str(raw).with_context(|| format!("{STOP}={raw}"))?;
        ensure!(
            req.reason == "AppsCompleted",
            "{STOP} reason {:?}",
            req.reason
        );
        // Who wrote it: the API server's record of field owners.
        let key = format!("f:{STOP}");
        let owners: Vec<String> = pod
            .metadata
            .managed_fields
            .iter()
            .flatten()
            .filter(|m| {
                m.fields_v1
                    .as_ref()
                    .is_some_and(|f| f.0["f:metadata"]["f:annotations"].get(&key).is_some())
            })
            .filter_map(|m| m.manager.clone())
            .collect();
        ensure!(
            owners == [FIELD_MANAGER],
            "{STOP} is owned by {owners:?}, want the operator's field manager only"
        );
        let asked: Timestamp = req
            .at
            .parse()
            .with_context(|| format!("{STOP} at {:?}", req.at))?;
        // finishedAt has whole seconds: compare at that resolution.
        ensure!(
            asked.as_second() >= app_end.as_second(),
            "stop asked at {asked}, before the app finished ({app_end})"
        );
        ensure!(
            proxy_end.as_second() >= asked.as_second(),
            "sidecar finished at {proxy_end}, before the stop was asked ({asked})"
        );
        let seen = log_time(&log, STOP_LOG)
            .with_context(|| format!("the sidecar never logged {STOP_LOG:?}; its log:\n{log}"))?;
        ensure!(
            !log.contains(SIGNAL_LOG),
            "the Legacy sidecar was signalled, not stopped by {STOP}:\n{log}"
        );
        let events: Api<Event> = Api::namespaced(client.clone(), ns);
        let by_pod = format!("involvedObject.name={name}");
        wait_until(
            Duration::from_secs(30),
            "the SidecarStopRequested Event on the pod",
            || async {
                let list = events
                    .list(&ListParams::default().fields(&by_pod))
                    .await?
                    .items;
                Ok::<_, anyhow::Error>(
                    match list
                        .iter()
                        .find(|e| e.reason.as_deref() == Some("SidecarStopRequested"))
                    {
                        Some(_) => Check::Done(()),
                        None => Check::NotYet(format!(
                            "reasons {:?}",
                            list.iter().map(|e| e.reason.clone()).collect::<Vec<_>>()
                        )),
                    },
                )
            },
        )
        .await?;
        how = format!(
            "agent: {STOP} set by the operator at {asked}, read from the downward-API file +{} ms (kubelet refresh + inotify wake, 100 ms poll as fallback), agent exiting +{} ms",
            ts_ms(asked, seen),
            exiting.map_or("?".into(), |e| ts_ms(asked, e).to_string())
        );
    } else {
        // Nobody asked: the kubelet stopped the native sidecar with SIGTERM
        // once the app was done.
        ensure!(
            !annotations.contains_key(STOP),
            "the operator set {STOP} on Native pod {name}"
        );
        ensure!(
            log.contains(SIGNAL_LOG) && !log.contains(STOP_LOG),
            "the Native sidecar was not stopped by the kubelet's SIGTERM; its log:\n{log}"
        );
        let sig = log_time(&log, SIGNAL_LOG).context("no signal log line")?;
        how = format!(
            "agent: the kubelet's SIGTERM {} ms after the app's finishedAt (whole seconds), agent exiting +{} ms (drain)",
            ts_ms(app_end, sig),
            exiting.map_or("?".into(), |e| ts_ms(sig, e).to_string())
        );
    }

    // The timeline as the watches saw it (host clock, ms).
    let mine = |p: &Pod| p.metadata.name.as_deref() == Some(name.as_str());
    let app_seen = pods.first(|p| mine(p) && terminated(p, APP).is_some());
    let stop_seen = pods.first(|p| {
        mine(p)
            && p.metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(STOP))
    });
    let proxy_seen = pods.first(|p| mine(p) && terminated(p, PROXY_CONTAINER).is_some());
    let succeeded_seen = pods.first(|p| {
        mine(p) && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded")
    });
    let complete_seen = jobs.first(|j| {
        j.metadata.name.as_deref() == Some(job) && job_condition(j, "Complete").is_some()
    });
    let stop_part = if mode == "Legacy" {
        format!(" stop annotation +{},", span(app_seen, stop_seen))
    } else {
        String::new()
    };
    report(&format!(
        "  {job} ({mode}): watch: last app exit ->{stop_part} sidecar exited +{}, pod Succeeded +{}, Job Complete +{}; API finishedAt app {app_end} -> sidecar {proxy_end} ({} ms, whole seconds); {how}",
        span(app_seen, proxy_seen),
        span(app_seen, succeeded_seen),
        span(app_seen, complete_seen),
        ts_ms(app_end, proxy_end),
    ));
    Ok(())
}

/// A Job in sidecar `mode` runs to completion.
async fn job_in_mode(test: &str, mode: &str) -> anyhow::Result<()> {
    let node = Node::for_test(test).await?;
    let client = node.client()?;
    let drops_before = node.guard_drops().await?;
    let started = Instant::now();
    node.remora(&client).await?;
    let ns = TestNamespace::injected(node, &client, test).await?;
    let pods = Recording::start(ns.api::<Pod>(), None).await?;
    let jobs = Recording::start(ns.api::<Job>(), None).await?;
    let name = "work";
    let job: Job = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": job_spec(json!({"app": name}), mode),
    }))?;
    let t0 = Instant::now();
    ns.api::<Job>().create(&PostParams::default(), &job).await?;
    check_job(&client, ns.name(), name, mode, &pods, &jobs).await?;
    report(&format!(
        "{test}: Job created -> Complete in {} ms",
        ms(t0.elapsed())
    ));
    ns.delete().await?;
    report(&format!("{test}: passed in {} ms", ms(started.elapsed())));
    guard_untouched(node, drops_before).await?;
    Ok(())
}

#[tokio::test]
#[ignore = "needs the real node: REMORA_NODE_TESTS=1 cargo test -p e2e --test node_workloads -- --ignored (root, scripts/cluster.sh, scripts/images.sh)"]
async fn job_legacy() -> anyhow::Result<()> {
    job_in_mode("job_legacy", "Legacy").await
}

#[tokio::test]
#[ignore = "needs the real node: REMORA_NODE_TESTS=1 cargo test -p e2e --test node_workloads -- --ignored (root, scripts/cluster.sh, scripts/images.sh)"]
async fn job_native() -> anyhow::Result<()> {
    job_in_mode("job_native", "Native").await
}

/// Two CronJobs (Legacy, Native) scheduled every minute: the cluster's own
/// CronJob controller (kube-controller-manager runs every default
/// controller) creates their Jobs from the jobTemplate, as it does for a
/// user, rather than a copy made here as `kubectl create job --from` does.
/// Both fire at the same minute boundary, so the test waits at most one
/// minute once, while the other tests of the binary run.
#[tokio::test]
#[ignore = "needs the real node: REMORA_NODE_TESTS=1 cargo test -p e2e --test node_workloads -- --ignored (root, scripts/cluster.sh, scripts/images.sh)"]
async fn cronjob_legacy_and_native() -> anyhow::Result<()> {
    let test = "cronjob_legacy_and_native";
    let node = Node::for_test(test).await?;
    let client = node.client()?;
    let drops_before = node.guard_drops().await?;
    let started = Instant::now();
    node.remora(&client).await?;
    let ns = TestNamespace::injected(node, &client, "cronjob").await?;
    let pods = Recording::start(ns.api::<Pod>(), None).await?;
    let jobs = Recording::start(ns.api::<Job>(), None).await?;
    let crons: Api<CronJob> = ns.api();
    let modes = [("cron-legacy", "Legacy"), ("cron-native", "Native")];
    let t0 = Instant::now();
    let mut uids = BTreeMap::new();
    for (name, mode) in modes {
        let cron: CronJob = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "schedule": "* * * * *",
                "concurrencyPolicy": "Forbid",
                "jobTemplate": {
                    "metadata": {"labels": {"from-cron": name}},
                    "spec": job_spec(json!({"from-cron": name}), mode)
                }
            }
        }))?;
        let created = crons.create(&PostParams::default(), &cron).await?;
        uids.insert(name, created.metadata.uid.unwrap_or_default());
    }

    // The first Job of each, made by the CronJob controller.
    let jobs_api: Api<Job> = ns.api();
    let made = wait_until(CRON_DEADLINE, "a Job from each CronJob", || async {
        let list = jobs_api.list(&ListParams::default()).await?.items;
        let mut found = BTreeMap::new();
        for (name, _) in modes {
            let owned = list.iter().find(|j| {
                j.metadata.owner_references.iter().flatten().any(|o| {
                    o.kind == "CronJob"
                        && o.name == name
                        && o.controller == Some(true)
                        && Some(&o.uid) == uids.get(name)
                })
            });
            if let Some(j) = owned {
                found.insert(name, j.clone());
            }
        }
        Ok::<_, anyhow::Error>(if found.len() == modes.len() {
            Check::Done(found)
        } else {
            Check::NotYet(format!(
                "Jobs so far: {:?}",
                list.iter()
                    .map(|j| j.metadata.name.clone())
                    .collect::<Vec<_>>()
            ))
        })
    })
    .await?;
    let fired = t0.elapsed();
    // One run each is enough: no more Jobs while the test checks these.
    for (name, _) in modes {
        crons
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"suspend": true}})),
            )
            .await?;
    }
    let scheduled: Vec<String> = made
        .values()
        .map(|j| {
            format!(
                "{} (scheduled {})",
                j.metadata.name.clone().unwrap_or_default(),
                j.metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get("batch.kubernetes.io/cronjob-scheduled-timestamp"))
                    .cloned()
                    .unwrap_or_default()
            )
        })
        .collect();
    report(&format!(
        "{test}: the CronJob controller created {scheduled:?} {} ms after the CronJobs",
        ms(fired)
    ));

    let ns_name = ns.name().to_owned();
    let checks = modes.map(|(name, mode)| {
        let job = made[name].metadata.name.clone().unwrap_or_default();
        let (client, ns, pods, jobs) = (&client, ns_name.as_str(), &pods, &jobs);
        async move {
            check_job(client, ns, &job, mode, pods, jobs).await?;
            // The pod came from the CronJob's template and was injected.
            let list = Api::<Pod>::namespaced(client.clone(), ns)
                .list(&ListParams::default().labels(&format!("batch.kubernetes.io/job-name={job}")))
                .await?
                .items;
            for p in &list {
                ensure!(
                    p.metadata.labels.as_ref().and_then(|l| l.get("from-cron"))
                        == Some(&name.to_owned()),
                    "pod {:?} lacks the jobTemplate's label from-cron={name}",
                    p.metadata.name
                );
                ensure!(
                    p.metadata.annotations.as_ref().and_then(|a| a.get(MODE))
                        == Some(&mode.to_owned()),
                    "pod {:?} lacks the jobTemplate's {MODE}",
                    p.metadata.name
                );
                ensure!(
                    e2e::webhook::sidecar(p).is_some(),
                    "pod {:?} has no sidecar",
                    p.metadata.name
                );
            }
            anyhow::Ok(())
        }
    });
    let [legacy, native] = checks;
    let (legacy, native) = tokio::join!(legacy, native);
    legacy.context("the Legacy CronJob's Job")?;
    native.context("the Native CronJob's Job")?;
    report(&format!(
        "{test}: both Jobs Complete {} ms after the CronJobs were created",
        ms(t0.elapsed())
    ));
    ns.delete().await?;
    report(&format!("{test}: passed in {} ms", ms(started.elapsed())));
    guard_untouched(node, drops_before).await?;
    Ok(())
}

/// One condition of a SidecarLifecycle's status: (status, reason).
fn slc_condition(slc: &DynamicObject, type_: &str) -> Option<(String, String)> {
    slc.data["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_owned(),
                c["reason"].as_str().unwrap_or_default().to_owned(),
            )
        })
}

/// Waits until the controller has acted on the current generation of SLC
/// `name`: observedGeneration, `matchedPods == matched`, Accepted, not
/// Conflicted, Applied, and RestartRequired False. Returns the object.
async fn wait_slc_settled(
    client: &Client,
    ns: &str,
    name: &str,
    matched: i64,
    timeout: Duration,
) -> anyhow::Result<DynamicObject> {
    let api = lifecycles(client, ns);
    wait_until(
        timeout,
        &format!("SidecarLifecycle {ns}/{name} status settled"),
        || async {
            let slc = api.get(name).await?;
            let st = &slc.data["status"];
            let want = [
                ("Accepted", "True"),
                ("Conflicted", "False"),
                ("Applied", "True"),
                ("RestartRequired", "False"),
            ];
            let ok = st["observedGeneration"].as_i64() == slc.metadata.generation
                && st["matchedPods"].as_i64() == Some(matched)
                && want
                    .iter()
                    .all(|(t, s)| slc_condition(&slc, t).is_some_and(|(status, _)| status == *s));
            Ok::<_, anyhow::Error>(if ok {
                Check::Done(slc)
            } else {
                Check::NotYet(format!(
                    "generation {:?}, status {st}",
                    slc.metadata.generation
                ))
            })
        },
    )
    .await
}

fn slc_summary(slc: &DynamicObject) -> String {
    let st = &slc.data["status"];
    let conds: Vec<String> = ["Accepted", "Conflicted", "Applied", "RestartRequired"]
        .iter()
        .filter_map(|t| slc_condition(slc, t).map(|(s, r)| format!("{t}={s}/{r}")))
        .collect();
    format!(
        "generation {:?}, observedGeneration {}, matchedPods {}, {}",
        slc.metadata.generation,
        st["observedGeneration"],
        st["matchedPods"],
        conds.join(" ")
    )
}

/// Seconds of a field of the agent's `effective_drain_settings`.
fn drain_setting(config: &Value, field: &str) -> Option<f64> {
    config["effective_drain_settings"][field].as_f64()
}

/// (uid, every container's restart count) per pod name.
fn identities(pods: &[Pod]) -> BTreeMap<String, (String, Vec<i32>)> {
    pods.iter()
        .map(|p| {
            let st = p.status.clone().unwrap_or_default();
            let restarts = st
                .init_container_statuses
                .iter()
                .flatten()
                .chain(st.container_statuses.iter().flatten())
                .map(|c| c.restart_count)
                .collect();
            (
                p.metadata.name.clone().unwrap_or_default(),
                (p.metadata.uid.clone().unwrap_or_default(), restarts),
            )
        })
        .collect()
}

/// A drain setting changed in the SidecarLifecycle reaches every running
/// agent (controller → pod annotation → kubelet's downward-API file →
/// agent), with no pod restarted.
#[tokio::test]
#[ignore = "needs the real node: REMORA_NODE_TESTS=1 cargo test -p e2e --test node_workloads -- --ignored (root, scripts/cluster.sh, scripts/images.sh)"]
async fn sidecar_lifecycle_retune() -> anyhow::Result<()> {
    let test = "sidecar_lifecycle_retune";
    let node = Node::for_test(test).await?;
    let client = node.client()?;
    let drops_before = node.guard_drops().await?;
    let started = Instant::now();
    node.remora(&client).await?;
    let ns = TestNamespace::injected(node, &client, "retune").await?;
    let name = "retune";
    let slcs = lifecycles(&client, ns.name());
    let spec = json!({
        "selector": {"matchLabels": {"app": name}},
        "mode": "Legacy",
        "shutdown": {"drainDuration": "30s", "terminationDrainDuration": "4s"},
    });
    slcs.create(&PostParams::default(), &lifecycle(name, spec)?)
        .await?;
    let source = format!("workload:{}/{name}", ns.name());
    wait_layer_in_force(
        &client,
        ns.name(),
        &[("app", name)],
        &source,
        4,
        Duration::from_secs(60),
    )
    .await?;
    ns.api::<Deployment>()
        .create(&PostParams::default(), &deployment(name, 2)?)
        .await?;
    let before = wait_deployment_rolled_out(&client, ns.name(), name, ROLLOUT_DEADLINE).await?;
    let names: Vec<String> = before
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    let mut hot_before = BTreeMap::new();
    for p in &before {
        let injected = sidecar_status(p).context("no remora.dev/status")?;
        ensure!(
            injected.sources.contains(&source) && injected.mode.as_str() == "Legacy",
            "pod {:?} injected from {:?} in {:?}",
            p.metadata.name,
            injected.sources,
            injected.mode
        );
        let pod = p.metadata.name.clone().unwrap_or_default();
        let cfg = agent_debug_config(&client, ns.name(), &pod).await?;
        ensure!(
            drain_setting(&cfg, "drain_duration") == Some(30.0)
                && drain_setting(&cfg, "termination_drain_duration") == Some(4.0),
            "{pod} starts with {}",
            cfg["effective_drain_settings"]
        );
        hot_before.insert(pod, cfg["envoy"]["hot_restarts"].as_u64().unwrap_or(0));
    }
    let settled = wait_slc_settled(&client, ns.name(), name, 2, Duration::from_secs(60)).await?;
    report(&format!(
        "{test}: before the edit: {}",
        slc_summary(&settled)
    ));
    let ids = identities(&before);

    // The edit: both drain settings, which running agents take live.
    let pods = Recording::start(ns.api::<Pod>(), Some(&format!("app={name}"))).await?;
    let t0 = Instant::now();
    slcs.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"shutdown": {
            "drainDuration": "20s", "terminationDrainDuration": "2s"
        }}})),
    )
    .await?;
    let seen = std::sync::Mutex::new(BTreeMap::<String, Duration>::new());
    wait_until(
        RETUNE_DEADLINE,
        "every agent reporting the new drain settings",
        || async {
            let mut lagging = Vec::new();
            for pod in &names {
                if seen
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .contains_key(pod)
                {
                    continue;
                }
                let cfg = agent_debug_config(&client, ns.name(), pod).await?;
                let (drain, term) = (
                    drain_setting(&cfg, "drain_duration"),
                    drain_setting(&cfg, "termination_drain_duration"),
                );
                if drain == Some(20.0) && term == Some(2.0) {
                    seen.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(pod.clone(), t0.elapsed());
                } else {
                    lagging.push(format!("{pod}: drain {drain:?} termination {term:?}"));
                }
            }
            Ok::<_, anyhow::Error>(if lagging.is_empty() {
                Check::Done(())
            } else {
                Check::NotYet(lagging.join("; "))
            })
        },
    )
    .await?;
    let all_agents = t0.elapsed();
    let seen = seen.into_inner().unwrap_or_else(|p| p.into_inner());

    // When the controller patched each pod's annotation (watch, host clock).
    let patched: Vec<String> = names
        .iter()
        .map(|pod| {
            let at = pods.first(|p| {
                p.metadata.name.as_deref() == Some(pod)
                    && p.metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(LIFECYCLE))
                        .and_then(|l| serde_json::from_str::<LifecycleAnnotation>(l).ok())
                        .and_then(|l| l.shutdown?.drain_duration)
                        .is_some_and(|d| {
                            remora_contract::duration::parse(&d).ok()
                                == Some(Duration::from_secs(20))
                        })
            });
            format!(
                "{pod}: annotation +{}, agent +{} ms",
                span(Some(t0), at),
                seen.get(pod).map_or(0, |d| ms(*d))
            )
        })
        .collect();
    report(&format!(
        "{test}: edit -> all {} agents report drain 20s/termination 2s in {} ms ({})",
        names.len(),
        ms(all_agents),
        patched.join("; ")
    ));

    // A new drain duration is a bootstrap input: Envoy restarts hot, in the
    // same container.
    let hot = wait_until(
        Duration::from_secs(30),
        "a hot restart of each Envoy (new --drain-time-s)",
        || async {
            let mut waiting = Vec::new();
            for pod in &names {
                let cfg = agent_debug_config(&client, ns.name(), pod).await?;
                let now = cfg["envoy"]["hot_restarts"].as_u64().unwrap_or(0);
                if now <= hot_before[pod] || cfg["envoy"]["crash_restarts"].as_u64() != Some(0) {
                    waiting.push(format!("{pod}: envoy {}", cfg["envoy"]));
                }
            }
            Ok::<_, anyhow::Error>(if waiting.is_empty() {
                Check::Done(t0.elapsed())
            } else {
                Check::NotYet(waiting.join("; "))
            })
        },
    )
    .await?;
    report(&format!(
        "{test}: every Envoy hot-restarted by edit +{} ms",
        ms(hot)
    ));

    // Nothing restarted: the same pods, no container restart, all Ready.
    let after = ns
        .api::<Pod>()
        .list(&ListParams::default().labels(&format!("app={name}")))
        .await?
        .items;
    ensure!(
        identities(&after) == ids,
        "pods changed: before {ids:?}, after {:?}",
        identities(&after)
    );
    ensure!(
        ids.values().all(|(_, r)| r.iter().all(|n| *n == 0)),
        "restarts: {ids:?}"
    );
    ensure!(after.iter().all(node::is_ready), "a pod is not Ready");
    let d = ns.api::<Deployment>().get(name).await?;
    ensure!(
        d.metadata.generation == Some(1),
        "the Deployment was changed (generation {:?})",
        d.metadata.generation
    );
    let settled = wait_slc_settled(&client, ns.name(), name, 2, Duration::from_secs(60)).await?;
    ensure!(settled.metadata.generation == Some(2));
    report(&format!(
        "{test}: after the edit: {}",
        slc_summary(&settled)
    ));
    drop(pods);
    ns.delete().await?;
    report(&format!("{test}: passed in {} ms", ms(started.elapsed())));
    guard_untouched(node, drops_before).await?;
    Ok(())
}

/// A setting only a restart applies (Envoy's concurrency) changed in a
/// SidecarLifecycle with `rolloutPolicy: Automatic`: the controller rolls
/// the Deployment, and the new pods run with it.
#[tokio::test]
#[ignore = "needs the real node: REMORA_NODE_TESTS=1 cargo test -p e2e --test node_workloads -- --ignored (root, scripts/cluster.sh, scripts/images.sh)"]
async fn rollout_policy_automatic() -> anyhow::Result<()> {
    let test = "rollout_policy_automatic";
    let node = Node::for_test(test).await?;
    let client = node.client()?;
    let drops_before = node.guard_drops().await?;
    let started = Instant::now();
    node.remora(&client).await?;
    let ns = TestNamespace::injected(node, &client, "rollout").await?;
    let name = "roll";
    let slcs = lifecycles(&client, ns.name());
    let spec = json!({
        "selector": {"matchLabels": {"app": name}},
        "mode": "Legacy",
        "rolloutPolicy": "Automatic",
        "proxy": {"concurrency": 2},
        // Old pods go quickly once replaced.
        "shutdown": {"terminationDrainDuration": "1s"},
    });
    slcs.create(&PostParams::default(), &lifecycle(name, spec)?)
        .await?;
    let source = format!("workload:{}/{name}", ns.name());
    wait_layer_in_force(
        &client,
        ns.name(),
        &[("app", name)],
        &source,
        4,
        Duration::from_secs(60),
    )
    .await?;
    let deploys: Api<Deployment> = ns.api();
    deploys
        .create(&PostParams::default(), &deployment(name, 2)?)
        .await?;
    let before = wait_deployment_rolled_out(&client, ns.name(), name, ROLLOUT_DEADLINE).await?;
    for p in &before {
        let pod = p.metadata.name.clone().unwrap_or_default();
        let cfg = agent_debug_config(&client, ns.name(), &pod).await?;
        ensure!(
            cfg["config"]["concurrency"] == 2,
            "{pod}: concurrency {}",
            cfg["config"]["concurrency"]
        );
    }
    let settled = wait_slc_settled(&client, ns.name(), name, 2, Duration::from_secs(60)).await?;
    report(&format!(
        "{test}: before the edit: {}",
        slc_summary(&settled)
    ));
    let old: BTreeSet<String> = before
        .iter()
        .filter_map(|p| p.metadata.uid.clone())
        .collect();
    let old_template = deploys.get(name).await?.spec.and_then(|s| {
        s.template
            .metadata
            .and_then(|m| m.annotations)
            .and_then(|a| a.get(RESTARTED_FOR).cloned())
    });
    ensure!(
        old_template.is_none(),
        "rolled before the edit: {old_template:?}"
    );

    let by_app = format!("app={name}");
    let pods = Recording::start(ns.api::<Pod>(), Some(&by_app)).await?;
    let workloads = Recording::start(deploys.clone(), None).await?;
    let slc_seen = Recording::start(slcs.clone(), None).await?;
    let t0 = Instant::now();
    slcs.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"proxy": {"concurrency": 1}}})),
    )
    .await?;

    // The controller annotates the template; the Deployment controller rolls.
    let hash = wait_until(
        Duration::from_secs(90),
        "the controller rolling the Deployment",
        || async {
            let d = deploys.get(name).await?;
            let hash = d
                .spec
                .and_then(|s| s.template.metadata)
                .and_then(|m| m.annotations)
                .and_then(|a| a.get(RESTARTED_FOR).cloned());
            let slc = slcs.get(name).await?;
            Ok::<_, anyhow::Error>(match hash {
                Some(h) => Check::Done(h),
                None => Check::NotYet(slc_summary(&slc)),
            })
        },
    )
    .await?;
    let after = wait_deployment_rolled_out(&client, ns.name(), name, ROLLOUT_DEADLINE).await?;
    let rolled = t0.elapsed();
    let gone: Vec<&String> = old.iter().collect();
    ensure!(
        after
            .iter()
            .all(|p| p.metadata.uid.as_ref().is_some_and(|u| !old.contains(u))),
        "old pods {gone:?} still there"
    );
    for p in &after {
        let pod = p.metadata.name.clone().unwrap_or_default();
        let injected = sidecar_status(p).context("no remora.dev/status")?;
        ensure!(
            injected.restart_hash.as_deref() == Some(hash.as_str()),
            "{pod}: restart hash {:?}, the template asks for {hash}",
            injected.restart_hash
        );
        let cfg = agent_debug_config(&client, ns.name(), &pod).await?;
        ensure!(
            cfg["config"]["concurrency"] == 1,
            "{pod}: concurrency {}",
            cfg["config"]["concurrency"]
        );
        let restarts = container_status(p, PROXY_CONTAINER).map_or(-1, |s| s.restart_count);
        ensure!(restarts == 0, "{pod}: sidecar restarts {restarts}");
    }
    let settled = wait_slc_settled(&client, ns.name(), name, 2, Duration::from_secs(60)).await?;
    ensure!(settled.metadata.generation == Some(2));

    let annotated = workloads.first(|d| {
        d.spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.annotations.as_ref())
            .is_some_and(|a| a.contains_key(RESTARTED_FOR))
    });
    let first_new_ready = pods
        .first(|p| p.metadata.uid.as_ref().is_some_and(|u| !old.contains(u)) && node::is_ready(p));
    let rolling_out = slc_seen.first(|s| {
        slc_condition(s, "RestartRequired").is_some_and(|(st, r)| st == "True" && r == "RollingOut")
    });
    report(&format!(
        "{test}: edit -> template annotated {RESTARTED_FOR}={hash} +{}, RestartRequired=True/RollingOut +{}, first new pod Ready +{}, rollout done and old pods gone +{} ms",
        span(Some(t0), annotated),
        span(Some(t0), rolling_out),
        span(Some(t0), first_new_ready),
        ms(rolled)
    ));
    report(&format!("{test}: after: {}", slc_summary(&settled)));
    drop((pods, workloads, slc_seen));
    ns.delete().await?;
    report(&format!("{test}: passed in {} ms", ms(started.elapsed())));
    guard_untouched(node, drops_before).await?;
    Ok(())
}
