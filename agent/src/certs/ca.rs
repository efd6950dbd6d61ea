//! CA mode: a client of Istio's `IstioCertificateService/CreateCertificate`.
//!
//! A fresh key and CSR (rcgen) per issuance, URI SAN
//! `spiffe://<trust-domain>/ns/<ns>/sa/<sa>`. Renewal at a fraction of the
//! lifetime (default 50%, minus jitter so a fleet does not renew in step),
//! never sooner than a minimum interval after the last issuance; a failed
//! call is retried with jittered exponential backoff up to a cap while the
//! current cert keeps being served.
//!
//! `ROOTCA` is what the CA said over its verified connection: the trust
//! bundle of its answer (every root the mesh trusts, old and new during a
//! rotation; response metadata `x-remora-trust-bundle-bin`) and the root at
//! the end of its chain. The `--ca-root-cert` file (in a pod, a ConfigMap
//! anyone who may write ConfigMaps in the namespace can edit) verifies the
//! CA's own serving certificate, together with the roots the CA said last,
//! and is polled: when it comes to differ from the roots served, the agent
//! asks the CA again (a staged or retired root reaches Envoy that way), but
//! a root that only the file holds is never trusted for peers. A bad file is
//! reported and the last good roots stay.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use backon::{BackoffBuilder, ExponentialBuilder};
use rand::Rng;
use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, SanType, string::Ia5String};
use remora_proto::istio::v1::auth::IstioCertificateRequest;
use remora_proto::istio::v1::auth::istio_certificate_service_client::IstioCertificateServiceClient;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use super::{BundleSender, CertBundle, CertError, CertSource, union_roots, validate_bundle};
use crate::config::{KeyType, RunConfig};

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("key generation: {0}")]
    Key(String),
    #[error("CSR: {0}")]
    Csr(String),
    #[error("bearer token {path}: {reason}")]
    Token { path: PathBuf, reason: String },
    #[error("CA call failed: {code:?}: {message}")]
    Rpc { code: tonic::Code, message: String },
    #[error("CA returned an empty certificate chain")]
    EmptyChain,
    #[error("the CA's trust bundle ({0}): {1}")]
    TrustBundle(&'static str, String),
    #[error("CA address {0:?}: {1}")]
    Address(String, String),
    #[error("{0}")]
    Config(String),
}

/// A CA's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Issued {
    /// PEM, leaf first, root last.
    pub chain: Vec<String>,
    /// Every root the CA says the mesh trusts now (PEM), from
    /// [`TRUST_BUNDLE_METADATA`](remora_contract::workload_ca::TRUST_BUNDLE_METADATA);
    /// `None` from a CA that sends none (Istio's).
    pub trust_bundle: Option<String>,
}

/// Something that signs CSRs: the real gRPC CA client, or a fake in tests.
pub trait Issuer: Send + Sync + 'static {
    fn issue(
        &self,
        csr_pem: String,
        ttl: Duration,
    ) -> impl Future<Output = Result<Issued, CaError>> + Send;
}

/// When to renew and how to back off.
#[derive(Debug, Clone)]
pub struct RenewPolicy {
    /// Renew after this fraction of the lifetime (0..1).
    pub fraction: f64,
    /// Renew up to this fraction of the lifetime earlier, at random.
    pub jitter: f64,
    /// Never ask the CA again sooner than this after a successful issuance.
    /// A back-dated or very short certificate, or a clock skewed against the
    /// CA's, puts the renewal point in the past at receipt; without a floor
    /// renewal would call the CA in a loop.
    pub min_interval: Duration,
    /// First wait after a failure; doubles per consecutive failure.
    pub min_backoff: Duration,
    /// Cap of the failure wait (jitter only ever shortens it).
    pub max_backoff: Duration,
    /// Each failure wait is shortened by up to this fraction (0..1), at
    /// random, so a fleet that lost its CA together does not retry in step.
    pub backoff_jitter: f64,
}

impl Default for RenewPolicy {
    fn default() -> Self {
        Self {
            fraction: 0.5,
            jitter: 0.05,
            min_interval: Duration::from_secs(30),
            min_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(60),
            backoff_jitter: 0.25,
        }
    }
}

/// `x` clamped to 0..=1; a NaN (a policy built by hand) counts as `default`.
fn unit(x: f64, default: f64) -> f64 {
    if x.is_nan() {
        default
    } else {
        x.clamp(0.0, 1.0)
    }
}

impl RenewPolicy {
    /// Delay from `now` until renewal of `b`; `u` in [0,1) picks the jitter.
    /// Never below [`RenewPolicy::min_interval`].
    pub fn renew_delay(&self, b: &CertBundle, now: SystemTime, u: f64) -> Duration {
        let due = self.renew_due(b, now, u);
        due.max(self.min_interval)
    }

    /// Time from `now` to the renewal point itself (zero when already past).
    fn renew_due(&self, b: &CertBundle, now: SystemTime, u: f64) -> Duration {
        let frac = unit(
            unit(self.fraction, 0.5) - unit(self.jitter, 0.0) * unit(u, 0.0),
            0.5,
        );
        // `frac` is within 0..=1, so this stays within the certificate's own window.
        let at = b
            .not_before
            .checked_add(b.lifetime().mul_f64(frac))
            .unwrap_or(b.not_after);
        at.duration_since(now).unwrap_or_default()
    }

    /// Consecutive failure waits: exponential from `min_backoff`, capped.
    fn backoff(&self) -> impl Iterator<Item = Duration> + Send + use<> {
        ExponentialBuilder::default()
            .with_min_delay(self.min_backoff)
            .with_max_delay(self.max_backoff.max(self.min_backoff))
            .with_factor(2.0)
            .without_max_times()
            .build()
    }

