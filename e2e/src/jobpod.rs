//! The kubelet's part for one Legacy-injected Job pod, with real processes:
//! binds the pod to a [`FakeKubelet`] node, runs the sidecar (the real
//! `remora-agent`, which runs the real Envoy) and the app containers (their
//! own `command`/`args`, e.g. `sh -c 'sleep 0.5'`), reports each container's
//! state to the API server as it changes, keeps the downward-API annotations
//! file in sync with the pod from a watch (written like the kubelet's atomic
//! writer: a new `..<timestamp>` directory, then the `..data` symlink
//! swapped), and completes the pod (`Succeeded`/`Failed`) once every
//! container has terminated. The timeline it returns is what the jobs
//! bench reports.
//!
//! Differences from the kubelet: the annotations file is rewritten as soon as
//! the watch shows a change (the kubelet does it on its next sync of the
//! pod, seconds later); containers are never restarted (a failed app under
//! `OnFailure` stays terminated with its code); the Legacy hold (postStart
//! `remora-agent wait`) is a readiness poll of the agent before the apps start.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{
    Container, ContainerState, ContainerStateRunning, ContainerStateTerminated,
    ContainerStateWaiting, ContainerStatus, Pod, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, WatchEvent, WatchParams};
use kube::{Api, Client};
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::controlplane::FakeKubelet;

/// The sidecar's container name (DESIGN.md).
pub const PROXY: &str = "remora-proxy";
/// The annotation the operator sets to stop the sidecar.
pub const STOP_ANNOTATION: &str = "remora.dev/stop";

#[derive(Debug, thiserror::Error)]
pub enum JobPodError {
    #[error(transparent)]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    ControlPlane(#[from] crate::controlplane::Error),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("pod {0} has no {PROXY} among its containers (not injected in Legacy mode)")]
    NotLegacy(String),
    #[error("pod {0} has no spec")]
    NoSpec(String),
    #[error("container {0} has no command")]
    NoCommand(String),
    #[error("the sidecar was not ready within {0:?}; its log ends with:\n{1}")]
    NotReady(Duration, String),
    #[error("pod {pod} still running after {timeout:?}")]
    Timeout { pod: String, timeout: Duration },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> JobPodError {
    let what = what.into();
    move |source| JobPodError::Io { what, source }
}

/// What plays the images.
#[derive(Debug, Clone)]
pub struct JobPodOptions {
    pub agent_bin: PathBuf,
    pub envoy_bin: PathBuf,
    /// Where the pod's directory (logs, run dir, podinfo) is made.
    pub base_dir: PathBuf,
    /// Give up (and kill everything) after this long.
    pub timeout: Duration,
}

/// When things happened, on this process's monotonic clock.
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    /// The sidecar was ready and the apps started.
    pub apps_started: Option<Instant>,
    /// The last app container's process exited.
    pub last_app_exit: Option<Instant>,
    /// The watch showed `remora.dev/stop` on the pod.
    pub stop_seen: Option<Instant>,
    /// The annotations file carrying it was in place.
    pub stop_written: Option<Instant>,
    /// The sidecar's process exited.
    pub sidecar_exit: Option<Instant>,
    /// The API server accepted the pod's final phase.
    pub completed: Option<Instant>,
}

/// How the pod ended.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub pod: String,
    /// Exit code of each container (128+N when killed by signal N).
    pub exit_codes: BTreeMap<String, i32>,
    /// `Succeeded` or `Failed`.
    pub phase: String,
    pub timeline: Timeline,
    pub dir: PathBuf,
}

/// The pod's annotations in the downward API's `key="value"` format.
pub fn render_annotations(ann: &BTreeMap<String, String>) -> String {
    // JSON string escaping matches Go's strconv.Quote for what annotations hold.
    ann.iter()
        .map(|(k, v)| format!("{k}={}\n", serde_json::Value::String(v.clone())))
        .collect()
}

/// Write the downward-API `annotations` file into `dir` the way the
/// kubelet's atomic writer does.
fn write_annotations(dir: &Path, text: &str) -> std::io::Result<()> {
    remora_test_support::kubelet::atomic_write(dir, [("annotations", text)]).map(|_| ())
}

fn running(now: &Time) -> ContainerState {
    ContainerState {
        running: Some(ContainerStateRunning {
            started_at: Some(now.clone()),
        }),
        ..ContainerState::default()
    }
}

