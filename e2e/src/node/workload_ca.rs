//! The workload CA on the node: a client of its gRPC service from the host
//! (the bad-input tests and the CA bench), service-account tokens from the
//! TokenRequest API, CSRs, and what a sidecar's Envoy says about the
//! certificates it holds.

use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, ServiceAccount};
use kube::Client;
use kube::api::{Api, PostParams};
use remora_contract::workload_ca::{PORT, TRUST_BUNDLE_CONFIGMAP, TRUST_BUNDLE_KEY};
use remora_proto::istio::v1::auth::IstioCertificateRequest;
use remora_proto::istio::v1::auth::istio_certificate_service_client::IstioCertificateServiceClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use super::{Error, Remora};

fn failed(what: impl Into<String>, detail: impl ToString) -> Error {
    Error::Failed {
        what: what.into(),
        detail: detail.to_string(),
    }
}

/// The trust bundle the leader wrote in `namespace`, once it is there.
pub async fn trust_bundle(client: &Client, namespace: &str) -> Result<Option<String>, Error> {
    let cm = Api::<ConfigMap>::namespaced(client.clone(), namespace)
        .get_opt(TRUST_BUNDLE_CONFIGMAP)
        .await?;
    Ok(cm
        .and_then(|c| c.data)
        .and_then(|d| d.get(TRUST_BUNDLE_KEY).cloned()))
}

/// Waits (up to `deadline`) for the trust bundle in `namespace`; returns it.
pub async fn wait_trust_bundle(
    client: &Client,
    namespace: &str,
    deadline: Duration,
) -> Result<String, Error> {
    super::wait_until(deadline, "the trust bundle ConfigMap", || async {
        Ok::<_, Error>(match trust_bundle(client, namespace).await? {
            Some(b) if !b.trim().is_empty() => super::Check::Done(b),
            _ => super::Check::NotYet("not written yet".into()),
        })
    })
    .await
}

/// The signing Secret's current root (`root-cert.pem`), staged root and
/// retiring root, as PEM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SigningRoots {
    pub current: String,
    pub next: Option<String>,
    pub previous: Option<String>,
}

pub async fn signing_roots(
    client: &Client,
    remora: &Remora,
) -> Result<Option<SigningRoots>, Error> {
    let s = Api::<Secret>::namespaced(client.clone(), &remora.namespace)
        .get_opt(remora_contract::workload_ca::SIGNING_SECRET)
        .await?;
    let Some(data) = s.and_then(|s| s.data) else {
        return Ok(None);
    };
    let text = |k: &str| {
        data.get(k)
            .map(|b| String::from_utf8_lossy(&b.0).into_owned())
            .filter(|t| !t.trim().is_empty())
    };
    Ok(text("root-cert.pem").map(|current| SigningRoots {
        current,
        next: text("next-cert.pem"),
        previous: text("previous-cert.pem"),
    }))
}

/// The serial numbers of the certificates in `pem`, as Envoy's `/certs`
/// prints them (lowercase hex, no separators).
pub fn serials(pem: &str) -> Vec<String> {
    x509_parser::pem::Pem::iter_from_buffer(pem.as_bytes())
        .filter_map(Result::ok)
        .filter_map(|p| {
            p.parse_x509().ok().map(|c| {
                c.raw_serial()
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
            })
        })
        .map(|s| s.trim_start_matches('0').to_string())
        .collect()
}

/// What a sidecar's Envoy holds (admin `/certs`, through a port-forward).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnvoyCerts {
    /// The workload certificate's serial and URI SANs.
    pub leaf_serial: Option<String>,
    pub leaf_uris: Vec<String>,
    /// The trusted roots' serials.
    pub root_serials: Vec<String>,
}

pub async fn envoy_certs(client: &Client, namespace: &str, pod: &str) -> Result<EnvoyCerts, Error> {
    let (status, body) = super::pod_http_get(
        client,
        namespace,
        pod,
        remora_contract::pod::ENVOY_ADMIN_PORT,
        "/certs",
    )
    .await?;
    if !status.is_success() {
        return Err(failed(format!("/certs of {namespace}/{pod}"), status));
    }
    let v: serde_json::Value = serde_json::from_str(&body)
        .map_err(|e| failed(format!("/certs of {namespace}/{pod}"), e))?;
    let mut out = EnvoyCerts::default();
    let norm = |s: &str| s.to_ascii_lowercase().trim_start_matches('0').to_string();
    for c in v["certificates"].as_array().into_iter().flatten() {
        for ca in c["ca_cert"].as_array().into_iter().flatten() {
            if let Some(s) = ca["serial_number"].as_str() {
                let s = norm(s);
                if !out.root_serials.contains(&s) {
                    out.root_serials.push(s);
                }
            }
        }
        if let Some(leaf) = c["cert_chain"].as_array().and_then(|a| a.first()) {
            out.leaf_serial = leaf["serial_number"].as_str().map(norm);
            out.leaf_uris = leaf["subject_alt_names"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s["uri"].as_str().map(str::to_string))
                .collect();
        }
    }
    out.root_serials.sort();
    Ok(out)
}

