//! Supervision of Envoy: start, crash restarts within a budget, hot restarts,
//! the drain on termination, and the agent's exit status.
//!
//! One task owns every Envoy process. Everything else talks to it through
//! [`Control`] messages: signals, the admin endpoints, the input watcher.

use std::path::PathBuf;
use std::pin::Pin;
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::Duration;

use futures::future::pending;
use serde::Serialize;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::bootstrap::{self, BootstrapError, Extras};
use crate::config::RunConfig;
use crate::drain::{self, DrainOutcome, DrainReport};
use crate::envoy::admin::{EnvoyAdmin, ServerState};
use crate::envoy::process::{BaseId, EnvoyArgs, EnvoyProcess};
use crate::lifecycle::LiveSettings;
use crate::metrics::{DrainLabels, Metrics, RestartKind, RestartLabels};
use crate::readiness::{Readiness, ReadinessGuard};

/// Longest pause between two crash restarts.
const MAX_RESTART_DELAY: Duration = Duration::from_secs(30);
/// How often readiness asks Envoy whether it is up yet.
const READY_POLL: Duration = Duration::from_millis(2);

/// What the supervisor is asked to do.
#[derive(Debug)]
pub enum Control {
    /// SIGTERM or SIGINT: the first drains then stops; a second aborts.
    Signal,
    /// Drain now (preStop `remora-agent drain`); Envoy keeps running afterwards,
    /// until a signal or `/quitquitquit`.
    Drain,
    /// Stop Envoy now and exit 0 (`/quitquitquit`, for Jobs).
    Quit,
    /// The bootstrap's inputs changed: start a new epoch.
    HotRestart { reason: String },
}

/// Why the agent exits; [`ExitReason::code`] is its process status.
#[derive(Debug, Clone)]
pub enum ExitReason {
    /// Envoy exited on its own.
    EnvoyExited(ExitStatus),
    /// `/quitquitquit`.
    Quit,
    /// Terminated after a drain.
    Drained(DrainReport),
    /// Envoy kept failing: more than `--max-restarts` within `--restart-window`.
    RestartBudgetExhausted { failures: usize },
    /// Envoy could not be started at all.
    StartFailed(String),
    /// A second signal cut the drain short.
    Aborted,
}

impl ExitReason {
    /// 0: clean (Envoy exited 0, quit, or a drain that ended as configured);
    /// 1: Envoy failed (could not start, or crashed beyond the budget);
    /// 3: the drain deadline came before the connections closed;
    /// 4: aborted by a second signal;
    /// otherwise Envoy's own status (128+N when killed by signal N).
    pub fn code(&self) -> i32 {
        match self {
            Self::EnvoyExited(s) => status_code(*s),
            Self::Quit => 0,
            Self::Drained(r) if r.outcome.is_clean() => 0,
            Self::Drained(_) => 3,
            Self::RestartBudgetExhausted { .. } | Self::StartFailed(_) => 1,
            Self::Aborted => 4,
        }
    }
}

fn status_code(s: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    s.code()
        .or_else(|| s.signal().map(|n| 128 + n))
        .unwrap_or(1)
}

/// Counts abnormal exits within a sliding window and spaces restarts out.
#[derive(Debug)]
pub struct RestartBudget {
    max: u32,
    window: Duration,
    base_delay: Duration,
    failures: std::collections::VecDeque<Instant>,
}

impl RestartBudget {
    pub fn new(max: u32, window: Duration, base_delay: Duration) -> Self {
        Self {
            max,
            window,
            base_delay,
            failures: Default::default(),
        }
    }

    /// Record a failure at `now`. `Some(delay)`: restart after `delay`
    /// (doubling with each failure in the window); `None`: the budget is spent.
    pub fn on_failure(&mut self, now: Instant) -> Option<Duration> {
        while let Some(first) = self.failures.front() {
            if now.duration_since(*first) >= self.window {
                self.failures.pop_front();
            } else {
                break;
            }
        }
        self.failures.push_back(now);
        let n = self.failures.len();
        if n > self.max as usize {
            return None;
        }
        let exp = u32::try_from(n.saturating_sub(1))
            .unwrap_or(u32::MAX)
            .min(16);
        Some(
            self.base_delay
                .saturating_mul(1 << exp)
                .min(MAX_RESTART_DELAY),
        )
    }

