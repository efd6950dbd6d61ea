//! What both contenders are fed, written to the real API server: S
//! selector-less Services with hand-written EndpointSlices (managed-by this
//! bench), Istio's CRDs, the Sidecar resources of istiod's "best" row, and
//! for the withdrawal measurement the callee's pods: bound to a node that
//! does not exist, so no kubelet ever runs them and a graceful delete
//! leaves them deleting (a deletion timestamp) until they are force-deleted.

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{
    Container, Namespace, ObjectReference, Pod, PodSpec, Service, ServiceAccount, ServicePort,
    ServiceSpec,
};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointPort, EndpointSlice};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};

/// The field manager of every write, and the slices' managed-by label.
pub const MANAGER: &str = "discovery-bench";

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("{0}: {1}")]
    Kube(String, kube::Error),
    #[error("reading {0}: {1}")]
    Read(String, String),
    #[error("{0} not done within {1:?}")]
    Timeout(String, Duration),
}

fn kube(what: impl Into<String>) -> impl FnOnce(kube::Error) -> ClusterError {
    let what = what.into();
    move |e| ClusterError::Kube(what, e)
}

fn apply() -> PatchParams {
    PatchParams::apply(MANAGER).force()
}

/// Create namespace `name`; `Ok(false)` when it existed already.
pub async fn create_namespace(client: &Client, name: &str) -> Result<bool, ClusterError> {
    let api: Api<Namespace> = Api::all(client.clone());
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    match api.create(&PostParams::default(), &ns).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(ClusterError::Kube(format!("creating namespace {name}"), e)),
    }
}

