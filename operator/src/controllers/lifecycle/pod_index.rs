//! The leader's live pods as the controller reads them: by namespace, each
//! read once from its metadata into a [`PodInfo`]. A reconcile looks only at
//! the namespaces its resource can reach: scanning every pod of the cluster,
//! and parsing its `remora.dev/status`, for each of thousands of resources
//! would take the leader minutes of CPU.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock, Weak};

use super::unconfirmed::Unconfirmed;
use crate::cluster::live_pod::LivePod;
use crate::cluster::watch::{Change, SharedWatch};
use crate::controllers::lifecycle::status::PodInfo;

type Namespaces = HashMap<String, HashMap<String, Arc<PodInfo>>>;

#[derive(Default)]
pub(super) struct PodIndex {
    by_namespace: RwLock<Namespaces>,
    /// What the controller wrote that the watch has not shown yet.
    pub(super) unconfirmed: Unconfirmed,
}

impl PodIndex {
    /// An index kept up to date by `pods` for as long as it lives. Call it
    /// once `pods` has listed: it holds what the store holds when it
    /// returns.
    pub(super) fn follow(pods: &SharedWatch<LivePod>) -> Arc<Self> {
        let index = Arc::new(Self::default());
        let weak: Weak<Self> = Arc::downgrade(&index);
        pods.observe(move |change| match weak.upgrade() {
            Some(index) => {
                index.apply(change);
                true
            }
            None => false,
        });
        index
    }

    fn apply(&self, change: &Change<LivePod>) {
        let meta = &change.object().metadata;
        let (Some(ns), Some(name)) = (meta.namespace.as_deref(), meta.name.as_deref()) else {
            return;
        };
        let key = format!("{ns}/{name}");
        match change {
            Change::Applied(pod) => self.unconfirmed.seen(&key, pod.lifecycle()),
            Change::Deleted(_) => self.unconfirmed.forget(&key),
        }
        let mut map = self
            .by_namespace
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        match change {
            Change::Applied(_) => {
                map.entry(ns.to_owned()).or_default().insert(
                    name.to_owned(),
                    Arc::new(PodInfo::of(Arc::clone(change.object()))),
                );
            }
            Change::Deleted(_) => {
                if let Some(pods) = map.get_mut(ns) {
                    pods.remove(name);
                    if pods.is_empty() {
                        map.remove(ns);
                    }
                }
            }
        }
    }

    /// The pods of `ns`.
    pub(super) fn namespace(&self, ns: &str) -> Vec<Arc<PodInfo>> {
        let map = self
            .by_namespace
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        map.get(ns)
            .map(|pods| pods.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Every namespace with pods, and its pods.
    pub(super) fn all(&self) -> Vec<(String, Vec<Arc<PodInfo>>)> {
        let map = self
            .by_namespace
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        map.iter()
            .map(|(ns, pods)| (ns.clone(), pods.values().cloned().collect()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;

    fn pod(ns: &str, name: &str, app: &str) -> LivePod {
        LivePod::from_meta(ObjectMeta {
            namespace: Some(ns.into()),
            name: Some(name.into()),
            labels: Some([("app".to_string(), app.to_string())].into()),
            ..ObjectMeta::default()
        })
    }

    fn names(pods: Vec<Arc<PodInfo>>) -> Vec<String> {
        let mut n: Vec<String> = pods
            .iter()
            .map(|p| format!("{}={}", p.name(), p.labels().get("app").unwrap_or_default()))
            .collect();
        n.sort();
        n
    }

    #[test]
    fn follows_applies_and_deletions_by_namespace() {
        let index = PodIndex::default();
        let apply = |p| index.apply(&Change::Applied(Arc::new(p)));
        apply(pod("a", "p1", "web"));
        apply(pod("a", "p2", "web"));
        apply(pod("b", "p1", "api"));
        apply(pod("a", "p1", "db"));
        assert_eq!(names(index.namespace("a")), ["p1=db", "p2=web"]);
        assert_eq!(names(index.namespace("b")), ["p1=api"]);
        assert!(index.namespace("c").is_empty());

        index.apply(&Change::Deleted(Arc::new(pod("b", "p1", "api"))));
        let mut all: Vec<String> = index.all().into_iter().map(|(ns, _)| ns).collect();
        all.sort();
        assert_eq!(all, ["a"], "an emptied namespace is dropped");
    }
}
