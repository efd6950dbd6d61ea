//! Shared helpers of the agent's integration tests: the agent binary in
//! front of the real Envoy, a small HTTP app, and raw HTTP/1.1 clients.
//! Ports, Envoy's path and waiting come from remora-test-support.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

pub use remora_test_support::bins::envoy_bin;
pub use remora_test_support::ports::{connect_from, free_port};
pub use remora_test_support::wait::wait_until_blocking;
use remora_test_support::wait::{Check, Wait};

pub fn agent_bin() -> &'static str {
    env!("CARGO_BIN_EXE_remora-agent")
}

/// A tiny HTTP/1.1 app: answers every request with `ok <n>` (keep-alive), after `delay`.
pub struct App {
    pub port: u16,
    pub requests: Arc<AtomicUsize>,
}

impl App {
    pub fn start(delay: Duration) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind app");
        let port = l.local_addr().expect("addr").port();
        let requests = Arc::new(AtomicUsize::new(0));
        let count = requests.clone();
        std::thread::spawn(move || {
            for stream in l.incoming() {
                let Ok(mut s) = stream else { continue };
                let count = count.clone();
                std::thread::spawn(move || {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                            match s.read(&mut chunk) {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        let end = buf.windows(4).position(|w| w == b"\r\n\r\n").expect("end") + 4;
                        buf.drain(..end);
                        std::thread::sleep(delay);
                        let n = count.fetch_add(1, Ordering::SeqCst) + 1;
                        let body = format!("ok {n}");
                        let resp = format!(
                            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        );
                        if s.write_all(resp.as_bytes()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self { port, requests }
    }
}

/// One HTTP/1.1 response, read off a kept-alive connection.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A client connection that stays open between requests.
pub struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    pub fn open(port: u16) -> std::io::Result<Self> {
        Self::from_stream(TcpStream::connect(("127.0.0.1", port))?)
    }

    /// A connection to 127.0.0.1:`port` from `source` (another client).
    pub fn open_from(source: [u8; 4], port: u16) -> std::io::Result<Self> {
        Self::from_stream(connect_from(source.into(), addr(port))?)
    }

    /// Whether the server has closed this connection (read without waiting).
    pub fn closed_by_peer(&self) -> std::io::Result<bool> {
        self.stream.set_nonblocking(true)?;
        let mut b = [0u8; 1];
        let r = self.stream.peek(&mut b);
        self.stream.set_nonblocking(false)?;
        match r {
            Ok(0) => Ok(true),
            Ok(_) => Ok(false),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(true),
            Err(e) => Err(e),
        }
    }

    fn from_stream(stream: TcpStream) -> std::io::Result<Self> {
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(Self {
            stream,
            buf: Vec::new(),
        })
    }

    pub fn request(&mut self, method: &str, path: &str) -> std::io::Result<HttpResponse> {
        self.request_with(method, path, &[])
    }

    pub fn request_with(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
    ) -> std::io::Result<HttpResponse> {
        let extra: String = headers
            .iter()
            .map(|(k, v)| format!("{k}: {v}\r\n"))
            .collect();
        let req =
            format!("{method} {path} HTTP/1.1\r\nhost: test\r\ncontent-length: 0\r\n{extra}\r\n");
        self.stream.write_all(req.as_bytes())?;
        self.read_response()
    }

    /// Write raw bytes: e.g. half of a request's head, which keeps a
    /// request in flight (its connection active, never idle) until the
    /// rest follows.
    pub fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Read one response off the connection.
    pub fn read_response(&mut self) -> std::io::Result<HttpResponse> {
        let head_end = loop {
            if let Some(p) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
            self.fill()?;
        };
        let head = String::from_utf8_lossy(&self.buf[..head_end]).into_owned();
        let mut lines = head.split("\r\n");
        let status: u16 = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("bad status line in {head:?}")))?;
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        self.buf.drain(..head_end);
        let chunked = headers
            .iter()
            .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
        if chunked {
            let body = self.read_chunked()?;
            return Ok(HttpResponse {
                status,
                headers,
                body,
            });
        }
        let len: usize = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        while self.buf.len() < len {
            self.fill()?;
        }
        let body = String::from_utf8_lossy(&self.buf[..len]).into_owned();
        self.buf.drain(..len);
        Ok(HttpResponse {
            status,
            headers,
            body,
        })
    }

    fn fill(&mut self) -> std::io::Result<()> {
        let mut chunk = [0u8; 4096];
        let n = self.stream.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "connection closed before the response ended",
            ));
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }

    fn read_line(&mut self) -> std::io::Result<String> {
        loop {
            if let Some(p) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line = String::from_utf8_lossy(&self.buf[..p]).into_owned();
                self.buf.drain(..p + 2);
                return Ok(line);
            }
            self.fill()?;
        }
    }

