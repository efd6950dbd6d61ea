//! Secrets by resource name, each a `watch` channel so a stream can follow
//! exactly the names it watches.
//!
//! `default` and `ROOTCA` are derived from the workload [`CertBundle`]
//! channel, each with its own version, so a leaf rotation does not push
//! `ROOTCA` and vice versa. `file-cert:<cert>~<key>` and `file-root:<path>`
//! (Istio's formats) are loaded and watched on first request.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use envoy_types::pb::envoy::config::core::v3::DataSource;
use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, Secret, TlsCertificate, secret,
};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::certs::file::{self, DEFAULT_POLL, DEFAULT_RESYNC};
use crate::certs::{self, BundleReceiver, CertError};

pub const SECRET_TYPE_URL: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
/// Istio's name of the workload identity secret.
pub const WORKLOAD_CERT: &str = "default";
/// Istio's name of the trust bundle secret.
pub const ROOT_CA: &str = "ROOTCA";
pub const FILE_CERT_PREFIX: &str = "file-cert:";
pub const FILE_ROOT_PREFIX: &str = "file-root:";

/// One secret ready to send: its version and its encoded form.
#[derive(Debug, Clone, PartialEq)]
pub struct Resource {
    pub name: String,
    pub version: String,
    pub any: Any,
}

pub type ResourceRx = watch::Receiver<Option<Arc<Resource>>>;

fn inline(bytes: &str) -> Option<DataSource> {
    Some(DataSource {
        specifier: Some(Specifier::InlineBytes(bytes.as_bytes().to_vec())),
        ..Default::default()
    })
}

fn encode(name: &str, version: String, ty: secret::Type) -> Resource {
    let s = Secret {
        name: name.to_string(),
        r#type: Some(ty),
    };
    Resource {
        name: name.to_string(),
        version,
        any: Any {
            type_url: SECRET_TYPE_URL.to_string(),
            value: s.encode_to_vec(),
        },
    }
}

pub fn tls_certificate(name: &str, chain_pem: &str, key_pem: &str) -> Resource {
    encode(
        name,
        certs::content_version(&[chain_pem, key_pem]),
        secret::Type::TlsCertificate(TlsCertificate {
            certificate_chain: inline(chain_pem),
            private_key: inline(key_pem),
            ..Default::default()
        }),
    )
}

pub fn validation_context(name: &str, roots_pem: &str) -> Resource {
    encode(
        name,
        certs::content_version(&[roots_pem]),
        secret::Type::ValidationContext(CertificateValidationContext {
            trusted_ca: inline(roots_pem),
            ..Default::default()
        }),
    )
}

/// What a name refers to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretName {
    Workload,
    RootCa,
    FileCert { cert: PathBuf, key: PathBuf },
    FileRoot(PathBuf),
}

impl SecretName {
    pub fn parse(name: &str) -> Option<Self> {
        if name == WORKLOAD_CERT {
            return Some(Self::Workload);
        }
        if name == ROOT_CA {
            return Some(Self::RootCa);
        }
        if let Some(rest) = name.strip_prefix(FILE_CERT_PREFIX) {
            let (c, k) = rest.split_once('~')?;
            if c.is_empty() || k.is_empty() {
                return None;
            }
            return Some(Self::FileCert {
                cert: c.into(),
                key: k.into(),
            });
        }
        if let Some(p) = name.strip_prefix(FILE_ROOT_PREFIX)
            && !p.is_empty()
        {
            return Some(Self::FileRoot(p.into()));
        }
        None
    }
}

/// All secrets the server can serve.
#[derive(Debug, Clone)]
pub struct SecretStore {
    inner: Arc<StoreInner>,
}

#[derive(Debug)]
struct StoreInner {
    workload: watch::Sender<Option<Arc<Resource>>>,
    root: watch::Sender<Option<Arc<Resource>>>,
    files: Mutex<HashMap<String, watch::Sender<Option<Arc<Resource>>>>>,
    cancel: CancellationToken,
    failures: prometheus_client::metrics::counter::Counter,
}

