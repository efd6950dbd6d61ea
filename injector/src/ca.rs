//! The operator's self-managed serving certificate: a CA and a serving
//! certificate made with rcgen, kept in a Secret that every replica shares
//! (the first to start creates it; the others read it), and the CA patched
//! into the MutatingWebhookConfiguration's `caBundle`. With cert-manager the
//! chart mounts the certificate instead and none of this runs.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use serde_json::{Value, json};

pub const CA_KEY: &str = "ca.crt";
pub const CERT_KEY: &str = "tls.crt";
pub const KEY_KEY: &str = "tls.key";

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("certificate generation: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("Secret {0} lacks {1}")]
    Incomplete(String, &'static str),
    #[error("Secret {0}: still unusable after {WRITE_ATTEMPTS} attempts to replace it ({1})")]
    Contended(String, String),
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bundle {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
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

/// Make a fresh CA and a serving certificate for `names`.
pub fn generate(names: &[String]) -> Result<Bundle, CaError> {
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.distinguished_name
        .push(DnType::CommonName, "remora-injector-ca");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);

    let mut leaf = CertificateParams::new(names.to_vec())?;
    if let Some(first) = names.first() {
        leaf.distinguished_name
            .push(DnType::CommonName, first.clone());
    }
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let leaf_key = KeyPair::generate()?;
    let leaf_cert = leaf.signed_by(&leaf_key, &issuer)?;
    Ok(Bundle {
        ca_pem: ca_cert.pem(),
        cert_pem: leaf_cert.pem(),
        key_pem: leaf_key.serialize_pem(),
    })
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
                    "remora-injector".to_string(),
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
            ]
            .into(),
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

/// Where the bootstrap writes the serving pair for [`crate::tls::ReloadingCert`].
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
        let fresh = generate(&service_names(service, namespace))?;
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
/// every pod creation meanwhile.
pub async fn keep_ca_bundle(client: Client, webhook_config: String, ca_pem: String) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};

    let api: Api<MutatingWebhookConfiguration> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("metadata.name={webhook_config}"));
    let mut changes = std::pin::pin!(
        watcher(api.clone(), config)
            .default_backoff()
            .applied_objects()
    );
    while let Some(next) = changes.next().await {
        let mwc = match next {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, webhook_config, "cannot watch the MutatingWebhookConfiguration");
                continue;
            }
        };
        let ops = ca_bundle_patch(&mwc, &ca_pem);
        if ops.is_empty() {
            continue;
        }
        let patch = match serde_json::from_value(Value::Array(ops)) {
            Ok(p) => Patch::Json::<()>(p),
            Err(e) => {
                tracing::warn!(error = %e, "cannot build the caBundle patch");
                continue;
            }
        };
        // A failed patch is retried at the configuration's next change or
        // the watch's next relist.
        match api
            .patch(&webhook_config, &PatchParams::default(), &patch)
            .await
        {
            Ok(_) => tracing::info!(webhook_config, "caBundle patched"),
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
        let b = generate(&service_names("remora-injector", "remora-system"))?;
        let s = to_secret("remora-injector-tls", "remora-system", &b);
        assert_eq!(s.type_.as_deref(), Some("kubernetes.io/tls"));
        assert_eq!(from_secret(&s)?, b);
        let dir = tempfile::tempdir()?;
        let (cert, key) = write_files(dir.path(), &b)?;
        crate::tls::load_certified_key(&cert, &key)?;
        let mut empty = s.clone();
        empty.data = None;
        assert!(from_secret(&empty).is_err());
        Ok(())
    }

    #[test]
    fn unusable_bundles_are_named_and_usable_ones_pass() -> anyhow::Result<()> {
        let names = service_names("remora-injector", "remora-system");
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