    pub fn failures(&self) -> usize {
        self.failures.len()
    }
}

/// What `/debug/config` shows of the running Envoy.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EnvoyState {
    pub epoch: u32,
    pub pid: Option<u32>,
    pub base_id: Option<u32>,
    pub crash_restarts: u64,
    pub hot_restarts: u64,
    pub draining: bool,
}

/// Handles the rest of the agent keeps on the supervisor.
#[derive(Clone, Debug)]
pub struct SupervisorHandle {
    pub control: mpsc::Sender<Control>,
    /// `Some` once a drain has finished.
    pub drained: watch::Receiver<Option<DrainReport>>,
    /// True once a drain has let the app stop (inbound quiet, or at once when
    /// the drain is fixed); what the app containers' preStop hook waits for.
    pub inbound_quiet: watch::Receiver<bool>,
    pub state: watch::Receiver<EnvoyState>,
}

pub struct Supervisor {
    cfg: Arc<RunConfig>,
    envoy_bin: PathBuf,
    extras: Extras,
    admin: EnvoyAdmin,
    live: LiveSettings,
    metrics: Metrics,
    envoy_guard: Arc<ReadinessGuard>,
    readiness: Readiness,
    draining_guard: Option<ReadinessGuard>,
    budget: RestartBudget,
    current: Option<EnvoyProcess>,
    parents: Vec<EnvoyProcess>,
    monitor: Option<JoinHandle<()>>,
    base_id: Option<u32>,
    rx: mpsc::Receiver<Control>,
    drained_tx: watch::Sender<Option<DrainReport>>,
    inbound_quiet_tx: watch::Sender<bool>,
    state_tx: watch::Sender<EnvoyState>,
}

type DrainFuture = Pin<Box<dyn std::future::Future<Output = DrainReport> + Send>>;

enum Event {
    Exited(ExitStatus),
    RestartDue,
    Control(Control),
    DrainDone(DrainReport),
}

impl Supervisor {
    pub fn new(
        cfg: Arc<RunConfig>,
        envoy_bin: PathBuf,
        extras: Extras,
        readiness: Readiness,
        metrics: Metrics,
    ) -> (Self, SupervisorHandle) {
        let (control, rx) = mpsc::channel(16);
        let (drained_tx, drained) = watch::channel(None);
        let (inbound_quiet_tx, inbound_quiet) = watch::channel(false);
        let (state_tx, state) = watch::channel(EnvoyState::default());
        let envoy_guard = Arc::new(readiness.register("envoy", "Envoy is not started yet"));
        let sup = Self {
            admin: EnvoyAdmin::new(cfg.envoy_admin_port),
            live: LiveSettings::new(&cfg),
            budget: RestartBudget::new(cfg.max_restarts, cfg.restart_window, cfg.restart_backoff),
            base_id: cfg.base_id,
            cfg,
            envoy_bin,
            extras,
            metrics,
            envoy_guard,
            readiness,
            draining_guard: None,
            current: None,
            parents: Vec::new(),
            monitor: None,
            rx,
            drained_tx,
            inbound_quiet_tx,
            state_tx,
        };
        let handle = SupervisorHandle {
            control,
            drained,
            inbound_quiet,
            state,
        };
        (sup, handle)
    }

    /// Render and write the bootstrap from the current inputs.
    pub fn render(&self) -> Result<serde_json::Value, BootstrapError> {
        let ov = match &self.cfg.bootstrap_override {
            Some(p) => Some(bootstrap::read_override(p)?),
            None => None,
        };
        bootstrap::generate(&self.cfg, &self.extras, ov.as_ref())
    }

