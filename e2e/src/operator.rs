//! Runs `remora-operator serve` as a real process against a control plane,
//! listening on 127.0.0.1 with a certificate made for that address, so that
//! the API server can call it through a webhook's `clientConfig.url`
//! (a Service would need kube-proxy and a pod network, which the local
//! control plane does not have). Also where the harness finds the
//! workspace's operator and agent binaries.

use std::fs::File;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use remora_test_support::bins::{BinError, workspace_bin};
use remora_test_support::pki::{Ca, Leaf};
use remora_test_support::ports::try_free_port;

/// Where a prebuilt operator can be named explicitly.
pub const ENV_OPERATOR_BIN: &str = "REMORA_OPERATOR_BIN";
/// Where a prebuilt agent can be named explicitly.
pub const ENV_AGENT_BIN: &str = "REMORA_AGENT_BIN";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "{name} not found at {}: build it (`cargo build -p {name}`, which `cargo test \
         --workspace` does) or set {env}",
        path.display()
    )]
    MissingBinary {
        name: &'static str,
        path: PathBuf,
        env: &'static str,
    },
    #[error("locating {name}: {source}")]
    Locate {
        name: &'static str,
        #[source]
        source: BinError,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("remora-operator exited during startup ({status}); its log ends with:\n{log}")]
    Exited { status: String, log: String },
    #[error("remora-operator not listening on {addr} after {timeout:?}; its log ends with:\n{log}")]
    NotListening {
        addr: SocketAddr,
        timeout: Duration,
        log: String,
    },
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}

/// The workspace binary `name`: `$env`, else next to the running test or
/// bench binary (`target/<profile>/<name>`).
fn workspace_binary(name: &'static str, env: &'static str) -> Result<PathBuf, Error> {
    workspace_bin(name, env).map_err(|e| match e {
        BinError::NotBuilt(path) => Error::MissingBinary { name, path, env },
        source => Error::Locate { name, source },
    })
}

/// The operator binary: `$REMORA_OPERATOR_BIN`, else next to the test
/// binary (`target/<profile>/remora-operator`).
pub fn operator_bin() -> Result<PathBuf, Error> {
    workspace_binary("remora-operator", ENV_OPERATOR_BIN)
}

/// The agent binary: `$REMORA_AGENT_BIN`, else next to the test binary
/// (`target/<profile>/remora-agent`).
pub fn agent_bin() -> Result<PathBuf, Error> {
    workspace_binary("remora-agent", ENV_AGENT_BIN)
}

/// How to start the operator.
#[derive(Debug, Clone)]
pub struct Options {
    /// `POD_NAMESPACE`: where its cluster default SidecarLifecycle lives. A
    /// test namespace keeps parallel tests apart.
    pub operator_namespace: String,
    /// `--default-mode` (no nodes run here, so `Auto` has no kubelet to ask).
    pub default_mode: String,
    /// Run the SidecarLifecycle controller. Off unless a test needs it:
    /// tests share one API server and each operator's controller acts on
    /// every namespace, so several at once would fight over the same objects.
    pub controller: bool,
    /// More `serve` flags.
    pub args: Vec<String>,
    /// More environment variables (`POD_NAME`, say).
    pub env: Vec<(String, String)>,
    /// How long to wait for it to list the cluster and listen.
    pub start_timeout: Duration,
}

impl Options {
    pub fn new(operator_namespace: &str) -> Self {
        Self {
            operator_namespace: operator_namespace.to_owned(),
            default_mode: "Legacy".to_owned(),
            controller: false,
            args: Vec::new(),
            env: Vec::new(),
            start_timeout: Duration::from_secs(60),
        }
    }

