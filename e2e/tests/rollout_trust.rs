//! Rollouts trust only what the API server says (issue 13): a user who may
//! only create pods writes a pod's labels, its `remora.dev/status` and its
//! ownerReferences, and must not thereby make the SidecarLifecycle
//! controller roll someone else's workload, nor (issue 27) a workload its
//! resource governs whose template is not out of date.
//!
//! The control plane runs without kube-controller-manager: its ReplicaSet
//! controller would release the forged pods and its garbage collector
//! delete them, racing the controller under test. The ReplicaSets are made
//! by hand, owned by their Deployments as the deployment controller would.

use std::collections::BTreeMap;

use anyhow::Context;
use e2e::controlplane::{ControlPlane, Options, service_account_token};
use e2e::webhook::{DEADLINE, Setup, lifecycles, pod};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{ListParams, PostParams};
use kube::{Api, Client};
use remora_test_support::wait::wait_until;
use serde_json::json;

const ROLLOUT_ANNOTATION: &str = "remora.dev/restarted-for";

/// A Deployment and the ReplicaSet it controls (no pods: nothing runs them).
async fn workload(client: &Client, ns: &str, app: &str) -> anyhow::Result<ReplicaSet> {
    let labels = BTreeMap::from([("app".to_owned(), app.to_owned())]);
    let d = Api::<Deployment>::namespaced(client.clone(), ns)
        .create(
            &PostParams::default(),
            &e2e::controlplane::deployment(app, 1, labels, pod("unused", &[], &[]).spec),
        )
        .await?;
    let rs: ReplicaSet = serde_json::from_value(json!({
        "metadata": {
            "name": format!("{app}-1"),
            "labels": {"app": app},
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "Deployment", "name": app,
                "uid": d.metadata.uid, "controller": true,
            }],
        },
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": app}},
            "template": {
                "metadata": {"labels": {"app": app}},
                "spec": {"containers": [{"name": "app", "image": "registry.invalid/app:1"}]},
            },
        },
    }))?;
    Ok(Api::<ReplicaSet>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &rs)
        .await?)
}

/// A pod that claims to be a ReplicaSet's, injected with settings it
/// names itself (the webhook leaves a pod with `remora.dev/status` alone).
fn claiming(name: &str, app: &str, rs: &str, uid: &str, restart_hash: &str) -> Pod {
    let status = json!({"sources": ["chart"], "restartHash": restart_hash}).to_string();
    let mut p = pod(name, &[("app", app)], &[("remora.dev/status", &status)]);
    p.metadata.owner_references = Some(vec![OwnerReference {
        api_version: "apps/v1".into(),
        kind: "ReplicaSet".into(),
        name: rs.into(),
        uid: uid.into(),
        controller: Some(true),
        ..OwnerReference::default()
    }]);
    p
}

/// A client for a ServiceAccount that may create pods in `ns`, nothing else.
async fn pods_only_user(cp: &ControlPlane, admin: &Client, ns: &str) -> anyhow::Result<Client> {
    let pp = PostParams::default();
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "mallory"}}))?;
    Api::<ServiceAccount>::namespaced(admin.clone(), ns)
        .create(&pp, &sa)
        .await?;
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "create-pods"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}],
    }))?;
    Api::<Role>::namespaced(admin.clone(), ns)
        .create(&pp, &role)
        .await?;
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "mallory-creates-pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "create-pods"},
        "subjects": [{"kind": "ServiceAccount", "name": "mallory", "namespace": ns}],
    }))?;
    Api::<RoleBinding>::namespaced(admin.clone(), ns)
        .create(&pp, &binding)
        .await?;
    let token = service_account_token(admin, ns, "mallory").await?;
    Ok(cp.client_with_token(&token)?)
}

/// Waits for a Warning `RolloutRefused` naming `pod`, and returns its note.
async fn refusal(client: &Client, ns: &str, pod: &str) -> anyhow::Result<String> {
    let api: Api<Event> = Api::namespaced(client.clone(), ns);
    let note = wait_until(DEADLINE, &format!("RolloutRefused for {pod}"), || async {
        let list = api.list(&ListParams::default()).await?;
        Ok::<_, anyhow::Error>(list.items.into_iter().find_map(|e| {
            (e.reason.as_deref() == Some("RolloutRefused")
                && e.type_.as_deref() == Some("Warning")
                && e.related.as_ref().and_then(|r| r.name.as_deref()) == Some(pod))
            .then(|| e.note.unwrap_or_default())
        }))
    })
    .await?;
    Ok(note)
}

async fn rolled_for(client: &Client, ns: &str, name: &str) -> kube::Result<Option<String>> {
    let d = Api::<Deployment>::namespaced(client.clone(), ns)
        .get(name)
        .await?;
    Ok(d.spec
        .and_then(|s| s.template.metadata)
        .and_then(|m| m.annotations)
        .and_then(|a| a.get(ROLLOUT_ANNOTATION).cloned()))
}

