//! Who is calling: the bearer token (the pod's projected service-account
//! token, minted for [`remora_contract::workload_ca::TOKEN_AUDIENCE`]) is
//! checked by the API server with a TokenReview for that audience. The token
//! itself is never logged, nor put in an error.
//!
//! A TokenReview costs the API server (and, under API priority and
//! fairness, the operator's own requests) something, so the [`Gate`] stands
//! before it: a token that is not a JWT for our audience with a future
//! `exp` is refused without one; a token the API server accepted is
//! remembered (by its SHA-256) until its `exp`, at most
//! [`GateLimits::cache_max_age`]; and reviews are rate-limited in total and
//! per source address.

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::{Api, PostParams};
use leaky_bucket::RateLimiter;
use sha2::{Digest, Sha256};

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
    /// Refused before any TokenReview; the text says what was wrong, never
    /// what the token holds.
    #[error("the token is not a service-account token for audience {audience:?}: {what}")]
    NotOurs { audience: String, what: String },
    #[error("too many token reviews {0}; try again shortly")]
    Throttled(&'static str),
}

impl AuthError {
    /// The metrics label.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Missing => "no_token",
            Self::Rejected(_)
            | Self::NotServiceAccount(_)
            | Self::WrongAudience(_)
            | Self::NotOurs { .. } => "bad_token",
            Self::Review(_) => "review_failed",
            Self::Throttled(_) => "review_throttled",
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

/// Far longer than any service-account token (about 1 KiB).
const MAX_TOKEN_BYTES: usize = 16 * 1024;

/// JWT parts are base64url; padding is tolerated, not required.
const JWT_BASE64: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::URL_SAFE,
    base64::engine::GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
);

#[derive(serde::Deserialize)]
struct JwtHeader {
    alg: String,
}

/// Whether `token` can be a service-account token for `audience` that is
/// still valid at `now` (give or take `skew`): three base64url parts, a
/// header naming a signing algorithm other than `none`, claims whose `aud`
/// holds `audience` and whose `exp` is not past. The signature is the API
/// server's to check. Returns `exp`.
pub fn precheck(
    token: &str,
    audience: &str,
    now: SystemTime,
    skew: Duration,
) -> Result<SystemTime, AuthError> {
    let not_ours = |what: String| AuthError::NotOurs {
        audience: audience.to_string(),
        what,
    };
    if token.len() > MAX_TOKEN_BYTES {
        return Err(not_ours(format!(
            "{} bytes long, more than {MAX_TOKEN_BYTES}",
            token.len()
        )));
    }
    let parts: Vec<&str> = token.split('.').collect();
    let [header, claims, signature] = parts[..] else {
        return Err(not_ours(format!(
            "not a JWT ({} dot-separated parts, not 3)",
            parts.len()
        )));
    };
    let decode = |part: &str, name: &str| {
        JWT_BASE64
            .decode(part)
            .map_err(|_| not_ours(format!("the JWT {name} is not base64url")))
    };
    let header: JwtHeader = serde_json::from_slice(&decode(header, "header")?)
        .map_err(|_| not_ours("the JWT header is not JSON with an `alg`".into()))?;
    if header.alg.eq_ignore_ascii_case("none") {
        return Err(not_ours("an unsigned JWT (`alg` none)".into()));
    }
    if decode(signature, "signature")?.is_empty() {
        return Err(not_ours("the JWT has no signature".into()));
    }
    let claims: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&decode(claims, "claims")?)
            .map_err(|_| not_ours("the JWT claims are not a JSON object".into()))?;
    let ours = match claims.get("aud") {
        Some(serde_json::Value::String(a)) => a == audience,
        Some(serde_json::Value::Array(a)) => a.iter().any(|a| a.as_str() == Some(audience)),
        Some(_) => return Err(not_ours("`aud` is neither a string nor a list".into())),
        None => return Err(not_ours("no `aud` claim".into())),
    };
    if !ours {
        return Err(not_ours("`aud` does not hold it".into()));
    }
    let exp = claims
        .get("exp")
        .and_then(serde_json::Value::as_f64)
        .filter(|e| e.is_finite() && *e >= 0.0)
        .ok_or_else(|| not_ours("no numeric `exp` claim".into()))?;
    // Capped at some 30,000 years, which SystemTime holds.
    let exp = SystemTime::UNIX_EPOCH
        .checked_add(Duration::from_secs_f64(exp.min(1e12)))
        .unwrap_or(now);
    if let Ok(ago) = now.duration_since(exp)
        && ago > skew
    {
        return Err(not_ours(format!("expired {} s ago", ago.as_secs())));
    }
    Ok(exp)
}

