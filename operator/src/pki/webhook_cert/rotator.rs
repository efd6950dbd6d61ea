//! The webhook CA's half of a rotation ([`crate::pki::rotation`]): what
//! its Secret holds beside the roots (the serving certificate), its switch
//! condition (the webhook configuration's caBundle carries the staged
//! root, checked on the API server, not assumed), and every replica's loop
//! ([`Rotator::run`]), which also renews the serving certificate.
//!
//! The serving certificate is issued by the current root at each switch
//! and whenever it is two thirds through its life; the previous root stays
//! in the caBundle `overlap` after the serving certificate's start (every
//! replica has loaded a certificate of the new root by then).

use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rcgen::KeyUsagePurpose;

use super::{
    Bundle, CA_KEY, CA_SIGNING_KEY, CaError, Validity, from_secret, issue_serving, renewal_due_at,
    to_secret, unusable, write_files,
};
use crate::pki::rotation::{
    self, CaPair, Facts, Profile, Roots, SecretKeys, Step, trust_bundle, validity_of,
};

/// The staged CA (step 1) and its key.
pub const NEXT_CA_KEY: &str = "ca-next.crt";
pub const NEXT_CA_SIGNING_KEY: &str = "ca-next.key";
/// The retired CA's root, still trusted during the overlap (step 3).
pub const PREVIOUS_CA_KEY: &str = "ca-previous.crt";

/// Where the Secret keeps the roots.
const KEYS: SecretKeys = SecretKeys {
    cert: CA_KEY,
    key: CA_SIGNING_KEY,
    next_cert: NEXT_CA_KEY,
    next_key: NEXT_CA_SIGNING_KEY,
    previous: PREVIOUS_CA_KEY,
};

/// The webhook CA's roots.
const PROFILE: Profile = Profile {
    name: "remora-operator-ca",
    organization: None,
    path_len: Some(0),
    key_usages: &[KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign],
};

/// A new CA valid for `validity` from `now`.
pub fn new_ca(validity: Duration, now: SystemTime) -> Result<CaPair, CaError> {
    Ok(rotation::new_root(&PROFILE, validity, now)?)
}

/// Everything the Secret holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The current root (its key empty in Secrets made before it was
    /// kept), the staged and the previous one.
    pub roots: Roots,
    /// The serving certificate the current root signed, and its key.
    pub cert_pem: String,
    pub key_pem: String,
}

impl Stored {
    pub fn new(current: Bundle) -> Self {
        Self {
            roots: Roots::new(CaPair {
                cert_pem: current.ca_pem,
                key_pem: current.ca_key_pem,
            }),
            cert_pem: current.cert_pem,
            key_pem: current.key_pem,
        }
    }

    /// The CA and serving certificate in use.
    pub fn current(&self) -> Bundle {
        Bundle {
            ca_pem: self.roots.current.cert_pem.clone(),
            cert_pem: self.cert_pem.clone(),
            key_pem: self.key_pem.clone(),
            ca_key_pem: self.roots.current.key_pem.clone(),
        }
    }

    /// What the planner needs beside the roots. `published`: every webhook
    /// of the configuration trusts the staged root (seen now, so `settle`
    /// counts from the stage).
    fn facts(&self, published: bool) -> Facts {
        let start = |pem: &str| validity_of(pem).map(|(start, _)| start);
        let staged_at = self.roots.next.as_ref().and_then(|n| start(&n.cert_pem));
        Facts {
            staged_at,
            // The serving certificate's start is the switch (or later: a
            // renewal only keeps the old root longer, never beyond its end).
            switched_at: start(&self.cert_pem),
            // Without its key the CA cannot sign (a Secret from before
            // ca.key was kept): rotate to one that can.
            rotate: self.roots.current.key_pem.is_empty(),
            trusted_since: staged_at.filter(|_| published),
        }
    }
}

/// Read everything from the Secret; the current bundle must be there, the
/// extras are optional (checked by [`plan`], not here).
pub fn stored_from_secret(s: &Secret) -> Result<Stored, CaError> {
    let current = from_secret(s)?;
    Ok(Stored {
        roots: Roots {
            current: CaPair {
                cert_pem: current.ca_pem,
                key_pem: current.ca_key_pem,
            },
            ..KEYS.read(s.data.as_ref())
        },
        cert_pem: current.cert_pem,
        key_pem: current.key_pem,
    })
}

/// The Secret holding `s`.
pub fn stored_to_secret(name: &str, namespace: &str, s: &Stored) -> Secret {
    let mut secret = to_secret(name, namespace, &s.current());
    KEYS.write(&s.roots, secret.data.get_or_insert_with(Default::default));
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

impl Policy {
    fn roots(&self) -> rotation::Policy {
        rotation::Policy {
            validity: self.validity.ca,
            settle: self.settle,
            overlap: self.overlap,
        }
    }
}

/// One write to the Secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// A step of the root's rotation (a new or switched root comes with a
    /// serving certificate it signed).
    Root(Step),
    /// A new serving certificate from the current CA.
    Renew,
}