/// Delete namespace `name` and wait (up to two minutes) until it is gone.
pub async fn delete_namespace(client: &Client, name: &str) -> Result<(), ClusterError> {
    let api: Api<Namespace> = Api::all(client.clone());
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(()),
        Err(e) => return Err(ClusterError::Kube(format!("deleting namespace {name}"), e)),
    }
    let limit = Duration::from_secs(120);
    let deadline = Instant::now() + limit;
    while api
        .get_opt(name)
        .await
        .map_err(kube(format!("reading namespace {name}")))?
        .is_some()
    {
        if Instant::now() > deadline {
            return Err(ClusterError::Timeout(
                format!("deleting namespace {name}"),
                limit,
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(())
}

/// A selector-less Service with one HTTP port 80 → 8080.
pub async fn apply_service(client: &Client, ns: &str, name: &str) -> Result<(), ClusterError> {
    let svc = Service {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: 80,
                target_port: Some(
                    k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(8080),
                ),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    Api::<Service>::namespaced(client.clone(), ns)
        .patch(name, &apply(), &Patch::Apply(&svc))
        .await
        .map_err(kube(format!("applying Service {ns}/{name}")))?;
    Ok(())
}

/// Service `service`'s one slice (`<service>-bench`), ready endpoints `ips`
/// on port 8080: one API write.
pub async fn apply_slice(
    client: &Client,
    ns: &str,
    service: &str,
    ips: &[Ipv4Addr],
) -> Result<(), ClusterError> {
    let endpoints: Vec<SliceEndpoint> = ips
        .iter()
        .map(|ip| SliceEndpoint {
            ip: *ip,
            pod: None,
            terminating: false,
        })
        .collect();
    apply_slice_of(client, ns, service, &endpoints).await
}

/// One endpoint of a hand-written slice.
#[derive(Debug, Clone)]
pub struct SliceEndpoint {
    pub ip: Ipv4Addr,
    /// The pod its `targetRef` names.
    pub pod: Option<String>,
    /// As the EndpointSlice controller marks a deleting pod's endpoint:
    /// not ready, still serving, terminating.
    pub terminating: bool,
}

/// Service `service`'s one slice (`<service>-bench`), `endpoints` on port
/// 8080: one API write.
pub async fn apply_slice_of(
    client: &Client,
    ns: &str,
    service: &str,
    endpoints: &[SliceEndpoint],
) -> Result<(), ClusterError> {
    let name = format!("{service}-bench");
    let slice = EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(ns.into()),
            labels: Some(
                [
                    (
                        "kubernetes.io/service-name".to_string(),
                        service.to_string(),
                    ),
                    (
                        "endpointslice.kubernetes.io/managed-by".to_string(),
                        MANAGER.to_string(),
                    ),
                ]
                .into(),
            ),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints: Some(
            endpoints
                .iter()
                .map(|e| Endpoint {
                    addresses: vec![e.ip.to_string()],
                    conditions: Some(k8s_openapi::api::discovery::v1::EndpointConditions {
                        ready: Some(!e.terminating),
                        serving: Some(true),
                        terminating: Some(e.terminating),
                    }),
                    target_ref: e.pod.as_ref().map(|p| ObjectReference {
                        kind: Some("Pod".into()),
                        namespace: Some(ns.into()),
                        name: Some(p.clone()),
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect(),
        ),
        ports: Some(vec![EndpointPort {
            name: Some("http".into()),
            port: Some(8080),
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
    };
    Api::<EndpointSlice>::namespaced(client.clone(), ns)
        .patch(&name, &apply(), &Patch::Apply(&slice))
        .await
        .map_err(kube(format!("applying EndpointSlice {ns}/{name}")))?;
    Ok(())
}

/// The node the callee's pods are bound to: none by that name exists.
pub const NO_NODE: &str = "discovery-bench-no-node";

/// ServiceAccount `name` in `ns` (pods must name one that exists).
pub async fn apply_service_account(
    client: &Client,
    ns: &str,
    name: &str,
) -> Result<(), ClusterError> {
    let sa = ServiceAccount {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<ServiceAccount>::namespaced(client.clone(), ns)
        .patch(name, &apply(), &Patch::Apply(&sa))
        .await
        .map_err(kube(format!("applying ServiceAccount {ns}/{name}")))?;
    Ok(())
}

/// A callee pod as Remora's injector leaves it (`remora.dev/status`, so its
/// discovery server counts it a proxy), running as `service_account`, bound
/// to [`NO_NODE`], its status written as a kubelet would once it is Ready
/// at `ip` (both contenders look pods up by IP).
pub async fn create_callee_pod(
    client: &Client,
    ns: &str,
    name: &str,
    service_account: &str,
    ip: Ipv4Addr,
) -> Result<(), ClusterError> {
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            labels: Some([("app".to_string(), "callee".to_string())].into()),
            annotations: Some(
                [(
                    remora_contract::annotations::STATUS.to_string(),
                    "{}".to_string(),
                )]
                .into(),
            ),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(NO_NODE.into()),
            service_account_name: Some(service_account.into()),
            automount_service_account_token: Some(false),
            containers: vec![Container {
                name: "app".into(),
                image: Some("discovery-bench/none".into()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    };
    let api = Api::<Pod>::namespaced(client.clone(), ns);
    api.create(&PostParams::default(), &pod)
        .await
        .map_err(kube(format!("creating pod {ns}/{name}")))?;
    let status = serde_json::json!({"status": {
        "phase": "Running",
        "podIP": ip.to_string(),
        "podIPs": [{"ip": ip.to_string()}],
        "conditions": [{"type": "Ready", "status": "True"}],
    }});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map_err(kube(format!("writing pod {ns}/{name}'s status")))?;
    Ok(())
}

/// Delete pod `name` with `grace` seconds (0: at once, force).
pub async fn delete_pod(
    client: &Client,
    ns: &str,
    name: &str,
    grace: u32,
) -> Result<(), ClusterError> {
    let params = DeleteParams {
        grace_period_seconds: Some(grace),
        ..Default::default()
    };
    match Api::<Pod>::namespaced(client.clone(), ns)
        .delete(name, &params)
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(ClusterError::Kube(format!("deleting pod {ns}/{name}"), e)),
    }
}

/// Apply Istio's CRDs from the module's `crd-all.gen.yaml` (server-side)
/// and wait until they are established. Returns the names of those that
/// did not exist before (to delete afterwards).
pub async fn apply_istio_crds(client: &Client, file: &Path) -> Result<Vec<String>, ClusterError> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| ClusterError::Read(file.display().to_string(), e.to_string()))?;
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text)
        .map_err(|e| ClusterError::Read(file.display().to_string(), e.to_string()))?;
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut created = Vec::new();
    for doc in docs
        .into_iter()
        .filter(|d| d["kind"] == "CustomResourceDefinition")
    {
        let crd: CustomResourceDefinition = serde_json::from_value(doc)
            .map_err(|e| ClusterError::Read(file.display().to_string(), e.to_string()))?;
        let name = crd.metadata.name.clone().unwrap_or_default();
        if api
            .get_opt(&name)
            .await
            .map_err(kube(format!("reading CRD {name}")))?
            .is_none()
        {
            created.push(name.clone());
        }
        api.patch(&name, &apply(), &Patch::Apply(&crd))
            .await
            .map_err(kube(format!("applying CRD {name}")))?;
    }
    let limit = Duration::from_secs(60);
    let deadline = Instant::now() + limit;
    loop {
        let list = api
            .list(&ListParams::default())
            .await
            .map_err(kube("listing CRDs"))?;
        let pending = list.items.iter().any(|c| {
            c.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.ends_with(".istio.io"))
                && !c
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| {
                        cs.iter()
                            .any(|c| c.type_ == "Established" && c.status == "True")
                    })
        });
        if !pending {
            return Ok(created);
        }
        if Instant::now() > deadline {
            return Err(ClusterError::Timeout(
                "Istio's CRDs established".into(),
                limit,
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Delete the CRDs named (those this run created).
pub async fn delete_crds(client: &Client, names: &[String]) -> Result<(), ClusterError> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in names {
        match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(ClusterError::Kube(format!("deleting CRD {name}"), e)),
        }
    }
    Ok(())
}

fn sidecars(client: &Client, ns: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("networking.istio.io", "v1", "Sidecar");
    Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk))
}

/// Istio's documented remedy for "every proxy gets every Service": a
/// Sidecar resource per workload (selected by its `app` label) whose
/// egress lists only the Services that workload declared.
pub async fn apply_sidecar(
    client: &Client,
    ns: &str,
    workload: &str,
    services: &[String],
) -> Result<(), ClusterError> {
    let hosts: Vec<String> = services
        .iter()
        .map(|s| format!("./{s}.{ns}.svc.cluster.local"))
        .collect();
    let obj: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "networking.istio.io/v1",
        "kind": "Sidecar",
        "metadata": {"name": workload, "namespace": ns},
        "spec": {
            "workloadSelector": {"labels": {"app": workload}},
            "egress": [{"hosts": hosts}],
        },
    }))
    .map_err(|e| ClusterError::Read("the Sidecar".into(), e.to_string()))?;
    sidecars(client, ns)
        .patch(workload, &apply(), &Patch::Apply(&obj))
        .await
        .map_err(kube(format!("applying Sidecar {ns}/{workload}")))?;
    Ok(())
}

/// Delete every Sidecar resource in `ns`.
pub async fn delete_sidecars(client: &Client, ns: &str) -> Result<(), ClusterError> {
    sidecars(client, ns)
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .map_err(kube(format!("deleting the Sidecars of {ns}")))?;
    Ok(())
}

/// Whether pod `name` exists with a deletion timestamp.
pub async fn is_deleting(client: &Client, ns: &str, name: &str) -> Result<bool, ClusterError> {
    let pod = Api::<Pod>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .map_err(kube(format!("reading pod {ns}/{name}")))?;
    Ok(pod.is_some_and(|p| p.metadata.deletion_timestamp.is_some()))
}
