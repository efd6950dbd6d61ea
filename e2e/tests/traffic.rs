//! The benchmark's clients (`e2e::traffic`) against the test app on
//! loopback, no node: every client kind gets its answers, the app's SIGTERM
//! waits for a long request and ends gRPC streams cleanly, its outbound
//! caller makes a final call once in-flight work is done, and the lagging
//! ingress's errors reach the client classified.

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, ensure};
use e2e::node::ingress::{EndpointFeed, LaggingIngress};
use e2e::traffic::{Kind, Load, Outcome, Sample, Traffic, summarize};
use remora_test_support::wait::wait_until;
use tokio::io::AsyncBufReadExt as _;
use tokio::process::{Child, Command};
use tokio::time::Instant;

const POD: &str = "traffic-test-pod";

/// The test app on a free loopback port, stderr collected.
struct App {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
}

impl App {
    async fn start(extra: &[&str]) -> anyhow::Result<Self> {
        let port = remora_test_support::ports::free_port();
        let mut child = Command::new(env!("CARGO_BIN_EXE_test-app"))
            .args([
                "--port",
                &port.to_string(),
                "--address",
                "127.0.0.1",
                "--delay",
                "1ms",
            ])
            .args(extra)
            .env("HOSTNAME", POD)
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

    fn sigterm(&self) -> anyhow::Result<()> {
        let pid = self.child.id().context("test-app has exited")?;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid)?),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        Ok(())
    }

    fn log(&self) -> Vec<String> {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Waits (at most 20 s) until every load named in `loads` has `n` samples.
async fn until_each_has(traffic: &Traffic, loads: &[&str], n: usize) -> anyhow::Result<()> {
    wait_until(
        Duration::from_secs(20),
        "samples from every load",
        || async {
            let samples = traffic.samples();
            loads
                .iter()
                .all(|l| samples.iter().filter(|s| &*s.load == *l).count() >= n)
                .then_some(())
        },
    )
    .await?;
    Ok(())
}

fn print(samples: &[Sample]) {
    for s in summarize(samples) {
        eprintln!(
            "{:<12} sent {:>4} ok {:>4} failed {:>3} {:?} p50 {:.1} ms p99 {:.1} ms",
            s.load, s.sent, s.ok, s.failed, s.failures, s.latency.p50_ms, s.latency.p99_ms
        );
    }
}

#[tokio::test]
async fn every_client_kind_gets_its_answers() -> anyhow::Result<()> {
    let app = App::start(&[]).await?;
    let loads = vec![
        Load::new(Kind::Http1KeepAlive, app.addr, 50.0),
        Load::new(Kind::H2c { connections: 2 }, app.addr, 50.0),
        Load::new(
            Kind::Post {
                body_bytes: 16 * 1024,
            },
            app.addr,
            20.0,
        ),
        Load::new(
            Kind::Long {
                min: Duration::from_millis(100),
                max: Duration::from_millis(400),
            },
            app.addr,
            10.0,
        ),
        Load::new(Kind::GrpcUnary, app.addr, 50.0),
        Load::new(
            Kind::GrpcStream {
                hold: Duration::from_millis(300),
            },
            app.addr,
            10.0,
        ),
    ];
    let names: Vec<String> = loads.iter().map(|l| l.name.clone()).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let traffic = Traffic::start(loads, Instant::now());
    until_each_has(&traffic, &names, 5).await?;
    let samples = traffic.stop().await;
    print(&samples);
    let failed: Vec<String> = samples
        .iter()
        .filter(|s| !s.outcome.is_ok())
        .map(|s| format!("{} at {:?}: {:?}", s.load, s.at, s.outcome))
        .collect();
    ensure!(
        failed.is_empty(),
        "failed: {failed:#?}\ntest-app's log: {:#?}",
        app.log()
    );
    for s in &samples {
        ensure!(
            s.pod.as_deref() == Some(POD),
            "{} answered by {:?}",
            s.load,
            s.pod
        );
    }
    for s in summarize(&samples) {
        ensure!(s.sent >= 5, "{}: {} sent", s.load, s.sent);
    }
    Ok(())
}

#[tokio::test]
async fn sigterm_waits_for_a_long_request_and_ends_streams_cleanly() -> anyhow::Result<()> {
    let mut app = App::start(&[]).await?;
    let epoch = Instant::now();
    let slow = Duration::from_millis(1500);
    let traffic = Traffic::start(
        vec![
            // One long request, one stream held far beyond the test.
            Load::new(
                Kind::Long {
                    min: slow,
                    max: slow,
                },
                app.addr,
                0.01,
            ),
            Load::new(
                Kind::GrpcStream {
                    hold: Duration::from_secs(600),
                },
                app.addr,
                0.01,
            ),
        ],
        epoch,
    );
    // Both in flight: the stream has had its first message (so the app
    // was serving after the long request's connection was accepted).
    wait_until(
        Duration::from_secs(10),
        "the request and the stream open",
        || async { (traffic.open("long") == 1 && traffic.open("grpc-stream") == 1).then_some(()) },
    )
    .await?;
    let term = epoch.elapsed();
    app.sigterm()?;
    let status = tokio::time::timeout(Duration::from_secs(20), app.child.wait())
        .await
        .context("test-app did not exit in 20 s")??;
    let exited = epoch.elapsed();
    ensure!(status.success(), "test-app exited {status}");
    // The stream ended on its own (server side), before the traffic stopped.
    let before_stop = traffic.samples();
    let samples = traffic.stop().await;
    print(&samples);
    let long = samples
        .iter()
        .find(|s| &*s.load == "long")
        .context("no long request")?;
    ensure!(long.at < term, "the long request was sent after SIGTERM");
    ensure!(long.outcome.is_ok(), "long request: {:?}", long.outcome);
    ensure!(long.latency >= slow);
    // The app answers `slow` after it got the request, which is after the
    // client sent it. (Not the client's end: the last bytes may still be
    // read from the socket after the app has exited.)
    ensure!(
        exited >= long.at + slow,
        "test-app exited at {exited:?}, before it could have answered the long request ({:?})",
        long.at + slow
    );
    let stream = before_stop
        .iter()
        .find(|s| &*s.load == "grpc-stream")
        .context("the stream did not end when the app shut down")?;
    ensure!(stream.outcome.is_ok(), "stream: {:?}", stream.outcome);
    eprintln!(
        "SIGTERM at {term:?}, long request done at {:?}, exit at {exited:?}",
        long.at + long.latency
    );
    // Nothing listens any more: refused, for HTTP and gRPC alike.
    let after = Traffic::start(
        vec![
            Load::new(Kind::Http1KeepAlive, app.addr, 20.0),
            Load::new(Kind::GrpcUnary, app.addr, 20.0),
        ],
        Instant::now(),
    );
    until_each_has(&after, &["http1", "grpc-unary"], 1).await?;
    for s in after.stop().await {
        ensure!(
            s.outcome == Outcome::ConnectRefused,
            "{}: {:?}",
            s.load,
            s.outcome
        );
    }
    Ok(())
}

#[tokio::test]
async fn outbound_calls_end_with_a_final_flush_after_in_flight_work() -> anyhow::Result<()> {
    // The upstream the app calls: records when each call arrived.
    let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let upstream_addr = upstream.local_addr()?;
    let calls: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let seen = calls.clone();
    let router = axum::Router::new().route(
        "/",
        axum::routing::get(move || {
            seen.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Instant::now());
            async { "ok" }
        }),
    );
    tokio::spawn(async move { axum::serve(upstream, router).await });
    let url = format!("http://{upstream_addr}/");
    let mut app = App::start(&["--outbound-every", "50ms", "--outbound-url", &url]).await?;
    wait_until(Duration::from_secs(10), "3 periodic calls", || async {
        (calls.lock().unwrap_or_else(|p| p.into_inner()).len() >= 3).then_some(())
    })
    .await?;
    let epoch = Instant::now();
    let slow = Duration::from_millis(800);
    let traffic = Traffic::start(
        vec![Load::new(
            Kind::Long {
                min: slow,
                max: slow,
            },
            app.addr,
            0.01,
        )],
        epoch,
    );
    wait_until(
        Duration::from_secs(10),
        "the long request in flight",
        || async { (traffic.open("long") == 1).then_some(()) },
    )
    .await?;
    app.sigterm()?;
    let status = tokio::time::timeout(Duration::from_secs(20), app.child.wait())
        .await
        .context("test-app did not exit in 20 s")??;
    ensure!(status.success(), "test-app exited {status}");
    let samples = traffic.stop().await;
    let long = samples.first().context("no long request")?;
    ensure!(long.outcome.is_ok(), "long request: {:?}", long.outcome);
    let done = epoch + long.at + long.latency;
    let calls = calls.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let last = *calls.last().context("no call")?;
    ensure!(
        last >= done,
        "the last call came before the in-flight request ended"
    );
    // Periodic calls went on while the request was in flight.
    ensure!(
        calls.iter().filter(|t| **t > epoch && **t < done).count() >= 3,
        "no periodic calls during the drain"
    );
    let log = app.log();
    ensure!(
        log.iter()
            .any(|l| l == &format!("test-app: final call {url}: 200")),
        "no final call in the log: {log:?}"
    );
    ensure!(
        log.iter()
            .any(|l| l.starts_with("test-app: outbound calls: ")
                && l.ends_with("0 failed; final call ok")),
        "{log:?}"
    );
    eprintln!(
        "{} outbound calls; the final one {:?} after the long request ended",
        calls.len(),
        last - done
    );
    Ok(())
}

