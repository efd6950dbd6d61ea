//! What triggers a reconcile besides the resource itself: pods that came,
//! went or changed what decides their settings, and siblings whose spec
//! changed.

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::core::PartialObjectMeta;
use kube::runtime::watcher;

/// Pods still running or about to: the controller's whole view.
pub(super) const LIVE_PODS: &str = "status.phase!=Succeeded,status.phase!=Failed";

/// What of a pod decides which resources reach it and what it should carry:
/// labels, annotations, its controlling owner. Status-only updates (most of
/// a pod's updates) leave it unchanged.
pub(super) fn pod_key(p: &PartialObjectMeta<Pod>) -> (String, u64) {
    use std::hash::{Hash, Hasher};
    let key = format!(
        "{}/{}",
        p.metadata.namespace.as_deref().unwrap_or_default(),
        p.metadata.name.as_deref().unwrap_or_default()
    );
    let mut h = std::collections::hash_map::DefaultHasher::new();
    p.metadata.labels.hash(&mut h);
    p.metadata.annotations.hash(&mut h);
    for o in p.metadata.owner_references.iter().flatten() {
        (&o.kind, &o.name, o.controller).hash(&mut h);
    }
    (key, h.finish())
}

/// The objects of a watch whose fingerprint (`key` gives name and
/// fingerprint) changed since last seen, and every deletion. A relist of
/// unchanged objects passes nothing.
pub(super) fn changes<K, S>(
    events: S,
    key: impl Fn(&K) -> (String, u64) + Send + 'static,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send
where
    K: Send + 'static,
    S: futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
{
    let mut seen: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    events.filter_map(move |ev| {
        let out = match ev {
            Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                let (k, fingerprint) = key(&o);
                (seen.insert(k, fingerprint) != Some(fingerprint)).then_some(Ok(o))
            }
            Ok(watcher::Event::Delete(o)) => {
                seen.remove(&key(&o).0);
                Some(Ok(o))
            }
            Ok(watcher::Event::Init | watcher::Event::InitDone) => None,
            Err(e) => Some(Err(e)),
        };
        futures::future::ready(out)
    })
}