    /// A failure wait shortened by the jitter; `u` in [0,1).
    pub fn jittered(&self, wait: Duration, u: f64) -> Duration {
        wait.mul_f64(1.0 - unit(self.backoff_jitter, 0.0) * unit(u, 0.0))
    }
}

/// The workload identity requested from the CA.
#[derive(Debug, Clone)]
pub struct Identity {
    pub trust_domain: String,
    pub namespace: String,
    pub service_account: String,
    pub key_type: KeyType,
    pub ttl: Duration,
}

impl Identity {
    pub fn spiffe_id(&self) -> String {
        format!(
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain, self.namespace, self.service_account
        )
    }

    /// A new key and a PEM CSR for it.
    pub fn key_and_csr(&self) -> Result<(KeyPair, String), CaError> {
        let key = match self.key_type {
            KeyType::EcdsaP256 => KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
                .map_err(|e| CaError::Key(e.to_string()))?,
            // ring (the crypto backend here) signs RSA but cannot generate
            // RSA keys: the `rsa` crate generates, ring signs.
            KeyType::Rsa2048 => {
                use rsa::pkcs8::EncodePrivateKey;
                let k = rsa::RsaPrivateKey::new(&mut rsa::rand_core::OsRng, 2048)
                    .map_err(|e| CaError::Key(e.to_string()))?;
                let der = k.to_pkcs8_der().map_err(|e| CaError::Key(e.to_string()))?;
                KeyPair::from_pkcs8_der_and_sign_algo(
                    &rustls::pki_types::PrivatePkcs8KeyDer::from(der.as_bytes()),
                    &rcgen::PKCS_RSA_SHA256,
                )
                .map_err(|e| CaError::Key(e.to_string()))?
            }
        };
        let mut p = CertificateParams::default();
        p.distinguished_name = DistinguishedName::new();
        p.distinguished_name
            .push(DnType::OrganizationName, self.trust_domain.clone());
        let uri = Ia5String::try_from(self.spiffe_id()).map_err(|e| CaError::Csr(e.to_string()))?;
        p.subject_alt_names = vec![SanType::URI(uri)];
        let csr = p
            .serialize_request(&key)
            .and_then(|r| r.pem())
            .map_err(|e| CaError::Csr(e.to_string()))?;
        Ok((key, csr))
    }
}

/// How often the `--ca-root-cert` trust bundle is read.
pub const DEFAULT_ROOT_POLL: Duration = Duration::from_secs(5);

/// The trust bundle of `--ca-root-cert` as last read well (normalized PEM);
/// `None` without the flag. In a pod it is a ConfigMap that anyone who may
/// write ConfigMaps in the namespace can edit: it only checks the CA's own
/// certificate and tells the agent when to ask the CA again, and never adds
/// a root that the agent's peers are checked against.
pub type TrustRoots = watch::Receiver<Option<Arc<str>>>;

/// Turn a CA answer into a validated bundle: the last element of a longer
/// chain is the CA's root; the roots are it plus `trust_roots` (what the CA
/// said over its verified connection), each once. A one-element answer
/// carries no root: `trust_roots`, or the element itself.
pub fn bundle_from_chain(
    chain: Vec<String>,
    key_pem: String,
    trust_roots: Option<&str>,
) -> Result<CertBundle, CertError> {
    let mut parts: Vec<String> = chain
        .into_iter()
        .map(|c| c.trim().to_string())
        .filter(|c| !c.is_empty())
        .collect();
    let chain_root = match (parts.len(), trust_roots) {
        (0, _) => return Err(CaError::EmptyChain.into()),
        (1, Some(_)) => None,
        (1, None) => Some(parts[0].clone()),
        _ => parts.pop(),
    };
    let roots_pem = union_roots(
        "root certificates",
        trust_roots.into_iter().chain(chain_root.as_deref()),
    )?;
    let chain_pem = parts.join("\n") + "\n";
    validate_bundle(chain_pem, key_pem, roots_pem, SystemTime::now())
}

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

/// Write the bundle as files for apps, each one atomically (temp + rename).
pub fn write_output(dir: &Path, b: &CertBundle) -> Result<(), CertError> {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;
    let werr = |path: &Path| {
        let path = path.to_path_buf();
        move |source| CertError::Write { path, source }
    };
    std::fs::create_dir_all(dir).map_err(werr(dir))?;
    for (name, content, mode) in [
        (super::CERT_CHAIN_FILE, &b.chain_pem, 0o644),
        (super::KEY_FILE, &b.key_pem, 0o600),
        (super::ROOT_CERT_FILE, &b.roots_pem, 0o644),
    ] {
        let path = dir.join(name);
        // NamedTempFile starts at 0600, so the key is never readable by others.
        let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(werr(dir))?;
        tmp.write_all(content.as_bytes()).map_err(werr(&path))?;
        tmp.as_file().sync_all().map_err(werr(&path))?;
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(mode))
            .map_err(werr(&path))?;
        tmp.persist(&path).map_err(|e| CertError::Write {
            path: path.clone(),
            source: e.error,
        })?;
    }
    Ok(())
}

/// Whether the roots of `file` (the `--ca-root-cert` bundle) are those the
/// agent serves now; unparsable text counts as different.
fn same_roots(file: &str, served: &str) -> bool {
    let set = |pem: &str| {
        super::parse_certs("roots", pem)
            .ok()
            .map(|v| v.into_iter().collect::<std::collections::HashSet<_>>())
    };
    matches!((set(file), set(served)), (Some(a), Some(b)) if a == b)
}

