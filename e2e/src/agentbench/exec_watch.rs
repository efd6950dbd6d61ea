//! When a binary was exec'd, and by which process: fanotify's
//! `FAN_OPEN_EXEC` on the file, read by a thread that stamps each event as it
//! arrives. `/proc/<pid>/stat` only has start times in clock ticks (10 ms
//! here), too coarse next to the ~60 ms Envoy needs to become LIVE. Needs
//! `CAP_SYS_ADMIN` (root).

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::mpsc::{Receiver, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::fanotify::{EventFFlags, Fanotify, InitFlags, MarkFlags, MaskFlags};

use super::AgentBenchError;

/// Every exec of one file since the watch started, by pid.
pub struct ExecWatch {
    events: Mutex<Receiver<(i32, Instant)>>,
    seen: Mutex<HashMap<i32, Instant>>,
    // Kept so the group outlives the reading thread's borrow.
    _fan: Arc<Fanotify>,
}

impl ExecWatch {
    /// Watch execs of `binary` (symlinks followed: the mark is on the inode
    /// that runs).
    pub fn new(binary: &Path) -> Result<Self, AgentBenchError> {
        let fanotify = |e: Errno| AgentBenchError::Fanotify(binary.to_path_buf(), e);
        let fan = Fanotify::init(
            InitFlags::FAN_CLASS_NOTIF | InitFlags::FAN_CLOEXEC,
            EventFFlags::O_RDONLY | EventFFlags::O_CLOEXEC | EventFFlags::O_LARGEFILE,
        )
        .map_err(fanotify)?;
        fan.mark(
            MarkFlags::FAN_MARK_ADD,
            MaskFlags::FAN_OPEN_EXEC,
            nix::fcntl::AT_FDCWD.as_fd(),
            Some(binary),
        )
        .map_err(fanotify)?;
        let fan = Arc::new(fan);
        let (tx, rx) = channel();
        let reader = fan.clone();
        // A blocking read per batch; the thread ends with the process (or
        // when nobody listens any more).
        std::thread::Builder::new()
            .name("exec-watch".into())
            .spawn(move || {
                loop {
                    match reader.read_events() {
                        Ok(events) => {
                            let at = Instant::now();
                            for e in events {
                                // Dropping the event closes its file descriptor.
                                if tx.send((e.pid(), at)).is_err() {
                                    return;
                                }
                            }
                        }
                        Err(Errno::EINTR) => {}
                        Err(_) => return,
                    }
                }
            })
            .map_err(AgentBenchError::Thread)?;
        Ok(Self {
            events: Mutex::new(rx),
            seen: Mutex::new(HashMap::new()),
            _fan: fan,
        })
    }

    /// When `pid` exec'd the binary, waiting up to `timeout` for the event
    /// (the reading thread may be a little behind on a busy machine).
    pub fn exec_of(&self, pid: i32, timeout: Duration) -> Option<Instant> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(at) = self.drain().get(&pid) {
                return Some(*at);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            let rx = self.events.lock().unwrap_or_else(|e| e.into_inner());
            if let Ok((p, at)) = rx.recv_timeout(left) {
                drop(rx);
                self.seen
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(p, at);
            }
        }
    }

    fn drain(&self) -> std::sync::MutexGuard<'_, HashMap<i32, Instant>> {
        let rx = self.events.lock().unwrap_or_else(|e| e.into_inner());
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.extend(rx.try_iter());
        seen
    }
}
