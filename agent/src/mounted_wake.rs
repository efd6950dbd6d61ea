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
//!
//! Every wake of the process shares one inotify instance ([`Hub`]): the
//! kernel caps instances per user (`fs.inotify.max_user_instances`, 128 by
//! default) and every sidecar on a node runs as the same user, Envoy
//! included. With an instance per wake (3 per agent, and Envoy's one for
//! its idle-close monitor) the 33rd sidecar on a node found none left and
//! its Envoy aborted at start.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask, Watches};
use tokio::sync::broadcast;
use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use tokio::time::Instant;

/// The most a wake waits, after an event that starts a change (a write, a
/// create, a delete), for one that completes it (a close after writing, a
/// rename into place): a writer that never closes is read anyway.
const MAX_SETTLE: Duration = Duration::from_millis(100);

/// Events kept for a wake that has not taken them yet; one that falls
/// further behind reads its files at once (nothing is lost: the files
/// decide).
const BACKLOG: usize = 256;

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

/// One event, as every wake of the process receives it.
#[derive(Debug, Clone)]
struct Seen {
    wd: WatchDescriptor,
    mask: EventMask,
}

/// The process's one inotify instance: a thread of its own reads it
/// (blocking, so it serves wakes on any runtime) and hands every event to
/// every wake, each keeping those of its directories. It is never closed;
/// its watches go at [`release`].
struct Hub {
    watches: Watches,
    /// Weak: the reader thread holds the one sender, so that a failed
    /// read ends every wake's stream and they poll only.
    events: broadcast::WeakSender<Seen>,
    /// Every watch added, for [`release`]; `None` once released.
    added: Mutex<Option<Vec<WatchDescriptor>>>,
}

/// Remove every watch, for good: wakes poll only from here on. The agent
/// calls it as Envoy's final stop begins. A process whose inotify instance
/// still has watches at exit is reaped only after a kernel grace period
/// (SRCU: 14 ms at p50 on the CI machine); removed now, on a thread of
/// their own, their marks are gone while Envoy shuts down.
pub fn release() {
    if let Some(hub) = Hub::get() {
        hub.release();
    }
}

impl Hub {
    /// The instance, started at the first call; `None` when inotify is not
    /// available here (said once in the log).
    fn get() -> Option<&'static Hub> {
        static HUB: OnceLock<Option<Hub>> = OnceLock::new();
        HUB.get_or_init(|| match Self::start() {
            Ok(hub) => Some(hub),
            Err(e) => {
                tracing::info!(error = %e, "inotify unavailable: mounted files are read at each poll only");
                None
            }
        })
        .as_ref()
    }

    fn release(&self) {
        let Some(added) = self.added.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        let mut watches = self.watches.clone();
        let _ = std::thread::Builder::new()
            .name("inotify-release".into())
            .spawn(move || {
                for wd in added {
                    // Already gone (its directory was removed), or added twice.
                    let _ = watches.remove(wd);
                }
            });
    }

    fn start() -> std::io::Result<Self> {
        let mut inotify = Inotify::init()?;
        let watches = inotify.watches();
        let (tx, _) = broadcast::channel(BACKLOG);
        let events = tx.downgrade();
        std::thread::Builder::new()
            .name("inotify".into())
            .spawn(move || {
                let mut buffer = vec![0; 4096];
                loop {
                    match inotify.read_events_blocking(&mut buffer) {
                        Ok(events) => {
                            for e in events {
                                // No wake listening: nothing to tell.
                                let _ = tx.send(Seen {
                                    wd: e.wd,
                                    mask: e.mask,
                                });
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            tracing::info!(error = %e, "inotify failed: mounted files are read at each poll only");
                            return;
                        }
                    }
                }
            })?;
        Ok(Self {
            watches,
            events,
            added: Mutex::new(Some(Vec::new())),
        })
    }
}

/// Wakes a poll loop at its period, or sooner on a change.
pub struct MountedWake {
    poll: Duration,
    /// `None`: inotify is not available here or failed; the loop polls
    /// only.
    events: Option<broadcast::Receiver<Seen>>,
    hub: Option<&'static Hub>,
    /// Each directory, and its watch once added.
    dirs: Vec<(PathBuf, Option<WatchDescriptor>)>,
    max_settle: Duration,
}

