//! File mode: certificates mounted into the pod (`--cert-dir`).
//!
//! Changes are noticed the one way Remora notices a mounted file change
//! ([`remora_contract::mounted`], which says why): the files are read every
//! [`DEFAULT_POLL`], and at once when inotify sees their directory change
//! ([`crate::mounted_wake`]), and reloaded when their bytes change. A slow periodic
//! reload also runs without a change, so a bundle refused for the time (not
//! yet valid) is tried again.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::{Duration, SystemTime};

use remora_contract::mounted::MountedFiles;
use tokio_util::sync::CancellationToken;

use crate::mounted_wake::MountedWake;

use super::{
    BundleSender, CERT_CHAIN_FILE, CertBundle, CertError, CertSource, KEY_FILE, ROOT_CERT_FILE,
    validate_bundle,
};

/// How often mounted certificate files are read.
pub const DEFAULT_POLL: Duration = Duration::from_millis(100);
/// Reload this often even without a change.
pub const DEFAULT_RESYNC: Duration = Duration::from_secs(30);

/// Runs `reload` once, then whenever the bytes of `files` change (and every
/// `resync`), until cancelled.
pub async fn watch_and_reload(
    files: Vec<PathBuf>,
    poll: Duration,
    resync: Duration,
    cancel: CancellationToken,
    mut reload: impl FnMut() + Send,
) {
    let mut wake = MountedWake::new(files.iter().map(PathBuf::as_path), poll);
    let mut mounted = MountedFiles::new(files);
    let mut last_reload: Option<tokio::time::Instant> = None;
    loop {
        let changed = mounted.poll().is_some();
        if changed || last_reload.is_none_or(|t| t.elapsed() >= resync) {
            reload();
            last_reload = Some(tokio::time::Instant::now());
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            () = wake.next() => {}
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
    pub poll: Duration,
    pub resync: Duration,
}

impl FileSource {
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            poll: DEFAULT_POLL,
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
            let files = [CERT_CHAIN_FILE, KEY_FILE, ROOT_CERT_FILE]
                .map(|f| dir.join(f))
                .to_vec();
            watch_and_reload(
                files,
                self.poll,
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

    /// A new bundle is picked up through inotify, with no poll due: once
    /// written in place, once swapped in by the kubelet's `..data` rename.
    #[tokio::test]
    async fn in_place_writes_and_kubelet_swaps_are_picked_up_without_a_poll() {
        use remora_test_support::kubelet::atomic_write;
        let ca = Ca::new("root");
        let leaf = |ca: &Ca| {
            let Leaf { chain, key, .. } = ca.leaf();
            (chain, key)
        };
        let set = |chain: &str, key: &str| {
            [
                (CERT_CHAIN_FILE, chain.to_string()),
                (KEY_FILE, key.to_string()),
                (ROOT_CERT_FILE, ca.pem.clone()),
            ]
        };
        let plain = tempfile::tempdir().expect("tmp");
        let kubelet = tempfile::tempdir().expect("tmp");
        let (chain, key) = leaf(&ca);
        for (name, text) in set(&chain, &key) {
            std::fs::write(plain.path().join(name), text).expect("write");
        }
        atomic_write(kubelet.path(), set(&chain, &key)).expect("write");

        for (dir, kubelet_style) in [(plain.path(), false), (kubelet.path(), true)] {
            let tx = BundleSender::new(CertMetrics::default());
            let cancel = CancellationToken::new();
            let source = FileSource {
                dir: dir.to_path_buf(),
                poll: Duration::from_secs(3600),
                resync: Duration::from_secs(3600),
            };
            let task = tokio::spawn(Box::new(source).run(tx.clone(), cancel.clone()));
            wait_for("the first bundle", || {
                tx.current().is_some_and(|b| b.chain_pem == chain)
            })
            .await;
            let (chain2, key2) = leaf(&ca);
            if kubelet_style {
                atomic_write(dir, set(&chain2, &key2)).expect("write");
            } else {
                // The key first: a chain without its key is refused, then
                // the pair is whole at the chain's write.
                std::fs::write(dir.join(KEY_FILE), &key2).expect("write");
                std::fs::write(dir.join(CERT_CHAIN_FILE), &chain2).expect("write");
            }
            wait_for("the new bundle", || {
                tx.current().is_some_and(|b| b.chain_pem == chain2)
            })
            .await;
            cancel.cancel();
            task.await.expect("join");
        }
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
