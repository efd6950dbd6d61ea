//! A kubelet-emulating pod runner: takes an (injected) pod spec and runs its
//! containers as local processes, in the order and with the hooks, probes and
//! signals the kubelet would use. What is and is not emulated: `e2e/README.md`.

pub mod spec;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use remora_test_support::kubelet::atomic_write;
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

pub use spec::{ContainerSpec, EnvValue, PodSpec, Probe, RestartPolicy, SpecError};

#[derive(Debug, thiserror::Error)]
pub enum PodError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("container {container}: no local binary for image {image:?} / command {command:?}")]
    NoBinary {
        container: String,
        image: String,
        command: String,
    },
    #[error("container {container}: {what}: {source}")]
    Io {
        container: String,
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("container {container}: {hook} hook failed: {reason}")]
    Hook {
        container: String,
        hook: &'static str,
        reason: String,
    },
    #[error("container {container}: startup probe failed {failures} times")]
    StartupProbe { container: String, failures: u32 },
    #[error("container {container} exited during start: {status}")]
    Exited { container: String, status: String },
    #[error("bootstrap for {container}: {reason}")]
    Bootstrap { container: String, reason: String },
    #[error("volume {volume}: secret {secret:?} not found")]
    NoSecret { volume: String, secret: String },
    #[error("volume {volume}: writing secret {secret:?}: {source}")]
    SecretWrite {
        volume: String,
        secret: String,
        #[source]
        source: std::io::Error,
    },
}

/// Ports a Remora sidecar uses inside the pod (DESIGN.md), remapped like the app's.
pub const SIDECAR_PORTS: [u16; 5] = [15000, 15006, 15020, 15021, 15090];
/// The in-pod port of the sidecar's outbound listener the runner configures.
pub const OUTBOUND_PORT: u16 = 15001;

/// What plays the part of images and of the control plane's config.
#[derive(Debug, Clone)]
pub struct RunnerOptions {
    pub agent_bin: PathBuf,
    pub envoy_bin: PathBuf,
    /// `(name, binary)`: an image whose last path segment (before `:`) or a
    /// command equal to `name` runs `binary`.
    pub images: Vec<(String, PathBuf)>,
    /// Static sidecar config, in pod ports: inbound `(listener, app port)`.
    pub inbound: Vec<(u16, u16)>,
    /// The upstream (host:port on this host) behind the sidecar's outbound listener 15001.
    pub outbound_upstream: Option<SocketAddr>,
    /// Probe periods are `min(spec period, this)` so that runs stay short.
    pub max_probe_period: Duration,
    /// Where pod directories go.
    pub base_dir: PathBuf,
    /// The Secrets that secret volumes are filled from.
    pub secrets: Secrets,
    /// Container restart backoff: the first restart is immediate, the next
    /// waits this long, then twice as long each time up to
    /// `max_restart_backoff` (the kubelet: 10 s and 300 s).
    pub restart_backoff: Duration,
    pub max_restart_backoff: Duration,
}

impl RunnerOptions {
    /// The kubelet's container restart backoff.
    pub const KUBELET_BACKOFF: (Duration, Duration) =
        (Duration::from_secs(10), Duration::from_secs(300));
}

/// How long the kubelet waits before restart number `level` (0-based,
/// since the backoff was last reset): nothing for the first, then
/// `initial`, doubling, at most `max`.
pub fn restart_delay(level: u32, initial: Duration, max: Duration) -> Duration {
    match level {
        0 => Duration::ZERO,
        n => initial
            .checked_mul(1u32.checked_shl(n - 1).unwrap_or(u32::MAX))
            .map_or(max, |d| d.min(max)),
    }
}

/// What the runner knows of a container (the kubelet's containerStatuses).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerStatus {
    pub restart_count: u32,
    /// The last exit, as text (`exit 1`, `signal 9`).
    pub last_exit: Option<String>,
    /// Exited, waiting this long before its restart (CrashLoopBackOff).
    pub backoff: Option<Duration>,
    /// Exited and not to be restarted (restartPolicy).
    pub terminated: bool,
    /// Restarts since the backoff was last reset (a long enough run).
    backoff_level: u32,
}

/// A Secret's data: key → content.
pub type SecretData = BTreeMap<String, Vec<u8>>;

/// Secrets by name, as the API server would hold them. Shared: a test
/// updates a Secret here, then `Pod::sync_secrets` plays the kubelet's
/// periodic volume sync.
#[derive(Debug, Clone, Default)]
pub struct Secrets(Arc<RwLock<BTreeMap<String, SecretData>>>);

impl Secrets {
    /// Create or replace a Secret's data.
    pub fn set(&self, name: &str, data: SecretData) {
        self.0
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), data);
    }

    pub fn get(&self, name: &str) -> Option<SecretData> {
        self.0
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }
}

/// A free port below the kernel's ephemeral range (32768+ by default), so
/// that the load generator's outgoing connections, which take ephemeral
/// local ports, never grab a port between its pick here and the
/// container's bind. Checked free on 0.0.0.0; ports are handed out once per
/// process, from a base that differs between processes.
pub fn free_port() -> std::io::Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOW: u32 = 20000;
    const SPAN: u32 = 12000;
    let _ = NEXT.compare_exchange(
        0,
        std::process::id().wrapping_mul(7919) % SPAN + 1,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..SPAN {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let port = u16::try_from(LOW + n % SPAN).unwrap_or(0);
        if port != 0 && std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        "no free port in 20000-31999",
    ))
}

