//! What the admission handler reads about the cluster: kept in memory
//! (reflectors in the operator, fixed values in tests), with one API call
//! allowed per admission, bounded in time, for a namespace the cache has not
//! seen yet.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::core::PartialObjectMeta;

use remora_inject::resolve::LifecycleEntry;
pub use remora_inject::review::StaticView;

/// What the handler reads about the cluster. The one API call an admission
/// may make is [`ClusterView::lookup_namespace_labels`].
pub trait ClusterView: Send + Sync {
    /// The `SidecarLifecycle`s of these namespaces. A pod's own and the
    /// operator's (the cluster default) are all that can reach it, so no
    /// review copies the cluster's whole set.
    fn lifecycles_in(&self, namespaces: &[&str]) -> Vec<LifecycleEntry>;
    /// The labels of a namespace; `None` when unknown.
    fn namespace_labels(&self, namespace: &str) -> Option<BTreeMap<String, String>>;
    /// Whether every node runs native sidecars (kubelet >= 1.29).
    fn native_sidecars(&self) -> bool;
    /// The labels of a namespace [`Self::namespace_labels`] does not know
    /// (created a moment ago, not yet in the cache), asked of the source;
    /// `Ok(None)` when it does not exist. A view that holds every namespace
    /// (tests) answers from what it holds.
    fn lookup_namespace_labels<'a>(&'a self, namespace: &'a str) -> BoxFuture<'a, Lookup> {
        Box::pin(std::future::ready(Ok(self.namespace_labels(namespace))))
    }
}

/// What [`ClusterView::lookup_namespace_labels`] answers.
pub type Lookup = Result<Option<BTreeMap<String, String>>, LookupError>;

/// How long an admission waits for a namespace the cache does not know: well
/// inside the webhook's own timeout (the chart's `timeoutSeconds`).
pub const NAMESPACE_LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    #[error("reading namespace {namespace:?} from the API server: {source}")]
    Api {
        namespace: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "namespace {namespace:?} is not in the injector's cache yet and the API server did not \
         answer within {timeout:?}"
    )]
    Timeout {
        namespace: String,
        timeout: Duration,
    },
}

/// A cached view that asks the API server for the namespaces it has not
/// seen yet, each lookup bounded by `timeout`: without it, a pod created
/// right after its (injection-enabled) namespace would silently go without
/// its sidecar.
pub struct LookingUpView<V> {
    cached: V,
    namespaces: Api<Namespace>,
    timeout: Duration,
}

impl<V: ClusterView> LookingUpView<V> {
    pub fn new(cached: V, client: kube::Client, timeout: Duration) -> Self {
        Self {
            cached,
            namespaces: Api::all(client),
            timeout,
        }
    }
}

impl<V: ClusterView> ClusterView for LookingUpView<V> {
    fn lifecycles_in(&self, namespaces: &[&str]) -> Vec<LifecycleEntry> {
        self.cached.lifecycles_in(namespaces)
    }
    fn namespace_labels(&self, namespace: &str) -> Option<BTreeMap<String, String>> {
        self.cached.namespace_labels(namespace)
    }
    fn native_sidecars(&self) -> bool {
        self.cached.native_sidecars()
    }
    fn lookup_namespace_labels<'a>(&'a self, namespace: &'a str) -> BoxFuture<'a, Lookup> {
        Box::pin(bounded_lookup(
            namespace,
            self.timeout,
            self.namespaces.get_metadata_opt(namespace),
        ))
    }
}

/// A namespace read, given up after `timeout`.
pub async fn bounded_lookup<F>(namespace: &str, timeout: Duration, get: F) -> Lookup
where
    F: Future<Output = kube::Result<Option<PartialObjectMeta<Namespace>>>>,
{
    match tokio::time::timeout(timeout, get).await {
        Ok(Ok(ns)) => Ok(ns.map(|n| n.metadata.labels.unwrap_or_default())),
        Ok(Err(source)) => Err(LookupError::Api {
            namespace: namespace.to_string(),
            source,
        }),
        Err(_) => Err(LookupError::Timeout {
            namespace: namespace.to_string(),
            timeout,
        }),
    }
}

impl ClusterView for StaticView {
    fn lifecycles_in(&self, namespaces: &[&str]) -> Vec<LifecycleEntry> {
        StaticView::lifecycles_in(self, namespaces)
    }
    fn namespace_labels(&self, namespace: &str) -> Option<BTreeMap<String, String>> {
        self.namespaces.get(namespace).cloned()
    }
    fn native_sidecars(&self) -> bool {
        self.native_sidecars
    }
}
