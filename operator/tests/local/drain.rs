//! The webhook server's shutdown: stop accepting, finish in-flight
//! requests, cut off what outlives the grace period.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use remora_operator::webhook::server::{Drained, serve_tls_draining};
use remora_operator::webhook::tls::ReloadingCert;
use remora_test_support::pki::self_signed;
use remora_test_support::wait::wait_until;
use remora_test_support::webhook_client::connect;
use tokio_util::sync::CancellationToken;

struct Running {
    addr: std::net::SocketAddr,
    ca: String,
    stop: CancellationToken,
    done: tokio::task::JoinHandle<Result<Drained, remora_operator::webhook::server::ServerError>>,
    _dir: tempfile::TempDir,
}

/// A server whose `/slow` answers when `release` is notified (never, if
/// nobody does), and tells `entered` when a request is inside it.
async fn start(
    grace: Duration,
    entered: Arc<tokio::sync::Notify>,
    release: Arc<tokio::sync::Notify>,
) -> anyhow::Result<Running> {
    let dir = tempfile::tempdir()?;
    let serving = self_signed(&["localhost"]);
    let (cert, key) = serving.write_pem(dir.path(), "tls.crt", "tls.key")?;
    let cert = ReloadingCert::load(cert, key)?;
    let tls = Arc::new(cert.server_config()?);
    let app = Router::new()
        .route("/fast", get(|| async { "fast" }))
        .route(
            "/slow",
            get(move || {
                let (entered, release) = (Arc::clone(&entered), Arc::clone(&release));
                async move {
                    entered.notify_one();
                    release.notified().await;
                    "slow"
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop = CancellationToken::new();
    let done = tokio::spawn(serve_tls_draining(
        listener,
        tls,
        app,
        stop.clone().cancelled_owned(),
        grace,
    ));
    Ok(Running {
        addr,
        ca: serving.chain,
        stop,
        done,
        _dir: dir,
    })
}

#[tokio::test]
async fn in_flight_requests_finish_and_new_connections_are_refused() -> anyhow::Result<()> {
    let entered = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let mut s = start(
        Duration::from_secs(30),
        Arc::clone(&entered),
        Arc::clone(&release),
    )
    .await?;
    // An idle keep-alive connection, and one with a request in flight.
    let mut idle = connect(s.addr, "localhost", &s.ca).await?;
    let (status, _) = idle.request(http::Method::GET, "/fast", vec![]).await?;
    assert_eq!(status.as_u16(), 200);
    let mut busy = connect(s.addr, "localhost", &s.ca).await?;
    let in_flight =
        tokio::spawn(async move { busy.request(http::Method::GET, "/slow", vec![]).await });
    entered.notified().await;

    s.stop.cancel();
    // Not accepting any more (the listener is closed).
    wait_until(
        Duration::from_secs(10),
        "no more accepting after shutdown",
        || async { connect(s.addr, "localhost", &s.ca).await.is_err() },
    )
    .await?;
    assert!(!s.done.is_finished(), "returned with a request in flight");

    release.notify_one();
    let (status, body) = in_flight.await??;
    assert_eq!(
        (status.as_u16(), body.as_slice()),
        (200, b"slow".as_slice())
    );
    let drained = tokio::time::timeout(Duration::from_secs(10), &mut s.done).await???;
    assert_eq!(drained, Drained { forced: 0 });
    Ok(())
}

#[tokio::test]
async fn requests_outliving_the_grace_are_cut_off() -> anyhow::Result<()> {
    let entered = Arc::new(tokio::sync::Notify::new());
    let never = Arc::new(tokio::sync::Notify::new());
    let mut s = start(Duration::from_millis(200), Arc::clone(&entered), never).await?;
    let mut busy = connect(s.addr, "localhost", &s.ca).await?;
    let in_flight =
        tokio::spawn(async move { busy.request(http::Method::GET, "/slow", vec![]).await });
    entered.notified().await;
    s.stop.cancel();
    let drained = tokio::time::timeout(Duration::from_secs(10), &mut s.done).await???;
    assert_eq!(drained, Drained { forced: 1 });
    assert!(
        in_flight.await?.is_err(),
        "the cut-off request cannot succeed"
    );
    Ok(())
}
