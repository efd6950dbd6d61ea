//! Rotation of the self-managed CA and its serving certificate, decided by a
//! pure function of what the shared Secret holds and the time ([`plan`]),
//! carried out by every replica ([`Rotator::run`]) with writes conditional
//! on the Secret's resourceVersion.
//!
//! A CA rotation takes three writes, so that no serving certificate is ever
//! presented to an API server that does not trust its issuer:
//! 1. stage: at two thirds of the CA's life a new CA is stored next to the
//!    current one (`ca-next.crt`/`ca-next.key`); the caBundle becomes
//!    old + new while the serving certificate stays signed by the old CA;
//! 2. switch: once the webhook configuration carries the new root (checked
//!    on the API server, not assumed) and `settle` has passed, the new CA
//!    becomes current and signs a new serving certificate; the old root
//!    moves to `ca-previous.crt` and stays in the caBundle;
//! 3. retire: the old root leaves once it expires or `overlap` after the
//!    switch (every replica has loaded a certificate of the new CA by then).

use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::PostParams;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};

use super::{
    Bundle, CA_KEY, CaError, Validity, from_secret, issue_serving, renewal_due_at, to_secret,
    unusable, validity_of, write_files,
};

/// The staged CA (step 1) and its key.
pub const NEXT_CA_KEY: &str = "ca-next.crt";
pub const NEXT_CA_SIGNING_KEY: &str = "ca-next.key";
/// The retired CA's root, still trusted during the overlap (step 3).
pub const PREVIOUS_CA_KEY: &str = "ca-previous.crt";

/// A CA certificate and its private key (PEM).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaPair {
    pub cert_pem: String,
    pub key_pem: String,
}

/// Everything the Secret holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The CA that signed the serving certificate, and that certificate.
    pub current: Bundle,
    pub next: Option<CaPair>,
    pub previous: Option<String>,
}

impl Stored {
    pub fn new(current: Bundle) -> Self {
        Self {
            current,
            next: None,
            previous: None,
        }
    }
}

/// Read everything from the Secret; the current bundle must be there, the
/// extras are optional (checked by [`plan`], not here).
pub fn stored_from_secret(s: &Secret) -> Result<Stored, CaError> {
    let current = from_secret(s)?;
    let get = |key: &str| {
        s.data
            .as_ref()
            .and_then(|d| d.get(key))
            .map(|b| String::from_utf8_lossy(&b.0).into_owned())
            .filter(|t| !t.is_empty())
    };
    let next = match (get(NEXT_CA_KEY), get(NEXT_CA_SIGNING_KEY)) {
        (Some(cert_pem), Some(key_pem)) => Some(CaPair { cert_pem, key_pem }),
        // Half a staged CA is no CA: plan() stages a whole one when due.
        _ => None,
    };
    Ok(Stored {
        current,
        next,
        previous: get(PREVIOUS_CA_KEY),
    })
}

/// The Secret holding `s`.
pub fn stored_to_secret(name: &str, namespace: &str, s: &Stored) -> Secret {
    let mut secret = to_secret(name, namespace, &s.current);
    let data = secret.data.get_or_insert_with(Default::default);
    let mut put = |k: &str, v: &str| {
        data.insert(k.to_string(), ByteString(v.as_bytes().to_vec()));
    };
    if let Some(n) = &s.next {
        put(NEXT_CA_KEY, &n.cert_pem);
        put(NEXT_CA_SIGNING_KEY, &n.key_pem);
    }
    if let Some(p) = &s.previous {
        put(PREVIOUS_CA_KEY, p);
    }
    secret
}

/// The timings of a rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub validity: Validity,
    /// How long the retired root stays trusted after the switch: every
    /// replica must have loaded a certificate of the new CA within it.
    pub overlap: Duration,
    /// How long a staged CA waits, once published, before it signs: the
    /// API servers' view of the webhook configuration may lag.
    pub settle: Duration,
}

/// One write to the Secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The current bundle cannot be served: a new CA and certificate.
    Regenerate(String),
    /// Drop the previous root (its overlap is over, or it is unusable) and
    /// a staged CA that is unusable.
    Retire(String),
    /// Store a new CA next to the current one (step 1).
    Stage,
    /// The staged CA becomes current (step 2).
    Switch,
    /// A new serving certificate from the current CA.
    Renew,
}

/// What [`plan`] decides: at most one write now, and when to look again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub action: Option<Action>,
    pub wake: SystemTime,
}

