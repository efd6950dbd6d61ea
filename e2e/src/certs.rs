//! Workload certificates for the certificate rotation test
//! (`tests/local/cert_rotation.rs`): one root, a client certificate for the
//! load (mTLS), and serving certificates as the Secret data that
//! `remora-agent --cert-dir` reads.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use remora_agent::certs::{CERT_CHAIN_FILE, KEY_FILE, ROOT_CERT_FILE};
use remora_test_support::pki::{Ca, ClientConfigError, KeyPair, Leaf, client_config};

use crate::traffic::fingerprint;

/// A root CA and a client certificate it signed.
pub struct Pki {
    ca: Ca,
    pub root_pem: String,
    client: Leaf,
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
    pub fn new(root_cn: &str, client_id: &str) -> Self {
        let ca = Ca::new(root_cn);
        let client = ca.issue().uri(client_id).client_auth().sign();
        Self {
            root_pem: ca.pem.clone(),
            ca,
            client,
        }
    }

    /// A client that trusts the root and presents the client certificate,
    /// without session resumption (every connection shows the certificate
    /// the server holds at that moment).
    pub fn client_config(&self) -> Result<Arc<rustls::ClientConfig>, ClientConfigError> {
        client_config(&self.root_pem, Some(&self.client))
    }

    /// A serving certificate for `key` with DNS SANs `names` and a URI SAN
    /// `id`, valid from a minute ago for an hour, with serial `serial`
    /// (explicit: rcgen would derive it from the key, and a renewal keeps
    /// the key).
    pub fn serving(&self, serial: u64, key: &KeyPair, names: &[&str], id: &str) -> Serving {
        let cert = self
            .ca
            .issue()
            .names(names)
            .uri(id)
            .serial(serial)
            .valid_for(Duration::from_secs(3600))
            .server_auth()
            .client_auth()
            .key(key)
            .sign();
        let files = [
            (CERT_CHAIN_FILE, cert.chain),
            (KEY_FILE, cert.key),
            (ROOT_CERT_FILE, self.root_pem.clone()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.into_bytes()))
        .collect();
        Serving {
            files,
            fingerprint: fingerprint(&cert.der),
            serial: cert.serial,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewals_with_the_same_key_are_different_certificates() {
        let pki = Pki::new("root", "spiffe://cluster.local/ns/t/sa/client");
        let key = remora_test_support::pki::new_key();
        let names = ["web.t.svc"];
        let id = "spiffe://cluster.local/ns/t/sa/web";
        let a = pki.serving(1, &key, &names, id);
        let b = pki.serving(2, &key, &names, id);
        assert_ne!(a.fingerprint, b.fingerprint);
        assert_ne!(a.serial, b.serial);
        assert_eq!(a.files[KEY_FILE], b.files[KEY_FILE], "same key");
        // What the agent accepts as a bundle.
        let bundle = remora_agent::certs::validate_bundle(
            String::from_utf8(b.files[CERT_CHAIN_FILE].clone()).expect("utf8"),
            String::from_utf8(b.files[KEY_FILE].clone()).expect("utf8"),
            pki.root_pem.clone(),
            std::time::SystemTime::now(),
        )
        .expect("valid bundle");
        assert_eq!(bundle.serial.replace(':', "").to_lowercase(), b.serial);
        pki.client_config().expect("client config");
    }
}
