//! Least privilege of the operator's identity on the real API server: the
//! chart's RBAC and ValidatingAdmissionPolicy installed, and requests made
//! with a real token of the chart's ServiceAccount (TokenRequest), in the
//! very shapes the operator's code makes them (same kube calls, field
//! manager and patch types). What it must do passes; anything else is
//! refused with the policy's message, even once RBAC grants it everything.

use std::collections::BTreeMap;
use std::fmt::Debug;

use anyhow::{Context, bail};
use e2e::chart::refused_by_policy;
use e2e::controlplane::{ControlPlane, service_account_token};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, PodSpec, Secret};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
    PostParams,
};
use kube::runtime::events::{Event as RecorderEvent, EventType, Recorder, Reporter};
use kube::{Api, Client, Resource};
use remora_contract::annotations::{LIFECYCLE, STOP};
use remora_operator::controllers::lifecycle::ROLLOUT_ANNOTATION;
use remora_operator::identity::FIELD_MANAGER;
use remora_test_support::wait::wait_until;
use serde_json::{Value, json};

/// The policy's messages (charts/remora/templates/admissionpolicy.yaml).
const POD_RULE: &str = "may change a pod only in its remora.dev/* annotations";
const WORKLOAD_RULE: &str =
    "may change a workload only in the remora.dev/restarted-for annotation of its pod template";
const WEBHOOK_RULE: &str =
    "may change its MutatingWebhookConfiguration only in the webhooks' clientConfig.caBundle";
const EVENT_RULE: &str = "Events must name remora-operator as their reporting controller";

/// The first rule's message: a write of a kind (or verb) it never makes.
fn not_at_all(op: &str, target: &str, object: &str) -> String {
    format!("the Remora operator may not {op} {target} {object}: it writes only what Remora owns")
}

/// `result` must be the policy's refusal, with `message`.
fn refused<T: Debug>(
    policy: &str,
    what: &str,
    message: &str,
    result: kube::Result<T>,
) -> anyhow::Result<()> {
    match result {
        Err(e) if refused_by_policy(&e, policy) && e.to_string().contains(message) => Ok(()),
        other => bail!("{what}: want the policy's refusal \"{message}\", got {other:?}"),
    }
}

/// `result` must be RBAC's refusal (the policy is never asked).
fn refused_by_rbac<T: Debug>(what: &str, result: kube::Result<T>) -> anyhow::Result<()> {
    match result {
        Err(kube::Error::Api(s))
            if s.code == 403
                && s.message.contains("cannot")
                && !s.message.contains("ValidatingAdmissionPolicy") => {}
        other => bail!("{what}: want RBAC's refusal, got {other:?}"),
    }
    Ok(())
}

fn annotation(meta: &kube::api::ObjectMeta, key: &str) -> Option<String> {
    meta.annotations.as_ref()?.get(key).cloned()
}

fn workload_api(client: &Client, ns: &str, kind: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("apps", "v1", kind);
    Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk))
}

/// The rollout's write (operator/src/controllers/lifecycle/rollout.rs).
async fn roll(client: &Client, ns: &str, kind: &str, name: &str, hash: &str) -> kube::Result<()> {
    let patch = Patch::Apply(json!({
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": name, "namespace": ns},
        "spec": {"template": {"metadata": {"annotations": {ROLLOUT_ANNOTATION: hash}}}},
    }));
    workload_api(client, ns, kind)
        .patch(name, &PatchParams::apply(FIELD_MANAGER).force(), &patch)
        .await?;
    Ok(())
}

/// A server-side apply of `spec` to workload `kind/name`, as the operator's
/// field manager: what a compromised operator would send.
async fn apply_spec(
    client: &Client,
    ns: &str,
    kind: &str,
    name: &str,
    spec: Value,
) -> kube::Result<DynamicObject> {
    let patch = Patch::Apply(json!({
        "apiVersion": "apps/v1", "kind": kind,
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }));
    workload_api(client, ns, kind)
        .patch(name, &PatchParams::apply(FIELD_MANAGER).force(), &patch)
        .await
}

fn json_patch(ops: Value) -> anyhow::Result<Patch<()>> {
    Ok(Patch::Json(serde_json::from_value(ops)?))
}

fn labels(app: &str) -> BTreeMap<String, String> {
    BTreeMap::from([("app".to_owned(), app.to_owned())])
}

