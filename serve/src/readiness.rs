//! Readiness built from named guards.
//!
//! Each part of a component that must be in place before it takes traffic
//! registers a guard under its name (the agent's "envoy", "draining",
//! "certificates"; the operator's "cluster-view").
//! While any guard is pending, the readiness endpoint answers 503 and lists every
//! pending guard with its reason. A guard can go back to pending (Envoy died,
//! a drain started); dropping a guard stops it blocking.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

#[derive(Clone, Debug)]
pub struct Readiness {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    pending: Mutex<BTreeMap<String, String>>,
    /// Bumped on every change, so waiters can re-check.
    changed: watch::Sender<u64>,
}

impl Default for Readiness {
    fn default() -> Self {
        Self::new()
    }
}

impl Readiness {
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Inner {
                pending: Mutex::new(BTreeMap::new()),
                changed: watch::channel(0).0,
            }),
        }
    }

    /// Register a guard that starts pending with `reason`.
    pub fn register(&self, name: impl Into<String>, reason: impl Into<String>) -> ReadinessGuard {
        let guard = ReadinessGuard {
            name: name.into(),
            readiness: self.clone(),
        };
        guard.pending(reason);
        guard
    }

    /// The pending guards and their reasons; empty means ready.
    pub fn pending(&self) -> Vec<(String, String)> {
        self.lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    pub fn is_ready(&self) -> bool {
        self.lock().is_empty()
    }

    /// A receiver that sees a new value on every change of readiness.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.inner.changed.subscribe()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, String>> {
        // A panic elsewhere while holding this lock leaves a plain map behind: keep using it.
        self.inner
            .pending
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn set(&self, name: &str, reason: Option<String>) {
        let changed = {
            let mut map = self.lock();
            match reason {
                Some(r) => map.insert(name.to_string(), r.clone()).as_ref() != Some(&r),
                None => map.remove(name).is_some(),
            }
        };
        if changed {
            self.inner.changed.send_modify(|v| *v += 1);
        }
    }
}

/// One named condition of readiness.
#[derive(Debug)]
pub struct ReadinessGuard {
    name: String,
    readiness: Readiness,
}

impl ReadinessGuard {
    /// Mark this guard pending, saying why.
    pub fn pending(&self, reason: impl Into<String>) {
        self.readiness.set(&self.name, Some(reason.into()));
    }

    /// Mark this guard satisfied.
    pub fn ready(&self) {
        self.readiness.set(&self.name, None);
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for ReadinessGuard {
    fn drop(&mut self) {
        self.readiness.set(&self.name, None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_block_until_ready_and_can_regress() {
        let r = Readiness::new();
        assert!(r.is_ready());
        let envoy = r.register("envoy", "not started");
        let certs = r.register("certificates", "default not served");
        assert_eq!(r.pending().len(), 2);
        envoy.ready();
        assert_eq!(
            r.pending(),
            vec![("certificates".to_string(), "default not served".to_string())]
        );
        drop(certs);
        assert!(r.is_ready());
        envoy.pending("Envoy exited");
        assert!(!r.is_ready());
    }

    #[tokio::test]
    async fn subscribers_see_changes() {
        let r = Readiness::new();
        let mut rx = r.subscribe();
        let g = r.register("envoy", "starting");
        assert!(rx.has_changed().expect("open"));
        rx.mark_unchanged();
        g.pending("starting");
        assert!(!rx.has_changed().expect("open"), "same reason is no change");
        g.ready();
        assert!(rx.has_changed().expect("open"));
    }
}
