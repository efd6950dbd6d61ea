//! One list-watch per kind, shared by every reader in the process: a
//! reflector keeps the store, and each change is handed to every
//! subscriber. A subscriber may join at any time (the leader's controllers
//! start and stop with leadership) and first gets what the store holds then,
//! so it misses nothing, and the API server serves one watch per kind, not
//! one per reader.
//!
//! Not kube-runtime's `reflector::store_shared`: its subscribers are told
//! neither of deletions (the controller must learn that a pod finished or a
//! resource was deleted) nor, when they join late, of what was listed
//! before.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};

use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use futures::{Stream, StreamExt};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

/// What a subscriber is told.
#[derive(Debug)]
pub enum Change<K> {
    /// Created, updated or listed: the object as the store has it.
    Applied(Arc<K>),
    /// Deleted, or no longer matching the watch's selector: its last state.
    Deleted(Arc<K>),
}

impl<K> Clone for Change<K> {
    fn clone(&self) -> Self {
        match self {
            Self::Applied(o) => Self::Applied(Arc::clone(o)),
            Self::Deleted(o) => Self::Deleted(Arc::clone(o)),
        }
    }
}

impl<K> Change<K> {
    pub fn object(&self) -> &Arc<K> {
        match self {
            Self::Applied(o) | Self::Deleted(o) => o,
        }
    }

    pub fn into_object(self) -> Arc<K> {
        match self {
            Self::Applied(o) | Self::Deleted(o) => o,
        }
    }
}

/// A watch of one kind: its store, and its changes for whoever subscribes.
pub struct SharedWatch<K>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    store: Store<K>,
    subscribers: Arc<Mutex<Subscribers<K>>>,
    /// True once the first listing is stored. Not `Store::wait_until_ready`:
    /// its future keeps only the last waiter's waker, so of two tasks
    /// waiting at once one may never wake.
    listed: tokio::sync::watch::Sender<bool>,
}

/// Told each change on the watch's own task, before any stream subscriber:
/// returns `false` to unsubscribe.
type Observer<K> = Box<dyn FnMut(&Change<K>) -> bool + Send>;

struct Subscribers<K> {
    streams: Vec<UnboundedSender<Change<K>>>,
    observers: Vec<Observer<K>>,
}

impl<K> Default for Subscribers<K> {
    fn default() -> Self {
        Self {
            streams: Vec::new(),
            observers: Vec::new(),
        }
    }
}

impl<K> Clone for SharedWatch<K>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            subscribers: Arc::clone(&self.subscribers),
            listed: self.listed.clone(),
        }
    }
}