fn pod_spec() -> PodSpec {
    PodSpec {
        containers: vec![Container {
            name: "app".into(),
            image: Some("registry.invalid/app:1".into()),
            ..Container::default()
        }],
        ..PodSpec::default()
    }
}

/// The workloads and the pod the operator's identity works on, made by the
/// admin in `ns`.
async fn workloads(admin: &Client, ns: &str) -> anyhow::Result<()> {
    let pp = PostParams::default();
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "app", "labels": {"app": "app"},
            "annotations": {"example.com/owner": "team-a", LIFECYCLE: "{}"}},
        "spec": pod_spec(),
    }))?;
    Api::<Pod>::namespaced(admin.clone(), ns)
        .create(&pp, &pod)
        .await?;
    let web = e2e::controlplane::deployment("web", 1, labels("web"), Some(pod_spec()));
    Api::<Deployment>::namespaced(admin.clone(), ns)
        .create(&pp, &web)
        .await?;
    let template = json!({"metadata": {"labels": {"app": "agent"}}, "spec": pod_spec()});
    let ds: DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": "agent"},
        "spec": {"selector": {"matchLabels": {"app": "agent"}}, "template": template},
    }))?;
    Api::<DaemonSet>::namespaced(admin.clone(), ns)
        .create(&pp, &ds)
        .await?;
    let template = json!({"metadata": {"labels": {"app": "db"}}, "spec": pod_spec()});
    let sts: StatefulSet = serde_json::from_value(json!({
        "metadata": {"name": "db"},
        "spec": {"serviceName": "db", "selector": {"matchLabels": {"app": "db"}},
            "template": template},
    }))?;
    Api::<StatefulSet>::namespaced(admin.clone(), ns)
        .create(&pp, &sts)
        .await?;
    Ok(())
}

