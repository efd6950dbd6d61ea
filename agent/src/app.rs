//! Wiring of `remora-agent run`: bind the agent's ports, prepare Envoy, start
//! the supervisor, the servers, the signal and input watchers.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

use crate::bootstrap;
use crate::config::{PodRestartPolicy, RunConfig};
use crate::envoy::process;
use crate::hook::{self, Secret};
use crate::lifecycle::LiveSettings;
use crate::metrics::Metrics;
use crate::pod_annotations::{PodAnnotations, StreamCopy, runs_native_in};
use crate::readiness::Readiness;
use crate::sds::{self, SdsHandle};
use crate::servers;
use crate::supervisor::{Control, ExitReason, Supervisor, SupervisorHandle};
use crate::telemetry::LogLevelHandle;
use crate::xds::{self, XdsHandle};
use remora_contract::annotations::STOP as STOP_ANNOTATION;
use remora_contract::downward::stop_request;
use remora_contract::mounted::MountedFiles;

use crate::mounted_wake::MountedWake;

/// How often the bootstrap's inputs are checked for changes.
const INPUT_POLL: Duration = Duration::from_secs(1);
/// How often the annotations file is checked for a stop request: a finished
/// Job's pod waits on it, and reading a small file ten times a second is cheap.
const STOP_POLL: Duration = Duration::from_millis(100);

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Server(#[from] servers::ServerError),
    #[error(transparent)]
    Envoy(#[from] process::ProcessError),
    #[error(transparent)]
    Bootstrap(#[from] bootstrap::BootstrapError),
    #[error("cannot create --run-dir {path}: {source}")]
    RunDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} port {port} is already in use")]
    PortInUse { what: String, port: u16 },
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
    #[error(transparent)]
    Sds(#[from] sds::SdsError),
    #[error(transparent)]
    Hook(#[from] hook::HookError),
    #[error(transparent)]
    Xds(#[from] xds::XdsError),
}

/// A built agent, ready to run.
pub struct App {
    cfg: Arc<RunConfig>,
    supervisor: Supervisor,
    handle: SupervisorHandle,
    health: TcpListener,
    admin: TcpListener,
    health_server: remora_serve::Server,
    admin_server: remora_serve::Server,
    registry: Arc<Registry>,
    readiness: Readiness,
    metrics: Metrics,
    log: LogLevelHandle,
    sds: SdsHandle,
    xds: Option<XdsHandle>,
    shutdown: CancellationToken,
    admin_token: Secret,
    hook_token: Option<Secret>,
}

/// Check everything that can be checked before Envoy starts, so bad input
/// ends in one clear line instead of a failing child.
pub async fn build(cfg: RunConfig, log: LogLevelHandle) -> Result<App, AppError> {
    let cfg = Arc::new(cfg);
    tracing::info!(config = %cfg.redacted(), "remora-agent starting");
    let envoy_bin = process::resolve_binary(&cfg.envoy_bin)?;
    // 0750: the SDS socket lives here (the mode applies only if we create it).
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o750)
        .create(&cfg.run_dir)
        .map_err(|source| AppError::RunDir {
            path: cfg.run_dir.clone(),
            source,
        })?;
    if let Some(p) = &cfg.bootstrap_override {
        bootstrap::read_override(p)?;
    }
    let health = servers::bind(
        "health",
        SocketAddr::new(cfg.health_address, cfg.health_port),
    )
    .await?;
    let admin = servers::bind(
        "admin",
        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), cfg.admin_port),
    )
    .await?;
    check_envoy_ports(&cfg).await?;
    let admin_token = hook::write_admin_token(&cfg.run_dir)?;
    let hook_token = match &cfg.hook_dir {
        Some(dir) => {
            let helper = cfg.prestop_helper_path().ok_or(hook::HookError::NoHelper)?;
            let addr = admin.local_addr().unwrap_or(SocketAddr::new(
                IpAddr::V4(Ipv4Addr::LOCALHOST),
                cfg.admin_port,
            ));
            Some(hook::install(dir, &helper, addr)?)
        }
        None => None,
    };

    let mut registry = Registry::with_prefix("remora_agent");
    let metrics = Metrics::new(&mut registry);
    let health_server = servers::server("health", &mut registry);
    let admin_server = servers::server("admin", &mut registry);
    let readiness = Readiness::new();
    let shutdown = CancellationToken::new();
    // SDS always runs, so xDS-delivered configs can use `default`, `ROOTCA` and
    // `file-*` secrets; a certificate source only when one is configured. It
    // is up before Envoy asks for secrets.
    let sds = sds::start(&cfg, &mut registry, shutdown.clone()).await?;
    // Discovery mode: the proxy is up before Envoy dials it; its guard holds
    // readiness until the first listeners and clusters are in.
    // The pod's annotations: pushed on the discovery stream when there is
    // one, else (and while it is down) the downward-API file.
    let (pod_annotations, stream_copy) = tokio::sync::watch::channel(None);
    let live = LiveSettings::new(
        &cfg,
        PodAnnotations::new(cfg.annotations_file.clone(), stream_copy),
    );
    // The pod's withdrawal, which the drain waits on (confirmed removal).
    let (withdrawal, withdrawal_rx) = tokio::sync::watch::channel(Default::default());
    let xds = xds::start(
        &cfg,
        sds.bundles(),
        xds::ToAgent {
            pod_annotations,
            withdrawal,
        },
        &mut registry,
        shutdown.clone(),
    )
    .await?;
    if let Some(x) = &xds {
        x.hold_readiness(&readiness);
    }
    let extras = sds::bootstrap::extras(&cfg, &sds.socket);
    let (mut supervisor, handle) = Supervisor::new(
        cfg.clone(),
        envoy_bin,
        extras,
        readiness.clone(),
        metrics.clone(),
        live,
        shutdown.clone(),
    );
    if let Some(x) = &xds {
        let node_id = crate::bootstrap::node_id(&cfg);
        supervisor.confirm_withdrawal(x.withdrawal_source(withdrawal_rx, node_id));
    }
    // Render once now: an invalid configuration fails here, not in Envoy.
    let rendered = supervisor.render()?;
    // Readiness waits for the certificates only if the bootstrap makes Envoy
    // fetch them (see `UsedSecrets::of_bootstrap` for xDS-delivered listeners).
    sds.hold_readiness(&readiness, sds::UsedSecrets::of_bootstrap(&rendered));
    Ok(App {
        cfg,
        supervisor,
        handle,
        health,
        admin,
        health_server,
        admin_server,
        registry: Arc::new(registry),
        readiness,
        metrics,
        log,
        sds,
        xds,
        shutdown,
        admin_token,
        hook_token,
    })
}

/// Envoy binds these itself; a port taken by someone else would only show up
/// as Envoy failing, so try them first.
async fn check_envoy_ports(cfg: &RunConfig) -> Result<(), AppError> {
    let mut ports = vec![
        (
            "Envoy admin".to_string(),
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            cfg.envoy_admin_port,
        ),
        (
            "Envoy stats".to_string(),
            IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            cfg.stats_port,
        ),
    ];
    for i in &cfg.inbound {
        let port = i.port.unwrap_or(cfg.inbound_port);
        ports.push((
            "inbound listener".to_string(),
            IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            port,
        ));
    }
    // In discovery mode Envoy binds these when the server's listeners come,
    // so they must be free all the same.
    for o in &cfg.outbound {
        ports.push((
            "outbound listener".to_string(),
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            o.port,
        ));
    }
    for (what, ip, port) in ports {
        if TcpListener::bind((ip, port)).await.is_err() {
            return Err(AppError::PortInUse { what, port });
        }
    }
    Ok(())
}

impl App {
    /// Run until the agent should exit.
    pub async fn run(self) -> Result<ExitReason, AppError> {
        let shutdown = self.shutdown.clone();
        let mut tasks = Vec::new();
        tasks.push(tokio::spawn(servers::serve(
            self.health_server,
            self.health,
            servers::health_router(self.readiness.clone(), self.metrics.clone()),
            shutdown.clone(),
        )));
        tasks.push(tokio::spawn(servers::serve(
            self.admin_server,
            self.admin,
            servers::admin_router(
                self.readiness.clone(),
                self.registry.clone(),
                self.handle.clone(),
                self.cfg.clone(),
                self.log.clone(),
                self.admin_token.clone(),
                servers::AppPrestop::new(self.hook_token.clone(), self.handle.clone()),
            ),
            shutdown.clone(),
        )));
        let signals = forward_signals(self.handle.control.clone(), shutdown.clone())
            .map_err(AppError::Signals)?;
        tasks.push(signals);
        tasks.push(tokio::spawn(watch_inputs(
            self.cfg.clone(),
            self.handle.live.clone(),
            self.handle.control.clone(),
            shutdown.clone(),
        )));
        tasks.push(tokio::spawn(watch_stop(
            self.handle.live.annotations().clone(),
            PodRestartPolicy::can_complete(self.cfg.pod_restart_policy),
            STOP_POLL,
            self.handle.control.clone(),
            shutdown.clone(),
        )));

        // Cancelled by the supervisor as Envoy's final stop begins, so the
        // servers and watchers end while Envoy shuts down; here for the
        // exits that stop nothing.
        let reason = self.supervisor.run().await;
        shutdown.cancel();
        // Servers finish their in-flight answers; bounded so exit is never held up.
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            futures::future::join_all(tasks).await;
            if let Err(e) = self.sds.join().await {
                tracing::warn!(error = %e, "SDS did not stop cleanly");
            }
            if let Some(x) = self.xds
                && let Err(e) = x.join().await
            {
                tracing::warn!(error = %e, "the xDS proxy did not stop cleanly");
            }
        })
        .await;
        Ok(reason)
    }
}

