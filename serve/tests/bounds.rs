//! The limits of a bounded server, against real sockets on loopback.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use axum::Router;
use axum::body::Body;
use axum::http::StatusCode;
use axum::routing::{get, post};
use remora_serve::{Limits, Server};
use remora_test_support::wait::wait_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(10);

struct Running {
    addr: std::net::SocketAddr,
    server: Server,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<remora_serve::Drained, remora_serve::ServeError>>,
}

async fn start(limits: Limits, app: Router) -> Result<Running> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = Server::new("test", limits)?;
    let stop = CancellationToken::new();
    let task = tokio::spawn(
        server
            .clone()
            .serve(listener, app, stop.clone().cancelled_owned()),
    );
    Ok(Running {
        addr,
        server,
        stop,
        task,
    })
}

fn probe_app() -> Router {
    Router::new().route("/healthz", get(|| async { "ok" }))
}

/// One request on a fresh connection; the status and how long it took.
async fn get_once(addr: std::net::SocketAddr, path: &str) -> Result<(u16, Duration)> {
    let t = Instant::now();
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut out = Vec::new();
    tokio::time::timeout(DEADLINE, s.read_to_end(&mut out))
        .await
        .context("response timed out")??;
    Ok((status_of(&out)?, t.elapsed()))
}

fn status_of(response: &[u8]) -> Result<u16> {
    let text = String::from_utf8_lossy(response);
    let code = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .with_context(|| format!("not an HTTP response: {text:?}"))?;
    Ok(code.parse()?)
}

/// Reads until the server closes; what it sent.
async fn read_until_closed(s: &mut TcpStream) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    tokio::time::timeout(DEADLINE, s.read_to_end(&mut out))
        .await
        .context("the server never closed the connection")?
        .or_else(|e| {
            // A reset is a close too.
            if e.kind() == std::io::ErrorKind::ConnectionReset {
                Ok(0)
            } else {
                Err(e)
            }
        })?;
    Ok(out)
}

#[tokio::test]
async fn a_slow_loris_flood_does_not_lock_out_probes() -> Result<()> {
    let limits = Limits {
        max_connections: 32,
        header_read_timeout: Duration::from_secs(60),
        ..Limits::default()
    };
    let srv = start(limits, probe_app()).await?;
    // 300 connections from another client (127.0.0.2), each starting a
    // head and never finishing it.
    let mut loris = Vec::new();
    for _ in 0..300 {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind("127.0.0.2:0".parse()?)?;
        let mut s = socket.connect(srv.addr).await?;
        s.write_all(b"GET /healthz HTTP/1.1\r\nx-slow: ").await?;
        loris.push(s);
    }
    let m = srv.server.metrics().clone();
    // Younger than `evict_after`, the flood's own connections are not
    // evicted for its newcomers: those are parked.
    wait_until(DEADLINE, "every loris connection accepted", || async {
        (m.evicted_total() + m.parked_total() >= 300 - 32).then_some(())
    })
    .await?;
    assert!(m.open_now() <= 32, "open: {}", m.open_now());
    // The probe still gets through, on a fresh connection, every time.
    for _ in 0..20 {
        let (status, _) = get_once(srv.addr, "/healthz").await?;
        assert_eq!(status, 200);
    }
    assert!(m.open_now() <= 32, "open: {}", m.open_now());
    Ok(())
}

#[tokio::test]
async fn an_unfinished_head_is_closed_at_the_header_timeout() -> Result<()> {
    let limits = Limits {
        header_read_timeout: Duration::from_millis(300),
        ..Limits::default()
    };
    let srv = start(limits, probe_app()).await?;
    let t = Instant::now();
    let mut s = TcpStream::connect(srv.addr).await?;
    s.write_all(b"GET /healthz HTTP/1.1\r\nx-slow: a").await?;
    read_until_closed(&mut s).await?;
    let took = t.elapsed();
    assert!(took >= Duration::from_millis(300), "closed after {took:?}");
    // An idle keep-alive connection is closed the same way.
    let mut s = TcpStream::connect(srv.addr).await?;
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await?;
    let out = read_until_closed(&mut s).await?;
    assert_eq!(status_of(&out)?, 200);
    Ok(())
}

#[tokio::test]
async fn an_oversized_head_is_refused() -> Result<()> {
    let srv = start(Limits::default(), probe_app()).await?;
    let mut s = TcpStream::connect(srv.addr).await?;
    let big = "a".repeat(64 * 1024);
    s.write_all(format!("GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: {big}\r\n\r\n").as_bytes())
        .await
        .ok(); // The server may close before taking it all.
    let out = read_until_closed(&mut s).await?;
    assert_eq!(status_of(&out)?, 431);
    Ok(())
}

