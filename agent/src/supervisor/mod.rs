//! Supervision of Envoy: start, crash restarts within a budget, hot restarts,
//! the drain on termination, and the agent's exit status.
//!
//! One task owns every Envoy process. Everything else talks to it through
//! [`Control`] messages: signals, the admin endpoints, the input watcher.
//! What each event does is decided in [`phase`], by one transition function
//! over named phases; [`Supervisor::run`] waits for the events and carries
//! the decisions out.

mod hot_restart;
mod phase;
mod restart_budget;
mod state;

use std::future::pending;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::ExitStatus;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::bootstrap::{self, BootstrapError, Extras};
use crate::config::RunConfig;
use crate::drain::{self, DrainOutcome, DrainReport};
use crate::envoy::admin::EnvoyAdmin;
use crate::envoy::idle_close;
use crate::envoy::process::{BaseId, EnvoyArgs, EnvoyProcess};
use crate::envoy::ready::{self, Wanted};
use crate::lifecycle::LiveSettings;
use crate::metrics::{DrainLabels, Metrics, RestartKind, RestartLabels};
use crate::readiness::{Readiness, ReadinessGuard};
pub use hot_restart::validate;
use hot_restart::{Candidate, Input, TAKEOVER_TIMEOUT};
pub use phase::hook_undo_after;
use phase::{Action, Event, Machine};
pub use restart_budget::RestartBudget;
pub use state::{EnvoyState, RejectStage, RejectedConfig};

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
    /// Signalled as a native sidecar: the app containers had exited, so
    /// Envoy was stopped without a drain.
    AppsExited,
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
            Self::Quit | Self::AppsExited => 0,
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
    /// The settings in force, read at each use (the pod's annotations over the flags).
    pub live: LiveSettings,
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
    /// Cancelled as Envoy's final stop begins (see [`Supervisor::new`]).
    stopping: CancellationToken,
    /// Discovery mode: the xDS proxy's view of the pod's withdrawal, which
    /// an adaptive drain waits on ([`drain::run_confirming`]).
    withdrawal: Option<crate::withdrawal::Source>,
}

type DrainFuture = Pin<Box<dyn std::future::Future<Output = DrainReport> + Send>>;

impl Supervisor {
    /// `stopping` is cancelled when Envoy's final stop begins: what serves
    /// Envoy or watches the agent's inputs can end then, while Envoy shuts
    /// down, instead of after it.
    pub fn new(
        cfg: Arc<RunConfig>,
        envoy_bin: PathBuf,
        extras: Extras,
        readiness: Readiness,
        metrics: Metrics,
        live: LiveSettings,
        stopping: CancellationToken,
    ) -> (Self, SupervisorHandle) {
        let (control, rx) = mpsc::channel(16);
        let (drained_tx, drained) = watch::channel(None);
        let (inbound_quiet_tx, inbound_quiet) = watch::channel(false);
        let (state_tx, state) = watch::channel(EnvoyState::default());
        let envoy_guard = Arc::new(readiness.register("envoy", "Envoy is not started yet"));
        let sup = Self {
            admin: EnvoyAdmin::new(cfg.envoy_admin_port),
            live: live.clone(),
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
            stopping,
            withdrawal: None,
        };
        let handle = SupervisorHandle {
            control,
            drained,
            inbound_quiet,
            state,
            live,
        };
        (sup, handle)
    }

    /// Discovery mode: drains wait for the confirmed removal of the pod's
    /// endpoints, as the xDS proxy sees it.
    pub fn confirm_withdrawal(&mut self, source: crate::withdrawal::Source) {
        self.withdrawal = Some(source);
    }