    fn read_chunked(&mut self) -> std::io::Result<String> {
        let mut body = Vec::new();
        loop {
            let size_line = self.read_line()?;
            let size = usize::from_str_radix(size_line.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| std::io::Error::other(format!("bad chunk size {size_line:?}")))?;
            if size == 0 {
                // Trailers end with an empty line.
                while !self.read_line()?.is_empty() {}
                return Ok(String::from_utf8_lossy(&body).into_owned());
            }
            while self.buf.len() < size + 2 {
                self.fill()?;
            }
            body.extend_from_slice(&self.buf[..size]);
            self.buf.drain(..size + 2);
        }
    }

    pub fn get(&mut self, path: &str) -> std::io::Result<HttpResponse> {
        self.request("GET", path)
    }
}

/// One request on a fresh connection.
pub fn http(method: &str, port: u16, path: &str) -> std::io::Result<HttpResponse> {
    Conn::open(port)?.request(method, path)
}

pub fn get(port: u16, path: &str) -> std::io::Result<HttpResponse> {
    http("GET", port, path)
}

/// One request with `Authorization: Bearer <token>`, on a fresh connection.
pub fn http_bearer(
    method: &str,
    port: u16,
    path: &str,
    token: &str,
) -> std::io::Result<HttpResponse> {
    let auth = format!("Bearer {token}");
    Conn::open(port)?.request_with(method, path, &[("authorization", &auth)])
}

/// The ports one agent uses.
#[derive(Debug, Clone, Copy)]
pub struct Ports {
    pub envoy_admin: u16,
    pub admin: u16,
    pub health: u16,
    pub stats: u16,
    pub inbound: u16,
    pub outbound: u16,
}

impl Ports {
    pub fn new() -> Self {
        Self {
            envoy_admin: free_port(),
            admin: free_port(),
            health: free_port(),
            stats: free_port(),
            inbound: free_port(),
            outbound: free_port(),
        }
    }
}

/// A running `remora-agent run`, killed (with its Envoy) when dropped.
pub struct Agent {
    pub child: Child,
    pub ports: Ports,
    pub dir: tempfile::TempDir,
    pub app: App,
    log: PathBuf,
}

pub struct AgentBuilder {
    args: Vec<String>,
    envs: Vec<(String, String)>,
    app_delay: Duration,
    annotations: Option<String>,
    hook: bool,
}

impl AgentBuilder {
    pub fn new() -> Self {
        Self {
            args: Vec::new(),
            envs: Vec::new(),
            app_delay: Duration::ZERO,
            annotations: None,
            hook: false,
        }
    }
    /// Give the agent a hook dir (`<dir>/hook`), as the operator does.
    pub fn hook(mut self) -> Self {
        self.hook = true;
        self
    }
    /// The annotations file as it is before the agent starts (raw text).
    pub fn annotations(mut self, text: &str) -> Self {
        self.annotations = Some(text.into());
        self
    }
    pub fn arg(mut self, a: impl Into<String>) -> Self {
        self.args.push(a.into());
        self
    }
    pub fn args<I: IntoIterator<Item = S>, S: Into<String>>(mut self, a: I) -> Self {
        self.args.extend(a.into_iter().map(Into::into));
        self
    }
    pub fn env(mut self, k: &str, v: &str) -> Self {
        self.envs.push((k.into(), v.into()));
        self
    }
    pub fn app_delay(mut self, d: Duration) -> Self {
        self.app_delay = d;
        self
    }

    /// Start the app and the agent in front of it; do not wait for readiness.
    pub fn spawn(self) -> Agent {
        let app = App::start(self.app_delay);
        let ports = Ports::new();
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("agent.log");
        let logf = std::fs::File::create(&log).expect("log file");
        if let Some(text) = &self.annotations {
            std::fs::write(dir.path().join("annotations"), text).expect("annotations");
        }
        let mut hook_args = Vec::new();
        if self.hook {
            let hook = dir.path().join("hook");
            std::fs::create_dir(&hook).expect("hook dir");
            hook_args.push(format!("--hook-dir={}", hook.display()));
        }
        let mut cmd = Command::new(agent_bin());
        cmd.arg("run")
            .arg("--envoy-bin")
            .arg(envoy_bin().expect("Envoy binary"))
            .arg("--run-dir")
            .arg(dir.path().join("run"))
            .arg("--annotations-file")
            .arg(dir.path().join("annotations"))
            .args(["--health-address", "127.0.0.1"])
            .args(["--log-format", "text", "--concurrency", "1"])
            .arg(format!("--envoy-admin-port={}", ports.envoy_admin))
            .arg(format!("--admin-port={}", ports.admin))
            .arg(format!("--health-port={}", ports.health))
            .arg(format!("--stats-port={}", ports.stats))
            .arg(format!("--inbound={}:{}", ports.inbound, app.port))
            .arg(format!(
                "--outbound={}:127.0.0.1:{}",
                ports.outbound, app.port
            ))
            .args(&hook_args)
            .args(&self.args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(logf.try_clone().expect("dup"))
            .stderr(logf);
        let child = cmd.spawn().expect("agent starts");
        Agent {
            child,
            ports,
            dir,
            app,
            log,
        }
    }

    /// Start and wait until `/healthz/ready` says 200.
    pub fn start(self) -> Agent {
        let mut a = self.spawn();
        a.wait_ready();
        a
    }
}

impl Agent {
    pub fn builder() -> AgentBuilder {
        AgentBuilder::new()
    }

