//! A stand-in for the kubelet: the local control plane has no nodes and no
//! kubelet, so a test that needs a pod to run, or its containers to exit,
//! writes what a kubelet would write: a Ready `Node`, the pod's binding, and
//! the pod's status. Nothing runs; only the API objects change. Works the
//! same on a real cluster only for pods no real kubelet owns (bound here).

use k8s_openapi::api::core::v1::{
    Binding, Container, ContainerState, ContainerStateRunning, ContainerStateTerminated,
    ContainerStatus, Node, NodeAddress, NodeCondition, NodeStatus, NodeSystemInfo, ObjectReference,
    Pod, PodCondition, PodSpec, PodStatus,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};

use super::Error;

/// The address the fake node and its pods report.
const NODE_IP: &str = "127.0.0.1";

/// Plays the kubelet of one fake node.
#[derive(Clone)]
pub struct FakeKubelet {
    client: Client,
    node: String,
}

impl FakeKubelet {
    /// Registers node `name` (or reuses it) and marks it Ready.
    pub async fn register(client: Client, name: &str) -> Result<Self, Error> {
        let nodes: Api<Node> = Api::all(client.clone());
        let node = Node {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                labels: Some(
                    [("kubernetes.io/hostname".to_owned(), name.to_owned())]
                        .into_iter()
                        .collect(),
                ),
                ..ObjectMeta::default()
            },
            ..Node::default()
        };
        match nodes.create(&PostParams::default(), &node).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => return Err(e.into()),
        }
        let kubelet_version = client.apiserver_version().await?.git_version;
        let now = Time(Timestamp::now());
        let capacity = [("cpu", "8"), ("memory", "32Gi"), ("pods", "110")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), Quantity(v.to_owned())))
            .collect::<std::collections::BTreeMap<_, _>>();
        let status = NodeStatus {
            conditions: Some(vec![NodeCondition {
                type_: "Ready".into(),
                status: "True".into(),
                reason: Some("KubeletReady".into()),
                message: Some("remora e2e fake kubelet".into()),
                last_heartbeat_time: Some(now.clone()),
                last_transition_time: Some(now),
            }]),
            addresses: Some(vec![NodeAddress {
                type_: "InternalIP".into(),
                address: NODE_IP.into(),
            }]),
            allocatable: Some(capacity.clone()),
            capacity: Some(capacity),
            // A kubelet of the API server's release, as on a real node: a
            // Node without a version reads as one that cannot run native
            // sidecars, and would turn them off for every test sharing the
            // control plane.
            node_info: Some(NodeSystemInfo {
                kubelet_version: kubelet_version.clone(),
                kube_proxy_version: kubelet_version,
                architecture: std::env::consts::ARCH.into(),
                operating_system: "linux".into(),
                container_runtime_version: "remora-e2e://0".into(),
                os_image: "remora e2e fake kubelet".into(),
                ..NodeSystemInfo::default()
            }),
            ..NodeStatus::default()
        };
        let patch = serde_json::json!({ "status": status });
        nodes
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(Self {
            client,
            node: name.to_owned(),
        })
    }

    /// The node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Binds the pod to this node, as the scheduler would (no-op if bound).
    pub async fn bind(&self, namespace: &str, pod: &str) -> Result<(), Error> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let current = api.get(pod).await?;
        if is_bound(&current) {
            return Ok(());
        }
        self.create_binding(&api, pod).await
    }

    async fn create_binding(&self, api: &Api<Pod>, pod: &str) -> Result<(), Error> {
        let binding = Binding {
            metadata: ObjectMeta {
                name: Some(pod.to_owned()),
                ..ObjectMeta::default()
            },
            target: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(self.node.clone()),
                ..ObjectReference::default()
            },
        };
        // The answer is a Status, not a Binding.
        let _: serde_json::Value = api
            .create_subresource("binding", pod, &PostParams::default(), &binding)
            .await?;
        Ok(())
    }

    /// Binds the pod and reports every container (native sidecars included)
    /// started and ready, the pod `Running` and `Ready`.
    pub async fn start(&self, namespace: &str, pod: &str) -> Result<Pod, Error> {
        self.bind(namespace, pod).await?;
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let current = api.get(pod).await?;
        self.start_known(&current).await
    }

    /// As [`FakeKubelet::start`], for a pod the caller has just created or
    /// read: no read first, and no binding if it already names a node. At
    /// scale (thousands of pods) that is one write per pod instead of four
    /// requests.
    pub async fn start_known(&self, pod: &Pod) -> Result<Pod, Error> {
        let (Some(namespace), Some(name)) = (&pod.metadata.namespace, &pod.metadata.name) else {
            return Err(Error::Unnamed("a pod to start"));
        };
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        if !is_bound(pod) {
            self.create_binding(&api, name).await?;
        }
        let status = running_status(pod.spec.as_ref(), &Time(Timestamp::now()));
        self.patch_status(&api, name, &status).await
    }

    /// Reports `container` exited with `exit_code`, and then what the kubelet
    /// would decide: under restartPolicy `Always` (or `OnFailure` with a
    /// non-zero code) the container runs again with `restartCount + 1`;
    /// otherwise it stays terminated, and once every regular container has
    /// terminated the pod is `Succeeded` (all exit 0) or `Failed`, with its
    /// native sidecars stopped too. A Legacy sidecar is a regular container,
    /// so the pod keeps `Running` until it exits as well. A native sidecar
    /// (`container` among the init containers) is always restarted.
    pub async fn exit(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
        exit_code: i32,
    ) -> Result<Pod, Error> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let current = api.get(pod).await?;
        let policy = current
            .spec
            .as_ref()
            .and_then(|s| s.restart_policy.clone())
            .unwrap_or_else(|| "Always".into());
        let mut status = current.status.unwrap_or_default();
        let now = Time(Timestamp::now());
        // A native sidecar's own restartPolicy Always wins over the pod's.
        if let Some(cs) = status
            .init_container_statuses
            .iter_mut()
            .flatten()
            .find(|c| c.name == container)
        {
            cs.restart_count += 1;
            cs.last_state = Some(terminated(exit_code, &now));
            cs.state = Some(running_state(&now));
            return self.patch_status(&api, pod, &status).await;
        }
        let statuses = status.container_statuses.get_or_insert_with(Vec::new);
        let Some(cs) = statuses.iter_mut().find(|c| c.name == container) else {
            return Err(Error::NoSuchContainer {
                pod: format!("{namespace}/{pod}"),
                container: container.to_owned(),
            });
        };
        let restart = policy == "Always" || (policy == "OnFailure" && exit_code != 0);
        if restart {
            cs.restart_count += 1;
            cs.last_state = Some(terminated(exit_code, &now));
            cs.state = Some(running_state(&now));
        } else {
            cs.ready = false;
            cs.started = Some(false);
            cs.state = Some(terminated(exit_code, &now));
        }
        let codes: Option<Vec<i32>> = statuses
            .iter()
            .map(|c| c.state.as_ref()?.terminated.as_ref().map(|t| t.exit_code))
            .collect();
        if let Some(codes) = codes {
            // Every regular container is done: the pod completes.
            let ok = codes.iter().all(|c| *c == 0);
            status.phase = Some(if ok { "Succeeded" } else { "Failed" }.into());
            status.conditions = Some(conditions(false, &now));
            for s in status.init_container_statuses.iter_mut().flatten() {
                if s.state.as_ref().is_some_and(|st| st.running.is_some()) {
                    s.ready = false;
                    s.started = Some(false);
                    s.state = Some(terminated(0, &now));
                }
            }
        } else if !restart {
            status.conditions = Some(conditions(false, &now));
        }
        self.patch_status(&api, pod, &status).await
    }

    async fn patch_status(
        &self,
        api: &Api<Pod>,
        pod: &str,
        status: &PodStatus,
    ) -> Result<Pod, Error> {
        let patch = serde_json::json!({ "status": status });
        Ok(api
            .patch_status(pod, &PatchParams::default(), &Patch::Merge(&patch))
            .await?)
    }
}

