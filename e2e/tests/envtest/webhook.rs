//! The operator behind the real kube-apiserver: the CRD and its CEL rules,
//! and `remora-operator serve` called as a mutating webhook.
//! (`e2e::webhook` sets the webhook up.)

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context;
use e2e::controlplane::ControlPlane;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::Deployment;
use kube::Api;
use kube::api::{ListParams, PostParams};
use remora_test_support::wait::wait_until;
use serde_json::json;

use e2e::webhook::{DEADLINE, PROXY, Setup, pod, sidecar};

#[tokio::test]
async fn crd_rejects_invalid_lifecycles_with_readable_messages() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    e2e::chart::install_crds(&client).await?;
    let ns = cp.create_namespace(&client, "cel").await?;
    let api = e2e::webhook::lifecycles(&client, &ns);
    let slc = e2e::webhook::lifecycle;

    let ok = api
        .create(
            &PostParams::default(),
            &slc(
                "good",
                json!({
                    "selector": {"matchLabels": {"app": "web"}},
                    "mode": "Native",
                    "shutdown": {"drainDuration": "1m30s", "terminationDrainDuration": "10s",
                                 "exitOnZeroActiveConnections": true, "minimumDrainDuration": "5s"},
                    "startup": {"holdApplicationUntilProxyStarts": true, "timeout": "30s"},
                    "proxy": {"concurrency": 4, "logLevel": "info"},
                }),
            )?,
        )
        .await?;
    // Defaulted by the schema.
    assert_eq!(ok.data["spec"]["rolloutPolicy"], "Manual", "{ok:?}");

    // (spec, what the message must say)
    let cases = [
        (
            json!({"shutdown": {"drainDuration": "25h"}}),
            vec![
                "spec.shutdown.drainDuration",
                "must be a duration between 0s and 24h",
            ],
        ),
        (
            json!({"shutdown": {"drainDuration": "10s", "minimumDrainDuration": "20s"}}),
            vec![
                "spec.shutdown",
                "minimumDrainDuration must not exceed drainDuration",
            ],
        ),
        (
            json!({"shutdown": {"drainDuration": "10s", "terminationDrainDuration": "1m"}}),
            vec![
                "spec.shutdown",
                "terminationDrainDuration must not exceed drainDuration",
            ],
        ),
        (
            json!({"startup": {"timeout": "soon"}}),
            vec!["spec.startup.timeout", "should match"],
        ),
        (
            json!({"mode": "Sometimes"}),
            vec!["spec.mode", "Unsupported value: \"Sometimes\""],
        ),
        (
            json!({"proxy": {"concurrency": 1000}}),
            vec!["spec.proxy.concurrency", "less than or equal to 256"],
        ),
    ];
    for (i, (spec, want)) in cases.into_iter().enumerate() {
        let name = format!("bad-{i}");
        let err = api
            .create(&PostParams::default(), &slc(&name, spec.clone())?)
            .await
            .expect_err(&format!("{spec} must be refused"));
        let kube::Error::Api(status) = err else {
            anyhow::bail!("{spec}: not an API error: {err}");
        };
        assert_eq!(status.code, 422, "{spec}: {status:?}");
        for w in want {
            assert!(
                status.message.contains(w),
                "{spec}: message lacks {w:?}: {}",
                status.message
            );
        }
    }
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}

#[tokio::test]
async fn pods_come_back_injected_in_legacy_and_native_mode() -> anyhow::Result<()> {
    let s = Setup::new("modes", "Fail").await?;
    let api = s.pods(&s.enabled);

    let legacy = api
        .create(
            &PostParams::default(),
            &pod("legacy", &[], &[("remora.dev/sidecar-mode", "Legacy")]),
        )
        .await?;
    // What the API server stored (it validated the injected spec).
    let legacy = api
        .get(&legacy.metadata.name.clone().unwrap_or_default())
        .await?;
    let spec = legacy.spec.as_ref().context("no spec")?;
    assert_eq!(spec.containers[0].name, PROXY, "{spec:?}");
    assert_eq!(spec.containers[1].name, "app");
    let lc = spec.containers[0]
        .lifecycle
        .as_ref()
        .context("no lifecycle on the Legacy sidecar")?;
    assert!(lc.post_start.is_some(), "postStart hold: {lc:?}");
    assert!(lc.pre_stop.is_some(), "preStop drain: {lc:?}");
    let ann = legacy.metadata.annotations.clone().unwrap_or_default();
    assert!(ann.contains_key("remora.dev/status"), "{ann:?}");
    assert!(ann.contains_key("remora.dev/lifecycle"), "{ann:?}");

    let native = api
        .create(
            &PostParams::default(),
            &pod("native", &[], &[("remora.dev/sidecar-mode", "Native")]),
        )
        .await?;
    let native = api
        .get(&native.metadata.name.clone().unwrap_or_default())
        .await?;
    let (place, c) = sidecar(&native).context("Native pod not injected")?;
    assert_eq!(place, "initContainers");
    assert_eq!(c.restart_policy.as_deref(), Some("Always"));
    assert!(c.startup_probe.is_some(), "{c:?}");
    let spec = native.spec.as_ref().context("no spec")?;
    assert!(spec.containers.iter().all(|c| c.name != PROXY), "{spec:?}");

    Ok(s.cleanup().await?)
}