fn forward_signals(
    control: tokio::sync::mpsc::Sender<Control>,
    shutdown: CancellationToken,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    Ok(tokio::spawn(async move {
        loop {
            let msg = tokio::select! {
                _ = term.recv() => Control::Signal,
                _ = int.recv() => Control::Signal,
                _ = hup.recv() => Control::HotRestart { reason: "SIGHUP".into() },
                _ = shutdown.cancelled() => return,
            };
            tracing::info!(?msg, "signal received");
            if control.send(msg).await.is_err() {
                return;
            }
        }
    }))
}

/// What the bootstrap depends on besides the flags: the override file and
/// the drain duration (Envoy's `--drain-time-s`) from the pod's annotations.
#[derive(Debug, PartialEq)]
struct Inputs {
    override_file: Option<Result<Vec<u8>, std::io::ErrorKind>>,
    drain_duration: Duration,
    /// Whether a drain can wait decides the idle-close monitor's presence.
    drain_can_wait: bool,
}

fn read_inputs(cfg: &RunConfig, live: &LiveSettings) -> Inputs {
    let settings = live.current_quiet().0;
    Inputs {
        override_file: cfg
            .bootstrap_override
            .as_ref()
            .map(|p| std::fs::read(p).map_err(|e| e.kind())),
        // Quiet: this runs every second; the drain itself logs bad values.
        drain_duration: settings.drain_duration,
        drain_can_wait: settings.can_wait(),
    }
}

