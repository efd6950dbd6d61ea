//! Workload certificates for the cert-rotation scenario: one root, a client
//! certificate for the load generator (mTLS), and serving certificates as
//! the Secret data that `remora-agent --cert-dir` reads.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType, SerialNumber,
};
use remora_agent::certs::{CERT_CHAIN_FILE, KEY_FILE, ROOT_CERT_FILE};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::load::fingerprint;

#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    #[error("generating a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("building the TLS client config: {0}")]
    Tls(#[from] rustls::Error),
}

/// A root CA and a client certificate it signed.
pub struct Pki {
    issuer: Issuer<'static, KeyPair>,
    pub root_pem: String,
    root_der: CertificateDer<'static>,
    client_der: CertificateDer<'static>,
    client_key: Vec<u8>,
}

/// One serving certificate, as the Secret's data and as the client sees it.
pub struct Serving {
    /// `cert-chain.pem`, `key.pem`, `root-cert.pem`.
    pub files: BTreeMap<String, Vec<u8>>,
    /// [`fingerprint`] of the certificate's DER: what a client compares.
    pub fingerprint: u64,
    /// Hex serial number.
    pub serial: String,
}

impl Pki {
    /// A root named `root_cn`, and a client certificate with the URI SAN
    /// `client_id` (what `--inbound-tls-san` matches).
    pub fn new(root_cn: &str, client_id: &str) -> Result<Self, CertsError> {
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.distinguished_name.push(DnType::CommonName, root_cn);
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let root = p.self_signed(&key)?;
        let issuer = Issuer::new(p, key);

        let client_key = KeyPair::generate()?;
        let mut c = CertificateParams::new(Vec::<String>::new())?;
        c.subject_alt_names = vec![SanType::URI(client_id.try_into()?)];
        c.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        c.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let client = c.signed_by(&client_key, &issuer)?;
        Ok(Self {
            root_pem: root.pem(),
            root_der: root.der().clone(),
            client_der: client.der().clone(),
            client_key: client_key.serialize_der(),
            issuer,
        })
    }

    /// A client that trusts the root and presents the client certificate.
    /// Session resumption is off, so every new connection is a full
    /// handshake and shows the certificate the server holds at that moment.
    pub fn client_config(&self) -> Result<Arc<rustls::ClientConfig>, CertsError> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.root_der.clone())?;
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.client_key.clone()));
        let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_client_auth_cert(vec![self.client_der.clone()], key)?;
        cfg.resumption = rustls::client::Resumption::disabled();
        Ok(Arc::new(cfg))
    }

    /// A serving certificate for `key` with DNS SANs `names` and a URI SAN
    /// `id`, valid from a minute ago for an hour, with serial `serial`
    /// (explicit: rcgen would derive it from the key, and a renewal keeps
    /// the key).
    pub fn serving(
        &self,
        serial: u64,
        key: &KeyPair,
        names: &[&str],
        id: &str,
    ) -> Result<Serving, CertsError> {
        let mut p =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())?;
        p.subject_alt_names.push(SanType::URI(id.try_into()?));
        // A leading 0x01 keeps the DER integer positive and non-zero.
        let mut bytes = vec![0x01];
        bytes.extend(serial.to_be_bytes());
        let serial = SerialNumber::from_slice(&bytes);
        p.serial_number = Some(serial.clone());
        let now = SystemTime::now();
        p.not_before = (now - Duration::from_secs(60)).into();
        p.not_after = (now + Duration::from_secs(3600)).into();
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let cert = p.signed_by(key, &self.issuer)?;
        let files = [
            (CERT_CHAIN_FILE, cert.pem()),
            (KEY_FILE, key.serialize_pem()),
            (ROOT_CERT_FILE, self.root_pem.clone()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.into_bytes()))
        .collect();
        Ok(Serving {
            files,
            fingerprint: fingerprint(cert.der()),
            serial: serial.to_string().replace(':', ""),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewals_with_the_same_key_are_different_certificates() {
        let pki = Pki::new("root", "spiffe://cluster.local/ns/t/sa/client").expect("pki");
        let key = KeyPair::generate().expect("key");
        let names = ["web.t.svc"];
        let id = "spiffe://cluster.local/ns/t/sa/web";
        let a = pki.serving(1, &key, &names, id).expect("a");
        let b = pki.serving(2, &key, &names, id).expect("b");
        assert_ne!(a.fingerprint, b.fingerprint);
        assert_ne!(a.serial, b.serial);
        assert_eq!(a.files[KEY_FILE], b.files[KEY_FILE], "same key");
        // What the agent accepts as a bundle.
        let bundle = remora_agent::certs::validate_bundle(
            String::from_utf8(b.files[CERT_CHAIN_FILE].clone()).expect("utf8"),
            String::from_utf8(b.files[KEY_FILE].clone()).expect("utf8"),
            pki.root_pem.clone(),
            SystemTime::now(),
        )
        .expect("valid bundle");
        assert_eq!(bundle.serial.replace(':', "").to_lowercase(), b.serial);
        pki.client_config().expect("client config");
    }
}
