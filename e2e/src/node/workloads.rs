//! Jobs, CronJobs and Deployments under a SidecarLifecycle on the node
//! (`node_workloads.rs`): object histories stamped with the host clock,
//! container and Job conditions, an agent's `/debug/config`, rollouts.

use super::*;
use futures::StreamExt as _;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::{Job, JobCondition};
use k8s_openapi::api::core::v1::{ContainerStateTerminated, ContainerStatus};
use remora_contract::lifecycle::SidecarStatus;

/// Every version of some objects that a watch delivered, each stamped
/// with the host's clock when it arrived: "when did the pod first show
/// X" with millisecond resolution, where the API's own timestamps have
/// whole seconds. The watch stops when the recording is dropped.
pub struct Recording<K> {
    seen: Arc<Mutex<Vec<(Instant, K)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl<K> Recording<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    /// Starts recording the objects of `api` (with the label selector
    /// `labels`, if any); returns once the first list is in, so nothing
    /// created afterwards is missed.
    pub async fn start(api: Api<K>, labels: Option<&str>) -> Result<Self, Error> {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (ready, listed) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(follow(api, labels.map(str::to_owned), seen.clone(), ready));
        if tokio::time::timeout(Duration::from_secs(30), listed)
            .await
            .is_err()
        {
            task.abort();
            return Err(Error::Failed {
                what: "starting a watch recording".into(),
                detail: "the first list did not come back in 30 s".into(),
            });
        }
        Ok(Self { seen, task })
    }

    /// When a version for which `pred` holds first arrived.
    pub fn first(&self, pred: impl Fn(&K) -> bool) -> Option<Instant> {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|(_, k)| pred(k))
            .map(|(t, _)| *t)
    }

    /// Every version so far, oldest first.
    pub fn versions(&self) -> Vec<(Instant, K)> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl<K> Drop for Recording<K> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// kube's watcher (list, then watch; relists after an expired version,
/// backing off on errors): every object it delivers, deletions included.
async fn follow<K>(
    api: Api<K>,
    labels: Option<String>,
    seen: Arc<Mutex<Vec<(Instant, K)>>>,
    ready: tokio::sync::oneshot::Sender<()>,
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    use kube::runtime::WatchStreamExt as _;
    use kube::runtime::watcher::{self, Event};
    let mut config = watcher::Config::default();
    if let Some(l) = &labels {
        config = config.labels(l);
    }
    let mut ready = Some(ready);
    let events = watcher::watcher(api, config).default_backoff();
    let mut events = std::pin::pin!(events);
    while let Some(event) = events.next().await {
        let k = match event {
            Ok(Event::Apply(k) | Event::InitApply(k) | Event::Delete(k)) => k,
            Ok(Event::InitDone) => {
                if let Some(tx) = ready.take() {
                    let _ = tx.send(());
                }
                continue;
            }
            Ok(Event::Init) | Err(_) => continue,
        };
        seen.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((Instant::now(), k));
    }
}

/// The status of container `name`, regular or init (a native sidecar).
pub fn container_status<'a>(pod: &'a Pod, name: &str) -> Option<&'a ContainerStatus> {
    let status = pod.status.as_ref()?;
    status
        .container_statuses
        .iter()
        .flatten()
        .chain(status.init_container_statuses.iter().flatten())
        .find(|c| c.name == name)
}

/// How container `name` ended, once it has.
pub fn terminated<'a>(pod: &'a Pod, name: &str) -> Option<&'a ContainerStateTerminated> {
    container_status(pod, name)?
        .state
        .as_ref()?
        .terminated
        .as_ref()
}

/// The Job's condition `type_` when it is `True`.
pub fn job_condition<'a>(job: &'a Job, type_: &str) -> Option<&'a JobCondition> {
    job.status
        .as_ref()?
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == type_ && c.status == "True")
}

/// `remora.dev/status` of an injected pod.
pub fn sidecar_status(pod: &Pod) -> Option<SidecarStatus> {
    let raw = pod
        .metadata
        .annotations
        .as_ref()?
        .get(remora_contract::annotations::STATUS)?;
    serde_json::from_str(raw).ok()
}

