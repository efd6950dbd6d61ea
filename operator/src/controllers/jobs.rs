//! Jobs finish without app changes: a Legacy-mode sidecar is a regular
//! container, so a pod with restartPolicy `Never` or `OnFailure` would stay
//! `Running` after its app containers are done. Once they all have
//! terminated (successfully, under `OnFailure`), this controller sets the pod
//! annotation `remora.dev/stop`; the agent reads it through the downward-API
//! file it already reads and exits 0 (after stopping Envoy), and the pod
//! completes. Native mode needs none of this: the kubelet stops native
//! sidecars itself.
//!
//! Why an annotation rather than a request to the sidecar: nothing listens
//! for it on the pod network, no secret is shared, and only who may patch
//! pods (the operator, cluster admins: Kubernetes RBAC) can trigger it. The
//! price is the kubelet's downward-API refresh (README "Jobs").

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client, Resource, ResourceExt};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use remora_contract::annotations::STOP as STOP_ANNOTATION;
use remora_contract::lifecycle::StopRequest;
use remora_contract::pod::PROXY_CONTAINER;
use tokio_util::sync::CancellationToken;

use crate::cluster::live_pod::LivePod;
use crate::cluster::watch::{Change, SharedWatch};
use crate::identity::FIELD_MANAGER;

/// Reason of the Event set on the pod, and of the stop request.
pub const EVENT_REASON: &str = "SidecarStopRequested";
/// What the stop request says it is for.
pub const STOP_REASON: &str = "AppsCompleted";

/// Only pods that can complete, and only while they run, are looked at.
/// The leader's one pod watch holds every live pod (the SidecarLifecycle
/// controller needs them all); this is the field selector
/// `spec.restartPolicy!=Always,status.phase=Running`, applied in memory.
pub fn may_complete(pod: &LivePod) -> bool {
    // The API server defaults restartPolicy to Always.
    matches!(pod.restart_policy(), Some(p) if p != "Always") && pod.phase() == Some("Running")
}

#[derive(Debug, thiserror::Error)]
pub enum JobsError {
    #[error("cannot patch {STOP_ANNOTATION} on pod {pod}: {source}")]
    Patch {
        pod: String,
        #[source]
        source: kube::Error,
    },
    #[error("the pod has no namespace")]
    NoNamespace,
}

/// Why a pod's sidecar is left alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// No `remora.dev/status`: Remora did not inject it.
    NotInjected,
    /// The sidecar is not a regular container (Native mode, or gone).
    NotLegacy,
    /// restartPolicy `Always` (the default): the pod never completes.
    RestartAlways,
    /// Deleted or already finished: the kubelet stops the sidecar itself.
    NotRunning,
    /// `remora.dev/stop` is there already.
    AlreadyRequested,
    /// The pod has no app container besides the sidecar.
    NoApps,
    /// An app container has not terminated (or has no status yet).
    AppsRunning,
    /// restartPolicy `OnFailure` and an app failed: the kubelet restarts it.
    AppWillRestart,
    /// The sidecar has terminated already.
    SidecarDone,
}

/// What to do with a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Ask the sidecar to stop; the app containers that have terminated.
    Stop {
        apps: Vec<String>,
    },
    Leave(Skip),
}

