//! The pod's annotations as the agent sees them while it runs.
//!
//! Two copies of the same pod object: the discovery server pushes the
//! annotations the agent reads on the ADS stream the agent holds for Envoy
//! (milliseconds after the pod changes), and the kubelet refreshes the
//! downward-API file (about a minute). The stream's copy is used while the
//! stream is up; the file otherwise, and always without discovery.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use remora_contract::downward::read_annotations_file;
use tokio::sync::watch;

/// The stream's copy: `None` while no stream is up.
pub type StreamCopy = Option<Arc<BTreeMap<String, String>>>;

#[derive(Debug, Clone)]
pub struct PodAnnotations {
    file: PathBuf,
    stream: watch::Receiver<StreamCopy>,
}

impl PodAnnotations {
    pub fn new(file: PathBuf, stream: watch::Receiver<StreamCopy>) -> Self {
        Self { file, stream }
    }

    /// The file alone (no discovery).
    pub fn file_only(file: PathBuf) -> Self {
        Self::new(file, watch::channel(None).1)
    }

    pub fn file(&self) -> &Path {
        &self.file
    }

    /// The stream's copy, when the stream is up.
    pub fn from_stream(&self) -> StreamCopy {
        self.stream.borrow().clone()
    }

    /// The annotations now: the stream's copy, else the file's (`None`
    /// when there is no file).
    pub fn read(&self) -> Result<Option<BTreeMap<String, String>>, std::io::Error> {
        match self.from_stream() {
            Some(a) => Ok(Some((*a).clone())),
            None => read_annotations_file(&self.file),
        }
    }

    /// Until the stream's copy changes; never when there is no stream.
    pub async fn stream_changed(&mut self) {
        if self.stream.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_streams_copy_wins_while_it_is_there() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("annotations");
        std::fs::write(&file, "remora.dev/quiet-period=\"2s\"\n").expect("write");
        let (tx, rx) = watch::channel(None);
        let a = PodAnnotations::new(file.clone(), rx);
        let quiet = |a: &PodAnnotations| {
            a.read()
                .expect("read")
                .and_then(|m| m.get("remora.dev/quiet-period").cloned())
        };
        assert_eq!(quiet(&a).as_deref(), Some("2s"), "the file");
        tx.send_replace(Some(Arc::new(BTreeMap::from([(
            "remora.dev/quiet-period".to_string(),
            "1s".to_string(),
        )]))));
        assert_eq!(quiet(&a).as_deref(), Some("1s"), "the stream");
        tx.send_replace(None);
        assert_eq!(quiet(&a).as_deref(), Some("2s"), "the file again");
        assert!(PodAnnotations::file_only(file).from_stream().is_none());
    }
}
