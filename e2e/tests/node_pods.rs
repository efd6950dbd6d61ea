//! Injected pods on the real node, in both sidecar modes: a Deployment of
//! the test app behind a ClusterIP Service runs the real remora-agent (and
//! its Envoy) next to the app, the app starts only once the sidecar is ready,
//! traffic from the host reaches the app through Envoy, and a deleted pod
//! drains and is gone within its grace period with every container exiting
//! 0. Then the sidecar's failure paths: Envoy killed (the agent restarts it,
//! the kubelet sees nothing), the agent killed (the kubelet restarts the
//! container).
//!
//! Runs with `REMORA_NODE_TESTS=1` (see `e2e::node`); each test has its own
//! namespace, so they run in parallel. Timings are printed, not asserted.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, ensure};
use e2e::node::pods::{self, LogFollower, LogLine, PodProcess};
use e2e::node::workloads::{Recording, container_status, terminated, wait_deployment_rolled_out};
use e2e::node::{self, Check, Node, PROXY_IMAGE, TestNamespace, is_ready, report};
use e2e::webhook::sidecar;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::Client;
use kube::api::{DeleteParams, PostParams};
use nix::sys::signal::Signal;
use remora_contract::annotations::{INBOUND, MODE, OUTBOUND};
use remora_contract::pod::{AGENT_ADMIN_PORT, HEALTH_PORT, INBOUND_PORT, PROXY_CONTAINER};
use remora_test_support::wait::wait_until;

const APP: &str = "web";
const APP_CONTAINER: &str = "app";
const APP_PORT: u16 = 8080;
/// An outbound listener to the agent's own health port: through Envoy, 200
/// only once the agent reports ready. The app calls it at startup, so an app
/// started before its sidecar logs a failed call.
const OUTBOUND_PORT: u16 = 15001;
const DEADLINE: Duration = Duration::from_secs(120);
const REQUESTS: usize = 50;
/// `/proc` start times have 10 ms ticks; log times are nanoseconds.
const TICK_TOLERANCE_MS: i64 = 20;

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

fn startup_url() -> String {
    format!("http://127.0.0.1:{OUTBOUND_PORT}/healthz/ready")
}

/// The test app behind its sidecar: inbound 15006 → 8080, the outbound
/// listener it calls at startup, and 2 s of serving after SIGTERM.
fn app_deployment(name: &str, replicas: i32, mode: &str) -> anyhow::Result<Deployment> {
    let inbound = format!("{INBOUND_PORT}:{APP_PORT}");
    let outbound = format!("{OUTBOUND_PORT}:127.0.0.1:{HEALTH_PORT}");
    let port = APP_PORT.to_string();
    let url = startup_url();
    Ok(pods::test_app_deployment(
        name,
        replicas,
        &[(MODE, mode), (INBOUND, &inbound), (OUTBOUND, &outbound)],
        &[
            "--port",
            &port,
            "--startup-call",
            &url,
            "--shutdown-delay",
            "2s",
        ],
    )?)
}

/// Creates the Deployment and its Service (80 → the sidecar's inbound
/// port) and waits for the rollout; returns the pods and the ClusterIP.
async fn deploy(
    client: &Client,
    ns: &TestNamespace,
    name: &str,
    replicas: i32,
    mode: &str,
) -> anyhow::Result<(Vec<Pod>, IpAddr)> {
    // The webhook must be in force for this namespace before pods are made.
    node::wait_injected(client, ns.name(), DEADLINE).await?;
    let t = Instant::now();
    ns.api::<Deployment>()
        .create(
            &PostParams::default(),
            &app_deployment(name, replicas, mode)?,
        )
        .await?;
    let svc = ns
        .api::<Service>()
        .create(
            &PostParams::default(),
            &pods::test_app_service(name, 80, INBOUND_PORT)?,
        )
        .await?;
    let running = wait_deployment_rolled_out(client, ns.name(), name, DEADLINE).await?;
    report(&format!(
        "  {mode}: Deployment {}/{name} ({replicas} replicas) rolled out in {} ms",
        ns.name(),
        ms(t.elapsed())
    ));
    let ip: IpAddr = svc
        .spec
        .and_then(|s| s.cluster_ip)
        .context("Service has no ClusterIP")?
        .parse()?;
    wait_serving(client, ns, name, replicas, ip, mode).await?;
    Ok((running, ip))
}

