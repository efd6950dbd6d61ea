//! Two sidecar agents side by side on the host, for the agent micro-bench:
//! remora-agent and Istio's real pilot-agent, each supervising the same Envoy
//! binary with the same inbound listener and cluster, started, observed and
//! stopped the same way. No Kubernetes: each instance is a process with its
//! own ports and directory.

pub mod exec_watch;
pub mod pilot;
pub mod remora;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use remora_agent::http_client::HttpClient;
use remora_test_support::kubelet::atomic_write;
use tokio::process::{Child, Command};

use exec_watch::ExecWatch;

#[derive(Debug, thiserror::Error)]
pub enum AgentBenchError {
    #[error("fanotify on {0}: {1} (the bench needs root)")]
    Fanotify(PathBuf, nix::errno::Errno),
    #[error("starting a thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("reading the pilot-agent bootstrap template {path}: {reason}")]
    Template { path: PathBuf, reason: String },
    #[error("refusing to start pilot-agent: {0}")]
    Unsafe(String),
    #[error("generating the inbound listener: {0}")]
    Listener(String),
    #[error("{name} exited before it was ready ({status}); end of {log}:\n{tail}")]
    ExitedEarly {
        name: String,
        status: ExitStatus,
        log: PathBuf,
        tail: String,
    },
    #[error("{name} not ready after {timeout:?} (Envoy LIVE: {live}); end of {log}:\n{tail}")]
    NotReady {
        name: String,
        timeout: Duration,
        live: bool,
        log: PathBuf,
        tail: String,
    },
    #[error("{name}: no Envoy child of pid {pid} once ready")]
    NoEnvoy { name: String, pid: i32 },
    #[error("{name}: no exec event for Envoy pid {pid}")]
    NoExecEvent { name: String, pid: i32 },
    #[error("{name} did not exit within {timeout:?} of SIGTERM; end of {log}:\n{tail}")]
    NoExit {
        name: String,
        timeout: Duration,
        log: PathBuf,
        tail: String,
    },
    #[error("signalling {name}: {source}")]
    Signal {
        name: String,
        #[source]
        source: nix::errno::Errno,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> AgentBenchError {
    let what = what.into();
    move |source| AgentBenchError::Io { what, source }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub enum Contender {
    #[serde(rename = "remora-agent")]
    Remora,
    #[serde(rename = "pilot-agent")]
    PilotAgent,
}

impl Contender {
    pub const ALL: [Contender; 2] = [Contender::Remora, Contender::PilotAgent];

    pub fn name(self) -> &'static str {
        match self {
            Contender::Remora => "remora-agent",
            Contender::PilotAgent => "pilot-agent",
        }
    }
}

/// What the agent does on SIGTERM. Each variant is a documented setting of
/// both agents, spelled the same way for both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drain {
    /// Nothing set: each agent's own defaults (both wait a 5 s termination drain).
    Defaults,
    /// `terminationDrainDuration` / `--termination-drain-duration`.
    TerminationDrain(Duration),
    /// `EXIT_ON_ZERO_ACTIVE_CONNECTIONS=true` with `MINIMUM_DRAIN_DURATION`.
    ExitOnZero { minimum: Duration },
}

/// One instance's configuration.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub drain: Drain,
    /// mTLS on the inbound listener with the workload certificate from files.
    pub tls: bool,
}

/// What every instance shares.
#[derive(Debug, Clone)]
pub struct Setup {
    /// The one Envoy binary both agents run (canonical path).
    pub envoy: PathBuf,
    pub remora_agent: PathBuf,
    pub pilot_agent: PathBuf,
    /// Istio's `envoy_bootstrap.json` as shipped with the pilot-agent build.
    pub pilot_template: PathBuf,
    /// The app behind every inbound listener.
    pub app_port: u16,
    /// Instances get directories below this.
    pub base: PathBuf,
}

/// A running agent (and the Envoy it started). Dropping it SIGKILLs both,
/// by pid, if they still run.
pub struct Instance {
    pub contender: Contender,
    pub name: String,
    pub pid: i32,
    /// Just before the agent was spawned.
    pub spawned: Instant,
    /// The inbound listener (what clients use).
    pub inbound: u16,
    envoy_admin: u16,
    /// The agent's own readiness endpoint.
    ready_url: String,
    /// The directory the agent reads the workload certificate from.
    pub cert_dir: PathBuf,
    log: PathBuf,
    child: Child,
    envoy_bin: PathBuf,
    envoy_pid: Option<i32>,
}

/// What a start showed, once the agent said ready.
#[derive(Debug, Clone, Copy)]
pub struct Startup {
    /// Agent exec → the agent's readiness endpoint answers 200.
    pub exec_to_ready: Duration,
    /// Envoy's exec (under the agent) → Envoy's admin `/ready` says LIVE.
    pub envoy_exec_to_live: Duration,
    /// Agent exec → Envoy exec: what the agent does before starting Envoy.
    pub agent_to_envoy_exec: Duration,
    /// VmRSS at the moment readiness was seen, in bytes.
    pub agent_rss: u64,
    pub envoy_rss: u64,
    /// The agent's RssAnon at the same moment: its heap and stacks, the part
    /// of its RSS no other pod shares (its code pages are the image's page
    /// cache, one copy per node however many pods run it).
    pub agent_rss_anon: u64,
}

