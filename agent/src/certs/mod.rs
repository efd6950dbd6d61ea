//! Workload certificates: one [`CertSource`] trait, one `watch` channel of a
//! validated [`CertBundle`] that the SDS server subscribes to.
//!
//! Sources: [`file::FileSource`] (mounted files, `--cert-dir`) and
//! [`ca::CaSource`] (an Istio-compatible CA, `--ca-address`, in parts:
//! [`csr`], [`ca_client`], [`renewal`], [`roots`], [`output`]). A source only
//! ever publishes bundles that passed [`validate_bundle`]; a bad update is
//! logged and counted while the last good bundle stays in service.

pub mod ca;
pub mod ca_client;
pub mod csr;
pub mod file;
pub mod output;
pub mod renewal;
pub mod roots;
#[cfg(test)]
mod testing;

use std::collections::hash_map::DefaultHasher;
use std::fmt;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::RunConfig;

/// Default directory of mounted workload certificates (DESIGN.md).
pub const DEFAULT_CERT_DIR: &str = "/etc/certs";
pub const CERT_CHAIN_FILE: &str = "cert-chain.pem";
pub const KEY_FILE: &str = "key.pem";
pub const ROOT_CERT_FILE: &str = "root-cert.pem";

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what}: no PEM certificate found")]
    NoCertificate { what: &'static str },
    #[error("{what}: invalid PEM: {reason}")]
    Pem { what: &'static str, reason: String },
    #[error("{what}: certificate does not parse: {reason}")]
    Parse { what: &'static str, reason: String },
    #[error("private key: {0}")]
    Key(String),
    #[error("private key does not match the leaf certificate")]
    KeyMismatch,
    #[error("leaf certificate expired at {0}")]
    Expired(String),
    #[error("leaf certificate not valid before {0}")]
    NotYetValid(String),
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Ca(#[from] ca_client::CaError),
    #[error(transparent)]
    Csr(#[from] csr::CsrError),
    #[error("{0}")]
    Config(String),
}

/// A validated workload identity plus trust bundle.
#[derive(Clone, PartialEq, Eq)]
pub struct CertBundle {
    /// Leaf first, then intermediates.
    pub chain_pem: String,
    pub key_pem: String,
    /// Trust bundle (one or more roots).
    pub roots_pem: String,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    /// Leaf serial, hex.
    pub serial: String,
}

impl fmt::Debug for CertBundle {
    // Never print the key: bundles end up in logs through `?bundle`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertBundle")
            .field("serial", &self.serial)
            .field("not_after", &self.not_after)
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

impl CertBundle {
    /// Version of the identity part (chain + key), stable across restarts.
    pub fn cert_version(&self) -> String {
        content_version(&[&self.chain_pem, &self.key_pem])
    }
    /// Version of the trust bundle.
    pub fn roots_version(&self) -> String {
        content_version(&[&self.roots_pem])
    }
    pub fn lifetime(&self) -> Duration {
        self.not_after
            .duration_since(self.not_before)
            .unwrap_or_default()
    }
}

/// A short content hash used as an xDS version.
pub fn content_version(parts: &[&str]) -> String {
    let mut h = DefaultHasher::new();
    for p in parts {
        p.hash(&mut h);
    }
    format!("{:016x}", h.finish())
}

/// Facts about a validated leaf.
#[derive(Debug, Clone)]
pub struct LeafInfo {
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    pub serial: String,
}

fn to_system_time(t: x509_parser::time::ASN1Time) -> SystemTime {
    let secs = t.timestamp();
    if secs >= 0 {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs.unsigned_abs())
    } else {
        SystemTime::UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs())
    }
}

/// Parse every certificate of a PEM text (at least one).
pub fn parse_certs(
    what: &'static str,
    pem: &str,
) -> Result<Vec<CertificateDer<'static>>, CertError> {
    let mut out = Vec::new();
    for c in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        let der = c.map_err(|e| CertError::Pem {
            what,
            reason: e.to_string(),
        })?;
        x509_parser::parse_x509_certificate(&der).map_err(|e| CertError::Parse {
            what,
            reason: e.to_string(),
        })?;
        out.push(der);
    }
    if out.is_empty() {
        return Err(CertError::NoCertificate { what });
    }
    Ok(out)
}

/// The certificates of `texts` (PEM), each once whatever its formatting
/// (deduplicated by DER), in order of first appearance, as one PEM bundle:
/// the trust bundle a rotation's old and new roots make together.
pub fn union_roots<'a>(
    what: &'static str,
    texts: impl IntoIterator<Item = &'a str>,
) -> Result<String, CertError> {
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    const END: &str = "-----END CERTIFICATE-----";
    let mut seen = std::collections::HashSet::new();
    let mut blocks = Vec::new();
    for text in texts {
        let mut rest = text;
        while let Some(start) = rest.find(BEGIN) {
            let Some(len) = rest[start..].find(END) else {
                return Err(CertError::Pem {
                    what,
                    reason: "a certificate without its END line".into(),
                });
            };
            let block = rest[start..start + len + END.len()].replace("\r\n", "\n");
            rest = &rest[start + len + END.len()..];
            let der = parse_certs(what, &block)?
                .pop()
                .ok_or(CertError::NoCertificate { what })?;
            if seen.insert(der) {
                blocks.push(block);
            }
        }
    }
    if blocks.is_empty() {
        return Err(CertError::NoCertificate { what });
    }
    Ok(blocks.join("\n") + "\n")
}

