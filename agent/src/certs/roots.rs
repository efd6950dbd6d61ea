//! Following the `--ca-root-cert` trust bundle. The file (in a pod, a
//! ConfigMap anyone who may write ConfigMaps in the namespace can edit)
//! verifies the CA's own serving certificate, together with the roots the CA
//! said last, and is polled: when it comes to differ from the roots served,
//! the renewal loop asks the CA again. A root that only the file holds is
//! never trusted for peers; a bad file is reported and the last good roots
//! stay.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::ca_client::{CaError, GrpcIssuer, Issued, Issuer};
use super::{BundleSender, union_roots};

/// How often the `--ca-root-cert` trust bundle is read.
pub const DEFAULT_ROOT_POLL: Duration = Duration::from_secs(5);

/// The trust bundle of `--ca-root-cert` as last read well (normalized PEM);
/// `None` without the flag. In a pod it is a ConfigMap that anyone who may
/// write ConfigMaps in the namespace can edit: it only checks the CA's own
/// certificate and tells the agent when to ask the CA again, and never adds
/// a root that the agent's peers are checked against.
pub type TrustRoots = watch::Receiver<Option<Arc<str>>>;

/// Poll the `--ca-root-cert` file at `path` and send its roots into `tx`
/// whenever they change; an unreadable, empty or non-PEM file is reported
/// into `out` (failure metric, log) and the last good roots stay.
pub async fn watch_trust_roots(
    path: PathBuf,
    poll: Duration,
    tx: watch::Sender<Option<Arc<str>>>,
    out: BundleSender,
    cancel: CancellationToken,
) {
    let source = format!("--ca-root-cert {}", path.display());
    let files = vec![path.clone()];
    super::file::watch_and_reload(files, poll, super::file::DEFAULT_RESYNC, cancel, move || {
        let read = super::file::read(&path).and_then(|t| union_roots("--ca-root-cert", [t.as_str()]));
        match read {
            Ok(roots) => {
                let changed = tx.send_if_modified(|cur| {
                    if cur.as_deref() == Some(roots.as_str()) {
                        return false;
                    }
                    *cur = Some(roots.as_str().into());
                    true
                });
                if changed {
                    tracing::info!(source = %source, roots = roots.matches("BEGIN CERTIFICATE").count(),
                        "CA trust roots changed");
                }
            }
            Err(e) => out.fail(&source, &e),
        }
    })
    .await;
}

/// Whether the roots of `file` (the `--ca-root-cert` bundle) are those the
/// agent serves now; unparsable text counts as different.
pub(super) fn same_roots(file: &str, served: &str) -> bool {
    let set = |pem: &str| {
        super::parse_certs("roots", pem)
            .ok()
            .map(|v| v.into_iter().collect::<std::collections::HashSet<_>>())
    };
    matches!((set(file), set(served)), (Some(a), Some(b)) if a == b)
}

/// A [`GrpcIssuer`] that follows the trust roots: when they change, the
/// next call goes over a new channel that verifies the CA with them (after
/// a root rotation the CA serves a certificate of the new root). It checks
/// the CA with the file's roots and those the CA itself said last, so that
/// roots taken out of the file (by someone else) do not cut the agent off.
#[derive(Debug)]
pub struct RootFollowingIssuer {
    address: String,
    server_name: Option<String>,
    token_path: PathBuf,
    cluster_id: String,
    state: Mutex<Following>,
}

#[derive(Debug)]
struct Following {
    file: TrustRoots,
    /// The trust bundle of the CA's last answer.
    learned: Option<String>,
    /// `learned` changed since the channel was built.
    relearned: bool,
    issuer: GrpcIssuer,
}

/// The roots the CA's certificate is checked with.
fn verifying_roots(file: Option<&str>, learned: Option<&str>) -> Option<String> {
    match (file, learned) {
        (None, None) => None,
        (f, l) => union_roots("CA verification roots", f.into_iter().chain(l))
            .ok()
            .or_else(|| f.map(str::to_string)),
    }
}

impl RootFollowingIssuer {
    pub fn new(
        address: &str,
        server_name: Option<String>,
        mut roots: TrustRoots,
        token_path: PathBuf,
        cluster_id: String,
    ) -> Result<Self, CaError> {
        let current = roots.borrow_and_update().clone();
        let issuer = GrpcIssuer::new(
            address,
            server_name.as_deref(),
            current.as_deref(),
            token_path.clone(),
            cluster_id.clone(),
        )?;
        Ok(Self {
            address: address.to_string(),
            server_name,
            token_path,
            cluster_id,
            state: Mutex::new(Following {
                file: roots,
                learned: None,
                relearned: false,
                issuer,
            }),
        })
    }

