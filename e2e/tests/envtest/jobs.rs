//! Jobs finish without app changes, at the API level: on the real API server
//! and Job controller, `remora-operator serve` injects a `batch/v1` Job's pod
//! in Legacy mode; once the pod's app container has terminated with exit 0
//! while the sidecar runs, the operator asks the sidecar to stop
//! (`remora.dev/stop`), with an Event and a count. Pods it must leave alone
//! get nothing: a Native pod (the kubelet stops native sidecars itself) and
//! an `OnFailure` pod whose app failed (the kubelet restarts the app).
//!
//! The kubelet is [`FakeKubelet`]: container states written to the API, no
//! process runs. What the agent does with the annotation is
//! `agent/tests/local/agent_envoy.rs`'s `stop_annotation_stops_envoy_and_exits_zero`;
//! the whole path with a real kubelet, to the Job's completion, is
//! `e2e/tests/node_workloads.rs`'s `job_legacy` and `job_native`.

use std::time::Duration;

use anyhow::ensure;
use e2e::controlplane::{ControlPlane, FakeKubelet};
use e2e::webhook::Setup;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ContainerState, ContainerStateTerminated, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use remora_contract::annotations::{MODE, STOP};
use remora_contract::pod::PROXY_CONTAINER;
use remora_test_support::wait::wait_until;

const DEADLINE: Duration = Duration::from_secs(60);

/// A Job of one pod with one app container, `app` (nothing runs it).
fn job(name: &str, restart_policy: &str, annotations: &[(&str, &str)]) -> anyhow::Result<Job> {
    let annotations: std::collections::BTreeMap<&str, &str> = annotations.iter().copied().collect();
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"annotations": annotations},
                "spec": {
                    "restartPolicy": restart_policy,
                    "containers": [{
                        "name": "app",
                        "image": "registry.invalid/app:1",
                    }],
                },
            },
        },
    }))?)
}

/// Creates `job` in `ns` and waits for the pod the Job controller makes for it.
async fn create_job(client: &kube::Client, ns: &str, job: &Job) -> anyhow::Result<String> {
    Api::<Job>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), job)
        .await?;
    let name = job.metadata.name.clone().unwrap_or_default();
    let lp = ListParams::default().labels(&format!("job-name={name}"));
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pod = wait_until(DEADLINE, &format!("Job {name}'s pod"), || async {
        let list = pods.list(&lp).await?;
        Ok::<_, anyhow::Error>(list.items.first().and_then(|p| p.metadata.name.clone()))
    })
    .await?;
    Ok(pod)
}

/// Where the operator put the sidecar: `containers` (Legacy) or `initContainers` (Native).
fn sidecar_place(p: &Pod) -> Option<&'static str> {
    let spec = p.spec.as_ref()?;
    if spec.containers.iter().any(|c| c.name == PROXY_CONTAINER) {
        Some("containers")
    } else if spec
        .init_containers
        .iter()
        .flatten()
        .any(|c| c.name == PROXY_CONTAINER)
    {
        Some("initContainers")
    } else {
        None
    }
}

fn has_stop(p: &Pod) -> bool {
    p.metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(STOP))
}

