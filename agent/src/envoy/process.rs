//! Starting and stopping one Envoy process.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::sync::watch;

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("Envoy binary {0} not found (set --envoy-bin)")]
    NotFound(PathBuf),
    #[error("cannot start Envoy {bin}: {source}")]
    Spawn {
        bin: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// How one Envoy is started.
#[derive(Debug, Clone)]
pub struct EnvoyArgs {
    pub bin: PathBuf,
    pub bootstrap: PathBuf,
    pub epoch: u32,
    pub base_id: BaseId,
    pub drain_time: Duration,
    pub drain_strategy: &'static str,
    pub parent_shutdown_time: Duration,
    pub concurrency: u32,
    pub log_level: String,
    pub component_log_level: Option<String>,
}

/// Envoy's shared-memory id; hot restarts need the same one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BaseId {
    Fixed(u32),
    /// Let Envoy pick a free id and write it to this file (first start only).
    Dynamic {
        path: PathBuf,
    },
}

impl EnvoyArgs {
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            "-c".to_string(),
            self.bootstrap.display().to_string(),
            "--restart-epoch".into(),
            self.epoch.to_string(),
            // Envoy takes whole seconds; round up so a sub-second setting is not zero.
            "--drain-time-s".into(),
            ceil_secs(self.drain_time).to_string(),
            "--drain-strategy".into(),
            self.drain_strategy.to_string(),
            "--parent-shutdown-time-s".into(),
            ceil_secs(self.parent_shutdown_time).to_string(),
            "--concurrency".into(),
            self.concurrency.to_string(),
            "--log-level".into(),
            self.log_level.clone(),
        ];
        match &self.base_id {
            BaseId::Fixed(id) => a.extend(["--base-id".into(), id.to_string()]),
            BaseId::Dynamic { path } => a.extend([
                "--use-dynamic-base-id".into(),
                "--base-id-path".into(),
                path.display().to_string(),
            ]),
        }
        if let Some(c) = &self.component_log_level {
            a.extend(["--component-log-level".into(), c.clone()]);
        }
        a
    }
}

fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// Resolve `--envoy-bin`: a path must exist; a bare name is looked up on PATH.
pub fn resolve_binary(bin: &Path) -> Result<PathBuf, ProcessError> {
    let is_file = |p: &Path| p.metadata().map(|m| m.is_file()).unwrap_or(false);
    if bin.components().count() > 1 || bin.is_absolute() {
        return if is_file(bin) {
            Ok(bin.to_path_buf())
        } else {
            Err(ProcessError::NotFound(bin.to_path_buf()))
        };
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join(bin))
        .find(|p| is_file(p))
        .ok_or_else(|| ProcessError::NotFound(bin.to_path_buf()))
}

/// A running (or exited) Envoy. The child is owned by a reaper task; this
/// handle signals it and watches for its exit.
#[derive(Debug, Clone)]
pub struct EnvoyProcess {
    pub epoch: u32,
    pub pid: u32,
    exit: watch::Receiver<Option<ExitStatus>>,
}

impl EnvoyProcess {
    /// Start Envoy. Its stdout/stderr are the agent's.
    pub fn spawn(args: &EnvoyArgs) -> Result<Self, ProcessError> {
        let mut cmd = tokio::process::Command::new(&args.bin);
        cmd.args(args.to_args())
            .stdin(Stdio::null())
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        die_with_parent(&mut cmd);
        let mut child = cmd.spawn().map_err(|source| ProcessError::Spawn {
            bin: args.bin.clone(),
            source,
        })?;
        let pid = child.id().unwrap_or(0);
        let (tx, rx) = watch::channel(None);
        tokio::spawn(async move {
            let status = child.wait().await;
            match status {
                Ok(s) => {
                    let _ = tx.send(Some(s));
                }
                Err(e) => {
                    tracing::error!(error = %e, "lost track of Envoy");
                    let _ = tx.send(Some(std::os::unix::process::ExitStatusExt::from_raw(
                        255 << 8,
                    )));
                }
            }
        });
        Ok(Self {
            epoch: args.epoch,
            pid,
            exit: rx,
        })
    }

