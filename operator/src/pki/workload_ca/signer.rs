//! Signing one workload certificate: the CSR is parsed and its signature
//! checked (rcgen over x509-parser), it must ask for exactly the caller's
//! SPIFFE identity, and the leaf is built from our own parameters (only the
//! CSR's public key is kept, so nothing else a CSR asks for reaches the
//! certificate: no CA bit, no other names, no other usages).

use std::time::{Duration, SystemTime};

use rcgen::{
    CertificateParams, CertificateSigningRequestParams, DistinguishedName, ExtendedKeyUsagePurpose,
    Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};

/// Backdating of a leaf's start, for clocks a little behind ours: a
/// twentieth of its lifetime, at most a minute. More would move the
/// sidecar's renewal (at half the lifetime from the start) forward.
const MAX_BACKDATE: Duration = Duration::from_secs(60);

fn backdate(ttl: Duration) -> Duration {
    (ttl / 20).min(MAX_BACKDATE)
}
/// The largest CSR read (a P-256 or RSA-4096 CSR is well under 4 KiB).
pub const MAX_CSR_BYTES: usize = 16 * 1024;

/// Why a CSR is not signed. Each is a refusal reason in the metrics.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SignError {
    #[error("the CSR is larger than {MAX_CSR_BYTES} bytes")]
    TooLarge,
    #[error("the CSR is not a valid PEM certificate request with a good signature: {0}")]
    BadCsr(String),
    #[error("the CSR asks for {asked:?}; a token of this service account gets only {allowed}")]
    WrongIdentity { asked: Vec<String>, allowed: String },
    #[error("signing failed: {0}")]
    Sign(String),
}

impl SignError {
    /// The metrics label.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::TooLarge | Self::BadCsr(_) => "bad_csr",
            Self::WrongIdentity { .. } => "wrong_identity",
            Self::Sign(_) => "internal",
        }
    }
}

/// A signing root: its certificate and key, parsed once.
pub struct Signer {
    root_pem: String,
    issuer: Issuer<'static, KeyPair>,
    not_before: SystemTime,
    not_after: SystemTime,
}

impl std::fmt::Debug for Signer {
    // Never the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field("not_before", &self.not_before)
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

impl Signer {
    pub fn new(root_pem: &str, key_pem: &str) -> Result<Self, SignError> {
        let bad = |e: &dyn std::fmt::Display| SignError::Sign(format!("signing root: {e}"));
        let key = KeyPair::from_pem(key_pem).map_err(|e| bad(&e))?;
        let (not_before, not_after) = crate::pki::rotation::validity_of(root_pem)
            .ok_or_else(|| SignError::Sign("signing root: not a parsable certificate".into()))?;
        let issuer = Issuer::from_ca_cert_pem(root_pem, key).map_err(|e| bad(&e))?;
        Ok(Self {
            root_pem: root_pem.trim().to_string() + "\n",
            issuer,
            not_before,
            not_after,
        })
    }

    /// A certificate's start and end for `life` from `now`: backdated,
    /// and never outside the root's own.
    fn window(&self, now: SystemTime, life: Duration) -> (SystemTime, SystemTime) {
        let start = now
            .checked_sub(backdate(life))
            .unwrap_or(now)
            .max(self.not_before);
        let end = now
            .checked_add(life)
            .unwrap_or(self.not_after)
            .min(self.not_after);
        (start, end)
    }

    pub fn root_pem(&self) -> &str {
        &self.root_pem
    }

    pub fn not_after(&self) -> SystemTime {
        self.not_after
    }

    /// Sign `csr_pem` for `identity`, valid `ttl` from `now` (backdated a
    /// twentieth of `ttl`, at most a minute) and never past the root. Returns the chain, leaf first and
    /// the root last (what Istio's protocol returns).
    pub fn sign(
        &self,
        csr_pem: &str,
        identity: &str,
        ttl: Duration,
        now: SystemTime,
    ) -> Result<Vec<String>, SignError> {
        if csr_pem.len() > MAX_CSR_BYTES {
            return Err(SignError::TooLarge);
        }
        let (_, pem) = x509_parser::pem::parse_x509_pem(csr_pem.as_bytes())
            .map_err(|e| SignError::BadCsr(e.to_string()))?;
        if pem.label != "CERTIFICATE REQUEST" {
            return Err(SignError::BadCsr(format!(
                "a PEM {:?} block, not a CERTIFICATE REQUEST",
                pem.label
            )));
        }
        self.sign_der(&pem.contents, identity, ttl, now)
    }

    /// [`Signer::sign`] of a DER CSR.
    pub fn sign_der(
        &self,
        csr_der: &[u8],
        identity: &str,
        ttl: Duration,
        now: SystemTime,
    ) -> Result<Vec<String>, SignError> {
        let csr = CertificateSigningRequestParams::from_der(&csr_der.to_vec().into())
            .map_err(|e| SignError::BadCsr(e.to_string()))?;
        let asked: Vec<String> = csr
            .params
            .subject_alt_names
            .iter()
            .map(|s| match s {
                SanType::URI(u) => u.as_str().to_string(),
                SanType::DnsName(d) => format!("DNS:{}", d.as_str()),
                other => format!("{other:?}"),
            })
            .collect();
        if asked.len() != 1 || asked[0] != identity {
            return Err(SignError::WrongIdentity {
                asked,
                allowed: identity.to_string(),
            });
        }
        let mut leaf = CertificateParams::default();
        leaf.distinguished_name = DistinguishedName::new();
        leaf.subject_alt_names = csr.params.subject_alt_names.clone();
        leaf.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        leaf.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        leaf.serial_number = Some(SerialNumber::from_slice(&rand::random::<[u8; 16]>()));
        let (start, end) = self.window(now, ttl);
        (leaf.not_before, leaf.not_after) = (start.into(), end.into());
        let signed = CertificateSigningRequestParams {
            params: leaf,
            public_key: csr.public_key,
        }
        .signed_by(&self.issuer)
        .map_err(|e| SignError::Sign(e.to_string()))?;
        Ok(vec![signed.pem(), self.root_pem.clone()])
    }

