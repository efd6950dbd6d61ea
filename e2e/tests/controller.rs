//! The SidecarLifecycle controller on the real API server, with
//! kube-controller-manager running the Deployments: status and conflicts by
//! server-side apply, Events, live retuning of running pods' lifecycle
//! annotation, and rolloutPolicy Automatic rolling a Deployment to a new
//! ReplicaSet (Manual only reporting it).
//!
//! One test on purpose: the controller acts on every namespace, so two
//! operators' controllers in one API server would act on each other's
//! objects.

use std::collections::BTreeMap;

use anyhow::Context;
use e2e::controlplane::{ControlPlane, FakeKubelet};
use e2e::webhook::{DEADLINE, Setup, lifecycles, pod, sidecar};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use remora_operator::identity::FIELD_MANAGER;
use remora_test_support::wait::wait_until;
use serde_json::{Value, json};

const ROLLOUT_ANNOTATION: &str = "remora.dev/restarted-for";

/// A SidecarLifecycle selecting `app=<app>`.
fn lifecycle(name: &str, app: &str, spec: Value) -> anyhow::Result<DynamicObject> {
    let mut spec = spec;
    spec["selector"] = json!({"matchLabels": {"app": app}});
    Ok(e2e::webhook::lifecycle(name, spec)?)
}

fn condition<'a>(o: &'a DynamicObject, type_: &str) -> Option<&'a Value> {
    o.data["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// Waits until `name`'s status satisfies `check`, and returns it.
async fn status_where(
    api: &Api<DynamicObject>,
    name: &str,
    what: &str,
    check: impl Fn(&DynamicObject) -> bool,
) -> anyhow::Result<DynamicObject> {
    let o = wait_until(DEADLINE, what, || async {
        let o = api.get(name).await?;
        Ok::<_, anyhow::Error>(check(&o).then_some(o))
    })
    .await?;
    Ok(o)
}

fn is(o: &DynamicObject, type_: &str, status: &str) -> bool {
    condition(o, type_).is_some_and(|c| c["status"] == status)
}

/// Waits for an Event with `reason` about the object named `regarding`.
async fn event(client: &Client, ns: &str, regarding: &str, reason: &str) -> anyhow::Result<Event> {
    let api: Api<Event> = Api::namespaced(client.clone(), ns);
    let ev = wait_until(
        DEADLINE,
        &format!("event {reason} on {regarding}"),
        || async {
            let list = api.list(&ListParams::default()).await?;
            Ok::<_, anyhow::Error>(list.items.into_iter().find(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(regarding)
            }))
        },
    )
    .await?;
    Ok(ev)
}

async fn deployment_pods(s: &Setup, app: &str, n: usize) -> anyhow::Result<Vec<Pod>> {
    let labels = BTreeMap::from([("app".to_owned(), app.to_owned())]);
    let template = pod("unused", &[("app", app)], &[]);
    let deploy = e2e::controlplane::deployment(app, n as i32, labels, template.spec);
    Api::<Deployment>::namespaced(s.client.clone(), &s.enabled)
        .create(&PostParams::default(), &deploy)
        .await?;
    let api = s.pods(&s.enabled);
    let pods = wait_until(DEADLINE, &format!("{n} pods of {app}"), || async {
        let list = api
            .list(&ListParams::default().labels(&format!("app={app}")))
            .await?;
        Ok::<_, anyhow::Error>((list.items.len() == n).then_some(list.items))
    })
    .await?;
    Ok(pods)
}

fn lifecycle_annotation(p: &Pod) -> Value {
    p.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("remora.dev/lifecycle"))
        .and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or(Value::Null)
}

async fn replicasets(client: &Client, ns: &str, app: &str) -> kube::Result<Vec<ReplicaSet>> {
    Ok(Api::<ReplicaSet>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&format!("app={app}")))
        .await?
        .items)
}

fn template_annotation(d: &Deployment) -> Option<String> {
    d.spec
        .as_ref()?
        .template
        .metadata
        .as_ref()?
        .annotations
        .as_ref()?
        .get(ROLLOUT_ANNOTATION)
        .cloned()
}