    fn envoy_args(&self, epoch: u32, bootstrap: PathBuf) -> EnvoyArgs {
        let base_id = match self.base_id {
            Some(id) => BaseId::Fixed(id),
            None => BaseId::Dynamic {
                path: self.base_id_path(),
            },
        };
        EnvoyArgs {
            bin: self.envoy_bin.clone(),
            bootstrap,
            epoch,
            base_id,
            drain_time: self.live.current().drain_duration,
            drain_strategy: self.cfg.drain_strategy.as_envoy_arg(),
            parent_shutdown_time: self.cfg.parent_shutdown_duration,
            concurrency: self.cfg.concurrency,
            log_level: self.cfg.log_level.clone(),
            component_log_level: self.cfg.component_log_level.clone(),
        }
    }

    fn base_id_path(&self) -> PathBuf {
        self.cfg.run_dir.join("envoy-base-id")
    }

    /// Start Envoy from scratch (epoch 0): the first start and after a crash.
    fn start_fresh(&mut self) -> Result<(), String> {
        let bootstrap = self.render().map_err(|e| e.to_string())?;
        let path = self.cfg.bootstrap_path();
        bootstrap::write(&path, &bootstrap).map_err(|e| e.to_string())?;
        if self.cfg.base_id.is_none() {
            // A fresh start picks a free base id again (the old one may be taken by now).
            self.base_id = None;
            let _ = std::fs::remove_file(self.base_id_path());
        }
        let args = self.envoy_args(0, path);
        let proc = EnvoyProcess::spawn(&args).map_err(|e| e.to_string())?;
        tracing::info!(pid = proc.pid, epoch = 0, "started Envoy");
        self.envoy_guard.pending("Envoy is starting");
        self.current = Some(proc);
        self.start_monitor();
        self.publish_state(|s| {
            s.epoch = 0;
        });
        Ok(())
    }

    /// Watch the new Envoy until it is up, then release the readiness guard.
    fn start_monitor(&mut self) {
        if let Some(m) = self.monitor.take() {
            m.abort();
        }
        let admin = self.admin.clone();
        let guard = self.envoy_guard.clone();
        let xds = self.cfg.discovery_address.clone().filter(|a| !a.is_empty());
        self.monitor = Some(tokio::spawn(async move {
            loop {
                match admin.server_status().await {
                    Ok(st) => {
                        let reason = match st.state {
                            ServerState::Live if !st.workers_started => {
                                Some("Envoy's workers have not started".to_string())
                            }
                            ServerState::Live => match &xds {
                                Some(addr) if st.lds_updates == 0 || st.cds_updates == 0 => {
                                    Some(format!(
                                        "waiting for the first LDS and CDS from {addr} \
                                         (LDS updates: {}, CDS updates: {})",
                                        st.lds_updates, st.cds_updates
                                    ))
                                }
                                _ => None,
                            },
                            other => Some(format!("Envoy is not LIVE yet (state {other:?})")),
                        };
                        match reason {
                            None => {
                                guard.ready();
                                tracing::info!("Envoy is ready");
                                return;
                            }
                            Some(r) => guard.pending(r),
                        }
                    }
                    Err(e) => guard.pending(format!("Envoy admin does not answer yet: {e}")),
                }
                tokio::time::sleep(READY_POLL).await;
            }
        }));
    }