#[tokio::test]
async fn forged_owners_and_status_roll_nothing() -> anyhow::Result<()> {
    let cp = ControlPlane::shared_with(Options::without_controller_manager()).await?;
    let s = Setup::with("trust", "Fail", |o| {
        o.controller = true;
        o.args.push("--automatic-rollouts".into());
    })
    .await?;
    let log = || s.operator.log_tail();
    let admin = s.client.clone();
    let ns = s.enabled.clone();
    let pp = PostParams::default();

    // "bait" governs app=bait and rolls automatically; nothing governs the
    // victim. "web" governs the web Deployment and rolls automatically.
    let slc = lifecycles(&admin, &ns);
    for (name, app) in [("bait", "bait"), ("web", "web")] {
        let spec = json!({"rolloutPolicy": "Automatic", "selector": {"matchLabels": {"app": app}}});
        slc.create(&pp, &e2e::webhook::lifecycle(name, spec)?)
            .await?;
    }
    let victim = workload(&admin, &ns, "victim").await?;
    let web = workload(&admin, &ns, "web").await?;
    let victim_rs_uid = victim.metadata.uid.clone().context("no uid")?;
    let web_rs_uid = web.metadata.uid.clone().context("no uid")?;

    let mallory = pods_only_user(cp, &admin, &ns).await?;
    let mallory_pods: Api<Pod> = Api::namespaced(mallory, &ns);
    // The user may indeed do nothing but create pods.
    let denied = mallory_pods.list(&ListParams::default()).await;
    assert!(
        matches!(&denied, Err(kube::Error::Api(e)) if e.code == 403),
        "{denied:?}"
    );

    // 1. Governed by "bait", outdated by its own word, and owned (with the
    //    right UID, as if it had learned it) by the victim's ReplicaSet.
    mallory_pods
        .create(
            &pp,
            &claiming("forged-owner", "bait", "victim-1", &victim_rs_uid, "forged"),
        )
        .await?;
    // 2. Governed by "web", claiming the web ReplicaSet by name with a UID
    //    that is not its.
    mallory_pods
        .create(
            &pp,
            &claiming(
                "forged-uid",
                "web",
                "web-1",
                "00000000-0000-0000-0000-000000000001",
                "forged",
            ),
        )
        .await?;

    let note = refusal(&admin, &ns, "forged-owner")
        .await
        .with_context(log)?;
    assert!(
        note.contains("Deployment")
            && note.contains("victim")
            && note.contains("no SidecarLifecycle governs"),
        "{note}"
    );
    let note = refusal(&admin, &ns, "forged-uid").await.with_context(log)?;
    assert!(note.contains("web-1") && note.contains("UID"), "{note}");
    // The reconciles that refused are done: nothing was rolled.
    assert_eq!(rolled_for(&admin, &ns, "victim").await?, None);
    assert_eq!(rolled_for(&admin, &ns, "web").await?, None);

    // 3. The true owner chain, but the web Deployment's template is not out
    //    of date: its own pod (made as its ReplicaSet would make it,
    //    injected by the webhook from the template) runs with what the
    //    template gets now. A pod claiming otherwise rolls nothing.
    let pods = Api::<Pod>::namespaced(admin.clone(), &ns);
    let mut genuine = pod("web-1-genuine", &[("app", "web")], &[]);
    genuine.metadata.owner_references = claiming("x", "web", "web-1", &web_rs_uid, "x")
        .metadata
        .owner_references;
    pods.create(&pp, &genuine).await?;
    let injected = pods.get("web-1-genuine").await?;
    let status = injected
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("remora.dev/status"))
        .context("the webhook injected the ReplicaSet's pod")?;
    let current: serde_json::Value = serde_json::from_str(status)?;
    let current = current["restartHash"].as_str().context("restartHash")?;
    mallory_pods
        .create(
            &pp,
            &claiming("forged-status", "web", "web-1", &web_rs_uid, "forged"),
        )
        .await?;
    // Whichever comes first: the refusal, or (the attack working) a rollout.
    let note = tokio::select! {
        note = refusal(&admin, &ns, "forged-status") => note.with_context(log)?,
        rolled = wait_until(DEADLINE, "web rolled", || async {
            Ok::<_, anyhow::Error>(rolled_for(&admin, &ns, "web").await?)
        }) => anyhow::bail!("a forged remora.dev/status rolled web to {rolled:?}"),
    };
    assert!(
        note.contains("not out of date") && note.contains("web-1-genuine"),
        "{note}"
    );
    assert_eq!(rolled_for(&admin, &ns, "web").await?, None);

    // A restart-only change does make the template out of date: the
    // ReplicaSet's own pod is then outdated too, and web rolls, so the
    // refusals above come from the checks, not from a controller that
    // rolls nothing.
    slc.patch(
        "web",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({"spec": {"proxy": {"concurrency": 4}}})),
    )
    .await?;
    let want = wait_until(DEADLINE, "web rolled", || async {
        Ok::<_, anyhow::Error>(rolled_for(&admin, &ns, "web").await?)
    })
    .await
    .with_context(log)?;
    assert_ne!(want, current);
    assert_ne!(want, "forged");
    assert_eq!(rolled_for(&admin, &ns, "victim").await?, None);
    s.cleanup().await?;
    Ok(())
}