/// Ask for a hot restart when the bootstrap's inputs change. Changes of the
/// mounted files are noticed the one way ([`remora_contract::mounted`]).
async fn watch_inputs(
    cfg: Arc<RunConfig>,
    live: LiveSettings,
    control: tokio::sync::mpsc::Sender<Control>,
    shutdown: CancellationToken,
) {
    let mut pushed = live.annotations().clone();
    let paths: Vec<PathBuf> = std::iter::once(cfg.annotations_file.clone())
        .chain(cfg.bootstrap_override.clone())
        .collect();
    let mut wake = MountedWake::new(paths.iter().map(PathBuf::as_path), INPUT_POLL);
    let mut mounted = MountedFiles::new(paths);
    let _ = mounted.poll();
    let mut last = read_inputs(&cfg, &live);
    loop {
        let files_changed = tokio::select! {
            () = wake.next() => mounted.poll().is_some(),
            () = pushed.stream_changed() => true,
            _ = shutdown.cancelled() => return,
        };
        if !files_changed {
            continue;
        }
        let now = read_inputs(&cfg, &live);
        if now != last {
            let reason = if now.drain_duration != last.drain_duration {
                format!("drain duration changed to {:?}", now.drain_duration)
            } else if now.drain_can_wait != last.drain_can_wait {
                format!("a drain can wait: {}", now.drain_can_wait)
            } else {
                "bootstrap override changed".to_string()
            };
            last = now;
            if control.send(Control::HotRestart { reason }).await.is_err() {
                return;
            }
        }
    }
}