/// Does this pod's sidecar need a stop request? Pure: the pod as the API
/// server has it.
pub fn decide(pod: &LivePod) -> Decision {
    let annotations = pod.annotations();
    if pod.injected().is_none() {
        return Decision::Leave(Skip::NotInjected);
    }
    // First: the watch keeps no containers of a pod that restarts Always.
    let on_failure = match pod.restart_policy() {
        Some("Never") => false,
        Some("OnFailure") => true,
        _ => return Decision::Leave(Skip::RestartAlways),
    };
    let in_init = pod
        .init_containers()
        .iter()
        .any(|c| c.name == PROXY_CONTAINER);
    if in_init || !pod.containers().iter().any(|c| c.name == PROXY_CONTAINER) {
        return Decision::Leave(Skip::NotLegacy);
    }
    if pod.metadata.deletion_timestamp.is_some()
        || matches!(pod.phase(), Some("Succeeded" | "Failed"))
    {
        return Decision::Leave(Skip::NotRunning);
    }
    if annotations.contains_key(STOP_ANNOTATION) {
        return Decision::Leave(Skip::AlreadyRequested);
    }
    let apps: Vec<String> = pod
        .containers()
        .iter()
        .filter(|c| c.name != PROXY_CONTAINER)
        .map(|c| c.name.clone())
        .collect();
    if apps.is_empty() {
        return Decision::Leave(Skip::NoApps);
    }
    for app in &apps {
        match pod.exit_code(app) {
            None => return Decision::Leave(Skip::AppsRunning),
            Some(code) if on_failure && code != 0 => {
                return Decision::Leave(Skip::AppWillRestart);
            }
            Some(_) => {}
        }
    }
    if pod.exit_code(PROXY_CONTAINER).is_some() {
        return Decision::Leave(Skip::SidecarDone);
    }
    Decision::Stop { apps }
}

/// The annotation value: who asked and when (informational; the agent stops
/// on any value).
pub fn stop_value(now: k8s_openapi::jiff::Timestamp) -> String {
    let req = StopRequest {
        reason: STOP_REASON.into(),
        at: now.to_string(),
    };
    serde_json::to_string(&req).unwrap_or_default()
}

/// What the Jobs controller counts.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    stopped: Counter,
    failures: Counter,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Self {
        let me = Self::default();
        registry.register(
            "jobs_sidecars_stopped",
            "Legacy sidecars of completed Job pods asked to stop (remora.dev/stop)",
            me.stopped.clone(),
        );
        registry.register(
            "jobs_stop_failures",
            "Failed attempts to set remora.dev/stop (retried)",
            me.failures.clone(),
        );
        me
    }
}

struct Ctx {
    client: Client,
    recorder: Recorder,
    metrics: Metrics,
}

async fn reconcile(pod: Arc<LivePod>, ctx: Arc<Ctx>) -> Result<Action, JobsError> {
    let Decision::Stop { apps } = decide(&pod) else {
        return Ok(Action::await_change());
    };
    let ns = pod.namespace().ok_or(JobsError::NoNamespace)?;
    let name = pod.name_any();
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let value = stop_value(k8s_openapi::jiff::Timestamp::now());
    // A merge patch of one annotation: nothing else of the pod is touched,
    // and a second replica doing the same writes the same key.
    let patch = Patch::Merge(serde_json::json!({
        "metadata": {"annotations": {STOP_ANNOTATION: value}}
    }));
    api.patch_metadata(&name, &PatchParams::apply(FIELD_MANAGER), &patch)
        .await
        .map_err(|source| JobsError::Patch {
            pod: format!("{ns}/{name}"),
            source,
        })?;
    ctx.metrics.stopped.inc();
    tracing::info!(pod = %format!("{ns}/{name}"), apps = ?apps,
        "app containers terminated: asked the sidecar to stop");
    let event = Event {
        type_: EventType::Normal,
        reason: EVENT_REASON.into(),
        note: Some(format!(
            "app containers {} terminated; asked {PROXY_CONTAINER} to stop through the \
             {STOP_ANNOTATION} annotation so the pod can complete",
            apps.join(", ")
        )),
        action: "StopSidecar".into(),
        secondary: None,
    };
    // An Event that cannot be written does not undo the stop.
    if let Err(e) = ctx.recorder.publish(&event, &pod.object_ref(&())).await {
        tracing::warn!(pod = %format!("{ns}/{name}"), error = %e, "cannot record the event");
    }
    Ok(Action::await_change())
}

