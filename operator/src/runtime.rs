//! The process's runtime: one shutdown signal, the readiness guards, and
//! the tasks it supervises (kubert's `Runtime` is the model).
//!
//! Shutdown: one [`CancellationToken`], cancelled by the first SIGTERM or
//! SIGINT or by a supervised task that fails, and handed to every long-lived
//! task; each stops (or drains) on it. A second signal aborts at once
//! ([`Runtime::run`] returns [`RuntimeError::Aborted`]).
//!
//! Readiness: named guards ([`Runtime::not_ready_until`]); the replica is
//! ready once none is pending.
//!
//! Tasks: [`Runtime::spawn`] runs a named task in the background. One that
//! fails (returns an error, or panics) is logged and shuts the process down:
//! a replica missing part of its work must not look healthy. One that ends
//! quietly has done its job (a readiness follower whose source closed).

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use remora_serve::readiness::{Readiness, ReadinessGuard};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("installing the signal handlers: {0}")]
    Signals(#[source] std::io::Error),
    #[error("aborted by a second signal")]
    Aborted,
}

/// See the module doc. Cheap to clone: clones share one shutdown, one
/// abort and one set of readiness guards.
#[derive(Clone, Debug, Default)]
pub struct Runtime {
    shutdown: CancellationToken,
    abort: CancellationToken,
    readiness: Readiness,
}

impl Runtime {
    /// A runtime stopped by its tasks or [`Self::shutdown_token`] alone
    /// (tests); [`Self::with_signals`] adds the signals.
    pub fn new() -> Self {
        Self::default()
    }

    /// Shut down on the first SIGTERM or SIGINT, abort on the second.
    /// `grace` is only logged: each server bounds its own drain with it.
    pub fn with_signals(grace: Duration) -> Result<Self, RuntimeError> {
        use tokio::signal::unix::{SignalKind, signal};
        let rt = Self::new();
        let mut term = signal(SignalKind::terminate()).map_err(RuntimeError::Signals)?;
        let mut int = signal(SignalKind::interrupt()).map_err(RuntimeError::Signals)?;
        let (shutdown, abort) = (rt.shutdown.clone(), rt.abort.clone());
        tokio::spawn(async move {
            let mut next = async || {
                tokio::select! {
                    _ = term.recv() => "SIGTERM",
                    _ = int.recv() => "SIGINT",
                }
            };
            let first = next().await;
            tracing::info!(
                signal = first,
                ?grace,
                "shutting down; a second signal aborts"
            );
            shutdown.cancel();
            let second = next().await;
            tracing::warn!(signal = second, "second signal; aborting");
            abort.cancel();
        });
        Ok(rt)
    }

    /// Cancelled when shutdown begins; hand it to what must stop then.
    pub fn shutdown_token(&self) -> &CancellationToken {
        &self.shutdown
    }

    /// The readiness the probe reads.
    pub fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    /// A named guard holding the replica not ready (`reason`) until it is
    /// marked ready or dropped.
    pub fn not_ready_until(&self, name: &str, reason: &str) -> ReadinessGuard {
        self.readiness.register(name, reason)
    }

