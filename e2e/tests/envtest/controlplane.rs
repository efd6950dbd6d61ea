//! The control-plane harness against the real kube-apiserver, etcd and
//! kube-controller-manager (or the cluster of `REMORA_E2E_KUBECONFIG`).

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context;
use e2e::controlplane::{ControlPlane, ENV_KUBECONFIG, FakeKubelet, Options};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet, ReplicaSetSpec};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Pod, PodSpec, PodTemplateSpec, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{ListParams, ObjectMeta, PostParams};
use kube::{Api, Resource};
use remora_test_support::wait::wait_until;

const DEADLINE: Duration = Duration::from_secs(60);

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

fn controlled_by(meta: &ObjectMeta, uid: &str) -> bool {
    meta.owner_references
        .iter()
        .flatten()
        .any(|r| r.uid == uid && r.controller == Some(true))
}

#[tokio::test]
async fn version_is_the_pinned_release() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    let info = cp.client()?.apiserver_version().await?;
    if let Some(want) = cp.expected_version() {
        assert_eq!(info.git_version, want);
        assert_eq!(info.major, "1");
        assert_eq!(Some(info.minor.as_str()), want.split('.').nth(1));
        // Set by scripts/build-k8s.sh's ldflags, like an official build.
        assert_eq!(info.git_tree_state, "clean");
        assert!(info.build_date.starts_with("20"), "{info:?}");
    }
    Ok(())
}

#[tokio::test]
async fn configmap_round_trips_in_a_fresh_namespace() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "configmap").await?;
    assert!(ns.starts_with("e2e-configmap-"), "{ns}");

    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let data = BTreeMap::from([("k".to_owned(), "v with ünïcode\n".to_owned())]);
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some("settings".into()),
            ..ObjectMeta::default()
        },
        data: Some(data.clone()),
        ..ConfigMap::default()
    };
    api.create(&PostParams::default(), &cm).await?;
    let got = api.get("settings").await?;
    assert_eq!(got.data, Some(data));
    assert_eq!(got.metadata.namespace.as_deref(), Some(ns.as_str()));
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}

#[tokio::test]
async fn pod_is_accepted_and_stays_pending() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "pod").await?;
    let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some("p".into()),
            ..ObjectMeta::default()
        },
        spec: Some(pod_spec()),
        ..Pod::default()
    };
    api.create(&PostParams::default(), &pod).await?;
    let got = api.get("p").await?;
    let phase = got.status.and_then(|s| s.phase);
    assert_eq!(phase.as_deref(), Some("Pending"));
    if cp.is_local() {
        // Nothing schedules it: no scheduler, no node.
        assert_eq!(got.spec.and_then(|s| s.node_name), None);
    }
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}

#[tokio::test]
async fn deployment_gets_a_replicaset_and_pods() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    anyhow::ensure!(cp.has_controller_manager(), "needs kube-controller-manager");
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "deployment").await?;
    let labels = BTreeMap::from([("app".to_owned(), "web".to_owned())]);
    let deploy = e2e::controlplane::deployment("web", 2, labels, Some(pod_spec()));
    let deploy = Api::<Deployment>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &deploy)
        .await?;
    let deploy_uid = deploy.meta().uid.clone().context("deployment has no uid")?;

    let rs_api: Api<ReplicaSet> = Api::namespaced(client.clone(), &ns);
    let rs_uid = wait_until(DEADLINE, "a ReplicaSet owned by the Deployment", || {
        let rs_api = rs_api.clone();
        let deploy_uid = deploy_uid.clone();
        async move {
            let list = rs_api.list(&ListParams::default()).await?;
            Ok::<_, anyhow::Error>(
                list.items
                    .into_iter()
                    .find(|rs| controlled_by(&rs.metadata, &deploy_uid))
                    .and_then(|rs| rs.metadata.uid),
            )
        }
    })
    .await?;

    let pod_api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pods = wait_until(DEADLINE, "2 Pods owned by the ReplicaSet", || {
        let pod_api = pod_api.clone();
        let rs_uid = rs_uid.clone();
        async move {
            let list = pod_api.list(&ListParams::default()).await?;
            let owned: Vec<Pod> = list
                .items
                .into_iter()
                .filter(|p| controlled_by(&p.metadata, &rs_uid))
                .collect();
            Ok::<_, anyhow::Error>((owned.len() == 2).then_some(owned))
        }
    })
    .await?;
    if cp.is_local() {
        for p in &pods {
            let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
            assert_eq!(phase, Some("Pending"), "no kubelet runs pods");
        }
    }
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}

