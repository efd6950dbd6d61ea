//! Events on a pod from a server that answers many pods (Warnings: the
//! workload CA's refusals, the discovery server's NACKs; Normal: the
//! discovery server's confirmed withdrawals), published on
//! tasks of their own so the answer is not held up by the API server, and
//! a bounded number at a time: more are dropped (the servers count them in
//! their metrics all the same), so a pod misbehaving in a loop cannot make
//! the operator flood the API server.

use std::sync::Arc;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder};

/// At most this many Events are being published at once.
const MAX_IN_FLIGHT: usize = 8;
/// Kubernetes refuses an Event note over 1 kB.
const MAX_NOTE_BYTES: usize = 1024;

/// One Event on a pod (a Warning, or Normal through [`PodEvents::normal`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    pub namespace: String,
    pub pod: String,
    pub reason: &'static str,
    pub action: &'static str,
    pub note: String,
}

#[derive(Clone)]
pub struct PodEvents {
    sink: Sink,
    slots: Arc<tokio::sync::Semaphore>,
}

#[derive(Clone)]
enum Sink {
    Api(Recorder),
    /// Test double: the warnings go to a channel instead of the API server.
    Channel(tokio::sync::mpsc::UnboundedSender<Warning>),
}

impl PodEvents {
    pub fn new(recorder: Recorder) -> Self {
        Self::with(Sink::Api(recorder))
    }

    /// Test double: what would be published arrives on the receiver.
    pub fn channel_for_tests() -> (Self, tokio::sync::mpsc::UnboundedReceiver<Warning>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (Self::with(Sink::Channel(tx)), rx)
    }

    fn with(sink: Sink) -> Self {
        Self {
            sink,
            slots: Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT)),
        }
    }

    /// Publish `w` unless [`MAX_IN_FLIGHT`] are being published already.
    pub fn warn(&self, w: Warning) {
        self.publish(EventType::Warning, w);
    }

    /// [`PodEvents::warn`], as a Normal Event (the test double's channel
    /// carries both).
    pub fn normal(&self, w: Warning) {
        self.publish(EventType::Normal, w);
    }

    fn publish(&self, type_: EventType, w: Warning) {
        let Ok(slot) = Arc::clone(&self.slots).try_acquire_owned() else {
            tracing::debug!(
                reason = w.reason,
                "pod Events are being published already; dropping this one"
            );
            return;
        };
        let recorder = match &self.sink {
            Sink::Api(r) => r.clone(),
            Sink::Channel(tx) => {
                let _ = tx.send(w);
                return;
            }
        };
        let event = Event {
            type_,
            reason: w.reason.into(),
            note: Some(bounded_note(w.note)),
            action: w.action.into(),
            secondary: None,
        };
        let regarding = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(w.pod),
            namespace: Some(w.namespace),
            ..Default::default()
        };
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = recorder.publish(&event, &regarding).await {
                tracing::debug!(error = %e, reason = %event.reason, "cannot record a pod's Event");
            }
        });
    }
}

/// `note` cut to what the API server takes, on a character boundary.
pub fn bounded_note(mut note: String) -> String {
    if note.len() > MAX_NOTE_BYTES {
        let mut end = MAX_NOTE_BYTES - '…'.len_utf8();
        while !note.is_char_boundary(end) {
            end -= 1;
        }
        note.truncate(end);
        note.push('…');
    }
    note
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_note_is_cut_on_a_character_boundary() {
        assert_eq!(bounded_note("short".into()), "short");
        let long = "é".repeat(1000);
        let cut = bounded_note(long);
        assert!(cut.len() <= MAX_NOTE_BYTES, "{}", cut.len());
        assert!(cut.ends_with('…'));
    }
}
