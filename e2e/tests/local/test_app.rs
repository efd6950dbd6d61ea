//! The test app (`e2e/test-app/src/main.rs`) as the tests of this binary
//! start it: on a free loopback port, its stderr collected, ready once it
//! says it listens.

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use remora_test_support::wait::wait_until;
use tokio::io::AsyncBufReadExt as _;
use tokio::process::{Child, Command};

/// The test app on a free loopback port, stderr collected.
pub struct App {
    pub child: Child,
    pub addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
}

impl App {
    /// Started with `HOSTNAME` `pod` (the name its answers carry) and `args`.
    pub async fn start(pod: &str, args: &[&str]) -> anyhow::Result<Self> {
        let port = remora_test_support::ports::free_port();
        // Another package's binary (remora-test-app): its own integration
        // test (e2e/test-app/tests/cli.rs) has `cargo test --workspace`
        // build it beside this one.
        let bin = remora_test_support::bins::sibling_bin("test-app")?;
        let mut child = Command::new(bin)
            .args(["--port", &port.to_string(), "--address", "127.0.0.1"])
            .args(args)
            .env("HOSTNAME", pod)
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting test-app")?;
        let log = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().context("stderr")?;
        let sink = log.clone();
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(stderr).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                sink.lock().unwrap_or_else(|p| p.into_inner()).push(l);
            }
        });
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        // The app's own word, not a connect: a connect may reach whatever
        // else holds the port for a moment (a CI run once saw refused
        // connects after a connect-based wait succeeded).
        let listening = format!("test-app: listening on {addr}");
        let mut app = Self { child, addr, log };
        wait_until(Duration::from_secs(10), "test-app listening", || {
            let found = app.log().contains(&listening);
            let exited = app.child.try_wait().ok().flatten();
            async move {
                match (found, exited) {
                    (true, _) => Some(Ok(())),
                    (false, Some(status)) => Some(Err(status)),
                    (false, None) => None,
                }
            }
        })
        .await?
        .map_err(|status| anyhow::anyhow!("test-app exited {status}: {:?}", app.log()))?;
        Ok(app)
    }

    pub fn sigterm(&self) -> anyhow::Result<()> {
        let pid = self.child.id().context("test-app has exited")?;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid)?),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        Ok(())
    }

    pub fn log(&self) -> Vec<String> {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