/// A route that holds its request until released.
fn held_app(release: Arc<Notify>, entered: Arc<tokio::sync::Semaphore>) -> Router {
    probe_app().route(
        "/hold",
        get(move || {
            let release = Arc::clone(&release);
            let entered = Arc::clone(&entered);
            async move {
                entered.add_permits(1);
                release.notified().await;
                "released"
            }
        }),
    )
}

#[tokio::test]
async fn requests_over_the_in_flight_cap_get_a_fast_503() -> Result<()> {
    let release = Arc::new(Notify::new());
    let entered = Arc::new(tokio::sync::Semaphore::new(0));
    let limits = Limits {
        max_in_flight: 2,
        ..Limits::default()
    };
    let srv = start(limits, held_app(Arc::clone(&release), Arc::clone(&entered))).await?;
    let held: Vec<_> = (0..2)
        .map(|_| tokio::spawn(get_once(srv.addr, "/hold")))
        .collect();
    let _two = entered.acquire_many(2).await?;
    let (status, _) = get_once(srv.addr, "/healthz").await?;
    assert_eq!(status, 503);
    assert_eq!(srv.server.metrics().shed_total(), 1);
    release.notify_waiters();
    for h in held {
        assert_eq!(h.await??.0, 200);
    }
    let (status, _) = get_once(srv.addr, "/healthz").await?;
    assert_eq!(status, 200);
    Ok(())
}

#[tokio::test]
async fn a_new_connection_waits_while_every_open_one_is_busy_then_is_served() -> Result<()> {
    let release = Arc::new(Notify::new());
    let entered = Arc::new(tokio::sync::Semaphore::new(0));
    let limits = Limits {
        max_connections: 2,
        ..Limits::default()
    };
    let srv = start(limits, held_app(Arc::clone(&release), Arc::clone(&entered))).await?;
    let held: Vec<_> = (0..2)
        .map(|_| tokio::spawn(get_once(srv.addr, "/hold")))
        .collect();
    let _two = entered.acquire_many(2).await?;
    let waiting = tokio::spawn(get_once(srv.addr, "/healthz"));
    let m = srv.server.metrics().clone();
    wait_until(DEADLINE, "the third connection parked", || async {
        (m.parked_total() == 1).then_some(())
    })
    .await?;
    assert!(!waiting.is_finished(), "a parked connection is not read");
    release.notify_waiters();
    for h in held {
        assert_eq!(h.await??.0, 200);
    }
    // A closing connection's place goes to the parked one.
    assert_eq!(waiting.await??.0, 200);
    assert_eq!(m.refused_total(), 0);
    Ok(())
}

#[tokio::test]
async fn a_parked_connection_is_closed_unserved_at_its_deadline() -> Result<()> {
    let release = Arc::new(Notify::new());
    let entered = Arc::new(tokio::sync::Semaphore::new(0));
    let limits = Limits {
        max_connections: 1,
        header_read_timeout: Duration::from_millis(300),
        ..Limits::default()
    };
    let srv = start(limits, held_app(Arc::clone(&release), Arc::clone(&entered))).await?;
    let held = tokio::spawn(get_once(srv.addr, "/hold"));
    let _one = entered.acquire_many(1).await?;
    let mut s = TcpStream::connect(srv.addr).await?;
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await?;
    let t = Instant::now();
    let out = read_until_closed(&mut s).await?;
    assert!(out.is_empty(), "closed unserved: {out:?}");
    assert!(t.elapsed() < DEADLINE);
    let m = srv.server.metrics();
    assert_eq!((m.parked_total(), m.refused_total()), (1, 1));
    release.notify_waiters();
    assert_eq!(held.await??.0, 200);
    Ok(())
}

/// `n` clients from 127.0.0.2, each starting a head it never finishes and
/// reconnecting the moment it is closed, for `run`: how many connections
/// they opened in all.
async fn reconnecting_flood(
    addr: std::net::SocketAddr,
    n: usize,
    run: Duration,
    first_bytes: &'static [u8],
) -> Result<u64> {
    let opened = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stop = CancellationToken::new();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..n {
        let opened = Arc::clone(&opened);
        let stop = stop.clone();
        set.spawn(async move {
            while !stop.is_cancelled() {
                let socket = tokio::net::TcpSocket::new_v4()?;
                socket.bind("127.0.0.2:0".parse()?)?;
                let Ok(mut s) = socket.connect(addr).await else {
                    tokio::task::yield_now().await;
                    continue;
                };
                opened.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let _ = s.write_all(first_bytes).await;
                let mut buf = [0u8; 256];
                tokio::select! {
                    () = stop.cancelled() => {}
                    _ = s.read(&mut buf) => {}
                }
            }
            anyhow::Ok(())
        });
    }
    tokio::time::sleep(run).await;
    stop.cancel();
    while let Some(r) = set.join_next().await {
        r??;
    }
    Ok(opened.load(std::sync::atomic::Ordering::Relaxed))
}