/// The [`Gate`]'s bounds; [`GateLimits::default`] is the operator's.
#[derive(Debug, Clone, Copy)]
pub struct GateLimits {
    /// TokenReviews per second, over all callers. A sidecar needs one per
    /// renewal (about every 12 h) and one at start: 20/s is 1,200 new pods
    /// a minute, more than this cluster's API server starts, and little
    /// next to what API priority and fairness gives a workload-high flow.
    pub reviews_per_second: u32,
    /// Reviews that may be made at once after a quiet spell (a rollout).
    pub burst: u32,
    /// TokenReviews per second for one source address: a pod has one
    /// token; 1/s, 5 at once, is plenty for its retries.
    pub per_source_per_second: u32,
    pub per_source_burst: u32,
    /// Source addresses tracked at once; past this, new sources wait.
    pub sources: usize,
    /// Tokens remembered at once.
    pub cache_entries: usize,
    /// A remembered token is reviewed again after this, even before its
    /// `exp`: a pod or ServiceAccount deleted since has its token refused
    /// by the API server, and the CA follows within this long.
    pub cache_max_age: Duration,
    /// Clock difference tolerated on `exp`.
    pub skew: Duration,
}

impl Default for GateLimits {
    fn default() -> Self {
        Self {
            reviews_per_second: 20,
            burst: 40,
            per_source_per_second: 1,
            per_source_burst: 5,
            sources: 4096,
            cache_entries: 10_000,
            cache_max_age: Duration::from_secs(300),
            skew: Duration::from_secs(60),
        }
    }
}

fn bucket(per_second: u32, burst: u32) -> RateLimiter {
    let burst = usize::try_from(burst.max(1)).unwrap_or(usize::MAX);
    RateLimiter::builder()
        .max(burst)
        .initial(burst)
        .refill(1)
        .interval(Duration::from_secs(1) / per_second.max(1))
        .build()
}

/// A source's bucket and when it was last used; once full again (after
/// `per_source_burst` / `per_source_per_second`) it can be forgotten.
struct SourceBucket {
    bucket: RateLimiter,
    used: tokio::time::Instant,
}

/// What stands before the API server's TokenReview: see the module doc.
pub struct Gate {
    audience: String,
    limits: GateLimits,
    total: RateLimiter,
    sources: Mutex<HashMap<IpAddr, SourceBucket>>,
    /// SHA-256 of a token the API server accepted → its caller, and until when.
    cache: Mutex<HashMap<[u8; 32], (Caller, SystemTime)>>,
}

impl Gate {
    pub fn new(audience: &str, limits: GateLimits) -> Self {
        Self {
            audience: audience.to_string(),
            limits,
            total: bucket(limits.reviews_per_second, limits.burst),
            sources: Mutex::default(),
            cache: Mutex::default(),
        }
    }

    /// The caller `token` belongs to: from the cache, or from `auth` when
    /// the token passes [`precheck`] and the rate limits allow a review.
    pub async fn authenticate<A: Authenticate>(
        &self,
        auth: &A,
        token: &str,
        source: Option<IpAddr>,
    ) -> Result<Caller, AuthError> {
        let now = SystemTime::now();
        let exp = precheck(token, &self.audience, now, self.limits.skew)?;
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(caller) = self.cached(&key, now) {
            return Ok(caller);
        }
        self.admit(source)?;
        let caller = auth.authenticate(token).await?;
        let until = exp.min(now + self.limits.cache_max_age);
        self.remember(key, caller.clone(), until, now);
        Ok(caller)
    }

    fn cached(&self, key: &[u8; 32], now: SystemTime) -> Option<Caller> {
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        match cache.get(key) {
            Some((caller, until)) if *until > now => Some(caller.clone()),
            Some(_) => {
                cache.remove(key);
                None
            }
            None => None,
        }
    }