    /// A serving certificate for the CA's own TLS, for `names`, from this root.
    pub fn serving(
        &self,
        names: &[String],
        validity: Duration,
        now: SystemTime,
    ) -> Result<(String, String), SignError> {
        let e = |e: rcgen::Error| SignError::Sign(e.to_string());
        let key = KeyPair::generate().map_err(e)?;
        let mut p = CertificateParams::new(names.to_vec()).map_err(e)?;
        p.distinguished_name = DistinguishedName::new();
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let (start, end) = self.window(now, validity);
        (p.not_before, p.not_after) = (start.into(), end.into());
        let cert = p.signed_by(&key, &self.issuer).map_err(e)?;
        Ok((cert.pem() + &self.root_pem, key.serialize_pem()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::string::Ia5String;

    const ID: &str = "spiffe://cluster.local/ns/web/sa/default";

    fn root() -> Signer {
        // Made ten minutes ago, so that a backdated leaf starts inside it.
        let made = SystemTime::now() - Duration::from_secs(600);
        let ca = crate::pki::webhook_cert::new_ca(Duration::from_secs(3600), made).expect("root");
        Signer::new(&ca.cert_pem, &ca.key_pem).expect("signer")
    }

    fn csr(sans: Vec<SanType>) -> String {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
        let mut p = CertificateParams::default();
        p.subject_alt_names = sans;
        p.serialize_request(&key).expect("csr").pem().expect("pem")
    }

    fn uri(s: &str) -> SanType {
        SanType::URI(Ia5String::try_from(s).expect("uri"))
    }

    #[test]
    fn signs_exactly_the_identity_for_at_most_the_root() {
        let s = root();
        let now = SystemTime::now();
        let chain = s
            .sign(&csr(vec![uri(ID)]), ID, Duration::from_secs(120), now)
            .expect("signed");
        assert_eq!(chain.len(), 2);
        assert_eq!(chain[1], s.root_pem());
        let (_, pem) = x509_parser::pem::parse_x509_pem(chain[0].as_bytes()).expect("pem");
        let cert = pem.parse_x509().expect("x509");
        let sans = cert
            .subject_alternative_name()
            .expect("ext")
            .expect("sans")
            .value
            .general_names
            .iter()
            .map(|n| format!("{n}"))
            .collect::<Vec<_>>();
        assert_eq!(sans, vec![format!("URI({ID})")]);
        assert!(!cert.is_ca());
        let life = cert.validity().not_after.timestamp() - cert.validity().not_before.timestamp();
        assert_eq!(life, 126, "120 s asked, backdated a twentieth");
        // A day asked from a root of an hour: cut at the root's end.
        let long = s
            .sign(&csr(vec![uri(ID)]), ID, Duration::from_secs(86_400), now)
            .expect("signed");
        let (_, pem) = x509_parser::pem::parse_x509_pem(long[0].as_bytes()).expect("pem");
        let end = pem
            .parse_x509()
            .expect("x509")
            .validity()
            .not_after
            .timestamp();
        assert!(
            end <= s
                .not_after()
                .duration_since(SystemTime::UNIX_EPOCH)
                .expect("epoch")
                .as_secs() as i64
        );
    }

    #[test]
    fn refuses_another_identity_extra_names_and_garbage() {
        let s = root();
        let now = SystemTime::now();
        let ttl = Duration::from_secs(60);
        let other = "spiffe://cluster.local/ns/web/sa/admin";
        let e = s.sign(&csr(vec![uri(other)]), ID, ttl, now).unwrap_err();
        assert_eq!(e.reason(), "wrong_identity");
        assert!(e.to_string().contains(other), "{e}");
        let e = s
            .sign(
                &csr(vec![
                    uri(ID),
                    SanType::DnsName("evil.example".try_into().expect("dns")),
                ]),
                ID,
                ttl,
                now,
            )
            .unwrap_err();
        assert_eq!(e.reason(), "wrong_identity");
        let e = s.sign(&csr(vec![]), ID, ttl, now).unwrap_err();
        assert_eq!(e.reason(), "wrong_identity");
        for garbage in [
            "",
            "hello",
            "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
        ] {
            let e = s.sign(garbage, ID, ttl, now).unwrap_err();
            assert_eq!(e.reason(), "bad_csr", "{garbage:?}");
        }
        assert_eq!(
            s.sign(&"A".repeat(MAX_CSR_BYTES + 1), ID, ttl, now),
            Err(SignError::TooLarge)
        );
    }

    #[test]
    fn a_csr_whose_signature_does_not_match_is_refused() {
        let s = root();
        let good = csr(vec![uri(ID)]);
        let (_, pem) = x509_parser::pem::parse_x509_pem(good.as_bytes()).expect("pem");
        let mut der = pem.contents.clone();
        assert!(
            s.sign_der(&der, ID, Duration::from_secs(60), SystemTime::now())
                .is_ok()
        );
        // The last byte is in the signature.
        let last = der.len() - 1;
        der[last] ^= 0x55;
        let e = s
            .sign_der(&der, ID, Duration::from_secs(60), SystemTime::now())
            .unwrap_err();
        assert_eq!(e.reason(), "bad_csr", "{e}");
    }
}
