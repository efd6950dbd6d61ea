//! `istio.v1.auth.IstioCertificateService/CreateCertificate`: authenticate
//! the caller, check the CSR asks for exactly the caller's identity, sign.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use remora_proto::istio::v1::auth::istio_certificate_service_server::IstioCertificateService;
use remora_proto::istio::v1::auth::{IstioCertificateRequest, IstioCertificateResponse};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use super::Metrics;
use super::authn::{AuthError, Authenticate, Caller, Gate, bearer};
use super::keeper::Authority;
use super::signer::SignError;
use crate::pod_events::{PodEvents, Warning};

pub use crate::grpc_server::Peer;

/// Lifetimes granted.
#[derive(Debug, Clone, Copy)]
pub struct Lifetimes {
    /// When the request asks for none (0 or negative).
    pub default: Duration,
    pub max: Duration,
}

impl Lifetimes {
    /// The lifetime granted for `asked` seconds.
    pub fn grant(&self, asked: i64) -> Duration {
        match u64::try_from(asked) {
            Ok(s) if s > 0 => Duration::from_secs(s).min(self.max),
            _ => self.default.min(self.max),
        }
    }
}

/// Why a request was refused.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error(transparent)]
    Sign(#[from] SignError),
    #[error("the CA has no signing root yet")]
    NotReady,
}

impl Refusal {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Auth(e) => e.reason(),
            Self::Sign(e) => e.reason(),
            Self::NotReady => "not_ready",
        }
    }

    fn status(&self) -> Status {
        let msg = self.to_string();
        match self {
            Self::Auth(AuthError::Review(_) | AuthError::Throttled(_)) | Self::NotReady => {
                Status::unavailable(msg)
            }
            Self::Auth(_) => Status::unauthenticated(msg),
            Self::Sign(SignError::WrongIdentity { .. }) => Status::permission_denied(msg),
            Self::Sign(SignError::Sign(_)) => Status::internal(msg),
            Self::Sign(_) => Status::invalid_argument(msg),
        }
    }
}

pub struct CaService<A> {
    pub auth: A,
    /// What a token must pass before `auth` is asked about it.
    pub gate: Gate,
    pub authority: watch::Receiver<Option<Arc<Authority>>>,
    pub trust_domain: String,
    pub lifetimes: Lifetimes,
    pub metrics: Metrics,
    /// Events for refusals of a known caller (on its pod); `None` in tests.
    pub events: Option<PodEvents>,
}

impl<A: Authenticate> CaService<A> {
    /// The whole decision, apart from gRPC; `Err` carries the caller when
    /// known. `source` is the caller's address, for its share of reviews.
    pub async fn decide(
        &self,
        authorization: Option<&str>,
        source: Option<IpAddr>,
        req: &IstioCertificateRequest,
    ) -> Result<Vec<String>, (Refusal, Option<Caller>)> {
        let token = bearer(authorization).map_err(|e| (e.into(), None))?;
        let caller = self
            .gate
            .authenticate(&self.auth, token, source)
            .await
            .map_err(|e| (e.into(), None))?;
        let identity = remora_contract::workload_ca::spiffe_id(
            &self.trust_domain,
            &caller.namespace,
            &caller.service_account,
        );
        let Some(authority) = self.authority.borrow().clone() else {
            return Err((Refusal::NotReady, Some(caller)));
        };
        let ttl = self.lifetimes.grant(req.validity_duration);
        let csr = req.csr.clone();
        // Signing is CPU work; keep it off the runtime's threads.
        let signed = tokio::task::spawn_blocking(move || {
            authority
                .signer
                .sign(&csr, &identity, ttl, SystemTime::now())
        })
        .await
        .map_err(|e| {
            (
                Refusal::Sign(SignError::Sign(e.to_string())),
                Some(caller.clone()),
            )
        })?;
        signed.map_err(|e| (e.into(), Some(caller)))
    }

    /// A Warning Event on the caller's pod.
    fn record(&self, refusal: &Refusal, caller: &Caller) {
        let (Some(events), Some(pod)) = (&self.events, &caller.pod) else {
            return;
        };
        events.warn(Warning {
            namespace: caller.namespace.clone(),
            pod: pod.clone(),
            reason: "CertificateRefused",
            action: "IssueCertificate",
            note: refusal.to_string(),
        });
    }
}

