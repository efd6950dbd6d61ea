//! The test PKI: a root CA, the leaves it signs (servers, clients, workloads
//! with SPIFFE IDs), CSR signing for CA doubles, and rustls client configs
//! that trust the root. Keys are ECDSA P-256 and generated fresh, so nothing
//! secret lives in the repository.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

pub use rcgen::KeyPair;
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyUsagePurpose, SanType, SerialNumber,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// The URI SAN of [`Ca::leaf`]: a workload identity as Istio's CA issues it.
pub const WORKLOAD_ID: &str = "spiffe://cluster.local/ns/test/sa/test";

/// A fresh ECDSA P-256 key pair.
pub fn new_key() -> KeyPair {
    KeyPair::generate().unwrap_or_else(|e| panic!("generating a key pair: {e}"))
}

/// A self-signed root CA.
pub struct Ca {
    /// The root certificate, PEM: what a peer trusts.
    pub pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A certificate (signed by a [`Ca`], or self-signed) with its key.
#[derive(Clone)]
pub struct Leaf {
    /// The certificate, PEM (just the leaf: the root is [`Ca::pem`]).
    pub chain: String,
    /// Its private key, PKCS#8 PEM.
    pub key: String,
    /// Its serial number, lowercase hex without colons.
    pub serial: String,
    pub der: CertificateDer<'static>,
    key_der: Vec<u8>,
}

impl std::fmt::Debug for Leaf {
    // The key stays out of test output.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leaf")
            .field("serial", &self.serial)
            .finish()
    }
}

impl Leaf {
    fn new(cert: &rcgen::Certificate, key: &KeyPair) -> Self {
        Self {
            chain: cert.pem(),
            key: key.serialize_pem(),
            serial: serial_of(cert.der()),
            der: cert.der().clone(),
            key_der: key.serialize_der(),
        }
    }

    pub fn private_key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()))
    }

    /// Writes the certificate and the key as PEM files `cert_file` and
    /// `key_file` in `dir` (a server's `--tls-cert`/`--tls-key`); returns
    /// their paths.
    pub fn write_pem(
        &self,
        dir: &Path,
        cert_file: &str,
        key_file: &str,
    ) -> std::io::Result<(PathBuf, PathBuf)> {
        let (cert, key) = (dir.join(cert_file), dir.join(key_file));
        std::fs::write(&cert, &self.chain)?;
        std::fs::write(&key, &self.key)?;
        Ok((cert, key))
    }
}

impl Ca {
    /// A root named `common_name`, allowed to sign certificates and CRLs.
    pub fn new(common_name: &str) -> Self {
        let mut p = CertificateParams::default();
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name.push(DnType::CommonName, common_name);
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = new_key();
        let cert = p
            .self_signed(&key)
            .unwrap_or_else(|e| panic!("self-signing the CA {common_name:?}: {e}"));
        Self {
            pem: cert.pem(),
            issuer: Issuer::new(p, key),
        }
    }

    /// A workload certificate: DNS SAN `localhost` (what test clients dial)
    /// and URI SAN [`WORKLOAD_ID`], valid from a minute ago for an hour.
    pub fn leaf(&self) -> Leaf {
        let now = SystemTime::now();
        self.leaf_with(
            now - Duration::from_secs(60),
            now + Duration::from_secs(3600),
        )
    }

    /// [`Ca::leaf`] with another validity (expired, not yet valid, short).
    pub fn leaf_with(&self, not_before: SystemTime, not_after: SystemTime) -> Leaf {
        self.issue()
            .names(&["localhost"])
            .uri(WORKLOAD_ID)
            .validity(not_before, not_after)
            .sign()
    }

    /// Any other certificate: names, identities, usages, serial, key.
    pub fn issue(&self) -> LeafBuilder<'_> {
        let mut params = CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        LeafBuilder {
            ca: self,
            params,
            key: None,
        }
    }

    /// Signs a CSR as a CA double does: valid from now for `ttl`, with the
    /// CSR's names plus DNS SANs `extra_dns`. Returns the certificate PEM.
    pub fn sign_csr(
        &self,
        csr_pem: &str,
        ttl: Duration,
        extra_dns: &[&str],
    ) -> Result<String, rcgen::Error> {
        let now = SystemTime::now();
        self.sign_csr_valid(csr_pem, now, now + ttl, extra_dns)
    }

    /// [`Ca::sign_csr`] with an explicit validity window: a CA double that
    /// back-dates, issues already-expired or very short certificates.
    pub fn sign_csr_valid(
        &self,
        csr_pem: &str,
        not_before: SystemTime,
        not_after: SystemTime,
        extra_dns: &[&str],
    ) -> Result<String, rcgen::Error> {
        let mut csr = CertificateSigningRequestParams::from_pem(csr_pem)?;
        csr.params.not_before = not_before.into();
        csr.params.not_after = not_after.into();
        for name in extra_dns {
            csr.params
                .subject_alt_names
                .push(SanType::DnsName((*name).try_into()?));
        }
        Ok(csr.signed_by(&self.issuer)?.pem())
    }
}

/// A certificate being described; [`LeafBuilder::sign`] makes it. Without
/// further calls: no names, no usages, rcgen's default validity.
pub struct LeafBuilder<'a> {
    ca: &'a Ca,
    params: CertificateParams,
    key: Option<&'a KeyPair>,
}

