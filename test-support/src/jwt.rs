//! JWT-shaped tokens for tests of code that reads a token's parts before
//! someone else checks its signature: the signature here is random bytes,
//! never valid.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

/// `header.claims.signature`, each part base64url of the given bytes.
pub fn from_parts(header: &[u8], claims: &[u8], signature: &[u8]) -> String {
    format!(
        "{}.{}.{}",
        URL_SAFE_NO_PAD.encode(header),
        URL_SAFE_NO_PAD.encode(claims),
        URL_SAFE_NO_PAD.encode(signature)
    )
}

/// A token shaped like a projected service-account token (RS256) for
/// `audience`, ending at `exp` (Unix seconds); `nonce` makes it unique.
pub fn service_account(audience: &str, exp: u64, nonce: u64) -> String {
    let claims = serde_json::json!({
        "aud": [audience],
        "exp": exp,
        "iat": exp.saturating_sub(3600),
        "iss": "https://kubernetes.default.svc",
        "sub": "system:serviceaccount:web:default",
        "jti": format!("test-{nonce}"),
    });
    from_parts(
        br#"{"alg":"RS256","kid":"test"}"#,
        claims.to_string().as_bytes(),
        &nonce.to_be_bytes().repeat(32),
    )
}

/// Unix seconds `offset` from now (negative: in the past).
pub fn unix_from_now(offset: i64) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    now.saturating_add_signed(offset)
}
