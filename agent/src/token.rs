//! The pod's projected service-account tokens, as the CA client and the xDS
//! proxy show them.

use std::path::Path;

/// The token in `path`, trimmed. Read at every use: the kubelet rotates
/// projected tokens, so a copy kept in memory would expire. The error is the
/// reason alone; callers name the path in their own error.
pub async fn read(path: &Path) -> Result<String, String> {
    let t = tokio::fs::read_to_string(path)
        .await
        .map_err(|e| e.to_string())?;
    let t = t.trim();
    if t.is_empty() {
        return Err("empty".into());
    }
    Ok(t.to_string())
}
