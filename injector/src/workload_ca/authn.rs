//! Who is calling: the bearer token (the pod's projected service-account
//! token, minted for [`remora_contract::workload_ca::TOKEN_AUDIENCE`]) is
//! checked by the API server with a TokenReview for that audience. The token
//! itself is never logged, nor put in an error.

use std::future::Future;

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::{Api, PostParams};

/// A caller the API server vouched for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub namespace: String,
    pub service_account: String,
    /// From the token's pod binding, when it has one: where Events go.
    pub pod: Option<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    #[error("no bearer token in the `authorization` metadata")]
    Missing,
    #[error("the token was not accepted: {0}")]
    Rejected(String),
    #[error("the token is not a service account's (user {0:?})")]
    NotServiceAccount(String),
    #[error("the token is not for audience {0:?}")]
    WrongAudience(String),
    #[error("the TokenReview failed: {0}")]
    Review(String),
}

impl AuthError {
    /// The metrics label.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Missing => "no_token",
            Self::Rejected(_) | Self::NotServiceAccount(_) | Self::WrongAudience(_) => "bad_token",
            Self::Review(_) => "review_failed",
        }
    }
}

/// Something that tells who a token belongs to: the API server, or a test
/// double in the unit tests.
pub trait Authenticate: Send + Sync + 'static {
    fn authenticate(&self, token: &str) -> impl Future<Output = Result<Caller, AuthError>> + Send;
}

/// `Bearer <token>` → the token.
pub fn bearer(header: Option<&str>) -> Result<&str, AuthError> {
    let h = header.ok_or(AuthError::Missing)?.trim();
    let token = h
        .strip_prefix("Bearer ")
        .or_else(|| h.strip_prefix("bearer "))
        .ok_or(AuthError::Missing)?
        .trim();
    if token.is_empty() {
        return Err(AuthError::Missing);
    }
    Ok(token)
}

/// `system:serviceaccount:<ns>:<name>` → (ns, name).
pub fn service_account(username: &str) -> Option<(&str, &str)> {
    let rest = username.strip_prefix("system:serviceaccount:")?;
    let (ns, name) = rest.split_once(':')?;
    (!ns.is_empty() && !name.is_empty() && !name.contains(':')).then_some((ns, name))
}

/// The API server's TokenReview.
#[derive(Clone)]
pub struct TokenReviewer {
    api: Api<TokenReview>,
    audience: String,
}

impl TokenReviewer {
    pub fn new(client: kube::Client, audience: &str) -> Self {
        Self {
            api: Api::all(client),
            audience: audience.to_string(),
        }
    }
}

/// The answer of a TokenReview, judged.
pub fn judge(review: &TokenReview, audience: &str) -> Result<Caller, AuthError> {
    let status = review
        .status
        .as_ref()
        .ok_or_else(|| AuthError::Review("no status in the answer".into()))?;
    if status.authenticated != Some(true) {
        return Err(AuthError::Rejected(
            status
                .error
                .clone()
                .filter(|e| !e.is_empty())
                .unwrap_or_else(|| "not authenticated".into()),
        ));
    }
    // The API server checks the audience when one is asked for and says
    // which it matched; an answer without ours is a refusal.
    if !status
        .audiences
        .as_ref()
        .is_some_and(|a| a.iter().any(|x| x == audience))
    {
        return Err(AuthError::WrongAudience(audience.to_string()));
    }
    let user = status.user.as_ref();
    let username = user.and_then(|u| u.username.as_deref()).unwrap_or_default();
    let (namespace, sa) = service_account(username)
        .ok_or_else(|| AuthError::NotServiceAccount(username.to_string()))?;
    let pod = user
        .and_then(|u| u.extra.as_ref())
        .and_then(|e| e.get("authentication.kubernetes.io/pod-name"))
        .and_then(|v| v.first())
        .cloned();
    Ok(Caller {
        namespace: namespace.to_string(),
        service_account: sa.to_string(),
        pod,
    })
}

impl Authenticate for TokenReviewer {
    async fn authenticate(&self, token: &str) -> Result<Caller, AuthError> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_string(),
                audiences: Some(vec![self.audience.clone()]),
            },
            ..Default::default()
        };
        let answer = self
            .api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| AuthError::Review(e.to_string()))?;
        judge(&answer, &self.audience)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::authentication::v1::{TokenReviewStatus, UserInfo};

    fn answer(auth: bool, user: &str, audiences: &[&str], error: Option<&str>) -> TokenReview {
        TokenReview {
            status: Some(TokenReviewStatus {
                authenticated: Some(auth),
                audiences: Some(audiences.iter().map(|s| s.to_string()).collect()),
                error: error.map(str::to_string),
                user: Some(UserInfo {
                    username: Some(user.into()),
                    extra: Some(
                        [(
                            "authentication.kubernetes.io/pod-name".to_string(),
                            vec!["web-0".to_string()],
                        )]
                        .into(),
                    ),
                    ..Default::default()
                }),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn bearer_tokens() {
        assert_eq!(bearer(Some("Bearer abc")), Ok("abc"));
        assert_eq!(bearer(None), Err(AuthError::Missing));
        assert_eq!(bearer(Some("Basic abc")), Err(AuthError::Missing));
        assert_eq!(bearer(Some("Bearer ")), Err(AuthError::Missing));
    }

    #[test]
    fn judges_the_answer() {
        let sa = "system:serviceaccount:web:default";
        assert_eq!(
            judge(&answer(true, sa, &["remora-ca"], None), "remora-ca"),
            Ok(Caller {
                namespace: "web".into(),
                service_account: "default".into(),
                pod: Some("web-0".into())
            })
        );
        let e = judge(
            &answer(false, "", &[], Some("service account token has expired")),
            "remora-ca",
        )
        .unwrap_err();
        assert!(e.to_string().contains("expired"), "{e}");
        assert_eq!(e.reason(), "bad_token");
        assert_eq!(
            judge(&answer(true, sa, &["api"], None), "remora-ca"),
            Err(AuthError::WrongAudience("remora-ca".into()))
        );
        assert!(matches!(
            judge(&answer(true, "alice", &["remora-ca"], None), "remora-ca"),
            Err(AuthError::NotServiceAccount(_))
        ));
        assert_eq!(service_account("system:serviceaccount:a:b:c"), None);
        assert_eq!(service_account("system:serviceaccount::b"), None);
        assert!(judge(&TokenReview::default(), "remora-ca").is_err());
    }
}
