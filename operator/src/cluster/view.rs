//! The operator's in-memory view of the cluster: reflectors over
//! SidecarLifecycles, Namespaces (labels only) and Nodes (kubelet versions,
//! which decide `Auto` mode). Admissions read these stores, never the API.
//! The SidecarLifecycle watch is shared: the leader's controller reads it
//! rather than opening its own.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Node, NodeStatus, NodeSystemInfo};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use remora_crds::SidecarLifecycle;
use tokio_util::sync::CancellationToken;

use crate::cluster::watch::{SharedWatch, drive};
use crate::webhook::view::ClusterView;
use remora_inject::resolve::LifecycleEntry;

/// Native sidecars (restartable init containers) are on by default from here.
pub const NATIVE_SIDECAR_MINOR: u32 = 29;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cannot read the API server's version: {0}")]
    Version(#[source] kube::Error),
}

/// `v1.29.3`, `v1.30.0-eks-1234` → (1, 29); `None` when unreadable.
pub fn parse_kube_version(v: &str) -> Option<(u32, u32)> {
    let v = v.trim().trim_start_matches('v');
    let mut parts = v.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor: String = parts
        .next()?
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    Some((major, minor.parse().ok()?))
}

fn supports_native(v: (u32, u32)) -> bool {
    v.0 > 1 || (v.0 == 1 && v.1 >= NATIVE_SIDECAR_MINOR)
}

/// Whether these kubelets all run native sidecars; with no node in sight,
/// the API server's version decides.
pub fn native_supported(kubelet_versions: &[String], apiserver: Option<(u32, u32)>) -> bool {
    if kubelet_versions.is_empty() {
        return apiserver.is_some_and(supports_native);
    }
    kubelet_versions
        .iter()
        .all(|v| parse_kube_version(v).is_some_and(supports_native))
}

#[derive(Clone)]
pub struct KubeView {
    lifecycles: SharedWatch<SidecarLifecycle>,
    namespaces: Store<PartialObjectMeta<Namespace>>,
    native: Arc<AtomicBool>,
}

impl ClusterView for KubeView {
    fn lifecycles_in(&self, namespaces: &[&str]) -> Vec<LifecycleEntry> {
        self.lifecycles
            .store()
            .state()
            .iter()
            .filter(|r| namespaces.contains(&r.metadata.namespace.as_deref().unwrap_or_default()))
            .map(|r| LifecycleEntry::from_resource(r))
            .collect()
    }

    fn namespace_labels(&self, namespace: &str) -> Option<BTreeMap<String, String>> {
        let key = reflector::ObjectRef::<PartialObjectMeta<Namespace>>::new(namespace);
        self.namespaces
            .get(&key)
            .map(|n| n.metadata.labels.clone().unwrap_or_default())
    }

    fn native_sidecars(&self) -> bool {
        self.native.load(Ordering::Relaxed)
    }
}