impl Startup {
    /// exec → ready minus Envoy's own exec → LIVE: the agent's part.
    pub fn agent_overhead(&self) -> Duration {
        self.exec_to_ready.saturating_sub(self.envoy_exec_to_live)
    }
}

/// How an agent ended after SIGTERM.
#[derive(Debug, Clone, Copy)]
pub struct Exit {
    /// From the instant given to [`Instance::wait_exit`].
    pub after: Duration,
    pub status: ExitStatus,
    /// Envoy still running when the agent was seen gone: how long after
    /// that it was gone too (polled every millisecond, up to 5 s).
    pub envoy_lingered: Option<Duration>,
}

const POLL: Duration = Duration::from_millis(2);

impl Instance {
    /// Start `contender` with `settings`; the certificate files (Secret-volume
    /// layout) are written first where that agent reads them.
    pub async fn start(
        setup: &Setup,
        contender: Contender,
        settings: Settings,
        certs: &BTreeMap<String, Vec<u8>>,
        name: &str,
    ) -> Result<Self, AgentBenchError> {
        let dir = setup.base.join(name);
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        let prepared = match contender {
            Contender::Remora => remora::prepare(setup, &dir, settings)?,
            Contender::PilotAgent => pilot::prepare(setup, &dir, settings, name)?,
        };
        atomic_write(&prepared.cert_dir, certs)
            .map_err(io(format!("writing {}", prepared.cert_dir.display())))?;
        let log = dir.join("agent.log");
        let out = std::fs::File::create(&log).map_err(io(format!("creating {}", log.display())))?;
        let err = out.try_clone().map_err(io("duplicating the log file"))?;
        let mut cmd = prepared.command;
        cmd.stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .stdin(Stdio::null());
        if contender == Contender::PilotAgent {
            pilot::refuse_unsafe(&cmd)?;
        }
        let spawned = Instant::now();
        let child = cmd.spawn().map_err(io(format!("starting {name}")))?;
        let pid = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
        Ok(Self {
            contender,
            name: name.to_string(),
            pid,
            spawned,
            inbound: prepared.inbound,
            envoy_admin: prepared.envoy_admin,
            ready_url: prepared.ready_url,
            cert_dir: prepared.cert_dir,
            log,
            child,
            envoy_bin: setup.envoy.clone(),
            envoy_pid: None,
        })
    }

