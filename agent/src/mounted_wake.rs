//! When to read mounted files again: at the poll, or as soon as inotify
//! sees a change in one of their directories complete.
//!
//! What changed is still decided the one way ([`remora_contract::mounted`]):
//! by reading the files. inotify only ends the wait early, so a certificate
//! or annotation change is picked up once its writer is done (a rename
//! into place, as the kubelet's `..data` swap ends, or the close of a file
//! written in place, so a file torn mid-write is not read) instead of up
//! to a poll later, and everything inotify misses (a
//! volume mounted after start, a filesystem without events, an event queue
//! overflow) is still seen at the next poll.
//!
//! The watch is on each file's directory, not on the file: the kubelet
//! replaces a volume's files by renaming a `..data` symlink in that
//! directory, which a watch on the file (a symlink through `..data`) never
//! sees. In-place writes show as events on the file's own name there.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::{FutureExt as _, StreamExt as _};
use inotify::{EventMask, EventStream, Inotify, WatchDescriptor, WatchMask};
use tokio::time::Instant;

/// The most a wake waits, after an event that starts a change (a write, a
/// create, a delete), for one that completes it (a close after writing, a
/// rename into place): a writer that never closes is read anyway.
const MAX_SETTLE: Duration = Duration::from_millis(100);

/// Events that can mean a watched file's bytes changed.
fn mask() -> WatchMask {
    WatchMask::CREATE
        | WatchMask::CLOSE_WRITE
        | WatchMask::MODIFY
        | WatchMask::MOVED_TO
        | WatchMask::MOVED_FROM
        | WatchMask::DELETE
        | WatchMask::ATTRIB
}

/// Wakes a poll loop at its period, or sooner on a change.
pub struct MountedWake {
    poll: Duration,
    /// `None`: inotify is not available here or failed (said once in the
    /// log); the loop polls only.
    events: Option<EventStream<Vec<u8>>>,
    /// Each directory, and its watch once added.
    dirs: Vec<(PathBuf, Option<WatchDescriptor>)>,
    max_settle: Duration,
}

impl MountedWake {
    /// For the files at `paths`, read every `poll` at the latest.
    pub fn new<'a>(paths: impl IntoIterator<Item = &'a Path>, poll: Duration) -> Self {
        let mut dirs: Vec<(PathBuf, Option<WatchDescriptor>)> = Vec::new();
        for p in paths {
            let dir = match p.parent() {
                Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
                _ => PathBuf::from("."),
            };
            if !dirs.iter().any(|(d, _)| *d == dir) {
                dirs.push((dir, None));
            }
        }
        let events = Inotify::init().and_then(|i| i.into_event_stream(vec![0; 4096]));
        let events = match events {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::info!(error = %e, "inotify unavailable: mounted files are read at each poll only");
                None
            }
        };
        let mut wake = Self {
            poll,
            events,
            dirs,
            max_settle: MAX_SETTLE,
        };
        wake.add_watches();
        wake
    }

    /// Watch the directories not watched yet (one that does not exist yet
    /// is tried again at the next wake).
    fn add_watches(&mut self) {
        let Some(events) = &self.events else { return };
        let mut watches = events.watches();
        for (dir, wd) in self.dirs.iter_mut().filter(|(_, wd)| wd.is_none()) {
            *wd = watches.add(dir.as_path(), mask()).ok();
        }
    }

    /// Whether every directory is watched: then only events and the poll wake.
    pub fn watching(&self) -> bool {
        self.events.is_some() && self.dirs.iter().all(|(_, wd)| wd.is_some())
    }

    /// Returns at the next poll, or once a watched directory saw a change
    /// complete: at once on a rename into place or a close after writing;
    /// after any other event, at the first such one or [`MAX_SETTLE`] later.
    pub async fn next(&mut self) {
        let deadline = Instant::now() + self.poll;
        let max_settle = self.max_settle;
        let woken = match &mut self.events {
            Some(events) => {
                let event = async {
                    let mut burst = drain(events).await?;
                    let settled_by = Instant::now() + max_settle;
                    while !burst.complete {
                        match tokio::time::timeout_at(settled_by, drain(events)).await {
                            Ok(more) => burst.add(more?),
                            Err(_) => break,
                        }
                    }
                    Ok::<_, std::io::Error>(burst.gone)
                };
                tokio::select! {
                    woken = event => Some(woken),
                    () = tokio::time::sleep_until(deadline) => None,
                }
            }
            None => {
                tokio::time::sleep_until(deadline).await;
                None
            }
        };
        match woken {
            Some(Ok(gone)) => {
                for (_, wd) in &mut self.dirs {
                    if wd.as_ref().is_some_and(|w| gone.contains(w)) {
                        *wd = None;
                    }
                }
            }
            Some(Err(e)) => {
                tracing::info!(error = %e, "inotify failed: mounted files are read at each poll only");
                self.events = None;
            }
            None => {}
        }
        self.add_watches();
    }
}

impl Drop for MountedWake {
    /// Closing an inotify instance that has watches waits in the kernel until
    /// its marks are destroyed (an SRCU grace period: 10 ms and more on a busy
    /// machine). On the agent's one runtime thread that wait would stall
    /// everything, and at exit the instances would be closed one grace period
    /// after another; a thread of its own closes it instead, and several such
    /// closes share one grace period.
    fn drop(&mut self) {
        let Some(events) = self.events.take() else {
            return;
        };
        // Holds the descriptor open past the stream, whose drop takes it out
        // of the runtime's reactor here.
        let fd = events.watches();
        drop(events);
        // Without a thread the closure, and the descriptor, are dropped here.
        let _ = std::thread::Builder::new()
            .name("inotify-close".into())
            .spawn(move || drop(fd));
    }
}