/// Start the reflectors, which run until `shutdown`; waits (up to
/// `sync_timeout`) for the first listing so that the first admissions
/// already see the SidecarLifecycles.
pub async fn start(
    client: Client,
    sync_timeout: Duration,
    shutdown: CancellationToken,
) -> Result<KubeView, ClusterError> {
    let apiserver = client
        .apiserver_version()
        .await
        .map_err(ClusterError::Version)?;
    let apiserver = parse_kube_version(&format!("v{}.{}", apiserver.major, apiserver.minor));

    let lifecycles = SharedWatch::start(
        "sidecarlifecycles",
        Api::<SidecarLifecycle>::all(client.clone()),
        watcher::Config::default(),
        slim_lifecycle,
        shutdown.clone(),
    );
    let (namespaces, w) = reflector::store();
    drive(
        "namespaces",
        watcher(
            Api::<PartialObjectMeta<Namespace>>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .modify(slim_namespace)
        .reflect(w),
        shutdown.clone(),
        |_| {},
    );
    let (nodes, w) = reflector::store::<Node>();
    let native = Arc::new(AtomicBool::new(apiserver.is_some_and(supports_native)));
    {
        let native = Arc::clone(&native);
        let nodes = nodes.clone();
        let stream = watcher(Api::<Node>::all(client), watcher::Config::default())
            .default_backoff()
            .modify(slim_node)
            .reflect(w);
        // Re-evaluated on every node event: a new old node turns Auto to Legacy.
        drive("nodes", stream, shutdown, move |_| {
            let versions: Vec<String> = nodes
                .state()
                .iter()
                .filter_map(|n| {
                    n.status
                        .as_ref()
                        .and_then(|s| s.node_info.as_ref())
                        .map(|i| i.kubelet_version.clone())
                })
                .collect();
            let now = native_supported(&versions, apiserver);
            if native.swap(now, Ordering::Relaxed) != now {
                tracing::info!(
                    native_sidecars = now,
                    nodes = versions.len(),
                    "Auto mode changed"
                );
            }
        });
    }
    let view = KubeView {
        lifecycles,
        namespaces,
        native,
    };
    if tokio::time::timeout(sync_timeout, view.wait_synced())
        .await
        .is_err()
    {
        tracing::warn!("stores not synced in time; serving, but not ready until they are");
    }
    Ok(view)
}

impl KubeView {
    /// Resolves once the SidecarLifecycles and namespaces have been listed.
    pub async fn wait_synced(&self) {
        self.lifecycles.listed().await;
        let _ = self.namespaces.wait_until_ready().await;
    }

    /// The namespaces whose label `key` is `value` (the injection label).
    pub fn namespaces_labelled(&self, key: &str, value: &str) -> Vec<String> {
        self.namespaces
            .state()
            .iter()
            .filter(|n| {
                n.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(key))
                    .is_some_and(|v| v == value)
            })
            .filter_map(|n| n.metadata.name.clone())
            .collect()
    }

    /// The one SidecarLifecycle watch of this replica: the leader's
    /// controller reads it too, rather than opening its own.
    pub fn lifecycle_watch(&self) -> SharedWatch<SidecarLifecycle> {
        self.lifecycles.clone()
    }
}

/// What is kept of a SidecarLifecycle: all but its managed fields and the
/// last-applied copy `kubectl apply` leaves (each as large as the object).
pub fn slim_lifecycle(r: &mut SidecarLifecycle) {
    r.metadata.managed_fields = None;
    drop_last_applied(&mut r.metadata.annotations);
}

/// What is kept of a Namespace (already metadata-only): its name and labels.
pub fn slim_namespace(n: &mut PartialObjectMeta<Namespace>) {
    n.metadata = ObjectMeta {
        name: n.metadata.name.take(),
        labels: n.metadata.labels.take(),
        resource_version: n.metadata.resource_version.take(),
        ..ObjectMeta::default()
    };
}

/// What is kept of a Node: its name and kubelet version. A node's status
/// lists every image it holds, often the largest part of the object.
pub fn slim_node(n: &mut Node) {
    let kubelet_version = n
        .status
        .as_ref()
        .and_then(|s| s.node_info.as_ref())
        .map(|i| i.kubelet_version.clone());
    n.metadata = ObjectMeta {
        name: n.metadata.name.take(),
        resource_version: n.metadata.resource_version.take(),
        ..ObjectMeta::default()
    };
    n.spec = None;
    n.status = kubelet_version.map(|kubelet_version| NodeStatus {
        node_info: Some(NodeSystemInfo {
            kubelet_version,
            ..NodeSystemInfo::default()
        }),
        ..NodeStatus::default()
    });
}