/// Issue, publish, sleep until renewal; on failure back off. Runs until
/// cancelled. Between two CA calls there is always at least
/// `policy.min_interval` after a success and the (jittered, capped)
/// backoff after a failure; the last good bundle stays published meanwhile.
///
/// The roots served for peers are the CA's answer alone (its trust bundle
/// and chain root). A `roots` file that comes to differ from them (a staged
/// or retired root, or an edit by someone else) makes the agent ask the CA
/// again, once per content and no sooner than `policy.min_interval` after
/// the last call; what the file holds is never served.
pub async fn run_renewal<I: Issuer>(
    issuer: I,
    ident: Identity,
    policy: RenewPolicy,
    mut roots: TrustRoots,
    output_dir: Option<PathBuf>,
    out: BundleSender,
    cancel: CancellationToken,
) {
    let source = "CA";
    let mut backoff = policy.backoff();
    // Warn once per run of certificates that are due at receipt, not every floor.
    let mut warned_due = false;
    // A closed roots channel (no --ca-root-cert watcher) never changes again.
    let mut roots_open = true;
    // The file content the last CA call answered (or that prompted one).
    let mut checked: Option<Arc<str>> = None;
    loop {
        let called = tokio::time::Instant::now();
        checked = roots.borrow_and_update().clone().or(checked);
        let result = async {
            // Key generation is CPU work (seconds for RSA): keep it off the runtime's threads.
            let id = ident.clone();
            let (key, csr) = tokio::task::spawn_blocking(move || id.key_and_csr())
                .await
                .map_err(|e| CaError::Key(e.to_string()))??;
            let issued = issuer.issue(csr, ident.ttl).await?;
            let b = bundle_from_chain(
                issued.chain,
                key.serialize_pem(),
                issued.trust_bundle.as_deref(),
            )?;
            Ok::<_, CertError>(b)
        }
        .await;
        let wait = match result {
            Ok(b) => {
                backoff = policy.backoff();
                let now = SystemTime::now();
                let u: f64 = rand::rng().random();
                let due = policy.renew_due(&b, now, u);
                let delay = policy.renew_delay(&b, now, u);
                if due < policy.min_interval {
                    if !warned_due {
                        tracing::warn!(serial = %b.serial, lifetime = ?b.lifetime(), renew_in = ?delay,
                            "the CA's certificate is due for renewal already (back-dated, very short, or clocks disagree); renewing no sooner than the minimum interval");
                    }
                    warned_due = true;
                } else {
                    warned_due = false;
                }
                if let Some(dir) = &output_dir
                    && let Err(e) = write_output(dir, &b)
                {
                    out.fail(source, &e);
                }
                tracing::info!(serial = %b.serial, renew_in = ?delay, "workload certificate issued");
                out.publish(b);
                delay
            }
            Err(e) => {
                out.fail(source, &e);
                let d = backoff.next().unwrap_or(policy.max_backoff);
                if let Some(cur) = out.current()
                    && cur.not_after <= SystemTime::now()
                {
                    tracing::error!(serial = %cur.serial, "workload certificate expired and the CA is unreachable");
                }
                policy.jittered(d, rand::rng().random())
            }
        };
        let now = tokio::time::Instant::now();
        // Saturate: a huge wait is "a day from now", never a panic.
        let mut deadline = now
            .checked_add(wait)
            .unwrap_or_else(|| now + Duration::from_secs(86_400));
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep_until(deadline) => break,
                changed = roots.changed(), if roots_open => {
                    if changed.is_err() {
                        roots_open = false;
                        continue;
                    }
                    let Some(file) = roots.borrow_and_update().clone() else {
                        continue;
                    };
                    let served = out.current().map(|b| b.roots_pem.clone()).unwrap_or_default();
                    if checked.as_ref() == Some(&file) || same_roots(&file, &served) {
                        continue;
                    }
                    checked = Some(file);
                    let soonest = called + policy.min_interval;
                    if soonest < deadline {
                        deadline = soonest.max(tokio::time::Instant::now());
                        tracing::info!(ask_in = ?deadline.saturating_duration_since(tokio::time::Instant::now()),
                            "the trust bundle file differs from the roots the CA gave; asking the CA again (the file's roots are not trusted)");
                    }
                }
            }
        }
    }
}

/// The real CA over gRPC.
#[derive(Debug, Clone)]
pub struct GrpcIssuer {
    client: IstioCertificateServiceClient<Channel>,
    token_path: PathBuf,
    cluster_id: String,
}

impl GrpcIssuer {
    /// `address` is `host:port` (TLS, verified by `ca_root_pem` under
    /// `server_name`, default the host) or an explicit `http://host:port`
    /// for a plaintext CA (local testing only).
    pub fn new(
        address: &str,
        server_name: Option<&str>,
        ca_root_pem: Option<&str>,
        token_path: PathBuf,
        cluster_id: String,
    ) -> Result<Self, CaError> {
        let bad = |e: &dyn std::fmt::Display| CaError::Address(address.to_string(), e.to_string());
        let plaintext = address.starts_with("http://");
        let url = if plaintext || address.starts_with("https://") {
            address.to_string()
        } else {
            format!("https://{address}")
        };
        let mut ep = Endpoint::from_shared(url.clone())
            .map_err(|e| bad(&e))?
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(15));
        if !plaintext {
            let root = ca_root_pem.ok_or_else(|| {
                CaError::Config("--ca-root-cert is required to verify the CA over TLS".into())
            })?;
            let uri: http::Uri = url.parse().map_err(|e| bad(&e))?;
            let host = server_name
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| uri.host().unwrap_or_default().trim_matches(['[', ']']));
            ep = ep
                .tls_config(
                    ClientTlsConfig::new()
                        .ca_certificate(Certificate::from_pem(root))
                        .domain_name(host),
                )
                .map_err(|e| bad(&e))?;
        }
        Ok(Self {
            client: IstioCertificateServiceClient::new(ep.connect_lazy()),
            token_path,
            cluster_id,
        })
    }

    async fn token(&self) -> Result<String, CaError> {
        let terr = |reason: String| CaError::Token {
            path: self.token_path.clone(),
            reason,
        };
        // Read on every call: projected service-account tokens rotate.
        let t = tokio::fs::read_to_string(&self.token_path)
            .await
            .map_err(|e| terr(e.to_string()))?;
        let t = t.trim();
        if t.is_empty() {
            return Err(terr("empty".into()));
        }
        Ok(t.to_string())
    }
}

