//! The CA client: the [`Issuer`] interface the renewal loop calls, and its
//! implementation over gRPC (`IstioCertificateService/CreateCertificate`,
//! bearer token, cluster id, and the trust bundle the CA sends in the
//! answer's metadata).

use std::path::PathBuf;
use std::time::Duration;

use remora_proto::istio::v1::auth::IstioCertificateRequest;
use remora_proto::istio::v1::auth::istio_certificate_service_client::IstioCertificateServiceClient;
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use super::union_roots;

#[derive(Debug, thiserror::Error)]
pub enum CaError {
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
        crate::token::read(&self.token_path)
            .await
            .map_err(|reason| CaError::Token {
                path: self.token_path.clone(),
                reason,
            })
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

#[cfg(test)]
mod tests {
    use super::*;
    use remora_test_support::pki::Ca;

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
}