#[tokio::test]
async fn a_reconnecting_flood_gets_places_only_as_fast_as_they_free_up() -> Result<()> {
    let limits = Limits {
        max_connections: 8,
        ..Limits::default()
    };
    let srv = start(limits, probe_app()).await?;
    let run = Duration::from_secs(2);
    let t = Instant::now();
    let opened =
        reconnecting_flood(srv.addr, 64, run, b"GET /healthz HTTP/1.1\r\nx-slow: ").await?;
    // Each place is taken from the flood at most once per `evict_after`
    // (1 s); nothing reaches its 5 s header timeout. Evicting at once,
    // as before, let it reconnect as fast as the loop could accept.
    let secs = t.elapsed().as_secs() + 2;
    let bound = 64 + 8 * secs;
    assert!(
        opened <= bound,
        "{opened} connections opened, at most {bound} expected"
    );
    let m = srv.server.metrics();
    assert!(m.parked_total() > 0);
    assert_eq!(get_once(srv.addr, "/healthz").await?.0, 200);
    Ok(())
}

#[tokio::test]
async fn a_failed_tls_handshake_keeps_its_place_until_the_handshake_deadline() -> Result<()> {
    let leaf = remora_test_support::pki::self_signed(&["localhost"]);
    let tls = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(vec![leaf.der.clone()], leaf.private_key())?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = Server::new(
        "tls",
        Limits {
            max_connections: 8,
            tls_handshake_timeout: Duration::from_secs(30),
            ..Limits::default()
        },
    )?
    .with_tls(Arc::new(tls));
    let stop = CancellationToken::new();
    tokio::spawn(
        server
            .clone()
            .serve(listener, probe_app(), stop.clone().cancelled_owned()),
    );
    // Plain HTTP at a TLS port fails the handshake at its first byte.
    let opened =
        reconnecting_flood(addr, 16, Duration::from_secs(2), b"GET / HTTP/1.1\r\n\r\n").await?;
    // 8 held to the deadline, at most 8 per second evicted by their own
    // source; closed at once, as before, they came back thousands of times.
    assert!(opened <= 16 + 8 * 4, "{opened} connections opened");
    stop.cancel();
    Ok(())
}
#[tokio::test]
async fn a_body_that_trickles_past_its_deadline_fails_the_read() -> Result<()> {
    let app = Router::new().route(
        "/upload",
        post(|body: Body| async move {
            match axum::body::to_bytes(body, 1 << 20).await {
                Ok(b) => (StatusCode::OK, format!("{} bytes", b.len())),
                Err(e) => (StatusCode::REQUEST_TIMEOUT, format!("body: {e}")),
            }
        }),
    );
    let limits = Limits {
        body_read_timeout: Duration::from_millis(300),
        ..Limits::default()
    };
    let srv = start(limits, app).await?;
    let mut s = TcpStream::connect(srv.addr).await?;
    s.write_all(b"POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\nabc")
        .await?;
    let out = read_until_closed(&mut s).await?;
    assert_eq!(status_of(&out)?, 408, "{}", String::from_utf8_lossy(&out));
    Ok(())
}

#[tokio::test]
async fn shutdown_lets_the_request_in_progress_finish() -> Result<()> {
    let release = Arc::new(Notify::new());
    let entered = Arc::new(tokio::sync::Semaphore::new(0));
    let srv = start(
        Limits::default(),
        held_app(Arc::clone(&release), Arc::clone(&entered)),
    )
    .await?;
    let held = tokio::spawn(get_once(srv.addr, "/hold"));
    let _one = entered.acquire().await?;
    srv.stop.cancel();
    // Not accepting any more.
    wait_until(DEADLINE, "the listener to close", || async {
        TcpStream::connect(srv.addr).await.is_err().then_some(())
    })
    .await?;
    release.notify_waiters();
    assert_eq!(held.await??.0, 200);
    let drained = srv.task.await??;
    assert_eq!(drained.forced, 0);
    Ok(())
}

/// One keep-alive `GET /healthz` on `s`; the response's head.
async fn get_keep_alive(s: &mut TcpStream) -> Result<String> {
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await?;
    let mut out = Vec::new();
    let mut buf = [0u8; 1024];
    tokio::time::timeout(DEADLINE, async {
        // The body is "ok": the response is whole once it ends so.
        while !(out.ends_with(b"\r\n\r\nok")) {
            let n = s.read(&mut buf).await?;
            anyhow::ensure!(
                n > 0,
                "closed mid-response: {:?}",
                String::from_utf8_lossy(&out)
            );
            out.extend_from_slice(&buf[..n]);
        }
        Ok(())
    })
    .await
    .context("response timed out")??;
    Ok(String::from_utf8_lossy(&out).to_lowercase())
}

