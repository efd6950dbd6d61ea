//! A process's inotify instances, read from `/proc`: the kernel caps them
//! per user (`fs.inotify.max_user_instances`), so tests count what the
//! agent and Envoy hold.

use std::path::{Path, PathBuf};

/// The descriptors of process `pid` (a number, or `self`) that are inotify
/// instances (`/proc/PID/fd/N` linking to `anon_inode:inotify`).
pub fn descriptors(pid: &str) -> std::io::Result<Vec<PathBuf>> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| std::fs::read_link(p).is_ok_and(|l| l.as_os_str() == "anon_inode:inotify"))
        .collect())
}

/// The watches the kernel holds for the instance behind `descriptor` (one
/// of [`descriptors`]), from its `fdinfo`.
pub fn watches(descriptor: &Path) -> std::io::Result<usize> {
    let info = descriptor.to_string_lossy().replace("/fd/", "/fdinfo/");
    Ok(std::fs::read_to_string(info)?
        .lines()
        .filter(|l| l.starts_with("inotify wd:"))
        .count())
}