/// Binary, args and env of a container on this host.
type LocalCommand = (PathBuf, Vec<String>, Vec<(String, String)>);

struct Running {
    name: String,
    spec: ContainerSpec,
    child: Child,
    pgid: i32,
    env: Vec<(String, String)>,
    started: Instant,
}

/// Times of a pod's life, relative to `Pod::created`.
#[derive(Debug, Clone, Default)]
pub struct PodTimes {
    pub ready: Option<Duration>,
    pub stop_requested: Option<Duration>,
    pub stopped: Option<Duration>,
}

#[derive(Debug, Clone)]
pub struct StopReport {
    pub duration: Duration,
    /// `(container, exit status as text, killed by the grace period)`.
    pub exits: Vec<(String, String, bool)>,
}

/// One running pod.
pub struct Pod {
    pub spec: PodSpec,
    pub dir: PathBuf,
    /// In-pod port → host port.
    pub ports: BTreeMap<u16, u16>,
    pub created: Instant,
    opts: RunnerOptions,
    running: Mutex<Vec<Running>>,
    readiness: Mutex<BTreeMap<String, bool>>,
    terminating: Mutex<bool>,
    serving: watch::Sender<bool>,
    probes: Mutex<Vec<JoinHandle<()>>>,
    times: Mutex<PodTimes>,
    statuses: Mutex<BTreeMap<String, ContainerStatus>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Pod {
    /// Host port for an in-pod port.
    pub fn host_port(&self, pod_port: u16) -> Option<u16> {
        self.ports.get(&pod_port).copied()
    }

    /// Ready and not terminating: whether endpoints should include the pod.
    pub fn serving(&self) -> watch::Receiver<bool> {
        self.serving.subscribe()
    }

    pub fn times(&self) -> PodTimes {
        lock(&self.times).clone()
    }

    /// Pids of the running containers' main processes.
    pub fn pid(&self, container: &str) -> Option<i32> {
        lock(&self.running)
            .iter()
            .find(|r| r.name == container)
            .map(|r| r.pgid)
    }

    /// Where a volume's files are on this host.
    pub fn volume_dir(&self, volume: &str) -> PathBuf {
        volume_dir(&self.dir, volume)
    }

    /// The kubelet's periodic sync of secret volumes: each one whose Secret
    /// changed is updated with an atomic `..data` swap. Returns the volumes
    /// that changed.
    pub fn sync_secrets(&self) -> Result<Vec<String>, PodError> {
        let mut changed = Vec::new();
        for (volume, secret) in &self.spec.secret_volumes {
            if write_secret(&self.dir, &self.opts.secrets, volume, secret)? {
                changed.push(volume.clone());
            }
        }
        Ok(changed)
    }

    /// The mount path of a secret volume in an env value or arg, rewritten
    /// to the volume's directory on this host (`/etc/certs/x`,
    /// `--cert-dir=/etc/certs`). Other volumes are not materialized, so
    /// their paths are left alone.
    fn remap_mounts(&self, c: &ContainerSpec, s: &str) -> String {
        let (prefix, value) = match s.split_once('=') {
            Some((flag, v)) if flag.starts_with('-') => (format!("{flag}="), v),
            _ => (String::new(), s),
        };
        let secret = |v: &String| self.spec.secret_volumes.iter().any(|(n, _)| n == v);
        for (volume, path) in c.mounts.iter().filter(|(v, _)| secret(v)) {
            let path = path.trim_end_matches('/');
            if let Some(rest) = value.strip_prefix(path)
                && (rest.is_empty() || rest.starts_with('/'))
            {
                return format!("{prefix}{}{rest}", self.volume_dir(volume).display());
            }
        }
        s.to_string()
    }

    /// The log file of a container (stdout and stderr).
    pub fn log_path(&self, container: &str) -> PathBuf {
        self.dir.join(format!("{container}.log"))
    }

    fn update_serving(&self) {
        let ready = lock(&self.readiness).values().all(|r| *r);
        let serving = ready && !*lock(&self.terminating);
        let changed = self.serving.send_if_modified(|s| {
            let c = *s != serving;
            *s = serving;
            c
        });
        if changed && serving {
            let mut t = lock(&self.times);
            t.ready.get_or_insert(self.created.elapsed());
        }
    }

    fn set_ready(&self, container: &str, ready: bool) {
        lock(&self.readiness).insert(container.to_string(), ready);
        self.update_serving();
    }

    /// Create the pod: allocate ports, write the downward-API file, and start
    /// the containers the way the kubelet does. Returns once every container
    /// has started (postStart hooks and startup probes done); readiness follows.
    pub async fn start(spec: PodSpec, opts: &RunnerOptions) -> Result<Arc<Pod>, PodError> {
        let io = |what: &str| {
            let what = what.to_string();
            move |source| PodError::Io {
                container: "-".into(),
                what,
                source,
            }
        };
        let dir = opts.base_dir.join(&spec.name);
        std::fs::create_dir_all(dir.join("run")).map_err(io("pod dir"))?;
        // The hook volume the sidecar fills and the app hooks exec from.
        std::fs::create_dir_all(dir.join("hook")).map_err(io("pod dir"))?;
        let mut ports = BTreeMap::new();
        for p in spec
            .ports()
            .into_iter()
            .chain(SIDECAR_PORTS)
            .chain([OUTBOUND_PORT])
            .chain(opts.inbound.iter().flat_map(|(l, a)| [*l, *a]))
        {
            if let std::collections::btree_map::Entry::Vacant(e) = ports.entry(p) {
                e.insert(free_port().map_err(io("free port"))?);
            }
        }
        // The downward-API volume: `key="value"` lines, Go-quoted (JSON
        // escaping is the same for what annotations hold).
        let annotations: String = spec
            .annotations
            .iter()
            .map(|(k, v)| format!("{k}={}\n", serde_json::Value::String(v.clone())))
            .collect();
        std::fs::write(dir.join("annotations"), annotations).map_err(io("annotations"))?;
        for (volume, secret) in &spec.secret_volumes {
            write_secret(&dir, &opts.secrets, volume, secret)?;
        }
        let (serving, _) = watch::channel(false);
        let pod = Arc::new(Pod {
            spec,
            dir,
            ports,
            created: Instant::now(),
            opts: opts.clone(),
            running: Mutex::new(Vec::new()),
            readiness: Mutex::new(BTreeMap::new()),
            terminating: Mutex::new(false),
            serving,
            probes: Mutex::new(Vec::new()),
            times: Mutex::new(PodTimes::default()),
            statuses: Mutex::new(BTreeMap::new()),
        });
        // Every container counts as not ready until started (and probed).
        for c in pod.spec.init_containers.iter().chain(&pod.spec.containers) {
            if c.sidecar || pod.spec.containers.iter().any(|a| a.name == c.name) {
                lock(&pod.readiness).insert(c.name.clone(), false);
            }
        }
        if let Err(e) = pod.start_all().await {
            pod.kill_all();
            return Err(e);
        }
        // Weak: the pod's owner decides when it goes (Drop kills it).
        let task = tokio::spawn(Pod::restart_loop(Arc::downgrade(&pod)));
        lock(&pod.probes).push(task);
        Ok(pod)
    }

    async fn start_all(self: &Arc<Self>) -> Result<(), PodError> {
        for c in self.spec.init_containers.clone() {
            if c.sidecar {
                // Native sidecar: started, then its startupProbe must pass
                // before the next init container (or the app) starts.
                self.spawn_container(&c).await?;
                if let Some(p) = &c.startup {
                    self.startup_probe(&c.name, p).await?;
                }
                self.after_started(&c);
            } else {
                // A regular init container runs to completion.
                self.spawn_container(&c).await?;
                let status = self.wait_exit(&c.name).await;
                if !status.success() {
                    return Err(PodError::Exited {
                        container: c.name.clone(),
                        status: describe(status),
                    });
                }
            }
        }
        for c in self.spec.containers.clone() {
            // The kubelet starts containers in order and runs each postStart
            // hook before starting the next container (what Legacy's hold uses).
            self.spawn_container(&c).await?;
            self.after_started(&c);
        }
        Ok(())
    }

    fn after_started(self: &Arc<Self>, c: &ContainerSpec) {
        match &c.readiness {
            None => self.set_ready(&c.name, true),
            Some(p) => {
                let pod = self.clone();
                let (name, probe) = (c.name.clone(), p.clone());
                let task = tokio::spawn(async move { pod.readiness_loop(name, probe).await });
                lock(&self.probes).push(task);
            }
        }
    }

    fn probe_url(&self, p: &Probe) -> String {
        let port = self.host_port(p.port).unwrap_or(p.port);
        format!("http://127.0.0.1:{port}{}", p.path)
    }

    fn period(&self, p: &Probe) -> Duration {
        p.period.min(self.opts.max_probe_period)
    }

    async fn probe_once(&self, p: &Probe) -> bool {
        let client = remora_agent::http_client::HttpClient::new(p.timeout);
        // Kubelet: any 2xx or 3xx is a success.
        matches!(client.get(&self.probe_url(p)).await, Ok(r) if (200..400).contains(&r.status))
    }

    async fn startup_probe(&self, name: &str, p: &Probe) -> Result<(), PodError> {
        let mut failures = 0;
        loop {
            if self.probe_once(p).await {
                return Ok(());
            }
            failures += 1;
            if failures >= p.failure_threshold {
                return Err(PodError::StartupProbe {
                    container: name.into(),
                    failures,
                });
            }
            tokio::time::sleep(self.period(p)).await;
        }
    }

    async fn readiness_loop(self: Arc<Self>, name: String, p: Probe) {
        let mut failures = 0;
        let mut tick = tokio::time::interval(self.period(&p));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if self.probe_once(&p).await {
                failures = 0;
                self.set_ready(&name, true);
            } else {
                failures += 1;
                if failures >= p.failure_threshold {
                    self.set_ready(&name, false);
                }
            }
        }
    }