/// The service-account signing key works (TokenRequest), the token
/// authenticates, and RBAC, not AlwaysAllow, decides what it may do.
#[tokio::test]
async fn service_account_token_is_subject_to_rbac() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "rbac").await?;
    let sa = ServiceAccount {
        metadata: ObjectMeta {
            name: Some("reader".into()),
            ..ObjectMeta::default()
        },
        ..ServiceAccount::default()
    };
    let sa_api: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
    sa_api.create(&PostParams::default(), &sa).await?;
    let tr = sa_api
        .create_token_request(
            "reader",
            &PostParams::default(),
            &TokenRequest {
                spec: Some(TokenRequestSpec {
                    expiration_seconds: Some(600),
                    ..TokenRequestSpec::default()
                }),
                ..TokenRequest::default()
            },
        )
        .await?;
    let token = tr.status.context("TokenRequest has no status")?.token;

    let mut config = cp.config().clone();
    config.auth_info = serde_json::from_value(serde_json::json!({ "token": token }))?;
    let as_sa: Api<Pod> = Api::namespaced(kube::Client::try_from(config)?, &ns);
    match as_sa.list(&ListParams::default()).await {
        Err(kube::Error::Api(s)) if s.is_forbidden() => {}
        other => anyhow::bail!("listing pods without a role: want 403, got {other:?}"),
    }

    let role = Role {
        metadata: ObjectMeta {
            name: Some("pod-reader".into()),
            ..ObjectMeta::default()
        },
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["pods".into()]),
            verbs: vec!["list".into()],
            ..PolicyRule::default()
        }]),
    };
    Api::<Role>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &role)
        .await?;
    let binding = RoleBinding {
        metadata: ObjectMeta {
            name: Some("reader-reads-pods".into()),
            ..ObjectMeta::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: "pod-reader".into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: "reader".into(),
            namespace: Some(ns.clone()),
            ..Subject::default()
        }]),
    };
    Api::<RoleBinding>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &binding)
        .await?;
    // The authorizer's informer sees the binding shortly after it is created.
    wait_until(DEADLINE, "the RoleBinding to take effect", || {
        let as_sa = as_sa.clone();
        async move {
            match as_sa.list(&ListParams::default()).await {
                Ok(_) => Ok(Some(())),
                Err(kube::Error::Api(s)) if s.is_forbidden() => Ok(None),
                Err(e) => Err(anyhow::Error::from(e)),
            }
        }
    })
    .await?;
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}

/// A control plane owned by a test (here without the controller manager)
/// stops its processes and removes its directory when dropped; its
/// kubeconfig works for `ControlPlane::external` (`REMORA_E2E_KUBECONFIG`).
#[tokio::test]
async fn owned_control_plane_is_gone_after_drop() -> anyhow::Result<()> {
    if std::env::var_os(ENV_KUBECONFIG).is_some() {
        eprintln!("{ENV_KUBECONFIG} is set: not starting a local control plane");
        return Ok(());
    }
    let cp = ControlPlane::start(Options::without_controller_manager()).await?;
    assert!(!cp.has_controller_manager());
    let info = cp.client()?.apiserver_version().await?;
    assert_eq!(Some(info.git_version.as_str()), cp.expected_version());
    // The REMORA_E2E_KUBECONFIG path, pointed at this control plane.
    let external = ControlPlane::external(cp.kubeconfig().to_owned()).await?;
    assert!(!external.is_local());
    assert!(
        external.has_controller_manager(),
        "assumed on a real cluster"
    );
    assert_eq!(external.expected_version(), None);
    let ns = external
        .create_namespace(&external.client()?, "external")
        .await?;
    assert!(ns.starts_with("e2e-external-"), "{ns}");
    drop(external);

    let dir = cp
        .dir()
        .context("local control plane has a dir")?
        .to_owned();
    let pids = cp.pids();
    assert_eq!(pids.len(), 2, "etcd and kube-apiserver");
    drop(cp);
    assert!(!dir.exists(), "{} left behind", dir.display());
    for pid in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "process {pid} survived"
        );
    }
    Ok(())
}

