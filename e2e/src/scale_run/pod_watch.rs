//! A watch of the load's pods (metadata only) that keeps what the
//! operator wrote on each (`remora.dev/status` sources, the shutdown
//! settings of `remora.dev/lifecycle`) and, once given a target value of
//! one setting, when each pod first carried it: the client's view of a
//! retune, timed on arrival of the change.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::core::PartialObjectMeta;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Api, Client};
use remora_contract::annotations::{LIFECYCLE, STATUS};
use tokio::task::JoinHandle;
use tokio::time::Instant;

pub type PodKey = (String, String);

/// What the operator wrote on one pod.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Seen {
    /// `sources` of `remora.dev/status`; `None`: not injected.
    pub sources: Option<Vec<String>>,
    /// The string settings of `shutdown` in `remora.dev/lifecycle`.
    pub shutdown: BTreeMap<String, String>,
}

impl Seen {
    fn from_annotations(a: Option<&BTreeMap<String, String>>) -> Self {
        let json = |k: &str| {
            a.and_then(|a| a.get(k))
                .and_then(|v| serde_json::from_str::<serde_json::Value>(v).ok())
        };
        let sources = json(STATUS).map(|s| {
            s["sources"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        });
        let shutdown = json(LIFECYCLE)
            .and_then(|l| l["shutdown"].as_object().cloned())
            .into_iter()
            .flatten()
            .filter_map(|(k, v)| v.as_str().map(|s| (k, s.to_owned())))
            .collect();
        Self { sources, shutdown }
    }

    /// Whether setting `knob` holds `value` (as durations: `1m` is `60s`).
    pub fn carries(&self, knob: &str, value: &str) -> bool {
        let d = |s: &str| remora_contract::duration::parse(s).ok();
        self.shutdown
            .get(knob)
            .is_some_and(|v| v == value || (d(v).is_some() && d(v) == d(value)))
    }
}

#[derive(Debug, Default)]
struct Target {
    knob: String,
    value: String,
    reached: HashMap<PodKey, Instant>,
}

#[derive(Debug, Default)]
struct State {
    pods: HashMap<PodKey, Seen>,
    listed: bool,
    target: Option<Target>,
}

/// The running watch; stopped when dropped.
pub struct PodWatch {
    state: Arc<Mutex<State>>,
    task: JoinHandle<()>,
}

impl Drop for PodWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PodWatch {
    /// Watches the pods of every namespace carrying `labels`.
    pub fn start(client: Client, labels: &str) -> Self {
        let state = Arc::new(Mutex::new(State::default()));
        // Metadata only: the annotations are all that is read.
        let api: Api<PartialObjectMeta<Pod>> = Api::all(client);
        let stream = watcher(api, watcher::Config::default().labels(labels)).default_backoff();
        let st = Arc::clone(&state);
        let task = tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(ev) = stream.next().await {
                let Ok(ev) = ev else { continue };
                let now = Instant::now();
                let mut s = st.lock().unwrap_or_else(|e| e.into_inner());
                match ev {
                    Event::Apply(p) | Event::InitApply(p) => {
                        let key = (
                            p.metadata.namespace.clone().unwrap_or_default(),
                            p.metadata.name.clone().unwrap_or_default(),
                        );
                        let seen = Seen::from_annotations(p.metadata.annotations.as_ref());
                        if let Some(t) = s.target.as_mut()
                            && seen.carries(&t.knob, &t.value)
                        {
                            t.reached.entry(key.clone()).or_insert(now);
                        }
                        s.pods.insert(key, seen);
                    }
                    Event::Delete(p) => {
                        s.pods.remove(&(
                            p.metadata.namespace.clone().unwrap_or_default(),
                            p.metadata.name.clone().unwrap_or_default(),
                        ));
                    }
                    Event::Init => {}
                    Event::InitDone => s.listed = true,
                }
            }
        });
        Self { state, task }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the first listing is complete.
    pub fn listed(&self) -> bool {
        self.lock().listed
    }

    /// What was last seen of every pod.
    pub fn snapshot(&self) -> HashMap<PodKey, Seen> {
        self.lock().pods.clone()
    }

    /// From now on, note when each pod first carries `knob` = `value`.
    pub fn target(&self, knob: &str, value: &str) {
        self.lock().target = Some(Target {
            knob: knob.to_owned(),
            value: value.to_owned(),
            reached: HashMap::new(),
        });
    }

    /// Of `pods`, when each reached the target; `None` for those that have
    /// not yet.
    pub fn reached(&self, pods: &BTreeSet<PodKey>) -> Vec<Option<Instant>> {
        let s = self.lock();
        pods.iter()
            .map(|k| s.target.as_ref().and_then(|t| t.reached.get(k).copied()))
            .collect()
    }

    /// Waits until every one of `pods` carries the target, polling every
    /// 50 ms, at most `timeout`; returns each one's time from `since`
    /// (`None`: not reached).
    pub async fn wait_reached(
        &self,
        pods: &BTreeSet<PodKey>,
        since: Instant,
        timeout: Duration,
    ) -> Vec<Option<Duration>> {
        let deadline = Instant::now() + timeout;
        loop {
            let r = self.reached(pods);
            if r.iter().all(Option::is_some) || Instant::now() >= deadline {
                return r
                    .into_iter()
                    .map(|t| t.map(|t| t.saturating_duration_since(since)))
                    .collect();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_the_operator_wrote() {
        let a = BTreeMap::from([
            (
                STATUS.to_owned(),
                r#"{"injected":true,"sources":["defaults","namespace:a/wide"]}"#.to_owned(),
            ),
            (
                LIFECYCLE.to_owned(),
                r#"{"shutdown":{"drainDuration":"1m","exitOnZeroActiveConnections":false}}"#
                    .to_owned(),
            ),
        ]);
        let s = Seen::from_annotations(Some(&a));
        assert_eq!(
            s.sources,
            Some(vec!["defaults".to_owned(), "namespace:a/wide".to_owned()])
        );
        assert!(s.carries("drainDuration", "60s"));
        assert!(!s.carries("drainDuration", "61s"));
        assert!(!s.carries("terminationDrainDuration", "5s"));
        assert_eq!(Seen::from_annotations(None), Seen::default());
    }
}
