//! Lifecycle values the controller has written (or is writing) to pods and
//! the pod watch has not shown yet. A reconcile that runs before the watch
//! catches up reads the old value from the index and would write the new
//! one again, as it often does under a cluster default's edit, when the API
//! server's watch lags behind its writes. The controllers' "expectations",
//! as kube-controller-manager keeps them for the pods a ReplicaSet creates.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// How long a write is expected to show before it is no longer trusted
/// (the watch may have skipped it in a relist): then the pod is judged by
/// what the watch shows, and written again if it must be.
const TRUSTED_FOR: Duration = Duration::from_secs(30);

/// By pod (`namespace/name`): the value written, and when.
#[derive(Default)]
pub(super) struct Unconfirmed {
    writes: Mutex<HashMap<String, (String, Instant)>>,
}

impl Unconfirmed {
    /// `value` is being written to `pod`. Call before the request: the
    /// watch may show it before the answer arrives.
    pub(super) fn expect(&self, pod: &str, value: &str) {
        self.lock()
            .insert(pod.to_owned(), (value.to_owned(), Instant::now()));
    }

    /// The write to `pod` failed, or the pod is gone.
    pub(super) fn forget(&self, pod: &str) {
        self.lock().remove(pod);
    }

    /// The watch shows `pod` carrying `current`: a write it shows is
    /// confirmed.
    pub(super) fn seen(&self, pod: &str, current: Option<&str>) {
        let mut writes = self.lock();
        if writes
            .get(pod)
            .is_some_and(|(v, _)| Some(v.as_str()) == current)
        {
            writes.remove(pod);
        }
    }

    /// Whether `value` was written to `pod` recently and the watch has not
    /// shown it yet (so writing it again would change nothing).
    pub(super) fn pending(&self, pod: &str, value: &str) -> bool {
        let mut writes = self.lock();
        match writes.get(pod) {
            Some((v, at)) if at.elapsed() < TRUSTED_FOR => v == value,
            Some(_) => {
                writes.remove(pod);
                false
            }
            None => false,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, Instant)>> {
        self.writes.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_write_is_pending_until_the_watch_shows_it_or_it_is_too_old() {
        let u = Unconfirmed::default();
        u.expect("ns/p", "new");
        assert!(u.pending("ns/p", "new"));
        assert!(!u.pending("ns/p", "other"), "only that value");
        assert!(!u.pending("ns/q", "new"), "only that pod");

        u.seen("ns/p", Some("old"));
        assert!(u.pending("ns/p", "new"), "an older state of the pod");
        u.seen("ns/p", Some("new"));
        assert!(
            !u.pending("ns/p", "new"),
            "shown: the watch is the truth again"
        );

        u.expect("ns/p", "new");
        u.forget("ns/p");
        assert!(!u.pending("ns/p", "new"), "failed writes are forgotten");

        u.expect("ns/p", "new");
        tokio::time::advance(TRUSTED_FOR).await;
        assert!(!u.pending("ns/p", "new"), "never shown: no longer trusted");
    }
}