/// Check a chain + key: the chain parses, the key matches the leaf, and the
/// leaf is valid at `now`.
pub fn validate_pair(
    chain_pem: &str,
    key_pem: &str,
    now: SystemTime,
) -> Result<LeafInfo, CertError> {
    let chain = parse_certs("certificate chain", chain_pem)?;
    let (_, leaf) =
        x509_parser::parse_x509_certificate(&chain[0]).map_err(|e| CertError::Parse {
            what: "certificate chain",
            reason: e.to_string(),
        })?;
    // The PEM error text never contains key material, only its position.
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| CertError::Key(e.to_string()))?;
    let signer = rustls::crypto::ring::sign::any_supported_type(&key)
        .map_err(|e| CertError::Key(e.to_string()))?;
    let spki = signer
        .public_key()
        .ok_or_else(|| CertError::Key("unsupported key type".into()))?;
    if spki.as_ref() != leaf.tbs_certificate.subject_pki.raw {
        return Err(CertError::KeyMismatch);
    }
    let not_before = to_system_time(leaf.validity().not_before);
    let not_after = to_system_time(leaf.validity().not_after);
    if now >= not_after {
        return Err(CertError::Expired(leaf.validity().not_after.to_string()));
    }
    if now + Duration::from_secs(300) < not_before {
        // Five minutes of clock skew tolerated, as issuers usually backdate by that much.
        return Err(CertError::NotYetValid(
            leaf.validity().not_before.to_string(),
        ));
    }
    Ok(LeafInfo {
        not_before,
        not_after,
        serial: leaf.raw_serial_as_string().replace(':', ""),
    })
}

/// Validate a full bundle and build it.
pub fn validate_bundle(
    chain_pem: String,
    key_pem: String,
    roots_pem: String,
    now: SystemTime,
) -> Result<CertBundle, CertError> {
    let info = validate_pair(&chain_pem, &key_pem, now)?;
    parse_certs("root certificates", &roots_pem)?;
    Ok(CertBundle {
        chain_pem,
        key_pem,
        roots_pem,
        not_before: info.not_before,
        not_after: info.not_after,
        serial: info.serial,
    })
}

/// Metrics of the certificate sources.
#[derive(Clone, Debug, Default)]
pub struct CertMetrics {
    pub updates: Counter,
    pub failures: Counter,
    pub expiry: Gauge,
}

