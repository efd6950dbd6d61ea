//! The test workload: an HTTP server that refuses connections until it has
//! started, takes a little time per request, and on SIGTERM finishes its
//! in-flight requests before exiting — calling an upstream during its own
//! shutdown (through the sidecar's outbound listener) when told to. With
//! `--exit-after` it also stops on its own, exit 0, as a Job's work does.
//!
//! One port serves HTTP/1.1 and h2c (HTTP/2 with prior knowledge), the way
//! the benchmark's clients arrive (`e2e::traffic`):
//! - `GET /`: `ok N` after `--delay`;
//! - `POST /echo`: the request body back, after `--delay`;
//! - `GET /slow?ms=N`: answers after N ms (a request still in flight when
//!   SIGTERM comes; shutdown waits for it);
//! - gRPC `grpc.health.v1.Health` (tonic-health): unary `Check` and the
//!   server-streaming `Watch`. When shutdown starts every `Watch` stream ends
//!   cleanly (grpc-status 0), as a well-behaved server ends its endless
//!   streams; otherwise the app could never finish its in-flight work.
//!
//! Every response carries `x-pod` (`$HOSTNAME`: the pod's name), so a client
//! can tell which replica answered. With `--outbound-every` the app also
//! calls `--outbound-url` periodically until it exits, plus one final call
//! once its in-flight work is done (a final flush).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::Query;
use axum::http::{HeaderValue, Response};
use axum::routing::{get, post};
use clap::Parser;
use futures::{Stream, StreamExt as _};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tonic_health::server::{HealthReporter, HealthService};

#[derive(Parser, Debug)]
struct Args {
    /// Port to serve on (HTTP/1.1, h2c and gRPC).
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
    /// Time each `GET /` and `POST /echo` takes.
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
    /// Call `--outbound-url` this often from the moment the port opens until
    /// the app exits (through its drain too), then once more when in-flight
    /// work is done. Each call is a fresh connection, so no client retry can
    /// hide a failure; failures are logged one by one, successes counted.
    #[arg(long, value_parser = remora_contract::duration::parse, requires = "outbound_url")]
    outbound_every: Option<Duration>,
    /// The URL of `--outbound-every`.
    #[arg(long, requires = "outbound_every")]
    outbound_url: Option<String>,
}

/// One call to `url`; logs a line the node tests read from the app's log
/// (`test-app: <what> call <url>: <status>` or `... failed: <error>`), the
/// success line only when `log_ok`. Returns whether it got a 200.
async fn call(what: &str, url: &str, log_ok: bool) -> bool {
    let client = remora_agent::http_client::HttpClient::new(Duration::from_secs(2));
    match client.get(url).await {
        Ok(r) if r.status == 200 => {
            if log_ok {
                eprintln!("test-app: {what} call {url}: {}", r.status);
            }
            true
        }
        Ok(r) => {
            eprintln!("test-app: {what} call {url} failed: status {}", r.status);
            false
        }
        Err(e) => {
            eprintln!("test-app: {what} call {url} failed: {e}");
            false
        }
    }
}

/// `--outbound-every`: calls `url` every `every` until `stop` turns true;
/// returns (ok, failed).
async fn call_periodically(
    url: String,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) -> (u64, u64) {
    let (mut ok, mut failed) = (0, 0);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return (ok, failed),
        }
        if call("outbound", &url, false).await {
            ok += 1;
        } else {
            failed += 1;
        }
    }
}

