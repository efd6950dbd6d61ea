//! Hot restarts: a new epoch is started beside the running one from a
//! changed input, validated first, and takes over the listeners (or fails,
//! and the running one keeps serving); an input Envoy refused is not tried
//! again until it changes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::Supervisor;
use super::state::{RejectStage, RejectedConfig};
use crate::bootstrap;
use crate::envoy::process::EnvoyProcess;
use crate::envoy::ready::{self, Wanted};
use crate::metrics::{RestartKind, RestartLabels};

/// A new epoch that has not taken over by then is given up (and killed): its
/// parent keeps serving, but has no admin API while the child holds it.
pub(super) const TAKEOVER_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the running epoch's admin API is given to say it is still there
/// after a new epoch failed.
const ADMIN_PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// What one Envoy is started from: its bootstrap and its drain time (an
/// argument, not part of the bootstrap). Equal inputs start equal Envoys.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Input {
    pub(super) bootstrap: serde_json::Value,
    pub(super) drain_time: Duration,
}

/// A new epoch that has not taken over the listeners yet: until it has, its
/// parent is [`Supervisor::current`] and serves.
pub(super) struct Candidate {
    pub(super) process: EnvoyProcess,
    pub(super) input: Input,
    pub(super) trigger: String,
    pub(super) bootstrap: PathBuf,
    /// Turns true once the new epoch is LIVE with its workers started.
    pub(super) up: watch::Receiver<bool>,
    pub(super) monitor: JoinHandle<()>,
    pub(super) give_up_at: Instant,
}

impl Supervisor {
    /// Start epoch+1 alongside the running Envoy. It becomes current once it
    /// has taken the listeners over (LIVE, workers started), and the old one
    /// drains for the parent shutdown time; until then the old one serves,
    /// and keeps serving if the new one fails.
    pub(super) async fn hot_restart(&mut self, trigger: &str) {
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
    pub(super) fn promote_candidate(&mut self, taken_over: bool) {
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
    pub(super) async fn candidate_failed(&mut self, error: String) {
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
    fn keep_rejected(&self, path: &Path) -> Option<PathBuf> {
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
}

fn read_base_id(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `envoy --mode validate`: does Envoy accept this bootstrap?
pub async fn validate(envoy: &Path, bootstrap: &Path) -> Result<(), String> {
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