/// A token of ServiceAccount `namespace/sa` for `audience`, from the
/// TokenRequest API; bound to `pod` when given.
pub async fn token(
    client: &Client,
    namespace: &str,
    sa: &str,
    audience: &str,
    pod: Option<&Pod>,
) -> Result<String, Error> {
    let req = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: Some(vec![audience.to_string()]),
            expiration_seconds: Some(600),
            bound_object_ref: pod.map(|p| BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: p.metadata.name.clone(),
                uid: p.metadata.uid.clone(),
            }),
        }),
        ..Default::default()
    };
    let answer = Api::<ServiceAccount>::namespaced(client.clone(), namespace)
        .create_token_request(sa, &PostParams::default(), &req)
        .await?;
    answer
        .status
        .and_then(|s| s.token)
        .ok_or_else(|| failed(format!("a token for {namespace}/{sa}"), "no status"))
}

/// A fresh ECDSA P-256 key's CSR asking for `uri` (what the agent sends).
pub fn csr(uri: &str) -> Result<String, Error> {
    use rcgen::{CertificateParams, KeyPair, SanType};
    let key =
        KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(|e| failed("key", e))?;
    let mut p = CertificateParams::default();
    p.subject_alt_names = vec![SanType::URI(uri.try_into().map_err(|e| failed("uri", e))?)];
    p.serialize_request(&key)
        .and_then(|r| r.pem())
        .map_err(|e| failed("CSR", e))
}

/// A client of the CA on one operator pod, verifying it with `bundle` under
/// the Service's name (as the sidecars do).
#[derive(Clone)]
pub struct CaClient {
    inner: IstioCertificateServiceClient<Channel>,
}

impl CaClient {
    pub fn connect(pod_ip: IpAddr, server_name: &str, bundle: &str) -> Result<Self, Error> {
        Self::connect_addr(std::net::SocketAddr::new(pod_ip, PORT), server_name, bundle)
    }

    /// As [`CaClient::connect`], to any address (the Service's ClusterIP).
    pub fn connect_addr(
        addr: std::net::SocketAddr,
        server_name: &str,
        bundle: &str,
    ) -> Result<Self, Error> {
        let url = format!("https://{addr}");
        let ep = Endpoint::from_shared(url.clone())
            .map_err(|e| failed(&url, e))?
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(20))
            .tls_config(
                ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(bundle))
                    .domain_name(server_name),
            )
            .map_err(|e| failed(&url, e))?;
        Ok(Self {
            inner: IstioCertificateServiceClient::new(ep.connect_lazy()),
        })
    }

    /// One CreateCertificate; `token` goes in `authorization` when given.
    pub async fn create(
        &self,
        token: Option<&str>,
        csr: String,
        ttl: Duration,
    ) -> Result<Vec<String>, tonic::Status> {
        self.create_with_trust_bundle(token, csr, ttl)
            .await
            .map(|(chain, _)| chain)
    }

    /// [`CaClient::create`], with the trust bundle the CA sent as response
    /// metadata ([`TRUST_BUNDLE_METADATA`](remora_contract::workload_ca::TRUST_BUNDLE_METADATA)).
    pub async fn create_with_trust_bundle(
        &self,
        token: Option<&str>,
        csr: String,
        ttl: Duration,
    ) -> Result<(Vec<String>, Option<String>), tonic::Status> {
        let mut req = tonic::Request::new(IstioCertificateRequest {
            csr,
            validity_duration: i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX),
            metadata: None,
        });
        if let Some(t) = token {
            let v = format!("Bearer {t}")
                .parse()
                .map_err(|_| tonic::Status::invalid_argument("token not a header value"))?;
            req.metadata_mut().insert("authorization", v);
        }
        let r = self.inner.clone().create_certificate(req).await?;
        let bundle = r
            .metadata()
            .get_bin(remora_contract::workload_ca::TRUST_BUNDLE_METADATA)
            .and_then(|v| v.to_bytes().ok())
            .map(|b| String::from_utf8_lossy(&b).into_owned());
        Ok((r.into_inner().cert_chain, bundle))
    }
}

/// The sum of every series of metric `name` in a Prometheus text exposition.
pub fn sum_series(text: &str, name: &str) -> f64 {
    sum_matching(text, name, "")
}

/// The sum of every series whose metric name starts with `prefix` and ends
/// with `suffix`. Envoy folds a cluster name with dots (an IP) into the
/// metric name, so a cluster's series is found by both ends.
pub fn sum_matching(text: &str, prefix: &str, suffix: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let name = series.split('{').next()?;
            (name.starts_with(prefix) && name.ends_with(suffix))
                .then(|| value.parse::<f64>().ok())?
        })
        .sum()
}