/// Waits until Service `name` at `ip:80` has `replicas` ready endpoints and
/// kube-proxy has programmed them: pods Ready is not yet a Service that
/// answers (the EndpointSlice controller, then kube-proxy, catch up
/// asynchronously).
async fn wait_serving(
    client: &Client,
    ns: &TestNamespace,
    name: &str,
    replicas: i32,
    ip: IpAddr,
    what: &str,
) -> anyhow::Result<()> {
    let t = Instant::now();
    let n = usize::try_from(replicas)?;
    pods::wait_service_endpoints(client, ns.name(), name, n, DEADLINE).await?;
    let endpoints = t.elapsed();
    pods::wait_kube_proxy(ip, 80, DEADLINE).await?;
    report(&format!(
        "  {what}: Service {name}: {n} ready endpoints after {} ms, in kube-proxy's rules after {} ms",
        ms(endpoints),
        ms(t.elapsed())
    ));
    Ok(())
}

fn pod_name(pod: &Pod) -> &str {
    pod.metadata.name.as_deref().unwrap_or("?")
}

fn pod_uid(pod: &Pod) -> anyhow::Result<&str> {
    pod.metadata.uid.as_deref().context("pod without uid")
}

fn pod_ip(pod: &Pod) -> anyhow::Result<IpAddr> {
    Ok(pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .context("pod without IP")?
        .parse()?)
}

/// The sidecar where the mode puts it, from the locally built agent image,
/// running and ready.
fn check_sidecar(pod: &Pod, mode: &str) -> anyhow::Result<()> {
    let name = pod_name(pod);
    let (place, c) = sidecar(pod).with_context(|| format!("pod {name}: no {PROXY_CONTAINER}"))?;
    let image = format!("{PROXY_IMAGE}:{}", node::image_tag());
    ensure!(
        c.image.as_deref() == Some(image.as_str()),
        "pod {name}: sidecar image {:?}, want {image}",
        c.image
    );
    ensure!(
        c.command.as_deref() == Some(&["remora-agent".to_owned()][..]),
        "pod {name}: sidecar command {:?}",
        c.command
    );
    match mode {
        "Legacy" => {
            ensure!(
                place == "containers" && c.restart_policy.is_none(),
                "pod {name}: Legacy sidecar in {place}, restartPolicy {:?}",
                c.restart_policy
            );
            let hooks = c
                .lifecycle
                .as_ref()
                .context("Legacy sidecar without hooks")?;
            let cmd = |h: Option<&k8s_openapi::api::core::v1::LifecycleHandler>| {
                h.and_then(|h| h.exec.as_ref())
                    .and_then(|e| e.command.clone())
                    .unwrap_or_default()
            };
            let post = cmd(hooks.post_start.as_ref());
            let pre = cmd(hooks.pre_stop.as_ref());
            ensure!(
                post.get(..2) == Some(&["remora-agent".to_owned(), "wait".to_owned()][..]),
                "pod {name}: postStart {post:?}"
            );
            ensure!(
                pre.get(..2) == Some(&["remora-agent".to_owned(), "drain".to_owned()][..]),
                "pod {name}: preStop {pre:?}"
            );
        }
        _ => {
            ensure!(
                place == "initContainers" && c.restart_policy.as_deref() == Some("Always"),
                "pod {name}: Native sidecar in {place}, restartPolicy {:?}",
                c.restart_policy
            );
            ensure!(
                c.startup_probe.is_some(),
                "pod {name}: Native sidecar without a startupProbe"
            );
        }
    }
    let status = container_status(pod, PROXY_CONTAINER).context("no sidecar status")?;
    ensure!(
        status.ready && status.state.as_ref().is_some_and(|s| s.running.is_some()),
        "pod {name}: sidecar not running and ready: {status:?}"
    );
    ensure!(
        status.image.contains(PROXY_IMAGE),
        "pod {name}: the runtime runs image {}",
        status.image
    );
    Ok(())
}

/// The processes of a container of `pod`, seen from the host.
fn container_processes(pod: &Pod, container: &str) -> anyhow::Result<Vec<PodProcess>> {
    let id = container_status(pod, container)
        .and_then(|s| s.container_id.clone())
        .with_context(|| format!("pod {}: no containerID for {container}", pod_name(pod)))?;
    Ok(pods::pod_processes(pod_uid(pod)?)?
        .into_iter()
        .filter(|p| p.in_container(&id))
        .collect())
}

