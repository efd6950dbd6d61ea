//! File mode: certificates mounted into the pod (`--cert-dir`).
//!
//! The directory is watched, not the files: Kubernetes Secret volumes swap a
//! `..data` symlink atomically, which shows as events on the directory only.
//! Bursts of events are coalesced (one reload per `debounce`), and a slow
//! periodic re-read covers anything a watch can miss.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::{Duration, SystemTime};

use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{
    BundleSender, CERT_CHAIN_FILE, CertBundle, CertError, CertSource, KEY_FILE, ROOT_CERT_FILE,
    validate_bundle,
};

/// Coalescing window after a change event.
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(20);
/// Re-read everything this often even without events.
pub const DEFAULT_RESYNC: Duration = Duration::from_secs(30);

/// Watches directories and turns their events into coalesced "something
/// changed" ticks. Dropping it stops the watch.
pub struct DirWatch {
    _watcher: RecommendedWatcher,
    rx: mpsc::Receiver<()>,
}

impl DirWatch {
    pub fn new(dirs: &[PathBuf]) -> Result<Self, CertError> {
        // Capacity 1 + try_send: a burst of events collapses into one pending tick.
        let (tx, rx) = mpsc::channel(1);
        let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            if let Ok(ev) = res
                && !ev.kind.is_access()
            {
                let _ = tx.try_send(());
            }
        })
        .map_err(|source| CertError::Watch {
            path: dirs.first().cloned().unwrap_or_default(),
            source,
        })?;
        for d in dirs {
            watcher
                .watch(d, RecursiveMode::NonRecursive)
                .map_err(|source| CertError::Watch {
                    path: d.clone(),
                    source,
                })?;
        }
        Ok(Self {
            _watcher: watcher,
            rx,
        })
    }

    /// Wait for the next change, then let the burst settle for `debounce`.
    /// `None` when the watcher is gone.
    pub async fn changed(&mut self, debounce: Duration) -> Option<()> {
        self.rx.recv().await?;
        tokio::time::sleep(debounce).await;
        while self.rx.try_recv().is_ok() {}
        Some(())
    }
}

/// Runs `reload` once, then on every change of `dirs` (and every `resync`),
/// until cancelled. Re-creates the watch if it cannot be set up (a directory
/// that does not exist yet).
pub async fn watch_and_reload(
    dirs: Vec<PathBuf>,
    debounce: Duration,
    resync: Duration,
    cancel: CancellationToken,
    mut reload: impl FnMut() + Send,
) {
    loop {
        let mut watch = match DirWatch::new(&dirs) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::debug!(error = %e, "watch not set up yet; polling");
                None
            }
        };
        reload();
        // Without a watch, poll quickly until the directory appears.
        let period = if watch.is_some() {
            resync
        } else {
            resync.min(Duration::from_secs(1))
        };
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                r = async {
                    match watch.as_mut() {
                        Some(w) => w.changed(debounce).await,
                        None => std::future::pending().await,
                    }
                } => {
                    if r.is_none() { break; }
                    reload();
                }
                _ = tokio::time::sleep(period) => {
                    if watch.is_none() { break; }
                    reload();
                }
            }
        }
    }
}

pub(crate) fn read(path: &Path) -> Result<String, CertError> {
    std::fs::read_to_string(path).map_err(|source| CertError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Read and validate `cert-chain.pem`, `key.pem` and `root-cert.pem` in `dir`.
pub fn load_dir(dir: &Path) -> Result<CertBundle, CertError> {
    let chain = read(&dir.join(CERT_CHAIN_FILE))?;
    let key = read(&dir.join(KEY_FILE))?;
    let roots = read(&dir.join(ROOT_CERT_FILE))?;
    validate_bundle(chain, key, roots, SystemTime::now())
}

/// Certificates from `cert-chain.pem`, `key.pem`, `root-cert.pem` in a directory.
#[derive(Debug, Clone)]
pub struct FileSource {
    pub dir: PathBuf,
    pub debounce: Duration,
    pub resync: Duration,
}

impl FileSource {
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            debounce: DEFAULT_DEBOUNCE,
            resync: DEFAULT_RESYNC,
        }
    }
}

impl CertSource for FileSource {
    fn describe(&self) -> String {
        format!("files in {}", self.dir.display())
    }

    fn run(
        self: Box<Self>,
        out: BundleSender,
        cancel: CancellationToken,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let dir = self.dir.clone();
            let source = self.describe();
            watch_and_reload(
                vec![dir.clone()],
                self.debounce,
                self.resync,
                cancel,
                move || match load_dir(&dir) {
                    Ok(b) => {
                        let serial = b.serial.clone();
                        if out.publish(b) {
                            tracing::info!(source = %source, serial = %serial, "workload certificate loaded");
                        }
                    }
                    Err(e) => out.fail(&source, &e),
                },
            )
            .await;
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::CertMetrics;
    use super::*;
    use remora_test_support::pki::{Ca, Leaf};
    use remora_test_support::wait::wait_until;

    fn write_set(dir: &Path, ca: &Ca) -> String {
        let Leaf { chain, key, .. } = ca.leaf();
        std::fs::write(dir.join(CERT_CHAIN_FILE), &chain).expect("write");
        std::fs::write(dir.join(KEY_FILE), &key).expect("write");
        std::fs::write(dir.join(ROOT_CERT_FILE), &ca.pem).expect("write");
        chain
    }

    async fn wait_for(what: &str, f: impl Fn() -> bool) {
        wait_until(Duration::from_secs(10), what, || {
            std::future::ready(f().then_some(()))
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }

    #[tokio::test]
    async fn missing_then_present_then_bad_then_good() {
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = tmp.path().to_path_buf();
        let tx = BundleSender::new(CertMetrics::default());
        let status = tx.status();
        let cancel = CancellationToken::new();
        let task =
            tokio::spawn(Box::new(FileSource::new(dir.clone())).run(tx.clone(), cancel.clone()));

        wait_for("a status naming the missing file", || {
            status
                .borrow()
                .as_deref()
                .is_some_and(|s| s.contains("cert-chain.pem"))
        })
        .await;

        let ca = Ca::new("root");
        let chain = write_set(&dir, &ca);
        wait_for("the first bundle", || {
            tx.current().is_some_and(|b| b.chain_pem == chain)
        })
        .await;
        assert!(status.borrow().is_none());

        // A garbage write keeps the last good bundle.
        let before = tx.metrics.failures.get();
        std::fs::write(dir.join(CERT_CHAIN_FILE), "garbage").expect("write");
        wait_for("a counted failure", || tx.metrics.failures.get() > before).await;
        assert_eq!(tx.current().map(|b| b.chain_pem.clone()), Some(chain));
        assert!(status.borrow().is_none());

        let chain2 = write_set(&dir, &ca);
        wait_for("the second bundle", || {
            tx.current().is_some_and(|b| b.chain_pem == chain2)
        })
        .await;
        cancel.cancel();
        task.await.expect("join");
    }
}