/// Two thirds into `pem`'s validity (the renewal point of certificates and
/// CAs alike).
fn two_thirds(pem: &str) -> Option<SystemTime> {
    renewal_due_at(pem)
}

/// Why `pair` cannot act as a CA at `now`, if it cannot.
fn ca_unusable(pair: &CaPair, now: SystemTime) -> Option<String> {
    let check = || -> Result<(), String> {
        let (start, end) = validity_of(&pair.cert_pem).ok_or("not a PEM X.509 certificate")?;
        if now < start || now >= end {
            return Err("not valid now".into());
        }
        let key = KeyPair::from_pem(&pair.key_pem).map_err(|e| format!("key: {e}"))?;
        if public_key_of(&pair.cert_pem).as_deref() != Some(key.public_key_raw()) {
            return Err("the key is not the certificate's".into());
        }
        Ok(())
    };
    check().err()
}

fn public_key_of(pem: &str) -> Option<Vec<u8>> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    use x509_parser::prelude::{FromDer, X509Certificate};
    let der = CertificateDer::from_pem_slice(pem.as_bytes()).ok()?;
    let (_, c) = X509Certificate::from_der(&der).ok()?;
    Some(c.public_key().subject_public_key.data.to_vec())
}

/// A root worth trusting at `now`: parses and is within its validity.
fn root_valid(pem: &str, now: SystemTime) -> bool {
    validity_of(pem).is_some_and(|(start, end)| start <= now && now < end)
}

/// What to do with the Secret's contents `s` at `now`. `published`: every
/// webhook of the configuration trusts the staged CA (only asked for when
/// one is staged). Pure, so that every step is unit-tested.
pub fn plan(s: &Stored, published: bool, now: SystemTime, p: &Policy) -> Plan {
    let act = |a: Action| Plan {
        action: Some(a),
        wake: now,
    };
    if let Some(why) = unusable(&s.current, now) {
        return act(Action::Regenerate(why));
    }
    if let Some(n) = &s.next
        && let Some(why) = ca_unusable(n, now)
    {
        return act(Action::Retire(format!("staged CA: {why}")));
    }
    let serving_start = validity_of(&s.current.cert_pem).map_or(now, |(start, _)| start);
    let mut wake: Vec<SystemTime> = Vec::new();
    if let Some(prev) = &s.previous {
        let Some((_, prev_end)) = validity_of(prev).filter(|_| root_valid(prev, now)) else {
            return act(Action::Retire("previous CA expired or unreadable".into()));
        };
        // The serving certificate's start is the switch (or later: a
        // renewal only keeps the old root longer, never beyond its end).
        let retire_at = prev_end.min(serving_start.checked_add(p.overlap).unwrap_or(prev_end));
        if now >= retire_at {
            return act(Action::Retire("overlap over".into()));
        }
        wake.push(retire_at);
    }
    if let Some(n) = &s.next {
        let staged = validity_of(&n.cert_pem).map_or(now, |(start, _)| start);
        let switch_at = staged.checked_add(p.settle).unwrap_or(staged);
        // One previous root at a time: the switch waits for a retirement
        // (only reached with a hand-made Secret).
        if s.previous.is_none() && published && now >= switch_at {
            return act(Action::Switch);
        }
        // Unpublished: the caller looks again within its period.
        wake.push(switch_at.max(now));
    } else if s.previous.is_none() {
        // Without its key the CA cannot sign (a Secret from before ca.key
        // was kept): rotate to one that can.
        let ca_due = if s.current.ca_key_pem.is_empty() {
            Some(now)
        } else {
            two_thirds(&s.current.ca_pem)
        };
        match ca_due {
            Some(due) if now >= due => return act(Action::Stage),
            Some(due) => wake.push(due),
            None => {}
        }
    }
    if !s.current.ca_key_pem.is_empty()
        && let Some(due) = two_thirds(&s.current.cert_pem)
    {
        if now >= due {
            return act(Action::Renew);
        }
        wake.push(due);
    }
    Plan {
        action: None,
        wake: wake.into_iter().min().unwrap_or(now),
    }
}