/// Reports the app container terminated with `code`, the sidecar still
/// running: the kubelet's moment before it acts on the exit (restarts the
/// app under `OnFailure`, or stops a native sidecar), which
/// [`FakeKubelet::exit`] goes past.
async fn app_exited(pods: &Api<Pod>, pod: &str, code: i32) -> anyhow::Result<()> {
    let mut status = pods.get_status(pod).await?.status.unwrap_or_default();
    let app = status
        .container_statuses
        .iter_mut()
        .flatten()
        .find(|c| c.name == "app")
        .ok_or_else(|| anyhow::anyhow!("{pod} has no app status"))?;
    app.ready = false;
    app.started = Some(false);
    app.state = Some(ContainerState {
        terminated: Some(ContainerStateTerminated {
            exit_code: code,
            ..ContainerStateTerminated::default()
        }),
        ..ContainerState::default()
    });
    pods.patch_status(
        pod,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "status": status })),
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_legacy_jobs_sidecar_is_asked_to_stop_once_its_app_exits_and_others_are_left_alone()
-> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    ensure!(
        cp.has_controller_manager(),
        "the Job controller is needed: run against the local control plane"
    );
    let client = cp.client()?;
    // Registered with the API server's version before the operator starts:
    // its Native decision reads the nodes' kubelet versions.
    let kubelet = FakeKubelet::register(client.clone(), "jobs-node").await?;
    let setup = Setup::new("jobs", "Fail").await?;
    let ns = setup.enabled.clone();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);

    // Native: the app has terminated, the native sidecar still runs (the
    // kubelet's own moment between the two). Not the operator's to stop.
    let native = create_job(&client, &ns, &job("native", "Never", &[(MODE, "Native")])?).await?;
    let p = kubelet.start(&ns, &native).await?;
    ensure!(
        sidecar_place(&p) == Some("initContainers"),
        "not Native: {:?}",
        p.spec
    );
    app_exited(&pods, &native, 0).await?;

    // Legacy, OnFailure, the app failed: the kubelet restarts it, so the
    // sidecar must stay.
    let failing = create_job(&client, &ns, &job("failing", "OnFailure", &[])?).await?;
    let p = kubelet.start(&ns, &failing).await?;
    ensure!(
        sidecar_place(&p) == Some("containers"),
        "not Legacy: {:?}",
        p.spec
    );
    app_exited(&pods, &failing, 3).await?;

    // Legacy, Never, the app exits 0: the pod keeps Running on its
    // sidecar alone until the operator asks it to stop.
    let works = create_job(&client, &ns, &job("works", "Never", &[])?).await?;
    let p = kubelet.start(&ns, &works).await?;
    ensure!(
        sidecar_place(&p) == Some("containers"),
        "not Legacy: {:?}",
        p.spec
    );
    let p = kubelet.exit(&ns, &works, "app", 0).await?;
    ensure!(
        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"),
        "{:?}",
        p.status
    );
    let stopped = wait_until(DEADLINE, "remora.dev/stop on the Legacy pod", || async {
        Ok::<_, anyhow::Error>(has_stop(&pods.get(&works).await?))
    })
    .await;
    if let Err(e) = stopped {
        anyhow::bail!("{e}\noperator log:\n{}", setup.operator.log_tail());
    }
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    let ev = wait_until(DEADLINE, "the SidecarStopRequested event", || async {
        let list = events.list(&ListParams::default()).await?;
        Ok::<_, anyhow::Error>(list.items.into_iter().find(|e| {
            e.reason.as_deref() == Some("SidecarStopRequested")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(works.as_str())
        }))
    })
    .await?;
    ensure!(
        ev.note.as_deref().is_some_and(|n| n.contains("app")),
        "{ev:?}"
    );

    // The controller acted on the last pod's app exit, which the API server
    // recorded after the other two pods' states: it had seen those and left
    // them alone.
    for (name, what) in [
        (&native, "Native"),
        (&failing, "OnFailure with a failed app"),
    ] {
        ensure!(
            !has_stop(&pods.get(name).await?),
            "{what} pod {name} was asked to stop"
        );
    }

    // Counted (a reconcile racing its own watch may patch twice: at least one).
    let inj = &setup.operator;
    let mut c =
        remora_test_support::webhook_client::connect(inj.addr(), "localhost", inj.ca_pem()).await?;
    let (code, body) = c.request(http::Method::GET, "/metrics", Vec::new()).await?;
    ensure!(code.as_u16() == 200, "/metrics: {code}");
    let metrics = String::from_utf8_lossy(&body);
    let stopped: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("remora_operator_jobs_sidecars_stopped_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    ensure!(stopped >= 1, "{metrics}");
    setup.cleanup().await?;
    Ok(())
}