/// The one process in `procs` that `pick` selects.
fn one(
    procs: &[PodProcess],
    what: &str,
    pick: impl Fn(&PodProcess) -> bool,
) -> anyhow::Result<i32> {
    let found: Vec<&PodProcess> = procs.iter().filter(|p| pick(p)).collect();
    match found[..] {
        [p] => Ok(p.pid),
        _ => anyhow::bail!("want one {what} process, found {found:?} among {procs:?}"),
    }
}

/// (agent, Envoy) PIDs of the pod's sidecar: the agent's `run`, and the
/// Envoy binary it runs, in the sidecar's own container.
fn sidecar_pids(pod: &Pod) -> anyhow::Result<(i32, i32)> {
    let procs = container_processes(pod, PROXY_CONTAINER)?;
    let agent = one(&procs, "remora-agent run", |p| {
        p.program() == "remora-agent" && p.argv.get(1).map(String::as_str) == Some("run")
    })?;
    let envoy = one(&procs, "envoy", |p| p.program() == "envoy")?;
    Ok((agent, envoy))
}

/// First line of `lines` that is the agent's JSON event `message`.
fn event<'a>(lines: &'a [LogLine], message: &str) -> Option<&'a LogLine> {
    lines.iter().find(|l| l.is_event(message))
}

/// The app started only after its sidecar was ready: its startup call
/// through the sidecar's outbound listener succeeded (an app started before
/// Envoy listens gets connection refused; before the agent is ready, 503),
/// and its process was created after the agent logged "Envoy is ready".
/// Returns the app's start minus Envoy's readiness, in ms.
async fn check_hold(client: &Client, ns: &str, pod: &Pod) -> anyhow::Result<i64> {
    let name = pod_name(pod);
    let app = container_status(pod, APP_CONTAINER).context("no app status")?;
    // A restarted app's process is not the one that was held.
    ensure!(
        app.restart_count == 0,
        "pod {name}: app restarted {} times",
        app.restart_count
    );
    let procs = container_processes(pod, APP_CONTAINER)?;
    let app_pid = one(&procs, "test-app", |p| p.program() == "test-app")?;
    let started = pods::timestamp(pods::process_started(app_pid)?);
    let agent_log = pods::container_log(client, ns, name, PROXY_CONTAINER, false).await?;
    let ready = event(&agent_log, "Envoy is ready")
        .with_context(|| format!("pod {name}: agent never logged \"Envoy is ready\""))?
        .at;
    let app_log = pods::container_log(client, ns, name, APP_CONTAINER, false).await?;
    let want = format!("test-app: startup call {}: 200", startup_url());
    let call = app_log
        .iter()
        .find(|l| l.text == want)
        .with_context(|| format!("pod {name}: no successful startup call; app log: {app_log:?}"))?;
    ensure!(
        !app_log.iter().any(|l| l.text.contains("failed")),
        "pod {name}: app log has a failed call: {app_log:?}"
    );
    let hold = pods::ms_between(started, ready);
    ensure!(
        hold >= -TICK_TOLERANCE_MS,
        "pod {name}: app process started {} ms before Envoy was ready",
        -hold
    );
    ensure!(
        call.at >= ready,
        "pod {name}: startup call before readiness"
    );
    report(&format!(
        "  hold: pod {name}: app process started {hold} ms after the agent logged Envoy ready; its startup call through the sidecar answered 200 at +{} ms",
        pods::ms_between(call.at, ready)
    ));
    Ok(hold)
}

/// `n` requests from the host to `addr`, one connection each: all 200 from
/// the app, all through Envoy (it adds `server: envoy` and
/// `x-envoy-upstream-service-time`; the app sends neither).
async fn traffic(addr: SocketAddr, n: usize) -> anyhow::Result<Duration> {
    let t = Instant::now();
    for i in 0..n {
        let r = pods::http_get(addr, "/", Duration::from_secs(5)).await?;
        let headers = r.headers();
        ensure!(
            r.status() == 200 && r.body().starts_with("ok "),
            "request {i} to {addr}: {} {:?}",
            r.status(),
            r.body()
        );
        ensure!(
            headers.get("server").and_then(|v| v.to_str().ok()) == Some("envoy")
                && headers.contains_key("x-envoy-upstream-service-time"),
            "request {i} to {addr} did not pass Envoy: {headers:?}"
        );
    }
    Ok(t.elapsed())
}

