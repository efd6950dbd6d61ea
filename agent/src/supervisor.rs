//! Supervision of Envoy: start, crash restarts within a budget, hot restarts,
//! the drain on termination, and the agent's exit status.
//!
//! One task owns every Envoy process. Everything else talks to it through
//! [`Control`] messages: signals, the admin endpoints, the input watcher.

use std::path::PathBuf;
use std::pin::Pin;
use std::process::ExitStatus;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use futures::future::pending;
use serde::Serialize;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::bootstrap::{self, BootstrapError, Extras};
use crate::config::RunConfig;
use crate::drain::{self, DrainOutcome, DrainReport};
use crate::envoy::admin::EnvoyAdmin;
use crate::envoy::process::{BaseId, EnvoyArgs, EnvoyProcess, KILL_WAIT};
use crate::envoy::ready::{self, Wanted};
use crate::lifecycle::LiveSettings;
use crate::metrics::{DrainLabels, Metrics, RestartKind, RestartLabels};
use crate::readiness::{Readiness, ReadinessGuard};

/// Longest pause between two crash restarts.
const MAX_RESTART_DELAY: Duration = Duration::from_secs(30);
/// A new epoch that has not taken over by then is given up (and killed): its
/// parent keeps serving, but has no admin API while the child holds it.
const TAKEOVER_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the running epoch's admin API is given to say it is still there
/// after a new epoch failed.
const ADMIN_PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// What the supervisor is asked to do.
#[derive(Debug)]
pub enum Control {
    /// SIGTERM or SIGINT: the first drains then stops; a second aborts.
    Signal,
    /// Drain now; Envoy keeps running afterwards, until a signal or
    /// `/quitquitquit`.
    Drain(DrainOrigin),
    /// Stop Envoy now and exit 0 (`/quitquitquit`, for Jobs).
    Quit,
    /// The bootstrap's inputs changed: start a new epoch.
    HotRestart { reason: String },
}

/// Who asked for a drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainOrigin {
    /// `POST /drain` with the admin token: the sidecar's own preStop
    /// (`remora-agent drain`), so the pod is terminating.
    Admin,
    /// The app containers' preStop helper. Its token is readable in every
    /// app container, so such a drain is undone when no SIGTERM follows
    /// within the grace period (see [`hook_undo_after`]).
    AppHook,
}

/// How long after an app hook's drain started it is undone if no SIGTERM
/// (nor an admin drain) came: the grace period the drain deadline was derived
/// from. A pod that really terminates has been killed by then; so an agent
/// still running then was drained by a hook outside a termination.
pub fn hook_undo_after(deadline: Duration) -> Duration {
    remora_contract::pod::grace_of_deadline(deadline).max(Duration::from_millis(100))
}

/// When a drain that only an app hook asked for is undone.
#[derive(Debug, Default)]
struct HookUndo {
    at: Option<Instant>,
}

impl HookUndo {
    /// A drain starts: an app hook's alone is undone after [`hook_undo_after`].
    fn drain_started(&mut self, origin: DrainOrigin, deadline: Duration) {
        self.at =
            (origin == DrainOrigin::AppHook).then(|| Instant::now() + hook_undo_after(deadline));
    }

    /// A drain was asked for while one was under way or done.
    fn drain_asked(&mut self, origin: DrainOrigin) {
        if origin == DrainOrigin::Admin {
            // The sidecar's own preStop: the pod is terminating.
            self.at = None;
        }
    }

    /// SIGTERM: the pod is terminating; nothing is undone.
    fn terminating(&mut self) {
        self.at = None;
    }

    /// Resolves when the drain is to be undone (never, when none is).
    async fn due(&self) {
        match self.at {
            Some(t) => tokio::time::sleep_until(t).await,
            None => pending().await,
        }
    }

    fn done(&mut self) {
        self.at = None;
    }
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
    /// A new epoch that is starting and has not taken over yet.
    pub starting_epoch: Option<u32>,
    /// The last configuration Envoy refused; cleared when a newer one is
    /// accepted, or when the input is back to what runs.
    pub rejected_config: Option<RejectedConfig>,
}

/// Where a new configuration was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectStage {
    /// The bootstrap could not be generated (a bad override file).
    Render,
    /// `envoy --mode validate` refused it.
    Validate,
    /// The new epoch exited, or never took over, after validation passed.
    Start,
}