impl std::fmt::Debug for FakeKubelet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeKubelet")
            .field("node", &self.node)
            .finish()
    }
}

/// An init container with `restartPolicy: Always`: a native sidecar.
fn is_native_sidecar(c: &Container) -> bool {
    c.restart_policy.as_deref() == Some("Always")
}

fn is_bound(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.as_ref())
        .is_some()
}

/// What a kubelet reports once every container (native sidecars included)
/// has started and is ready.
fn running_status(spec: Option<&PodSpec>, now: &Time) -> PodStatus {
    let running = |c: &Container| ContainerStatus {
        name: c.name.clone(),
        image: c.image.clone().unwrap_or_default(),
        image_id: String::new(),
        ready: true,
        started: Some(true),
        restart_count: 0,
        state: Some(running_state(now)),
        ..ContainerStatus::default()
    };
    let init: Vec<ContainerStatus> = spec
        .and_then(|s| s.init_containers.as_ref())
        .into_iter()
        .flatten()
        .filter(|c| is_native_sidecar(c))
        .map(running)
        .collect();
    PodStatus {
        phase: Some("Running".into()),
        host_ip: Some(NODE_IP.into()),
        pod_ip: Some(NODE_IP.into()),
        start_time: Some(now.clone()),
        conditions: Some(conditions(true, now)),
        container_statuses: Some(
            spec.into_iter()
                .flat_map(|s| s.containers.iter())
                .map(running)
                .collect(),
        ),
        init_container_statuses: (!init.is_empty()).then_some(init),
        ..PodStatus::default()
    }
}

fn running_state(now: &Time) -> ContainerState {
    ContainerState {
        running: Some(ContainerStateRunning {
            started_at: Some(now.clone()),
        }),
        ..ContainerState::default()
    }
}

fn terminated(exit_code: i32, now: &Time) -> ContainerState {
    ContainerState {
        terminated: Some(ContainerStateTerminated {
            exit_code,
            reason: Some(if exit_code == 0 { "Completed" } else { "Error" }.into()),
            finished_at: Some(now.clone()),
            ..ContainerStateTerminated::default()
        }),
        ..ContainerState::default()
    }
}

fn conditions(ready: bool, now: &Time) -> Vec<PodCondition> {
    let cond = |type_: &str, status: bool| PodCondition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        last_transition_time: Some(now.clone()),
        ..PodCondition::default()
    };
    vec![
        cond("PodScheduled", true),
        cond("Initialized", true),
        cond("ContainersReady", ready),
        cond("Ready", ready),
    ]
}
