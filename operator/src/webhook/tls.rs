//! The webhook's serving certificate, read from PEM files and reloaded when
//! they change (a rotated Secret, cert-manager), without a restart. Changes
//! are noticed the one way Remora notices a mounted file change
//! ([`remora_contract::mounted`], which says why).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use remora_contract::mounted::MountedFiles;
use rustls::crypto::ring::sign::any_supported_type;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {reason}")]
    Read { path: PathBuf, reason: String },
    #[error("{path}: no certificate in the file")]
    NoCertificate { path: PathBuf },
    #[error("TLS configuration: {0}")]
    Config(String),
    #[error("{path}: unusable private key: {reason}")]
    Key { path: PathBuf, reason: String },
}

/// Load a certificate chain and its key.
pub fn load_certified_key(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let read_err = |path: &Path, e: &dyn std::fmt::Display| TlsError::Read {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| read_err(cert, &e))?
        .collect::<Result<_, _>>()
        .map_err(|e| read_err(cert, &e))?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            path: cert.to_path_buf(),
        });
    }
    let der = PrivateKeyDer::from_pem_file(key).map_err(|e| read_err(key, &e))?;
    let signing = any_supported_type(&der).map_err(|e| TlsError::Key {
        path: key.to_path_buf(),
        reason: e.to_string(),
    })?;
    Ok(CertifiedKey::new(chain, signing))
}

/// A certificate resolver whose certificate can be swapped at any time.
#[derive(Debug)]
pub struct ReloadingCert {
    cert_path: PathBuf,
    key_path: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
    /// The certificate and key files, to notice a change.
    files: Mutex<MountedFiles>,
}

impl ReloadingCert {
    pub fn load(cert_path: PathBuf, key_path: PathBuf) -> Result<Arc<Self>, TlsError> {
        let mut files = MountedFiles::new(vec![cert_path.clone(), key_path.clone()]);
        let _ = files.poll();
        let ck = load_certified_key(&cert_path, &key_path)?;
        Ok(Arc::new(Self {
            cert_path,
            key_path,
            current: RwLock::new(Arc::new(ck)),
            files: Mutex::new(files),
        }))
    }

    /// Reload when the files changed. `Ok(true)` when a new certificate is
    /// in use; on error the old one stays.
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        if files.poll().is_none() {
            return Ok(false);
        }
        match load_certified_key(&self.cert_path, &self.key_path) {
            Ok(ck) => {
                if let Ok(mut cur) = self.current.write() {
                    *cur = Arc::new(ck);
                }
                Ok(true)
            }
            Err(e) => {
                // Half-written or broken: try again at the next poll.
                files.forget();
                Err(e)
            }
        }
    }

    /// Poll the files every `period` until the task is dropped.
    pub fn spawn_reloader(self: &Arc<Self>, period: Duration) -> tokio::task::JoinHandle<()> {
        tokio::spawn(Arc::clone(self).reload_every(period))
    }

    /// Poll the files every `period`, forever (drop the future to stop).
    pub async fn reload_every(self: Arc<Self>, period: Duration) {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match self.reload_if_changed() {
                Ok(true) => {
                    tracing::info!(cert = %self.cert_path.display(), "serving certificate reloaded")
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "cannot reload the serving certificate; keeping the old one")
                }
            }
        }
    }

    pub fn server_config(self: &Arc<Self>) -> Result<rustls::ServerConfig, TlsError> {
        let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_no_client_auth()
        .with_cert_resolver(Arc::clone(self) as Arc<dyn ResolvesServerCert>);
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(cfg)
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.read().ok().map(|c| Arc::clone(&c))
    }
}
