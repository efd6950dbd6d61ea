//! The operator's self-managed serving certificate: a CA and a serving
//! certificate made with rcgen, kept in a Secret that every replica shares
//! (the first to start creates it; the others read it), and the CA patched
//! into the MutatingWebhookConfiguration's `caBundle`. With cert-manager the
//! chart mounts the certificate instead and none of this runs.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair, KeyUsagePurpose};
use serde_json::{Value, json};

mod rotator;
pub use rotator::{
    Action, Clock, KubeStore, MIN_STEP, Metrics, NEXT_CA_KEY, NEXT_CA_SIGNING_KEY, PREVIOUS_CA_KEY,
    Plan, Policy, Rotator, Store, Stored, apply, bundle_has_root, new_ca, plan, stored_from_secret,
    stored_to_secret,
};

use crate::pki::rotation::{trust_bundle, two_thirds, validity_of};

pub const CA_KEY: &str = "ca.crt";
pub const CERT_KEY: &str = "tls.crt";
pub const KEY_KEY: &str = "tls.key";
/// The CA's private key, so that any replica can issue the next serving
/// certificate. Absent from Secrets made before it was kept.
pub const CA_SIGNING_KEY: &str = "ca.key";

/// Lifetimes of what the self-managed CA makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    pub ca: Duration,
    pub serving: Duration,
}

impl Default for Validity {
    fn default() -> Self {
        Self {
            ca: Duration::from_secs(365 * 24 * 3600),
            serving: Duration::from_secs(90 * 24 * 3600),
        }
    }
}

/// The shortest serving lifetime accepted: renewal runs at two thirds of it
/// and every replica must see the new one before the old one ends.
pub const MIN_SERVING_VALIDITY: Duration = Duration::from_secs(30);
/// The longest lifetime accepted (so `now + validity` cannot overflow).
pub const MAX_VALIDITY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