/// The fake kubelet's pod lifecycle, in both sidecar modes, and a controller
/// reacting to it (the ReplicaSet counts the pods it marks ready).
#[tokio::test]
async fn fake_kubelet_runs_and_completes_pods() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    if !cp.is_local() {
        eprintln!("real cluster: its kubelets run pods; the fake one is not needed");
        return Ok(());
    }
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "kubelet").await?;
    let kubelet = FakeKubelet::register(client.clone(), "fake-node-1").await?;
    let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let container = |name: &str| Container {
        name: name.into(),
        image: Some(format!("registry.invalid/{name}:1")),
        ..Container::default()
    };
    let phase = |p: &Pod| p.status.as_ref().and_then(|s| s.phase.clone());

    // Legacy: the sidecar is a regular container and holds the pod.
    let legacy = Pod {
        metadata: ObjectMeta {
            name: Some("legacy".into()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            containers: vec![container("app"), container("remora-proxy")],
            ..PodSpec::default()
        }),
        ..Pod::default()
    };
    api.create(&PostParams::default(), &legacy).await?;
    let p = kubelet.start(&ns, "legacy").await?;
    assert_eq!(phase(&p).as_deref(), Some("Running"));
    assert_eq!(
        p.spec.as_ref().and_then(|s| s.node_name.as_deref()),
        Some("fake-node-1")
    );
    let p = kubelet.exit(&ns, "legacy", "app", 0).await?;
    assert_eq!(
        phase(&p).as_deref(),
        Some("Running"),
        "the sidecar holds it"
    );
    let p = kubelet.exit(&ns, "legacy", "remora-proxy", 0).await?;
    assert_eq!(phase(&p).as_deref(), Some("Succeeded"));

    // Native: the sidecar is an init container with restartPolicy Always.
    let mut sidecar = container("remora-proxy");
    sidecar.restart_policy = Some("Always".into());
    let native = Pod {
        metadata: ObjectMeta {
            name: Some("native".into()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            init_containers: Some(vec![sidecar]),
            containers: vec![container("app")],
            ..PodSpec::default()
        }),
        ..Pod::default()
    };
    api.create(&PostParams::default(), &native).await?;
    kubelet.start(&ns, "native").await?;
    let p = kubelet.exit(&ns, "native", "remora-proxy", 137).await?;
    assert_eq!(phase(&p).as_deref(), Some("Running"), "sidecar restarted");
    let p = kubelet.exit(&ns, "native", "app", 1).await?;
    assert_eq!(phase(&p).as_deref(), Some("Failed"));
    let sidecar_state = p
        .status
        .and_then(|s| s.init_container_statuses)
        .and_then(|v| v.into_iter().next())
        .and_then(|c| c.state);
    assert!(sidecar_state.is_some_and(|s| s.terminated.is_some()));

    // Always: an exited container is restarted, the pod keeps running.
    let always = Pod {
        metadata: ObjectMeta {
            name: Some("always".into()),
            ..ObjectMeta::default()
        },
        spec: Some(pod_spec()),
        ..Pod::default()
    };
    api.create(&PostParams::default(), &always).await?;
    kubelet.start(&ns, "always").await?;
    let p = kubelet.exit(&ns, "always", "app", 0).await?;
    assert_eq!(phase(&p).as_deref(), Some("Running"));
    let restarts = p
        .status
        .and_then(|s| s.container_statuses)
        .and_then(|v| v.into_iter().next())
        .map(|c| c.restart_count);
    assert_eq!(restarts, Some(1));
    assert!(matches!(
        kubelet.exit(&ns, "always", "nope", 0).await,
        Err(e2e::controlplane::Error::NoSuchContainer { .. })
    ));

    // A controller sees it: the ReplicaSet counts ready pods.
    let labels = BTreeMap::from([("app".to_owned(), "rs".to_owned())]);
    let rs = ReplicaSet {
        metadata: ObjectMeta {
            name: Some("rs".into()),
            ..ObjectMeta::default()
        },
        spec: Some(ReplicaSetSpec {
            replicas: Some(2),
            selector: LabelSelector {
                match_labels: Some(labels.clone()),
                ..LabelSelector::default()
            },
            template: Some(PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(pod_spec()),
            }),
            ..ReplicaSetSpec::default()
        }),
        ..ReplicaSet::default()
    };
    let rs_api: Api<ReplicaSet> = Api::namespaced(client.clone(), &ns);
    let rs = rs_api.create(&PostParams::default(), &rs).await?;
    let rs_uid = rs.metadata.uid.context("replicaset has no uid")?;
    let names = wait_until(DEADLINE, "2 Pods of the ReplicaSet", || {
        let api = api.clone();
        let rs_uid = rs_uid.clone();
        async move {
            let names: Vec<String> = api
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .filter(|p| controlled_by(&p.metadata, &rs_uid))
                .filter_map(|p| p.metadata.name)
                .collect();
            Ok::<_, anyhow::Error>((names.len() == 2).then_some(names))
        }
    })
    .await?;
    for n in &names {
        kubelet.start(&ns, n).await?;
    }
    wait_until(DEADLINE, "the ReplicaSet to count 2 ready pods", || {
        let rs_api = rs_api.clone();
        async move {
            let rs = rs_api.get("rs").await?;
            let ready = rs.status.and_then(|s| s.ready_replicas).unwrap_or(0);
            Ok::<_, anyhow::Error>((ready == 2).then_some(()))
        }
    })
    .await?;
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}