#[tokio::test]
async fn operator_identity_changes_only_what_remora_owns() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    let admin = cp.client()?;
    // The release namespace, and the one of the workloads.
    let ns = cp.create_namespace(&admin, "lp").await?;
    let work = cp.create_namespace(&admin, "lp-work").await?;
    // The namespace as release name: the cluster-scoped objects (roles,
    // webhook configuration, policy) are this test's own.
    let release = ns.clone();
    let name = format!("{release}-remora-operator");
    // Without the workload CA (on by default), whose rights the last test
    // of this file checks on their own.
    let objects = e2e::chart::render(
        &release,
        &ns,
        &["rollouts.automatic=true", "workloadCA.enabled=false"],
    )?;
    let mut cluster_scoped =
        e2e::chart::apply(&admin, &ns, &objects, &e2e::chart::IDENTITY_KINDS).await?;
    workloads(&admin, &work).await?;
    // Another webhook configuration, which the operator must never touch.
    let mwcs = Api::<MutatingWebhookConfiguration>::all(admin.clone());
    let other_name = format!("{release}-other");
    let other: MutatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": other_name}, "webhooks": []}))?;
    mwcs.create(&PostParams::default(), &other).await?;

    let token = service_account_token(&admin, &ns, &name).await?;
    let operator = cp.client_with_token(&token)?;
    let pods = Api::<Pod>::namespaced(operator.clone(), &work);
    let own_mwc = Api::<MutatingWebhookConfiguration>::all(operator.clone());
    let retime = json_patch(json!(
        [{"op": "replace", "path": "/webhooks/0/timeoutSeconds", "value": 29}]))?;
    let dry_run = PatchParams::default().dry_run();
    e2e::chart::wait_until_policy_refuses(&name, || own_mwc.patch(&name, &dry_run, &retime))
        .await?;

    // --- What the operator does passes. ---
    // Retuning a running pod (controller/retune.rs): a merge patch of
    // remora.dev/lifecycle, no field manager.
    let retuned = r#"{"drainDuration":"30s"}"#;
    pods.patch_metadata(
        "app",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {LIFECYCLE: retuned}}})),
    )
    .await
    .context("retuning the lifecycle annotation")?;
    // Stopping a Job's sidecar (jobs.rs): remora.dev/stop, with its field manager.
    pods.patch_metadata(
        "app",
        &PatchParams::apply(FIELD_MANAGER),
        &Patch::Merge(json!({"metadata": {"annotations": {STOP: "2024-01-01T00:00:00Z"}}})),
    )
    .await
    .context("setting remora.dev/stop")?;
    let pod = Api::<Pod>::namespaced(admin.clone(), &work)
        .get("app")
        .await?;
    assert_eq!(
        annotation(&pod.metadata, LIFECYCLE).as_deref(),
        Some(retuned)
    );
    assert!(annotation(&pod.metadata, STOP).is_some());
    // Removing one of its own annotations is its business too.
    pods.patch_metadata(
        "app",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {STOP: null}}})),
    )
    .await
    .context("removing remora.dev/stop")?;

    // Rolling each kind of workload, twice (the second time the annotation
    // and its managed field exist already).
    for (kind, name) in [
        ("Deployment", "web"),
        ("StatefulSet", "db"),
        ("DaemonSet", "agent"),
    ] {
        for hash in ["h1", "h2"] {
            roll(&operator, &work, kind, name, hash)
                .await
                .with_context(|| format!("rolling {kind} {name} to {hash}"))?;
        }
        let obj = workload_api(&admin, &work, kind).get(name).await?;
        assert_eq!(
            obj.data["spec"]["template"]["metadata"]["annotations"][ROLLOUT_ANNOTATION], "h2",
            "{kind} {name}"
        );
    }

    // Its Events (kube-runtime's Recorder, as the controller and the Jobs
    // controller use it): the second of two alike is a patch of the series.
    let recorder = Recorder::new(
        operator.clone(),
        Reporter {
            controller: FIELD_MANAGER.into(),
            instance: Some("least-privilege".into()),
        },
    );
    let decision = RecorderEvent {
        type_: EventType::Normal,
        reason: "RolloutTriggered".into(),
        note: Some("rolling for the test".into()),
        action: "Rollout".into(),
        secondary: None,
    };
    for _ in 0..2 {
        recorder
            .publish(&decision, &pod.object_ref(&()))
            .await
            .context("publishing an Event")?;
    }
    let series = Api::<Event>::namespaced(admin.clone(), &work)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .find(|e| e.reason.as_deref() == Some("RolloutTriggered"))
        .and_then(|e| e.series)
        .context("no Event series")?;
    assert_eq!(series.count, 2);

    // Keeping its CA in its own webhook configuration (ca.rs).
    let ca = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
    let current = own_mwc.get(&name).await?;
    let ops = remora_operator::pki::webhook_cert::ca_bundle_patch(&current, ca);
    assert_eq!(ops.len(), 2, "both webhooks lack the CA");
    own_mwc
        .patch(
            &name,
            &PatchParams::default(),
            &json_patch(Value::Array(ops))?,
        )
        .await
        .context("patching caBundle")?;
    let patched = mwcs.get(&name).await?;
    for w in patched.webhooks.unwrap_or_default() {
        assert_eq!(
            w.client_config.ca_bundle.map(|b| b.0),
            Some(ca.as_bytes().to_vec())
        );
    }

    // --- Anything else that RBAC lets through, the policy refuses. ---
    let image = json_patch(json!(
        [{"op": "replace", "path": "/spec/containers/0/image", "value": "evil.example/app:1"}]))?;
    refused(
        &name,
        "a pod's image",
        POD_RULE,
        pods.patch("app", &PatchParams::default(), &image).await,
    )?;
    let with_image = json_patch(json!([
        {"op": "add", "path": "/metadata/annotations/remora.dev~1lifecycle", "value": "{}"},
        {"op": "replace", "path": "/spec/containers/0/image", "value": "evil.example/app:1"}]))?;
    refused(
        &name,
        "a remora.dev annotation together with a pod's image",
        POD_RULE,
        pods.patch("app", &PatchParams::default(), &with_image)
            .await,
    )?;
    for (what, patch) in [
        (
            "another annotation of a pod",
            json!({"metadata": {"annotations": {"example.com/owner": "mallory"}}}),
        ),
        (
            "removing another annotation of a pod",
            json!({"metadata": {"annotations": {"example.com/owner": null}}}),
        ),
        (
            "a pod's labels",
            json!({"metadata": {"labels": {"app": "other"}}}),
        ),
    ] {
        refused(
            &name,
            what,
            POD_RULE,
            pods.patch("app", &PatchParams::default(), &Patch::Merge(patch))
                .await,
        )?;
    }
    let pod = Api::<Pod>::namespaced(admin.clone(), &work)
        .get("app")
        .await?;
    assert_eq!(
        pod.spec
            .as_ref()
            .and_then(|s| s.containers[0].image.as_deref()),
        Some("registry.invalid/app:1")
    );
    assert_eq!(
        annotation(&pod.metadata, "example.com/owner").as_deref(),
        Some("team-a")
    );

    // A DaemonSet's template: its containers, alone or with the restart
    // annotation.
    let containers = json!({"template": {"spec": {"containers": [
        {"name": "app", "image": "evil.example/app:1"}]}}});
    refused(
        &name,
        "a DaemonSet's containers",
        WORKLOAD_RULE,
        apply_spec(&operator, &work, "DaemonSet", "agent", containers).await,
    )?;
    let both = json!({"template": {
        "metadata": {"annotations": {ROLLOUT_ANNOTATION: "h3"}},
        "spec": {"containers": [{"name": "app", "image": "evil.example/app:1",
            "env": [{"name": "X", "value": "1"}]}]}}});
    refused(
        &name,
        "a DaemonSet's restart annotation together with its containers",
        WORKLOAD_RULE,
        apply_spec(&operator, &work, "DaemonSet", "agent", both).await,
    )?;
    let ds = Api::<DaemonSet>::namespaced(admin.clone(), &work)
        .get("agent")
        .await?;
    let template = ds.spec.context("no spec")?.template;
    assert_eq!(
        template.spec.context("no pod spec")?.containers[0]
            .image
            .as_deref(),
        Some("registry.invalid/app:1")
    );
    let deploy = workload_api(&operator, &work, "Deployment");
    for (what, patch) in [
        ("a Deployment's replicas", json!({"spec": {"replicas": 5}})),
        (
            "another annotation of a Deployment's template",
            json!({"spec": {"template": {"metadata": {"annotations": {
                "kubectl.kubernetes.io/restartedAt": "now"}}}}}),
        ),
        (
            "a Deployment's own annotations",
            json!({"metadata": {"annotations": {"example.com/x": "y"}}}),
        ),
    ] {
        refused(
            &name,
            what,
            WORKLOAD_RULE,
            deploy
                .patch("web", &PatchParams::default(), &Patch::Merge(patch))
                .await,
        )?;
    }

    // Its own webhook configuration, beyond caBundle.
    refused(
        &name,
        "its webhook configuration's timeout",
        WEBHOOK_RULE,
        own_mwc.patch(&name, &PatchParams::default(), &retime).await,
    )?;
    let fail_open = json_patch(json!(
        [{"op": "replace", "path": "/webhooks/1/failurePolicy", "value": "Ignore"}]))?;
    refused(
        &name,
        "its webhook configuration's failurePolicy",
        WEBHOOK_RULE,
        own_mwc
            .patch(&name, &PatchParams::default(), &fail_open)
            .await,
    )?;

    // RBAC cannot limit create by name; the policy does.
    let lease: Lease = serde_json::from_value(json!({"metadata": {"name": "someone-else"}}))?;
    refused(
        &name,
        "a Lease not its own",
        &not_at_all(
            "CREATE",
            "coordination.k8s.io/leases",
            &format!("{ns}/someone-else"),
        ),
        Api::<Lease>::namespaced(operator.clone(), &ns)
            .create(&PostParams::default(), &lease)
            .await,
    )?;
    let secret: Secret = serde_json::from_value(json!({"metadata": {"name": "stolen"}}))?;
    refused(
        &name,
        "a Secret not its own",
        &not_at_all("CREATE", "/secrets", &format!("{ns}/stolen")),
        Api::<Secret>::namespaced(operator.clone(), &ns)
            .create(&PostParams::default(), &secret)
            .await,
    )?;
    let spoofed: Event = serde_json::from_value(json!({
        "metadata": {"name": "app.spoofed"},
        "eventTime": "2024-01-01T00:00:00.000000Z",
        "reportingController": "kubelet", "reportingInstance": "node-1",
        "action": "Killing", "reason": "Killing", "type": "Normal",
        "regarding": {"kind": "Pod", "name": "app", "namespace": work}}))?;
    refused(
        &name,
        "an Event in another component's name",
        EVENT_RULE,
        Api::<Event>::namespaced(operator.clone(), &work)
            .create(&PostParams::default(), &spoofed)
            .await,
    )?;

    // What the chart's RBAC does not grant never reaches the policy.
    let relabel = Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}}));
    refused_by_rbac(
        "another webhook configuration",
        own_mwc
            .patch(&other_name, &PatchParams::default(), &relabel)
            .await,
    )?;
    refused_by_rbac(
        "deleting a pod",
        pods.delete("app", &DeleteParams::default()).await,
    )?;

    // --- Bound to cluster-admin too (a binding added by mistake), it can
    // still change only what Remora owns. ---
    let crb_name = format!("{release}-too-much");
    let crb: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": crb_name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
            "name": "cluster-admin"},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]}))?;
    let crbs = Api::<ClusterRoleBinding>::all(admin.clone());
    crbs.create(&PostParams::default(), &crb).await?;
    cluster_scoped.push((
        Api::all_with(
            admin.clone(),
            &ApiResource::erase::<ClusterRoleBinding>(&()),
        ),
        crb_name,
    ));
    // RBAC's turn is over once the policy, not RBAC, refuses this.
    e2e::chart::wait_until_policy_refuses(&name, || own_mwc.patch(&other_name, &dry_run, &relabel))
        .await?;
    refused(
        &name,
        "another webhook configuration, as cluster-admin",
        &not_at_all(
            "UPDATE",
            "admissionregistration.k8s.io/mutatingwebhookconfigurations",
            &other_name,
        ),
        own_mwc
            .patch(&other_name, &PatchParams::default(), &relabel)
            .await,
    )?;
    refused(
        &name,
        "deleting a pod, as cluster-admin",
        &not_at_all("DELETE", "/pods", &format!("{work}/app")),
        pods.delete("app", &DeleteParams::default()).await,
    )?;
    refused(
        &name,
        "a pod's status, as cluster-admin",
        &not_at_all("UPDATE", "/pods/status", &format!("{work}/app")),
        pods.patch_status(
            "app",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"message": "x"}})),
        )
        .await,
    )?;
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "c"}}))?;
    refused(
        &name,
        "a ConfigMap, as cluster-admin",
        &not_at_all("CREATE", "/configmaps", &format!("{work}/c")),
        Api::<ConfigMap>::namespaced(operator.clone(), &work)
            .create(&PostParams::default(), &cm)
            .await,
    )?;
    let rs_name = Api::<ReplicaSet>::namespaced(admin.clone(), &work)
        .list(&ListParams::default().labels("app=web"))
        .await?
        .items
        .into_iter()
        .find_map(|r| r.metadata.name)
        .context("the Deployment has no ReplicaSet")?;
    refused(
        &name,
        "a ReplicaSet, as cluster-admin",
        &not_at_all("UPDATE", "apps/replicasets", &format!("{work}/{rs_name}")),
        Api::<ReplicaSet>::namespaced(operator.clone(), &work)
            .patch(&rs_name, &PatchParams::default(), &relabel)
            .await,
    )?;
    let escalate: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": format!("{release}-escalate")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
            "name": "cluster-admin"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": ns}]}))?;
    refused(
        &name,
        "a ClusterRoleBinding, as cluster-admin",
        &not_at_all(
            "CREATE",
            "rbac.authorization.k8s.io/clusterrolebindings",
            &format!("{release}-escalate"),
        ),
        Api::<ClusterRoleBinding>::all(operator.clone())
            .create(&PostParams::default(), &escalate)
            .await,
    )?;
    refused(
        &name,
        "a pod's image, as cluster-admin",
        POD_RULE,
        pods.patch("app", &PatchParams::default(), &image).await,
    )?;
    let containers = json!({"template": {"spec": {"containers": [
        {"name": "app", "image": "evil.example/app:1"}]}}});
    refused(
        &name,
        "a DaemonSet's containers, as cluster-admin",
        WORKLOAD_RULE,
        apply_spec(&operator, &work, "DaemonSet", "agent", containers).await,
    )?;
    // And what it does still passes.
    roll(&operator, &work, "DaemonSet", "agent", "h3")
        .await
        .context("rolling the DaemonSet as cluster-admin")?;

    for (api, n) in cluster_scoped {
        api.delete(&n, &DeleteParams::default()).await?;
    }
    mwcs.delete(&other_name, &DeleteParams::default()).await?;
    cp.delete_namespace(&admin, &work).await?;
    cp.delete_namespace(&admin, &ns).await?;
    Ok(())
}