impl CertMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "cert_updates",
            "New workload certificate bundles published",
            self.updates.clone(),
        );
        registry.register(
            "cert_failures",
            "Failed certificate loads or CA calls (last good bundle kept)",
            self.failures.clone(),
        );
        registry.register(
            "cert_expiry_timestamp_seconds",
            "Expiry of the workload certificate in service (unix seconds)",
            self.expiry.clone(),
        );
    }
}

/// The publishing end a source writes to.
#[derive(Clone, Debug)]
pub struct BundleSender {
    bundle: watch::Sender<Option<Arc<CertBundle>>>,
    /// Why the source has nothing good to serve yet (or last failure), for readiness.
    status: watch::Sender<Option<String>>,
    metrics: CertMetrics,
    /// The last failure logged, so a retry loop logs a repeated error once.
    last_error: Arc<std::sync::Mutex<Option<String>>>,
}

/// The subscribing end.
pub type BundleReceiver = watch::Receiver<Option<Arc<CertBundle>>>;

impl BundleSender {
    pub fn new(metrics: CertMetrics) -> Self {
        Self {
            bundle: watch::channel(None).0,
            status: watch::channel(Some("certificate source starting".into())).0,
            metrics,
            last_error: Arc::default(),
        }
    }
    pub fn subscribe(&self) -> BundleReceiver {
        self.bundle.subscribe()
    }
    pub fn status(&self) -> watch::Receiver<Option<String>> {
        self.status.subscribe()
    }
    pub fn current(&self) -> Option<Arc<CertBundle>> {
        self.bundle.borrow().clone()
    }
    /// Publish a validated bundle; returns whether it differed from the current one.
    pub fn publish(&self, b: CertBundle) -> bool {
        let secs = b
            .not_after
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let changed = self.bundle.send_if_modified(|cur| {
            if cur.as_deref() == Some(&b) {
                return false;
            }
            *cur = Some(Arc::new(b));
            true
        });
        if changed {
            self.metrics.updates.inc();
            self.metrics
                .expiry
                .set(i64::try_from(secs).unwrap_or(i64::MAX));
        }
        self.status.send_if_modified(|s| s.take().is_some());
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = None;
        changed
    }
    /// Report a failure. The last good bundle stays; the reason shows in
    /// readiness only while nothing good was ever published.
    pub fn fail(&self, source: &str, err: &CertError) {
        self.metrics.failures.inc();
        let reason = format!("{source}: {err}");
        let repeated = {
            let mut last = self.last_error.lock().unwrap_or_else(|p| p.into_inner());
            let same = last.as_deref() == Some(reason.as_str());
            *last = Some(reason.clone());
            same
        };
        let have = self.bundle.borrow().is_some();
        match (have, repeated) {
            (_, true) => tracing::debug!(source, error = %err, "certificate source still failing"),
            (true, false) => {
                tracing::warn!(source, error = %err, "certificate update rejected; keeping the last good certificate")
            }
            (false, false) => tracing::warn!(source, error = %err, "no usable certificate yet"),
        }
        if !have {
            self.status.send_if_modified(|s| {
                if s.as_deref() == Some(reason.as_str()) {
                    return false;
                }
                *s = Some(reason);
                true
            });
        }
    }
}

/// A source of workload certificates. `run` publishes into `out` until
/// `cancel` fires; it retries on its own and never gives up.
pub trait CertSource: Send + 'static {
    fn describe(&self) -> String;
    fn run(
        self: Box<Self>,
        out: BundleSender,
        cancel: CancellationToken,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>>;
}

