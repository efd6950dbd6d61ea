//! Child processes of the control plane, and the janitor that kills them when
//! the test process goes away by any means.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::Error;

/// One running component (etcd, kube-apiserver, kube-controller-manager),
/// its stdout and stderr in `log`.
#[derive(Debug)]
pub struct Proc {
    pub name: &'static str,
    child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn spawn(
        name: &'static str,
        bin: &Path,
        args: &[String],
        dir: &Path,
    ) -> Result<Self, Error> {
        Self::spawn_with_env(name, bin, args, &[], dir)
    }

    /// [`Proc::spawn`] with `env` added to the inherited environment.
    pub fn spawn_with_env(
        name: &'static str,
        bin: &Path,
        args: &[String],
        env: &[(&str, &str)],
        dir: &Path,
    ) -> Result<Self, Error> {
        let log = dir.join(format!("{name}.log"));
        let out =
            File::create(&log).map_err(|e| Error::io(format!("creating {}", log.display()), e))?;
        let err = out
            .try_clone()
            .map_err(|e| Error::io(format!("cloning {}", log.display()), e))?;
        let child = Command::new(bin)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| Error::io(format!("starting {}", bin.display()), e))?;
        Ok(Self { name, child, log })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Some(status)` once the process has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The end of the log, for error messages.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log, 4000)
    }

    /// SIGTERM, then SIGKILL after `grace`; always reaps the child.
    pub fn stop(&mut self, grace: Duration) {
        if self.exited().is_some() {
            return;
        }
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.exited().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Last `max` bytes of a file, lossily decoded; empty if unreadable.
pub fn log_tail(path: &Path, max: u64) -> String {
    let Ok(mut f) = File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// Kills the components and removes the scratch directory once the test
/// process has gone, however it went: a shared control plane lives in a
/// `static`, which Rust never drops, and a test binary may be killed.
///
/// A `sh` reads the pids on its stdin, a pipe whose write end only this
/// process holds (close-on-exec, so no other child inherits it). EOF on that
/// pipe means the test process closed it or died; the janitor then SIGTERMs
/// the components, SIGKILLs them after 5 s and removes the directory. It
/// ignores SIGINT/SIGTERM/SIGHUP so that a Ctrl-C to the process group, which
/// kills the test, does not kill the cleaner. This needs no `unsafe`
/// (`PR_SET_PDEATHSIG` would need `pre_exec`, and it follows the forking
/// thread, which for a `#[tokio::test]` ends with the first test).
#[derive(Debug)]
pub struct Janitor {
    child: Child,
    stdin: Option<ChildStdin>,
}

const JANITOR: &str = r#"
trap '' INT TERM HUP
dir=$1; keep=$2; pids=
while read -r p; do pids="$pids $p"; done
for p in $pids; do kill -TERM "$p" 2>/dev/null; done
# A zombie (dead, not yet reaped by init) counts as gone.
alive() { kill -0 "$1" 2>/dev/null && ! grep -qs '^[^)]*) Z' "/proc/$1/stat"; }
i=0
while [ "$i" -lt 50 ]; do
  alive=
  for p in $pids; do alive "$p" && alive=1; done
  [ -z "$alive" ] && break
  sleep 0.1; i=$((i + 1))
done
for p in $pids; do kill -KILL "$p" 2>/dev/null; done
[ "$keep" = 1 ] || rm -rf "$dir"
"#;

impl Janitor {
    pub fn spawn(dir: &Path, keep: bool) -> Result<Self, Error> {
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(JANITOR)
            .arg("remora-e2e-janitor")
            .arg(dir)
            .arg(if keep { "1" } else { "0" })
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| Error::io("starting the janitor (sh)".to_owned(), e))?;
        let stdin = child.stdin.take();
        Ok(Self { child, stdin })
    }

    /// Hands a component's pid to the janitor.
    pub fn watch(&mut self, pid: u32) -> Result<(), Error> {
        let Some(stdin) = self.stdin.as_mut() else {
            return Ok(());
        };
        writeln!(stdin, "{pid}")
            .and_then(|()| stdin.flush())
            .map_err(|e| Error::io("writing to the janitor".to_owned(), e))
    }

    /// Closes the pipe, so the janitor cleans up now, and waits for it.
    pub fn finish(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    /// The janitor acts on EOF, which is what the test process dying looks
    /// like from its side: it stops the components and removes the dir.
    #[test]
    fn janitor_stops_processes_and_removes_the_dir_on_eof() -> Result<(), Error> {
        let dir = tempfile::tempdir()
            .map_err(|e| Error::io("tempdir".to_owned(), e))?
            .keep();
        let mut janitor = Janitor::spawn(&dir, false)?;
        let mut p = Proc::spawn("sleep", Path::new("sleep"), &["1000".to_owned()], &dir)?;
        janitor.watch(p.pid())?;
        assert!(p.exited().is_none());

        drop(janitor.stdin.take());
        // Reaped here, as init would reap it once the test process is gone.
        let status = p
            .child
            .wait()
            .map_err(|e| Error::io("wait".to_owned(), e))?;
        assert_eq!(status.signal(), Some(Signal::SIGTERM as i32));
        janitor.finish();
        assert!(!dir.exists(), "{} left behind", dir.display());
        Ok(())
    }

    #[test]
    fn stop_reaps_and_log_tail_reads_the_end() -> Result<(), Error> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir".to_owned(), e))?;
        let script = "seq 1 2000; exec sleep 1000".to_owned();
        let mut p = Proc::spawn(
            "seq",
            Path::new("sh"),
            &["-c".to_owned(), script],
            dir.path(),
        )?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !log_tail(&p.log, 100).contains("2000") {
            assert!(
                Instant::now() < deadline,
                "no output in {}",
                p.log.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(p.log_tail().ends_with("1999\n2000\n"));
        assert!(p.log_tail().len() <= 4000);
        p.stop(Duration::from_secs(5));
        assert!(p.exited().is_some());
        Ok(())
    }
}
