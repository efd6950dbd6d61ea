//! What triggers a reconcile besides the resource itself: pods that came,
//! went or changed what decides their settings, and siblings whose spec
//! changed, came or went.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use futures::{Stream, StreamExt};
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use remora_contract::annotations;
use remora_crds::SidecarLifecycle;

use crate::cluster::live_pod::LivePod;
use crate::cluster::watch::Change;
use crate::controllers::lifecycle::status::{PodInfo, governor, reaches};
use remora_inject::resolve::LifecycleEntry;

/// A pod change concerns every resource that reaches it.
pub(super) fn by_pod(
    lifecycles: Store<SidecarLifecycle>,
    operator_ns: String,
) -> impl Fn(Arc<LivePod>) -> Vec<ObjectRef<SidecarLifecycle>> + Send + Sync + 'static {
    move |p| {
        let pod = PodInfo::of(p);
        candidates(&lifecycles, &pod, &operator_ns)
            .filter(|r| reaches(&LifecycleEntry::from_resource(r), &pod, &operator_ns))
            .map(|r| ObjectRef::from_obj(r.as_ref()))
            .collect()
    }
}

/// A change of only the settings a pod runs with (`remora.dev/lifecycle`)
/// concerns its governor alone: the governor decides that value (and puts
/// it back if someone else changed it), and nothing another resource
/// reports depends on it. Triggering every resource that reaches the pod
/// would have each of a cluster default's retunes reconcile the default
/// again, over every pod of the cluster.
pub(super) fn by_governor(
    lifecycles: Store<SidecarLifecycle>,
    operator_ns: String,
) -> impl Fn(Arc<LivePod>) -> Vec<ObjectRef<SidecarLifecycle>> + Send + Sync + 'static {
    move |p| {
        let pod = PodInfo::of(p);
        let entries: Vec<LifecycleEntry> = candidates(&lifecycles, &pod, &operator_ns)
            .map(|r| LifecycleEntry::from_resource(&r))
            .collect();
        governor(&entries, &pod, &operator_ns)
            .map(|g| ObjectRef::new(&g.name).within(&g.namespace))
            .into_iter()
            .collect()
    }
}

/// The resources that may reach `pod`: its own namespace's and the cluster
/// defaults (the rest are not even read).
fn candidates<'a>(
    lifecycles: &Store<SidecarLifecycle>,
    pod: &'a PodInfo,
    operator_ns: &'a str,
) -> impl Iterator<Item = Arc<SidecarLifecycle>> + 'a {
    lifecycles.state().into_iter().filter(move |r| {
        r.metadata
            .namespace
            .as_deref()
            .is_some_and(|ns| ns == pod.namespace() || ns == operator_ns)
    })
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

/// What of a pod decides which resources reach it and what they report:
/// labels, its controlling owner, what its `remora.dev/status` records and
/// its own settings; not what the controllers write to running pods (the
/// lifecycle, retuned, is kept apart; `remora.dev/stop` is the Jobs
/// controller's). Status-only updates (most of a pod's updates) leave it
/// unchanged.
pub(super) fn pod_key(p: &LivePod) -> (String, u64) {
    let mut h = DefaultHasher::new();
    p.labels().hash(&mut h);
    p.injected().hash(&mut h);
    for a in p.annotations() {
        if a.0 != annotations::STOP {
            a.hash(&mut h);
        }
    }
    for o in p.metadata.owner_references.iter().flatten() {
        (&o.kind, &o.name, o.controller).hash(&mut h);
    }
    (pod_name(p), h.finish())
}

/// The settings a pod runs with: its `remora.dev/lifecycle` (see
/// [`by_governor`]).
pub(super) fn pod_settings(p: &LivePod) -> (String, u64) {
    let mut h = DefaultHasher::new();
    p.lifecycle().hash(&mut h);
    (pod_name(p), h.finish())
}

fn pod_name(p: &LivePod) -> String {
    format!(
        "{}/{}",
        p.metadata.namespace.as_deref().unwrap_or_default(),
        p.metadata.name.as_deref().unwrap_or_default()
    )
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

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;
    use kube::runtime::{reflector, watcher};
    use remora_crds::{SidecarLifecycleSpec, WorkloadSelector};

    const OPERATOR_NS: &str = "remora-system";

    fn slc(ns: &str, name: &str, app: Option<&str>) -> SidecarLifecycle {
        let mut r = SidecarLifecycle::new(
            name,
            SidecarLifecycleSpec {
                selector: app.map(|a| WorkloadSelector {
                    match_labels: [("app".to_string(), a.to_string())].into(),
                }),
                ..SidecarLifecycleSpec::default()
            },
        );
        r.metadata.namespace = Some(ns.into());
        r
    }

    fn store(all: Vec<SidecarLifecycle>) -> Store<SidecarLifecycle> {
        let (store, mut writer) = reflector::store();
        writer.apply_watcher_event(&watcher::Event::Init);
        for r in all {
            writer.apply_watcher_event(&watcher::Event::InitApply(r));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        store
    }

    fn pod(annotations: &[(&str, &str)]) -> LivePod {
        LivePod::from_meta(ObjectMeta {
            namespace: Some("shop".into()),
            name: Some("web-1".into()),
            labels: Some([("app".to_string(), "web".to_string())].into()),
            annotations: Some(
                annotations
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        })
    }

    fn names(refs: Vec<ObjectRef<SidecarLifecycle>>) -> Vec<String> {
        let mut n: Vec<String> = refs
            .iter()
            .map(|r| format!("{}/{}", r.namespace.as_deref().unwrap_or_default(), r.name))
            .collect();
        n.sort();
        n
    }

    #[test]
    fn what_the_controllers_write_leaves_the_pod_key_alone_and_moves_its_settings() {
        let before = pod(&[(annotations::DRAIN_DURATION, "5s")]);
        let retuned = pod(&[
            (annotations::DRAIN_DURATION, "5s"),
            (annotations::LIFECYCLE, r#"{"drain":"9s"}"#),
            (annotations::STOP, "true"),
        ]);
        assert_eq!(pod_key(&before), pod_key(&retuned));
        assert_ne!(pod_settings(&before), pod_settings(&retuned));

        let overridden = pod(&[(annotations::DRAIN_DURATION, "7s")]);
        assert_ne!(
            pod_key(&before),
            pod_key(&overridden),
            "a pod's own setting"
        );
        assert_eq!(pod_settings(&before), pod_settings(&overridden));
    }

    #[test]
    fn a_settings_change_triggers_the_governor_and_any_other_change_every_resource_reaching_it() {
        let lifecycles = store(vec![
            slc(OPERATOR_NS, "default", None),
            slc("shop", "shop-wide", None),
            slc("shop", "web", Some("web")),
            slc("shop", "api", Some("api")),
            slc("other", "elsewhere", None),
        ]);
        let p = Arc::new(pod(&[]));
        let reaching = by_pod(lifecycles.clone(), OPERATOR_NS.into())(Arc::clone(&p));
        assert_eq!(
            names(reaching),
            ["remora-system/default", "shop/shop-wide", "shop/web"]
        );
        let governing = by_governor(lifecycles, OPERATOR_NS.into())(p);
        assert_eq!(names(governing), ["shop/web"], "the workload layer wins");

        let only_default = store(vec![slc(OPERATOR_NS, "default", None)]);
        let governing = by_governor(only_default, OPERATOR_NS.into())(Arc::new(pod(&[])));
        assert_eq!(names(governing), ["remora-system/default"]);
    }
}