/// A new CA valid for `validity` from `now` (certificate, key).
pub fn new_ca(validity: Duration, now: SystemTime) -> Result<CaPair, CaError> {
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.not_before = now.into();
    ca.not_after = now.checked_add(validity).unwrap_or(now).into();
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    // Distinct names: old and new roots sit side by side in the caBundle.
    let serial = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    ca.distinguished_name
        .push(DnType::CommonName, format!("remora-operator-ca-{serial}"));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let key = KeyPair::generate()?;
    let cert = ca.self_signed(&key)?;
    Ok(CaPair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// `s` after `a` at `now` (new keys are random, the rest follows `plan`).
pub fn apply(
    s: &Stored,
    a: &Action,
    names: &[String],
    p: &Policy,
    now: SystemTime,
) -> Result<Stored, CaError> {
    let v = p.validity;
    Ok(match a {
        Action::Regenerate(_) => {
            let ca = new_ca(v.ca, now)?;
            let (cert_pem, key_pem) = issue_serving(&ca.cert_pem, &ca.key_pem, names, v, now)?;
            // A still valid root keeps being trusted for the overlap: a
            // replica may be serving a certificate it signed.
            let previous = Some(s.current.ca_pem.clone()).filter(|c| root_valid(c, now));
            Stored {
                current: Bundle {
                    ca_pem: ca.cert_pem,
                    cert_pem,
                    key_pem,
                    ca_key_pem: ca.key_pem,
                },
                next: None,
                previous,
            }
        }
        Action::Retire(_) => {
            // plan() retires a bad staged CA first, on its own; the
            // previous root only when no staged CA was dropped.
            let next = s.next.clone().filter(|n| ca_unusable(n, now).is_none());
            let dropped_next = s.next.is_some() && next.is_none();
            Stored {
                current: s.current.clone(),
                previous: s.previous.clone().filter(|_| dropped_next),
                next,
            }
        }
        Action::Stage => Stored {
            next: Some(new_ca(v.ca, now)?),
            ..s.clone()
        },
        Action::Switch => {
            let Some(next) = &s.next else {
                return Ok(s.clone());
            };
            let (cert_pem, key_pem) = issue_serving(&next.cert_pem, &next.key_pem, names, v, now)?;
            Stored {
                current: Bundle {
                    ca_pem: next.cert_pem.clone(),
                    cert_pem,
                    key_pem,
                    ca_key_pem: next.key_pem.clone(),
                },
                next: None,
                previous: Some(s.current.ca_pem.clone()),
            }
        }
        Action::Renew => {
            let (cert_pem, key_pem) =
                issue_serving(&s.current.ca_pem, &s.current.ca_key_pem, names, v, now)?;
            Stored {
                current: Bundle {
                    cert_pem,
                    key_pem,
                    ..s.current.clone()
                },
                ..s.clone()
            }
        }
    })
}

/// The caBundle `s` wants: the previous root, the current one, the staged
/// one (oldest first, so that a switch leaves the text unchanged), each
/// only while valid at `now`.
pub fn trust_bundle(s: &Stored, now: SystemTime) -> String {
    let mut out = String::new();
    let roots = [
        s.previous.as_deref(),
        Some(s.current.ca_pem.as_str()),
        s.next.as_ref().map(|n| n.cert_pem.as_str()),
    ];
    for root in roots.into_iter().flatten() {
        if root_valid(root, now) || root == s.current.ca_pem {
            out.push_str(root.trim_end());
            out.push('\n');
        }
    }
    out
}

/// Whether the PEM `bundle` holds the certificate `root_pem`.
pub fn bundle_has_root(bundle: &[u8], root_pem: &str) -> bool {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let Ok(root) = CertificateDer::from_pem_slice(root_pem.as_bytes()) else {
        return false;
    };
    CertificateDer::pem_slice_iter(bundle)
        .filter_map(Result::ok)
        .any(|c| c == root)
}

/// The replicas' shared state: the Secret and the webhook configuration.
/// The API in production ([`KubeStore`]), in memory in the tests.
pub trait Store: Send + Sync {
    fn get(&self) -> impl Future<Output = Result<Option<Secret>, CaError>> + Send;
    /// Create (no resourceVersion) or replace (conditional on it);
    /// `Ok(false)` when another replica wrote first.
    fn write(&self, s: Secret) -> impl Future<Output = Result<bool, CaError>> + Send;
    /// The caBundle of every webhook of the configuration.
    fn published(&self) -> impl Future<Output = Result<Vec<Vec<u8>>, CaError>> + Send;
    /// Tell the cluster what happened to the Secret (an Event on it); a
    /// failure is logged, never fatal.
    fn record(&self, warning: bool, reason: &str, note: String) -> impl Future<Output = ()> + Send;
}

/// [`Store`] on the Kubernetes API.
#[derive(Clone)]
pub struct KubeStore {
    pub secrets: Api<Secret>,
    pub secret: String,
    pub webhook_configs: Api<MutatingWebhookConfiguration>,
    pub webhook_config: String,
    /// Events on the Secret; `None`: logs only.
    pub recorder: Option<kube::runtime::events::Recorder>,
}

impl Store for KubeStore {
    async fn get(&self) -> Result<Option<Secret>, CaError> {
        Ok(self.secrets.get_opt(&self.secret).await?)
    }

    async fn write(&self, s: Secret) -> Result<bool, CaError> {
        let written = if s.metadata.resource_version.is_some() {
            self.secrets
                .replace(&self.secret, &PostParams::default(), &s)
                .await
        } else {
            self.secrets.create(&PostParams::default(), &s).await
        };
        match written {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    async fn published(&self) -> Result<Vec<Vec<u8>>, CaError> {
        let mwc = self.webhook_configs.get_opt(&self.webhook_config).await?;
        Ok(mwc
            .and_then(|m| m.webhooks)
            .unwrap_or_default()
            .into_iter()
            .map(|w| w.client_config.ca_bundle.map(|b| b.0).unwrap_or_default())
            .collect())
    }

    async fn record(&self, warning: bool, reason: &str, note: String) {
        use kube::runtime::events::{Event, EventType};
        let Some(recorder) = &self.recorder else {
            return;
        };
        let event = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.into(),
            note: Some(note),
            action: "Certificate".into(),
            secondary: None,
        };
        let regarding = k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Secret".into()),
            name: Some(self.secret.clone()),
            namespace: self.secrets.namespace().map(str::to_string),
            ..Default::default()
        };
        if let Err(e) = recorder.publish(&event, &regarding).await {
            tracing::warn!(error = %e, secret = %self.secret, "cannot record the event");
        }
    }
}

/// Where "now" comes from: the wall clock, or tokio's (paused) clock from
/// an anchor, so that rotation loops run on paused time in the tests.
#[derive(Debug, Clone, Copy)]
pub enum Clock {
    System,
    Tokio {
        anchor: SystemTime,
        at: tokio::time::Instant,
    },
}

impl Clock {
    pub fn tokio(anchor: SystemTime) -> Self {
        Self::Tokio {
            anchor,
            at: tokio::time::Instant::now(),
        }
    }

    pub fn now(&self) -> SystemTime {
        match self {
            Self::System => SystemTime::now(),
            Self::Tokio { anchor, at } => anchor.checked_add(at.elapsed()).unwrap_or(*anchor),
        }
    }
}

/// The rotation's metrics, in the injector's registry.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// Unix time at which the loaded serving certificate ends.
    pub serving_cert_expiry: Gauge,
    /// CA switches this replica wrote.
    pub ca_rotations: Counter,
}

impl Metrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "serving_cert_expiry_seconds",
            "Unix time at which the serving certificate in use ends",
            self.serving_cert_expiry.clone(),
        );
        registry.register(
            "ca_rotations",
            "Switches to a new self-managed CA written by this replica",
            self.ca_rotations.clone(),
        );
    }
}