/// A configuration Envoy refused, as `/debug/config` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct RejectedConfig {
    pub stage: RejectStage,
    /// The epoch that failed to start (stage `start`).
    pub epoch: Option<u32>,
    /// What asked for the hot restart.
    pub trigger: String,
    pub error: String,
    /// The refused bootstrap, kept for inspection.
    pub bootstrap: Option<PathBuf>,
    pub at_unix_seconds: u64,
    /// Stage `start`: whether the running epoch's admin API still answers.
    /// Envoy closes it as soon as a new epoch begins and cannot reopen it;
    /// without it a drain cannot be graceful, and the shared memory stays
    /// marked as initializing, so Envoy cannot hot restart again until it
    /// starts afresh (envoyproxy/envoy#33446).
    pub running_admin_answers: Option<bool>,
}

impl RejectedConfig {
    fn new(stage: RejectStage, trigger: &str, error: impl Into<String>) -> Self {
        Self {
            stage,
            epoch: None,
            trigger: trigger.to_string(),
            error: error.into(),
            bootstrap: None,
            at_unix_seconds: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            running_admin_answers: None,
        }
    }
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
    /// Release `draining_guard` once the new epoch of an undone drain is up.
    release_draining_on_takeover: bool,
    budget: RestartBudget,
    current: Option<EnvoyProcess>,
    parents: Vec<EnvoyProcess>,
    candidate: Option<Candidate>,
    /// A hot restart asked for while a candidate was starting.
    deferred_restart: Option<String>,
    /// What the current Envoy runs, and the input Envoy last refused.
    running: Option<Input>,
    rejected: Option<Input>,
    monitor: Option<JoinHandle<()>>,
    base_id: Option<u32>,
    rx: mpsc::Receiver<Control>,
    drained_tx: watch::Sender<Option<DrainReport>>,
    inbound_quiet_tx: watch::Sender<bool>,
    /// An app hook waits for the release (see [`drain::run`]).
    app_waits: Arc<AtomicBool>,
    state_tx: watch::Sender<EnvoyState>,
}

type DrainFuture = Pin<Box<dyn std::future::Future<Output = DrainReport> + Send>>;

/// What one Envoy is started from: its bootstrap and its drain time (an
/// argument, not part of the bootstrap). Equal inputs start equal Envoys.
#[derive(Debug, Clone, PartialEq)]
struct Input {
    bootstrap: serde_json::Value,
    drain_time: Duration,
}

/// A new epoch that has not taken over the listeners yet: until it has, its
/// parent is [`Supervisor::current`] and serves.
struct Candidate {
    process: EnvoyProcess,
    input: Input,
    trigger: String,
    bootstrap: PathBuf,
    /// Turns true once the new epoch is LIVE with its workers started.
    up: watch::Receiver<bool>,
    monitor: JoinHandle<()>,
    give_up_at: Instant,
}

enum Event {
    Exited(ExitStatus),
    RestartDue,
    Control(Control),
    DrainDone(DrainReport),
    CandidateUp,
    CandidateExited(ExitStatus),
    CandidateTimedOut,
    UndoHookDrain,
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
            release_draining_on_takeover: false,
            current: None,
            parents: Vec::new(),
            candidate: None,
            deferred_restart: None,
            running: None,
            rejected: None,
            monitor: None,
            rx,
            drained_tx,
            inbound_quiet_tx,
            app_waits: Arc::default(),
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