impl MountedWake {
    /// For the files at `paths`, read every `poll` at the latest.
    pub fn new<'a>(paths: impl IntoIterator<Item = &'a Path>, poll: Duration) -> Self {
        Self::on(Hub::get(), paths, poll)
    }

    fn on<'a>(
        hub: Option<&'static Hub>,
        paths: impl IntoIterator<Item = &'a Path>,
        poll: Duration,
    ) -> Self {
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
        let events = hub
            .and_then(|h| h.events.upgrade())
            .map(|tx| tx.subscribe());
        let hub = events.as_ref().and(hub);
        let mut wake = Self {
            poll,
            events,
            hub,
            dirs,
            max_settle: MAX_SETTLE,
        };
        wake.add_watches();
        wake
    }

    /// Watch the directories not watched yet (one that does not exist yet
    /// is tried again at the next wake). A directory another wake watches
    /// already gets the same watch back.
    fn add_watches(&mut self) {
        let Some(hub) = self.hub else { return };
        if self.dirs.iter().all(|(_, wd)| wd.is_some()) {
            return;
        }
        let mut added = hub.added.lock().unwrap_or_else(|p| p.into_inner());
        // Released: no new watch.
        let Some(added) = added.as_mut() else { return };
        let mut watches = hub.watches.clone();
        for (dir, wd) in self.dirs.iter_mut().filter(|(_, wd)| wd.is_none()) {
            *wd = watches.add(dir.as_path(), mask()).ok();
            if let Some(w) = wd
                && !added.contains(w)
            {
                added.push(w.clone());
            }
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
        let dirs = &self.dirs;
        let woken = match &mut self.events {
            Some(events) => {
                let event = async {
                    let mut burst = take(events, dirs).await?;
                    let settled_by = Instant::now() + max_settle;
                    while !burst.complete {
                        match tokio::time::timeout_at(settled_by, take(events, dirs)).await {
                            Ok(more) => burst.add(more?),
                            Err(_) => break,
                        }
                    }
                    Ok::<_, RecvError>(burst.gone)
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
            // The reader thread is gone (it said why): poll only.
            Some(Err(_)) => {
                self.events = None;
                self.hub = None;
            }
            None => {}
        }
        self.add_watches();
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

    /// Counts `seen` if it is of one of `dirs`, or lost events; whether it was.
    fn count(&mut self, seen: &Seen, dirs: &[(PathBuf, Option<WatchDescriptor>)]) -> bool {
        if seen.mask.contains(EventMask::Q_OVERFLOW) {
            self.complete = true;
            return true;
        }
        if !dirs.iter().any(|(_, wd)| wd.as_ref() == Some(&seen.wd)) {
            return false;
        }
        if seen.mask.contains(EventMask::IGNORED) {
            self.gone.push(seen.wd.clone());
        }
        self.complete |= seen
            .mask
            .intersects(EventMask::CLOSE_WRITE | EventMask::MOVED_TO | EventMask::IGNORED);
        true
    }
}

/// Waits for the next event of one of `dirs` and takes every one already
/// queued. Having fallen behind the backlog counts as a complete change.
async fn take(
    events: &mut broadcast::Receiver<Seen>,
    dirs: &[(PathBuf, Option<WatchDescriptor>)],
) -> Result<Burst, RecvError> {
    let mut burst = Burst {
        gone: Vec::new(),
        complete: false,
    };
    let mut counted = false;
    while !counted {
        match events.recv().await {
            Ok(seen) => counted = burst.count(&seen, dirs),
            Err(RecvError::Lagged(_)) => {
                burst.complete = true;
                counted = true;
            }
            Err(RecvError::Closed) => return Err(RecvError::Closed),
        }
    }
    loop {
        match events.try_recv() {
            Ok(seen) => {
                burst.count(&seen, dirs);
            }
            Err(TryRecvError::Lagged(_)) => burst.complete = true,
            Err(TryRecvError::Empty) => return Ok(burst),
            Err(TryRecvError::Closed) => return Err(RecvError::Closed),
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::FutureExt as _;

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

    /// Held by the tests that count the process's inotify instances.
    static COUNTING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    fn inotify_instances() -> usize {
        std::fs::read_dir("/proc/self/fd")
            .expect("/proc/self/fd")
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|l| l.as_os_str() == "anon_inode:inotify")
            .count()
    }

    /// However many wakes there are, the process holds one inotify
    /// instance, and each wake keeps to its own directories' events.
    #[tokio::test]
    async fn wakes_share_one_instance_and_keep_to_their_directories() {
        let _counting = COUNTING.lock().await;
        let (a, b) = (
            tempfile::tempdir().expect("tempdir"),
            tempfile::tempdir().expect("tempdir"),
        );
        let (path_a, path_b) = (a.path().join("f"), b.path().join("f"));
        std::fs::write(&path_a, "a1").expect("write");
        std::fs::write(&path_b, "b1").expect("write");
        let mut files_a = MountedFiles::new(vec![path_a.clone()]);
        let _ = files_a.poll();
        let mut wake_a = MountedWake::new([path_a.as_path()], NEVER);
        let mut wake_b = MountedWake::new([path_b.as_path()], NEVER);
        let more: Vec<MountedWake> = (0..8)
            .map(|_| MountedWake::new([path_b.as_path()], NEVER))
            .collect();
        assert!(wake_a.watching() && wake_b.watching());
        assert!(more.iter().all(MountedWake::watching));
        // The process's own, and the released one of the test below.
        assert!(inotify_instances() <= 2, "one instance for 10 wakes");

        std::fs::write(&path_a, "a2").expect("write");
        assert_eq!(woken(&mut wake_a, &mut files_a).await, b"a2");
        // b's wake holds the same events by now, none of its directory.
        assert!(
            wake_b.next().now_or_never().is_none(),
            "b's wake woke for a's change"
        );
        let mut files_b = MountedFiles::new(vec![path_b.clone()]);
        let _ = files_b.poll();
        std::fs::write(&path_b, "b2").expect("write");
        assert_eq!(woken(&mut wake_b, &mut files_b).await, b"b2");
    }

    /// Watches in the kernel of the inotify instance behind descriptor `fd`.
    fn kernel_watches(fd: &Path) -> usize {
        let info = fd.to_string_lossy().replace("/fd/", "/fdinfo/");
        std::fs::read_to_string(info)
            .expect("fdinfo")
            .lines()
            .filter(|l| l.starts_with("inotify wd:"))
            .count()
    }

    fn inotify_fds() -> Vec<PathBuf> {
        std::fs::read_dir("/proc/self/fd")
            .expect("/proc/self/fd")
            .filter_map(|e| {
                let p = e.ok()?.path();
                (std::fs::read_link(&p).ok()?.as_os_str() == "anon_inode:inotify").then_some(p)
            })
            .collect()
    }

    /// Released (Envoy's final stop), the watches leave the kernel, so the
    /// agent's exit waits for no grace period; wakes poll only from then on.
    #[tokio::test]
    async fn released_watches_leave_the_kernel_and_wakes_poll_only() {
        let _counting = COUNTING.lock().await;
        // The process's own hub first, so the one made here is told apart.
        let _ = Hub::get();
        let before = inotify_fds();
        let hub: &'static Hub = Box::leak(Box::new(Hub::start().expect("inotify")));
        let fd = inotify_fds()
            .into_iter()
            .find(|p| !before.contains(p))
            .expect("the new instance's descriptor");
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f");
        let mut wake = MountedWake::on(Some(hub), [path.as_path()], Duration::from_millis(10));
        assert!(wake.watching());
        assert_eq!(kernel_watches(&fd), 1);

        hub.release();
        remora_test_support::wait::wait_until(DEADLINE, "the watch removed", || async {
            kernel_watches(&fd) == 0
        })
        .await
        .expect("the watch removed in time");
        tokio::time::timeout(DEADLINE, async {
            while wake.watching() {
                wake.next().await;
            }
        })
        .await
        .expect("the wake told its watch is gone");
        wake.next().await;
        assert!(!wake.watching(), "not watched again once released");
        let later = MountedWake::on(Some(hub), [path.as_path()], NEVER);
        assert!(!later.watching());
        assert_eq!(kernel_watches(&fd), 0);
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