/// The shortest pause between two looks at the Secret (no hot loop, even
/// when a write keeps losing or the clock jumps).
pub const MIN_STEP: Duration = Duration::from_secs(1);

/// One replica's rotation loop.
pub struct Rotator<S> {
    pub store: S,
    pub secret: String,
    pub namespace: String,
    /// The serving certificate's DNS names.
    pub names: Vec<String>,
    pub policy: Policy,
    /// Where the serving pair is written for the reloader.
    pub dir: PathBuf,
    /// Longest time between two reads of the Secret.
    pub period: Duration,
    pub clock: Clock,
    pub metrics: Metrics,
}

impl<S: Store> Rotator<S> {
    /// Every replica runs this forever: read the Secret, make the one write
    /// [`plan`] asks for (conditional; a loser re-reads and adopts), serve
    /// what the Secret holds, and publish its trust bundle to `bundle_tx`
    /// (the caBundle keeper).
    pub async fn run(self, mut serving: Bundle, bundle_tx: tokio::sync::watch::Sender<String>) {
        let mut backoff = MIN_STEP;
        loop {
            let now = self.clock.now();
            let wait = match self.step(now).await {
                Ok((stored, wake)) => {
                    backoff = MIN_STEP;
                    self.adopt(&mut serving, &stored, &bundle_tx, now);
                    wake.duration_since(now).unwrap_or_default()
                }
                Err(e) => {
                    tracing::warn!(error = %e, secret = %self.secret, retry_in = ?backoff,
                        "cannot keep the self-managed certificate; serving the current one");
                    let b = backoff;
                    backoff = backoff.saturating_mul(2).min(self.period.max(MIN_STEP));
                    b
                }
            };
            tokio::time::sleep(wait.clamp(MIN_STEP, self.period.max(MIN_STEP))).await;
        }
    }