/// What the deletion of one pod showed.
struct Deletion {
    gone: Duration,
    grace: i64,
}

/// Deletes `pod` (default grace) and follows it until it is gone: the
/// sidecar drains from the app's preStop hook (and in Legacy its own), the
/// adaptive drain ends `quiet`, the app exits only after the drain began and
/// inbound went quiet (its SIGTERM waits for the hook), the sidecar's
/// SIGTERM comes after its preStop (Legacy) or after the app exited
/// (Native), every container exits 0, and the pod is gone within its grace
/// period.
async fn check_deletion(
    client: &Client,
    ns: &TestNamespace,
    pod: &Pod,
    mode: &str,
) -> anyhow::Result<Deletion> {
    let name = pod_name(pod).to_owned();
    let uid = pod_uid(pod)?.to_owned();
    let grace = pod
        .spec
        .as_ref()
        .and_then(|s| s.termination_grace_period_seconds)
        .unwrap_or(30);
    let agent = LogFollower::start(client, ns.name(), &name, PROXY_CONTAINER).await?;
    let app = LogFollower::start(client, ns.name(), &name, APP_CONTAINER).await?;
    // A watch sees every version of the pod, so no short-lived terminated
    // state is missed between polls.
    let versions = Recording::start(ns.api::<Pod>(), Some(&format!("app={APP}"))).await?;
    let api = ns.api::<Pod>();
    let t0 = Instant::now();
    let deleted_at = pods::timestamp(SystemTime::now());
    api.delete(&name, &DeleteParams::default()).await?;
    // Polled every 150 ms (the default schedule backs off to 500 ms):
    // the time it disappears is a figure this reports.
    let limit = Duration::from_secs(u64::try_from(grace)? + 30);
    let gone =
        node::wait_pod_gone(&api, &name, &uid, t0, Duration::from_millis(150), limit).await?;
    let agent_log = agent.finish(Duration::from_secs(10)).await?;
    let app_log = app.finish(Duration::from_secs(10)).await?;

    // Exit codes, from the last version of each container's terminated state.
    let mut exits = std::collections::BTreeMap::new();
    for (_, p) in versions.versions() {
        if p.metadata.uid.as_deref() != Some(&uid) {
            continue;
        }
        for c in [PROXY_CONTAINER, APP_CONTAINER] {
            if let Some(t) = terminated(&p, c) {
                exits.insert(c, (t.exit_code, t.reason.clone().unwrap_or_default()));
            }
        }
    }
    ensure!(
        exits.len() == 2 && exits.values().all(|(code, _)| *code == 0),
        "pod {name}: container exits {exits:?}, want both 0"
    );

    let find = |lines: &[LogLine], message: &str| {
        event(lines, message)
            .map(|l| l.at)
            .with_context(|| format!("pod {name}: agent never logged {message:?}: {lines:?}"))
    };
    let drain_start = find(&agent_log, "draining inbound listeners")?;
    let drain_end = find(&agent_log, "drain finished")?;
    let signal = find(&agent_log, "signal received")?;
    let report_json: serde_json::Value = event(&agent_log, "drain finished")
        .and_then(|l| l.json())
        .and_then(|j| serde_json::from_str(j.get("report")?.as_str()?).ok())
        .context("drain finished without a report")?;
    let outcome = report_json
        .get("outcome")
        .and_then(|o| o.as_str())
        .unwrap_or("?")
        .to_owned();
    ensure!(
        outcome == "quiet",
        "pod {name}: the chart's adaptive drain ended {outcome}: {report_json}"
    );
    let app_exit = app_log
        .iter()
        .find(|l| l.text.starts_with("test-app: served") && l.text.ends_with("exiting"))
        .map(|l| l.at)
        .with_context(|| format!("pod {name}: app never logged its exit: {app_log:?}"))?;
    // The app's preStop hook holds its SIGTERM until inbound has been quiet
    // for the quiet period (the chart's default; log times are whole ms).
    let quiet = remora_contract::duration::parse(remora_contract::defaults::QUIET_PERIOD)?;
    ensure!(
        pods::ms_between(app_exit, drain_start) >= i64::try_from(quiet.as_millis())? - 100,
        "pod {name}: app exit {app_exit} less than a quiet period after the drain began {drain_start}"
    );
    if mode == "Legacy" {
        // The agent's SIGTERM comes only after its own preStop returned.
        ensure!(
            drain_end < signal,
            "pod {name}: Legacy drain {drain_start}..{drain_end}, SIGTERM {signal}, app exit {app_exit}"
        );
    } else {
        // The kubelet stops a native sidecar after the app has exited.
        ensure!(
            app_exit < signal,
            "pod {name}: Native app exit {app_exit}, SIGTERM {signal}, drain {drain_start}"
        );
    }
    ensure!(
        gone < Duration::from_secs(u64::try_from(grace)?),
        "pod {name} took {} ms to go, grace {grace} s",
        ms(gone)
    );
    let from = |t| pods::ms_between(t, deleted_at);
    report(&format!(
        "  drain: pod {name} deleted: drain started +{} ms, finished +{} ms ({outcome}, {}s), agent SIGTERM +{} ms, app exited +{} ms; gone +{} ms (grace {grace} s); exits {exits:?}",
        from(drain_start),
        from(drain_end),
        report_json
            .get("duration_seconds")
            .and_then(|d| d.as_f64())
            .unwrap_or_default(),
        from(signal),
        from(app_exit),
        ms(gone)
    ));
    Ok(Deletion { gone, grace })
}