#[tokio::test]
async fn controller_reports_status_retunes_running_pods_and_rolls_workloads() -> anyhow::Result<()>
{
    let cp = ControlPlane::shared().await?;
    anyhow::ensure!(cp.has_controller_manager(), "needs kube-controller-manager");
    let s = Setup::with("ctl", "Fail", |o| {
        o.controller = true;
        o.args.push("--automatic-rollouts".into());
    })
    .await?;
    let log = || s.operator.log_tail();
    let client = s.client.clone();
    let ns = s.enabled.clone();
    let slc = lifecycles(&client, &ns);
    let pp = PostParams::default();

    // "web-old" governs app=web and rolls automatically; "api" is Manual.
    slc.create(
        &pp,
        &lifecycle(
            "web-old",
            "web",
            json!({"rolloutPolicy": "Automatic", "shutdown": {"drainDuration": "30s"}}),
        )?,
    )
    .await?;
    slc.create(
        &pp,
        &lifecycle(
            "api",
            "api",
            json!({"rolloutPolicy": "Manual", "shutdown": {"drainDuration": "40s"}}),
        )?,
    )
    .await?;
    let web = deployment_pods(&s, "web", 2).await?;
    let api_pods = deployment_pods(&s, "api", 1).await?;
    for p in web.iter().chain(&api_pods) {
        anyhow::ensure!(sidecar(p).is_some(), "not injected: {:?}", p.metadata.name);
        let app = p.metadata.labels.as_ref().and_then(|l| l.get("app"));
        let want = if app.map(String::as_str) == Some("web") {
            "30s"
        } else {
            "40s"
        };
        assert_eq!(lifecycle_annotation(p)["shutdown"]["drainDuration"], want);
    }
    // The web pods run, as far as the API server can tell.
    let kubelet = FakeKubelet::register(client.clone(), &format!("{ns}-node")).await?;
    for p in &web {
        kubelet
            .start(&ns, p.metadata.name.as_deref().unwrap_or_default())
            .await?;
    }

    // Status: accepted, no conflict, both pods matched and current.
    let o = status_where(&slc, "web-old", "web-old's first status", |o| {
        o.data["status"]["matchedPods"] == 2
            && is(o, "Accepted", "True")
            && is(o, "RestartRequired", "False")
    })
    .await
    .with_context(log)?;
    assert_eq!(o.data["status"]["observedGeneration"], 1);
    assert!(
        is(&o, "Conflicted", "False") && is(&o, "Applied", "True"),
        "{:#}",
        o.data["status"]
    );
    // Written by server-side apply under the controller's field manager.
    let managers: Vec<_> = o
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| m.subresource.as_deref() == Some("status"))
        .map(|m| (m.manager.clone(), m.operation.clone()))
        .collect();
    assert_eq!(
        managers,
        [(Some(FIELD_MANAGER.to_owned()), Some("Apply".to_owned()))]
    );
    event(&client, &ns, "web-old", "Accepted").await?;

    // A newer resource over the same pods: Conflicted, the older one wins.
    // Creation times have one-second resolution (a tie goes to the name), so
    // "newer" means a later second.
    let created = o
        .metadata
        .creation_timestamp
        .clone()
        .context("creationTimestamp")?
        .0;
    wait_until(
        DEADLINE,
        "a later second than web-old's creation",
        || async {
            let later = k8s_openapi::jiff::Timestamp::now().as_second() > created.as_second();
            Ok::<_, anyhow::Error>(later.then_some(()))
        },
    )
    .await?;
    slc.create(
        &pp,
        &lifecycle(
            "web-new",
            "web",
            json!({"shutdown": {"drainDuration": "5s"}}),
        )?,
    )
    .await?;
    let o = status_where(&slc, "web-new", "web-new conflicted", |o| {
        is(o, "Conflicted", "True")
    })
    .await
    .with_context(log)?;
    let c = condition(&o, "Conflicted").context("Conflicted")?;
    assert_eq!(c["reason"], "OlderResourceWins");
    assert!(
        c["message"].as_str().is_some_and(|m| m.contains("web-old")),
        "{c}"
    );
    assert_eq!(o.data["status"]["matchedPods"], 0);
    let ev = event(&client, &ns, "web-new", "Conflicted").await?;
    assert_eq!(ev.type_.as_deref(), Some("Warning"));

    // Manual: a restart-only change is reported and nothing is rolled.
    slc.patch(
        "api",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"proxy": {"concurrency": 3}}})),
    )
    .await?;
    let o = status_where(&slc, "api", "api RestartRequired", |o| {
        is(o, "RestartRequired", "True")
    })
    .await
    .with_context(log)?;
    assert_eq!(
        condition(&o, "RestartRequired").context("cond")?["reason"],
        "ManualRestartNeeded"
    );
    event(&client, &ns, "api", "RestartRequired").await?;

    // Live retuning: a drain setting reaches the running pods' annotation,
    // with no rollout.
    slc.patch(
        "web-old",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"shutdown": {"drainDuration": "20s", "exitOnZeroActiveConnections": true}}})),
    )
    .await?;
    let pods_api = s.pods(&ns);
    wait_until(DEADLINE, "web pods retuned", || async {
        let list = pods_api
            .list(&ListParams::default().labels("app=web"))
            .await?;
        let done = list.items.len() == 2
            && list.items.iter().all(|p| {
                let l = lifecycle_annotation(p);
                l["shutdown"]["drainDuration"] == "20s"
                    && l["shutdown"]["exitOnZeroActiveConnections"] == true
            });
        Ok::<_, anyhow::Error>(done.then_some(()))
    })
    .await
    .with_context(log)?;
    let first = web[0].metadata.name.clone().unwrap_or_default();
    event(&client, &ns, &first, "LifecycleRetuned").await?;
    event(&client, &ns, "web-old", "PodsRetuned").await?;

    // A hand edit of a pod's settings is put back by the resource that
    // governs it (a change of only that annotation triggers its governor).
    let retuned = lifecycle_annotation(&pods_api.get(&first).await?);
    let mut edited = retuned.clone();
    edited["shutdown"]["drainDuration"] = json!("1s");
    pods_api
        .patch_metadata(
            &first,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                remora_contract::annotations::LIFECYCLE: edited.to_string()
            }}})),
        )
        .await?;
    wait_until(DEADLINE, "the hand-edited pod put back", || async {
        let now = lifecycle_annotation(&pods_api.get(&first).await?);
        Ok::<_, anyhow::Error>((now == retuned).then_some(()))
    })
    .await
    .with_context(log)?;
    let o = status_where(&slc, "web-old", "web-old at generation 2", |o| {
        o.data["status"]["observedGeneration"] == 2
    })
    .await?;
    assert!(
        is(&o, "RestartRequired", "False"),
        "drain settings need no restart"
    );
    assert_eq!(replicasets(&client, &ns, "web").await?.len(), 1);

    // Automatic: a restart-only change rolls the Deployment to a new
    // ReplicaSet whose pods are injected with the new settings.
    slc.patch(
        "web-old",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"proxy": {"concurrency": 4}}})),
    )
    .await?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let want = wait_until(DEADLINE, "the web Deployment rolled", || async {
        let d = deployments.get("web").await?;
        Ok::<_, anyhow::Error>(template_annotation(&d))
    })
    .await
    .with_context(log)?;
    let rs = wait_until(DEADLINE, "a second ReplicaSet", || async {
        let list = replicasets(&client, &ns, "web").await?;
        Ok::<_, anyhow::Error>((list.len() == 2).then_some(list))
    })
    .await?;
    assert!(rs.iter().any(|r| {
        r.spec
            .as_ref()
            .and_then(|s| s.template.as_ref())
            .and_then(|t| t.metadata.as_ref())
            .and_then(|m| m.annotations.as_ref())
            .and_then(|a| a.get(ROLLOUT_ANNOTATION))
            == Some(&want)
    }));
    let fresh = wait_until(DEADLINE, "a pod of the new ReplicaSet", || async {
        let list = pods_api
            .list(&ListParams::default().labels("app=web"))
            .await?;
        Ok::<_, anyhow::Error>(list.items.into_iter().find(|p| {
            p.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ROLLOUT_ANNOTATION))
                == Some(&want)
        }))
    })
    .await?;
    let status: Value = serde_json::from_str(
        fresh
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("remora.dev/status"))
            .context("status annotation")?,
    )?;
    assert_eq!(
        status["restartHash"],
        want.as_str(),
        "the new pod carries the new settings"
    );
    let o = status_where(&slc, "web-old", "web-old RestartRequired", |o| {
        is(o, "RestartRequired", "True")
    })
    .await?;
    assert_eq!(
        condition(&o, "RestartRequired").context("cond")?["reason"],
        "RollingOut"
    );
    event(&client, &ns, "web-old", "RolloutTriggered").await?;

    // Manual still rolled nothing, long after its decision.
    let api_deploy = deployments.get("api").await?;
    assert_eq!(template_annotation(&api_deploy), None);
    assert_eq!(replicasets(&client, &ns, "api").await?.len(), 1);

    // Deleting the winner ends the conflict.
    slc.delete("web-old", &Default::default()).await?;
    status_where(&slc, "web-new", "web-new no longer conflicted", |o| {
        is(o, "Conflicted", "False")
    })
    .await
    .with_context(log)?;
    event(&client, &ns, "web-new", "ConflictResolved").await?;

    // Deleting the only resource that reaches the api pod: it goes back to
    // the chart's default drain.
    slc.delete("api", &Default::default()).await?;
    let api_pod = api_pods[0].metadata.name.clone().unwrap_or_default();
    wait_until(
        DEADLINE,
        "the api pod back to the default drain",
        || async {
            let p = pods_api.get(&api_pod).await?;
            let back = lifecycle_annotation(&p)["shutdown"]["drainDuration"] == "45s";
            Ok::<_, anyhow::Error>(back.then_some(()))
        },
    )
    .await
    .with_context(log)?;

    // A finished pod no longer counts (the controller watches live pods).
    slc.create(&pp, &lifecycle("batch", "batch", json!({}))?)
        .await?;
    let mut batch = pod("batch-1", &[("app", "batch")], &[]);
    if let Some(spec) = batch.spec.as_mut() {
        spec.restart_policy = Some("Never".into());
    }
    pods_api.create(&pp, &batch).await?;
    status_where(&slc, "batch", "batch matches its pod", |o| {
        o.data["status"]["matchedPods"] == 1
    })
    .await
    .with_context(log)?;
    kubelet.start(&ns, "batch-1").await?;
    kubelet.exit(&ns, "batch-1", "app", 0).await?;
    let done = kubelet.exit(&ns, "batch-1", "remora-proxy", 0).await?;
    assert_eq!(
        done.status.and_then(|s| s.phase).as_deref(),
        Some("Succeeded")
    );
    status_where(&slc, "batch", "the finished pod no longer counts", |o| {
        o.data["status"]["matchedPods"] == 0
    })
    .await
    .with_context(log)?;

    // Its metrics, over the operator's own TLS.
    let mut c = remora_test_support::webhook_client::connect(
        s.operator.addr(),
        "localhost",
        s.operator.ca_pem(),
    )
    .await?;
    let (code, body) = c.request(http::Method::GET, "/metrics", Vec::new()).await?;
    assert_eq!(code.as_u16(), 200);
    let metrics = String::from_utf8_lossy(&body);
    for m in [
        "remora_operator_controller_reconciles_total{result=\"ok\"}",
        "remora_operator_controller_rollouts_total 1",
        "remora_operator_controller_pods_retuned_total",
        "remora_operator_controller_reconcile_duration_seconds_count",
        "remora_operator_leader 1",
    ] {
        assert!(metrics.contains(m), "{m} missing from:\n{metrics}");
    }
    Ok(s.cleanup().await?)
}