    /// Poll the agent's readiness and Envoy's `/ready` every 2 ms until both
    /// say so; then read the RSS of both and Envoy's exec time.
    pub async fn wait_ready(
        &mut self,
        execs: &ExecWatch,
        timeout: Duration,
    ) -> Result<Startup, AgentBenchError> {
        let client = HttpClient::new(Duration::from_secs(1));
        let live_url = format!("http://127.0.0.1:{}/ready", self.envoy_admin);
        let deadline = self.spawned + timeout;
        let (mut live, mut ready) = (None, None);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(AgentBenchError::ExitedEarly {
                    name: self.name.clone(),
                    status,
                    log: self.log.clone(),
                    tail: tail(&self.log),
                });
            }
            if live.is_none()
                && client
                    .get(&live_url)
                    .await
                    .is_ok_and(|r| r.status == 200 && r.body.trim() == "LIVE")
            {
                live = Some(Instant::now());
            }
            if ready.is_none()
                && client
                    .get(&self.ready_url)
                    .await
                    .is_ok_and(|r| r.status == 200)
            {
                ready = Some(Instant::now());
            }
            if let (Some(live), Some(ready)) = (live, ready) {
                return self.startup(execs, live, ready);
            }
            if Instant::now() >= deadline {
                return Err(AgentBenchError::NotReady {
                    name: self.name.clone(),
                    timeout,
                    live: live.is_some(),
                    log: self.log.clone(),
                    tail: tail(&self.log),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    fn startup(
        &mut self,
        execs: &ExecWatch,
        live: Instant,
        ready: Instant,
    ) -> Result<Startup, AgentBenchError> {
        let agent_rss = rss(self.pid);
        let agent_rss_anon = rss_anon(self.pid);
        let envoy_pid = self.envoy_child().ok_or_else(|| AgentBenchError::NoEnvoy {
            name: self.name.clone(),
            pid: self.pid,
        })?;
        let envoy_rss = rss(envoy_pid);
        self.envoy_pid = Some(envoy_pid);
        let exec = execs
            .exec_of(envoy_pid, Duration::from_secs(2))
            .ok_or_else(|| AgentBenchError::NoExecEvent {
                name: self.name.clone(),
                pid: envoy_pid,
            })?;
        Ok(Startup {
            exec_to_ready: ready.saturating_duration_since(self.spawned),
            envoy_exec_to_live: live.saturating_duration_since(exec),
            agent_to_envoy_exec: exec.saturating_duration_since(self.spawned),
            agent_rss,
            envoy_rss,
            agent_rss_anon,
        })
    }

    /// The agent's child running the Envoy binary.
    fn envoy_child(&self) -> Option<i32> {
        children(self.pid).into_iter().find(|c| {
            std::fs::read_link(format!("/proc/{c}/exe")).is_ok_and(|exe| exe == self.envoy_bin)
        })
    }

    pub fn envoy_pid(&self) -> Option<i32> {
        self.envoy_pid
    }

    /// Whether the agent still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGTERM to the agent's pid only (a group signal would reach Envoy
    /// directly too); returns when it was sent.
    pub fn sigterm(&self) -> Result<Instant, AgentBenchError> {
        kill(Pid::from_raw(self.pid), Signal::SIGTERM).map_err(|source| {
            AgentBenchError::Signal {
                name: self.name.clone(),
                source,
            }
        })?;
        Ok(Instant::now())
    }

    /// Wait for the agent to exit; the time is measured from `since`.
    pub async fn wait_exit(
        &mut self,
        since: Instant,
        timeout: Duration,
    ) -> Result<Exit, AgentBenchError> {
        let status = match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(s) => s.map_err(io(format!("waiting for {}", self.name)))?,
            Err(_) => {
                return Err(AgentBenchError::NoExit {
                    name: self.name.clone(),
                    timeout,
                    log: self.log.clone(),
                    tail: tail(&self.log),
                });
            }
        };
        let after = since.elapsed();
        let gone = Instant::now();
        let envoy_lingered = match self.envoy_pid.filter(|p| alive(*p)) {
            None => None,
            Some(p) => {
                while alive(p) && gone.elapsed() < Duration::from_secs(5) {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Some(gone.elapsed())
            }
        };
        Ok(Exit {
            after,
            status,
            envoy_lingered,
        })
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        if !self.running() {
            if let Some(p) = self.envoy_pid.filter(|p| alive(*p)) {
                let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
            }
            return;
        }
        for c in children(self.pid) {
            let _ = kill(Pid::from_raw(c), Signal::SIGKILL);
        }
        let _ = self.child.start_kill();
    }
}

/// What a contender's module hands back: the command and where things are.
pub struct Prepared {
    pub command: Command,
    pub inbound: u16,
    pub envoy_admin: u16,
    pub ready_url: String,
    pub cert_dir: PathBuf,
}

/// VmRSS of `pid` in bytes (0 if gone).
pub fn rss(pid: i32) -> u64 {
    proc_status_bytes(pid, "VmRSS:")
}

/// RssAnon of `pid` in bytes (0 if gone).
pub fn rss_anon(pid: i32) -> u64 {
    proc_status_bytes(pid, "RssAnon:")
}

fn proc_status_bytes(pid: i32, key: &str) -> u64 {
    u32::try_from(pid)
        .ok()
        .and_then(|pid| proc_status_kib(pid, key))
        .map_or(0, |kb| kb.saturating_mul(1024))
}

/// A kB figure of `/proc/<pid>/status` (`key` as `"VmRSS:"`); `None` when
/// the process is gone.
pub fn proc_status_kib(pid: u32, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Pids of a process's direct children (Envoy under the agent), from the
/// parent pid in `/proc/<pid>/stat`.
pub fn children(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in entries.flatten() {
        let Some(child) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<i32>().ok());
        if ppid == Some(pid) {
            out.push(child);
        }
    }
    out
}

/// A process that exists and is not a zombie.
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// The last lines of a log, for error messages.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Only what both agents need from the environment: the bench's own
/// environment (REMORA_*, PROXY_CONFIG, ...) must not tune either of them.
fn clean_env(cmd: &mut Command, dir: &Path) {
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", dir)
        .env("POD_NAMESPACE", "bench")
        .env("SERVICE_ACCOUNT", "default")
        .env("INSTANCE_IP", "127.0.0.1");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_and_liveness_of_this_process() {
        let me = i32::try_from(std::process::id()).expect("pid");
        assert!(rss(me) > 0);
        assert!(rss_anon(me) > 0 && rss_anon(me) <= rss(me));
        assert!(alive(me));
        assert_eq!(rss(i32::MAX), 0);
        assert!(!alive(i32::MAX));
    }

    #[test]
    fn a_child_is_listed_under_its_parent_only() {
        let me = i32::try_from(std::process::id()).expect("pid");
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .expect("sleep");
        let pid = i32::try_from(child.id()).expect("pid");
        let (mine, its) = (children(me), children(pid));
        let _ = child.kill();
        let _ = child.wait();
        assert!(mine.contains(&pid), "{pid} not in {mine:?}");
        assert!(its.is_empty(), "{its:?}");
    }
}