/// What [`plan`] decides: at most one write now (and why), and when to look
/// again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub action: Option<Action>,
    pub why: String,
    pub wake: SystemTime,
}

/// What to do with the Secret's contents `s` at `now`. `published`: every
/// webhook of the configuration trusts the staged CA (only asked for when
/// one is staged).
pub fn plan(s: &Stored, published: bool, now: SystemTime, p: &Policy) -> Plan {
    let act = |action: Action, why: String| Plan {
        action: Some(action),
        why,
        wake: now,
    };
    if let Some(why) = unusable(&s.current(), now) {
        return act(Action::Root(Step::Create), why);
    }
    let roots = rotation::plan(Some(&s.roots), &s.facts(published), &p.roots(), now);
    if let Some(step) = roots.step {
        return act(Action::Root(step), roots.why);
    }
    let mut wake = roots.wake;
    if !s.roots.current.key_pem.is_empty()
        && let Some(due) = renewal_due_at(&s.cert_pem)
    {
        if now >= due {
            return act(Action::Renew, "the serving certificate is due".into());
        }
        wake = Some(wake.map_or(due, |w| w.min(due)));
    }
    Plan {
        action: None,
        why: String::new(),
        wake: wake.unwrap_or(now),
    }
}

/// `s` after `a` at `now` (new keys are random, the rest follows `plan`).
pub fn apply(
    s: &Stored,
    a: Action,
    names: &[String],
    p: &Policy,
    now: SystemTime,
) -> Result<Stored, CaError> {
    let roots = match a {
        Action::Root(step) => rotation::apply(Some(&s.roots), step, &PROFILE, &p.roots(), now)?,
        Action::Renew => s.roots.clone(),
    };
    let issue = a == Action::Renew || roots.current != s.roots.current;
    let (cert_pem, key_pem) = match issue {
        true => issue_serving(
            &roots.current.cert_pem,
            &roots.current.key_pem,
            names,
            p.validity,
            now,
        )?,
        false => (s.cert_pem.clone(), s.key_pem.clone()),
    };
    Ok(Stored {
        roots,
        cert_pem,
        key_pem,
    })
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
        Ok(rotation::write_secret(&self.secrets, &self.secret, &s).await?)
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

/// The rotation's metrics, in the operator's registry.
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
        let create = |why: String| Plan {
            action: Some(Action::Root(Step::Create)),
            why,
            wake: now,
        };
        let (stored, plan) = match read {
            Some(Ok(stored)) => {
                let published = match &stored.roots.next {
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
            Some(Err(e)) => (None, create(e.to_string())),
            None => (None, create("no Secret".into())),
        };
        let Some(action) = plan.action else {
            return stored
                .map(|s| (s, plan.wake))
                .ok_or_else(|| CaError::Incomplete(self.secret.clone(), CA_KEY));
        };
        let base = stored
            .clone()
            .unwrap_or_else(|| Stored::new(Bundle::default()));
        let next = apply(&base, action, &self.names, &self.policy, now)?;
        let mut want = stored_to_secret(&self.secret, &self.namespace, &next);
        want.metadata.resource_version = rv;
        if !self.store.write(want).await? {
            // Another replica wrote first: adopt its write at the next look.
            return match stored.filter(|s| unusable(&s.current(), now).is_none()) {
                Some(s) => Ok((s, now)),
                None => Err(CaError::Contended(
                    self.secret.clone(),
                    "lost a write race".into(),
                )),
            };
        }
        let why = &plan.why;
        match action {
            Action::Root(Step::Create) => {
                tracing::warn!(secret = %self.secret, reason = %why, "self-managed CA and serving certificate replaced");
                let note =
                    format!("unusable ({why}): replaced with a new CA and serving certificate");
                self.store.record(true, "CertificateRepaired", note).await;
            }
            Action::Root(Step::Switch) => {
                self.metrics.ca_rotations.inc();
                tracing::info!(secret = %self.secret, "switched to the new CA; the old root stays trusted for the overlap");
                let note =
                    "switched to the new CA; the old root stays in the caBundle for the overlap";
                self.store.record(false, "CARotated", note.into()).await;
            }
            a => {
                tracing::info!(secret = %self.secret, action = ?a, reason = %why, "self-managed CA updated");
            }
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
        let bundle = trust_bundle(&stored.roots, now);
        bundle_tx.send_if_modified(|b| {
            let changed = *b != bundle;
            if changed {
                b.clone_from(&bundle);
            }
            changed
        });
        if stored.cert_pem != serving.cert_pem || stored.key_pem != serving.key_pem {
            let new = stored.current();
            match write_files(&self.dir, &new) {
                Ok(_) => {
                    tracing::info!(secret = %self.secret, "serving certificate updated from the Secret");
                    *serving = new;
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