#[tokio::test]
async fn opt_out_and_namespace_selection() -> anyhow::Result<()> {
    let s = Setup::new("select", "Fail").await?;
    let pp = PostParams::default();

    // Labelled namespace: every pod, but "false" on the pod wins.
    let on = s.pods(&s.enabled);
    let p = on.create(&pp, &pod("default", &[], &[])).await?;
    assert!(sidecar(&p).is_some(), "labelled namespace: {p:?}");
    let p = on
        .create(
            &pp,
            &pod("opted-out", &[("remora.dev/inject", "false")], &[]),
        )
        .await?;
    assert!(sidecar(&p).is_none(), "opted out: {:?}", p.spec);

    // Unlabelled namespace: only pods labelled "true".
    let off = s.pods(&s.plain);
    let p = off.create(&pp, &pod("plain", &[], &[])).await?;
    assert!(sidecar(&p).is_none(), "unlabelled namespace: {:?}", p.spec);
    let p = off
        .create(&pp, &pod("opted-in", &[("remora.dev/inject", "true")], &[]))
        .await?;
    assert!(sidecar(&p).is_some(), "opted in: {:?}", p.spec);

    Ok(s.cleanup().await?)
}

#[tokio::test]
async fn webhook_down_fail_refuses_and_ignore_admits_uninjected() -> anyhow::Result<()> {
    let mut s = Setup::new("down", "Fail").await?;
    let api = s.pods(&s.enabled);
    let pp = PostParams::default();
    s.operator.stop(Duration::from_secs(10));

    // failurePolicy Fail: refused, saying which webhook and why.
    let err = api
        .create(&pp, &pod("refused", &[], &[]))
        .await
        .expect_err("with the operator down and Fail, the pod must be refused");
    let kube::Error::Api(status) = err else {
        anyhow::bail!("not an API error: {err}");
    };
    assert!(
        status
            .message
            .contains("failed calling webhook \"namespace.inject.remora.dev\""),
        "{status:?}"
    );
    assert!(status.message.contains(&s.operator.url()), "{status:?}");
    // Pods the webhook does not select are not affected.
    s.pods(&s.plain)
        .create(&pp, &pod("unselected", &[], &[]))
        .await?;

    // failurePolicy Ignore: created, without a sidecar.
    let mwc_api = Api::<MutatingWebhookConfiguration>::all(s.client.clone());
    let mut mwc = mwc_api.get(&s.mwc).await?;
    for w in mwc.webhooks.iter_mut().flatten() {
        w.failure_policy = Some("Ignore".into());
    }
    mwc_api.replace(&s.mwc, &pp, &mwc).await?;
    let created = wait_until(DEADLINE, "failurePolicy Ignore in force", || {
        let api = api.clone();
        async move {
            match api
                .create(&PostParams::default(), &pod("admitted", &[], &[]))
                .await
            {
                Ok(p) => Ok(Some(p)),
                // Still the old configuration.
                Err(kube::Error::Api(e)) if e.message.contains("failed calling webhook") => {
                    Ok(None)
                }
                Err(e) => Err(anyhow::Error::from(e)),
            }
        }
    })
    .await?;
    assert!(sidecar(&created).is_none(), "{:?}", created.spec);
    assert!(
        !created
            .metadata
            .annotations
            .unwrap_or_default()
            .contains_key("remora.dev/status")
    );

    Ok(s.cleanup().await?)
}

/// With kube-controller-manager: the pods a Deployment's ReplicaSet creates
/// go through the webhook like any other.
#[tokio::test]
async fn deployment_pods_are_injected() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    anyhow::ensure!(cp.has_controller_manager(), "needs kube-controller-manager");
    let s = Setup::new("deploy", "Fail").await?;
    let labels = BTreeMap::from([("app".to_owned(), "web".to_owned())]);
    let template = pod("unused", &[("app", "web")], &[]);
    let deploy = e2e::controlplane::deployment("web", 2, labels, template.spec);
    Api::<Deployment>::namespaced(s.client.clone(), &s.enabled)
        .create(&PostParams::default(), &deploy)
        .await?;
    let api = s.pods(&s.enabled);
    let pods = wait_until(DEADLINE, "two pods of the Deployment", || async {
        let list = api.list(&ListParams::default().labels("app=web")).await?;
        Ok::<_, anyhow::Error>((list.items.len() == 2).then_some(list.items))
    })
    .await?;
    for p in &pods {
        assert!(sidecar(p).is_some(), "{:?}", p.spec);
    }
    Ok(s.cleanup().await?)
}

/// The API server shows the operator's refusal of a pod asking for a
/// listener onto Envoy's admin port.
#[tokio::test]
async fn plumbing_onto_envoy_admin_is_refused_by_the_api_server() -> anyhow::Result<()> {
    let s = Setup::new("plumb", "Fail").await?;
    let err = s
        .pods(&s.enabled)
        .create(
            &PostParams::default(),
            &pod("admin", &[], &[("remora.dev/inbound", "15006:15000")]),
        )
        .await
        .expect_err("a listener forwarding to Envoy admin must be refused");
    let kube::Error::Api(status) = err else {
        anyhow::bail!("not an API error: {err}");
    };
    for want in ["remora.dev/inbound", "15006:15000", "target port 15000"] {
        assert!(status.message.contains(want), "{status:?}");
    }
    Ok(s.cleanup().await?)
}