fn waiting(reason: &str) -> ContainerState {
    ContainerState {
        waiting: Some(ContainerStateWaiting {
            reason: Some(reason.into()),
            ..ContainerStateWaiting::default()
        }),
        ..ContainerState::default()
    }
}

fn terminated(code: i32, now: &Time) -> ContainerState {
    ContainerState {
        terminated: Some(ContainerStateTerminated {
            exit_code: code,
            reason: Some(if code == 0 { "Completed" } else { "Error" }.into()),
            finished_at: Some(now.clone()),
            ..ContainerStateTerminated::default()
        }),
        ..ContainerState::default()
    }
}

fn exit_code(s: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    s.code()
        .or_else(|| s.signal().map(|n| 128 + n))
        .unwrap_or(1)
}

/// Kills the container's process group when dropped (a container's cgroup).
struct Proc {
    name: String,
    child: Child,
    pgid: i32,
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.pgid > 0 {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(self.pgid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

struct Bridge {
    api: Api<Pod>,
    pod: String,
    statuses: Vec<ContainerStatus>,
}

impl Bridge {
    fn set(&mut self, name: &str, state: ContainerState, ready: bool) {
        if let Some(s) = self.statuses.iter_mut().find(|s| s.name == name) {
            s.started = Some(state.running.is_some());
            s.state = Some(state);
            s.ready = ready;
        }
    }

    async fn report(&self, phase: &str) -> Result<(), JobPodError> {
        let status = PodStatus {
            phase: Some(phase.into()),
            host_ip: Some("127.0.0.1".into()),
            pod_ip: Some("127.0.0.1".into()),
            container_statuses: Some(self.statuses.clone()),
            ..PodStatus::default()
        };
        self.api
            .patch_status(
                &self.pod,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "status": status })),
            )
            .await?;
        Ok(())
    }
}

/// The env of a container on this host: literal values, and the downward-API
/// fields the operator uses.
fn container_env(c: &Container, ns: &str, pod: &str) -> Vec<(String, String)> {
    c.env
        .iter()
        .flatten()
        .map(|e| {
            let v = match (
                &e.value,
                e.value_from.as_ref().and_then(|f| f.field_ref.as_ref()),
            ) {
                (Some(v), _) => v.clone(),
                (None, Some(f)) => match f.field_path.as_str() {
                    "metadata.name" => pod.to_owned(),
                    "metadata.namespace" => ns.to_owned(),
                    "status.podIP" | "status.hostIP" => "127.0.0.1".into(),
                    "spec.serviceAccountName" => "default".into(),
                    _ => String::new(),
                },
                _ => String::new(),
            };
            (e.name.clone(), v)
        })
        .collect()
}

fn spawn(
    name: &str,
    bin: &Path,
    args: &[String],
    env: &[(String, String)],
    dir: &Path,
) -> Result<Proc, JobPodError> {
    let log = std::fs::File::create(dir.join(format!("{name}.log")))
        .map_err(io(format!("{name}.log")))?;
    let err = log.try_clone().map_err(io("log file"))?;
    let child = Command::new(bin)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(io(format!("starting {name} ({})", bin.display())))?;
    let pgid = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
    Ok(Proc {
        name: name.to_owned(),
        child,
        pgid,
    })
}

