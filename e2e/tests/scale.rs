//! The scale load (issue 14) at CI size on the local control plane, without
//! kube-controller-manager: every planned object must be listed back with
//! the right owner, node and phase.

use std::time::Duration;

use e2e::controlplane::{ControlPlane, Options};
use e2e::scale::{self, LifecycleKind, Load};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams};
use serde_json::json;

#[tokio::test]
async fn ci_sized_load_is_all_there_as_planned() -> anyhow::Result<()> {
    let cp = ControlPlane::shared_with(Options::without_controller_manager()).await?;
    anyhow::ensure!(
        !cp.has_controller_manager(),
        "the scale load creates the workloads' pods itself: it needs a control plane \
         without kube-controller-manager (not REMORA_E2E_KUBECONFIG)"
    );
    let client = cp.client()?;
    e2e::chart::install_crds(&client).await?;
    let load = Load {
        namespaces: 20,
        nodes: 10,
        pods: 1_000,
        lifecycles: 100,
        run: "scale-ci".into(),
        ..Load::default()
    };
    let populated =
        tokio::time::timeout(Duration::from_secs(150), scale::populate(&client, &load)).await??;
    let checked = scale::check(&client, &populated).await?;
    assert!(
        checked.problems.is_empty(),
        "{} problems, first: {:?}",
        checked.problems.len(),
        &checked.problems[..checked.problems.len().min(10)]
    );
    let c = &checked.counts;
    assert_eq!(c.namespaces, 21, "20 and the operator's");
    assert_eq!((c.nodes, c.nodes_ready), (10, 10));
    assert_eq!((c.pods, c.pods_running), (1_000, 1_000));
    assert_eq!(c.sidecar_lifecycles, 100);
    let plan = &populated.plan;
    assert_eq!(c.deployments, c.replica_sets);
    assert_eq!(
        c.deployments + c.stateful_sets + c.jobs,
        plan.workloads.len()
    );
    for kind in [
        LifecycleKind::ClusterDefault,
        LifecycleKind::NamespaceWide,
        LifecycleKind::Selector,
        LifecycleKind::Overlapping,
    ] {
        assert!(plan.lifecycles_of(kind) > 0, "no {kind:?} SidecarLifecycle");
    }

    // The check sees what is wrong: one pod gone, another not Running.
    let w = &plan.workloads[0];
    let (gone, pending) = (&w.pods[0].name, &w.pods[1].name);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &w.namespace);
    // No kubelet confirms a graceful deletion: at once.
    pods.delete(gone, &DeleteParams::default().grace_period(0))
        .await?;
    pods.patch_status(
        pending,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Pending"}})),
    )
    .await?;
    let checked = scale::check(&client, &populated).await?;
    let has = |needle: &str| checked.problems.iter().any(|p| p.contains(needle));
    assert!(
        has(&format!("pod {}/{gone} missing", w.namespace)),
        "{:?}",
        checked.problems
    );
    assert!(
        has(&format!(
            "pod {}/{pending}: phase Some(\"Pending\")",
            w.namespace
        )),
        "{:?}",
        checked.problems
    );
    assert_eq!(checked.counts.pods_running, 998);
    Ok(())
}
