//! The benchmark's clients (`e2e::traffic`) against the test app on
//! loopback, no node: every client kind gets its answers, the app's SIGTERM
//! waits for a long request and ends gRPC streams cleanly, its outbound
//! caller makes a final call once in-flight work is done, the lagging
//! ingress's errors reach the client classified, and every client kind
//! reports a request the server cut as lost, never resent.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::test_app::App;
use anyhow::{Context, ensure};
use e2e::node::ingress::{EndpointFeed, LaggingIngress};
use e2e::traffic::{
    IDLE_KEEP_ALIVE, Kind, Load, Outcome, Sample, TlsClient, TlsConnector, Traffic,
    fresh_tls_client, summarize, tls_client,
};
use remora_test_support::pki::{Ca, client_config};
use remora_test_support::wait::wait_until;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tokio::time::Instant;

const POD: &str = "traffic-test-pod";

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
    let app = App::start(POD, &["--delay", "1ms"]).await?;
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
    let mut app = App::start(POD, &["--delay", "1ms"]).await?;
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
    let mut app = App::start(
        POD,
        &[
            "--delay",
            "1ms",
            "--outbound-every",
            "50ms",
            "--outbound-url",
            &url,
        ],
    )
    .await?;
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
    let app = App::start(POD, &["--delay", "1ms"]).await?;
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

/// What a [`CuttingServer`] speaks.
enum Speaks {
    Http1,
    /// HTTP/1.1 over TLS, client certificates required (mTLS).
    Http1Tls(tokio_rustls::TlsAcceptor),
    /// HTTP/2 with prior knowledge (h2c and gRPC).
    H2,
}

/// A server double on loopback: it takes each connection, reads one
/// request (an HTTP/1.1 head, or an HTTP/2 HEADERS frame), counts it and
/// closes the connection without answering. What a client reports then is
/// a request lost under it; a client that resent it would make the double
/// count a second request (or connection).
struct CuttingServer {
    addr: SocketAddr,
    requests: Arc<AtomicUsize>,
    connections: Arc<AtomicUsize>,
}

impl CuttingServer {
    async fn start(speaks: Speaks) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let requests = Arc::new(AtomicUsize::new(0));
        let connections = Arc::new(AtomicUsize::new(0));
        let (seen, accepted) = (requests.clone(), connections.clone());
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                accepted.fetch_add(1, Ordering::SeqCst);
                let read = match &speaks {
                    Speaks::Http1 => {
                        let mut tcp = tcp;
                        read_head(&mut tcp).await
                    }
                    Speaks::Http1Tls(acceptor) => match acceptor.accept(tcp).await {
                        Ok(mut tls) => read_head(&mut tls).await,
                        Err(_) => false,
                    },
                    Speaks::H2 => read_h2_headers(tcp).await,
                };
                if read {
                    seen.fetch_add(1, Ordering::SeqCst);
                }
                // The stream is dropped here: the connection closes under
                // the request.
            }
        });
        Ok(Self {
            addr,
            requests,
            connections,
        })
    }

    /// (requests read, connections accepted).
    fn counts(&self) -> (usize, usize) {
        (
            self.requests.load(Ordering::SeqCst),
            self.connections.load(Ordering::SeqCst),
        )
    }
}

/// Reads an HTTP/1.1 request head (to the blank line); false if the
/// connection ended first.
async fn read_head<S: AsyncRead + Unpin>(s: &mut S) -> bool {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    true
}

/// The server side of an HTTP/2 connection up to the client's first
/// HEADERS frame: the client's preface, our empty SETTINGS and the ACK of
/// the client's; false if the connection ended first.
async fn read_h2_headers(mut s: tokio::net::TcpStream) -> bool {
    let mut preface = [0u8; 24];
    if s.read_exact(&mut preface).await.is_err() {
        return false;
    }
    let settings = [0, 0, 0, 4, 0, 0, 0, 0, 0];
    let ack = [0, 0, 0, 4, 1, 0, 0, 0, 0];
    if s.write_all(&settings).await.is_err() || s.write_all(&ack).await.is_err() {
        return false;
    }
    loop {
        let mut head = [0u8; 9];
        if s.read_exact(&mut head).await.is_err() {
            return false;
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0u8; len];
        if s.read_exact(&mut payload).await.is_err() {
            return false;
        }
        const HEADERS: u8 = 1;
        if head[3] == HEADERS {
            return true;
        }
    }
}