    /// A replica named `identity` (`POD_NAME`) whose leader election runs
    /// at test speed: a 3 s lease, so a takeover comes within seconds.
    pub fn fast_leader(operator_namespace: &str, identity: &str) -> Self {
        let mut o = Self::new(operator_namespace);
        o.env = vec![("POD_NAME".to_owned(), identity.to_owned())];
        o.args = [
            "--lease-duration",
            "3s",
            "--renew-deadline",
            "2s",
            "--retry-period",
            "500ms",
            "--shutdown-grace",
            "5s",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        o
    }
}

/// A running `remora-operator serve`. Stopped (SIGTERM, then SIGKILL) when
/// dropped; a watchdog `sh` holding a pipe from this process kills it if the
/// test process dies without dropping it (panic=abort, SIGKILL).
#[derive(Debug)]
pub struct Operator {
    child: Child,
    watchdog: Option<(Child, ChildStdin)>,
    addr: SocketAddr,
    ca_pem: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Operator {
    /// Starts the operator with `kubeconfig` and waits until it listens
    /// (it binds only after its first listing of the cluster).
    pub async fn start(kubeconfig: &Path, options: Options) -> Result<Self, Error> {
        let bin = operator_bin()?;
        let dir = tempfile::Builder::new()
            .prefix("remora-operator-")
            .tempdir()
            .map_err(io("creating a temp dir"))?;
        let (ca_pem, serving) = loopback_certs();
        let (cert, key) = serving
            .write_pem(dir.path(), "tls.crt", "tls.key")
            .map_err(io("writing tls.crt and tls.key"))?;
        let port = try_free_port().map_err(io("picking a free port"))?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let log = dir.path().join("operator.log");
        let out = File::create(&log).map_err(io("creating operator.log"))?;
        let err = out.try_clone().map_err(io("cloning the log file"))?;
        let child = Command::new(&bin)
            .arg("serve")
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--tls-cert")
            .arg(&cert)
            .arg("--tls-key")
            .arg(&key)
            .arg("--default-mode")
            .arg(&options.default_mode)
            .arg("--log-level")
            .arg("info,remora_operator=debug")
            .arg(format!("--controller={}", options.controller))
            .args(&options.args)
            .env("KUBECONFIG", kubeconfig)
            .env("POD_NAMESPACE", &options.operator_namespace)
            .envs(options.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(io(format!("starting {}", bin.display())))?;
        let watchdog = spawn_watchdog(child.id())?;
        let mut me = Self {
            child,
            watchdog: Some(watchdog),
            addr,
            ca_pem,
            log,
            _dir: dir,
        };
        me.wait_listening(options.start_timeout).await?;
        Ok(me)
    }

    async fn wait_listening(&mut self, timeout: Duration) -> Result<(), Error> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self
                .child
                .try_wait()
                .map_err(io("polling remora-operator"))?
            {
                return Err(Error::Exited {
                    status: status.to_string(),
                    log: self.log_tail(),
                });
            }
            if TcpStream::connect_timeout(&self.addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::NotListening {
                    addr: self.addr,
                    timeout,
                    log: self.log_tail(),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The webhook URL for `clientConfig.url`.
    pub fn url(&self) -> String {
        format!("https://{}/inject", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The CA (PEM) that signed the serving certificate, for `caBundle`.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The end of the operator's log (JSON lines), for failure messages.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log, 6000)
    }

    /// The whole log, for asserting that something was logged at all.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The operator's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (SIGTERM to shut it down, SIGKILL to crash it) unless
    /// it has already exited.
    pub fn signal(&mut self, signal: Signal) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = kill(Pid::from_raw(pid), signal);
        }
    }

    /// Waits up to `timeout` for the process to exit; `None` if it has not.
    pub async fn wait_exit(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<std::process::ExitStatus>, Error> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self
                .child
                .try_wait()
                .map_err(io("polling remora-operator"))?
            {
                return Ok(Some(status));
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(None);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the operator: SIGTERM, then SIGKILL after `grace`. Waits for it.
    pub fn stop(&mut self, grace: Duration) {
        // The watchdog first, so it can never signal a reused pid later.
        if let Some((mut w, stdin)) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
            drop(stdin);
        }
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let deadline = std::time::Instant::now() + grace;
        while std::time::Instant::now() < deadline {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// An `sh` that waits for end-of-file on a pipe whose only writer is this
/// process, then kills `pid`: the operator never outlives the test process.
fn spawn_watchdog(pid: u32) -> Result<(Child, ChildStdin), Error> {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "read _ ; kill -TERM {pid} 2>/dev/null; sleep 3; kill -KILL {pid} 2>/dev/null"
        ))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(io("starting the operator's watchdog (sh)"))?;
    let stdin = child
        .stdin
        .take()
        .ok_or_else(|| io("the watchdog's stdin")(std::io::ErrorKind::BrokenPipe.into()))?;
    Ok((child, stdin))
}

/// A CA (PEM) and a serving certificate for 127.0.0.1 signed by it.
pub fn loopback_certs() -> (String, Leaf) {
    let ca = Ca::new("remora-e2e-webhook-ca");
    // The API server dials the IP of clientConfig.url: it must be an IP SAN.
    let leaf = ca
        .issue()
        .names(&["127.0.0.1", "localhost"])
        .common_name("remora-operator-e2e")
        .server_auth()
        .sign();
    (ca.pem, leaf)
}

/// The last `max` bytes of a log file (lossy UTF-8), for error messages.
fn log_tail(path: &Path, max: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let start = bytes.len().saturating_sub(max);
            String::from_utf8_lossy(&bytes[start..]).into_owned()
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}