/// Keep `<podinfo>/annotations` equal to the pod's annotations, from a watch
/// of that one pod; note when the stop annotation first shows up.
async fn sync_annotations(
    api: Api<Pod>,
    pod: String,
    podinfo: PathBuf,
    mut last: String,
    stop: watch::Sender<Option<(Instant, Instant)>>,
) {
    let mut version = "0".to_owned();
    loop {
        let wp = WatchParams::default()
            .fields(&format!("metadata.name={pod}"))
            .timeout(60);
        let stream = match api.watch(&wp, &version).await {
            Ok(s) => s,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let mut stream = std::pin::pin!(stream);
        while let Some(ev) = stream.next().await {
            let p = match ev {
                Ok(WatchEvent::Added(p) | WatchEvent::Modified(p)) => p,
                Ok(WatchEvent::Error(_)) => {
                    // Too old a version: start over from the current state.
                    version = "0".to_owned();
                    break;
                }
                Ok(_) => continue,
                Err(_) => break,
            };
            if let Some(v) = p.metadata.resource_version.clone() {
                version = v;
            }
            let ann = p.metadata.annotations.clone().unwrap_or_default();
            let seen = Instant::now();
            let text = render_annotations(&ann);
            if text != last && write_annotations(&podinfo, &text).is_ok() {
                last = text;
            }
            if ann.contains_key(STOP_ANNOTATION) && stop.borrow().is_none() {
                stop.send_replace(Some((seen, Instant::now())));
            }
        }
    }
}

/// Run pod `ns/pod` (created by the API server, injected in Legacy mode)
/// until it completes. `kubelet` is the node it is bound to.
pub async fn run(
    client: Client,
    kubelet: &FakeKubelet,
    ns: &str,
    pod: &str,
    opts: &JobPodOptions,
) -> Result<Outcome, JobPodError> {
    let api: Api<Pod> = Api::namespaced(client, ns);
    kubelet.bind(ns, pod).await?;
    let current = api.get(pod).await?;
    let spec = current
        .spec
        .clone()
        .ok_or_else(|| JobPodError::NoSpec(pod.to_owned()))?;
    let sidecar = spec
        .containers
        .iter()
        .find(|c| c.name == PROXY)
        .cloned()
        .ok_or_else(|| JobPodError::NotLegacy(pod.to_owned()))?;
    let apps: Vec<Container> = spec
        .containers
        .iter()
        .filter(|c| c.name != PROXY)
        .cloned()
        .collect();

    let dir = opts.base_dir.join(pod);
    let podinfo = dir.join("podinfo");
    std::fs::create_dir_all(&podinfo).map_err(io("creating the pod directory"))?;
    std::fs::create_dir_all(dir.join("run")).map_err(io("creating the run directory"))?;
    let text = render_annotations(&current.metadata.annotations.clone().unwrap_or_default());
    write_annotations(&podinfo, &text).map_err(io("writing annotations"))?;
    let (stop_tx, stop_rx) = watch::channel(None);
    let syncer = tokio::spawn(sync_annotations(
        api.clone(),
        pod.to_owned(),
        podinfo.clone(),
        text,
        stop_tx,
    ));
    // Aborted however this function ends.
    let _syncer = AbortOnDrop(syncer);

    let mut bridge = Bridge {
        api: api.clone(),
        pod: pod.to_owned(),
        statuses: spec
            .containers
            .iter()
            .map(|c| ContainerStatus {
                name: c.name.clone(),
                image: c.image.clone().unwrap_or_default(),
                state: Some(waiting("ContainerCreating")),
                ..ContainerStatus::default()
            })
            .collect(),
    };
    let result = tokio::time::timeout(
        opts.timeout,
        drive(
            &mut bridge,
            &sidecar,
            &apps,
            &dir,
            &podinfo,
            ns,
            pod,
            opts,
            stop_rx,
        ),
    )
    .await;
    match result {
        Ok(r) => r,
        Err(_) => Err(JobPodError::Timeout {
            pod: format!("{ns}/{pod}"),
            timeout: opts.timeout,
        }),
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[allow(clippy::too_many_arguments)]
async fn drive(
    bridge: &mut Bridge,
    sidecar: &Container,
    apps: &[Container],
    dir: &Path,
    podinfo: &Path,
    ns: &str,
    pod: &str,
    opts: &JobPodOptions,
    mut stop_rx: watch::Receiver<Option<(Instant, Instant)>>,
) -> Result<Outcome, JobPodError> {
    let mut timeline = Timeline::default();
    let port = || crate::podrunner::free_port().map_err(io("picking a port"));
    let health = port()?;
    let mut env = container_env(sidecar, ns, pod);
    env.extend([
        (
            "REMORA_ENVOY_BIN".into(),
            opts.envoy_bin.display().to_string(),
        ),
        (
            "REMORA_RUN_DIR".into(),
            dir.join("run").display().to_string(),
        ),
        (
            "REMORA_ANNOTATIONS_FILE".into(),
            podinfo.join("annotations").display().to_string(),
        ),
        ("REMORA_ENVOY_ADMIN_PORT".into(), port()?.to_string()),
        ("REMORA_ADMIN_PORT".into(), port()?.to_string()),
        ("REMORA_HEALTH_PORT".into(), health.to_string()),
        ("REMORA_HEALTH_ADDRESS".into(), "127.0.0.1".into()),
        ("REMORA_STATS_PORT".into(), port()?.to_string()),
        ("REMORA_CONCURRENCY".into(), "1".into()),
        // The hook volume the sidecar fills (a Job's apps get no preStop).
        (
            "REMORA_HOOK_DIR".into(),
            dir.join("hook").display().to_string(),
        ),
    ]);
    std::fs::create_dir_all(dir.join("hook")).map_err(io("the hook dir"))?;
    // `remora-agent run`: the image's binary is the agent built here.
    let args: Vec<String> = sidecar
        .command
        .iter()
        .flatten()
        .skip(1)
        .chain(sidecar.args.iter().flatten())
        .cloned()
        .collect();
    let mut procs = vec![spawn(PROXY, &opts.agent_bin, &args, &env, dir)?];
    let now = Time(Timestamp::now());
    bridge.set(PROXY, running(&now), false);
    bridge.report("Running").await?;

    // The Legacy hold: the apps start once the sidecar is ready.
    let url = format!("http://127.0.0.1:{health}/healthz/ready");
    let http = remora_agent::http_client::HttpClient::new(Duration::from_secs(1));
    let ready_by = Instant::now() + Duration::from_secs(30);
    loop {
        if matches!(http.get(&url).await, Ok(r) if r.status == 200) {
            break;
        }
        if let Ok(Some(_)) = procs[0].child.try_wait() {
            break;
        }
        if Instant::now() > ready_by {
            let log = std::fs::read_to_string(dir.join(format!("{PROXY}.log"))).unwrap_or_default();
            return Err(JobPodError::NotReady(Duration::from_secs(30), log));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bridge.set(PROXY, running(&now), true);
    for app in apps {
        let cmd: Vec<String> = app
            .command
            .iter()
            .flatten()
            .chain(app.args.iter().flatten())
            .cloned()
            .collect();
        let (bin, args) = cmd
            .split_first()
            .ok_or_else(|| JobPodError::NoCommand(app.name.clone()))?;
        let env = container_env(app, ns, pod);
        procs.push(spawn(&app.name, Path::new(bin), args, &env, dir)?);
        bridge.set(&app.name, running(&Time(Timestamp::now())), true);
    }
    timeline.apps_started = Some(Instant::now());
    bridge.report("Running").await?;

    let mut exit_codes = BTreeMap::new();
    let mut left: Vec<Proc> = procs;
    let mut stop_open = true;
    while !left.is_empty() {
        // Whichever container exits first.
        let (i, status) = {
            let waits = left
                .iter_mut()
                .map(|p| Box::pin(p.child.wait()))
                .collect::<Vec<_>>();
            let (status, i, _) = tokio::select! {
                r = futures::future::select_all(waits) => r,
                r = stop_rx.changed(), if stop_open => {
                    stop_open = r.is_ok();
                    if let Some((seen, written)) = *stop_rx.borrow() {
                        timeline.stop_seen = Some(seen);
                        timeline.stop_written = Some(written);
                    }
                    continue;
                }
            };
            (i, status.map_err(io("waiting for a container"))?)
        };
        let at = Instant::now();
        let proc = left.remove(i);
        let code = exit_code(status);
        exit_codes.insert(proc.name.clone(), code);
        if proc.name == PROXY {
            timeline.sidecar_exit = Some(at);
        } else if left.iter().all(|p| p.name == PROXY) {
            timeline.last_app_exit = Some(at);
        }
        bridge.set(&proc.name, terminated(code, &Time(Timestamp::now())), false);
        drop(proc);
        if !left.is_empty() {
            bridge.report("Running").await?;
        }
    }
    if timeline.stop_seen.is_none()
        && let Some((seen, written)) = *stop_rx.borrow()
    {
        timeline.stop_seen = Some(seen);
        timeline.stop_written = Some(written);
    }
    let phase = if exit_codes.values().all(|c| *c == 0) {
        "Succeeded"
    } else {
        "Failed"
    };
    bridge.report(phase).await?;
    timeline.completed = Some(Instant::now());
    Ok(Outcome {
        pod: format!("{ns}/{pod}"),
        exit_codes,
        phase: phase.to_owned(),
        timeline,
        dir: dir.to_path_buf(),
    })
}

/// A namespace labelled for injection, `remora-operator serve` running
/// against it with `operator_args` ([`crate::webhook::Setup`]), and a fake
/// node to bind pods to.
pub struct JobsEnv {
    pub client: Client,
    pub namespace: String,
    pub kubelet: FakeKubelet,
    /// The namespaces, the operator and its webhook configuration.
    pub setup: crate::webhook::Setup,
}

#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    #[error(transparent)]
    ControlPlane(#[from] crate::controlplane::Error),
    #[error(transparent)]
    Kube(#[from] kube::Error),
    #[error("setting up the operator as a webhook: {0}")]
    Setup(#[from] crate::webhook::SetupError),
}

impl JobsEnv {
    pub async fn start(
        cp: &crate::controlplane::ControlPlane,
        prefix: &str,
        operator_args: &[&str],
    ) -> Result<Self, EnvError> {
        let client = cp.client()?;
        // Before the operator starts, with a kubelet version: the operator's
        // `Auto`/`Native` decision reads the nodes' kubelet versions, and an
        // unversioned node would turn Native requests into Legacy.
        let kubelet = FakeKubelet::register(client.clone(), "jobs-node").await?;
        Api::<k8s_openapi::api::core::v1::Node>::all(client.clone())
            .patch_status(
                kubelet.node(),
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"status": {"nodeInfo": {
                    "kubeletVersion": crate::controlplane::K8S_VERSION,
                    "machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "",
                    "osImage": "", "containerRuntimeVersion": "", "kubeProxyVersion": "",
                    "operatingSystem": "linux", "architecture": "amd64",
                }}})),
            )
            .await?;
        let args: Vec<String> = operator_args.iter().map(|s| (*s).to_owned()).collect();
        let setup = crate::webhook::Setup::with(prefix, "Fail", |o| o.args = args).await?;
        Ok(Self {
            client,
            namespace: setup.enabled.clone(),
            kubelet,
            setup,
        })
    }

    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    pub fn jobs(&self) -> Api<k8s_openapi::api::batch::v1::Job> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Creates `job` and waits for the pod the Job controller makes for it.
    pub async fn create_job(
        &self,
        job: &k8s_openapi::api::batch::v1::Job,
    ) -> Result<String, EnvError> {
        self.jobs()
            .create(&kube::api::PostParams::default(), job)
            .await?;
        let name = job.metadata.name.clone().unwrap_or_default();
        let lp = kube::api::ListParams::default().labels(&format!("job-name={name}"));
        let pods = self.pods();
        let pod = remora_test_support::wait::wait_until(
            Duration::from_secs(60),
            "the Job's pod",
            || async {
                let list = pods.list(&lp).await?;
                Ok::<_, crate::controlplane::Error>(
                    list.items.first().and_then(|p| p.metadata.name.clone()),
                )
            },
        )
        .await?;
        Ok(pod)
    }

    /// Waits until the Job has condition `type_` (`Complete`, `Failed`).
    pub async fn wait_job(
        &self,
        name: &str,
        type_: &str,
        timeout: Duration,
    ) -> Result<(), EnvError> {
        let jobs = self.jobs();
        remora_test_support::wait::wait_until(
            timeout,
            &format!("Job {name} to be {type_}"),
            || async {
                let j = jobs.get(name).await?;
                let done = j
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == type_ && c.status == "True");
                Ok::<_, crate::controlplane::Error>(done.then_some(()))
            },
        )
        .await?;
        Ok(())
    }

    /// Removes the webhook configuration and the namespaces.
    pub async fn cleanup(self, _cp: &crate::controlplane::ControlPlane) -> Result<(), EnvError> {
        Ok(self.setup.cleanup().await?)
    }
}

/// A Job of one pod whose app container runs `sh -c script`.
pub fn job(
    name: &str,
    restart_policy: &str,
    script: &str,
    annotations: &[(&str, &str)],
) -> k8s_openapi::api::batch::v1::Job {
    let annotations: BTreeMap<&str, &str> = annotations.iter().copied().collect();
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"annotations": annotations},
                "spec": {
                    "restartPolicy": restart_policy,
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "app",
                        "image": "registry.invalid/app:1",
                        "command": ["sh", "-c", script],
                    }],
                },
            },
        },
    }))
    .unwrap_or_default()
}

/// The agent binary: `$REMORA_AGENT_BIN`, else `target/<profile>/remora-agent`
/// next to the running test or bench binary.
pub fn agent_bin() -> Result<PathBuf, JobPodError> {
    remora_test_support::bins::workspace_bin("remora-agent", "REMORA_AGENT_BIN").map_err(|e| {
        JobPodError::Io {
            what: format!("{e} (cargo build -p remora-agent, or set REMORA_AGENT_BIN)"),
            source: std::io::ErrorKind::NotFound.into(),
        }
    })
}