impl<'a> LeafBuilder<'a> {
    /// SANs: IP addresses as IP SANs, anything else as DNS names.
    pub fn names(mut self, names: &[&str]) -> Self {
        for name in names {
            let san = match name.parse() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(
                    (*name)
                        .try_into()
                        .unwrap_or_else(|e| panic!("DNS name {name:?}: {e}")),
                ),
            };
            self.params.subject_alt_names.push(san);
        }
        self
    }

    /// A URI SAN, such as a SPIFFE ID.
    pub fn uri(mut self, uri: &str) -> Self {
        let san = SanType::URI(
            uri.try_into()
                .unwrap_or_else(|e| panic!("URI {uri:?}: {e}")),
        );
        self.params.subject_alt_names.push(san);
        self
    }

    pub fn common_name(mut self, cn: &str) -> Self {
        self.params.distinguished_name.push(DnType::CommonName, cn);
        self
    }

    /// The subject's organization: a Kubernetes client certificate's group.
    pub fn organization(mut self, o: &str) -> Self {
        self.params
            .distinguished_name
            .push(DnType::OrganizationName, o);
        self
    }

    pub fn validity(mut self, not_before: SystemTime, not_after: SystemTime) -> Self {
        self.params.not_before = not_before.into();
        self.params.not_after = not_after.into();
        self
    }

    /// Valid from a minute ago (clock skew) for `ttl`.
    pub fn valid_for(self, ttl: Duration) -> Self {
        let now = SystemTime::now();
        self.validity(now - Duration::from_secs(60), now + ttl)
    }

    /// An explicit serial number: rcgen derives one from the key, so two
    /// certificates for the same key need this to differ.
    pub fn serial(mut self, serial: u64) -> Self {
        // A leading 0x01 keeps the DER integer positive and non-zero.
        let mut bytes = vec![0x01];
        bytes.extend(serial.to_be_bytes());
        self.params.serial_number = Some(SerialNumber::from_slice(&bytes));
        self
    }

    /// Usable as a TLS server certificate.
    pub fn server_auth(self) -> Self {
        self.usage(ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// Usable as a TLS client certificate.
    pub fn client_auth(self) -> Self {
        self.usage(ExtendedKeyUsagePurpose::ClientAuth)
    }

    fn usage(mut self, purpose: ExtendedKeyUsagePurpose) -> Self {
        self.params.extended_key_usages.push(purpose);
        if !self
            .params
            .key_usages
            .contains(&KeyUsagePurpose::DigitalSignature)
        {
            self.params
                .key_usages
                .push(KeyUsagePurpose::DigitalSignature);
        }
        self
    }

    /// Certify this key instead of a fresh one (a renewal that keeps it).
    pub fn key(mut self, key: &'a KeyPair) -> Self {
        self.key = Some(key);
        self
    }

    pub fn sign(self) -> Leaf {
        let fresh;
        let key = match self.key {
            Some(k) => k,
            None => {
                fresh = new_key();
                &fresh
            }
        };
        let cert = self
            .params
            .signed_by(key, &self.ca.issuer)
            .unwrap_or_else(|e| panic!("signing a leaf certificate: {e}"));
        Leaf::new(&cert, key)
    }
}

/// A self-signed certificate for `names`, its own trust anchor (a serving
/// certificate for a test server whose client trusts just that PEM).
pub fn self_signed(names: &[&str]) -> Leaf {
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let ck = rcgen::generate_simple_self_signed(names)
        .unwrap_or_else(|e| panic!("self-signing a certificate: {e}"));
    Leaf::new(&ck.cert, &ck.signing_key)
}

/// The serial number of a DER certificate, lowercase hex without colons.
pub fn serial_of(der: &[u8]) -> String {
    let (_, c) = x509_parser::parse_x509_certificate(der)
        .unwrap_or_else(|e| panic!("parsing a certificate: {e}"));
    c.raw_serial_as_string().replace(':', "")
}

/// [`serial_of`] the first certificate in `pem`.
pub fn serial_of_pem(pem: &str) -> String {
    let der = CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()
        .unwrap_or_else(|| panic!("no certificate in {pem:?}"))
        .unwrap_or_else(|e| panic!("certificate PEM: {e}"));
    serial_of(&der)
}

#[derive(Debug, thiserror::Error)]
pub enum ClientConfigError {
    #[error("root certificate PEM: {0}")]
    Pem(#[from] rustls::pki_types::pem::Error),
    #[error(transparent)]
    Tls(#[from] rustls::Error),
}

/// A rustls client trusting only the certificates in `roots_pem` and, when
/// given one, presenting `identity` (mTLS). Session resumption is off, so
/// every new connection is a full handshake and shows the certificate the
/// server holds at that moment.
pub fn client_config(
    roots_pem: &str,
    identity: Option<&Leaf>,
) -> Result<Arc<rustls::ClientConfig>, ClientConfigError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(roots_pem.as_bytes()) {
        roots.add(cert?)?;
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots);
    let mut cfg = match identity {
        Some(leaf) => builder.with_client_auth_cert(vec![leaf.der.clone()], leaf.private_key())?,
        None => builder.with_no_client_auth(),
    };
    cfg.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(cfg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaves_chain_to_their_root_and_carry_what_was_asked() {
        let ca = Ca::new("root");
        let key = new_key();
        let a = ca
            .issue()
            .names(&["web", "127.0.0.1"])
            .serial(1)
            .key(&key)
            .sign();
        let b = ca.issue().names(&["web"]).serial(2).key(&key).sign();
        assert_ne!(a.serial, b.serial);
        assert_eq!(a.key, b.key, "same key");
        assert_eq!(a.serial, "010000000000000001");
        assert_eq!(serial_of_pem(&a.chain), a.serial);
        let (_, cert) = x509_parser::parse_x509_certificate(&a.der).expect("parse");
        let sans = cert
            .subject_alternative_name()
            .expect("ext")
            .expect("sans")
            .value
            .general_names
            .len();
        assert_eq!(sans, 2);
        assert!(client_config(&ca.pem, Some(&ca.leaf())).is_ok());
    }
}