/// Pick the source the flags ask for: `--ca-address` wins, then
/// `--cert-dir`; `--inbound-tls` or `--outbound-tls` alone means the default
/// cert dir. `None`: no workload certificate configured.
pub fn source_from_config(cfg: &RunConfig) -> Result<Option<Box<dyn CertSource>>, CertError> {
    if let Some(addr) = cfg.ca_address.as_deref().filter(|a| !a.is_empty()) {
        let src = ca::CaSource::from_config(addr, cfg)?;
        return Ok(Some(Box::new(src)));
    }
    let uses_tls = cfg.inbound_tls || !cfg.outbound_tls.is_empty();
    let dir = match (&cfg.cert_dir, uses_tls) {
        (Some(d), _) => d.clone(),
        (None, true) => PathBuf::from(DEFAULT_CERT_DIR),
        (None, false) => return Ok(None),
    };
    Ok(Some(Box::new(file::FileSource::new(dir))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use remora_test_support::pki::{Ca, Leaf};

    #[test]
    fn validation_accepts_good_and_names_each_fault() {
        let ca = Ca::new("root");
        let Leaf { chain, key, .. } = ca.leaf();
        let now = SystemTime::now();
        let b = validate_bundle(chain.clone(), key.clone(), ca.pem.clone(), now).expect("valid");
        assert!(!b.serial.is_empty());
        assert!(
            !format!("{b:?}").contains("PRIVATE"),
            "Debug must not leak the key"
        );

        let other_key = ca.leaf().key;
        assert!(matches!(
            validate_pair(&chain, &other_key, now),
            Err(CertError::KeyMismatch)
        ));
        assert!(matches!(
            validate_pair("garbage", &key, now),
            Err(CertError::NoCertificate { .. })
        ));
        let broken = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        assert!(validate_pair(broken, &key, now).is_err());
        assert!(matches!(
            validate_pair(&chain, "nope", now),
            Err(CertError::Key(_))
        ));
        let expired = ca.leaf_with(
            now - Duration::from_secs(7200),
            now - Duration::from_secs(3600),
        );
        let (old, old_key) = (expired.chain, expired.key);
        assert!(matches!(
            validate_pair(&old, &old_key, now),
            Err(CertError::Expired(_))
        ));
        assert!(validate_bundle(chain, key, String::new(), now).is_err());
    }

    #[test]
    fn union_roots_keeps_each_certificate_once() {
        let (a, b) = (Ca::new("old root"), Ca::new("new root"));
        let crlf = b.pem.replace('\n', "\r\n");
        let u = union_roots("roots", [a.pem.as_str(), &format!("\n{crlf}\n\n{}", a.pem)])
            .expect("union");
        let ders = parse_certs("roots", &u).expect("parses");
        assert_eq!(
            ders,
            [
                parse_certs("a", &a.pem).expect("a"),
                parse_certs("b", &b.pem).expect("b")
            ]
            .concat()
        );
        assert_eq!(union_roots("roots", [u.as_str()]).expect("again"), u);
        for bad in ["", "garbage", "-----BEGIN CERTIFICATE-----\nAAAA\n"] {
            assert!(union_roots("roots", [bad]).is_err(), "{bad:?}");
        }
        let broken = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        assert!(union_roots("roots", [a.pem.as_str(), broken]).is_err());
    }

    #[test]
    fn publish_dedups_and_fail_keeps_last_good() {
        let ca = Ca::new("root");
        let Leaf { chain, key, .. } = ca.leaf();
        let b = validate_bundle(chain, key, ca.pem.clone(), SystemTime::now()).expect("valid");
        let tx = BundleSender::new(CertMetrics::default());
        let status = tx.status();
        assert!(status.borrow().is_some());
        assert!(tx.publish(b.clone()));
        assert!(!tx.publish(b.clone()), "same bundle is no change");
        assert!(status.borrow().is_none());
        tx.fail("test", &CertError::KeyMismatch);
        assert_eq!(tx.current().as_deref(), Some(&b));
        assert!(
            status.borrow().is_none(),
            "no readiness flap after a good bundle"
        );
        assert_eq!(tx.metrics.failures.get(), 1);
    }
}