#[tonic::async_trait]
impl<A: Authenticate> IstioCertificateService for CaService<A> {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        let started = Instant::now();
        let authorization = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let source = request.extensions().get::<Peer>().map(|p| p.0);
        let req = request.into_inner();
        let result = self.decide(authorization.as_deref(), source, &req).await;
        self.metrics.observe(started.elapsed());
        match result {
            Ok(cert_chain) => {
                self.metrics.issued();
                let mut response = Response::new(IstioCertificateResponse { cert_chain });
                attach_trust_bundle(&mut response, &self.authority);
                Ok(response)
            }
            Err((refusal, caller)) => {
                self.metrics.refused(refusal.reason());
                // Never the token: the refusal's text does not carry it.
                // A refusal of no known caller (no or a bad token) costs
                // any pod one request to cause: debug, counted all the same.
                match &caller {
                    Some(c) => tracing::info!(reason = refusal.reason(), namespace = %c.namespace,
                        service_account = %c.service_account, pod = c.pod.as_deref(),
                        error = %refusal, "workload CA: certificate refused"),
                    None => tracing::debug!(reason = refusal.reason(), error = %refusal,
                        "workload CA: certificate refused"),
                }
                if let Some(c) = &caller {
                    self.record(&refusal, c);
                }
                Err(refusal.status())
            }
        }
    }
}