impl<K> SharedWatch<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    /// Watch `api` until `shutdown`. `slim` trims each object before it is
    /// stored: what no reader reads is not kept.
    pub fn start(
        what: &'static str,
        api: Api<K>,
        config: watcher::Config,
        slim: impl FnMut(&mut K) + Send + 'static,
        shutdown: CancellationToken,
    ) -> Self {
        let (store, writer) = reflector::store();
        let me = Self::new(store);
        let events = watcher(api, config)
            .default_backoff()
            .modify(slim)
            .reflect(writer);
        let fan_out = me.clone();
        // The store as it was when a relist began: what the relist no longer
        // holds was deleted meanwhile.
        let mut before_relist = None;
        drive(what, events, shutdown, move |ev| {
            fan_out.publish(ev, &mut before_relist)
        });
        me
    }

    fn new(store: Store<K>) -> Self {
        Self {
            store,
            subscribers: Arc::default(),
            listed: tokio::sync::watch::Sender::new(false),
        }
    }

    /// The objects, shared with every other reader.
    pub fn store(&self) -> Store<K> {
        self.store.clone()
    }

    /// Returns once the first listing is in the store.
    pub async fn listed(&self) {
        let mut rx = self.listed.subscribe();
        // The sender lives in `self`: the wait cannot fail.
        let _ = rx.wait_for(|l| *l).await;
    }

    /// Every change from now on, after what the store holds now. A repeat
    /// is possible (an object changed as one subscribes); a gap is not.
    /// The stream is unbounded, so that the watch never waits for a slow
    /// reader: keep reading it (a kube-runtime Controller does), or drop it
    /// to unsubscribe.
    pub fn subscribe(&self) -> UnboundedReceiver<Change<K>> {
        let (tx, rx) = unbounded();
        let mut subscribers = self
            .subscribers
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Under the lock that `publish` takes: a change is in this snapshot,
        // or published after the subscription, or both.
        for o in self.store.state() {
            let _ = tx.unbounded_send(Change::Applied(o));
        }
        subscribers.streams.push(tx);
        rx
    }

    /// As [`SharedWatch::subscribe`], but `observe` is called in place, on
    /// the watch's task, with what the store holds now (before this
    /// returns) and then with every change before stream subscribers get
    /// it: an index it keeps is never behind what they are told. It must be
    /// quick and must not block. It unsubscribes by returning `false`.
    pub fn observe(&self, mut observe: impl FnMut(&Change<K>) -> bool + Send + 'static) {
        let mut subscribers = self
            .subscribers
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for o in self.store.state() {
            if !observe(&Change::Applied(o)) {
                return;
            }
        }
        subscribers.observers.push(Box::new(observe));
    }

    fn publish(&self, ev: watcher::Event<K>, before_relist: &mut Option<Vec<Arc<K>>>) {
        let changes = match ev {
            watcher::Event::Apply(o) => vec![Change::Applied(self.stored(o))],
            watcher::Event::Delete(o) => vec![Change::Deleted(Arc::new(o))],
            // The store has not taken the relist in yet.
            watcher::Event::Init => {
                *before_relist = Some(self.store.state());
                return;
            }
            watcher::Event::InitApply(_) => return,
            // A (re)list is stored whole at its end: pass what it holds, and
            // what it dropped.
            watcher::Event::InitDone => {
                let gone = before_relist
                    .take()
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|o| self.store.get(&ObjectRef::from_obj(o.as_ref())).is_none());
                let changes = gone
                    .map(Change::Deleted)
                    .chain(self.store.state().into_iter().map(Change::Applied))
                    .collect();
                self.listed.send_replace(true);
                changes
            }
        };
        let mut subscribers = self
            .subscribers
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        subscribers
            .observers
            .retain_mut(|observe| changes.iter().all(&mut *observe));
        // A dropped stream unsubscribes.
        subscribers
            .streams
            .retain(|tx| changes.iter().all(|c| tx.unbounded_send(c.clone()).is_ok()));
    }

    /// The store's copy of an object it just stored (shared, not copied).
    fn stored(&self, o: K) -> Arc<K> {
        self.store
            .get(&ObjectRef::from_obj(&o))
            .unwrap_or_else(|| Arc::new(o))
    }
}

