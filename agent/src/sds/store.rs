//! Secrets by resource name, each a `watch` channel so a stream can follow
//! exactly the names it watches.
//!
//! `default` and `ROOTCA` are derived from the workload [`CertBundle`]
//! channel, each with its own version, so a leaf rotation does not push
//! `ROOTCA` and vice versa. `file-cert:<cert>~<key>` and `file-root:<path>`
//! (Istio's formats) are loaded and watched on first request, and released
//! (entry, file watch task) once no stream or fetch holds them any more: the
//! names come from requests, so what is kept must follow what is asked.

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
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prost::Message;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::certs::file::{self, DEFAULT_POLL, DEFAULT_RESYNC};
use crate::certs::{self, BundleReceiver, CertError};

pub const SECRET_TYPE_URL: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
/// Istio's name of the workload identity secret.
pub const WORKLOAD_CERT: &str = remora_contract::mesh::WORKLOAD_SECRET;
/// Istio's name of the trust bundle secret.
pub const ROOT_CA: &str = remora_contract::mesh::ROOT_SECRET;
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

type ResourceTx = watch::Sender<Option<Arc<Resource>>>;

#[derive(Debug)]
struct StoreInner {
    workload: ResourceTx,
    root: ResourceTx,
    /// File secrets by name; an entry lives while someone holds a receiver.
    files: Mutex<HashMap<String, ResourceTx>>,
    cancel: CancellationToken,
    failures: Counter,
    /// Running file watch tasks (one per entry of `files`).
    file_watches: Gauge,
}

impl StoreInner {
    fn files(&self) -> std::sync::MutexGuard<'_, HashMap<String, ResourceTx>> {
        self.files.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drop the entry `name` if nobody holds `tx` any more. Under the map's
    /// lock, so a concurrent [`SecretStore::subscribe`] either came first (and
    /// holds a receiver: the entry stays) or creates a fresh entry after.
    fn release(&self, name: &str, tx: &ResourceTx) -> bool {
        let mut files = self.files();
        if tx.receiver_count() > 0 {
            return false;
        }
        if files.get(name).is_some_and(|t| t.same_channel(tx)) {
            files.remove(name);
        }
        true
    }
}

/// Counts a running file watch task for as long as it lives.
struct WatchCount(Gauge);

impl WatchCount {
    fn new(g: &Gauge) -> Self {
        g.inc();
        Self(g.clone())
    }
}

impl Drop for WatchCount {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl SecretStore {
    /// Follows `bundles` until `cancel`. `failures` counts failed file
    /// secret loads; `file_watches` the file secrets watched now.
    pub fn new(
        bundles: Option<BundleReceiver>,
        cancel: CancellationToken,
        failures: Counter,
        file_watches: Gauge,
    ) -> Self {
        let inner = Arc::new(StoreInner {
            workload: watch::channel(None).0,
            root: watch::channel(None).0,
            files: Mutex::default(),
            cancel,
            failures,
            file_watches,
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
        let mut files = self.inner.files();
        if let Some(tx) = files.get(name) {
            return tx.subscribe();
        }
        let tx: ResourceTx = watch::channel(None).0;
        let rx = tx.subscribe();
        files.insert(name.to_string(), tx.clone());
        let inner = self.inner.clone();
        let count = WatchCount::new(&inner.file_watches);
        let name = name.to_string();
        let stop = inner.cancel.child_token();
        let failures = inner.failures.clone();
        let (tx2, name2) = (tx.clone(), name.clone());
        let reload = file::watch_and_reload(
            paths,
            DEFAULT_POLL,
            DEFAULT_RESYNC,
            stop.clone(),
            move || match load() {
                Ok(v) => update(&tx2, build(&name2, v)),
                Err(e) => {
                    failures.inc();
                    tracing::warn!(secret = %name2, error = %e, "cannot load secret files; keeping the last good one");
                }
            },
        );
        tokio::spawn(async move {
            let _count = count;
            tokio::pin!(reload);
            loop {
                tokio::select! {
                    // Ends only when the store's token fires.
                    _ = &mut reload => return,
                    _ = tx.closed() => if inner.release(&name, &tx) {
                        stop.cancel();
                        tracing::debug!(secret = %name, "file secret no longer requested; watch released");
                        return;
                    },
                }
            }
        });
        rx
    }

    /// File secrets held now (entries, each with its watch task).
    pub fn file_secrets(&self) -> usize {
        self.inner.files().len()
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

fn update(tx: &ResourceTx, r: Resource) {
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
    use std::time::Duration;

    /// An entry lives exactly as long as a receiver: a second subscriber
    /// shares it, and the last one gone releases entry and task, also for
    /// lookups that never keep a receiver (`current`).
    #[tokio::test]
    async fn file_entries_follow_their_subscribers() {
        let tmp = tempfile::tempdir().expect("tmp");
        let path = tmp.path().join("r.pem");
        std::fs::write(&path, remora_test_support::pki::Ca::new("r").pem).expect("write");
        let name = format!("{FILE_ROOT_PREFIX}{}", path.display());
        let watches = Gauge::default();
        let store = SecretStore::new(
            None,
            CancellationToken::new(),
            Counter::default(),
            watches.clone(),
        );
        let held = |n: usize| {
            let ok = store.file_secrets() == n && watches.get() == i64::try_from(n).unwrap_or(-1);
            std::future::ready(ok.then_some(()))
        };
        let wait = |n: usize, what: &'static str| {
            remora_test_support::wait::wait_until(Duration::from_secs(10), what, move || held(n))
        };

        let mut first = store.subscribe(&name).expect("known name");
        let second = store.subscribe(&name).expect("known name");
        assert_eq!(store.file_secrets(), 1, "one entry per name");
        first.wait_for(Option::is_some).await.expect("loaded");
        drop(first);
        wait(1, "kept for the second subscriber")
            .await
            .expect("held");
        drop(second);
        wait(0, "released").await.expect("released");

        for _ in 0..50 {
            let _ = store.current(&name);
        }
        wait(0, "lookups leave nothing behind")
            .await
            .expect("released");
        // Unknown names never make an entry.
        assert!(store.subscribe("file-root:").is_none());
        assert_eq!(store.file_secrets(), 0);
    }

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