    /// Read, decide, write at most once: what the Secret holds afterwards
    /// (servable) and when to look again.
    pub async fn step(&self, now: SystemTime) -> Result<(Stored, SystemTime), CaError> {
        let secret = self.store.get().await?;
        let rv = secret
            .as_ref()
            .and_then(|s| s.metadata.resource_version.clone());
        let read = secret.as_ref().map(stored_from_secret);
        let (stored, plan) = match read {
            Some(Ok(stored)) => {
                let published = match &stored.next {
                    Some(n) => {
                        let bundles = self.store.published().await?;
                        !bundles.is_empty()
                            && bundles.iter().all(|b| bundle_has_root(b, &n.cert_pem))
                    }
                    None => false,
                };
                let plan = plan(&stored, published, now, &self.policy);
                (Some(stored), plan)
            }
            Some(Err(e)) => (
                None,
                Plan {
                    action: Some(Action::Regenerate(e.to_string())),
                    wake: now,
                },
            ),
            None => (
                None,
                Plan {
                    action: Some(Action::Regenerate("no Secret".into())),
                    wake: now,
                },
            ),
        };
        let Some(action) = plan.action else {
            return stored
                .map(|s| (s, plan.wake))
                .ok_or_else(|| CaError::Incomplete(self.secret.clone(), CA_KEY));
        };
        let base = stored.clone().unwrap_or_else(|| {
            Stored::new(Bundle {
                ca_pem: String::new(),
                cert_pem: String::new(),
                key_pem: String::new(),
                ca_key_pem: String::new(),
            })
        });
        let next = apply(&base, &action, &self.names, &self.policy, now)?;
        let mut want = stored_to_secret(&self.secret, &self.namespace, &next);
        want.metadata.resource_version = rv;
        if !self.store.write(want).await? {
            // Another replica wrote first: adopt its write at the next look.
            return match stored.filter(|s| unusable(&s.current, now).is_none()) {
                Some(s) => Ok((s, now)),
                None => Err(CaError::Contended(
                    self.secret.clone(),
                    "lost a write race".into(),
                )),
            };
        }
        match &action {
            Action::Regenerate(why) => {
                tracing::warn!(secret = %self.secret, reason = %why, "self-managed CA and serving certificate replaced");
                let note =
                    format!("unusable ({why}): replaced with a new CA and serving certificate");
                self.store.record(true, "CertificateRepaired", note).await;
            }
            Action::Switch => {
                self.metrics.ca_rotations.inc();
                tracing::info!(secret = %self.secret, "switched to the new CA; the old root stays trusted for the overlap");
                let note =
                    "switched to the new CA; the old root stays in the caBundle for the overlap";
                self.store.record(false, "CARotated", note.into()).await;
            }
            a => tracing::info!(secret = %self.secret, action = ?a, "self-managed CA updated"),
        }
        Ok((next, now))
    }

    fn adopt(
        &self,
        serving: &mut Bundle,
        stored: &Stored,
        bundle_tx: &tokio::sync::watch::Sender<String>,
        now: SystemTime,
    ) {
        // The caBundle first: a certificate of a new CA is only served once
        // the Secret says it is trusted, which the keeper then re-asserts.
        let bundle = trust_bundle(stored, now);
        bundle_tx.send_if_modified(|b| {
            let changed = *b != bundle;
            if changed {
                b.clone_from(&bundle);
            }
            changed
        });
        let new = &stored.current;
        if new.cert_pem != serving.cert_pem || new.key_pem != serving.key_pem {
            match write_files(&self.dir, new) {
                Ok(_) => {
                    tracing::info!(secret = %self.secret, "serving certificate updated from the Secret");
                    *serving = new.clone();
                }
                Err(e) => tracing::warn!(error = %e, "cannot write the serving certificate"),
            }
        }
        if let Some((_, end)) = validity_of(&serving.cert_pem) {
            let secs = end
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
            self.metrics.serving_cert_expiry.set(secs);
        }
    }
}

#[cfg(test)]
mod tests;