impl SecretStore {
    /// Follows `bundles` until `cancel`.
    pub fn new(
        bundles: Option<BundleReceiver>,
        cancel: CancellationToken,
        failures: prometheus_client::metrics::counter::Counter,
    ) -> Self {
        let inner = Arc::new(StoreInner {
            workload: watch::channel(None).0,
            root: watch::channel(None).0,
            files: Mutex::default(),
            cancel,
            failures,
        });
        if let Some(mut rx) = bundles {
            let inner2 = inner.clone();
            tokio::spawn(async move {
                loop {
                    let b = rx.borrow_and_update().clone();
                    if let Some(b) = b {
                        update(
                            &inner2.workload,
                            tls_certificate(WORKLOAD_CERT, &b.chain_pem, &b.key_pem),
                        );
                        update(&inner2.root, validation_context(ROOT_CA, &b.roots_pem));
                    }
                    tokio::select! {
                        _ = inner2.cancel.cancelled() => return,
                        r = rx.changed() => if r.is_err() { return },
                    }
                }
            });
        }
        Self { inner }
    }

    /// Subscribe to `name`; `None` for a name this server does not know.
    pub fn subscribe(&self, name: &str) -> Option<ResourceRx> {
        match SecretName::parse(name)? {
            SecretName::Workload => Some(self.inner.workload.subscribe()),
            SecretName::RootCa => Some(self.inner.root.subscribe()),
            SecretName::FileCert { cert, key } => Some(self.file_entry(
                name,
                move || {
                    let chain = file::read(&cert)?;
                    let key = file::read(&key)?;
                    certs::validate_pair(&chain, &key, SystemTime::now())?;
                    Ok((chain, Some(key)))
                },
                |n, (chain, key)| tls_certificate(n, &chain, key.as_deref().unwrap_or_default()),
                name_paths(name),
            )),
            SecretName::FileRoot(path) => Some(self.file_entry(
                name,
                move || {
                    let roots = file::read(&path)?;
                    certs::parse_certs("root certificates", &roots)?;
                    Ok((roots, None))
                },
                |n, (roots, _)| validation_context(n, &roots),
                name_paths(name),
            )),
        }
    }

    fn file_entry(
        &self,
        name: &str,
        load: impl Fn() -> Result<(String, Option<String>), CertError> + Send + 'static,
        build: fn(&str, (String, Option<String>)) -> Resource,
        paths: Vec<PathBuf>,
    ) -> ResourceRx {
        let mut files = self.inner.files.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = files.get(name) {
            return tx.subscribe();
        }
        let tx = watch::channel(None).0;
        let rx = tx.subscribe();
        files.insert(name.to_string(), tx.clone());
        let name = name.to_string();
        let cancel = self.inner.cancel.clone();
        let failures = self.inner.failures.clone();
        tokio::spawn(file::watch_and_reload(
            paths,
            DEFAULT_POLL,
            DEFAULT_RESYNC,
            cancel,
            move || match load() {
                Ok(v) => update(&tx, build(&name, v)),
                Err(e) => {
                    failures.inc();
                    tracing::warn!(secret = %name, error = %e, "cannot load secret files; keeping the last good one");
                }
            },
        ));
        rx
    }

    /// The current value of a name, if known and loaded.
    pub fn current(&self, name: &str) -> Option<Arc<Resource>> {
        self.subscribe(name)?.borrow().clone()
    }
}

/// Directories to watch for a file secret (parents of its files).
fn name_paths(name: &str) -> Vec<PathBuf> {
    match SecretName::parse(name) {
        Some(SecretName::FileCert { cert, key }) => vec![cert, key],
        Some(SecretName::FileRoot(p)) => vec![p],
        _ => vec![],
    }
}

fn update(tx: &watch::Sender<Option<Arc<Resource>>>, r: Resource) {
    tx.send_if_modified(|cur| {
        if cur.as_ref().is_some_and(|c| c.version == r.version) {
            return false;
        }
        *cur = Some(Arc::new(r));
        true
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_like_istio() {
        assert_eq!(SecretName::parse("default"), Some(SecretName::Workload));
        assert_eq!(SecretName::parse("ROOTCA"), Some(SecretName::RootCa));
        assert_eq!(
            SecretName::parse("file-cert:/a/c.pem~/a/k.pem"),
            Some(SecretName::FileCert {
                cert: "/a/c.pem".into(),
                key: "/a/k.pem".into()
            })
        );
        assert_eq!(
            SecretName::parse("file-root:/a/r.pem"),
            Some(SecretName::FileRoot("/a/r.pem".into()))
        );
        for bad in [
            "",
            "rootca",
            "file-cert:/a",
            "file-cert:~",
            "file-root:",
            "other",
        ] {
            assert_eq!(SecretName::parse(bad), None, "{bad}");
        }
        assert_eq!(
            name_paths("file-cert:/a/c.pem~/b/k.pem"),
            vec![PathBuf::from("/a/c.pem"), PathBuf::from("/b/k.pem")]
        );
    }
}