fn drop_last_applied(annotations: &mut Option<BTreeMap<String, String>>) {
    if let Some(a) = annotations.as_mut() {
        a.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

    fn managed() -> Option<Vec<ManagedFieldsEntry>> {
        Some(vec![ManagedFieldsEntry {
            manager: Some("kubectl".into()),
            ..ManagedFieldsEntry::default()
        }])
    }

    #[test]
    fn slim_objects_keep_what_the_view_reads_and_nothing_else() -> anyhow::Result<()> {
        let mut node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n1", "labels": {"a": "b"}, "resourceVersion": "7"},
            "spec": {"podCIDR": "10.244.0.0/24"},
            "status": {
                "nodeInfo": {"kubeletVersion": "v1.36.3", "osImage": "Debian"},
                "images": [{"names": ["registry.invalid/big:1"], "sizeBytes": 1}],
            },
        }))?;
        node.metadata.managed_fields = managed();
        slim_node(&mut node);
        let json = serde_json::to_value(&node)?;
        assert_eq!(
            json["metadata"],
            serde_json::json!({"name": "n1", "resourceVersion": "7"})
        );
        assert_eq!(json["status"]["nodeInfo"]["kubeletVersion"], "v1.36.3");
        assert_eq!(json["status"]["nodeInfo"]["osImage"], "");
        assert!(json.get("spec").is_none() && json["status"].get("images").is_none());

        let mut ns = PartialObjectMeta::<Namespace> {
            metadata: ObjectMeta {
                name: Some("team".into()),
                labels: Some([("remora.dev/inject".into(), "enabled".into())].into()),
                annotations: Some([("big".into(), "x".repeat(4096))].into()),
                managed_fields: managed(),
                ..ObjectMeta::default()
            },
            ..PartialObjectMeta::default()
        };
        slim_namespace(&mut ns);
        assert_eq!(ns.metadata.name.as_deref(), Some("team"));
        assert_eq!(ns.metadata.labels.as_ref().map(BTreeMap::len), Some(1));
        assert!(ns.metadata.annotations.is_none() && ns.metadata.managed_fields.is_none());

        let mut slc: SidecarLifecycle = serde_json::from_value(serde_json::json!({
            "apiVersion": "remora.dev/v1alpha1", "kind": "SidecarLifecycle",
            "metadata": {
                "name": "web", "namespace": "team", "generation": 3,
                "creationTimestamp": "2026-11-23T00:00:00Z",
                "annotations": {
                    "kubectl.kubernetes.io/last-applied-configuration": "{...}",
                    "team": "payments",
                },
            },
            "spec": {"selector": {"matchLabels": {"app": "web"}}},
        }))?;
        slc.metadata.managed_fields = managed();
        let before = LifecycleEntry::from_resource(&slc);
        slim_lifecycle(&mut slc);
        assert!(slc.metadata.managed_fields.is_none());
        assert_eq!(
            slc.metadata
                .annotations
                .as_ref()
                .map(|a| a.keys().cloned().collect::<Vec<_>>()),
            Some(vec!["team".to_string()])
        );
        // What resolution and the controller read is unchanged.
        assert_eq!(LifecycleEntry::from_resource(&slc), before);
        assert_eq!(slc.metadata.generation, Some(3));
        Ok(())
    }

    #[test]
    fn versions() {
        assert_eq!(parse_kube_version("v1.29.3"), Some((1, 29)));
        assert_eq!(parse_kube_version("v1.30.0-eks-1234"), Some((1, 30)));
        assert_eq!(parse_kube_version("1.28+"), Some((1, 28)));
        assert_eq!(parse_kube_version("garbage"), None);
        let v = |s: &[&str]| s.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(native_supported(&v(&["v1.29.0", "v1.31.2"]), None));
        assert!(!native_supported(
            &v(&["v1.29.0", "v1.28.9"]),
            Some((1, 31))
        ));
        assert!(!native_supported(&v(&["weird"]), Some((1, 31))));
        assert!(native_supported(&[], Some((1, 30))));
        assert!(!native_supported(&[], Some((1, 28))));
        assert!(!native_supported(&[], None));
    }
}