/// The message of the policy's refusal in an excluded namespace.
fn excluded(ns: &str) -> String {
    format!(
        "the Remora operator may not write in namespace {ns}: it is excluded from injection (webhook.excludeNamespaces)"
    )
}

/// With the chart's defaults (rollouts.automatic off) the operator's
/// identity cannot touch a workload: RBAC grants nothing on them, and the
/// policy refuses a rollout even once RBAC grants everything. In the
/// namespaces never sent to the webhook (and, for pods, workloads and
/// ConfigMaps, its own) the policy refuses what RBAC grants cluster-wide:
/// the trust bundle's create, a pod's remora.dev annotations.
#[tokio::test]
async fn without_automatic_rollouts_no_workload_and_nothing_in_excluded_namespaces()
-> anyhow::Result<()> {
    use remora_contract::workload_ca::TRUST_BUNDLE_CONFIGMAP;

    let cp = ControlPlane::shared().await?;
    let admin = cp.client()?;
    let ns = cp.create_namespace(&admin, "lp-off").await?;
    let work = cp.create_namespace(&admin, "lp-off-work").await?;
    let fenced = cp.create_namespace(&admin, "lp-off-excluded").await?;
    let release = ns.clone();
    let name = format!("{release}-remora-operator");
    let exclude =
        format!("webhook.excludeNamespaces={{kube-system,kube-public,kube-node-lease,{fenced}}}");
    let objects = e2e::chart::render(
        &release,
        &ns,
        &[
            "workloadCA.enabled=true",
            "discovery.enabled=false",
            &exclude,
        ],
    )?;
    let mut cluster_scoped =
        e2e::chart::apply(&admin, &ns, &objects, &e2e::chart::IDENTITY_KINDS).await?;
    workloads(&admin, &work).await?;
    workloads(&admin, &fenced).await?;
    let token = service_account_token(&admin, &ns, &name).await?;
    let operator = cp.client_with_token(&token)?;
    let own_mwc = Api::<MutatingWebhookConfiguration>::all(operator.clone());
    let retime = json_patch(json!(
        [{"op": "replace", "path": "/webhooks/0/timeoutSeconds", "value": 29}]))?;
    let dry_run = PatchParams::default().dry_run();
    e2e::chart::wait_until_policy_refuses(&name, || own_mwc.patch(&name, &dry_run, &retime))
        .await?;

    // --- No rollouts: RBAC refuses every step of one. ---
    for (kind, wl) in [
        ("Deployment", "web"),
        ("StatefulSet", "db"),
        ("DaemonSet", "agent"),
    ] {
        refused_by_rbac(
            &format!("rolling {kind} {wl}"),
            roll(&operator, &work, kind, wl, "h1").await,
        )?;
        refused_by_rbac(
            &format!("reading {kind} {wl}"),
            workload_api(&operator, &work, kind).get(wl).await,
        )?;
    }
    refused_by_rbac(
        "reading a ReplicaSet",
        Api::<ReplicaSet>::namespaced(operator.clone(), &work)
            .list(&ListParams::default())
            .await,
    )?;

    // --- What RBAC grants cluster-wide, the policy refuses where Remora
    // injects nothing. The same writes pass in a workload namespace. ---
    let retune = Patch::Merge(json!({"metadata": {"annotations": {LIFECYCLE: "{\"x\":1}"}}}));
    Api::<Pod>::namespaced(operator.clone(), &work)
        .patch_metadata("app", &PatchParams::default(), &retune)
        .await
        .context("retuning a pod in a workload namespace")?;
    let bundle = |value: &str| {
        Patch::Apply(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": TRUST_BUNDLE_CONFIGMAP},
            "data": {"root-cert.pem": value}}))
    };
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    Api::<ConfigMap>::namespaced(operator.clone(), &work)
        .patch(TRUST_BUNDLE_CONFIGMAP, &apply, &bundle("a"))
        .await
        .context("the trust bundle in a workload namespace")?;
    for excluded_ns in [fenced.as_str(), "kube-system"] {
        refused(
            &name,
            &format!("the trust bundle in {excluded_ns}"),
            &excluded(excluded_ns),
            Api::<ConfigMap>::namespaced(operator.clone(), excluded_ns)
                .patch(TRUST_BUNDLE_CONFIGMAP, &apply, &bundle("evil"))
                .await,
        )?;
    }
    refused(
        &name,
        "a pod's remora.dev annotation in an excluded namespace",
        &excluded(&fenced),
        Api::<Pod>::namespaced(operator.clone(), &fenced)
            .patch_metadata("app", &PatchParams::default(), &retune)
            .await,
    )?;
    let in_own = |target: &str| {
        format!(
            "the Remora operator may not write {target} in its own namespace {ns}: it injects no pod there"
        )
    };
    Api::<Pod>::namespaced(admin.clone(), &ns)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "app"}, "spec": pod_spec()}))?,
        )
        .await?;
    refused(
        &name,
        "a pod's remora.dev annotation in the release namespace",
        &in_own("/pods"),
        Api::<Pod>::namespaced(operator.clone(), &ns)
            .patch_metadata("app", &PatchParams::default(), &retune)
            .await,
    )?;
    refused(
        &name,
        "the trust bundle in the release namespace",
        &in_own("/configmaps"),
        Api::<ConfigMap>::namespaced(operator.clone(), &ns)
            .patch(TRUST_BUNDLE_CONFIGMAP, &apply, &bundle("evil"))
            .await,
    )?;
    // Its own Lease in the release namespace still passes.
    let lease: Lease = serde_json::from_value(json!({"metadata": {"name": name}}))?;
    Api::<Lease>::namespaced(operator.clone(), &ns)
        .create(&PostParams::default(), &lease)
        .await
        .context("its Lease in the release namespace")?;

    // --- Bound to cluster-admin too, it still cannot roll a workload:
    // without rollouts.automatic the policy lets no workload write through. ---
    let crb_name = format!("{release}-too-much");
    let crb: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": crb_name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
            "name": "cluster-admin"},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]}))?;
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(&PostParams::default(), &crb)
        .await?;
    cluster_scoped.push((
        Api::all_with(
            admin.clone(),
            &ApiResource::erase::<ClusterRoleBinding>(&()),
        ),
        crb_name,
    ));
    let deploy = workload_api(&operator, &work, "Deployment");
    // RBAC's turn is over once it lets the operator read the Deployment.
    wait_until(
        std::time::Duration::from_secs(60),
        "the cluster-admin binding in effect",
        || async {
            match deploy.get("web").await {
                Ok(_) => Ok(Some(())),
                Err(kube::Error::Api(s)) if s.code == 403 => Ok(None),
                Err(e) => Err(anyhow::Error::from(e)),
            }
        },
    )
    .await?;
    refused(
        &name,
        "rolling a Deployment, as cluster-admin",
        &not_at_all("UPDATE", "apps/deployments", &format!("{work}/web")),
        roll(&operator, &work, "Deployment", "web", "h1").await,
    )?;
    refused(
        &name,
        "a Deployment in an excluded namespace, as cluster-admin",
        &not_at_all("UPDATE", "apps/deployments", &format!("{fenced}/web")),
        roll(&operator, &fenced, "Deployment", "web", "h1").await,
    )?;
    let d = Api::<Deployment>::namespaced(admin.clone(), &work)
        .get("web")
        .await?;
    assert_eq!(
        d.spec
            .and_then(|s| s.template.metadata)
            .and_then(|m| m.annotations)
            .and_then(|a| a.get(ROLLOUT_ANNOTATION).cloned()),
        None
    );

    for (api, n) in cluster_scoped {
        api.delete(&n, &DeleteParams::default()).await?;
    }
    for n in [&work, &fenced, &ns] {
        cp.delete_namespace(&admin, n).await?;
    }
    Ok(())
}

