//! The kubelet's `AtomicWriter`, which fills Secret, ConfigMap, projected
//! and downward-API volumes: tests that watch such a volume see the same
//! sequence of filesystem events as in a pod.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Writes `files` (name → content) into the volume directory `dir` the way
/// the kubelet does: the files live in a timestamped directory `..<ts>`,
/// `..data` is a symlink to it, and each name is a symlink `name ->
/// ..data/name`. An update writes a new `..<ts>`, points `..data_tmp` at it
/// and renames that over `..data` (one atomic step: a reader sees all old
/// or all new files), then removes the names the previous payload had and
/// this one lacks, and the old directory. Other entries of `dir` are left
/// alone. Returns whether anything changed (same content: nothing is touched).
pub fn atomic_write<K, V>(
    dir: &Path,
    files: impl IntoIterator<Item = (K, V)>,
) -> std::io::Result<bool>
where
    K: AsRef<str>,
    V: AsRef<[u8]>,
{
    static GENERATION: AtomicU64 = AtomicU64::new(0);
    let files: BTreeMap<String, Vec<u8>> = files
        .into_iter()
        .map(|(k, v)| (k.as_ref().to_owned(), v.as_ref().to_vec()))
        .collect();
    std::fs::create_dir_all(dir)?;
    let data_link = dir.join("..data");
    let old = std::fs::read_link(&data_link).ok();
    let old_names: Vec<String> = match &old {
        Some(old) => std::fs::read_dir(dir.join(old))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        None => Vec::new(),
    };
    if let Some(old) = &old {
        let current = dir.join(old);
        let same = old_names.len() == files.len()
            && files
                .iter()
                .all(|(k, v)| std::fs::read(current.join(k)).is_ok_and(|c| c == *v));
        if same {
            return Ok(false);
        }
    }
    // The kubelet's name is `..2006_01_02_15_04_05.<random>`; only its
    // uniqueness and the `..` prefix (hidden from key listings) matter.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let ts = format!(
        "..{}_{:09}.{}",
        now.as_secs(),
        now.subsec_nanos(),
        GENERATION.fetch_add(1, Ordering::SeqCst)
    );
    let ts_dir = dir.join(&ts);
    std::fs::create_dir(&ts_dir)?;
    for (k, v) in &files {
        std::fs::write(ts_dir.join(k), v)?;
    }
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&ts, &tmp)?;
    std::fs::rename(&tmp, &data_link)?;
    for k in files.keys() {
        let link = dir.join(k);
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(format!("..data/{k}"), &link)?;
        }
    }
    for gone in old_names.iter().filter(|k| !files.contains_key(*k)) {
        std::fs::remove_file(dir.join(gone))?;
    }
    if let Some(old) = old {
        std::fs::remove_dir_all(dir.join(old))?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .expect("read dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn atomic_write_swaps_data_link_and_cleans_up() {
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = tmp.path().join("certs");
        assert!(atomic_write(&dir, [("a", "1"), ("b", "2")]).expect("write"));
        let first = std::fs::read_link(dir.join("..data")).expect("..data");
        assert_eq!(
            std::fs::read_link(dir.join("a")).expect("link"),
            PathBuf::from("..data/a")
        );
        assert_eq!(std::fs::read_to_string(dir.join("b")).expect("b"), "2");

        // Same content: nothing is touched.
        assert!(!atomic_write(&dir, [("a", "1"), ("b", "2")]).expect("write"));
        assert_eq!(
            std::fs::read_link(dir.join("..data")).expect("..data"),
            first
        );

        // New content, a key dropped: new target, old directory and key
        // gone; what the writer did not put there stays.
        std::fs::write(dir.join("other.log"), "x").expect("other");
        assert!(atomic_write(&dir, [("a", "3")]).expect("write"));
        let second = std::fs::read_link(dir.join("..data")).expect("..data");
        assert_ne!(second, first);
        assert_eq!(std::fs::read_to_string(dir.join("a")).expect("a"), "3");
        let mut want = vec![
            "..data".to_string(),
            second.display().to_string(),
            "a".into(),
            "other.log".into(),
        ];
        want.sort();
        assert_eq!(entries(&dir), want);
    }
}