/// Poll a watch stream until `shutdown` or its end, handing each event to
/// `each`; errors are logged (the watcher retries with backoff).
pub(crate) fn drive<S, T>(
    what: &'static str,
    stream: S,
    shutdown: CancellationToken,
    mut each: impl FnMut(T) + Send + 'static,
) where
    S: Stream<Item = Result<T, watcher::Error>> + Send + 'static,
    T: Send,
{
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        loop {
            let ev = tokio::select! {
                () = shutdown.cancelled() => return,
                ev = stream.next() => ev,
            };
            match ev {
                None => return,
                Some(Err(e)) => tracing::warn!(watch = what, error = %e, "watch error; retrying"),
                Some(Ok(ev)) => each(ev),
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;
    use k8s_openapi::api::core::v1::ConfigMap;

    fn cm(name: &str) -> ConfigMap {
        ConfigMap {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// A watch fed by hand, event by event, as its reflector feeds it.
    struct Fed {
        watch: SharedWatch<ConfigMap>,
        writer: reflector::store::Writer<ConfigMap>,
        before_relist: Option<Vec<Arc<ConfigMap>>>,
    }

    impl Fed {
        fn new() -> Self {
            let (store, writer) = reflector::store::<ConfigMap>();
            Self {
                watch: SharedWatch::new(store),
                writer,
                before_relist: None,
            }
        }

        fn feed(&mut self, ev: watcher::Event<ConfigMap>) {
            self.writer.apply_watcher_event(&ev);
            self.watch.publish(ev, &mut self.before_relist);
        }
    }

    /// What a subscriber was told so far, `+name` or `-name`, sorted (a
    /// listing comes in the store's order).
    fn told(rx: &mut UnboundedReceiver<Change<ConfigMap>>) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(Some(c)) = rx.next().now_or_never() {
            let sign = if matches!(c, Change::Applied(_)) {
                "+"
            } else {
                "-"
            };
            out.push(format!(
                "{sign}{}",
                c.object().metadata.name.as_deref().unwrap_or_default()
            ));
        }
        out.sort();
        out
    }

    #[test]
    fn subscribers_get_the_store_then_every_change_deletions_included() {
        use watcher::Event::{Delete, Init, InitApply, InitDone};
        let mut fed = Fed::new();
        let watch = fed.watch.clone();
        let mut feed = |ev| fed.feed(ev);
        let mut early = watch.subscribe();
        feed(Init);
        feed(InitApply(cm("a")));
        feed(InitApply(cm("b")));
        assert_eq!(
            told(&mut early),
            Vec::<String>::new(),
            "a listing counts once whole"
        );
        feed(InitDone);
        assert_eq!(told(&mut early), ["+a", "+b"]);

        // Joining late: what is there, then what changes.
        let mut late = watch.subscribe();
        assert_eq!(told(&mut late), ["+a", "+b"]);
        feed(Delete(cm("a")));
        // A relist after a gap in which b was deleted and c created.
        feed(Init);
        feed(InitApply(cm("c")));
        feed(InitDone);
        for rx in [&mut early, &mut late] {
            assert_eq!(told(rx), ["+c", "-a", "-b"]);
        }

        // A dropped stream unsubscribes.
        drop(early);
        feed(Delete(cm("c")));
        assert_eq!(told(&mut late), ["-c"]);
        assert_eq!(
            watch
                .subscribers
                .lock()
                .map(|s| s.streams.len())
                .unwrap_or_default(),
            1
        );
    }

    #[tokio::test]
    async fn every_task_waiting_for_the_first_listing_wakes() {
        use watcher::Event::{Init, InitApply, InitDone};
        let mut fed = Fed::new();
        let watch = fed.watch.clone();
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let w = watch.clone();
                tokio::spawn(async move { w.listed().await })
            })
            .collect();
        tokio::task::yield_now().await;
        for ev in [Init, InitApply(cm("a")), InitDone] {
            fed.feed(ev);
        }
        for w in waiters {
            tokio::time::timeout(std::time::Duration::from_secs(5), w)
                .await
                .expect("woken")
                .expect("joined");
        }
    }

    #[test]
    fn an_observer_gets_the_store_at_once_then_each_change_until_it_declines() {
        use watcher::Event::{Apply, Delete, Init, InitApply, InitDone};
        let mut fed = Fed::new();
        let watch = fed.watch.clone();
        let mut feed = |ev| fed.feed(ev);
        feed(Init);
        feed(InitApply(cm("a")));
        feed(InitDone);
        let seen = Arc::new(Mutex::new(Vec::<String>::new()));
        let log = Arc::clone(&seen);
        watch.observe(move |c| {
            let name = c.object().metadata.name.clone().unwrap_or_default();
            let sign = if matches!(c, Change::Applied(_)) {
                "+"
            } else {
                "-"
            };
            let mut log = log.lock().unwrap_or_else(PoisonError::into_inner);
            log.push(format!("{sign}{name}"));
            name != "stop"
        });
        let seen_now = || seen.lock().map(|s| s.clone()).unwrap_or_default();
        assert_eq!(
            seen_now(),
            ["+a"],
            "what the store held, before observe returned"
        );
        feed(Apply(cm("b")));
        feed(Delete(cm("a")));
        assert_eq!(seen_now(), ["+a", "+b", "-a"]);
        feed(Apply(cm("stop")));
        feed(Apply(cm("c")));
        assert_eq!(
            seen_now(),
            ["+a", "+b", "-a", "+stop"],
            "declined, then told nothing"
        );
    }
}