async fn deployment(mode: &str) -> anyhow::Result<()> {
    let lower = mode.to_ascii_lowercase();
    let node = Node::for_test(&format!("deployment_{lower}")).await?;
    let client = node.client()?;
    let total = Instant::now();
    node.remora(&client).await?;
    let ns = TestNamespace::injected(node, &client, &format!("pods-{lower}")).await?;
    let (running, ip) = deploy(&client, &ns, APP, 2, mode).await?;
    ensure!(running.len() == 2, "{} pods", running.len());

    let mut holds = Vec::new();
    for pod in &running {
        check_sidecar(pod, mode)?;
        let (agent, envoy) = sidecar_pids(pod)?;
        // Every sidecar on a node runs as one user, and the kernel allows
        // a user 128 inotify instances by default: the agent shares one
        // among its watchers, Envoy's idle-close monitor takes one.
        let instances = (
            pods::inotify_instances(agent)?,
            pods::inotify_instances(envoy)?,
        );
        report(&format!(
            "  {mode}: pod {}: sidecar runs remora-agent (pid {agent}) and Envoy (pid {envoy}); inotify instances: agent {}, Envoy {}",
            pod_name(pod),
            instances.0,
            instances.1
        ));
        ensure!(
            instances.0 == 1 && instances.1 <= 1,
            "pod {}: inotify instances agent {}, Envoy {}: at most 1 each",
            pod_name(pod),
            instances.0,
            instances.1
        );
        holds.push(check_hold(&client, ns.name(), pod).await?);
    }

    let took = traffic(SocketAddr::new(ip, 80), REQUESTS).await?;
    report(&format!(
        "  {mode}: {REQUESTS} requests host → ClusterIP {ip}:80 → Envoy → app: all 200 through Envoy, {} ms",
        ms(took)
    ));

    let deletion = check_deletion(&client, &ns, &running[0], mode).await?;

    ns.delete().await?;
    let drops = node.guard_drops().await?;
    ensure!(drops == 0, "the egress guard dropped {drops} packets");
    report(&format!(
        "deployment_{lower}: hold (app start - Envoy ready) {holds:?} ms; deletion -> gone {} ms of {} s grace; whole test {} ms",
        ms(deletion.gone),
        deletion.grace,
        ms(total.elapsed())
    ));
    Ok(())
}

#[tokio::test]
#[ignore = "needs the real node: REMORA_NODE_TESTS=1 cargo test -p e2e --test node_pods -- --ignored (root, scripts/cluster.sh, scripts/images.sh)"]
async fn deployment_legacy() -> anyhow::Result<()> {
    deployment("Legacy").await
}

#[tokio::test]
#[ignore = "needs the real node: REMORA_NODE_TESTS=1 cargo test -p e2e --test node_pods -- --ignored (root, scripts/cluster.sh, scripts/images.sh)"]
async fn deployment_native() -> anyhow::Result<()> {
    deployment("Native").await
}