/// tonic-health's service, whose `Watch` streams end cleanly once
/// `shutdown` turns true (tonic-health's own never end while the app lives).
struct EndingHealth {
    inner: HealthService,
    shutdown: watch::Receiver<bool>,
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl Health for EndingHealth {
    async fn check(
        &self,
        request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<HealthCheckResponse>, tonic::Status> {
        self.inner.check(request).await
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<WatchStream>, tonic::Status> {
        let stream = self.inner.watch(request).await?.into_inner();
        let mut shutdown = self.shutdown.clone();
        let end = async move {
            let _ = shutdown.wait_for(|s| *s).await;
        };
        Ok(tonic::Response::new(Box::pin(stream.take_until(end))))
    }
}

#[derive(serde::Deserialize)]
struct Slow {
    ms: u64,
}

fn app(delay: Duration, served: Arc<AtomicU64>, health: HealthServer<EndingHealth>) -> Router {
    let pod = std::env::var("HOSTNAME")
        .ok()
        .and_then(|h| HeaderValue::from_str(&h).ok());
    let (root, echo, slow) = (served.clone(), served.clone(), served);
    Router::new()
        .route(
            "/",
            get(move || async move {
                tokio::time::sleep(delay).await;
                format!("ok {}\n", root.fetch_add(1, Ordering::SeqCst) + 1)
            }),
        )
        .route(
            "/echo",
            post(move |body: Bytes| async move {
                tokio::time::sleep(delay).await;
                echo.fetch_add(1, Ordering::SeqCst);
                body
            }),
        )
        .route(
            "/slow",
            get(move |Query(q): Query<Slow>| async move {
                tokio::time::sleep(Duration::from_millis(q.ms)).await;
                slow.fetch_add(1, Ordering::SeqCst);
                format!("slow {}\n", q.ms)
            }),
        )
        // tonic's generated server routes by path; its requests come as h2c.
        .route_service(&format!("/{}/{{*rest}}", "grpc.health.v1.Health"), health)
        .layer(axum::middleware::map_response(
            move |mut resp: Response<axum::body::Body>| {
                let pod = pod.clone();
                async move {
                    if let Some(pod) = pod {
                        resp.headers_mut().insert("x-pod", pod);
                    }
                    resp
                }
            },
        ))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut term = signal(SignalKind::terminate())?;
    if let Some(url) = &args.startup_call {
        call("startup", url, true).await;
    }
    tokio::select! {
        _ = tokio::time::sleep(args.startup_delay) => {}
        _ = term.recv() => return Ok(()),
    }
    let served = Arc::new(AtomicU64::new(0));
    // true once shutdown starts (ends Watch streams); the outbound caller
    // has its own, set when in-flight work is done.
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let (done_tx, done_rx) = watch::channel(false);
    let health = HealthServer::new(EndingHealth {
        inner: HealthService::from_health_reporter(HealthReporter::new()),
        shutdown: shutdown_rx,
    });
    let listener =
        tokio::net::TcpListener::bind(SocketAddr::from((args.address, args.port))).await?;
    // Who started us can tell our listener from anything else on the port.
    eprintln!("test-app: listening on {}", listener.local_addr()?);
    let outbound = match (args.outbound_every, args.outbound_url.clone()) {
        (Some(every), Some(url)) => Some(tokio::spawn(call_periodically(url, every, done_rx))),
        _ => None,
    };
    let shutdown_call = args.shutdown_call.clone();
    let shutdown_delay = args.shutdown_delay;
    let exit_after = args.exit_after;
    // HTTP/1.1 and h2c: axum serves both (hyper-util's auto builder).
    axum::serve(listener, app(args.delay, served.clone(), health))
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
                call("shutdown", &url, true).await;
            }
            keep_serving.await;
            let _ = shutdown_tx.send(true);
        })
        .await?;
    if let (Some(task), Some(url)) = (outbound, &args.outbound_url) {
        let _ = done_tx.send(true);
        let (ok, failed) = task.await.unwrap_or_default();
        // In-flight work is done: the last word goes out now.
        let last = call("final", url, true).await;
        eprintln!(
            "test-app: outbound calls: {ok} ok, {failed} failed; final call {}",
            if last { "ok" } else { "failed" }
        );
    }
    eprintln!(
        "test-app: served {} requests, exiting",
        served.load(Ordering::SeqCst)
    );
    Ok(())
}
