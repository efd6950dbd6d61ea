//! The test workload: an HTTP server that refuses connections until it has
//! started, takes a little time per request, and on SIGTERM finishes its
//! in-flight requests before exiting — calling an upstream during its own
//! shutdown (through the sidecar's outbound listener) when told to. With
//! `--exit-after` it also stops on its own, exit 0, as a Job's work does.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use clap::Parser;
use tokio::signal::unix::{SignalKind, signal};

#[derive(Parser, Debug)]
struct Args {
    /// Port to serve on (127.0.0.1).
    #[arg(long)]
    port: u16,
    /// Address to listen on: all of the pod's by default (a Service may
    /// target the app directly, as it would without a sidecar); tests that
    /// run it on the host pass 127.0.0.1.
    #[arg(long, default_value = "0.0.0.0")]
    address: std::net::IpAddr,
    /// Time before the port is opened (connections are refused until then).
    #[arg(long, value_parser = remora_contract::duration::parse, default_value = "0s")]
    startup_delay: Duration,
    /// Time each request takes.
    #[arg(long, value_parser = remora_contract::duration::parse, default_value = "10ms")]
    delay: Duration,
    /// URL called once during shutdown (e.g. through the sidecar's outbound listener).
    #[arg(long)]
    shutdown_call: Option<String>,
    /// URL called once at startup, before the port opens (an app fetching its
    /// config through the sidecar: fails when the app starts before Envoy).
    #[arg(long)]
    startup_call: Option<String>,
    /// After SIGTERM, keep serving this long before closing the listener (what a
    /// well-behaved app does so that endpoint removal can catch up).
    #[arg(long, value_parser = remora_contract::duration::parse, default_value = "0s")]
    shutdown_delay: Duration,
    /// Exit 0 on its own this long after the port opens, as on SIGTERM (a
    /// Job's work done); unset: serve until SIGTERM.
    #[arg(long, value_parser = remora_contract::duration::parse)]
    exit_after: Option<Duration>,
}

/// One call to `url`; logs a line the pod runner's reports parse
/// (`test-app: <what> call <url>: <status>` or `... failed: <error>`).
async fn call(what: &str, url: &str) {
    let client = remora_agent::http_client::HttpClient::new(Duration::from_secs(2));
    match client.get(url).await {
        Ok(r) if r.status == 200 => eprintln!("test-app: {what} call {url}: {}", r.status),
        Ok(r) => eprintln!("test-app: {what} call {url} failed: status {}", r.status),
        Err(e) => eprintln!("test-app: {what} call {url} failed: {e}"),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut term = signal(SignalKind::terminate())?;
    if let Some(url) = &args.startup_call {
        call("startup", url).await;
    }
    tokio::select! {
        _ = tokio::time::sleep(args.startup_delay) => {}
        _ = term.recv() => return Ok(()),
    }
    let served = Arc::new(AtomicU64::new(0));
    let delay = args.delay;
    let counter = served.clone();
    let app = Router::new().route(
        "/",
        get(move || {
            let counter = counter.clone();
            async move {
                tokio::time::sleep(delay).await;
                format!("ok {}\n", counter.fetch_add(1, Ordering::SeqCst) + 1)
            }
        }),
    );
    let listener =
        tokio::net::TcpListener::bind(SocketAddr::from((args.address, args.port))).await?;
    let shutdown_call = args.shutdown_call.clone();
    let shutdown_delay = args.shutdown_delay;
    let exit_after = args.exit_after;
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            match exit_after {
                Some(after) => tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::time::sleep(after) => eprintln!("test-app: exit-after {after:?} elapsed"),
                },
                None => {
                    let _ = term.recv().await;
                }
            }
            // Still serving here: the call and the delay run before the listener closes.
            let keep_serving = tokio::time::sleep(shutdown_delay);
            if let Some(url) = shutdown_call {
                call("shutdown", &url).await;
            }
            keep_serving.await;
        })
        .await?;
    eprintln!(
        "test-app: served {} requests, exiting",
        served.load(Ordering::SeqCst)
    );
    Ok(())
}