/// One request of `kind` (a load at a rate that sends exactly one) to
/// `target`: its sample.
async fn one_request(kind: Kind, target: SocketAddr) -> anyhow::Result<Sample> {
    let name = kind.label();
    let traffic = Traffic::start(vec![Load::new(kind, target, 0.01)], Instant::now());
    until_each_has(&traffic, &[name], 1).await?;
    let samples = traffic.stop().await;
    ensure!(samples.len() == 1, "{} samples: {samples:?}", samples.len());
    Ok(samples[0].clone())
}

/// The request was reported lost as cut in flight, and the server saw it
/// exactly once, on one connection.
fn lost_once(what: &str, outcome: &Outcome, server: &CuttingServer) -> anyhow::Result<()> {
    eprintln!("{what}: {outcome}");
    ensure!(
        outcome.in_flight_cut(),
        "{what}: expected an in-flight cut, got {outcome:?}"
    );
    ensure!(
        server.counts() == (1, 1),
        "{what}: the server saw (requests, connections) {:?}, not (1, 1): a resend",
        server.counts()
    );
    Ok(())
}

#[tokio::test]
async fn http1_keep_alive_reports_a_cut_request_lost() -> anyhow::Result<()> {
    let server = CuttingServer::start(Speaks::Http1).await?;
    let sample = one_request(Kind::Http1KeepAlive, server.addr).await?;
    lost_once("http1", &sample.outcome, &server)
}

#[tokio::test]
async fn h2c_reports_a_cut_request_lost() -> anyhow::Result<()> {
    let server = CuttingServer::start(Speaks::H2).await?;
    let sample = one_request(Kind::H2c { connections: 1 }, server.addr).await?;
    lost_once("h2c", &sample.outcome, &server)
}

#[tokio::test]
async fn grpc_unary_reports_a_cut_call_lost() -> anyhow::Result<()> {
    let server = CuttingServer::start(Speaks::H2).await?;
    let sample = one_request(Kind::GrpcUnary, server.addr).await?;
    lost_once("grpc-unary", &sample.outcome, &server)
}

#[tokio::test]
async fn grpc_stream_reports_a_cut_stream_lost() -> anyhow::Result<()> {
    let server = CuttingServer::start(Speaks::H2).await?;
    let hold = Duration::from_secs(60);
    let sample = one_request(Kind::GrpcStream { hold }, server.addr).await?;
    lost_once("grpc-stream", &sample.outcome, &server)
}

/// mTLS on both sides: a root, a serving certificate for `SERVER_NAME`,
/// a client certificate; the acceptor requires the client's.
fn mtls() -> anyhow::Result<(tokio_rustls::TlsAcceptor, TlsConnector)> {
    const SERVER_NAME: &str = "web.traffic.test";
    let ca = Ca::new("traffic test root");
    let serving = ca.issue().names(&[SERVER_NAME]).server_auth().sign();
    let client = ca
        .issue()
        .uri("spiffe://cluster.local/ns/traffic/sa/load")
        .client_auth()
        .sign();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca.pem.as_bytes()) {
        roots.add(cert?)?;
    }
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider.clone())
            .build()?;
    let server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![serving.der.clone()], serving.private_key())?;
    let connector = TlsConnector::new(client_config(&ca.pem, Some(&client))?, SERVER_NAME)?;
    Ok((Arc::new(server).into(), connector))
}

#[tokio::test]
async fn http1_over_mtls_reports_a_cut_request_lost() -> anyhow::Result<()> {
    let keep_alive: fn(TlsConnector) -> TlsClient = |c| tls_client(c, IDLE_KEEP_ALIVE);
    let clients = [
        ("keep-alive", keep_alive),
        ("fresh handshake", fresh_tls_client),
    ];
    for (what, client) in clients {
        let (acceptor, connector) = mtls()?;
        let server = CuttingServer::start(Speaks::Http1Tls(acceptor)).await?;
        let client = client(connector);
        let sample = e2e::traffic::get(&client, "https", "cut", server.addr, Instant::now()).await;
        lost_once(
            &format!("http1 over mTLS, {what}"),
            &sample.outcome,
            &server,
        )?;
    }
    Ok(())
}