    /// Render and write the bootstrap from the current inputs.
    pub fn render(&self) -> Result<serde_json::Value, BootstrapError> {
        let ov = match &self.cfg.bootstrap_override {
            Some(p) => Some(bootstrap::read_override(p)?),
            None => None,
        };
        let idle_close =
            self.live.current_quiet().0.can_wait() && crate::envoy::idle_close::monitor_can_start();
        bootstrap::generate(&self.cfg, &self.extras, ov.as_ref(), idle_close)
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
        // Created once; a restart after a crash in a drain keeps its pressure.
        let pressure = self.cfg.drain_pressure_path();
        if !pressure.exists() {
            idle_close::set(&pressure, false)
                .map_err(|e| format!("cannot write {}: {e}", pressure.display()))?;
        }
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
        self.set_idle_close(false);
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

    fn start_drain(&mut self, started: Instant) -> DrainFuture {
        let settings = self.live.current();
        // Dropped before registering again: a guard's drop clears its name.
        self.draining_guard = None;
        self.release_draining_on_takeover = false;
        self.draining_guard = Some(self.readiness.register("draining", "the proxy is draining"));
        self.publish_state(|s| s.draining = true);
        self.set_idle_close(true);
        let admin = self.admin.clone();
        let poll = self.cfg.drain_poll_interval;
        let inbound_quiet = self.inbound_quiet_tx.clone();
        let app_waits = Arc::clone(&self.app_waits);
        let mut withdrawal = self.withdrawal.clone();
        Box::pin(async move {
            drain::run_confirming(
                &admin,
                settings,
                poll,
                started,
                (&inbound_quiet, &app_waits),
                withdrawal.as_mut(),
            )
            .await
        })
    }

    /// Whether Envoy closes idle connections (see [`idle_close`]).
    fn set_idle_close(&self, draining: bool) {
        if let Err(e) = idle_close::set(&self.cfg.drain_pressure_path(), draining) {
            tracing::warn!(error = %e, draining, "cannot tell Envoy to close idle connections");
        }
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
        if let Some(w) = &report.withdrawal {
            self.metrics.record_withdrawal(w);
        }
        tracing::info!(report = %serde_json::to_string(report).unwrap_or_default(), "drain finished");
        self.drained_tx.send_replace(Some(report.clone()));
    }

    /// Supervise until the agent should exit.
    pub async fn run(mut self) -> ExitReason {
        if let Err(e) = self.start_fresh() {
            self.metrics.envoy_starts_failed.inc();
            return ExitReason::StartFailed(e);
        }
        let budget = RestartBudget::new(
            self.cfg.max_restarts,
            self.cfg.restart_window,
            self.cfg.restart_backoff,
        );
        let mut machine = Machine::new(budget, self.cfg.envoy_stop_grace);
        let mut drain: Option<DrainFuture> = None;
        let mut rx_open = true;
        loop {
            let event = self.next_event(&machine, &mut drain, &mut rx_open).await;
            for action in machine.next(event, Instant::now()) {
                if let Some(reason) = self.perform(action, &mut drain).await {
                    return reason;
                }
            }
        }
    }

    /// Wait for what happens next: an Envoy process exits, the new epoch
    /// takes over or fails, a control message, the drain under way ends, or
    /// the phase's timer.
    async fn next_event(
        &mut self,
        machine: &Machine,
        drain: &mut Option<DrainFuture>,
        rx_open: &mut bool,
    ) -> Event {
        enum Wake {
            Exited(ExitStatus),
            CandidateUp,
            CandidateExited(ExitStatus),
            CandidateTimedOut,
            Control(Option<Control>),
            DrainDone(DrainReport),
            Timer(Event),
        }
        loop {
            let cur = self.current.clone();
            let cand = self
                .candidate
                .as_ref()
                .map(|c| (c.process.clone(), c.up.clone(), c.give_up_at));
            let wake = tokio::select! {
                s = async { match &cur { Some(p) => p.wait().await, None => pending().await } } => Wake::Exited(s),
                w = async {
                    let Some((p, mut up, give_up_at)) = cand else { return pending().await };
                    tokio::select! {
                        s = p.wait() => Wake::CandidateExited(s),
                        // The sender goes only with the candidate.
                        Ok(_) = up.wait_for(|u| *u) => Wake::CandidateUp,
                        _ = tokio::time::sleep_until(give_up_at) => Wake::CandidateTimedOut,
                    }
                } => w,
                c = self.rx.recv(), if *rx_open => Wake::Control(c),
                r = async { match drain.as_mut() { Some(f) => f.as_mut().await, None => pending().await } } => Wake::DrainDone(r),
                e = machine.timer() => Wake::Timer(e),
            };
            return match wake {
                Wake::Exited(status) => {
                    let successor = self
                        .candidate
                        .as_ref()
                        .is_some_and(|c| c.process.exit_status().is_none());
                    self.current = None;
                    if !successor && let Some(m) = self.monitor.take() {
                        m.abort();
                    }
                    Event::Exited { status, successor }
                }
                Wake::CandidateUp => Event::CandidateUp {
                    deferred: self.deferred_restart.take(),
                },
                Wake::CandidateExited(status) => Event::CandidateFailed {
                    error: format!("exited with {status} before taking over"),
                    deferred: self.deferred_restart.take(),
                },
                Wake::CandidateTimedOut => Event::CandidateFailed {
                    error: format!("did not take over within {TAKEOVER_TIMEOUT:?}"),
                    deferred: self.deferred_restart.take(),
                },
                Wake::Control(None) => {
                    *rx_open = false;
                    continue;
                }
                Wake::Control(Some(c)) => self.control_event(c),
                Wake::DrainDone(report) => {
                    *drain = None;
                    Event::DrainDone(report)
                }
                Wake::Timer(e) => e,
            };
        }
    }

    fn control_event(&self, c: Control) -> Event {
        // Read without logging: a drain that starts reads (and reports) them again.
        let drain_deadline = self.live.current_quiet().0.drain_deadline;
        match c {
            Control::Signal => Event::Signal {
                drain_deadline,
                apps_exited: self.live.annotations().runs_native(),
            },
            Control::Drain(origin) => Event::Drain {
                origin,
                drain_deadline,
            },
            Control::Quit => Event::Quit,
            Control::HotRestart { reason } => Event::HotRestart { reason },
        }
    }

    /// Carry out one decision of the phase machine; `Some`: the run ends.
    async fn perform(
        &mut self,
        action: Action,
        drain: &mut Option<DrainFuture>,
    ) -> Option<ExitReason> {
        match action {
            Action::Promote { taken_over } => {
                if taken_over {
                    self.undone_drain_settled();
                }
                self.promote_candidate(taken_over);
            }
            Action::DropCandidate { error } => {
                self.undone_drain_settled();
                self.candidate_failed(error).await;
            }
            Action::HotRestart { trigger } => self.hot_restart(&trigger).await,
            Action::AwaitRestart {
                status,
                delay,
                failures,
            } => {
                self.publish_state(|_| {});
                tracing::warn!(%status, ?delay, failures, "Envoy exited abnormally; restarting");
                self.envoy_guard
                    .pending(format!("Envoy exited abnormally ({status}); restarting"));
            }
            Action::StartFresh => {
                // Old epochs hold the listeners; a fresh start needs them gone.
                for p in std::mem::take(&mut self.parents) {
                    p.stop(Duration::from_secs(1)).await;
                }
                if let Err(e) = self.start_fresh() {
                    self.metrics.envoy_starts_failed.inc();
                    tracing::error!(error = %e, "cannot restart Envoy");
                    return Some(ExitReason::StartFailed(e));
                }
                self.metrics
                    .envoy_restarts
                    .get_or_create(&RestartLabels {
                        kind: RestartKind::Crash,
                    })
                    .inc();
                self.publish_state(|s| s.crash_restarts += 1);
            }
            Action::StartDrain { started } => *drain = Some(self.start_drain(started)),
            Action::NoteAppWaits => self.app_waits.store(true, Ordering::Release),
            Action::RecordDrain(report) => self.record_drain(&report),
            Action::AbortDrain { elapsed } => {
                let report = DrainReport {
                    outcome: DrainOutcome::Aborted,
                    active_at_start: None,
                    duration_seconds: elapsed.as_secs_f64(),
                    inbound_quiet_seconds: None,
                    withdrawal: None,
                    settings: self.live.current(),
                };
                self.inbound_quiet_tx.send_replace(true);
                self.record_drain(&report);
            }
            Action::UndoDrain => {
                *drain = None;
                self.undo_drain().await;
            }
            Action::Stop { grace } => {
                self.stopping.cancel();
                crate::mounted_wake::release();
                self.stop_all(grace).await;
            }
            Action::Exit(reason) => return Some(reason),
        }
        None
    }

    /// The new epoch of an undone drain has settled: its listeners are back
    /// (or could not be), so the drain no longer holds readiness.
    fn undone_drain_settled(&mut self) {
        if self.release_draining_on_takeover {
            self.release_draining_on_takeover = false;
            self.draining_guard = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let live = LiveSettings::new(
            &cfg,
            crate::pod_annotations::PodAnnotations::file_only(cfg.annotations_file.clone()),
        );
        let (sup, handle) = Supervisor::new(
            Arc::new(cfg),
            bin,
            Extras::default(),
            Readiness::new(),
            Metrics::new(&mut registry),
            live,
            CancellationToken::new(),
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