/// Adds every root the mesh trusts now to a successful answer, as
/// [`TRUST_BUNDLE_METADATA`](remora_contract::workload_ca::TRUST_BUNDLE_METADATA):
/// the sidecar trusts its peers by these roots, which reach it over this
/// verified connection, never by the ConfigMap a tenant can write. Read
/// after signing: a rotation in between still leaves the leaf's root in it
/// (a switched root is kept as the retiring one), and the sidecar adds the
/// chain's root in any case.
fn attach_trust_bundle<T>(
    response: &mut Response<T>,
    authority: &watch::Receiver<Option<Arc<Authority>>>,
) {
    let Some(bundle) = authority.borrow().as_ref().map(|a| a.bundle.clone()) else {
        return;
    };
    response.metadata_mut().insert_bin(
        tonic::metadata::BinaryMetadataKey::from_static(
            remora_contract::workload_ca::TRUST_BUNDLE_METADATA,
        ),
        tonic::metadata::BinaryMetadataValue::from_bytes(bundle.as_bytes()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::workload_ca::authn::GateLimits;
    use crate::pki::workload_ca::testing;
    use rcgen::{CertificateParams, KeyPair, SanType};
    use remora_test_support::jwt;

    /// JWT-shaped tokens the [`FakeReviewer`] knows: web/default's, and
    /// one refused as the API server refuses a token of a deleted pod.
    fn token(which: &str) -> String {
        let nonce = match which {
            "good" => 1,
            "revoked" => 2,
            _ => 3,
        };
        // A fixed `exp` (in 2096), so the same name gives the same token.
        jwt::service_account("remora-ca", 4_000_000_000, nonce)
    }

    fn bearer_of(which: &str) -> String {
        format!("Bearer {}", token(which))
    }

    /// Test double of the API server's TokenReview.
    struct FakeReviewer;

    impl Authenticate for FakeReviewer {
        async fn authenticate(&self, t: &str) -> Result<Caller, AuthError> {
            match t {
                t if t == token("good") => Ok(Caller {
                    namespace: "web".into(),
                    service_account: "default".into(),
                    pod: Some("web-0".into()),
                }),
                t if t == token("revoked") => Err(AuthError::Rejected(
                    "the pod the token is bound to is gone".into(),
                )),
                _ => Err(AuthError::Rejected("invalid bearer token".into())),
            }
        }
    }

    fn service(ready: bool) -> CaService<FakeReviewer> {
        let authority =
            ready.then(|| Arc::new(testing::authority(&["ca.test"]).expect("authority")));
        let (_tx, rx) = watch::channel(authority);
        CaService {
            auth: FakeReviewer,
            gate: Gate::new("remora-ca", GateLimits::default()),
            authority: rx,
            trust_domain: "cluster.local".into(),
            lifetimes: Lifetimes {
                default: Duration::from_secs(3600),
                max: Duration::from_secs(7200),
            },
            metrics: Metrics::default(),
            events: None,
        }
    }

    fn csr(id: &str) -> String {
        let key = KeyPair::generate().expect("key");
        let mut p = CertificateParams::default();
        p.subject_alt_names = vec![SanType::URI(id.try_into().expect("uri"))];
        p.serialize_request(&key).expect("csr").pem().expect("pem")
    }

    fn req(csr: String, ttl: i64) -> IstioCertificateRequest {
        IstioCertificateRequest {
            csr,
            validity_duration: ttl,
            metadata: None,
        }
    }

    const ME: &str = "spiffe://cluster.local/ns/web/sa/default";

    #[tokio::test]
    async fn issues_for_the_tokens_identity_and_refuses_the_rest() {
        let s = service(true);
        let good = bearer_of("good");
        let chain = s
            .decide(Some(&good), None, &req(csr(ME), 600))
            .await
            .expect("issued");
        assert_eq!(chain.len(), 2);
        let (revoked, other) = (bearer_of("revoked"), bearer_of("someone-else"));
        let cases: [(Option<&str>, IstioCertificateRequest, &str, tonic::Code); 7] = [
            (
                None,
                req(csr(ME), 600),
                "no_token",
                tonic::Code::Unauthenticated,
            ),
            (
                Some("Bearer not-a-jwt"),
                req(csr(ME), 600),
                "bad_token",
                tonic::Code::Unauthenticated,
            ),
            (
                Some(&revoked),
                req(csr(ME), 600),
                "bad_token",
                tonic::Code::Unauthenticated,
            ),
            (
                Some(&other),
                req(csr(ME), 600),
                "bad_token",
                tonic::Code::Unauthenticated,
            ),
            (
                Some(&good),
                req(csr("spiffe://cluster.local/ns/web/sa/admin"), 600),
                "wrong_identity",
                tonic::Code::PermissionDenied,
            ),
            (
                Some(&good),
                req("garbage".into(), 600),
                "bad_csr",
                tonic::Code::InvalidArgument,
            ),
            (
                Some(&good),
                req(String::new(), -5),
                "bad_csr",
                tonic::Code::InvalidArgument,
            ),
        ];
        for (auth, r, reason, code) in cases {
            let (refusal, _) = s.decide(auth, None, &r).await.expect_err(reason);
            assert_eq!(refusal.reason(), reason, "{refusal}");
            assert_eq!(refusal.status().code(), code, "{refusal}");
            assert!(!refusal.to_string().contains("gone") || reason == "bad_token");
        }
        let (refusal, caller) = service(false)
            .decide(Some(&good), None, &req(csr(ME), 600))
            .await
            .expect_err("no root yet");
        assert_eq!(refusal.reason(), "not_ready");
        assert_eq!(refusal.status().code(), tonic::Code::Unavailable);
        assert!(caller.is_some());
        let throttled = Refusal::Auth(AuthError::Throttled("in total"));
        assert_eq!(throttled.status().code(), tonic::Code::Unavailable);
    }

    /// The answer carries the CA's whole trust set as binary metadata.
    #[tokio::test]
    async fn an_issued_certificate_comes_with_the_trust_bundle() {
        let s = service(true);
        let bundle = s
            .authority
            .borrow()
            .as_ref()
            .expect("authority")
            .bundle
            .clone();
        let mut request = Request::new(req(csr(ME), 600));
        request
            .metadata_mut()
            .insert("authorization", bearer_of("good").parse().expect("value"));
        let response = s.create_certificate(request).await.expect("issued");
        let sent = response
            .metadata()
            .get_bin(remora_contract::workload_ca::TRUST_BUNDLE_METADATA)
            .expect("trust bundle metadata")
            .to_bytes()
            .expect("base64");
        assert_eq!(sent.as_ref(), bundle.as_bytes());
        assert!(bundle.contains("BEGIN CERTIFICATE"));
        // A refusal carries none.
        let refused = s
            .create_certificate(Request::new(req(csr(ME), 600)))
            .await
            .expect_err("no token");
        assert!(
            refused
                .metadata()
                .get_bin(remora_contract::workload_ca::TRUST_BUNDLE_METADATA)
                .is_none()
        );
    }

    #[test]
    fn lifetimes_are_capped() {
        let l = Lifetimes {
            default: Duration::from_secs(3600),
            max: Duration::from_secs(7200),
        };
        assert_eq!(l.grant(600), Duration::from_secs(600));
        assert_eq!(l.grant(0), Duration::from_secs(3600));
        assert_eq!(l.grant(-1), Duration::from_secs(3600));
        assert_eq!(l.grant(i64::MAX), Duration::from_secs(7200));
    }
}