    fn envoy_args(&self, epoch: u32, bootstrap: PathBuf, drain_time: Duration) -> EnvoyArgs {
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
            drain_time,
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

    /// The input as it is now.
    fn current_input(&self) -> Result<Input, BootstrapError> {
        Ok(Input {
            bootstrap: self.render()?,
            drain_time: self.live.current().drain_duration,
        })
    }

    /// Start Envoy from scratch (epoch 0): the first start and after a crash.
    /// An input Envoy refused before is not tried again: the last one that
    /// ran is used until the input changes.
    fn start_fresh(&mut self) -> Result<(), String> {
        let mut input = self.current_input().map_err(|e| e.to_string())?;
        if self.rejected.as_ref() == Some(&input)
            && let Some(good) = self.running.clone()
        {
            tracing::warn!(
                "the input Envoy refused is unchanged: starting the last configuration that ran"
            );
            input = good;
        }
        let path = self.cfg.bootstrap_path();
        bootstrap::write(&path, &input.bootstrap).map_err(|e| e.to_string())?;
        if self.cfg.base_id.is_none() {
            // A fresh start picks a free base id again (the old one may be taken by now).
            self.base_id = None;
            let _ = std::fs::remove_file(self.base_id_path());
        }
        let args = self.envoy_args(0, path, input.drain_time);
        let proc = EnvoyProcess::spawn(&args).map_err(|e| e.to_string())?;
        tracing::info!(pid = proc.pid, epoch = 0, "started Envoy");
        self.envoy_guard.pending("Envoy is starting");
        self.current = Some(proc);
        self.running = Some(input);
        self.start_monitor(None);
        self.publish_state(|s| {
            s.epoch = 0;
        });
        Ok(())
    }

    /// Watch the current Envoy until it is up, then release the readiness
    /// guard; `epoch`: the answer must come from that epoch.
    fn start_monitor(&mut self, epoch: Option<u32>) {
        if let Some(m) = self.monitor.take() {
            m.abort();
        }
        let admin = self.admin.clone();
        let guard = self.envoy_guard.clone();
        let wanted = Wanted {
            xds: self.cfg.discovery_address.clone().filter(|a| !a.is_empty()),
            epoch,
        };
        self.monitor = Some(tokio::spawn(async move {
            ready::wait_until_ready(&admin, &wanted, |r| guard.pending(r)).await;
            guard.ready();
            tracing::info!("Envoy is ready");
        }));
    }

    /// Start epoch+1 alongside the running Envoy. It becomes current once it
    /// has taken the listeners over (LIVE, workers started), and the old one
    /// drains for the parent shutdown time; until then the old one serves,
    /// and keeps serving if the new one fails.
    async fn hot_restart(&mut self, trigger: &str) {
        if self.candidate.is_some() {
            // Envoy refuses a new epoch while one is initializing.
            tracing::info!(
                trigger,
                "a new epoch is still starting; the hot restart follows it"
            );
            self.deferred_restart = Some(trigger.to_string());
            return;
        }
        let Some(cur) = self.current.clone() else {
            tracing::info!(
                trigger,
                "hot restart requested while Envoy is down; skipped"
            );
            return;
        };
        let input = match self.current_input() {
            Ok(i) => i,
            Err(e) => {
                tracing::error!(error = %e, "new bootstrap rejected; Envoy keeps its configuration");
                self.reject(
                    RejectedConfig::new(RejectStage::Render, trigger, e.to_string()),
                    None,
                );
                return;
            }
        };
        if self.rejected.as_ref() == Some(&input) {
            tracing::info!(
                trigger,
                "the input is unchanged since Envoy refused it; not trying again"
            );
            return;
        }
        if self.rejected.is_some() && self.running.as_ref() == Some(&input) {
            tracing::info!(
                trigger,
                "the input is back to the configuration that runs; nothing to restart"
            );
            self.clear_rejection();
            return;
        }
        let base_id = match self.base_id.or_else(|| read_base_id(&self.base_id_path())) {
            Some(id) => id,
            None => {
                tracing::error!("Envoy's base id is unknown; cannot hot restart");
                return;
            }
        };
        self.base_id = Some(base_id);
        let next = self.cfg.run_dir.join("envoy-bootstrap.next.json");
        if let Err(e) = bootstrap::write(&next, &input.bootstrap) {
            tracing::error!(error = %e, "cannot write the new bootstrap");
            return;
        }
        if let Err(e) = validate(&self.envoy_bin, &next).await {
            tracing::error!(error = %e, "Envoy rejects the new bootstrap; keeping the running one");
            let rejected = RejectedConfig {
                bootstrap: self.keep_rejected(&next),
                ..RejectedConfig::new(RejectStage::Validate, trigger, e)
            };
            self.reject(rejected, Some(input));
            return;
        }
        let epoch = cur.epoch.saturating_add(1);
        let args = self.envoy_args(epoch, next.clone(), input.drain_time);
        let process = match EnvoyProcess::spawn(&args) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(error = %e, "hot restart failed; the running Envoy stays");
                // Not the input's fault: a new input is no condition to try again.
                let rejected = RejectedConfig {
                    epoch: Some(epoch),
                    ..RejectedConfig::new(RejectStage::Start, trigger, e.to_string())
                };
                self.reject(rejected, None);
                return;
            }
        };
        tracing::info!(
            trigger,
            pid = process.pid,
            epoch,
            "hot restart: new Envoy epoch starting"
        );
        let (up_tx, up) = watch::channel(false);
        let admin = self.admin.clone();
        let wanted = Wanted {
            xds: None,
            epoch: Some(epoch),
        };
        let monitor = tokio::spawn(async move {
            ready::wait_until_ready(&admin, &wanted, |_| {}).await;
            up_tx.send_replace(true);
        });
        self.candidate = Some(Candidate {
            process,
            input,
            trigger: trigger.to_string(),
            bootstrap: next,
            up,
            monitor,
            give_up_at: Instant::now() + TAKEOVER_TIMEOUT,
        });
        self.publish_state(|s| s.starting_epoch = Some(epoch));
    }

    /// The new epoch becomes current. `taken_over`: it said so (LIVE, workers
    /// started) and its parent drains; otherwise its parent has exited while
    /// it was starting (it may have taken over unnoticed: the parent exits
    /// after the parent shutdown time), and it is all there is now, watched
    /// like a fresh start.
    fn promote_candidate(&mut self, taken_over: bool) {
        let Some(c) = self.candidate.take() else {
            return;
        };
        c.monitor.abort();
        if let Err(e) = std::fs::rename(&c.bootstrap, self.cfg.bootstrap_path()) {
            tracing::warn!(error = %e, "cannot install the new bootstrap file");
        }
        let epoch = c.process.epoch;
        tracing::info!(
            trigger = c.trigger,
            pid = c.process.pid,
            epoch,
            taken_over,
            "hot restart: the new epoch has taken over"
        );
        self.metrics
            .envoy_restarts
            .get_or_create(&RestartLabels {
                kind: RestartKind::Hot,
            })
            .inc();
        self.parents.retain(|p| p.exit_status().is_none());
        self.parents.extend(self.current.take());
        self.current = Some(c.process);
        self.running = Some(c.input);
        self.clear_rejection();
        if !taken_over {
            self.envoy_guard
                .pending(format!("the new epoch {epoch} is starting"));
            self.start_monitor(Some(epoch));
        }
        self.publish_state(|s| {
            s.epoch = epoch;
            s.hot_restarts += 1;
            s.starting_epoch = None;
        });
    }

    /// The new epoch exited (or never took over): the running one stays, and
    /// the input is not tried again until it changes.
    async fn candidate_failed(&mut self, error: String) {
        let Some(c) = self.candidate.take() else {
            return;
        };
        c.monitor.abort();
        let epoch = c.process.epoch;
        // Not serving yet: nothing to drain.
        c.process.stop(Duration::ZERO).await;
        let running_epoch = self.current.as_ref().map(|p| p.epoch);
        let admin_answers = tokio::time::timeout(ADMIN_PROBE_TIMEOUT, self.admin.server_status())
            .await
            .is_ok_and(|r| r.is_ok_and(|st| st.hot_restart_epoch == running_epoch));
        let kept = self.keep_rejected(&c.bootstrap);
        tracing::error!(
            trigger = c.trigger,
            epoch,
            error,
            running_epoch,
            running_admin_answers = admin_answers,
            bootstrap = ?kept,
            "hot restart failed: the new epoch did not take over; the running epoch keeps \
             serving, and this input is not tried again until it changes{}",
            if admin_answers {
                ""
            } else {
                ". Envoy closed the running epoch's admin API when the new one began: \
                 drains cannot be graceful and Envoy cannot hot restart again until it \
                 starts afresh"
            }
        );
        let rejected = RejectedConfig {
            epoch: Some(epoch),
            bootstrap: kept,
            running_admin_answers: Some(admin_answers),
            ..RejectedConfig::new(RejectStage::Start, &c.trigger, error)
        };
        self.reject(rejected, Some(c.input));
        self.publish_state(|s| s.starting_epoch = None);
    }

    /// Keep a refused bootstrap next to the running one, for inspection.
    fn keep_rejected(&self, path: &std::path::Path) -> Option<PathBuf> {
        let kept = self.cfg.run_dir.join("envoy-bootstrap.rejected.json");
        std::fs::rename(path, &kept).ok().map(|()| kept)
    }

    /// Report a refused configuration; `input`: do not try it again.
    fn reject(&mut self, rejected: RejectedConfig, input: Option<Input>) {
        self.metrics.envoy_starts_failed.inc();
        self.metrics.config_rejected.set(1);
        if input.is_some() {
            self.rejected = input;
        }
        self.publish_state(|s| s.rejected_config = Some(rejected));
    }

    fn clear_rejection(&mut self) {
        self.rejected = None;
        self.metrics.config_rejected.set(0);
        self.publish_state(|s| s.rejected_config = None);
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

    /// Stop every Envoy: the current one, old epochs and a starting one, all
    /// at once, SIGKILL after `grace`.
    async fn stop_all(&mut self, grace: Duration) {
        if let Some(m) = self.monitor.take() {
            m.abort();
        }
        let mut all = std::mem::take(&mut self.parents);
        all.extend(self.current.take());
        if let Some(c) = self.candidate.take() {
            c.monitor.abort();
            all.push(c.process);
        }
        futures::future::join_all(all.iter().map(|p| p.stop(grace))).await;
    }

    /// Undo a drain that turned out not to be a termination: the drain's
    /// watchers are reset, and a new epoch takes the listeners over (Envoy
    /// cannot undo `drain_listeners`); readiness comes back once it has, or
    /// at once when no new epoch could be started.
    async fn undo_drain(&mut self) {
        self.inbound_quiet_tx.send_replace(false);
        self.app_waits.store(false, Ordering::Release);
        self.drained_tx.send_replace(None);
        self.publish_state(|s| s.draining = false);
        self.hot_restart("undo a drain no SIGTERM followed").await;
        if self.candidate.is_some() {
            if let Some(g) = &self.draining_guard {
                g.pending("a drain is being undone: Envoy's listeners are coming back");
            }
            self.release_draining_on_takeover = true;
        } else {
            self.draining_guard = None;
        }
    }

    fn start_drain(&mut self) -> DrainFuture {
        let settings = self.live.current();
        // Dropped before registering again: a guard's drop clears its name.
        self.draining_guard = None;
        self.release_draining_on_takeover = false;
        self.draining_guard = Some(self.readiness.register("draining", "the proxy is draining"));
        self.publish_state(|s| s.draining = true);
        let admin = self.admin.clone();
        let poll = self.cfg.drain_poll_interval;
        let started = Instant::now();
        let inbound_quiet = self.inbound_quiet_tx.clone();
        let app_waits = Arc::clone(&self.app_waits);
        Box::pin(async move {
            drain::run(&admin, settings, poll, started, &inbound_quiet, &app_waits).await
        })
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

    /// SIGTERM's grace when stopping Envoy after a drain that started at
    /// `started`: what is left of the deadline, less the wait after SIGKILL.
    fn stop_grace(&self, started: Instant, deadline: Duration) -> Duration {
        stop_grace(self.cfg.envoy_stop_grace, started.elapsed(), deadline)
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
        let mut hook_undo = HookUndo::default();

        loop {
            let cur = self.current.clone();
            let cand = self
                .candidate
                .as_ref()
                .map(|c| (c.process.clone(), c.up.clone(), c.give_up_at));
            let event = tokio::select! {
                s = async { match &cur { Some(p) => p.wait().await, None => pending().await } } => Event::Exited(s),
                e = async {
                    let Some((p, mut up, give_up_at)) = cand else { return pending().await };
                    tokio::select! {
                        s = p.wait() => Event::CandidateExited(s),
                        // The sender goes only with the candidate.
                        Ok(_) = up.wait_for(|u| *u) => Event::CandidateUp,
                        _ = tokio::time::sleep_until(give_up_at) => Event::CandidateTimedOut,
                    }
                } => e,
                _ = async { match restart_at { Some(t) => tokio::time::sleep_until(t).await, None => pending().await } } => Event::RestartDue,
                c = self.rx.recv(), if rx_open => match c {
                    Some(c) => Event::Control(c),
                    None => { rx_open = false; continue; }
                },
                r = async { match drain.as_mut() { Some(f) => f.as_mut().await, None => pending().await } } => Event::DrainDone(r),
                _ = hook_undo.due() => Event::UndoHookDrain,
            };

            match event {
                Event::CandidateUp | Event::CandidateExited(_) | Event::CandidateTimedOut => {
                    if self.release_draining_on_takeover {
                        // The undone drain's listeners are back (or could not be).
                        self.release_draining_on_takeover = false;
                        self.draining_guard = None;
                    }
                    match event {
                        Event::CandidateUp => self.promote_candidate(true),
                        Event::CandidateExited(status) => {
                            self.candidate_failed(format!(
                                "exited with {status} before taking over"
                            ))
                            .await;
                        }
                        _ => {
                            self.candidate_failed(format!(
                                "did not take over within {TAKEOVER_TIMEOUT:?}"
                            ))
                            .await;
                        }
                    }
                    let deferred = self.deferred_restart.take();
                    if let Some(trigger) = deferred
                        && drain.is_none()
                        && drained.is_none()
                    {
                        self.hot_restart(&trigger).await;
                    }
                }
                Event::Exited(status)
                    if self
                        .candidate
                        .as_ref()
                        .is_some_and(|c| c.process.exit_status().is_none()) =>
                {
                    tracing::warn!(%status, "the running Envoy exited while a new epoch was starting; \
                        the new epoch takes its place");
                    self.current = None;
                    self.promote_candidate(false);
                }
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
                    hook_undo.terminating();
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
                Event::Control(Control::Drain(origin)) => {
                    if origin == DrainOrigin::AppHook {
                        self.app_waits.store(true, Ordering::Release);
                    }
                    if drain.is_none() && drained.is_none() {
                        let deadline = self.live.current().drain_deadline;
                        drain_started = Some((Instant::now(), deadline));
                        drain = Some(self.start_drain());
                        hook_undo.drain_started(origin, deadline);
                    } else {
                        hook_undo.drain_asked(origin);
                    }
                }
                Event::UndoHookDrain => {
                    hook_undo.done();
                    tracing::warn!(
                        "the drain the app hook started was followed by no SIGTERM within the \
                         grace period: the pod is not terminating; undoing it (ready again, \
                         Envoy's listeners back through a hot restart)"
                    );
                    drain = None;
                    drained = None;
                    drain_started = None;
                    self.undo_drain().await;
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

/// SIGTERM's grace: at most `configured`, and no later than the deadline
/// less [`KILL_WAIT`], so that Envoy is gone by the deadline even when it
/// ignores SIGTERM. Zero when the deadline has passed: SIGKILL at once.
fn stop_grace(configured: Duration, elapsed: Duration, deadline: Duration) -> Duration {
    configured.min(deadline.saturating_sub(elapsed).saturating_sub(KILL_WAIT))
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
    fn stop_grace_leaves_time_to_kill_before_the_deadline() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        // After a drain that used its whole wait: the 1 s reserve less the kill wait.
        assert_eq!(stop_grace(s(5), s(24), s(25)), ms(950));
        assert_eq!(stop_grace(ms(300), s(24), s(25)), ms(300));
        // Past the deadline (a drain of old): SIGKILL at once, never a floor.
        assert_eq!(stop_grace(s(5), s(26), s(25)), Duration::ZERO);
        assert_eq!(
            stop_grace(s(5), Duration::ZERO, Duration::ZERO),
            Duration::ZERO
        );
    }

    /// Test double of Envoy's admin API: takes every connection, reads
    /// nothing, never answers (a wedged Envoy main thread).
    struct NeverAnsweringAdmin {
        port: u16,
        task: JoinHandle<()>,
    }

    impl NeverAnsweringAdmin {
        async fn start() -> Self {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let port = l.local_addr().expect("addr").port();
            let task = tokio::spawn(async move {
                let mut held = Vec::new();
                while let Ok((conn, _)) = l.accept().await {
                    held.push(conn);
                }
            });
            Self { port, task }
        }
    }

    impl Drop for NeverAnsweringAdmin {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    /// A stand-in for Envoy that ignores SIGTERM: only SIGKILL stops it.
    fn envoy_that_ignores_sigterm(dir: &std::path::Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let bin = dir.join("envoy");
        std::fs::write(&bin, "#!/bin/sh\ntrap '' TERM\nexec sleep 600\n").expect("write");
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        bin
    }

    #[tokio::test]
    async fn drain_ends_by_the_deadline_with_a_hung_admin_and_an_envoy_that_ignores_sigterm() {
        let dir = tempfile::tempdir().expect("tempdir");
        let admin = NeverAnsweringAdmin::start().await;
        let bin = envoy_that_ignores_sigterm(dir.path());
        let path = |p: &str| dir.path().join(p).display().to_string();
        let deadline = Duration::from_secs(2);
        let cfg = crate::config::tests::run(
            &[
                "--envoy-bin",
                &path("envoy"),
                "--run-dir",
                &path("run"),
                "--annotations-file",
                &path("annotations"),
                "--envoy-admin-port",
                &admin.port.to_string(),
                "--drain-deadline",
                "2s",
            ],
            &[],
        )
        .expect("config");
        std::fs::create_dir_all(&cfg.run_dir).expect("run dir");
        let mut registry = prometheus_client::registry::Registry::default();
        let (sup, handle) = Supervisor::new(
            Arc::new(cfg),
            bin,
            Extras::default(),
            Readiness::new(),
            Metrics::new(&mut registry),
        );
        let run = tokio::spawn(sup.run());
        let mut state = handle.state.clone();
        let pid = state
            .wait_for(|s| s.pid.is_some())
            .await
            .expect("started")
            .pid
            .expect("pid");

        let start = Instant::now();
        handle.control.send(Control::Signal).await.expect("send");
        let reason = tokio::time::timeout(deadline * 3, run)
            .await
            .expect("the agent stops")
            .expect("no panic");
        let took = start.elapsed();
        println!(
            "SIGTERM to stopped, hung admin and SIGTERM ignored: {took:?} (deadline {deadline:?})"
        );
        // Envoy's admin never answered and Envoy ignored SIGTERM: the drain
        // gave up on the admin at the end of its wait and Envoy was killed in
        // the reserve. A few milliseconds of scheduling are allowed.
        assert!(took <= deadline + Duration::from_millis(100), "{took:?}");
        let ExitReason::Drained(report) = &reason else {
            panic!("{reason:?}")
        };
        assert_eq!(
            report.outcome,
            DrainOutcome::DeadlineExceeded { active: None }
        );
        assert_eq!(reason.code(), 3);
        let gone = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid")),
            None,
        );
        assert!(gone.is_err(), "the stand-in for Envoy is gone");
    }

    #[tokio::test(start_paused = true)]
    async fn an_app_hook_drain_alone_is_undone_after_the_grace_period() {
        let deadline = Duration::from_secs(25);
        // The grace period the injector derived a 25 s deadline from.
        assert_eq!(hook_undo_after(deadline), Duration::from_secs(30));
        async fn due(u: &HookUndo, within: Duration) -> bool {
            tokio::time::timeout(within, u.due()).await.is_ok()
        }

        let mut u = HookUndo::default();
        assert!(
            !due(&u, Duration::from_secs(3600)).await,
            "no drain, nothing due"
        );
        u.drain_started(DrainOrigin::AppHook, deadline);
        assert!(!due(&u, Duration::from_secs(29)).await);
        assert!(due(&u, Duration::from_secs(2)).await, "due at 30 s");
        u.done();
        assert!(!due(&u, Duration::from_secs(3600)).await);

        // SIGTERM in time: the pod terminates, nothing is undone.
        u.drain_started(DrainOrigin::AppHook, deadline);
        tokio::time::advance(Duration::from_secs(20)).await;
        u.terminating();
        assert!(!due(&u, Duration::from_secs(3600)).await);

        // The sidecar's own preStop joins the hook's drain: terminating too.
        u.drain_started(DrainOrigin::AppHook, deadline);
        u.drain_asked(DrainOrigin::AppHook);
        u.drain_asked(DrainOrigin::Admin);
        assert!(!due(&u, Duration::from_secs(3600)).await);

        // A drain the sidecar's own preStop started is never undone.
        u.drain_started(DrainOrigin::Admin, deadline);
        u.drain_asked(DrainOrigin::AppHook);
        assert!(!due(&u, Duration::from_secs(3600)).await);
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