#[tokio::test]
async fn a_draining_server_answers_on_idle_keep_alive_connections_then_closes_them() -> Result<()> {
    let linger = Duration::from_secs(2);
    let srv = start(
        Limits {
            drain_linger: linger,
            ..Limits::default()
        },
        probe_app(),
    )
    .await?;
    // Two keep-alive connections, each idle after one request, as an API
    // server's pool holds them.
    let mut used = TcpStream::connect(srv.addr).await?;
    let mut idle = TcpStream::connect(srv.addr).await?;
    for s in [&mut used, &mut idle] {
        let head = get_keep_alive(s).await?;
        assert!(
            head.starts_with("http/1.1 200") && !head.contains("connection: close"),
            "{head}"
        );
    }
    let stopped = Instant::now();
    srv.stop.cancel();
    wait_until(DEADLINE, "the listener to close", || async {
        TcpStream::connect(srv.addr).await.is_err().then_some(())
    })
    .await?;
    // A request on an idle connection well into the drain (not in the same
    // instant, when any server would still read it) is answered, and the
    // answer tells the client not to reuse the connection.
    tokio::time::sleep_until((stopped + Duration::from_millis(500)).into()).await;
    let head = get_keep_alive(&mut used).await?;
    assert!(
        head.starts_with("http/1.1 200") && head.contains("connection: close"),
        "{head}"
    );
    assert!(read_until_closed(&mut used).await?.is_empty());
    // The connection nobody used is closed once the linger is over.
    assert!(read_until_closed(&mut idle).await?.is_empty());
    assert!(stopped.elapsed() >= linger, "{:?}", stopped.elapsed());
    assert_eq!(srv.task.await??.forced, 0);
    Ok(())
}

#[test]
fn limits_that_would_refuse_everything_are_rejected() {
    for bad in [
        Limits {
            max_connections: 0,
            ..Limits::default()
        },
        Limits {
            max_in_flight: 0,
            ..Limits::default()
        },
        Limits {
            max_header_bytes: 100,
            ..Limits::default()
        },
        Limits {
            header_read_timeout: Duration::ZERO,
            ..Limits::default()
        },
        Limits {
            drain_linger: Duration::from_secs(10),
            drain_grace: Duration::from_secs(5),
            ..Limits::default()
        },
    ] {
        assert!(Server::new("bad", bad).is_err());
    }
}

#[tokio::test]
async fn the_listen_queue_holds_a_burst_far_larger_than_128() -> Result<()> {
    // The kernel caps the backlog at somaxconn (4096 on current kernels).
    let somaxconn: usize = std::fs::read_to_string("/proc/sys/net/core/somaxconn")?
        .trim()
        .parse()?;
    let burst = somaxconn.min(remora_serve::LISTEN_BACKLOG as usize) / 2;
    anyhow::ensure!(burst > 128, "somaxconn {somaxconn} leaves no room to test");
    let listener = remora_serve::bind("127.0.0.1:0".parse()?)?;
    let addr = listener.local_addr()?;
    // Nothing accepts: every connect completes in the kernel's queue or
    // not at all (a SYN dropped on a full queue is retried after 1 s).
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..burst {
        set.spawn(async move {
            tokio::time::timeout(Duration::from_millis(900), TcpStream::connect(addr)).await
        });
    }
    let mut held = Vec::new();
    while let Some(r) = set.join_next().await {
        held.push(r?.context("a connect waited for a SYN retransmission")??);
    }
    assert_eq!(held.len(), burst);
    drop(listener);
    Ok(())
}

/// A handler sees the client's address (what the webhook bounds per client).
#[tokio::test]
async fn a_handler_sees_the_client_address() -> Result<()> {
    use axum::extract::ConnectInfo;
    let app =
        Router::new().route(
            "/who",
            get(
                |ConnectInfo(peer): ConnectInfo<std::net::SocketAddr>| async move {
                    peer.ip().to_string()
                },
            ),
        );
    let running = start(Limits::default(), app).await?;
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind("127.0.0.7:0".parse()?)?;
    let mut s = socket.connect(running.addr).await?;
    s.write_all(b"GET /who HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await?;
    let out = read_until_closed(&mut s).await?;
    let text = String::from_utf8_lossy(&out);
    assert_eq!(status_of(&out)?, 200, "{text}");
    assert!(text.ends_with("127.0.0.7"), "{text}");
    running.stop.cancel();
    Ok(())
}
