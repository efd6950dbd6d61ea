//! Noticing that a mounted file changed: the one way Remora does it, for
//! workload certificates, the bootstrap override, the pod's annotations and
//! the webhook's serving certificate.
//!
//! Why polling the contents and not inotify: the kubelet updates Secret,
//! ConfigMap and downward-API volumes by writing a new timestamped
//! directory and renaming a `..data` symlink over the old one. The paths a
//! program opens are symlinks through `..data`, so a watch on a file never
//! fires, a watch on the directory sees the swap only as events on
//! `..data`, and a watch set up before the volume exists fails and must be
//! retried. Reading a few small files at a fixed period sees every swap
//! (and any other writer), needs no bookkeeping, behaves the same on every
//! filesystem and in tests, and costs microseconds. The agent also reads
//! them at once when inotify reports a change in their directories
//! (`remora_agent::mounted_wake`), so a change is seen in microseconds
//! rather than up to a poll later; the contents still decide what changed.

use std::io::ErrorKind;
use std::path::PathBuf;

/// What a poll read: each file's bytes, or why it could not be read.
pub type Contents = Vec<Result<Vec<u8>, ErrorKind>>;

/// A set of files and what they held at the last poll.
#[derive(Debug)]
pub struct MountedFiles {
    paths: Vec<PathBuf>,
    last: Option<Contents>,
}

impl MountedFiles {
    pub fn new(paths: Vec<PathBuf>) -> Self {
        Self { paths, last: None }
    }

    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Read every file; the contents when any differs from the last poll
    /// (the first poll always counts as a change), `None` otherwise.
    pub fn poll(&mut self) -> Option<&Contents> {
        let now: Contents = self
            .paths
            .iter()
            .map(|p| std::fs::read(p).map_err(|e| e.kind()))
            .collect();
        if self.last.as_ref() == Some(&now) {
            return None;
        }
        self.last = Some(now);
        self.last.as_ref()
    }

    /// Count the next poll as a change whatever it reads: for a caller that
    /// could not use what the last one returned and wants to try again.
    pub fn forget(&mut self) {
        self.last = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use remora_test_support::kubelet::atomic_write;

    fn kubelet_write(dir: &std::path::Path, text: &str) -> std::io::Result<()> {
        atomic_write(dir, [("file", text)]).map(|_| ())
    }

    #[test]
    fn sees_a_symlink_swap_and_nothing_else() -> std::io::Result<()> {
        let dir = std::env::temp_dir().join(format!("remora-mounted-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let mut files = MountedFiles::new(vec![dir.join("file")]);
        let first = files.poll().cloned();
        assert_eq!(
            first,
            Some(vec![Err(ErrorKind::NotFound)]),
            "absent at first"
        );
        assert!(files.poll().is_none(), "no change");
        kubelet_write(&dir, "a")?;
        assert_eq!(files.poll().cloned(), Some(vec![Ok(b"a".to_vec())]));
        assert!(files.poll().is_none());
        kubelet_write(&dir, "b")?;
        assert_eq!(files.poll().cloned(), Some(vec![Ok(b"b".to_vec())]));
        kubelet_write(&dir, "b")?;
        assert!(files.poll().is_none(), "same contents, no change");
        files.forget();
        assert!(files.poll().is_some(), "forgotten: counts as a change");
        std::fs::remove_dir_all(&dir)
    }
}