/// The agent's `GET /debug/config` (flags, the drain settings in force,
/// Envoy's state), through the API server's port-forward.
pub async fn agent_debug_config(
    client: &Client,
    namespace: &str,
    pod: &str,
) -> Result<serde_json::Value, Error> {
    let (status, body) = pod_http_get(
        client,
        namespace,
        pod,
        remora_contract::pod::AGENT_ADMIN_PORT,
        "/debug/config",
    )
    .await?;
    let failed = |detail: String| Error::Failed {
        what: format!("GET /debug/config of {namespace}/{pod}"),
        detail,
    };
    if !status.is_success() {
        return Err(failed(format!("{status}: {body}")));
    }
    serde_json::from_str(&body).map_err(|e| failed(format!("{e}: {body}")))
}

/// Waits until the webhook injects a pod with `labels` in `namespace`
/// with `source` (e.g. `workload:<ns>/<name>`, a SidecarLifecycle) among
/// its layers, `streak` dry-runs in a row: every operator replica (each
/// has its own watch of SidecarLifecycles, and the Service picks one per
/// call) knows the resource before a workload's pods are created.
pub async fn wait_layer_in_force(
    client: &Client,
    namespace: &str,
    labels: &[(&str, &str)],
    source: &str,
    streak: usize,
    timeout: Duration,
) -> Result<Duration, Error> {
    let t0 = Instant::now();
    let mut probe = pause_pod("layer-probe");
    probe.metadata.labels = Some(
        labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    );
    let run = Mutex::new(0usize);
    wait_until(
        timeout,
        &format!("pods in {namespace} injected with layer {source}"),
        || async {
            let sources = match dry_run_create(client, namespace, &probe).await {
                Ok(p) => sidecar_status(&p).map(|s| s.sources).unwrap_or_default(),
                Err(kube::Error::Api(s)) => {
                    return Ok::<_, Error>(Check::NotYet(format!("refused: {}", s.message)));
                }
                Err(e) => return Err(e.into()),
            };
            let mut run = run.lock().unwrap_or_else(|p| p.into_inner());
            if sources.iter().any(|s| s == source) {
                *run += 1;
                if *run >= streak {
                    return Ok(Check::Done(()));
                }
            } else {
                *run = 0;
            }
            Ok(Check::NotYet(format!("layers {sources:?}, {run} in a row")))
        },
    )
    .await?;
    Ok(t0.elapsed())
}

/// Waits until Deployment `name` has rolled out its current template:
/// observed, every replica updated and available, and exactly
/// `spec.replicas` pods of its selector exist, all Ready, none
/// terminating (the old ones are gone). A pod that cannot start ends the
/// wait at once. Returns the pods.
pub async fn wait_deployment_rolled_out(
    client: &Client,
    namespace: &str,
    name: &str,
    timeout: Duration,
) -> Result<Vec<Pod>, Error> {
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    wait_until(
        timeout,
        &format!("Deployment {namespace}/{name} rolled out"),
        || async {
            let d = deploys.get(name).await?;
            let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
            let selector = d
                .spec
                .as_ref()
                .and_then(|s| s.selector.match_labels.as_ref())
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .unwrap_or_default();
            let list = pods
                .list(&ListParams::default().labels(&selector))
                .await?
                .items;
            if let Some(reason) = list.iter().find_map(cannot_start) {
                return Err(Error::Failed {
                    what: format!("a pod of Deployment {namespace}/{name} cannot start"),
                    detail: reason,
                });
            }
            let st = d.status.clone().unwrap_or_default();
            let observed =
                st.observed_generation.unwrap_or(0) >= d.metadata.generation.unwrap_or(0);
            let ready = list
                .iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none() && is_ready(p))
                .count();
            let done = observed
                && st.updated_replicas == Some(want)
                && st.available_replicas == Some(want)
                && st.replicas == Some(want)
                && list.len() == usize::try_from(want).unwrap_or(0)
                && ready == list.len();
            Ok::<_, Error>(if done {
                Check::Done(list)
            } else {
                Check::NotYet(format!(
                    "observed {observed}, updated {:?} available {:?} total {:?} of {want}; {} pods, {ready} ready",
                    st.updated_replicas,
                    st.available_replicas,
                    st.replicas,
                    list.len()
                ))
            })
        },
    )
    .await
}