    /// Run `task` in the background until it ends; one that fails shuts
    /// the process down (see the module doc). It must watch
    /// [`Self::shutdown_token`] itself, or be spawned with
    /// [`Self::spawn_until_shutdown`]. The handle ends once the task's end
    /// has been dealt with.
    pub fn spawn<F>(&self, name: &'static str, task: F) -> JoinHandle<()>
    where
        F: Future + Send + 'static,
        F::Output: TaskEnd + Send,
    {
        let shutdown = self.shutdown.clone();
        let task = tokio::spawn(task);
        tokio::spawn(async move {
            let failed = match task.await {
                Ok(end) => end.failure(),
                Err(e) => Some(format!("panicked: {e}")),
            };
            match failed {
                // After shutdown began, a failure is part of stopping.
                Some(error) if !shutdown.is_cancelled() => {
                    tracing::error!(task = name, %error, "a task failed; shutting down");
                    shutdown.cancel();
                }
                Some(error) => tracing::debug!(task = name, %error, "a task failed while stopping"),
                None => tracing::debug!(task = name, "a task ended"),
            }
        })
    }

    /// [`Self::spawn`] a task that knows nothing of shutdown: it is dropped
    /// when shutdown begins.
    pub fn spawn_until_shutdown<F>(&self, name: &'static str, task: F) -> JoinHandle<()>
    where
        F: Future + Send + 'static,
        F::Output: TaskEnd + Send,
    {
        let shutdown = self.shutdown.clone();
        self.spawn(name, async move {
            shutdown
                .run_until_cancelled_owned(task)
                .await
                .and_then(TaskEnd::failure)
                .map_or(Ok(()), Err)
        })
    }

    /// `work`, after which the process shuts down whatever the outcome: for
    /// the work the process is for (the webhook server).
    pub async fn shut_down_after<T>(&self, work: impl Future<Output = T>) -> T {
        let out = work.await;
        self.shutdown.cancel();
        out
    }

    /// Run `main` to its end, unless a second signal aborts it first.
    pub async fn run<T, E>(&self, main: impl Future<Output = Result<T, E>>) -> Result<T, E>
    where
        E: From<RuntimeError>,
    {
        tokio::select! {
            biased;
            () = self.abort.cancelled() => Err(RuntimeError::Aborted.into()),
            r = main => r,
        }
    }
}

/// How a supervised task ended: `()` always well, a `Result` as it says.
pub trait TaskEnd {
    /// Why the task failed, if it did.
    fn failure(self) -> Option<String>;
}

impl TaskEnd for () {
    fn failure(self) -> Option<String> {
        None
    }
}

impl<E: Display> TaskEnd for Result<(), E> {
    fn failure(self) -> Option<String> {
        self.err().map(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_task_that_fails_shuts_the_process_down() {
        let rt = Runtime::new();
        rt.spawn("failing", async { Err::<(), _>("broken") })
            .await
            .expect("supervised");
        assert!(rt.shutdown_token().is_cancelled());
    }

    #[tokio::test]
    async fn a_task_that_panics_shuts_the_process_down() {
        let rt = Runtime::new();
        fn boom() {
            panic!("test double panics")
        }
        rt.spawn("panicking", async { boom() })
            .await
            .expect("supervised");
        assert!(rt.shutdown_token().is_cancelled());
    }

    #[tokio::test]
    async fn a_task_that_ends_well_leaves_the_process_running() {
        let rt = Runtime::new();
        rt.spawn("one-off", async {}).await.expect("supervised");
        rt.spawn("fine", async { Ok::<(), String>(()) })
            .await
            .expect("supervised");
        assert!(!rt.shutdown_token().is_cancelled());
    }

    #[tokio::test]
    async fn a_task_spawned_until_shutdown_is_dropped_then() {
        struct Dropped(Option<tokio::sync::oneshot::Sender<()>>);
        impl Drop for Dropped {
            fn drop(&mut self) {
                if let Some(tx) = self.0.take() {
                    let _ = tx.send(());
                }
            }
        }
        let rt = Runtime::new();
        let (tx, dropped) = tokio::sync::oneshot::channel();
        let (started_tx, started) = tokio::sync::oneshot::channel();
        let task = rt.spawn_until_shutdown("forever", async move {
            let _guard = Dropped(Some(tx));
            let _ = started_tx.send(());
            std::future::pending::<()>().await
        });
        started.await.expect("the task started");
        rt.shutdown_token().cancel();
        task.await.expect("supervised");
        dropped.await.expect("dropped on shutdown");
    }

    #[tokio::test]
    async fn the_work_shuts_the_process_down_when_it_ends() {
        let rt = Runtime::new();
        assert_eq!(rt.shut_down_after(async { 7 }).await, 7);
        assert!(rt.shutdown_token().is_cancelled());
    }

    #[tokio::test]
    async fn readiness_waits_for_every_named_guard() {
        let rt = Runtime::new();
        let a = rt.not_ready_until("a", "starting a");
        let b = rt.not_ready_until("b", "starting b");
        assert!(!rt.readiness().is_ready());
        a.ready();
        assert_eq!(
            rt.readiness().pending(),
            vec![("b".to_string(), "starting b".to_string())]
        );
        b.ready();
        assert!(rt.readiness().is_ready());
    }
}