    fn remember(&self, key: [u8; 32], caller: Caller, until: SystemTime, now: SystemTime) {
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if cache.len() >= self.limits.cache_entries && !cache.contains_key(&key) {
            cache.retain(|_, (_, u)| *u > now);
            // Still full: the entry that ends first makes room.
            if cache.len() >= self.limits.cache_entries
                && let Some(first) = cache.iter().min_by_key(|(_, (_, u))| *u).map(|(k, _)| *k)
            {
                cache.remove(&first);
            }
        }
        if self.limits.cache_entries > 0 {
            cache.insert(key, (caller, until));
        }
    }

    /// One review for `source`, if its bucket and the total allow it.
    fn admit(&self, source: Option<IpAddr>) -> Result<(), AuthError> {
        if let Some(ip) = source {
            let now = tokio::time::Instant::now();
            let mut sources = self.sources.lock().unwrap_or_else(PoisonError::into_inner);
            if sources.len() >= self.limits.sources && !sources.contains_key(&ip) {
                let refill = Duration::from_secs(1) / self.limits.per_source_per_second.max(1)
                    * self.limits.per_source_burst.max(1);
                sources.retain(|_, b| now.saturating_duration_since(b.used) < refill);
                if sources.len() >= self.limits.sources {
                    return Err(AuthError::Throttled("from too many addresses"));
                }
            }
            let b = sources.entry(ip).or_insert_with(|| SourceBucket {
                bucket: bucket(
                    self.limits.per_source_per_second,
                    self.limits.per_source_burst,
                ),
                used: now,
            });
            b.used = now;
            if !b.bucket.try_acquire(1) {
                return Err(AuthError::Throttled("from this address"));
            }
        }
        if !self.total.try_acquire(1) {
            return Err(AuthError::Throttled("in total"));
        }
        Ok(())
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

    use remora_test_support::jwt;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const AUD: &str = "remora-ca";
    const SKEW: Duration = Duration::from_secs(60);

    fn claims(c: serde_json::Value) -> String {
        jwt::from_parts(br#"{"alg":"RS256"}"#, c.to_string().as_bytes(), b"sig")
    }

    #[test]
    fn prechecks_the_token_without_echoing_it() {
        let now = SystemTime::now();
        let exp = jwt::unix_from_now(600);
        let good = jwt::service_account(AUD, exp, 1);
        assert_eq!(
            precheck(&good, AUD, now, SKEW),
            Ok(SystemTime::UNIX_EPOCH + Duration::from_secs(exp))
        );
        // A single audience as a string, and a just-expired token within the skew.
        let just = claims(serde_json::json!({"aud": AUD, "exp": jwt::unix_from_now(-30)}));
        assert!(precheck(&just, AUD, now, SKEW).is_ok());

        let secret = "s3cr3t";
        let cases: Vec<(String, &str)> = vec![
            (format!("not-a-jwt-{secret}"), "1 dot-separated parts"),
            (format!("a.b.c.{secret}"), "4 dot-separated parts"),
            (format!("!!.{secret}.c"), "header is not base64url"),
            (
                jwt::from_parts(secret.as_bytes(), b"{}", b"sig"),
                "header is not JSON",
            ),
            (
                jwt::from_parts(
                    br#"{"alg":"none"}"#,
                    serde_json::json!({"aud": AUD, "exp": exp})
                        .to_string()
                        .as_bytes(),
                    b"sig",
                ),
                "unsigned",
            ),
            (
                jwt::from_parts(br#"{"alg":"RS256"}"#, b"{}", b""),
                "no signature",
            ),
            (
                jwt::from_parts(br#"{"alg":"RS256"}"#, secret.as_bytes(), b"sig"),
                "claims are not a JSON object",
            ),
            (claims(serde_json::json!({"exp": exp})), "no `aud`"),
            (
                claims(serde_json::json!({"aud": 7, "exp": exp})),
                "neither a string nor a list",
            ),
            (
                jwt::service_account("https://kubernetes.default.svc", exp, 2),
                "does not hold it",
            ),
            (
                claims(serde_json::json!({"aud": [AUD]})),
                "no numeric `exp`",
            ),
            (
                claims(serde_json::json!({"aud": [AUD], "exp": "soon"})),
                "no numeric `exp`",
            ),
            (
                jwt::service_account(AUD, jwt::unix_from_now(-3600), 3),
                "expired",
            ),
            ("x".repeat(20_000), "more than 16384"),
        ];
        for (token, what) in cases {
            let e = precheck(&token, AUD, now, SKEW).expect_err(what);
            let msg = e.to_string();
            assert!(msg.contains(what), "{what}: {msg}");
            assert!(msg.contains(AUD), "{msg}");
            assert!(!msg.contains(secret), "the token's content echoed: {msg}");
            assert_eq!(e.reason(), "bad_token");
        }
    }

    /// Test double of the API server's TokenReview that counts the reviews.
    #[derive(Default)]
    struct CountingReviewer(AtomicUsize);

    impl Authenticate for CountingReviewer {
        async fn authenticate(&self, _token: &str) -> Result<Caller, AuthError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(Caller {
                namespace: "web".into(),
                service_account: "default".into(),
                pod: None,
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn reviews_are_cached_and_rate_limited() {
        let limits = GateLimits {
            reviews_per_second: 10,
            burst: 10,
            per_source_per_second: 1,
            per_source_burst: 3,
            sources: 2,
            ..GateLimits::default()
        };
        let gate = Gate::new(AUD, limits);
        let auth = CountingReviewer::default();
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let exp = jwt::unix_from_now(3600);
        let good = jwt::service_account(AUD, exp, 0);
        for _ in 0..100 {
            gate.authenticate(&auth, &good, Some(a))
                .await
                .expect("accepted");
        }
        assert_eq!(
            auth.0.load(Ordering::SeqCst),
            1,
            "one review, then the cache"
        );

        // One source: its burst, then Throttled at once; again after a second.
        for n in 1..3 {
            let t = jwt::service_account(AUD, exp, n);
            gate.authenticate(&auth, &t, Some(a))
                .await
                .expect("in the burst");
        }
        let e = gate
            .authenticate(&auth, &jwt::service_account(AUD, exp, 9), Some(a))
            .await
            .expect_err("over the source's rate");
        assert_eq!(e, AuthError::Throttled("from this address"));
        assert_eq!(e.reason(), "review_throttled");
        tokio::time::sleep(Duration::from_secs(1)).await;
        gate.authenticate(&auth, &jwt::service_account(AUD, exp, 10), Some(a))
            .await
            .expect("refilled");

        // The total: the unattributed callers take the rest of its burst
        // (10, less the one just made; the paused clock does not move).
        let before = auth.0.load(Ordering::SeqCst);
        let mut n = 100;
        let e = loop {
            n += 1;
            match gate
                .authenticate(&auth, &jwt::service_account(AUD, exp, n), None)
                .await
            {
                Ok(_) => continue,
                Err(e) => break e,
            }
        };
        assert_eq!(e, AuthError::Throttled("in total"));
        assert_eq!(
            auth.0.load(Ordering::SeqCst) - before,
            9,
            "the total's burst"
        );

        // At most `sources` addresses are tracked; an idle one is forgotten.
        tokio::time::sleep(Duration::from_secs(10)).await;
        let b: IpAddr = "10.0.0.2".parse().expect("ip");
        let c: IpAddr = "10.0.0.3".parse().expect("ip");
        gate.authenticate(&auth, &jwt::service_account(AUD, exp, 200), Some(b))
            .await
            .expect("b");
        gate.authenticate(&auth, &jwt::service_account(AUD, exp, 201), Some(c))
            .await
            .expect("c: a, idle, was forgotten");
        let d: IpAddr = "10.0.0.4".parse().expect("ip");
        assert_eq!(
            gate.authenticate(&auth, &jwt::service_account(AUD, exp, 202), Some(d))
                .await,
            Err(AuthError::Throttled("from too many addresses"))
        );
    }

    #[test]
    fn the_cache_is_bounded_and_ends_with_the_token() {
        let gate = Gate::new(
            AUD,
            GateLimits {
                cache_entries: 2,
                ..GateLimits::default()
            },
        );
        let now = SystemTime::now();
        let caller = Caller {
            namespace: "web".into(),
            service_account: "default".into(),
            pod: None,
        };
        let key = |n: u8| [n; 32];
        gate.remember(key(1), caller.clone(), now + Duration::from_secs(10), now);
        gate.remember(key(2), caller.clone(), now + Duration::from_secs(20), now);
        gate.remember(key(3), caller.clone(), now + Duration::from_secs(30), now);
        assert_eq!(
            gate.cached(&key(1), now),
            None,
            "the first to end made room"
        );
        assert_eq!(gate.cached(&key(3), now), Some(caller.clone()));
        assert_eq!(
            gate.cached(&key(2), now + Duration::from_secs(20)),
            None,
            "ended"
        );
    }
}
