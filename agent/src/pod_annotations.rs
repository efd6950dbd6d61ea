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

use remora_contract::annotations::LIFECYCLE;
use remora_contract::downward::{lifecycle_is_native, read_annotations_file};
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

    /// Whether the pod's `remora.dev/lifecycle` says this sidecar is a
    /// native one ([`runs_native_in`]), from the stream's copy, else the
    /// file as it is now; no file, or an unreadable one: not native.
    pub fn runs_native(&self) -> bool {
        let stream = self.from_stream();
        if stream.is_some() {
            return runs_native_in(&stream, None);
        }
        match std::fs::read(&self.file) {
            Ok(bytes) => runs_native_in(&None, Some(&String::from_utf8_lossy(&bytes))),
            Err(e) => {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(error = %e, file = %self.file.display(),
                        "cannot read the pod's annotations: taken as not a native sidecar");
                }
                false
            }
        }
    }

    /// Until the stream's copy changes; never when there is no stream.
    pub async fn stream_changed(&mut self) {
        if self.stream.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Whether the sidecar runs native: from the stream's copy while there is
/// one, else from the file's text, read line by line
/// ([`remora_contract::downward::runs_native`]) so that a line that cannot
/// be parsed elsewhere in the file never hides the mode. Absent or
/// unreadable: not native (a signal then drains, as for Legacy).
pub fn runs_native_in(stream: &StreamCopy, file_text: Option<&str>) -> bool {
    match stream {
        Some(a) => a.get(LIFECYCLE).is_some_and(|l| lifecycle_is_native(l)),
        None => file_text.is_some_and(remora_contract::downward::runs_native),
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

    /// One line the map parser cannot read must not turn a native sidecar
    /// into a Legacy one (which would drain for apps that are gone).
    #[test]
    fn the_mode_is_read_line_by_line_and_the_streams_copy_wins() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("annotations");
        let (tx, rx) = watch::channel(None);
        let a = PodAnnotations::new(file.clone(), rx);
        assert!(!a.runs_native(), "no file: not native");
        std::fs::write(
            &file,
            "broken line without an equals sign\nremora.dev/lifecycle=\"{\\\"mode\\\":\\\"Native\\\"}\"\n",
        )
        .expect("write");
        assert!(
            read_annotations_file(&file).is_err(),
            "the fixture must defeat the map parser"
        );
        assert!(a.runs_native(), "the file, line by line");
        tx.send_replace(Some(Arc::new(BTreeMap::from([(
            LIFECYCLE.to_string(),
            r#"{"mode":"Legacy"}"#.to_string(),
        )]))));
        assert!(!a.runs_native(), "the stream's copy wins");
        tx.send_replace(Some(Arc::new(BTreeMap::new())));
        assert!(
            !a.runs_native(),
            "absent from the stream's copy: not native"
        );
    }
}