    /// Start epoch+1 alongside the running Envoy; it takes the listeners over
    /// and the old one drains for the parent shutdown time.
    async fn hot_restart(&mut self, reason: &str) {
        let Some(cur) = self.current.clone() else {
            tracing::info!(reason, "hot restart requested while Envoy is down; skipped");
            return;
        };
        let bootstrap = match self.render() {
            Ok(b) => b,
            Err(e) => {
                self.metrics.envoy_starts_failed.inc();
                tracing::error!(error = %e, "new bootstrap rejected; Envoy keeps its configuration");
                return;
            }
        };
        let base_id = match self.base_id.or_else(|| read_base_id(&self.base_id_path())) {
            Some(id) => id,
            None => {
                tracing::error!("Envoy's base id is unknown; cannot hot restart");
                return;
            }
        };
        self.base_id = Some(base_id);
        let candidate = self.cfg.run_dir.join("envoy-bootstrap.next.json");
        if let Err(e) = bootstrap::write(&candidate, &bootstrap) {
            tracing::error!(error = %e, "cannot write the new bootstrap");
            return;
        }
        if let Err(e) = validate(&self.envoy_bin, &candidate).await {
            self.metrics.envoy_starts_failed.inc();
            tracing::error!(error = %e, "Envoy rejects the new bootstrap; keeping the running one");
            return;
        }
        let path = self.cfg.bootstrap_path();
        if let Err(e) = std::fs::rename(&candidate, &path) {
            tracing::error!(error = %e, "cannot install the new bootstrap");
            return;
        }
        let epoch = cur.epoch + 1;
        let args = self.envoy_args(epoch, path);
        match EnvoyProcess::spawn(&args) {
            Ok(p) => {
                tracing::info!(
                    reason,
                    pid = p.pid,
                    epoch,
                    "hot restart: new Envoy epoch started"
                );
                self.metrics
                    .envoy_restarts
                    .get_or_create(&RestartLabels {
                        kind: RestartKind::Hot,
                    })
                    .inc();
                self.parents.retain(|p| p.exit_status().is_none());
                self.parents.push(cur);
                self.current = Some(p);
                self.publish_state(|s| {
                    s.epoch = epoch;
                    s.hot_restarts += 1;
                });
            }
            Err(e) => {
                self.metrics.envoy_starts_failed.inc();
                tracing::error!(error = %e, "hot restart failed; the running Envoy stays");
            }
        }
    }

    fn publish_state(&self, f: impl FnOnce(&mut EnvoyState)) {
        let pid = self.current.as_ref().map(|p| p.pid);
        let base_id = self.base_id;
        self.state_tx.send_modify(|s| {
            f(s);
            s.pid = pid;
            if base_id.is_some() {
                s.base_id = base_id;
            }
        });
    }

    /// Stop every Envoy: the current one gracefully, old epochs as well.
    async fn stop_all(&mut self, grace: Duration) -> Option<ExitStatus> {
        if let Some(m) = self.monitor.take() {
            m.abort();
        }
        let parents = std::mem::take(&mut self.parents);
        let cur = self.current.take();
        let stops = parents.iter().chain(cur.iter()).map(|p| p.stop(grace));
        let statuses = futures::future::join_all(stops).await;
        cur.and(statuses.last().copied())
    }

    fn start_drain(&mut self) -> DrainFuture {
        let settings = self.live.current();
        self.draining_guard = Some(self.readiness.register("draining", "the proxy is draining"));
        self.publish_state(|s| s.draining = true);
        let admin = self.admin.clone();
        let poll = self.cfg.drain_poll_interval;
        let started = Instant::now();
        let inbound_quiet = self.inbound_quiet_tx.clone();
        Box::pin(async move { drain::run(&admin, settings, poll, started, &inbound_quiet).await })
    }

