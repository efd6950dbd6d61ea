//! What triggers a reconcile besides the resource itself: pods that came,
//! went or changed what decides their settings, and siblings whose spec
//! changed, came or went.

use std::collections::HashMap;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use remora_crds::SidecarLifecycle;

use crate::live_pod::LivePod;
use crate::sidecar_config::LifecycleEntry;
use crate::status::{PodInfo, reaches};
use crate::watch::Change;

/// A pod change concerns every resource that reaches it.
pub(super) fn by_pod(
    lifecycles: Store<SidecarLifecycle>,
    operator_ns: String,
) -> impl Fn(Arc<LivePod>) -> Vec<ObjectRef<SidecarLifecycle>> + Send + Sync + 'static {
    move |p| {
        let pod = PodInfo::from_meta(&p.metadata);
        lifecycles
            .state()
            .iter()
            // Only its own namespace's and the cluster defaults can reach it:
            // the rest are not even read.
            .filter(|r| {
                r.metadata
                    .namespace
                    .as_deref()
                    .is_some_and(|ns| ns == pod.namespace || ns == operator_ns)
            })
            .filter(|r| reaches(&LifecycleEntry::from_resource(r), &pod, &operator_ns))
            .map(|r| ObjectRef::from_obj(r.as_ref()))
            .collect()
    }
}

/// A resource's change (or deletion) moves the conflicts, governors and
/// settings of its siblings: its namespace, and everything when it is a
/// cluster default.
pub(super) fn by_sibling(
    lifecycles: Store<SidecarLifecycle>,
    operator_ns: String,
) -> impl Fn(Arc<SidecarLifecycle>) -> Vec<ObjectRef<SidecarLifecycle>> + Send + Sync + 'static {
    move |changed| {
        let changed_ns = changed.namespace().unwrap_or_default();
        let cluster_wide = changed_ns == operator_ns && changed.spec.selector.is_none();
        lifecycles
            .state()
            .iter()
            .filter(|r| {
                cluster_wide
                    || r.namespace().as_deref() == Some(changed_ns.as_str())
                    || (r.namespace().as_deref() == Some(operator_ns.as_str())
                        && r.spec.selector.is_none())
            })
            .map(|r| ObjectRef::from_obj(r.as_ref()))
            .collect()
    }
}

/// Only spec changes (generation), creations and deletions move the
/// siblings; a status write does not.
pub(super) fn generation(r: &SidecarLifecycle) -> (String, u64) {
    let key = format!("{}/{}", r.namespace().unwrap_or_default(), r.name_any());
    (key, r.metadata.generation.unwrap_or_default() as u64)
}

/// What of a pod decides which resources reach it and what it should carry:
/// labels, annotations, its controlling owner. Status-only updates (most of
/// a pod's updates) leave it unchanged.
pub(super) fn pod_key(p: &LivePod) -> (String, u64) {
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

/// The changes whose fingerprint (`key` gives name and fingerprint) differs
/// from the last seen, and every deletion. A relist of unchanged objects
/// passes nothing.
pub(super) fn changes<K>(
    changes: impl Stream<Item = Change<K>> + Send,
    key: impl Fn(&K) -> (String, u64) + Send + 'static,
) -> impl Stream<Item = Change<K>> + Send
where
    K: Send + Sync + 'static,
{
    let mut seen: HashMap<String, u64> = HashMap::new();
    changes.filter_map(move |c| {
        let (k, fingerprint) = key(c.object());
        let pass = match &c {
            Change::Applied(_) => seen.insert(k, fingerprint) != Some(fingerprint),
            Change::Deleted(_) => {
                seen.remove(&k);
                true
            }
        };
        futures::future::ready(pass.then_some(c))
    })
}
