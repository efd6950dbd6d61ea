//! Jobs finish without app changes, on the real API server and controller
//! manager: a `batch/v1` Job's pod is injected in Legacy mode by the real
//! `remora-operator serve`; the pod runs as real processes (the agent with
//! real Envoy, the app as `sh`) under `e2e::jobpod`, which plays the
//! kubelet; the operator's controller asks the sidecar to stop through the
//! `remora.dev/stop` annotation once the app has exited, the agent exits 0,
//! the pod succeeds and the Job controller marks the Job Complete.

use std::time::Duration;

use anyhow::Context;
use e2e::controlplane::ControlPlane;
use e2e::jobpod::{self, JobPodOptions, JobsEnv, PROXY, STOP_ANNOTATION};
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStatus, Pod,
};
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};
use remora_test_support::wait::wait_until;

const DEADLINE: Duration = Duration::from_secs(60);

fn options(dir: &std::path::Path) -> anyhow::Result<JobPodOptions> {
    Ok(JobPodOptions {
        agent_bin: jobpod::agent_bin()?,
        envoy_bin: remora_test_support::bins::envoy_bin()?,
        base_dir: dir.to_path_buf(),
        timeout: DEADLINE,
    })
}

fn has_stop(p: &Pod) -> bool {
    p.metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(STOP_ANNOTATION))
}

/// Where the operator put the sidecar: `containers` (Legacy) or `initContainers` (Native).
fn sidecar_place(p: &Pod) -> Option<&'static str> {
    let spec = p.spec.as_ref()?;
    if spec.containers.iter().any(|c| c.name == PROXY) {
        Some("containers")
    } else if spec
        .init_containers
        .iter()
        .flatten()
        .any(|c| c.name == PROXY)
    {
        Some("initContainers")
    } else {
        None
    }
}

fn status(name: &str, state: ContainerState) -> ContainerStatus {
    ContainerStatus {
        name: name.into(),
        state: Some(state),
        ..ContainerStatus::default()
    }
}

fn running() -> ContainerState {
    ContainerState {
        running: Some(ContainerStateRunning::default()),
        ..ContainerState::default()
    }
}

fn exited(code: i32) -> ContainerState {
    ContainerState {
        terminated: Some(ContainerStateTerminated {
            exit_code: code,
            ..ContainerStateTerminated::default()
        }),
        ..ContainerState::default()
    }
}

#[tokio::test]
async fn job_completes_when_its_app_exits_and_others_are_left_alone() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    anyhow::ensure!(
        cp.has_controller_manager(),
        "the Job controller is needed: run against the local control plane"
    );
    let env = JobsEnv::start(cp, "jobs", &[]).await?;
    let dir = tempfile::tempdir()?;
    let opts = options(dir.path())?;
    let pods = env.pods();

    // Native: the app has terminated, the native sidecar still runs (the
    // kubelet's own moment between the two). Not ours to stop.
    let native = env
        .create_job(&jobpod::job(
            "native",
            "Never",
            "exit 0",
            &[("remora.dev/sidecar-mode", "Native")],
        ))
        .await?;
    let p = pods.get(&native).await?;
    anyhow::ensure!(
        sidecar_place(&p) == Some("initContainers"),
        "not Native: {:?}",
        p.spec
    );
    env.kubelet.start(&env.namespace, &native).await?;
    let mut st = p.status.unwrap_or_default();
    st.phase = Some("Running".into());
    st.container_statuses = Some(vec![status("app", exited(0))]);
    st.init_container_statuses = Some(vec![status(PROXY, running())]);
    pods.patch_status(
        &native,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "status": st })),
    )
    .await?;

    // Legacy, OnFailure, the app fails: the kubelet would restart it, so the
    // sidecar must stay. Real processes; the bridge never completes this pod.
    let failing = env
        .create_job(&jobpod::job("failing", "OnFailure", "exit 3", &[]))
        .await?;
    anyhow::ensure!(sidecar_place(&pods.get(&failing).await?) == Some("containers"));
    let failing_run = {
        let (client, kubelet, ns, pod, opts) = (
            env.client.clone(),
            env.kubelet.clone(),
            env.namespace.clone(),
            failing.clone(),
            opts.clone(),
        );
        tokio::spawn(async move { jobpod::run(client, &kubelet, &ns, &pod, &opts).await })
    };
    wait_until(DEADLINE, "the failing app's exit in the API", || async {
        let p = pods.get(&failing).await?;
        let code = p
            .status
            .and_then(|s| s.container_statuses)
            .unwrap_or_default()
            .iter()
            .find(|c| c.name == "app")
            .and_then(|c| c.state.as_ref()?.terminated.as_ref().map(|t| t.exit_code));
        Ok::<_, anyhow::Error>(code.filter(|c| *c == 3))
    })
    .await?;

    // Legacy, Never, the app exits 0 after a moment: stopped, completed.
    let job = env
        .create_job(&jobpod::job("works", "Never", "sleep 0.3; exit 0", &[]))
        .await?;
    anyhow::ensure!(sidecar_place(&pods.get(&job).await?) == Some("containers"));
    let outcome = jobpod::run(
        env.client.clone(),
        &env.kubelet,
        &env.namespace,
        &job,
        &opts,
    )
    .await
    .with_context(|| format!("operator log:\n{}", env.setup.operator.log_tail()))?;
    anyhow::ensure!(
        outcome.exit_codes.get(PROXY) == Some(&0) && outcome.exit_codes.get("app") == Some(&0),
        "exit codes {:?}; agent log:\n{}",
        outcome.exit_codes,
        std::fs::read_to_string(outcome.dir.join(format!("{PROXY}.log"))).unwrap_or_default()
    );
    anyhow::ensure!(outcome.phase == "Succeeded");
    anyhow::ensure!(
        outcome.timeline.stop_seen.is_some(),
        "the sidecar exited without a stop request"
    );
    env.wait_job("works", "Complete", DEADLINE).await?;
    let events: Api<Event> = Api::namespaced(env.client.clone(), &env.namespace);
    let ev = wait_until(DEADLINE, "the SidecarStopRequested event", || async {
        let list = events.list(&ListParams::default()).await?;
        Ok::<_, anyhow::Error>(list.items.into_iter().find(|e| {
            e.reason.as_deref() == Some("SidecarStopRequested")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(job.as_str())
        }))
    })
    .await?;
    anyhow::ensure!(
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
        let p = pods.get(name).await?;
        anyhow::ensure!(!has_stop(&p), "{what} pod {name} was asked to stop");
    }
    anyhow::ensure!(!failing_run.is_finished(), "the failing pod completed");
    failing_run.abort();

    // Counted (a reconcile racing its own watch may patch twice: at least one).
    let inj = &env.setup.operator;
    let mut c =
        remora_test_support::webhook_client::connect(inj.addr(), "localhost", inj.ca_pem()).await?;
    let (code, body) = c.request(http::Method::GET, "/metrics", Vec::new()).await?;
    anyhow::ensure!(code.as_u16() == 200, "/metrics: {code}");
    let metrics = String::from_utf8_lossy(&body);
    let stopped: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("remora_operator_jobs_sidecars_stopped_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    anyhow::ensure!(stopped >= 1, "{metrics}");
    env.cleanup(cp).await?;
    Ok(())
}
