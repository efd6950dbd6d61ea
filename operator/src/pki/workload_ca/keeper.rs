//! Every replica's loop over the signing Secret: read it, carry out the
//! step [`roots::plan`] calls for (conditional on the resourceVersion, so of
//! two replicas one wins and the other re-reads), and publish what this
//! replica signs and serves with. A replica whose last good reading is
//! older than `settle` publishes nothing (it stops signing and serving, and
//! is not ready) until it reads again: it may be signing with a root the
//! others have retired.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use rustls::sign::CertifiedKey;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::Metrics;
use super::roots::{self, Policy, RootsError, Stored};
use super::signer::Signer;
use crate::pki::rotation::{trust_bundle, write_secret};

/// Why a pass over the signing Secret failed.
#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    #[error("reading the signing Secret: {0}")]
    Read(#[source] kube::Error),
    #[error("writing the signing Secret: {0}")]
    Write(#[source] kube::Error),
    #[error(transparent)]
    Roots(#[from] RootsError),
    #[error("the Secret lacks a root")]
    NoRoot,
    #[error("the signing root is unusable: {0}")]
    Authority(String),
}

/// What the CA signs and serves with, as of one reading of the Secret.
pub struct Authority {
    pub signer: Signer,
    /// Every root to trust, PEM.
    pub bundle: String,
    /// The staged root's [`roots::fingerprint`], during a rotation.
    pub staged: Option<String>,
    /// The CA's own TLS certificate (this replica's, signed by the current root).
    pub serving: Arc<CertifiedKey>,
    serving_renew_at: SystemTime,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority")
            .field("signer", &self.signer)
            .finish_non_exhaustive()
    }
}

/// How long the CA's own serving certificate lives (renewed at two thirds).
const SERVING_VALIDITY: Duration = Duration::from_secs(24 * 3600);

impl Authority {
    pub fn new(s: &Stored, names: &[String], now: SystemTime) -> Result<Self, String> {
        let r = &s.roots;
        let signer =
            Signer::new(&r.current.cert_pem, &r.current.key_pem).map_err(|e| e.to_string())?;
        let (chain, key) = signer
            .serving(names, SERVING_VALIDITY, now)
            .map_err(|e| e.to_string())?;
        let serving = certified_key(&chain, &key)?;
        Ok(Self {
            bundle: trust_bundle(r, now),
            staged: r
                .next
                .as_ref()
                .and_then(|n| roots::fingerprint(&n.cert_pem)),
            serving: Arc::new(serving),
            serving_renew_at: now
                .checked_add(SERVING_VALIDITY / 3 * 2)
                .unwrap_or(now)
                .min(signer.not_after()),
            signer,
        })
    }
}

fn certified_key(chain_pem: &str, key_pem: &str) -> Result<CertifiedKey, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_slice_iter(chain_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("serving chain: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| format!("serving key: {e}"))?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&key)
        .map_err(|e| format!("serving key: {e}"))?;
    Ok(CertifiedKey::new(chain, signing))
}

pub struct Keeper {
    pub secrets: Api<Secret>,
    pub name: String,
    pub policy: Policy,
    pub names: Vec<String>,
    pub period: Duration,
    pub metrics: Metrics,
}

impl Keeper {
    /// Read, step and publish until `token`; errors are logged and retried
    /// at the next period. The last good authority keeps serving for at most
    /// `settle` after the last good pass; then none does, until a pass
    /// succeeds again.
    pub async fn run(self, out: watch::Sender<Option<Arc<Authority>>>, token: CancellationToken) {
        let mut last_good = tokio::time::Instant::now();
        loop {
            let wait = match self.once(&out).await {
                Ok(wrote) => {
                    last_good = tokio::time::Instant::now();
                    if wrote { Duration::ZERO } else { self.period }
                }
                // Read and published; only a step could not be written.
                Err(e @ KeeperError::Write(_)) => {
                    last_good = tokio::time::Instant::now();
                    tracing::warn!(error = %e, secret = %self.name, "workload CA: cannot update the signing Secret; keeping its roots");
                    self.period
                }
                Err(e) => {
                    let stale = last_good.elapsed() >= self.policy.settle;
                    if stale && out.borrow().is_some() {
                        tracing::error!(error = %e, secret = %self.name, since = ?last_good.elapsed(),
                            "workload CA: no good reading of the signing Secret within the settle time; not signing until there is one (the root in use may be retired)");
                        out.send_replace(None);
                    } else if !stale {
                        tracing::warn!(error = %e, secret = %self.name, "workload CA: cannot read or update the signing Secret; keeping the last roots");
                    }
                    // Not later than the moment the last roots go stale.
                    let until_stale = self.policy.settle.saturating_sub(last_good.elapsed());
                    match until_stale.is_zero() {
                        true => self.period,
                        false => self.period.min(until_stale),
                    }
                }
            };
            tokio::select! {
                () = token.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// One pass; `Ok(true)` when it wrote (read again at once).
    pub async fn once(
        &self,
        out: &watch::Sender<Option<Arc<Authority>>>,
    ) -> Result<bool, KeeperError> {
        let now = SystemTime::now();
        let found = self
            .secrets
            .get_opt(&self.name)
            .await
            .map_err(KeeperError::Read)?;
        let roots = found.as_ref().and_then(roots::from_secret);
        let step = roots::plan(roots.as_ref(), &self.policy, now);
        // What the Secret holds signs until a step is written, so this
        // reading counts even when the step cannot be written.
        if let Some(r) = &roots
            && step != Some(roots::Step::Create)
        {
            self.publish(r, out, now)?;
        }
        if let Some(step) = step {
            let next = roots::apply(roots.as_ref(), step, &self.policy, now)?;
            let meta = found.map(|s| s.metadata).unwrap_or_else(|| ObjectMeta {
                name: Some(self.name.clone()),
                ..Default::default()
            });
            let secret = roots::to_secret(&next, meta);
            return match write_secret(&self.secrets, &self.name, &secret).await {
                Ok(true) => {
                    self.metrics.rotation(step);
                    tracing::info!(step = step.as_str(), secret = %self.name, "workload CA: signing roots updated");
                    Ok(true)
                }
                // Another replica wrote first: read what it wrote.
                Ok(false) => Ok(true),
                Err(e) => Err(KeeperError::Write(e)),
            };
        }
        match roots {
            Some(_) => Ok(false),
            None => Err(KeeperError::NoRoot),
        }
    }

    /// Publish the authority of `r`, unless the one published is it already.
    fn publish(
        &self,
        r: &Stored,
        out: &watch::Sender<Option<Arc<Authority>>>,
        now: SystemTime,
    ) -> Result<(), KeeperError> {
        let current = out.borrow().clone();
        let stale = current.as_ref().is_none_or(|a| {
            a.signer.root_pem().trim() != r.roots.current.cert_pem.trim()
                || a.bundle != trust_bundle(&r.roots, now)
                || a.serving_renew_at <= now
        });
        if stale {
            let a = Authority::new(r, &self.names, now).map_err(KeeperError::Authority)?;
            self.metrics.root_expiry(a.signer.not_after());
            out.send_replace(Some(Arc::new(a)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    const SETTLE: Duration = Duration::from_secs(60);
    const PERIOD: Duration = Duration::from_secs(10);

    /// A client of an API server that serves `secret` while `up`, and
    /// answers 500 otherwise.
    fn api(secret: &Secret, up: Arc<AtomicBool>) -> kube::Client {
        let body = serde_json::to_vec(secret).expect("json");
        let down = br#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"down","reason":"InternalError","code":500}"#;
        let service = tower::service_fn(move |_req: http::Request<kube::client::Body>| {
            let (status, body) = match up.load(Ordering::SeqCst) {
                true => (200, body.clone()),
                false => (500, down.to_vec()),
            };
            async move {
                http::Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(kube::client::Body::from(body))
            }
        });
        kube::Client::new(service, "ns")
    }

    /// Waits (a second of paused time at most) for readiness to be `want`.
    async fn ready_is(readiness: &remora_serve::readiness::Readiness, want: bool) {
        let mut changes = readiness.subscribe();
        let wait = async {
            while readiness.is_ready() != want {
                let _ = changes.changed().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(1), wait)
            .await
            .unwrap_or_else(|_| panic!("ready {want}: {:?}", readiness.pending()));
    }

    /// A replica that can no longer read the signing Secret signs (and is
    /// ready) until its last good reading is `settle` old, not after; it
    /// signs again once it reads again.
    #[tokio::test(start_paused = true)]
    async fn a_replica_that_cannot_read_the_secret_stops_after_settle() {
        let policy = Policy {
            validity: Duration::from_secs(3600),
            settle: SETTLE,
            overlap: 2 * SETTLE,
        };
        let made = SystemTime::now() - Duration::from_secs(600);
        let r = roots::apply(None, roots::Step::Create, &policy, made).expect("root");
        let secret = roots::to_secret(
            &r,
            ObjectMeta {
                name: Some("roots".into()),
                namespace: Some("ns".into()),
                resource_version: Some("1".into()),
                ..Default::default()
            },
        );
        let up = Arc::new(AtomicBool::new(true));
        let keeper = Keeper {
            secrets: Api::namespaced(api(&secret, Arc::clone(&up)), "ns"),
            name: "roots".into(),
            policy,
            names: vec!["ca.test".into()],
            period: PERIOD,
            metrics: Metrics::default(),
        };
        let (tx, mut rx) = watch::channel(None);
        let readiness = remora_serve::readiness::Readiness::new();
        let guard = readiness.register("workload-ca", "starting");
        tokio::spawn(super::super::follow_readiness(rx.clone(), guard));
        let token = CancellationToken::new();
        tokio::spawn(keeper.run(tx, token.clone()));
        rx.wait_for(Option::is_some).await.expect("first roots");
        ready_is(&readiness, true).await;

        // The API server goes away just after a good reading.
        let down_at = tokio::time::Instant::now();
        up.store(false, Ordering::SeqCst);
        tokio::time::sleep(SETTLE - PERIOD - Duration::from_secs(1)).await;
        assert!(rx.borrow().is_some(), "still signing within settle");
        assert!(readiness.is_ready());
        tokio::time::timeout(SETTLE, rx.wait_for(Option::is_none))
            .await
            .expect("stopped")
            .expect("open");
        let stopped_after = down_at.elapsed();
        assert!(
            stopped_after <= SETTLE + Duration::from_secs(1),
            "stopped {stopped_after:?} after the last good reading"
        );
        ready_is(&readiness, false).await;

        // Readable again: signing and ready within a period.
        up.store(true, Ordering::SeqCst);
        tokio::time::timeout(
            PERIOD + Duration::from_secs(1),
            rx.wait_for(Option::is_some),
        )
        .await
        .expect("signing again")
        .expect("open");
        ready_is(&readiness, true).await;
        token.cancel();
    }
}