/// Quit (stop Envoy, exit 0) once the pod's annotations carry
/// `remora.dev/stop`: the operator sets it on a Job's pod whose app
/// containers have all terminated, and the pod completes only when this
/// sidecar exits too. The file's changes are noticed the one way
/// ([`remora_contract::mounted`]), like [`watch_inputs`]'s. A request
/// already there at start counts too: the operator sets it only after the
/// apps are done and never removes it, so a sidecar (re)started afterwards
/// has nothing left to serve. A pod that cannot complete (restartPolicy
/// Always) would only restart its sidecar in a loop and be left without a
/// proxy: there the request is ignored, and said so once.
async fn watch_stop(
    mut annotations: PodAnnotations,
    can_complete: bool,
    poll: Duration,
    control: tokio::sync::mpsc::Sender<Control>,
    shutdown: CancellationToken,
) {
    let mut wake = MountedWake::new([annotations.file()], poll);
    let mut mounted = MountedFiles::new(vec![annotations.file().to_path_buf()]);
    let mut file_text = None;
    loop {
        // Absent or unreadable (between two kubelet updates): the last text read stays.
        if let Some(contents) = mounted.poll()
            && let Some(Ok(bytes)) = contents.first()
        {
            file_text = Some(String::from_utf8_lossy(bytes).into_owned());
        }
        if let Some((value, native)) = stop_in(annotations.from_stream(), file_text.as_deref()) {
            if native {
                tracing::warn!(
                    annotation = STOP_ANNOTATION,
                    "stop request ignored: a native sidecar is stopped by the kubelet"
                );
                return;
            }
            if !can_complete {
                tracing::warn!(
                    annotation = STOP_ANNOTATION,
                    "stop request ignored: the pod's restartPolicy is Always (or unknown), so it \
                     cannot complete and a stopped sidecar would only be restarted"
                );
                return;
            }
            // The value is informational (who asked, when): any value stops.
            let value: String = value.chars().take(200).collect();
            tracing::info!(annotation = STOP_ANNOTATION, %value,
                "stop requested through the pod's annotations: stopping Envoy, exiting 0");
            let _ = control.send(Control::Quit).await;
            return;
        }
        tokio::select! {
            () = wake.next() => {}
            () = annotations.stream_changed() => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

/// A stop request (its value) and whether the sidecar runs native: from the
/// discovery stream's copy of the annotations while there is one, else from
/// the file's text, read line by line ([`stop_request`]) so that a line its
/// parser cannot read never hides a request.
fn stop_in(stream: StreamCopy, file_text: Option<&str>) -> Option<(String, bool)> {
    let value = match &stream {
        Some(a) => a.get(STOP_ANNOTATION)?.clone(),
        None => stop_request(file_text?)?,
    };
    Some((value, runs_native_in(&stream, file_text)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use remora_contract::annotations::LIFECYCLE;
    use remora_test_support::kubelet::atomic_write;

    /// Write the downward-API file the way the kubelet does.
    fn kubelet_write(dir: &std::path::Path, text: &str) {
        atomic_write(dir, [("annotations", text)]).expect("kubelet-style write");
    }

    /// Through the discovery stream the request is seen when it arrives,
    /// not at the next poll of the file; a native sidecar still ignores it.
    #[tokio::test(start_paused = true)]
    async fn a_stop_pushed_on_the_stream_quits_at_once() {
        use std::collections::BTreeMap;
        type Pushed = tokio::sync::watch::Sender<crate::pod_annotations::StreamCopy>;
        let dir = tempfile::tempdir().expect("tempdir");
        let shutdown = CancellationToken::new();
        let poll = Duration::from_secs(3600);
        // A stop watcher fed by a stream (and a file that never comes).
        let watcher = || {
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let (push, copy): (Pushed, _) = tokio::sync::watch::channel(None);
            let task = tokio::spawn(watch_stop(
                PodAnnotations::new(dir.path().join("annotations"), copy),
                true,
                poll,
                tx,
                shutdown.clone(),
            ));
            (push, rx, task)
        };
        let pushed = |mode: &str, extra: &[(&str, &str)]| {
            let mut a =
                BTreeMap::from([(LIFECYCLE.to_string(), format!(r#"{{"mode":"{mode}"}}"#))]);
            a.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            Some(std::sync::Arc::new(a))
        };
        let (push, mut rx, task) = watcher();
        push.send_replace(pushed("Legacy", &[]));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(rx.try_recv().is_err(), "no request yet");
        let started = tokio::time::Instant::now();
        push.send_replace(pushed("Legacy", &[(STOP_ANNOTATION, "AppsCompleted")]));
        let got = tokio::time::timeout(Duration::from_secs(1), rx.recv())
            .await
            .expect("not at the next poll of the file");
        assert!(matches!(got, Some(Control::Quit)), "{got:?}");
        assert!(started.elapsed() < poll);
        task.await.expect("task");

        // Native: ignored, said so, and the task ends.
        let (push, mut rx, task) = watcher();
        push.send_replace(pushed("Native", &[(STOP_ANNOTATION, "x")]));
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .expect("ends")
            .expect("task");
        assert!(rx.try_recv().is_err(), "a native sidecar is not stopped");
    }

    #[tokio::test(start_paused = true)]
    async fn stop_annotation_sends_quit_once_it_appears() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(watch_stop(
            PodAnnotations::file_only(dir.path().join("annotations")),
            true,
            STOP_POLL,
            tx,
            shutdown.clone(),
        ));
        // No file, then a file without the request: nothing happens.
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert!(rx.try_recv().is_err());
        kubelet_write(dir.path(), "remora.dev/lifecycle=\"{}\"\n");
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert!(rx.try_recv().is_err());
        kubelet_write(
            dir.path(),
            "remora.dev/lifecycle=\"{}\"\nremora.dev/stop=\"not json\"\n",
        );
        let got = tokio::time::timeout(Duration::from_millis(150), rx.recv())
            .await
            .expect("within one poll");
        assert!(matches!(got, Some(Control::Quit)), "{got:?}");
        task.await.expect("the watcher ends after asking");
    }

    #[tokio::test(start_paused = true)]
    async fn stop_present_at_start_counts_and_shutdown_ends_the_watch() {
        let dir = tempfile::tempdir().expect("tempdir");
        kubelet_write(dir.path(), "remora.dev/stop=\"\"\n");
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let task = tokio::spawn(watch_stop(
            PodAnnotations::file_only(dir.path().join("annotations")),
            true,
            STOP_POLL,
            tx,
            CancellationToken::new(),
        ));
        assert!(matches!(rx.recv().await, Some(Control::Quit)));
        task.await.expect("ends");

        let empty = tempfile::tempdir().expect("tempdir");
        let (tx, _rx) = tokio::sync::mpsc::channel(4);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(watch_stop(
            PodAnnotations::file_only(empty.path().join("annotations")),
            true,
            STOP_POLL,
            tx,
            shutdown.clone(),
        ));
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .expect("stops on shutdown")
            .expect("no panic");
    }

    #[tokio::test(start_paused = true)]
    async fn stop_is_ignored_when_the_pod_cannot_complete() {
        let dir = tempfile::tempdir().expect("tempdir");
        kubelet_write(dir.path(), "remora.dev/stop=\"{}\"\n");
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let task = tokio::spawn(watch_stop(
            PodAnnotations::file_only(dir.path().join("annotations")),
            false,
            STOP_POLL,
            tx,
            CancellationToken::new(),
        ));
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .expect("the watcher gives up at once")
            .expect("no panic");
        assert!(rx.recv().await.is_none(), "no quit was asked for");
    }
}