    /// The command, args and env a container runs with on this host.
    fn local_command(&self, c: &ContainerSpec) -> Result<LocalCommand, PodError> {
        let mut env: Vec<(String, String)> = c
            .env
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    EnvValue::Literal(s) => self.remap_mounts(c, &self.remap(s)),
                    EnvValue::Field(path) => match path.as_str() {
                        "metadata.name" => self.spec.name.clone(),
                        "metadata.namespace" => self.spec.namespace.clone(),
                        "status.podIP" | "status.hostIP" => "127.0.0.1".into(),
                        "spec.serviceAccountName" => "default".into(),
                        _ => String::new(),
                    },
                };
                (k.clone(), v)
            })
            .collect();
        let first = c.command.first().cloned().unwrap_or_default();
        let image_name = image_name(&c.image);
        let is = |n: &str| first == n || image_name == n || c.image.contains(n);
        let args: Vec<String>;
        let bin: PathBuf;
        if is("remora-agent") {
            bin = self.opts.agent_bin.clone();
            env.extend(self.sidecar_env());
            args = c.command.iter().skip(1).chain(&c.args).cloned().collect();
        } else if image_name == "envoy" {
            // The baseline's plain Envoy sidecar: the same static bootstrap the
            // agent would write, Envoy started directly, nothing managing it.
            bin = self.opts.envoy_bin.clone();
            let bootstrap = self.write_baseline_bootstrap(&c.name)?;
            let mut a: Vec<String> = c.command.iter().skip(1).chain(&c.args).cloned().collect();
            a.extend([
                "-c".into(),
                bootstrap.display().to_string(),
                "--use-dynamic-base-id".into(),
                "--log-level".into(),
                "warning".into(),
            ]);
            args = a;
        } else if let Some((_, b)) = self.opts.images.iter().find(|(n, _)| is(n)) {
            bin = b.clone();
            let skip = usize::from(!c.command.is_empty());
            args = c
                .command
                .iter()
                .skip(skip)
                .chain(&c.args)
                .cloned()
                .collect();
        } else {
            return Err(PodError::NoBinary {
                container: c.name.clone(),
                image: c.image.clone(),
                command: first,
            });
        }
        let args = args
            .iter()
            .map(|a| self.remap_mounts(c, &self.remap(&expand(a, &env))))
            .collect();
        Ok((bin, args, env))
    }

    /// The sidecar's env on this host: ports, paths and the static config a
    /// control plane would otherwise provide. Appended after the spec's env,
    /// so these win (as the last duplicate does in a container's env).
    fn sidecar_env(&self) -> Vec<(String, String)> {
        let p = |port: u16| self.host_port(port).unwrap_or(port).to_string();
        let mut env = vec![
            (
                "REMORA_ENVOY_BIN".into(),
                self.opts.envoy_bin.display().to_string(),
            ),
            (
                "REMORA_RUN_DIR".into(),
                self.dir.join("run").display().to_string(),
            ),
            (
                "REMORA_ANNOTATIONS_FILE".into(),
                self.dir.join("annotations").display().to_string(),
            ),
            ("REMORA_ENVOY_ADMIN_PORT".into(), p(15000)),
            ("REMORA_ADMIN_PORT".into(), p(15020)),
            ("REMORA_HEALTH_PORT".into(), p(15021)),
            ("REMORA_HEALTH_ADDRESS".into(), "127.0.0.1".into()),
            ("REMORA_STATS_PORT".into(), p(15090)),
            (
                "REMORA_ADMIN_URL".into(),
                format!("http://127.0.0.1:{}", p(15020)),
            ),
            ("REMORA_CONCURRENCY".into(), "1".into()),
            (
                "REMORA_HOOK_DIR".into(),
                self.dir.join("hook").display().to_string(),
            ),
        ];
        let inbound: Vec<String> = self
            .opts
            .inbound
            .iter()
            .map(|(l, a)| format!("{}:{}", p(*l), p(*a)))
            .collect();
        if !inbound.is_empty() {
            env.push(("REMORA_INBOUND".into(), inbound.join(",")));
        }
        if let Some(up) = self.opts.outbound_upstream {
            env.push((
                "REMORA_OUTBOUND".into(),
                format!("{}:{}:{}", p(OUTBOUND_PORT), up.ip(), up.port()),
            ));
        }
        env
    }

    fn write_baseline_bootstrap(&self, container: &str) -> Result<PathBuf, PodError> {
        let err = |reason: String| PodError::Bootstrap {
            container: container.into(),
            reason,
        };
        let mut argv: Vec<String> = vec!["remora-agent".into(), "run".into()];
        for (k, v) in self.sidecar_env() {
            let flag = k
                .trim_start_matches("REMORA_")
                .to_lowercase()
                .replace('_', "-");
            if flag == "admin-url" {
                continue;
            }
            argv.push(format!("--{flag}={v}"));
        }
        let cli = <remora_agent::config::Cli as clap::Parser>::try_parse_from(&argv)
            .map_err(|e| err(e.to_string()))?;
        let remora_agent::config::Command::Run(cfg) = cli.command else {
            return Err(err("not a run command".into()));
        };
        let doc = remora_agent::bootstrap::generate(&cfg, &Default::default(), None, true)
            .map_err(|e| err(e.to_string()))?;
        let path = self.dir.join("envoy-bootstrap.json");
        remora_agent::bootstrap::write(&path, &doc).map_err(|e| err(e.to_string()))?;
        Ok(path)
    }

    /// Rewrite in-pod ports to host ports: a bare port number, `FLAG=PORT`, and
    /// `127.0.0.1:P` / `localhost:P` inside URLs and addresses.
    pub fn remap(&self, s: &str) -> String {
        if let Ok(p) = s.parse::<u16>() {
            return self.host_port(p).map_or(s.to_string(), |h| h.to_string());
        }
        // `--port=8080`
        if let Some((flag, value)) = s.split_once('=')
            && let Some(h) = value.parse::<u16>().ok().and_then(|p| self.host_port(p))
        {
            return format!("{flag}={h}");
        }
        let mut out = s.to_string();
        for host in ["127.0.0.1:", "localhost:"] {
            let mut result = String::new();
            let mut rest = out.as_str();
            while let Some(i) = rest.find(host) {
                let (head, tail) = rest.split_at(i + host.len());
                result.push_str(head);
                let digits: String = tail.chars().take_while(char::is_ascii_digit).collect();
                let mapped = digits
                    .parse::<u16>()
                    .ok()
                    .and_then(|p| self.host_port(p))
                    .map_or(digits.clone(), |h| h.to_string());
                result.push_str(&mapped);
                rest = &tail[digits.len()..];
            }
            result.push_str(rest);
            out = result;
        }
        out
    }

    async fn spawn_container(&self, c: &ContainerSpec) -> Result<(), PodError> {
        let env = self.launch(c)?;
        if let Some(hook) = &c.post_start {
            // The container counts as started only when its postStart returns.
            let status = self.exec_hook(c, hook, &env, None).await;
            if !status.as_ref().is_ok_and(ExitStatus::success) {
                return Err(PodError::Hook {
                    container: c.name.clone(),
                    hook: "postStart",
                    reason: status.map_or_else(|e| e.to_string(), describe),
                });
            }
        }
        Ok(())
    }

    /// Start a container's process (no hook); returns its env.
    fn launch(&self, c: &ContainerSpec) -> Result<Vec<(String, String)>, PodError> {
        let (bin, args, env) = self.local_command(c)?;
        let io = |what: &str| {
            let (container, what) = (c.name.clone(), what.to_string());
            move |source| PodError::Io {
                container,
                what,
                source,
            }
        };
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(&c.name))
            .map_err(io("log file"))?;
        let mut cmd = Command::new(&bin);
        cmd.args(&args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(io("log file"))?)
            .stderr(log)
            // Own process group: signals and the final SIGKILL reach the
            // container's whole tree, as a container's cgroup would.
            .process_group(0)
            .kill_on_drop(true);
        let child = cmd
            .spawn()
            .map_err(io(&format!("spawn {}", bin.display())))?;
        let pgid = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
        let mut running = lock(&self.running);
        // A restarted container replaces its exited predecessor.
        running.retain(|r| r.name != c.name);
        running.push(Running {
            name: c.name.clone(),
            spec: c.clone(),
            child,
            pgid,
            env: env.clone(),
            started: Instant::now(),
        });
        Ok(env)
    }

    /// A container's status: restarts, last exit, backoff.
    pub fn status(&self, container: &str) -> ContainerStatus {
        lock(&self.statuses)
            .get(container)
            .cloned()
            .unwrap_or_default()
    }

    /// Watch the started containers (native sidecars and regular
    /// containers; not the completed init containers) and restart those
    /// that exit while the pod is not terminating, as the kubelet does.
    async fn restart_loop(pod: std::sync::Weak<Pod>) {
        let mut handled = std::collections::HashSet::new();
        loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let Some(pod) = pod.upgrade() else { return };
            if *lock(&pod.terminating) {
                return;
            }
            let exited: Vec<(ContainerSpec, ExitStatus, Duration)> = lock(&pod.running)
                .iter_mut()
                .filter(|r| r.spec.sidecar || pod.spec.containers.iter().any(|c| c.name == r.name))
                .filter_map(|r| {
                    if handled.contains(&r.pgid) {
                        return None;
                    }
                    let s = r.child.try_wait().ok().flatten()?;
                    handled.insert(r.pgid);
                    Some((r.spec.clone(), s, r.started.elapsed()))
                })
                .collect();
            for (c, status, ran) in exited {
                pod.on_exit(c, status, ran);
            }
        }
    }

    /// A container exited on its own: not ready at once; restarted after
    /// its backoff if the restart policy says so.
    fn on_exit(self: &Arc<Self>, c: ContainerSpec, status: ExitStatus, ran: Duration) {
        if lock(&self.readiness).contains_key(&c.name) {
            self.set_ready(&c.name, false);
        }
        let restart = c.sidecar
            || match self.spec.restart_policy {
                RestartPolicy::Always => true,
                RestartPolicy::OnFailure => !status.success(),
                RestartPolicy::Never => false,
            };
        let delay = {
            let mut statuses = lock(&self.statuses);
            let st = statuses.entry(c.name.clone()).or_default();
            st.last_exit = Some(describe(status));
            if !restart {
                st.terminated = true;
                return;
            }
            // The kubelet forgets a container's backoff once it ran for
            // twice the maximum backoff.
            if ran > self.opts.max_restart_backoff * 2 {
                st.backoff_level = 0;
            }
            let d = restart_delay(
                st.backoff_level,
                self.opts.restart_backoff,
                self.opts.max_restart_backoff,
            );
            st.backoff_level += 1;
            st.backoff = Some(d);
            d
        };
        let pod = Arc::downgrade(self);
        let task = tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            if let Some(pod) = pod.upgrade() {
                pod.restart(&c).await;
            }
        });
        lock(&self.probes).push(task);
    }

    async fn restart(&self, c: &ContainerSpec) {
        let launched = {
            // Under the terminating lock: once `stop` has set it, nothing
            // starts again, and what started before is what it stops.
            let terminating = lock(&self.terminating);
            if *terminating {
                return;
            }
            self.launch(c)
        };
        let env = {
            let mut statuses = lock(&self.statuses);
            let st = statuses.entry(c.name.clone()).or_default();
            st.backoff = None;
            match launched {
                Ok(env) => {
                    st.restart_count += 1;
                    env
                }
                Err(e) => {
                    // Not retried: a binary that cannot start now will not later.
                    st.last_exit = Some(format!("restart failed: {e}"));
                    st.terminated = true;
                    return;
                }
            }
        };
        if let Some(hook) = &c.post_start {
            let ok = self
                .exec_hook(c, hook, &env, None)
                .await
                .is_ok_and(|s| s.success());
            if !ok {
                // The kubelet kills a container whose postStart failed; the
                // restart loop sees the exit and backs off.
                self.signal(&c.name, Signal::SIGKILL);
                return;
            }
        }
        if let Some(p) = c.startup.as_ref().filter(|_| c.sidecar)
            && self.startup_probe(&c.name, p).await.is_err()
        {
            self.signal(&c.name, Signal::SIGKILL);
            return;
        }
        if c.readiness.is_none() && lock(&self.readiness).contains_key(&c.name) {
            self.set_ready(&c.name, true);
        }
    }

    /// Run an exec hook as a local process with the container's env; hooks
    /// calling `remora-agent` get the agent binary and the remapped URLs.
    async fn exec_hook(
        &self,
        c: &ContainerSpec,
        hook: &[String],
        env: &[(String, String)],
        deadline: Option<Instant>,
    ) -> std::io::Result<ExitStatus> {
        let mut argv: Vec<String> = hook.iter().map(|a| self.remap(&expand(a, env))).collect();
        if let Some(rest) = argv
            .first()
            .and_then(|a| a.strip_prefix(remora_contract::pod::HOOK_DIR))
        {
            argv[0] = format!("{}{rest}", self.dir.join("hook").display());
        }
        if argv.first().map(String::as_str) == Some("remora-agent") {
            argv[0] = self.opts.agent_bin.display().to_string();
            if argv.get(1).map(String::as_str) == Some("wait")
                && !argv.iter().any(|a| a.starts_with("--url"))
            {
                let port = self.host_port(15021).unwrap_or(15021);
                argv.push(format!("--url=http://127.0.0.1:{port}/healthz/ready"));
            }
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(&format!("{}.hooks", c.name)))?;
        let mut child = Command::new(&argv[0])
            .args(&argv[1..])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()?;
        match deadline {
            None => child.wait().await,
            Some(d) => match tokio::time::timeout_at(d, child.wait()).await {
                Ok(r) => r,
                Err(_) => {
                    // Kubelet: a preStop hook that outlives the grace period is cut short.
                    let _ = child.kill().await;
                    child.wait().await
                }
            },
        }
    }

    async fn wait_exit(&self, name: &str) -> ExitStatus {
        loop {
            {
                let mut running = lock(&self.running);
                match running.iter_mut().find(|r| r.name == name) {
                    Some(r) => {
                        if let Ok(Some(s)) = r.child.try_wait() {
                            return s;
                        }
                    }
                    None => return ExitStatus::from_raw(0),
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// SIGTERM goes to the container's main process only (PID 1 in a real
    /// container: the agent, which stops Envoy itself); SIGKILL to the whole
    /// process group, as the runtime kills the container's cgroup.
    fn signal(&self, name: &str, sig: Signal) {
        if let Some(pid) = self.pid(name).filter(|p| *p > 0) {
            let _ = if sig == Signal::SIGKILL {
                killpg(Pid::from_raw(pid), sig)
            } else {
                nix::sys::signal::kill(Pid::from_raw(pid), sig)
            };
        }
    }

    /// Stop one container: preStop, SIGTERM, SIGKILL at `deadline`.
    async fn stop_container(&self, name: &str, deadline: Instant) -> (String, String, bool) {
        let found = lock(&self.running)
            .iter()
            .find(|r| r.name == name)
            .map(|r| (r.spec.clone(), r.env.clone()));
        let Some((c, env)) = found else {
            return (name.into(), "not running".into(), false);
        };
        if let Some(hook) = &c.pre_stop {
            let _ = self.exec_hook(&c, hook, &env, Some(deadline)).await;
        }
        self.signal(name, Signal::SIGTERM);
        let status = tokio::time::timeout_at(deadline, self.wait_exit(name)).await;
        match status {
            Ok(s) => (name.into(), describe(s), false),
            Err(_) => {
                self.signal(name, Signal::SIGKILL);
                let s = self.wait_exit(name).await;
                (name.into(), describe(s), true)
            }
        }
    }

    /// Delete the pod the way the kubelet does. Endpoints see the pod
    /// terminating at once (they remove it after their own lag).
    pub async fn stop(self: &Arc<Self>) -> StopReport {
        let t0 = Instant::now();
        *lock(&self.terminating) = true;
        self.update_serving();
        lock(&self.times).stop_requested = Some(self.created.elapsed());
        let deadline = t0 + self.spec.grace;
        let apps: Vec<String> = self
            .spec
            .containers
            .iter()
            .map(|c| c.name.clone())
            .collect();
        let sidecars: Vec<String> = self
            .spec
            .init_containers
            .iter()
            .filter(|c| c.sidecar)
            .map(|c| c.name.clone())
            .collect();
        let mut exits = Vec::new();
        // Regular containers all at once (preStop then SIGTERM, each).
        let mut stops = tokio::task::JoinSet::new();
        for n in apps {
            let pod = self.clone();
            stops.spawn(async move { pod.stop_container(&n, deadline).await });
        }
        while let Some(r) = stops.join_next().await {
            if let Ok(r) = r {
                exits.push(r);
            }
        }
        // Native sidecars after the app containers, in reverse order.
        for n in sidecars.iter().rev() {
            exits.push(self.stop_container(n, deadline).await);
        }
        for t in lock(&self.probes).drain(..) {
            t.abort();
        }
        lock(&self.times).stopped = Some(self.created.elapsed());
        StopReport {
            duration: t0.elapsed(),
            exits,
        }
    }

    fn kill_all(&self) {
        for r in lock(&self.running).iter() {
            if r.pgid > 0 {
                let _ = killpg(Pid::from_raw(r.pgid), Signal::SIGKILL);
            }
        }
        for t in lock(&self.probes).drain(..) {
            t.abort();
        }
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        // No orphans: the whole process group of every container (kill_on_drop
        // alone reaches only the main process).
        self.kill_all();
    }
}

fn volume_dir(pod_dir: &std::path::Path, volume: &str) -> PathBuf {
    pod_dir.join("volumes").join(volume)
}

/// Fill (or update) a secret volume from the current Secret.
fn write_secret(
    pod_dir: &std::path::Path,
    secrets: &Secrets,
    volume: &str,
    secret: &str,
) -> Result<bool, PodError> {
    // The kubelet keeps such a pod in ContainerCreating; here the start fails.
    let data = secrets.get(secret).ok_or_else(|| PodError::NoSecret {
        volume: volume.into(),
        secret: secret.into(),
    })?;
    atomic_write(&volume_dir(pod_dir, volume), &data).map_err(|source| PodError::SecretWrite {
        volume: volume.into(),
        secret: secret.into(),
        source,
    })
}

fn describe(s: ExitStatus) -> String {
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit {c}"),
        (None, Some(sig)) => format!("signal {sig}"),
        _ => "unknown".into(),
    }
}

/// `nginx:1` → `nginx`; `ghcr.io/remora/remora-agent:latest` → `remora-agent`.
fn image_name(image: &str) -> &str {
    let last = image.rsplit('/').next().unwrap_or(image);
    last.split([':', '@']).next().unwrap_or(last)
}

/// Kubernetes' `$(VAR)` expansion in command and args (`$$` escapes).
fn expand(s: &str, env: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(t) = tail.strip_prefix("$$") {
            out.push('$');
            rest = t;
        } else if let Some(end) = tail.strip_prefix("$(").and_then(|t| t.find(')')) {
            let name = &tail[2..2 + end];
            match env.iter().rev().find(|(k, _)| k == name) {
                Some((_, v)) => out.push_str(v),
                None => out.push_str(&tail[..3 + end]),
            }
            rest = &tail[3 + end..];
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

/// A Service's endpoints: pods that are ready and not terminating, each added
/// or removed `lag` after the change (endpoint controller + proxy propagation).
#[derive(Clone)]
pub struct Service {
    endpoints: Arc<RwLock<Vec<(String, SocketAddr)>>>,
    lag: Duration,
}

impl Service {
    pub fn new(lag: Duration) -> Self {
        Self {
            endpoints: Arc::default(),
            lag,
        }
    }

    pub fn snapshot(&self) -> Vec<(String, SocketAddr)> {
        self.endpoints
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Follow a pod: its `pod_port` (remapped) is an endpoint while it serves.
    pub fn track(&self, pod: &Arc<Pod>, pod_port: u16) -> JoinHandle<()> {
        let mut rx = pod.serving();
        let name = pod.spec.name.clone();
        let addr = SocketAddr::from(([127, 0, 0, 1], pod.host_port(pod_port).unwrap_or(pod_port)));
        let eps = self.endpoints.clone();
        let lag = self.lag;
        tokio::spawn(async move {
            loop {
                if rx.changed().await.is_err() {
                    // The pod is gone: so is its endpoint.
                    tokio::time::sleep(lag).await;
                    eps.write()
                        .unwrap_or_else(|e| e.into_inner())
                        .retain(|(n, _)| *n != name);
                    return;
                }
                tokio::time::sleep(lag).await;
                let serving = *rx.borrow_and_update();
                let mut e = eps.write().unwrap_or_else(|e| e.into_inner());
                e.retain(|(n, _)| *n != name);
                if serving {
                    e.push((name.clone(), addr));
                }
            }
        })
    }

    /// Wait until `pod` is (or is no longer) an endpoint, up to `timeout`.
    pub async fn wait_endpoint(&self, pod: &str, present: bool, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.snapshot().iter().any(|(n, _)| n == pod) == present {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        false
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, Vec<u8>> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn restart_backoff_is_immediate_then_doubles_to_the_cap() {
        let (i, m) = RunnerOptions::KUBELET_BACKOFF;
        let delays: Vec<u64> = (0..9).map(|l| restart_delay(l, i, m).as_secs()).collect();
        assert_eq!(delays, vec![0, 10, 20, 40, 80, 160, 300, 300, 300]);
        assert_eq!(restart_delay(u32::MAX, i, m), m);
    }

    #[test]
    fn mount_paths_are_remapped_for_the_mounting_container_only() {
        let yaml = r#"
apiVersion: v1
kind: Pod
metadata: {name: p, namespace: ns}
spec:
  volumes:
    - {name: certs, secret: {secretName: tls}}
    - {name: scratch, emptyDir: {}}
  containers:
    - name: proxy
      image: remora-agent
      args: [--cert-dir=/etc/certs, /etc/certs/key.pem, /etc/certsx]
      env: [{name: REMORA_CERT_DIR, value: /etc/certs/}]
      volumeMounts: [{name: certs, mountPath: /etc/certs}, {name: scratch, mountPath: /tmp/x}]
    - name: app
      image: app
      args: [--cert-dir=/etc/certs]
"#;
        let spec = PodSpec::from_yaml(yaml).expect("spec");
        assert_eq!(
            spec.secret_volumes,
            vec![("certs".to_string(), "tls".to_string())]
        );
        let tmp = tempfile::tempdir().expect("tmp");
        let opts = RunnerOptions {
            agent_bin: "remora-agent".into(),
            envoy_bin: "envoy".into(),
            images: Vec::new(),
            inbound: Vec::new(),
            outbound_upstream: None,
            max_probe_period: Duration::from_secs(1),
            base_dir: tmp.path().to_path_buf(),
            secrets: Secrets::default(),
            restart_backoff: Duration::from_secs(10),
            max_restart_backoff: Duration::from_secs(300),
        };
        let pod = Pod {
            dir: tmp.path().join("p"),
            spec: spec.clone(),
            ports: BTreeMap::new(),
            created: Instant::now(),
            opts,
            running: Mutex::new(Vec::new()),
            readiness: Mutex::new(BTreeMap::new()),
            terminating: Mutex::new(false),
            serving: watch::channel(false).0,
            probes: Mutex::new(Vec::new()),
            times: Mutex::new(PodTimes::default()),
            statuses: Mutex::new(BTreeMap::new()),
        };
        let certs = pod.volume_dir("certs").display().to_string();
        let (proxy, app) = (&spec.containers[0], &spec.containers[1]);
        assert_eq!(
            pod.remap_mounts(proxy, "--cert-dir=/etc/certs"),
            format!("--cert-dir={certs}")
        );
        assert_eq!(
            pod.remap_mounts(proxy, "/etc/certs/key.pem"),
            format!("{certs}/key.pem")
        );
        assert_eq!(pod.remap_mounts(proxy, "/etc/certs/"), format!("{certs}/"));
        assert_eq!(pod.remap_mounts(proxy, "/etc/certsx"), "/etc/certsx");
        assert_eq!(
            pod.remap_mounts(proxy, "/tmp/x/y"),
            "/tmp/x/y",
            "not a secret"
        );
        assert_eq!(
            pod.remap_mounts(app, "--cert-dir=/etc/certs"),
            "--cert-dir=/etc/certs"
        );
    }

    #[test]
    fn a_missing_secret_fails_the_start_and_sync_updates() {
        let tmp = tempfile::tempdir().expect("tmp");
        let secrets = Secrets::default();
        let err = write_secret(tmp.path(), &secrets, "certs", "tls").expect_err("no secret");
        assert!(matches!(err, PodError::NoSecret { .. }), "{err}");
        secrets.set("tls", data(&[("k", "v1")]));
        assert!(write_secret(tmp.path(), &secrets, "certs", "tls").expect("write"));
        secrets.set("tls", data(&[("k", "v2")]));
        assert!(write_secret(tmp.path(), &secrets, "certs", "tls").expect("write"));
        let f = volume_dir(tmp.path(), "certs").join("k");
        assert_eq!(std::fs::read_to_string(f).expect("k"), "v2");
    }
}