/// With the workload CA (workloadCA.enabled): the operator's identity
/// reviews tokens, keeps the trust-bundle ConfigMap in any namespace and its
/// signing Secret in its own, and nothing more: another ConfigMap or Secret
/// is refused, by RBAC where it can name objects, by the policy where it
/// cannot (create).
#[tokio::test]
async fn workload_ca_identity_writes_only_its_bundle_and_roots() -> anyhow::Result<()> {
    use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
    use remora_contract::workload_ca::{SIGNING_SECRET, TOKEN_AUDIENCE, TRUST_BUNDLE_CONFIGMAP};

    let cp = ControlPlane::shared().await?;
    let admin = cp.client()?;
    let ns = cp.create_namespace(&admin, "lp-ca").await?;
    let work = cp.create_namespace(&admin, "lp-ca-work").await?;
    let release = ns.clone();
    let name = format!("{release}-remora-operator");
    let objects = e2e::chart::render(
        &release,
        &ns,
        &["workloadCA.enabled=true", "discovery.enabled=false"],
    )?;
    let cluster_scoped =
        e2e::chart::apply(&admin, &ns, &objects, &e2e::chart::IDENTITY_KINDS).await?;
    let token = service_account_token(&admin, &ns, &name).await?;
    let operator = cp.client_with_token(&token)?;
    let own_mwc = Api::<MutatingWebhookConfiguration>::all(operator.clone());
    let retime = json_patch(json!(
        [{"op": "replace", "path": "/webhooks/0/timeoutSeconds", "value": 29}]))?;
    let dry_run = PatchParams::default().dry_run();
    e2e::chart::wait_until_policy_refuses(&name, || own_mwc.patch(&name, &dry_run, &retime))
        .await?;

    // --- What the CA does passes. ---
    // A TokenReview of a workload's token (its audience only).
    let review = TokenReview {
        spec: TokenReviewSpec {
            token: token.clone(),
            audiences: Some(vec![TOKEN_AUDIENCE.into()]),
        },
        ..TokenReview::default()
    };
    Api::<TokenReview>::all(operator.clone())
        .create(&PostParams::default(), &review)
        .await
        .context("creating a TokenReview")?;
    // The trust bundle in a workload namespace, as the leader writes it:
    // server-side apply, which creates it and then patches it.
    let cms = Api::<ConfigMap>::namespaced(operator.clone(), &work);
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    for value in ["a", "b"] {
        let bundle = json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": TRUST_BUNDLE_CONFIGMAP},
            "data": {"root-cert.pem": value}});
        cms.patch(TRUST_BUNDLE_CONFIGMAP, &apply, &Patch::Apply(bundle))
            .await
            .with_context(|| format!("applying the trust bundle ({value})"))?;
    }
    // The signing Secret in the release namespace: create, read, replace
    // (what every replica's keeper does).
    let secrets = Api::<Secret>::namespaced(operator.clone(), &ns);
    let roots: Secret = serde_json::from_value(json!({
        "metadata": {"name": SIGNING_SECRET}, "stringData": {"k": "v"}}))?;
    secrets
        .create(&PostParams::default(), &roots)
        .await
        .context("creating the signing Secret")?;
    let current = secrets.get(SIGNING_SECRET).await?;
    secrets
        .replace(SIGNING_SECRET, &PostParams::default(), &current)
        .await
        .context("replacing the signing Secret")?;
    refused_by_rbac(
        "watching the signing Secret (it is read by name)",
        secrets
            .list(&ListParams::default().fields(&format!("metadata.name={SIGNING_SECRET}")))
            .await,
    )?;
    // The leader watches the bundle by name in every namespace, to write
    // back someone else's edit at once; no other ConfigMap is read.
    Api::<ConfigMap>::all(operator.clone())
        .list(&ListParams::default().fields(&format!("metadata.name={TRUST_BUNDLE_CONFIGMAP}")))
        .await
        .context("listing the trust bundles by name")?;
    refused_by_rbac(
        "listing every ConfigMap",
        Api::<ConfigMap>::all(operator.clone())
            .list(&ListParams::default())
            .await,
    )?;

    // --- Anything else is refused. ---
    let other: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "c"}}))?;
    refused(
        &name,
        "a ConfigMap not the bundle",
        &not_at_all("CREATE", "/configmaps", &format!("{work}/c")),
        cms.create(&PostParams::default(), &other).await,
    )?;
    let stolen: Secret = serde_json::from_value(json!({"metadata": {"name": "stolen"}}))?;
    refused(
        &name,
        "a Secret not its own",
        &not_at_all("CREATE", "/secrets", &format!("{ns}/stolen")),
        secrets.create(&PostParams::default(), &stolen).await,
    )?;
    // Secrets only in the release namespace (a Role).
    refused_by_rbac(
        "creating its signing Secret's name in another namespace",
        Api::<Secret>::namespaced(operator.clone(), &work)
            .create(&PostParams::default(), &roots)
            .await,
    )?;
    // Reading: RBAC names the objects.
    let admin_cms = Api::<ConfigMap>::namespaced(admin.clone(), &work);
    admin_cms.create(&PostParams::default(), &other).await?;
    refused_by_rbac("reading another ConfigMap", cms.get("c").await)?;
    refused_by_rbac(
        "listing every ConfigMap",
        cms.list(&ListParams::default()).await,
    )?;
    refused_by_rbac(
        "listing every Secret",
        secrets.list(&ListParams::default()).await,
    )?;
    refused_by_rbac(
        "the signing Secret's name in another namespace",
        Api::<Secret>::namespaced(operator.clone(), &work)
            .get(SIGNING_SECRET)
            .await,
    )?;

    for (api, n) in cluster_scoped {
        api.delete(&n, &DeleteParams::default()).await?;
    }
    cp.delete_namespace(&admin, &work).await?;
    cp.delete_namespace(&admin, &ns).await?;
    Ok(())
}