    /// The issuer for the next call, rebuilt if the roots changed since the last.
    fn current(&self) -> Result<GrpcIssuer, CaError> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let st = &mut *state;
        if st.file.has_changed().unwrap_or(false) || st.relearned {
            let file = st.file.borrow_and_update().clone();
            let roots = verifying_roots(file.as_deref(), st.learned.as_deref());
            match GrpcIssuer::new(
                &self.address,
                self.server_name.as_deref(),
                roots.as_deref(),
                self.token_path.clone(),
                self.cluster_id.clone(),
            ) {
                Ok(i) => st.issuer = i,
                Err(e) => {
                    // Not seen until it is in use: the next call tries again.
                    st.file.mark_changed();
                    return Err(e);
                }
            }
            st.relearned = false;
            tracing::info!(address = %self.address, "CA connection rebuilt to verify the CA with the new trust roots");
        }
        Ok(st.issuer.clone())
    }

    fn learn(&self, trust_bundle: Option<&str>) {
        let Some(b) = trust_bundle else { return };
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.learned.as_deref() != Some(b) {
            state.learned = Some(b.to_string());
            state.relearned = true;
        }
    }
}

impl Issuer for RootFollowingIssuer {
    async fn issue(&self, csr_pem: String, ttl: Duration) -> Result<Issued, CaError> {
        let issuer = self.current()?;
        let issued = issuer.issue(csr_pem, ttl).await?;
        self.learn(issued.trust_bundle.as_deref());
        Ok(issued)
    }
}

#[cfg(test)]
mod tests {
    use super::super::CertMetrics;
    use super::super::testing::ders;
    use super::*;
    use remora_test_support::pki::Ca;

    /// The `--ca-root-cert` file: a change is sent once; unreadable, empty
    /// or non-PEM content is counted and reported, and the last good roots stay.
    #[tokio::test(start_paused = true)]
    async fn the_root_file_is_followed_and_bad_content_keeps_the_last_good() {
        let tmp = tempfile::tempdir().expect("tmp");
        let path = tmp.path().join("root-cert.pem");
        let (a, b) = (Ca::new("root a"), Ca::new("root b"));
        std::fs::write(&path, &a.pem).expect("write");
        let (tx, mut rx) = watch::channel(None);
        let out = BundleSender::new(CertMetrics::default());
        let status = out.status();
        let cancel = CancellationToken::new();
        let poll = DEFAULT_ROOT_POLL;
        let task = tokio::spawn(watch_trust_roots(
            path.clone(),
            poll,
            tx,
            out.clone(),
            cancel.clone(),
        ));
        rx.changed().await.expect("first read");
        assert_eq!(
            rx.borrow_and_update().as_deref().map(ders),
            Some(ders(&a.pem))
        );

        // Each bad state is noticed within a poll or two of paused time.
        let failures = |n: u64| {
            let out = out.clone();
            async move {
                let deadline = tokio::time::Instant::now() + poll * 3;
                while out.metrics.failures.get() < n {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "failure {n} not reported"
                    );
                    tokio::time::sleep(poll / 5).await;
                }
            }
        };
        std::fs::write(&path, "").expect("empty");
        failures(1).await;
        assert!(
            status
                .borrow()
                .as_deref()
                .is_some_and(|s| s.contains("--ca-root-cert"))
        );
        std::fs::write(&path, "not a certificate").expect("garbage");
        failures(2).await;
        std::fs::remove_file(&path).expect("remove");
        failures(3).await;
        assert!(!rx.has_changed().expect("open"), "the last good roots stay");

        // A rotation's bundle: both roots, sent once.
        std::fs::write(&path, format!("{}{}", a.pem, b.pem)).expect("write");
        rx.changed().await.expect("new roots");
        assert_eq!(
            rx.borrow_and_update().as_deref().map(ders),
            Some(ders(&format!("{}{}", a.pem, b.pem)))
        );
        // Not sent again: neither on a poll nor on the periodic reload, the
        // one path that reads the file without a change.
        let quiet = super::super::file::DEFAULT_RESYNC + poll * 2;
        let sent = tokio::time::timeout(quiet, rx.changed()).await;
        assert!(sent.is_err(), "no change, no send");
        cancel.cancel();
        task.await.expect("join");
    }
}