#[tokio::test]
async fn the_ingress_reports_a_cut_upstream_request_lost() -> anyhow::Result<()> {
    let backend = CuttingServer::start(Speaks::Http1).await?;
    let feed = EndpointFeed::manual(vec![backend.addr], Duration::ZERO);
    let ingress = LaggingIngress::start(feed.receiver()).await?;
    let sample = one_request(Kind::Http1KeepAlive, ingress.addr()).await?;
    eprintln!("through the ingress: {}", sample.outcome);
    // The ingress's upstream client saw the cut and said so in its 502.
    match &sample.outcome {
        Outcome::Status { code: 502, detail } => ensure!(
            detail.contains("x-ingress-error: closed_before_response"),
            "{detail}"
        ),
        o => anyhow::bail!("expected the ingress's 502, got {o:?}"),
    }
    ensure!(
        backend.counts() == (1, 1),
        "the backend saw (requests, connections) {:?}, not (1, 1): a resend",
        backend.counts()
    );
    ensure!(
        ingress.stats().errors.get("closed_before_response") == Some(&1),
        "{:?}",
        ingress.stats()
    );
    Ok(())
}

/// Connection reuse after a close: a request sent on a pooled keep-alive
/// connection that the server reset while it sat idle. A server double on
/// its own thread answers one request keep-alive, then resets that
/// connection while the test holds its runtime's only thread, so the
/// client's connection task sees the reset only once the next request is
/// on it. That request must be reported lost (hyper 1.x writes it and hits
/// the reset; were it still queued, it would be `not_sent`), and the
/// server must see it on no other connection.
#[tokio::test(flavor = "current_thread")]
async fn a_request_on_a_reset_keep_alive_connection_is_lost_not_resent() -> anyhow::Result<()> {
    const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let (reset, reset_rx) = std::sync::mpsc::channel::<()>();
    let (was_reset_tx, was_reset) = std::sync::mpsc::channel::<()>();
    // Requests read on each of the two connections it takes.
    let server = std::thread::spawn(move || -> std::io::Result<Vec<usize>> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async move {
            let listener = TcpListener::from_std(listener)?;
            let (mut first, _) = listener.accept().await?;
            let mut per_connection = vec![usize::from(read_head(&mut first).await)];
            first.write_all(OK).await?;
            let _ = reset_rx.recv();
            first.set_zero_linger()?;
            drop(first);
            let _ = was_reset_tx.send(());
            // A resend, or the test's own connection that ends this thread.
            let (mut next, _) = listener.accept().await?;
            let resent = read_head(&mut next).await;
            if resent {
                next.write_all(OK).await?;
            }
            per_connection.push(usize::from(resent));
            Ok(per_connection)
        })
    });
    let client = e2e::traffic::http1_client();
    let epoch = Instant::now();
    let first = e2e::traffic::get(&client, "http", "double", addr, epoch).await;
    ensure!(first.outcome.is_ok(), "first request: {}", first.outcome);
    // The client returns the connection to its pool in a task of its own,
    // woken when the response ended: let it run.
    tokio::task::yield_now().await;
    reset.send(())?;
    // Blocks the runtime's only thread on purpose: the RST arrives while
    // the client's connection task cannot run.
    was_reset.recv()?;
    let second = e2e::traffic::get(&client, "http", "double", addr, epoch).await;
    // Ends the server's wait for a resend (closed at once: no request).
    drop(std::net::TcpStream::connect(addr));
    let per_connection = tokio::task::spawn_blocking(move || server.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the server double panicked"))??;
    eprintln!("second request: {}", second.outcome);
    ensure!(
        second.outcome.in_flight_cut() || second.outcome.unprocessed(),
        "expected the request lost to the reset, got {:?}",
        second.outcome
    );
    ensure!(
        per_connection == [1, 0],
        "requests per connection {per_connection:?}: the second request was resent"
    );
    Ok(())
}