fn error_policy(_pod: Arc<LivePod>, err: &JobsError, ctx: Arc<Ctx>) -> Action {
    ctx.metrics.failures.inc();
    tracing::warn!(error = %err, "sidecar stop failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

/// Follow running pods that can complete, from the leader's pod watch, and
/// ask their Legacy sidecar to stop once their apps are done. Ends when
/// `shutdown` is cancelled (after the reconciles in flight).
pub async fn run(
    client: Client,
    identity: String,
    metrics: Metrics,
    pods: SharedWatch<LivePod>,
    shutdown: CancellationToken,
) -> Result<(), JobsError> {
    let reporter = Reporter {
        controller: FIELD_MANAGER.into(),
        instance: Some(identity),
    };
    let ctx = Arc::new(Ctx {
        recorder: Recorder::new(client.clone(), reporter),
        client,
        metrics,
    });
    tracing::info!("stopping the sidecars of completed Job pods");
    let candidates = pods.subscribe().filter_map(|c| {
        futures::future::ready(match c {
            Change::Applied(p) if may_complete(&p) => Some(p),
            _ => None,
        })
    });
    let controller = Controller::for_shared_stream(candidates, pods.store())
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                // Reconcile errors were logged by error_policy.
                if !matches!(e, kube::runtime::controller::Error::ReconcilerFailed(..)) {
                    tracing::warn!(error = %e, "sidecar-stop controller");
                }
            }
        });
    crate::controllers::lifecycle::bounded_by(controller, &shutdown).await;
    tracing::info!("sidecar-stop controller stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        Container, ContainerState, ContainerStateRunning, ContainerStateTerminated,
        ContainerStatus, PodSpec, PodStatus,
    };
    use kube::api::ObjectMeta;
    use remora_inject::patch::STATUS_ANNOTATION;

    #[derive(Clone, Copy)]
    enum St {
        Running,
        Exited(i32),
        Missing,
    }

    struct Case {
        name: &'static str,
        injected: bool,
        native: bool,
        policy: Option<&'static str>,
        phase: &'static str,
        deleting: bool,
        stop_set: bool,
        apps: &'static [St],
        sidecar: St,
        want: Decision,
    }

    const BASE: Case = Case {
        name: "",
        injected: true,
        native: false,
        policy: Some("Never"),
        phase: "Running",
        deleting: false,
        stop_set: false,
        apps: &[St::Exited(0)],
        sidecar: St::Running,
        want: Decision::Leave(Skip::NoApps),
    };

    fn status(name: &str, st: St) -> Option<ContainerStatus> {
        let state = match st {
            St::Missing => return None,
            St::Running => ContainerState {
                running: Some(ContainerStateRunning::default()),
                ..Default::default()
            },
            St::Exited(code) => ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: code,
                    ..Default::default()
                }),
                ..Default::default()
            },
        };
        Some(ContainerStatus {
            name: name.into(),
            state: Some(state),
            ..Default::default()
        })
    }

    fn pod(c: &Case) -> LivePod {
        crate::cluster::live_pod::read(&full_pod(c))
    }

    fn full_pod(c: &Case) -> Pod {
        let container = |n: &str| Container {
            name: n.into(),
            ..Default::default()
        };
        let mut annotations = std::collections::BTreeMap::new();
        if c.injected {
            annotations.insert(STATUS_ANNOTATION.to_string(), "{}".to_string());
        }
        if c.stop_set {
            annotations.insert(STOP_ANNOTATION.to_string(), "x".to_string());
        }
        let app_names: Vec<String> = (0..c.apps.len()).map(|i| format!("app{i}")).collect();
        let mut containers: Vec<Container> = app_names.iter().map(|n| container(n)).collect();
        let mut init = vec![];
        if c.native {
            init.push(container(PROXY_CONTAINER));
        } else {
            containers.insert(0, container(PROXY_CONTAINER));
        }
        let mut statuses: Vec<ContainerStatus> = app_names
            .iter()
            .zip(c.apps)
            .filter_map(|(n, st)| status(n, *st))
            .collect();
        statuses.extend(status(PROXY_CONTAINER, c.sidecar));
        Pod {
            metadata: ObjectMeta {
                name: Some("p".into()),
                namespace: Some("ns".into()),
                annotations: Some(annotations),
                deletion_timestamp: c.deleting.then_some(
                    k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                        k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                    ),
                ),
                ..Default::default()
            },
            spec: Some(PodSpec {
                containers,
                init_containers: (!init.is_empty()).then_some(init),
                restart_policy: c.policy.map(str::to_string),
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some(c.phase.into()),
                container_statuses: Some(statuses),
                ..Default::default()
            }),
        }
    }

    fn stop(n: usize) -> Decision {
        Decision::Stop {
            apps: (0..n).map(|i| format!("app{i}")).collect(),
        }
    }

    #[test]
    fn decisions() {
        let cases = [
            Case {
                name: "Never, app exited 0",
                want: stop(1),
                ..BASE
            },
            Case {
                name: "Never, app failed: stop too (the pod fails, the Job counts it)",
                apps: &[St::Exited(2)],
                want: stop(1),
                ..BASE
            },
            Case {
                name: "OnFailure, app exited 0",
                policy: Some("OnFailure"),
                want: stop(1),
                ..BASE
            },
            Case {
                name: "OnFailure, app failed: the kubelet restarts it",
                policy: Some("OnFailure"),
                apps: &[St::Exited(1)],
                want: Decision::Leave(Skip::AppWillRestart),
                ..BASE
            },
            Case {
                name: "two apps, one still running",
                apps: &[St::Exited(0), St::Running],
                want: Decision::Leave(Skip::AppsRunning),
                ..BASE
            },
            Case {
                name: "two apps, both done",
                apps: &[St::Exited(0), St::Exited(0)],
                want: stop(2),
                ..BASE
            },
            Case {
                name: "an app without status yet",
                apps: &[St::Exited(0), St::Missing],
                want: Decision::Leave(Skip::AppsRunning),
                ..BASE
            },
            Case {
                name: "restartPolicy Always",
                policy: Some("Always"),
                want: Decision::Leave(Skip::RestartAlways),
                ..BASE
            },
            Case {
                name: "restartPolicy unset means Always",
                policy: None,
                want: Decision::Leave(Skip::RestartAlways),
                ..BASE
            },
            Case {
                name: "Native mode",
                native: true,
                want: Decision::Leave(Skip::NotLegacy),
                ..BASE
            },
            Case {
                name: "not injected by Remora",
                injected: false,
                want: Decision::Leave(Skip::NotInjected),
                ..BASE
            },
            Case {
                name: "stop already requested",
                stop_set: true,
                want: Decision::Leave(Skip::AlreadyRequested),
                ..BASE
            },
            Case {
                name: "sidecar already exited",
                sidecar: St::Exited(0),
                want: Decision::Leave(Skip::SidecarDone),
                ..BASE
            },
            Case {
                name: "pod being deleted",
                deleting: true,
                want: Decision::Leave(Skip::NotRunning),
                ..BASE
            },
            Case {
                name: "pod already Succeeded",
                phase: "Succeeded",
                want: Decision::Leave(Skip::NotRunning),
                ..BASE
            },
            Case {
                name: "only the sidecar",
                apps: &[],
                want: Decision::Leave(Skip::NoApps),
                ..BASE
            },
        ];
        for c in &cases {
            assert_eq!(decide(&pod(c)), c.want, "{}", c.name);
        }
    }

    #[test]
    fn only_running_pods_that_can_complete_are_looked_at() {
        let with = |policy: Option<&'static str>, phase| {
            may_complete(&pod(&Case {
                policy,
                phase,
                ..BASE
            }))
        };
        assert!(with(Some("Never"), "Running"));
        assert!(with(Some("OnFailure"), "Running"));
        assert!(!with(Some("Always"), "Running"));
        assert!(!with(None, "Running"));
        assert!(!with(Some("Never"), "Pending"));
        assert!(!with(Some("Never"), "Succeeded"));
    }

    #[test]
    fn a_pod_without_spec_or_status_is_left_alone() {
        let mut p = pod(&Case {
            want: stop(1),
            ..BASE
        });
        p.status = None;
        assert_eq!(decide(&p), Decision::Leave(Skip::AppsRunning));
        // No restartPolicy: the API server's default, Always.
        p.spec = None;
        assert_eq!(decide(&p), Decision::Leave(Skip::RestartAlways));
    }

    #[test]
    fn stop_value_is_the_agents_shape() {
        let v = stop_value(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
        let req: StopRequest = serde_json::from_str(&v).expect("json");
        assert_eq!(req.reason, STOP_REASON);
        assert_eq!(req.at, "1970-01-01T00:00:00Z");
    }
}