    /// The exit status, once it has exited.
    pub fn exit_status(&self) -> Option<ExitStatus> {
        *self.exit.borrow()
    }

    /// Wait until it exits.
    pub async fn wait(&self) -> ExitStatus {
        let mut rx = self.exit.clone();
        loop {
            if let Some(s) = *rx.borrow_and_update() {
                return s;
            }
            if rx.changed().await.is_err() {
                // The reaper is gone without a status: only if the runtime is shutting down.
                return std::os::unix::process::ExitStatusExt::from_raw(255 << 8);
            }
        }
    }

    pub fn signal(&self, sig: Signal) {
        // Never signal a pid that was already reaped (it may be reused).
        if self.exit_status().is_none() && self.pid != 0 {
            let pid = i32::try_from(self.pid).unwrap_or(0);
            if pid > 0 {
                let _ = kill(Pid::from_raw(pid), sig);
            }
        }
    }

    /// SIGTERM, then SIGKILL after `grace`. Returns the exit status, or
    /// `None` when it has not been reaped [`KILL_WAIT`] after SIGKILL (a
    /// process stuck in the kernel): the caller's own deadline comes first.
    pub async fn stop(&self, grace: Duration) -> Option<ExitStatus> {
        self.signal(Signal::SIGTERM);
        if let Ok(s) = tokio::time::timeout(grace, self.wait()).await {
            return Some(s);
        }
        tracing::warn!(
            pid = self.pid,
            ?grace,
            "Envoy did not stop on SIGTERM; killing it"
        );
        self.signal(Signal::SIGKILL);
        let status = tokio::time::timeout(KILL_WAIT, self.wait()).await.ok();
        if status.is_none() {
            tracing::error!(pid = self.pid, "Envoy was not reaped after SIGKILL");
        }
        status
    }
}

/// How long a SIGKILLed Envoy is waited for: the kernel reaps it in
/// microseconds unless it is stuck in an uninterruptible call.
pub const KILL_WAIT: Duration = Duration::from_millis(50);

/// Make the kernel kill Envoy when the agent dies, even by SIGKILL, so Envoy
/// never outlives the agent.
///
/// The documented exception to the workspace's `unsafe_code` lint:
/// `pre_exec` is unsafe because the closure runs between fork and exec, where
/// only async-signal-safe calls are allowed. It calls `prctl(PR_SET_PDEATHSIG)`
/// and `getppid()`, both plain syscalls that allocate nothing and take no lock.
/// The death signal follows the thread that forked, so Envoy must be spawned
/// from a thread that lives as long as the agent: the agent runs a
/// current-thread runtime, whose only thread is the main one.
#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut tokio::process::Command) {
    let parent = std::process::id();
    // SAFETY: see above; the closure only makes async-signal-safe syscalls.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)?;
            // The agent may have died between fork and prctl: then never start.
            if u32::try_from(nix::unistd::getppid().as_raw()).ok() != Some(parent) {
                return Err(std::io::Error::other("agent exited before Envoy started"));
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_round_up_and_name_base_id() {
        let a = EnvoyArgs {
            bin: "envoy".into(),
            bootstrap: "/run/b.json".into(),
            epoch: 2,
            base_id: BaseId::Fixed(7),
            drain_time: Duration::from_millis(1500),
            drain_strategy: "gradual",
            parent_shutdown_time: Duration::from_secs(60),
            concurrency: 2,
            log_level: "warning".into(),
            component_log_level: None,
        };
        let v = a.to_args();
        let after = |flag: &str| {
            v.iter()
                .position(|x| x == flag)
                .map(|i| v[i + 1].clone())
                .expect(flag)
        };
        assert_eq!(after("--drain-time-s"), "2");
        assert_eq!(after("--restart-epoch"), "2");
        assert_eq!(after("--base-id"), "7");
        assert!(!v.contains(&"--use-dynamic-base-id".to_string()));
    }

    #[test]
    fn missing_binary_is_named() {
        let err = resolve_binary(Path::new("/nonexistent/envoy")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/envoy"));
        let err = resolve_binary(Path::new("surely-not-an-envoy-binary")).unwrap_err();
        assert!(err.to_string().contains("surely-not-an-envoy-binary"));
    }
}