/// The events taken in one wake.
struct Burst {
    /// Watches the kernel dropped (their directory was removed or
    /// unmounted), to be added again when the directory is back.
    gone: Vec<WatchDescriptor>,
    /// Whether a change is complete: a file closed after writing, a rename
    /// into place, or nothing left to wait for (a dropped watch, lost events).
    complete: bool,
}

impl Burst {
    fn add(&mut self, more: Burst) {
        self.gone.extend(more.gone);
        self.complete |= more.complete;
    }
}

/// Waits for the next event and takes every one already queued.
async fn drain(events: &mut EventStream<Vec<u8>>) -> std::io::Result<Burst> {
    let mut burst = Burst {
        gone: Vec::new(),
        complete: false,
    };
    let mut next = events.next().await;
    loop {
        match next {
            Some(Ok(e)) => {
                if e.mask.contains(EventMask::IGNORED) {
                    burst.gone.push(e.wd);
                }
                burst.complete |= e.mask.intersects(
                    EventMask::CLOSE_WRITE
                        | EventMask::MOVED_TO
                        | EventMask::IGNORED
                        | EventMask::Q_OVERFLOW,
                );
            }
            Some(Err(e)) => return Err(e),
            None => return Err(std::io::ErrorKind::UnexpectedEof.into()),
        }
        match events.next().now_or_never() {
            Some(n) => next = n,
            None => return Ok(burst),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use remora_contract::mounted::MountedFiles;
    use remora_test_support::kubelet::atomic_write;

    /// A poll that never comes in a test: only an event can wake the loop.
    const NEVER: Duration = Duration::from_secs(3600);
    const DEADLINE: Duration = Duration::from_secs(10);

    async fn woken(wake: &mut MountedWake, files: &mut MountedFiles) -> Vec<u8> {
        tokio::time::timeout(DEADLINE, async {
            loop {
                wake.next().await;
                if let Some(c) = files.poll() {
                    return c[0].clone().unwrap_or_default();
                }
            }
        })
        .await
        .expect("a change seen through inotify, with no poll due")
    }

    #[tokio::test]
    async fn an_in_place_write_wakes_the_loop() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("cert-chain.pem");
        std::fs::write(&path, "one").expect("write");
        let mut files = MountedFiles::new(vec![path.clone()]);
        let _ = files.poll();
        let mut wake = MountedWake::new([path.as_path()], NEVER);
        assert!(wake.watching());
        std::fs::write(&path, "two").expect("write");
        assert_eq!(woken(&mut wake, &mut files).await, b"two");
    }

    /// A writer that pauses between two writes to a file it keeps open is
    /// read once it closes the file, not torn between the writes.
    #[tokio::test]
    async fn a_slow_in_place_write_is_read_whole() {
        use std::io::Write as _;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("key.pem");
        std::fs::write(&path, "old").expect("write");
        let mut files = MountedFiles::new(vec![path.clone()]);
        let _ = files.poll();
        let mut wake = MountedWake::new([path.as_path()], NEVER);
        wake.max_settle = DEADLINE;
        let writer = std::thread::spawn({
            let path = path.clone();
            move || {
                let mut f = std::fs::File::create(&path).expect("create");
                f.write_all(b"first half, ").expect("write");
                f.flush().expect("flush");
                // A slow writer: the first half sits in the file a while.
                std::thread::sleep(Duration::from_millis(50));
                f.write_all(b"second half").expect("write");
            }
        });
        assert_eq!(
            woken(&mut wake, &mut files).await,
            b"first half, second half"
        );
        writer.join().expect("writer");
    }

    #[tokio::test]
    async fn a_kubelet_data_swap_wakes_the_loop() {
        let dir = tempfile::tempdir().expect("tempdir");
        atomic_write(dir.path(), [("annotations", "a=\"1\"")]).expect("write");
        let path = dir.path().join("annotations");
        let mut files = MountedFiles::new(vec![path.clone()]);
        let _ = files.poll();
        let mut wake = MountedWake::new([path.as_path()], NEVER);
        atomic_write(dir.path(), [("annotations", "a=\"2\"")]).expect("write");
        assert_eq!(woken(&mut wake, &mut files).await, b"a=\"2\"");
        // And again: the watch is on the directory, which the swap keeps.
        atomic_write(dir.path(), [("annotations", "a=\"3\"")]).expect("write");
        assert_eq!(woken(&mut wake, &mut files).await, b"a=\"3\"");
    }

    #[tokio::test]
    async fn a_directory_made_after_start_is_watched_from_the_next_wake() {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = root.path().join("later");
        let path = dir.join("key.pem");
        let mut files = MountedFiles::new(vec![path.clone()]);
        let _ = files.poll();
        let mut wake = MountedWake::new([path.as_path()], Duration::from_millis(10));
        assert!(!wake.watching());
        std::fs::create_dir(&dir).expect("mkdir");
        tokio::time::timeout(DEADLINE, async {
            while !wake.watching() {
                wake.next().await;
            }
        })
        .await
        .expect("the directory watched once it exists");
        wake.poll = NEVER;
        std::fs::write(&path, "k").expect("write");
        assert_eq!(woken(&mut wake, &mut files).await, b"k");
    }

    /// Without a change, the loop still wakes at its poll (paused time).
    #[tokio::test(start_paused = true)]
    async fn the_poll_still_wakes_without_events() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f");
        let mut wake = MountedWake::new([path.as_path()], Duration::from_secs(30));
        let start = Instant::now();
        wake.next().await;
        assert_eq!(start.elapsed(), Duration::from_secs(30));
    }
}