    pub fn wait_ready(&mut self) {
        let port = self.ports.health;
        let child = &mut self.child;
        let ready = Wait::new(Duration::from_secs(20), "the agent to be ready")
            .every(Duration::from_millis(10))
            .until_blocking(|| {
                if let Ok(Some(status)) = child.try_wait() {
                    return Check::Done(Err(status));
                }
                match get(port, "/healthz/ready") {
                    Ok(r) if r.status == 200 => Check::Done(Ok(())),
                    Ok(r) => Check::NotYet(format!("{}", r.status)),
                    Err(e) => Check::NotYet(e.to_string()),
                }
            });
        match ready {
            Ok(Ok(())) => {}
            Ok(Err(status)) => panic!("agent exited with {status} before ready:\n{}", self.log()),
            Err(e) => panic!("{e}:\n{}", self.log()),
        }
    }

    /// Wait (2 s at most) for `/healthz/ready` to answer 503; returns its body.
    pub fn wait_unready(&self) -> String {
        wait_until_blocking(Duration::from_secs(2), "readiness to fail", || {
            let r = get(self.ports.health, "/healthz/ready").ok()?;
            (r.status == 503).then_some(r.body)
        })
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid")
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig).expect("signal agent");
    }

    /// The agent's `/debug/config`.
    pub fn debug(&self) -> serde_json::Value {
        let r = get(self.ports.admin, "/debug/config").expect("debug/config");
        serde_json::from_str(&r.body).expect("json")
    }

    pub fn envoy_pid(&self) -> Option<i32> {
        self.debug()["envoy"]["pid"]
            .as_i64()
            .and_then(|p| i32::try_from(p).ok())
    }

    /// The admin token the agent wrote into its run dir.
    pub fn admin_token(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("run").join("admin-token"))
            .expect("the agent wrote its admin token")
    }

    /// The hook dir (with `.hook()`), where the helper and its endpoint are.
    pub fn hook_dir(&self) -> PathBuf {
        self.dir.path().join("hook")
    }

    /// The token in the hook's endpoint file.
    pub fn hook_token(&self) -> String {
        let text = std::fs::read_to_string(self.hook_dir().join("endpoint"))
            .expect("the agent wrote the hook endpoint");
        text.lines()
            .find_map(|l| l.strip_prefix("token="))
            .expect("a token line")
            .to_string()
    }

    /// POST to the admin port with the admin token.
    pub fn admin_post(&self, path: &str) -> HttpResponse {
        http_bearer("POST", self.ports.admin, path, &self.admin_token()).expect("admin answers")
    }

    pub fn metrics(&self) -> String {
        get(self.ports.admin, "/metrics").expect("metrics").body
    }

    /// Wait for the agent to exit, at most `deadline`.
    pub fn wait_exit(&mut self, deadline: Duration) -> ExitStatus {
        let child = &mut self.child;
        Wait::new(deadline, "the agent to exit")
            .every(Duration::from_millis(5))
            .until_blocking(|| child.try_wait().expect("try_wait"))
            .unwrap_or_else(|e| panic!("{e}:\n{}", self.log()))
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    pub fn write_annotations(&self, lines: &[(&str, &str)]) {
        let text = annotations_text(lines);
        let path = self.dir.path().join("annotations");
        let tmp = self.dir.path().join("annotations.tmp");
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(tmp, path).expect("rename");
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The downward API's annotations file: `key="value"` lines.
pub fn annotations_text(lines: &[(&str, &str)]) -> String {
    lines
        .iter()
        .map(|(k, v)| format!("{k}={}\n", serde_json::to_string(v).expect("quote")))
        .collect()
}

/// Is a process with this pid alive (and not a zombie)?
pub fn process_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // The state follows the command name in parentheses.
            let state = stat.rsplit_once(')').map(|(_, r)| r.trim_start());
            !matches!(
                state.and_then(|s| s.chars().next()),
                Some('Z') | Some('X') | None
            )
        }
        Err(_) => false,
    }
}

pub fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

pub fn path_str(p: &Path) -> String {
    p.display().to_string()
}
