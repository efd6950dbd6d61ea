//! The workload's identity as the CA is asked for it: a fresh key and a CSR
//! with the SPIFFE URI SAN `spiffe://<trust-domain>/ns/<ns>/sa/<sa>`.

use std::time::Duration;

use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, SanType, string::Ia5String};

use crate::config::KeyType;

#[derive(Debug, thiserror::Error)]
pub enum CsrError {
    #[error("key generation: {0}")]
    Key(String),
    #[error("CSR: {0}")]
    Csr(String),
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
    pub fn key_and_csr(&self) -> Result<(KeyPair, String), CsrError> {
        let key = match self.key_type {
            KeyType::EcdsaP256 => KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
                .map_err(|e| CsrError::Key(e.to_string()))?,
            // ring (the crypto backend here) signs RSA but cannot generate
            // RSA keys: the `rsa` crate generates, ring signs.
            KeyType::Rsa2048 => {
                use rsa::pkcs8::EncodePrivateKey;
                let k = rsa::RsaPrivateKey::new(&mut rsa::rand_core::OsRng, 2048)
                    .map_err(|e| CsrError::Key(e.to_string()))?;
                let der = k.to_pkcs8_der().map_err(|e| CsrError::Key(e.to_string()))?;
                KeyPair::from_pkcs8_der_and_sign_algo(
                    &rustls::pki_types::PrivatePkcs8KeyDer::from(der.as_bytes()),
                    &rcgen::PKCS_RSA_SHA256,
                )
                .map_err(|e| CsrError::Key(e.to_string()))?
            }
        };
        let mut p = CertificateParams::default();
        p.distinguished_name = DistinguishedName::new();
        p.distinguished_name
            .push(DnType::OrganizationName, self.trust_domain.clone());
        let uri =
            Ia5String::try_from(self.spiffe_id()).map_err(|e| CsrError::Csr(e.to_string()))?;
        p.subject_alt_names = vec![SanType::URI(uri)];
        let csr = p
            .serialize_request(&key)
            .and_then(|r| r.pem())
            .map_err(|e| CsrError::Csr(e.to_string()))?;
        Ok((key, csr))
    }
}

#[cfg(test)]
mod tests {
    use super::super::ca_client::Issuer;
    use super::super::output::bundle_from_chain;
    use super::super::testing::{fake_ca, ident};
    use super::*;
    use rcgen::CertificateSigningRequestParams;

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
}