    fn record_drain(&self, report: &DrainReport) {
        if let Some(n) = report.active_at_start {
            self.metrics
                .drain_active_connections_at_start
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        self.metrics.drain_duration.observe(report.duration_seconds);
        self.metrics
            .drains
            .get_or_create(&DrainLabels {
                outcome: report.outcome.label(),
            })
            .inc();
        tracing::info!(report = %serde_json::to_string(report).unwrap_or_default(), "drain finished");
        self.drained_tx.send_replace(Some(report.clone()));
    }

    /// Time left for stopping Envoy after a drain that started at `started`.
    fn stop_grace(&self, started: Instant, deadline: Duration) -> Duration {
        let left = deadline.saturating_sub(started.elapsed());
        self.cfg
            .envoy_stop_grace
            .min(left)
            .max(Duration::from_millis(100))
    }

    /// Supervise until the agent should exit.
    pub async fn run(mut self) -> ExitReason {
        if let Err(e) = self.start_fresh() {
            self.metrics.envoy_starts_failed.inc();
            return ExitReason::StartFailed(e);
        }
        let mut drain: Option<DrainFuture> = None;
        let mut drain_started: Option<(Instant, Duration)> = None;
        let mut drained: Option<DrainReport> = None;
        let mut stop_after_drain = false;
        let mut signals = 0u32;
        let mut restart_at: Option<Instant> = None;
        let mut rx_open = true;

        loop {
            let cur = self.current.clone();
            let event = tokio::select! {
                s = async { match &cur { Some(p) => p.wait().await, None => pending().await } } => Event::Exited(s),
                _ = async { match restart_at { Some(t) => tokio::time::sleep_until(t).await, None => pending().await } } => Event::RestartDue,
                c = self.rx.recv(), if rx_open => match c {
                    Some(c) => Event::Control(c),
                    None => { rx_open = false; continue; }
                },
                r = async { match drain.as_mut() { Some(f) => f.as_mut().await, None => pending().await } } => Event::DrainDone(r),
            };

            match event {
                Event::Exited(status) => {
                    self.current = None;
                    if let Some(m) = self.monitor.take() {
                        m.abort();
                    }
                    if drain.is_some() || drained.is_some() || status.success() {
                        tracing::info!(%status, "Envoy exited");
                        self.stop_all(self.cfg.envoy_stop_grace).await;
                        return ExitReason::EnvoyExited(status);
                    }
                    self.publish_state(|_| {});
                    match self.budget.on_failure(Instant::now()) {
                        Some(delay) => {
                            tracing::warn!(%status, ?delay, failures = self.budget.failures(),
                                "Envoy exited abnormally; restarting");
                            self.envoy_guard
                                .pending(format!("Envoy exited abnormally ({status}); restarting"));
                            restart_at = Some(Instant::now() + delay);
                        }
                        None => {
                            tracing::error!(%status, failures = self.budget.failures(),
                                window = ?self.cfg.restart_window,
                                "Envoy keeps failing; giving up so the kubelet takes over");
                            self.stop_all(self.cfg.envoy_stop_grace).await;
                            return ExitReason::RestartBudgetExhausted {
                                failures: self.budget.failures(),
                            };
                        }
                    }
                }
                Event::RestartDue => {
                    restart_at = None;
                    // Old epochs hold the listeners; a fresh start needs them gone.
                    for p in std::mem::take(&mut self.parents) {
                        p.stop(Duration::from_secs(1)).await;
                    }
                    match self.start_fresh() {
                        Ok(()) => {
                            self.metrics
                                .envoy_restarts
                                .get_or_create(&RestartLabels {
                                    kind: RestartKind::Crash,
                                })
                                .inc();
                            self.publish_state(|s| s.crash_restarts += 1);
                        }
                        Err(e) => {
                            self.metrics.envoy_starts_failed.inc();
                            tracing::error!(error = %e, "cannot restart Envoy");
                            return ExitReason::StartFailed(e);
                        }
                    }
                }
                Event::Control(Control::Quit) => {
                    tracing::info!("quitquitquit: stopping Envoy");
                    self.stop_all(self.cfg.envoy_stop_grace).await;
                    return ExitReason::Quit;
                }
                Event::Control(Control::HotRestart { reason }) => {
                    if drain.is_none() && drained.is_none() {
                        self.hot_restart(&reason).await;
                    } else {
                        tracing::info!(reason, "draining: no hot restart");
                    }
                }
                Event::Control(Control::Signal) => {
                    signals += 1;
                    if signals > 1 {
                        tracing::warn!("second signal: aborting the drain");
                        let report = DrainReport {
                            outcome: DrainOutcome::Aborted,
                            active_at_start: None,
                            duration_seconds: drain_started
                                .map(|(t, _)| t.elapsed().as_secs_f64())
                                .unwrap_or(0.0),
                            inbound_quiet_seconds: None,
                            settings: self.live.current(),
                        };
                        self.inbound_quiet_tx.send_replace(true);
                        if drained.is_none() {
                            self.record_drain(&report);
                        }
                        self.stop_all(Duration::from_millis(500)).await;
                        return ExitReason::Aborted;
                    }
                    stop_after_drain = true;
                    if let Some(report) = drained.clone() {
                        // preStop already drained: stop now.
                        let grace = drain_started
                            .map(|(t, d)| self.stop_grace(t, d))
                            .unwrap_or(self.cfg.envoy_stop_grace);
                        self.stop_all(grace).await;
                        return ExitReason::Drained(report);
                    }
                    if self.current.is_none() {
                        // Envoy is down between crash restarts: nothing to drain.
                        return ExitReason::Quit;
                    }
                    if drain.is_none() {
                        drain_started = Some((Instant::now(), self.live.current().drain_deadline));
                        drain = Some(self.start_drain());
                    }
                }
                Event::Control(Control::Drain) => {
                    if drain.is_none() && drained.is_none() {
                        drain_started = Some((Instant::now(), self.live.current().drain_deadline));
                        drain = Some(self.start_drain());
                    }
                }
                Event::DrainDone(report) => {
                    drain = None;
                    self.record_drain(&report);
                    if stop_after_drain {
                        let grace = drain_started
                            .map(|(t, d)| self.stop_grace(t, d))
                            .unwrap_or(self.cfg.envoy_stop_grace);
                        self.stop_all(grace).await;
                        return ExitReason::Drained(report);
                    }
                    drained = Some(report);
                }
            }
        }
    }
}

fn read_base_id(path: &std::path::Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `envoy --mode validate`: does Envoy accept this bootstrap?
pub async fn validate(envoy: &std::path::Path, bootstrap: &std::path::Path) -> Result<(), String> {
    let out = tokio::process::Command::new(envoy)
        .args(["--mode", "validate", "-c"])
        .arg(bootstrap)
        .args(["--log-level", "error"])
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| format!("cannot run {}: {e}", envoy.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        let mut msg = String::from_utf8_lossy(&out.stderr).into_owned();
        msg.push_str(&String::from_utf8_lossy(&out.stdout));
        Err(msg.trim().lines().last().unwrap_or("invalid").to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn budget_doubles_then_gives_up() {
        let mut b = RestartBudget::new(3, Duration::from_secs(60), Duration::from_millis(200));
        let t0 = Instant::now();
        assert_eq!(b.on_failure(t0), Some(Duration::from_millis(200)));
        assert_eq!(b.on_failure(t0), Some(Duration::from_millis(400)));
        assert_eq!(b.on_failure(t0), Some(Duration::from_millis(800)));
        assert_eq!(b.on_failure(t0), None);
    }

    #[tokio::test(start_paused = true)]
    async fn budget_forgets_failures_outside_the_window() {
        let mut b = RestartBudget::new(2, Duration::from_secs(60), Duration::from_millis(200));
        assert!(b.on_failure(Instant::now()).is_some());
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(b.on_failure(Instant::now()).is_some());
        tokio::time::advance(Duration::from_secs(31)).await;
        // The first failure left the window: this is the second in it, not the third.
        assert_eq!(
            b.on_failure(Instant::now()),
            Some(Duration::from_millis(400))
        );
        assert_eq!(b.failures(), 2);
    }

    #[test]
    fn delay_is_capped() {
        let mut b = RestartBudget::new(100, Duration::from_secs(3600), Duration::from_secs(1));
        let t = Instant::now();
        let last = (0..20).filter_map(|_| b.on_failure(t)).last();
        assert_eq!(last, Some(MAX_RESTART_DELAY));
    }

    #[test]
    fn exit_codes() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(ExitReason::Quit.code(), 0);
        assert_eq!(ExitReason::Aborted.code(), 4);
        assert_eq!(ExitReason::RestartBudgetExhausted { failures: 6 }.code(), 1);
        assert_eq!(ExitReason::EnvoyExited(ExitStatus::from_raw(9)).code(), 137);
        assert_eq!(ExitReason::EnvoyExited(ExitStatus::from_raw(0)).code(), 0);
    }
}
