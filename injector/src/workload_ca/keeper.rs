//! Every replica's loop over the signing Secret: read it, carry out the
//! step [`roots::plan`] calls for (conditional on the resourceVersion, so of
//! two replicas one wins and the other re-reads), and publish what this
//! replica signs and serves with.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;
use rustls::sign::CertifiedKey;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::Metrics;
use super::roots::{self, Policy, Roots};
use super::signer::Signer;

/// What the CA signs and serves with, as of one reading of the Secret.
pub struct Authority {
    pub signer: Signer,
    /// Every root to trust, PEM.
    pub bundle: String,
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
    pub fn new(r: &Roots, names: &[String], now: SystemTime) -> Result<Self, String> {
        let signer =
            Signer::new(&r.current.cert_pem, &r.current.key_pem).map_err(|e| e.to_string())?;
        let (chain, key) = signer
            .serving(names, SERVING_VALIDITY, now)
            .map_err(|e| e.to_string())?;
        let serving = certified_key(&chain, &key)?;
        Ok(Self {
            bundle: roots::trust_bundle(r),
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
    /// at the next period (the last good authority keeps serving).
    pub async fn run(self, out: watch::Sender<Option<Arc<Authority>>>, token: CancellationToken) {
        loop {
            let wait = match self.once(&out).await {
                Ok(true) => Duration::ZERO,
                Ok(false) => self.period,
                Err(e) => {
                    tracing::warn!(error = %e, secret = %self.name, "workload CA: cannot read or update the signing Secret; keeping the last roots");
                    self.period
                }
            };
            tokio::select! {
                () = token.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// One pass; `Ok(true)` when it wrote (read again at once).
    pub async fn once(&self, out: &watch::Sender<Option<Arc<Authority>>>) -> Result<bool, String> {
        let now = SystemTime::now();
        let found = self
            .secrets
            .get_opt(&self.name)
            .await
            .map_err(|e| e.to_string())?;
        let roots = found.as_ref().and_then(roots::from_secret);
        if let Some(step) = roots::plan(roots.as_ref(), &self.policy, now) {
            let next =
                roots::apply(roots.as_ref(), step, &self.policy, now).map_err(|e| e.to_string())?;
            let meta = found.map(|s| s.metadata).unwrap_or_else(|| ObjectMeta {
                name: Some(self.name.clone()),
                ..Default::default()
            });
            let exists = meta.resource_version.is_some();
            let secret = roots::to_secret(&next, meta);
            let r = if exists {
                self.secrets
                    .replace(&self.name, &PostParams::default(), &secret)
                    .await
            } else {
                self.secrets.create(&PostParams::default(), &secret).await
            };
            return match r {
                Ok(_) => {
                    self.metrics.rotation(step);
                    tracing::info!(step = step.as_str(), secret = %self.name, "workload CA: signing roots updated");
                    Ok(true)
                }
                // Another replica wrote first: read what it wrote.
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(true),
                Err(e) => Err(e.to_string()),
            };
        }
        let Some(r) = roots else {
            return Err("the Secret lacks a root".into());
        };
        let current = out.borrow().clone();
        let stale = current.as_ref().is_none_or(|a| {
            a.signer.root_pem().trim() != r.current.cert_pem.trim()
                || a.bundle != roots::trust_bundle(&r)
                || a.serving_renew_at <= now
        });
        if stale {
            let a = Authority::new(&r, &self.names, now)?;
            self.metrics.root_expiry(a.signer.not_after());
            out.send_replace(Some(Arc::new(a)));
        }
        Ok(false)
    }
}