impl Validity {
    pub fn validate(&self) -> Result<(), String> {
        if self.serving < MIN_SERVING_VALIDITY {
            return Err(format!(
                "the serving certificate's validity must be at least {MIN_SERVING_VALIDITY:?}"
            ));
        }
        if self.ca > MAX_VALIDITY || self.serving > MAX_VALIDITY {
            return Err(format!("validities must be at most {MAX_VALIDITY:?}"));
        }
        if self.ca < self.serving {
            return Err("the CA must be valid at least as long as the serving certificate".into());
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("certificate generation: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("Secret {0} lacks {1}")]
    Incomplete(String, &'static str),
    #[error("Secret {0}: still unusable after {WRITE_ATTEMPTS} attempts to replace it ({1})")]
    Contended(String, String),
    #[error("{0}")]
    Validity(String),
    #[error("Kubernetes API: {0}")]
    Api(#[from] kube::Error),
    #[error("{path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A CA and a serving certificate it signed (all PEM).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bundle {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
    /// Empty when the Secret predates stored CA keys (no renewal then).
    pub ca_key_pem: String,
}

/// The DNS names the API server uses to reach `service` in `namespace`.
pub fn service_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        service.to_string(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// Make a fresh CA and a serving certificate for `names`, with the default
/// lifetimes.
pub fn generate(names: &[String]) -> Result<Bundle, CaError> {
    generate_with(names, Validity::default(), SystemTime::now())
}

/// Make a fresh CA valid for `v.ca` from `now`, and a serving certificate.
pub fn generate_with(names: &[String], v: Validity, now: SystemTime) -> Result<Bundle, CaError> {
    let ca = new_ca(v.ca, now)?;
    let (cert_pem, key_pem) = issue_serving(&ca.cert_pem, &ca.key_pem, names, v, now)?;
    Ok(Bundle {
        ca_pem: ca.cert_pem,
        cert_pem,
        key_pem,
        ca_key_pem: ca.key_pem,
    })
}

/// A new serving certificate from the CA, valid for `v.serving` from `now`
/// but never beyond the CA: (certificate, key) in PEM.
pub fn issue_serving(
    ca_pem: &str,
    ca_key_pem: &str,
    names: &[String],
    v: Validity,
    now: SystemTime,
) -> Result<(String, String), CaError> {
    let ca_key = KeyPair::from_pem(ca_key_pem)?;
    let issuer = Issuer::from_ca_cert_pem(ca_pem, ca_key)?;
    let ca_end = ca_not_after(ca_pem).unwrap_or(now);
    let mut leaf = CertificateParams::new(names.to_vec())?;
    leaf.not_before = now.into();
    leaf.not_after = now.checked_add(v.serving).unwrap_or(now).min(ca_end).into();
    if let Some(first) = names.first() {
        leaf.distinguished_name
            .push(DnType::CommonName, first.clone());
    }
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let leaf_key = KeyPair::generate()?;
    let leaf_cert = leaf.signed_by(&leaf_key, &issuer)?;
    Ok((leaf_cert.pem(), leaf_key.serialize_pem()))
}

fn ca_not_after(ca_pem: &str) -> Option<SystemTime> {
    validity_of(ca_pem).map(|(_, end)| end)
}

/// When the serving certificate in `pem` is due for renewal: at two thirds
/// of its lifetime (a third is left for every replica to pick the new one
/// up, and for retries). `None` when unreadable.
pub fn renewal_due_at(pem: &str) -> Option<SystemTime> {
    validity_of(pem).map(|(start, end)| two_thirds(start, end))
}

/// The Secret holding a bundle.
pub fn to_secret(name: &str, namespace: &str, b: &Bundle) -> Secret {
    let bytes = |s: &str| ByteString(s.as_bytes().to_vec());
    Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            labels: Some(
                [(
                    "app.kubernetes.io/managed-by".to_string(),
                    "remora-operator".to_string(),
                )]
                .into(),
            ),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(
            [
                (CA_KEY.to_string(), bytes(&b.ca_pem)),
                (CERT_KEY.to_string(), bytes(&b.cert_pem)),
                (KEY_KEY.to_string(), bytes(&b.key_pem)),
                (CA_SIGNING_KEY.to_string(), bytes(&b.ca_key_pem)),
            ]
            .into_iter()
            .filter(|(_, v)| !v.0.is_empty())
            .collect(),
        ),
        ..Default::default()
    }
}

/// Read a bundle back from its Secret.
pub fn from_secret(s: &Secret) -> Result<Bundle, CaError> {
    let name = s.metadata.name.clone().unwrap_or_default();
    let get = |key: &'static str| {
        s.data
            .as_ref()
            .and_then(|d| d.get(key))
            .map(|b| String::from_utf8_lossy(&b.0).into_owned())
            .ok_or_else(|| CaError::Incomplete(name.clone(), key))
    };
    Ok(Bundle {
        ca_pem: get(CA_KEY)?,
        cert_pem: get(CERT_KEY)?,
        key_pem: get(KEY_KEY)?,
        ca_key_pem: get(CA_SIGNING_KEY).unwrap_or_default(),
    })
}

/// A JSON Patch setting `caBundle` on every webhook of the configuration
/// whose value differs; empty when all are current.
pub fn ca_bundle_patch(mwc: &MutatingWebhookConfiguration, ca_pem: &str) -> Vec<Value> {
    let want = ByteString(ca_pem.as_bytes().to_vec());
    mwc.webhooks
        .iter()
        .flatten()
        .enumerate()
        .filter(|(_, w)| w.client_config.ca_bundle.as_ref() != Some(&want))
        .map(|(i, _)| {
            json!({"op": "add", "path": format!("/webhooks/{i}/clientConfig/caBundle"), "value": want})
        })
        .collect()
}

/// Where the bootstrap writes the serving pair for [`crate::webhook::tls::ReloadingCert`].
pub fn write_files(dir: &Path, b: &Bundle) -> Result<(PathBuf, PathBuf), CaError> {
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|source| CaError::Write {
                path: path.clone(),
                source,
            })?;
        Ok::<_, CaError>(path)
    };
    std::fs::create_dir_all(dir).map_err(|source| CaError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    // Key first: the reloader only swaps once both files parse as a pair.
    let key = write(KEY_KEY, &b.key_pem)?;
    let cert = write(CERT_KEY, &b.cert_pem)?;
    Ok((cert, key))
}

/// Why a stored bundle cannot be served as it is (unparsable, a key that
/// is not the certificate's, a certificate the CA did not issue, or one not
/// valid at `now`); `None` when it can.
pub fn unusable(b: &Bundle, now: SystemTime) -> Option<String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use x509_parser::prelude::{ASN1Time, FromDer, X509Certificate};

    let secs = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    let at = match ASN1Time::from_timestamp(secs) {
        Ok(t) => t,
        Err(e) => return Some(format!("clock: {e}")),
    };
    let der = |what: &str, pem: &str| {
        CertificateDer::from_pem_slice(pem.as_bytes())
            .map_err(|e| format!("{what}: not a PEM certificate: {e}"))
    };
    let check = || -> Result<(), String> {
        let ca_der = der(CA_KEY, &b.ca_pem)?;
        let leaf_der = der(CERT_KEY, &b.cert_pem)?;
        let (_, ca) = X509Certificate::from_der(&ca_der)
            .map_err(|e| format!("{CA_KEY}: not an X.509 certificate: {e}"))?;
        let (_, leaf) = X509Certificate::from_der(&leaf_der)
            .map_err(|e| format!("{CERT_KEY}: not an X.509 certificate: {e}"))?;
        for (what, c) in [(CA_KEY, &ca), (CERT_KEY, &leaf)] {
            if !c.validity().is_valid_at(at) {
                return Err(format!(
                    "{what}: not valid now (valid {} to {})",
                    c.validity().not_before,
                    c.validity().not_after
                ));
            }
        }
        if leaf.issuer() != ca.subject() || leaf.verify_signature(Some(ca.public_key())).is_err() {
            return Err(format!("{CERT_KEY} was not issued by the CA in {CA_KEY}"));
        }
        let key = PrivateKeyDer::from_pem_slice(b.key_pem.as_bytes())
            .map_err(|e| format!("{KEY_KEY}: not a PEM private key: {e}"))?;
        let signing = rustls::crypto::ring::sign::any_supported_type(&key)
            .map_err(|e| format!("{KEY_KEY}: unusable: {e}"))?;
        rustls::sign::CertifiedKey::new(vec![leaf_der], signing)
            .keys_match()
            .map_err(|e| format!("{KEY_KEY} does not belong to {CERT_KEY}: {e}"))
    };
    check().err()
}

/// How often [`ensure_secret`] tries again after losing a write race.
const WRITE_ATTEMPTS: usize = 3;

/// Get the shared bundle, creating it when no replica has yet, and
/// repairing it when what is stored cannot be served (a partial or
/// hand-edited Secret, an expired certificate) instead of failing the
/// start of every replica. Writes are conditional on the Secret's
/// resourceVersion: of replicas repairing at once, one wins and the others
/// adopt its bundle.
pub async fn ensure_secret(
    client: &Client,
    namespace: &str,
    secret: &str,
    service: &str,
    validity: Validity,
) -> Result<Bundle, CaError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let mut last = None;
    for _ in 0..WRITE_ATTEMPTS {
        let stored = api.get_opt(secret).await?;
        let resource_version = match &stored {
            None => None,
            Some(s) => {
                let why = match from_secret(s) {
                    Ok(b) => match unusable(&b, SystemTime::now()) {
                        None => return Ok(b),
                        Some(why) => why,
                    },
                    Err(e) => e.to_string(),
                };
                tracing::warn!(secret, reason = %why, "stored CA and serving certificate unusable; replacing them");
                last = Some(why);
                s.metadata.resource_version.clone()
            }
        };
        let fresh = generate_with(
            &service_names(service, namespace),
            validity,
            SystemTime::now(),
        )?;
        let mut want = to_secret(secret, namespace, &fresh);
        let written = match resource_version {
            None => api.create(&PostParams::default(), &want).await,
            Some(rv) => {
                want.metadata.resource_version = Some(rv);
                api.replace(secret, &PostParams::default(), &want).await
            }
        };
        match written {
            Ok(_) => {
                tracing::info!(
                    secret,
                    repaired = last.is_some(),
                    "stored a new CA and serving certificate"
                );
                return Ok(fresh);
            }
            // Another replica wrote first: read (and check) what it wrote.
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(CaError::Contended(
        secret.to_string(),
        last.unwrap_or_else(|| "concurrent writes".into()),
    ))
}

/// Keep `caBundle` of the webhook configuration current. It watches that
/// one configuration (a field selector on its name, which RBAC's
/// `resourceNames` allows), so a reset (`helm upgrade`, or a GitOps
/// `helm template | kubectl apply` that blanks it) is repaired at once,
/// not at the next poll: with failurePolicy Fail a blank caBundle refuses
/// every pod creation meanwhile. A new trust bundle from `bundle_rx` is
/// patched in too.
///
/// Replicas' views of the Secret may lag one another during a rotation, so
/// a replica never patches from its own view alone: before a patch it
/// re-reads the Secret (and patches what that holds), and the patch is
/// conditional on the configuration's resourceVersion. A stale replica
/// thus cannot take a root out that another replica already serves from.
pub async fn keep_ca_bundle(
    client: Client,
    webhook_config: String,
    secrets: Api<Secret>,
    secret: String,
    period: Duration,
    mut bundle_rx: tokio::sync::watch::Receiver<String>,
) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};

    let api: Api<MutatingWebhookConfiguration> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("metadata.name={webhook_config}"));
    let mut changes = std::pin::pin!(
        watcher(api.clone(), config)
            .default_backoff()
            .applied_objects()
    );
    // A failed or lost patch is tried again within a period.
    let mut tick = tokio::time::interval(period.max(MIN_STEP));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last: Option<MutatingWebhookConfiguration> = None;
    loop {
        tokio::select! {
            next = changes.next() => match next {
                None => return,
                Some(Ok(m)) => last = Some(m),
                Some(Err(e)) => {
                    tracing::warn!(error = %e, webhook_config, "cannot watch the MutatingWebhookConfiguration");
                    continue;
                }
            },
            changed = bundle_rx.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            _ = tick.tick() => {}
        }
        let Some(mwc) = &last else { continue };
        let mine = bundle_rx.borrow_and_update().clone();
        if ca_bundle_patch(mwc, &mine).is_empty() {
            continue;
        }
        // Patch what the Secret holds now; this replica's view only when
        // the Secret cannot be read or served.
        let now = SystemTime::now();
        let want = match secrets.get_opt(&secret).await {
            Ok(Some(s)) => match stored_from_secret(&s) {
                Ok(st) if unusable(&st.current(), now).is_none() => trust_bundle(&st.roots, now),
                _ => mine,
            },
            _ => mine,
        };
        let mut ops = ca_bundle_patch(mwc, &want);
        if ops.is_empty() {
            continue;
        }
        if let Some(rv) = &mwc.metadata.resource_version {
            ops.insert(
                0,
                json!({"op": "test", "path": "/metadata/resourceVersion", "value": rv}),
            );
        }
        let patch = match serde_json::from_value(Value::Array(ops)) {
            Ok(p) => Patch::Json::<()>(p),
            Err(e) => {
                tracing::warn!(error = %e, "cannot build the caBundle patch");
                continue;
            }
        };
        match api
            .patch(&webhook_config, &PatchParams::default(), &patch)
            .await
        {
            Ok(m) => {
                last = Some(m);
                tracing::info!(webhook_config, "caBundle patched");
            }
            // Changed meanwhile: the watch brings the new version.
            Err(e) => tracing::warn!(error = %e, "cannot patch caBundle"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::admissionregistration::v1::{MutatingWebhook, WebhookClientConfig};

    #[test]
    fn bundle_round_trips_through_the_secret_and_loads() -> anyhow::Result<()> {
        let b = generate(&service_names("remora-operator", "remora-system"))?;
        let s = to_secret("remora-operator-tls", "remora-system", &b);
        assert_eq!(s.type_.as_deref(), Some("kubernetes.io/tls"));
        assert_eq!(from_secret(&s)?, b);
        let dir = tempfile::tempdir()?;
        let (cert, key) = write_files(dir.path(), &b)?;
        crate::webhook::tls::load_certified_key(&cert, &key)?;
        let mut empty = s.clone();
        empty.data = None;
        assert!(from_secret(&empty).is_err());
        Ok(())
    }

    #[test]
    fn serving_certificates_are_renewed_at_two_thirds_of_their_life() -> anyhow::Result<()> {
        let names = service_names("remora-operator", "remora-system");
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let v = Validity {
            ca: Duration::from_secs(3600),
            serving: Duration::from_secs(90),
        };
        let b = generate_with(&names, v, t0)?;
        assert_eq!(unusable(&b, t0 + Duration::from_secs(1)), None);
        let due = t0 + Duration::from_secs(60);
        let policy = Policy {
            validity: v,
            overlap: Duration::from_secs(30),
            settle: Duration::from_secs(3),
        };
        let renewal = |b: &Bundle, now| {
            let p = plan(&Stored::new(b.clone()), false, now, &policy);
            (p.action, p.wake)
        };
        let wait = |wake| (None, wake);
        let now = |action, wake| (Some(action), wake);
        assert_eq!(renewal(&b, t0), wait(due));
        assert_eq!(renewal(&b, due), now(Action::Renew, due));
        // Without the CA key (an older Secret) nothing can be issued: the
        // CA is rotated to one whose key is kept.
        let keyless = Bundle {
            ca_key_pem: String::new(),
            ..b.clone()
        };
        assert_eq!(
            renewal(&keyless, due),
            now(Action::Root(crate::pki::rotation::Step::Stage), due)
        );
        // A renewal from the stored CA: same CA, new pair, usable, due later.
        let (cert_pem, key_pem) = issue_serving(&b.ca_pem, &b.ca_key_pem, &names, v, due)?;
        let renewed = Bundle {
            cert_pem,
            key_pem,
            ..b.clone()
        };
        assert_ne!(renewed.cert_pem, b.cert_pem);
        assert_eq!(unusable(&renewed, due + Duration::from_secs(1)), None);
        assert_eq!(renewal(&renewed, due), wait(due + Duration::from_secs(60)));
        // Never beyond the CA: issued 30 s before the CA ends.
        let late = t0 + Duration::from_secs(3570);
        let (short, _) = issue_serving(&b.ca_pem, &b.ca_key_pem, &names, v, late)?;
        assert_eq!(renewal_due_at(&short), Some(late + Duration::from_secs(20)));
        // The Secret round trip keeps the CA key.
        assert_eq!(from_secret(&to_secret("s", "ns", &b))?, b);
        for bad in [
            Validity {
                serving: Duration::from_secs(5),
                ..v
            },
            Validity {
                ca: Duration::from_secs(60),
                serving: Duration::from_secs(90),
            },
            Validity {
                ca: Duration::MAX,
                ..v
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        assert_eq!(v.validate(), Ok(()));
        Ok(())
    }

    #[test]
    fn unusable_bundles_are_named_and_usable_ones_pass() -> anyhow::Result<()> {
        let names = service_names("remora-operator", "remora-system");
        let good = generate(&names)?;
        let other = generate(&names)?;
        let now = SystemTime::now();
        assert_eq!(unusable(&good, now), None);
        let cases = [
            (
                Bundle {
                    cert_pem: "garbage".into(),
                    ..good.clone()
                },
                "tls.crt: not a PEM certificate",
            ),
            (
                Bundle {
                    key_pem: other.key_pem.clone(),
                    ..good.clone()
                },
                "does not belong",
            ),
            (
                Bundle {
                    ca_pem: "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".into(),
                    ..good.clone()
                },
                "ca.crt: not an X.509 certificate",
            ),
        ];
        for (bad, why) in cases {
            let got = unusable(&bad, now).unwrap_or_default();
            assert!(got.contains(why), "{got:?} lacks {why:?}");
        }
        // A CA of the same name that did not issue the serving certificate.
        let mixed = Bundle {
            ca_pem: other.ca_pem.clone(),
            ..good.clone()
        };
        assert!(
            unusable(&mixed, now).is_some_and(|w| w.contains("not issued by the CA")),
            "{:?}",
            unusable(&mixed, now)
        );
        // Out of its validity (rcgen's default: 1975 to 4096).
        let ancient = SystemTime::UNIX_EPOCH;
        assert!(
            unusable(&good, ancient).is_some_and(|w| w.contains("not valid now")),
            "{:?}",
            unusable(&good, ancient)
        );
        Ok(())
    }

    #[test]
    fn ca_bundle_patch_touches_only_stale_webhooks() {
        let hook = |ca: Option<&str>| MutatingWebhook {
            name: "inject.remora.dev".into(),
            client_config: WebhookClientConfig {
                ca_bundle: ca.map(|c| ByteString(c.as_bytes().to_vec())),
                ..Default::default()
            },
            ..Default::default()
        };
        let mwc = MutatingWebhookConfiguration {
            webhooks: Some(vec![hook(None), hook(Some("CA")), hook(Some("old"))]),
            ..Default::default()
        };
        let ops = ca_bundle_patch(&mwc, "CA");
        let paths: Vec<&str> = ops.iter().filter_map(|o| o["path"].as_str()).collect();
        assert_eq!(
            paths,
            [
                "/webhooks/0/clientConfig/caBundle",
                "/webhooks/2/clientConfig/caBundle"
            ]
        );
        // Base64 on the wire, as Go's []byte.
        assert_eq!(ops[0]["value"], "Q0E=");
    }
}