/// `remora_agent_envoy_restarts_total{kind="Crash"}` from the agent's
/// `/metrics` (port-forward to its loopback admin port); 0 when absent.
/// (A labelled family is exposed only once it has a series.) Also returns
/// the whole exposition, for a failure message.
async fn crash_restarts(client: &Client, ns: &str, pod: &str) -> anyhow::Result<(f64, String)> {
    let (status, body) = node::pod_http_get(client, ns, pod, AGENT_ADMIN_PORT, "/metrics").await?;
    ensure!(status == 200, "GET /metrics: {status}: {body}");
    let n = pods::prometheus_value(&body, r#"remora_agent_envoy_restarts_total{kind="Crash"}"#)
        .unwrap_or(0.0);
    Ok((n, body))
}

/// The first version of the pod recorded after `since` for which `pred`
/// holds, as time since `since`.
fn first_after(
    versions: &Recording<Pod>,
    since: Instant,
    pred: impl Fn(&Pod) -> bool,
) -> Option<Duration> {
    versions
        .versions()
        .into_iter()
        .find(|(t, p)| *t >= since && pred(p))
        .map(|(t, _)| t - since)
}

/// The sidecar's failure paths, in Native mode: what `Auto` (the chart's
/// default) picks on this API server, so the kind of pod users get here.
/// Envoy killed: the agent restarts it inside the container. The agent
/// killed: the kubelet restarts the sidecar container, the app untouched.
#[tokio::test]
#[ignore = "needs the real node: REMORA_NODE_TESTS=1 cargo test -p e2e --test node_pods -- --ignored (root, scripts/cluster.sh, scripts/images.sh)"]
async fn sidecar_crash() -> anyhow::Result<()> {
    let node = Node::for_test("sidecar_crash").await?;
    let client = node.client()?;
    let total = Instant::now();
    node.remora(&client).await?;
    let ns = TestNamespace::injected(node, &client, "pods-crash").await?;
    let name = "crash";
    let (running, ip) = deploy(&client, &ns, name, 1, "Native").await?;
    let pod = running.first().context("no pod")?.clone();
    let pod_name = pod_name(&pod).to_owned();
    let uid = pod_uid(&pod)?.to_owned();
    let inbound = SocketAddr::new(pod_ip(&pod)?, INBOUND_PORT);
    let health = SocketAddr::new(pod_ip(&pod)?, HEALTH_PORT);
    check_sidecar(&pod, "Native")?;
    let (before, _) = crash_restarts(&client, ns.name(), &pod_name).await?;
    let versions = Recording::start(ns.api::<Pod>(), Some(&format!("app={name}"))).await?;
    let same_pod = |p: &Pod| p.metadata.uid.as_deref() == Some(uid.as_str());
    let restarts = |p: &Pod, c: &str| container_status(p, c).map(|s| s.restart_count);

    // 1. SIGKILL Envoy: the agent sees it exit abnormally and starts it again.
    let (agent_pid, envoy_pid) = sidecar_pids(&pod)?;
    let agent_log = LogFollower::start(&client, ns.name(), &pod_name, PROXY_CONTAINER).await?;
    let t = Instant::now();
    let killed_at = pods::timestamp(SystemTime::now());
    pods::signal(envoy_pid, Signal::SIGKILL)?;
    let new_envoy = wait_until(
        Duration::from_secs(60),
        "a new Envoy in the sidecar, the agent ready again",
        || async {
            let pod = ns.api::<Pod>().get(&pod_name).await?;
            let (agent, envoy) = match sidecar_pids(&pod) {
                Ok(p) => p,
                Err(e) => return Ok::<_, anyhow::Error>(Check::NotYet(e.to_string())),
            };
            if envoy == envoy_pid {
                return Ok(Check::NotYet("the killed Envoy is still listed".into()));
            }
            let ok = pods::http_get(health, "/healthz/ready", Duration::from_secs(2))
                .await
                .map(|r| r.status() == 200);
            Ok(match ok {
                Ok(true) if is_ready(&pod) => Check::Done((agent, envoy)),
                other => Check::NotYet(format!("agent ready: {other:?}")),
            })
        },
    )
    .await?;
    let waited = t.elapsed();
    ensure!(
        new_envoy.0 == agent_pid,
        "the agent changed ({agent_pid} → {}): it should have survived Envoy's death",
        new_envoy.0
    );
    // The followed log runs behind the readiness answer: wait until it has
    // the restart and the readiness after it.
    let lines = wait_until(
        Duration::from_secs(10),
        "the agent's log of the restart and of readiness after it",
        || async {
            let lines = agent_log.lines();
            let logged = lines
                .iter()
                .find(|l| l.is_event("Envoy exited abnormally; restarting") && l.at >= killed_at)
                .is_some_and(|e| {
                    lines
                        .iter()
                        .any(|l| l.is_event("Envoy is ready") && l.at > e.at)
                });
            Ok::<_, anyhow::Error>(if logged {
                Check::Done(lines)
            } else {
                Check::NotYet(format!("{} lines so far", lines.len()))
            })
        },
    )
    .await?;
    let exited = lines
        .iter()
        .find(|l| l.is_event("Envoy exited abnormally; restarting") && l.at >= killed_at)
        .with_context(|| format!("the agent logged no restart: {lines:?}"))?;
    ensure!(
        exited.text.contains("SIGKILL"),
        "restart reason: {}",
        exited.text
    );
    let ready_again = lines
        .iter()
        .find(|l| l.is_event("Envoy is ready") && l.at > exited.at)
        .context("the agent logged no readiness after the restart")?
        .at;
    let (after, metrics) = crash_restarts(&client, ns.name(), &pod_name).await?;
    ensure!(
        after == before + 1.0,
        "crash restarts in /metrics {before} → {after}, want +1:\n{metrics}"
    );
    let now = ns.api::<Pod>().get(&pod_name).await?;
    ensure!(
        restarts(&now, PROXY_CONTAINER) == Some(0) && restarts(&now, APP_CONTAINER) == Some(0),
        "restart counts changed after an Envoy crash: sidecar {:?}, app {:?}",
        restarts(&now, PROXY_CONTAINER),
        restarts(&now, APP_CONTAINER)
    );
    let unready_seen = versions
        .versions()
        .iter()
        .any(|(at, p)| *at >= t && same_pod(p) && !is_ready(p));
    traffic(inbound, 10).await?;
    wait_serving(&client, &ns, name, 1, ip, "after Envoy's restart").await?;
    traffic(SocketAddr::new(ip, 80), 10).await?;
    let envoy_ms = pods::ms_between(ready_again, killed_at);
    report(&format!(
        "  Envoy SIGKILLed (pid {envoy_pid}): the agent logged it at +{} ms, Envoy ready again (pid {}) at +{envoy_ms} ms; kubelet saw the pod unready: {unready_seen}; restartCount 0, /metrics crash restarts {before} → {after}; condition met after {} ms; traffic OK",
        pods::ms_between(exited.at, killed_at),
        new_envoy.1,
        ms(waited)
    ));
    drop(agent_log);

    // 2. SIGKILL the agent: the container ends (exit 137) and the kubelet
    // restarts it; the app keeps running.
    let t = Instant::now();
    pods::signal(agent_pid, Signal::SIGKILL)?;
    let restarted = wait_until(
        Duration::from_secs(60),
        "the sidecar restarted by the kubelet, the pod Ready",
        || async {
            let pod = ns.api::<Pod>().get(&pod_name).await?;
            let sidecar = container_status(&pod, PROXY_CONTAINER).cloned();
            Ok::<_, anyhow::Error>(match sidecar {
                Some(s) if s.restart_count == 1 && s.ready && is_ready(&pod) => Check::Done(pod),
                s => Check::NotYet(format!(
                    "sidecar restarts {:?} ready {:?}, pod ready {}",
                    s.as_ref().map(|s| s.restart_count),
                    s.as_ref().map(|s| s.ready),
                    is_ready(&pod)
                )),
            })
        },
    )
    .await?;
    let agent_ms = first_after(&versions, t, |p| {
        same_pod(p) && is_ready(p) && restarts(p, PROXY_CONTAINER) == Some(1)
    })
    .unwrap_or_else(|| t.elapsed());
    let unready_after = first_after(&versions, t, |p| same_pod(p) && !is_ready(p));
    let last = container_status(&restarted, PROXY_CONTAINER)
        .and_then(|s| s.last_state.as_ref())
        .and_then(|s| s.terminated.as_ref())
        .context("no terminated lastState of the sidecar")?;
    ensure!(
        last.exit_code == 137,
        "the killed agent's container exited {} ({:?})",
        last.exit_code,
        last.reason
    );
    ensure!(
        restarts(&restarted, APP_CONTAINER) == Some(0),
        "the app restarted with its sidecar: {:?}",
        restarts(&restarted, APP_CONTAINER)
    );
    let (new_agent, new_envoy) = sidecar_pids(&restarted)?;
    ensure!(new_agent != agent_pid, "the agent process did not change");
    traffic(inbound, 10).await?;
    // The pod was unready for a moment: its endpoint comes back asynchronously.
    wait_serving(&client, &ns, name, 1, ip, "after the agent's restart").await?;
    traffic(SocketAddr::new(ip, 80), 10).await?;
    report(&format!(
        "  agent SIGKILLed (pid {agent_pid}): container exit 137, kubelet unready after {:?} ms, restartCount 1 and Ready after {} ms (new agent {new_agent}, Envoy {new_envoy}); app restartCount 0; traffic OK",
        unready_after.map(ms),
        ms(agent_ms)
    ));

    ns.delete().await?;
    let drops = node.guard_drops().await?;
    ensure!(drops == 0, "the egress guard dropped {drops} packets");
    report(&format!(
        "sidecar_crash: envoy kill -> ready {envoy_ms} ms (kubelet stayed Ready: {}); agent kill -> Ready {} ms; whole test {} ms",
        !unready_seen,
        ms(agent_ms),
        ms(total.elapsed())
    ));
    Ok(())
}

/// Issue 27, item 4, on the real node: what used to drain a pod for good
/// from off the pod. The pod spec carries no drain credential any more (the
/// app hook is an exec of the helper in the hook volume), and the pod's
/// health port, reached from the host as any peer on the pod network would,
/// has no drain endpoint: the sidecar stays ready.
#[tokio::test]
#[ignore = "needs the real node: REMORA_NODE_TESTS=1 cargo test -p e2e --test node_pods -- --ignored (root, scripts/cluster.sh, scripts/images.sh)"]
async fn drain_attempts_from_off_the_pod_change_nothing() -> anyhow::Result<()> {
    let node = Node::for_test("drain_attempts_from_off_the_pod").await?;
    let client = node.client()?;
    node.remora(&client).await?;
    let ns = TestNamespace::injected(node, &client, "pods-drain-guard").await?;
    let name = "guarded";
    let (running, _) = deploy(&client, &ns, name, 1, "Native").await?;
    let pod = running.first().context("no pod")?.clone();
    let spec = serde_json::to_string(&pod)?;
    for secret in ["x-remora-drain-token", "REMORA_DRAIN_TOKEN", "httpHeaders"] {
        ensure!(
            !spec.contains(secret),
            "the pod spec holds {secret}: {spec}"
        );
    }
    let app = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.iter().find(|c| c.name == APP_CONTAINER))
        .context("no app container")?;
    let hook = app
        .lifecycle
        .as_ref()
        .and_then(|l| l.pre_stop.as_ref())
        .and_then(|h| h.exec.as_ref())
        .and_then(|e| e.command.clone())
        .unwrap_or_default();
    ensure!(
        hook == [remora_contract::pod::HOOK_HELPER_PATH],
        "app preStop: {hook:?}"
    );

    let health = SocketAddr::new(pod_ip(&pod)?, HEALTH_PORT);
    let path = remora_contract::pod::APP_PRESTOP_PATH;
    let r = pods::http_get(health, path, Duration::from_secs(5)).await?;
    ensure!(
        r.status() == 404,
        "GET {path} from the host: {}",
        r.status()
    );
    // Readiness fails at once when a drain starts: it is still 200.
    let r = pods::http_get(health, "/healthz/ready", Duration::from_secs(5)).await?;
    ensure!(r.status() == 200, "ready after the attempt: {}", r.status());
    let now = ns.api::<Pod>().get(pod_name(&pod)).await?;
    ensure!(is_ready(&now), "the pod is not Ready");
    report("  drain attempt from the host: 404, the sidecar stays ready");
    ns.delete().await?;
    Ok(())
}
