//! The scale run (issue 14) at CI size on a local control plane without
//! kube-controller-manager: two operator replicas under their own
//! ServiceAccounts, every pod created through the webhook. Asserts
//! correctness only (timings are scale-bench's): every pod injected and
//! carrying what its layers say, every SidecarLifecycle's status as
//! computed independently, no write but the Lease's at steady state (by the
//! API server's audit log), every pod of the big namespace retuned after
//! an edit of its lifecycle, and every pod of the cluster after an edit of
//! the cluster default, each written once.

use std::time::Duration;

use e2e::scale::{self, LifecycleKind, Load};
use e2e::scale_run::{Options, Run, StepResult};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams};
use serde_json::json;
use tokio::time::Instant;

fn done<T: std::fmt::Debug>(what: &str, r: StepResult<T>, run: &Run) -> anyhow::Result<T> {
    match r {
        StepResult::Done(t) => Ok(t),
        other => anyhow::bail!("{what}: {other:?}\n{}", run.logs()),
    }
}

/// Each pod patched once, give or take the rare write the controller
/// repeats on purpose (a failed one, or one the watch never showed in 30 s).
/// Before the controller remembered its unconfirmed writes, a cluster
/// default's edit wrote one pod in six twice.
fn written_once(patches: usize, pods: usize) -> bool {
    (pods..=pods + pods / 100).contains(&patches)
}

#[tokio::test]
async fn ci_sized_load_is_injected_steady_and_retuned() -> anyhow::Result<()> {
    let load = Load {
        namespaces: 20,
        nodes: 10,
        pods: 1_000,
        lifecycles: 100,
        big_namespace_pods: 200,
        run: "scale-ci".into(),
        ..Load::default()
    };
    let mut opts = Options::new(load);
    opts.steady = Duration::from_secs(10);
    opts.step_timeout = Duration::from_secs(90);
    // The webhook's load during the cluster default's edit: correctness
    // here, its latency is scale-bench's.
    opts.rate = 50;
    let run = Run::start(opts).await?;
    let load_end = Instant::now();
    let plan = &run.populated.plan;
    for kind in [
        LifecycleKind::ClusterDefault,
        LifecycleKind::NamespaceWide,
        LifecycleKind::Selector,
        LifecycleKind::Overlapping,
    ] {
        assert!(plan.lifecycles_of(kind) > 0, "no {kind:?} SidecarLifecycle");
    }
    let checked = scale::check(&run.client, &run.populated).await?;
    assert!(checked.problems.is_empty(), "{:?}", checked.problems);
    assert_eq!(
        (checked.counts.pods, checked.counts.pods_running),
        (1_200, 1_200)
    );
    assert_eq!(checked.counts.sidecar_lifecycles, 101);
    let leader = run.leader().await?.expect("a leader");

    // Every pod injected and retuned, every status right.
    let settled = done("settling", run.settle(load_end).await?, &run)?;
    assert_eq!((settled.pods, settled.pods_injected), (1_200, 1_200));
    assert!(settled.correct(), "{settled:?}");
    println!("settled {:.1} s after the load", settled.seconds);

    // Steady: nothing written but the Lease, which shows the audit log
    // sees the leader at all.
    let steady = done("the steady window", run.steady(&leader).await?, &run)?;
    assert_eq!(
        (steady.leader.writes, steady.standby.writes),
        (0, 0),
        "writes at steady state: leader {:?}, standby {:?}",
        steady.leader.by_verb,
        steady.standby.by_verb
    );
    assert!(
        steady.leader.lease_writes > 0,
        "no Lease renewal seen in {:?}",
        steady.leader
    );
    assert_eq!(steady.standby.lease_writes, 0, "{:?}", steady.standby);
    assert_eq!(steady.leader.lists + steady.standby.lists, 0, "re-lists");
    println!(
        "steady: leader {:.1} MiB {:.2} req/s, standby {:.1} MiB {:.2} req/s",
        steady.leader_rss.max_mib,
        steady.leader.requests_per_s(),
        steady.standby_rss.max_mib,
        steady.standby.requests_per_s()
    );

    // The big namespace's lifecycle edited: all 200 pods retuned.
    let big = done(
        "the big namespace's retune",
        run.retune_big(&leader).await?,
        &run,
    )?;
    assert_eq!((big.pods_expected, big.pods_reached), (200, 200), "{big:?}");
    assert!(written_once(big.patches, 200), "{big:?}");
    let after = done(
        "statuses after the edit",
        run.settle(Instant::now()).await?,
        &run,
    )?;
    assert!(after.correct(), "{after:?}");

    // The cluster default edited: every pod retuned, through the siblings
    // that govern them, each written once (not again by a reconcile that
    // ran before the watch showed the first write), the webhook answering.
    let def = done(
        "the cluster default's edit",
        run.edit_default(&leader).await?,
        &run,
    )?;
    let r = &def.retune;
    assert_eq!((r.pods_expected, r.pods_reached), (1_200, 1_200), "{r:?}");
    assert!(written_once(r.patches, 1_200), "{r:?}");
    assert_eq!(def.webhook.errors, 0, "{:?}", def.webhook.first_errors);
    let after = done(
        "statuses after the cluster default's edit",
        run.settle(Instant::now()).await?,
        &run,
    )?;
    assert!(after.correct(), "{after:?}");

    // The load check still sees what is wrong: one pod gone, another not Running.
    let w = &plan.workloads[0];
    let (gone, pending) = (&w.pods[0].name, &w.pods[1].name);
    let pods: Api<Pod> = Api::namespaced(run.client.clone(), &w.namespace);
    pods.delete(gone, &DeleteParams::default().grace_period(0))
        .await?;
    pods.patch_status(
        pending,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Pending"}})),
    )
    .await?;
    let checked = scale::check(&run.client, &run.populated).await?;
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
    Ok(())
}
