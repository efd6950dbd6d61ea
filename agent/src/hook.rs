//! The agent's credentials, made fresh at every start and kept in files,
//! never in the pod spec: the admin token (run dir, 0600: the sidecar's user
//! only) that `/quitquitquit`, `/drain` and `/logging` require, and the hook
//! token the app containers' preStop helper presents, written with the
//! helper into the hook volume that only this pod's containers mount.

use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use remora_contract::pod;

#[derive(Debug, thiserror::Error)]
pub enum HookError {
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot copy the app hook helper {from} to {to}: {source}")]
    Copy {
        from: PathBuf,
        to: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--hook-dir is set but no app hook helper was found (--prestop-helper)")]
    NoHelper,
}

/// A bearer token: 128 random bits, hex.
#[derive(Clone)]
pub struct Secret(Arc<str>);

impl Secret {
    pub fn random() -> Self {
        let bytes: [u8; 16] = rand::random();
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Self(Arc::from(hex))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `authorization` is `Bearer <this token>`, compared in a time
    /// that does not depend on where it first differs.
    pub fn authorizes(&self, authorization: Option<&[u8]>) -> bool {
        let presented = authorization
            .and_then(|v| v.strip_prefix(b"Bearer "))
            .unwrap_or_default();
        let want = self.0.as_bytes();
        presented.len() == want.len()
            && presented
                .iter()
                .zip(want)
                .fold(0u8, |acc, (x, y)| acc | (x ^ y))
                == 0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Write `contents` to `path` with `mode`, atomically (a reader sees the old
/// file or the new one, never a partial one).
fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> Result<(), HookError> {
    let err = |source| HookError::Write {
        path: path.to_path_buf(),
        source,
    };
    let tmp = tmp_path(path);
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(err)?;
    f.write_all(contents).map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

fn tmp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp"))
}

/// A fresh admin token in `<run_dir>/admin-token`, readable by this user only.
pub fn write_admin_token(run_dir: &Path) -> Result<Secret, HookError> {
    let token = Secret::random();
    write_atomic(
        &run_dir.join(pod::ADMIN_TOKEN_FILE),
        token.as_str().as_bytes(),
        0o600,
    )?;
    Ok(token)
}

/// Fill the hook volume: the helper (copied, so it runs in any app image),
/// then the endpoint file with a fresh hook token. App containers run as
/// users of their own, so both are readable by all; only the pod's
/// containers mount the volume.
pub fn install(dir: &Path, helper: &Path, admin: SocketAddr) -> Result<Secret, HookError> {
    let to = dir.join(pod::HOOK_HELPER);
    let tmp = tmp_path(&to);
    let copy_err = |source| HookError::Copy {
        from: helper.to_path_buf(),
        to: to.clone(),
        source,
    };
    // Through a new file and a rename: a hook running the old copy keeps it.
    let _ = std::fs::remove_file(&tmp);
    std::fs::copy(helper, &tmp).map_err(copy_err)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).map_err(copy_err)?;
    std::fs::rename(&tmp, &to).map_err(copy_err)?;
    let token = Secret::random();
    let text = format!("addr={admin}\ntoken={}\n", token.as_str());
    write_atomic(&dir.join(pod::HOOK_ENDPOINT_FILE), text.as_bytes(), 0o644)?;
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn admin_token_is_private_and_fresh() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = write_admin_token(dir.path()).expect("written");
        let path = dir.path().join(pod::ADMIN_TOKEN_FILE);
        let meta = std::fs::metadata(&path).expect("exists");
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_to_string(&path).expect("read"), a.as_str());
        let b = write_admin_token(dir.path()).expect("rewritten");
        assert_ne!(a.as_str(), b.as_str());
        assert_eq!(a.as_str().len(), 32);
        assert!(!format!("{a:?}").contains(a.as_str()));
    }

    #[test]
    fn secret_authorizes_only_its_bearer_header() {
        let s = Secret::random();
        let good = format!("Bearer {}", s.as_str());
        assert!(s.authorizes(Some(good.as_bytes())));
        assert!(!s.authorizes(None));
        assert!(!s.authorizes(Some(s.as_str().as_bytes())));
        assert!(!s.authorizes(Some(b"Bearer ")));
        assert!(!s.authorizes(Some(&good.as_bytes()[..good.len() - 1])));
        let other = Secret::random();
        assert!(!other.authorizes(Some(good.as_bytes())));
    }

    #[test]
    fn install_copies_the_helper_and_writes_the_endpoint() {
        let dir = tempfile::tempdir().expect("tempdir");
        let helper = dir.path().join("helper");
        std::fs::write(&helper, b"#!/bin/true\n").expect("helper");
        let hook = dir.path().join("hook");
        std::fs::create_dir(&hook).expect("hook dir");
        let addr: SocketAddr = "127.0.0.1:15020".parse().expect("addr");
        let token = install(&hook, &helper, addr).expect("installed");
        let copied = hook.join(pod::HOOK_HELPER);
        assert_eq!(std::fs::read(&copied).expect("copied"), b"#!/bin/true\n");
        assert_eq!(
            std::fs::metadata(&copied).expect("meta").mode() & 0o777,
            0o755
        );
        let endpoint =
            std::fs::read_to_string(hook.join(pod::HOOK_ENDPOINT_FILE)).expect("endpoint");
        assert_eq!(
            endpoint,
            format!("addr=127.0.0.1:15020\ntoken={}\n", token.as_str())
        );
        // Installed again (a restarted sidecar): a new token, no leftovers.
        let again = install(&hook, &helper, addr).expect("again");
        assert_ne!(again.as_str(), token.as_str());
        let names: Vec<_> = std::fs::read_dir(&hook)
            .expect("list")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");

        let missing = install(&hook, &dir.path().join("nope"), addr).expect_err("no helper");
        assert!(missing.to_string().contains("nope"), "{missing}");
    }
}