impl Issuer for GrpcIssuer {
    async fn issue(&self, csr_pem: String, ttl: Duration) -> Result<Issued, CaError> {
        let token = self.token().await?;
        let mut req = tonic::Request::new(IstioCertificateRequest {
            csr: csr_pem,
            validity_duration: i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX),
            metadata: None,
        });
        // The error never echoes the value: it is a credential.
        let auth =
            MetadataValue::try_from(format!("Bearer {token}")).map_err(|_| CaError::Token {
                path: self.token_path.clone(),
                reason: "contains characters not allowed in a header".into(),
            })?;
        req.metadata_mut().insert("authorization", auth);
        if let Ok(v) = MetadataValue::try_from(self.cluster_id.as_str()) {
            req.metadata_mut().insert("clusterid", v);
        }
        let resp = self
            .client
            .clone()
            .create_certificate(req)
            .await
            .map_err(|s| CaError::Rpc {
                code: s.code(),
                message: s.message().to_string(),
            })?;
        let trust_bundle = trust_bundle_of(resp.metadata())?;
        Ok(Issued {
            chain: resp.into_inner().cert_chain,
            trust_bundle,
        })
    }
}

/// The CA's trust bundle in an answer's metadata, if it sent one.
fn trust_bundle_of(m: &tonic::metadata::MetadataMap) -> Result<Option<String>, CaError> {
    use remora_contract::workload_ca::{MAX_TRUST_BUNDLE_BYTES, TRUST_BUNDLE_METADATA};
    let Some(v) = m.get_bin(TRUST_BUNDLE_METADATA) else {
        return Ok(None);
    };
    let bad = |why: String| CaError::TrustBundle(TRUST_BUNDLE_METADATA, why);
    let bytes = v.to_bytes().map_err(|e| bad(e.to_string()))?;
    if bytes.len() > MAX_TRUST_BUNDLE_BYTES {
        return Err(bad(format!(
            "{} bytes, more than {MAX_TRUST_BUNDLE_BYTES}",
            bytes.len()
        )));
    }
    let text = String::from_utf8(bytes.to_vec()).map_err(|e| bad(e.to_string()))?;
    // Checked here so that a bad value is the CA's fault, named as such.
    union_roots("the CA's trust bundle", [text.as_str()]).map_err(|e| bad(e.to_string()))?;
    Ok(Some(text))
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

/// CA mode as a [`CertSource`].
#[derive(Debug, Clone)]
pub struct CaSource {
    pub address: String,
    /// The name the CA's certificate is checked against (`--ca-server-name`).
    pub server_name: Option<String>,
    /// The trust bundle as read at start (`--ca-root-cert`).
    pub ca_root_pem: Option<String>,
    /// The file to follow for new roots; `None`: the start's stay.
    pub ca_root_cert: Option<PathBuf>,
    /// How often `ca_root_cert` is read.
    pub root_poll: Duration,
    pub token_path: PathBuf,
    pub cluster_id: String,
    pub identity: Identity,
    pub policy: RenewPolicy,
    pub output_dir: Option<PathBuf>,
}

impl CaSource {
    pub fn from_config(address: &str, cfg: &RunConfig) -> Result<Self, CertError> {
        // Unreadable or not PEM at start: a configuration error, as there
        // are no earlier roots to keep.
        let ca_root_pem = match &cfg.ca_root_cert {
            Some(p) => Some(union_roots(
                "--ca-root-cert",
                [super::file::read(p)?.as_str()],
            )?),
            None => None,
        };
        let or_default = |s: &str| {
            if s.is_empty() {
                "default".to_string()
            } else {
                s.to_string()
            }
        };
        Ok(Self {
            address: address.to_string(),
            server_name: cfg.ca_server_name.clone().filter(|n| !n.is_empty()),
            ca_root_pem,
            ca_root_cert: cfg.ca_root_cert.clone(),
            root_poll: DEFAULT_ROOT_POLL,
            token_path: cfg.token_path.clone(),
            cluster_id: cfg.cluster_id.clone(),
            identity: Identity {
                trust_domain: cfg.trust_domain.clone(),
                namespace: or_default(&cfg.pod_namespace),
                service_account: or_default(&cfg.service_account),
                key_type: cfg.key_type,
                ttl: cfg.cert_ttl,
            },
            policy: RenewPolicy::default(),
            output_dir: cfg.output_certs.clone(),
        })
    }
}

impl CertSource for CaSource {
    fn describe(&self) -> String {
        format!("CA at {}", self.address)
    }

    fn run(
        self: Box<Self>,
        out: BundleSender,
        cancel: CancellationToken,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let initial = self.ca_root_pem.as_deref().map(Arc::<str>::from);
            let (tx, roots) = watch::channel(initial);
            let issuer = match RootFollowingIssuer::new(
                &self.address,
                self.server_name.clone(),
                roots.clone(),
                self.token_path.clone(),
                self.cluster_id.clone(),
            ) {
                Ok(i) => i,
                Err(e) => {
                    // A config error does not fix itself: report it and wait for shutdown.
                    out.fail("CA", &e.into());
                    cancel.cancelled().await;
                    return;
                }
            };
            let watcher = {
                let (out, cancel) = (out.clone(), cancel.clone());
                let (file, poll) = (self.ca_root_cert.clone(), self.root_poll);
                async move {
                    match file {
                        Some(path) => {
                            watch_trust_roots(path, poll, tx, out, cancel).await;
                        }
                        // Dropping the sender tells the renewal loop no change comes.
                        None => drop(tx),
                    }
                }
            };
            let renewal = run_renewal(
                issuer,
                self.identity,
                self.policy,
                roots,
                self.output_dir,
                out,
                cancel,
            );
            tokio::join!(watcher, renewal);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::CertMetrics;
    use super::*;
    use rcgen::CertificateSigningRequestParams;
    use remora_test_support::pki::Ca;
    use std::sync::{Arc, Mutex};
    use tokio::sync::Notify;
    use tokio::time::Instant;

    /// A CA double whose answers are scripted: `fail` makes calls error;
    /// `window` is the validity it signs, in seconds relative to the wall
    /// clock at issuance (negative: in the past).
    struct FakeCa {
        root: Ca,
        fail: Arc<Mutex<bool>>,
        calls: Arc<Mutex<Vec<Instant>>>,
        window: Arc<Mutex<(i64, i64)>>,
        /// Signalled on every call, so a test sees a runaway loop at once.
        called: Arc<Notify>,
        /// The trust bundle it sends with each answer.
        trust: Arc<Mutex<Option<String>>>,
    }

    fn fake_ca(lifetime: Duration) -> FakeCa {
        let secs = i64::try_from(lifetime.as_secs()).expect("test lifetime");
        FakeCa {
            root: Ca::new("fake-ca"),
            fail: Arc::default(),
            calls: Arc::default(),
            window: Arc::new(Mutex::new((0, secs))),
            called: Arc::default(),
            trust: Arc::default(),
        }
    }

    fn offset(now: SystemTime, secs: i64) -> SystemTime {
        let d = Duration::from_secs(secs.unsigned_abs());
        if secs >= 0 { now + d } else { now - d }
    }

    impl Issuer for FakeCa {
        async fn issue(&self, csr_pem: String, _ttl: Duration) -> Result<Issued, CaError> {
            self.calls.lock().expect("lock").push(Instant::now());
            self.called.notify_one();
            if *self.fail.lock().expect("lock") {
                return Err(CaError::Rpc {
                    code: tonic::Code::Unavailable,
                    message: "down".into(),
                });
            }
            let (from, to) = *self.window.lock().expect("lock");
            let now = SystemTime::now();
            let leaf = self
                .root
                .sign_csr_valid(&csr_pem, offset(now, from), offset(now, to), &[])
                .expect("sign");
            Ok(Issued {
                chain: vec![leaf, self.root.pem.clone()],
                trust_bundle: self.trust.lock().expect("lock").clone(),
            })
        }
    }

    /// Let `span` of (paused) time pass and return the CA calls made; fails
    /// as soon as there are more than `limit`, since a loop that never
    /// sleeps would also keep the paused clock from ever reaching `span`.
    async fn calls_within(ca: &FakeCaHandles, span: Duration, limit: usize) -> Vec<Instant> {
        let start = Instant::now();
        let end = tokio::time::sleep(span);
        tokio::pin!(end);
        loop {
            tokio::select! {
                _ = &mut end => break,
                _ = ca.called.notified() => {
                    let n = ca.calls.lock().expect("lock").len();
                    assert!(n <= limit, "{n} CA calls within {:?}: renewal loops", start.elapsed());
                }
            }
        }
        ca.calls.lock().expect("lock").clone()
    }

    /// What a test keeps of a [`FakeCa`] it handed to the renewal loop.
    struct FakeCaHandles {
        calls: Arc<Mutex<Vec<Instant>>>,
        called: Arc<Notify>,
        window: Arc<Mutex<(i64, i64)>>,
        trust: Arc<Mutex<Option<String>>>,
    }

    impl FakeCa {
        fn handles(&self) -> FakeCaHandles {
            FakeCaHandles {
                calls: self.calls.clone(),
                called: self.called.clone(),
                window: self.window.clone(),
                trust: self.trust.clone(),
            }
        }
    }

    fn gaps(c: &[Instant]) -> Vec<Duration> {
        c.windows(2).map(|w| w[1] - w[0]).collect()
    }

    fn ident() -> Identity {
        Identity {
            trust_domain: "cluster.local".into(),
            namespace: "ns1".into(),
            service_account: "sa1".into(),
            key_type: KeyType::EcdsaP256,
            ttl: Duration::from_secs(3600),
        }
    }

    #[test]
    fn csr_carries_spiffe_uri() {
        let (_, csr) = ident().key_and_csr().expect("csr");
        let parsed = CertificateSigningRequestParams::from_pem(&csr).expect("parse");
        let uris: Vec<String> = parsed
            .params
            .subject_alt_names
            .iter()
            .filter_map(|s| match s {
                SanType::URI(u) => Some(u.as_str().to_string()),
                _ => None,
            })
            .collect();
        assert_eq!(
            uris,
            vec!["spiffe://cluster.local/ns/ns1/sa/sa1".to_string()]
        );
    }

    #[test]
    fn rsa_2048_key_and_csr() {
        let mut rsa = ident();
        rsa.key_type = KeyType::Rsa2048;
        let (key, csr) = rsa.key_and_csr().expect("rsa csr");
        assert!(key.serialize_pem().contains("PRIVATE KEY"));
        let parsed = CertificateSigningRequestParams::from_pem(&csr).expect("parse");
        assert_eq!(parsed.public_key.algorithm(), &rcgen::PKCS_RSA_SHA256);
        // The key works end to end: a CA signs it and the bundle validates.
        let ca = fake_ca(Duration::from_secs(1000));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("rt");
        let chain = rt
            .block_on(ca.issue(csr, Duration::from_secs(1)))
            .expect("issue")
            .chain;
        bundle_from_chain(chain, key.serialize_pem(), None).expect("valid bundle");
    }

    #[test]
    fn renew_delay_is_half_life_minus_jitter() {
        let now = SystemTime::now();
        let b = CertBundle {
            chain_pem: String::new(),
            key_pem: String::new(),
            roots_pem: String::new(),
            not_before: now,
            not_after: now + Duration::from_secs(1000),
            serial: String::new(),
        };
        let p = RenewPolicy::default();
        assert_eq!(p.renew_delay(&b, now, 0.0), Duration::from_secs(500));
        assert_eq!(p.renew_delay(&b, now, 1.0), Duration::from_secs(450));
        // Past the renewal point, or past the end: the floor, never zero.
        for late in [600, 5000] {
            assert_eq!(
                p.renew_delay(&b, now + Duration::from_secs(late), 0.0),
                p.min_interval
            );
        }
        // A policy built with nonsense fractions neither panics nor loops.
        let odd = RenewPolicy {
            fraction: f64::NAN,
            jitter: f64::INFINITY,
            ..RenewPolicy::default()
        };
        assert!(odd.renew_delay(&b, now, 0.5) >= odd.min_interval);
        let odd = RenewPolicy {
            backoff_jitter: f64::NAN,
            ..RenewPolicy::default()
        };
        assert_eq!(
            odd.jittered(Duration::from_secs(8), 0.9),
            Duration::from_secs(8)
        );
    }

    fn spawn(ca: FakeCa, policy: RenewPolicy) -> (BundleSender, CancellationToken) {
        // No --ca-root-cert: the sender goes at once, as in `CaSource::run`.
        let (out, cancel, _) = spawn_with_roots(ca, policy, watch::channel(None).1);
        (out, cancel)
    }

    fn spawn_with_roots(
        ca: FakeCa,
        policy: RenewPolicy,
        roots: TrustRoots,
    ) -> (BundleSender, CancellationToken, tempfile::TempDir) {
        let out = BundleSender::new(CertMetrics::default());
        let cancel = CancellationToken::new();
        let dir = tempfile::tempdir().expect("tmp");
        tokio::spawn(run_renewal(
            ca,
            ident(),
            policy,
            roots,
            Some(dir.path().join("out")),
            out.clone(),
            cancel.clone(),
        ));
        (out, cancel, dir)
    }

    fn ders(pem: &str) -> Vec<rustls::pki_types::CertificateDer<'static>> {
        super::super::parse_certs("test", pem).expect("PEM")
    }

    /// ROOTCA is the trust bundle's roots plus the CA's chain root, each once.
    #[test]
    fn roots_are_the_union_of_the_trust_bundle_and_the_chain_root() {
        let ca = fake_ca(Duration::from_secs(1000));
        let old = Ca::new("old root");
        let (key, csr) = ident().key_and_csr().expect("csr");
        let leaf = ca
            .root
            .sign_csr(&csr, Duration::from_secs(600), &[])
            .expect("sign");
        let chain = vec![leaf.clone(), ca.root.pem.clone()];
        let key_pem = key.serialize_pem();
        let both = format!("{}{}", old.pem, ca.root.pem);
        for trust in [old.pem.clone(), both.clone()] {
            let b =
                bundle_from_chain(chain.clone(), key_pem.clone(), Some(&trust)).expect("bundle");
            assert_eq!(ders(&b.roots_pem), ders(&both), "{trust}");
            assert_eq!(
                ders(&b.chain_pem),
                ders(&leaf),
                "the root is not in the chain"
            );
        }
        // No trust bundle: the chain's root alone, as before.
        let b = bundle_from_chain(chain.clone(), key_pem.clone(), None).expect("bundle");
        assert_eq!(ders(&b.roots_pem), ders(&ca.root.pem));
        // A chain of one carries no root: the trust bundle alone.
        let b = bundle_from_chain(vec![leaf], key_pem, Some(&old.pem)).expect("bundle");
        assert_eq!(ders(&b.roots_pem), ders(&old.pem));
    }

    /// The trust bundle file gains a root (an edit by whoever may write the
    /// ConfigMap): the agent asks the CA again, once, no sooner than the
    /// floor, and serves what the CA said, never the file's extra root. A
    /// root the CA stages does reach the served roots that way.
    #[tokio::test(start_paused = true)]
    async fn the_trust_bundle_file_prompts_a_ca_call_but_never_adds_a_root() {
        let ca = fake_ca(Duration::from_secs(1000));
        let h = ca.handles();
        let chain_root = ca.root.pem.clone();
        *h.trust.lock().expect("lock") = Some(chain_root.clone());
        let (tx, rx) = watch::channel(Some(Arc::<str>::from(chain_root.as_str())));
        let policy = RenewPolicy::default();
        let (out, cancel, dir) = spawn_with_roots(ca, policy.clone(), rx);
        let mut bundles = out.subscribe();
        bundles.wait_for(|b| b.is_some()).await.expect("first");
        let first = out.current().expect("bundle");
        assert_eq!(ders(&first.roots_pem), ders(&chain_root));

        // The attack: the file gains a root of someone else's.
        let attacker = Ca::new("attacker root");
        let poisoned = format!("{chain_root}{}", attacker.pem);
        tx.send_replace(Some(poisoned.as_str().into()));
        let c = calls_within(&h, policy.min_interval * 4, 2).await;
        assert_eq!(c.len(), 2, "one more CA call for the changed file");
        assert!(
            c[1] - c[0] >= policy.min_interval,
            "not sooner than the floor"
        );
        let now = out.current().expect("bundle");
        assert_eq!(
            ders(&now.roots_pem),
            ders(&chain_root),
            "the file's extra root is not served"
        );
        assert!(!now.roots_pem.contains(attacker.pem.trim()));
        let written = super::super::file::load_dir(&dir.path().join("out")).expect("files");
        assert!(!written.roots_pem.contains(attacker.pem.trim()));

        // The CA stages a root: the file's change brings it in, by a CA call.
        let next = Ca::new("staged root");
        let both = format!("{chain_root}{}", next.pem);
        *h.trust.lock().expect("lock") = Some(both.clone());
        tx.send_replace(Some(both.as_str().into()));
        let c = calls_within(&h, policy.min_interval * 2, 3).await;
        assert_eq!(c.len(), 3);
        assert_eq!(ders(&out.current().expect("bundle").roots_pem), ders(&both));
        // The same content again, or the roots served already: no call.
        tx.send_replace(Some(both.as_str().into()));
        let c = calls_within(&h, policy.min_interval * 2, 3).await;
        assert_eq!(c.len(), 3);
        cancel.cancel();
    }

    /// The CA's trust bundle metadata: absent is `None` (an Istio CA);
    /// garbage or too much is the CA's error, named as such.
    #[test]
    fn the_trust_bundle_metadata_is_read_and_checked() {
        use remora_contract::workload_ca::{MAX_TRUST_BUNDLE_BYTES, TRUST_BUNDLE_METADATA};
        use tonic::metadata::{BinaryMetadataValue, MetadataMap};
        let with = |bytes: &[u8]| {
            let mut m = MetadataMap::new();
            m.insert_bin(
                TRUST_BUNDLE_METADATA,
                BinaryMetadataValue::from_bytes(bytes),
            );
            m
        };
        assert_eq!(trust_bundle_of(&MetadataMap::new()).expect("none"), None);
        let root = Ca::new("root").pem;
        assert_eq!(
            trust_bundle_of(&with(root.as_bytes())).expect("good"),
            Some(root.clone())
        );
        let big = root.repeat(MAX_TRUST_BUNDLE_BYTES / root.len() + 1);
        for bad in [&b"not PEM"[..], &[0xff, 0xfe][..], big.as_bytes()] {
            let e = trust_bundle_of(&with(bad)).expect_err("refused");
            assert!(matches!(e, CaError::TrustBundle(..)), "{e}");
            assert!(e.to_string().contains(TRUST_BUNDLE_METADATA), "{e}");
        }
    }

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
        tokio::time::sleep(poll * 3).await;
        assert!(!rx.has_changed().expect("open"), "no change, no send");
        cancel.cancel();
        task.await.expect("join");
    }

    #[tokio::test(start_paused = true)]
    async fn renews_at_half_life() {
        let ca = fake_ca(Duration::from_secs(1000));
        let calls = ca.calls.clone();
        let policy = RenewPolicy {
            jitter: 0.0,
            ..RenewPolicy::default()
        };
        let start = Instant::now();
        let (out, cancel) = spawn(ca, policy);
        let mut rx = out.subscribe();
        rx.wait_for(|b| b.is_some()).await.expect("first");
        let first = out.current().expect("bundle").serial.clone();
        // Auto-advancing paused time jumps straight to the renewal.
        rx.changed().await.expect("renewed");
        let second = out.current().expect("bundle").serial.clone();
        assert_ne!(first, second);
        let c = calls.lock().expect("lock").clone();
        assert_eq!(c.len(), 2);
        let gap = c[1] - start;
        // Wall-clock time moves a little while tokio's is paused; allow for it.
        assert!(
            gap >= Duration::from_secs(495) && gap <= Duration::from_secs(500),
            "{gap:?}"
        );
        cancel.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn failures_back_off_exponentially_and_keep_serving() {
        let ca = fake_ca(Duration::from_secs(1000));
        let calls = ca.calls.clone();
        let fail = ca.fail.clone();
        let policy = RenewPolicy {
            jitter: 0.0,
            backoff_jitter: 0.0,
            ..RenewPolicy::default()
        };
        let (out, cancel) = spawn(ca, policy);
        let mut rx = out.subscribe();
        rx.wait_for(|b| b.is_some()).await.expect("first");
        let good = out.current().expect("bundle");
        *fail.lock().expect("lock") = true;
        // Let the renewal and 5 retries happen.
        while calls.lock().expect("lock").len() < 7 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let c = calls.lock().expect("lock").clone();
        let gaps: Vec<u64> = c
            .windows(2)
            .skip(1)
            .map(|w| (w[1] - w[0]).as_secs())
            .collect();
        assert_eq!(gaps, vec![1, 2, 4, 8, 16], "exponential backoff");
        assert_eq!(out.current(), Some(good), "last good bundle kept");
        assert!(out.status().borrow().is_none(), "readiness does not flap");
        // Recovery: the next retry succeeds and backoff resets.
        *fail.lock().expect("lock") = false;
        rx.changed().await.expect("recovered");
        cancel.cancel();
    }

    /// Checks failure waits: the n-th within [(1 - jitter) * base, base]
    /// with base = min(min_backoff * 2^n, max_backoff), and the jitter seen.
    fn assert_backoff(what: &str, waits: &[Duration], p: &RenewPolicy) {
        // Paused-time sleeps end on the next whole millisecond.
        let tick = Duration::from_millis(1);
        let mut base = p.min_backoff;
        let mut shortened = 0;
        for (i, w) in waits.iter().enumerate() {
            let low = base.mul_f64(1.0 - p.backoff_jitter);
            assert!(
                *w >= low && *w <= base + tick,
                "{what}: wait {i} is {w:?}, not within [{low:?}, {base:?}]: {waits:?}"
            );
            if *w + tick < base {
                shortened += 1;
            }
            base = (base * 2).min(p.max_backoff);
        }
        assert!(
            shortened * 2 >= waits.len(),
            "{what}: jitter shortened only {shortened} of {} waits",
            waits.len()
        );
    }

    /// Certificates already due for renewal when they arrive: back-dated, a
    /// CA clock behind ours, a lifetime of seconds. Over ten minutes of
    /// paused time the CA is called once at start and then once per
    /// `min_interval`, and every answer is published.
    #[tokio::test(start_paused = true)]
    async fn certificates_due_at_receipt_renew_no_sooner_than_the_floor() {
        for (what, window) in [
            ("back-dated by an hour, ten minutes left", (-3600, 600)),
            ("CA clock 40 min behind, 1 h lifetime", (-2400, 1200)),
            ("2 s lifetime", (0, 2)),
        ] {
            let ca = fake_ca(Duration::from_secs(1));
            *ca.window.lock().expect("lock") = window;
            let h = ca.handles();
            let policy = RenewPolicy::default();
            let (out, cancel) = spawn(ca, policy.clone());
            let c = calls_within(&h, Duration::from_secs(600), 25).await;
            cancel.cancel();
            // t = 0, 30, …, 570 and maybe 600 (it ties with the end of the span).
            assert!((20..=21).contains(&c.len()), "{what}: {} calls", c.len());
            for g in gaps(&c) {
                assert!(g >= policy.min_interval, "{what}: {g:?} between CA calls");
            }
            assert_eq!(out.metrics.failures.get(), 0, "{what}");
            assert_eq!(
                out.metrics.updates.get(),
                u64::try_from(c.len()).expect("count"),
                "{what}: each valid answer is served"
            );
        }
    }

    /// A CA that answers with certificates expired at receipt: each is
    /// refused, the retries follow the failure backoff, and the last good
    /// certificate stays in service.
    #[tokio::test(start_paused = true)]
    async fn expired_answers_back_off_and_keep_the_last_good() {
        let ca = fake_ca(Duration::from_secs(1000));
        let h = ca.handles();
        let policy = RenewPolicy::default();
        let (out, cancel) = spawn(ca, policy.clone());
        out.subscribe()
            .wait_for(|b| b.is_some())
            .await
            .expect("first");
        let good = out.current().expect("bundle");
        *h.window.lock().expect("lock") = (-7200, -3600);
        // The renewal (before 500 s), then ten minutes of retries.
        let c = calls_within(&h, Duration::from_secs(1100), 30).await;
        cancel.cancel();
        assert!(c.len() >= 14, "{} calls", c.len());
        assert_backoff("expired answers", &gaps(&c[1..]), &policy);
        assert_eq!(
            out.metrics.failures.get(),
            u64::try_from(c.len() - 1).expect("count")
        );
        assert_eq!(out.current(), Some(good), "last good bundle kept");
        assert!(out.status().borrow().is_none(), "readiness does not flap");
    }

    /// A CA that is down: ten minutes of retries, exponential from 1 s with
    /// jitter, capped at 60 s; nothing to serve and the reason in readiness.
    #[tokio::test(start_paused = true)]
    async fn failures_back_off_with_jitter_up_to_the_cap() {
        let ca = fake_ca(Duration::from_secs(1000));
        *ca.fail.lock().expect("lock") = true;
        let h = ca.handles();
        let policy = RenewPolicy::default();
        let (out, cancel) = spawn(ca, policy.clone());
        let c = calls_within(&h, Duration::from_secs(600), 25).await;
        cancel.cancel();
        let waits = gaps(&c);
        assert_backoff("CA down", &waits, &policy);
        // 1+2+…+32 = 63 s, then at most 60 s apart: the cap is reached and held.
        assert!(waits.len() >= 14, "{waits:?}");
        assert!(
            waits[7..].iter().all(|w| *w > Duration::from_secs(44)),
            "{waits:?}"
        );
        assert!(out.current().is_none());
        assert!(
            out.status()
                .borrow()
                .as_deref()
                .is_some_and(|s| s.contains("Unavailable"))
        );
    }

    #[test]
    fn chain_split_and_output_files() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("rt");
        let ca = fake_ca(Duration::from_secs(1000));
        let (key, csr) = ident().key_and_csr().expect("csr");
        let chain = rt
            .block_on(ca.issue(csr, Duration::from_secs(1)))
            .expect("issue")
            .chain;
        let b = bundle_from_chain(chain, key.serialize_pem(), None).expect("bundle");
        assert_eq!(b.roots_pem.trim(), ca.root.pem.trim());
        assert!(bundle_from_chain(vec![], String::new(), None).is_err());
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = tmp.path().join("out");
        write_output(&dir, &b).expect("write");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join("key.pem"))
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let loaded = super::super::file::load_dir(&dir).expect("reload");
        assert_eq!(loaded, b);
    }
}