#[tokio::test]
async fn ingress_errors_reach_the_client_classified() -> anyhow::Result<()> {
    let app = App::start(&[]).await?;
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await?
        .local_addr()?;
    let feed = EndpointFeed::manual(vec![app.addr, dead], Duration::ZERO);
    let ingress = LaggingIngress::start(feed.receiver()).await?;
    let traffic = Traffic::start(
        vec![Load::new(Kind::Http1KeepAlive, ingress.addr(), 50.0).named("http1@ingress")],
        Instant::now(),
    );
    until_each_has(&traffic, &["http1@ingress"], 10).await?;
    let samples = traffic.stop().await;
    print(&samples);
    let (ok, failed): (Vec<&Sample>, Vec<&Sample>) =
        samples.iter().partition(|s| s.outcome.is_ok());
    // Round robin, no next upstream: half fail, half are served.
    ensure!(
        ok.len().abs_diff(failed.len()) <= 1,
        "{} ok, {} failed",
        ok.len(),
        failed.len()
    );
    for s in failed {
        match &s.outcome {
            Outcome::Status { code: 502, detail } => ensure!(
                detail.contains("x-ingress-error: connect_refused"),
                "{detail}"
            ),
            o => anyhow::bail!("{o:?}"),
        }
    }
    Ok(())
}
