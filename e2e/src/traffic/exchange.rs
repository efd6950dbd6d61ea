//! One request (or gRPC stream) on a client of [`super::clients`], and how
//! it ended: the only code that reads answers into an [`Outcome`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::Connect;
use tokio::sync::watch;
use tokio::time::Instant;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use super::outcome::status_detail;
use super::{DEFAULT_TIMEOUT, Outcome, PeerCert, Sample};

/// How a request ended, who answered, which certificate the server
/// presented (over TLS) and, for a stream, when its first message came.
pub(super) struct Answer {
    pub outcome: Outcome,
    pub pod: Option<String>,
    pub peer: Option<u64>,
    pub first: Option<Duration>,
}

impl From<(Outcome, Option<String>)> for Answer {
    fn from((outcome, pod): (Outcome, Option<String>)) -> Self {
        Self {
            outcome,
            pod,
            peer: None,
            first: None,
        }
    }
}

/// One in-flight request on a load's gauge, for as long as it lives.
pub(super) struct Open<'a>(&'a AtomicUsize);

impl<'a> Open<'a> {
    pub fn new(gauge: &'a AtomicUsize) -> Self {
        gauge.fetch_add(1, Ordering::SeqCst);
        Self(gauge)
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(super) fn get_request(url: &str) -> http::Result<http::Request<Full<Bytes>>> {
    http::Request::get(url).body(Full::new(Bytes::new()))
}

fn pod_of(headers: &http::HeaderMap) -> Option<String> {
    headers
        .get("x-pod")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Sends `req`, reads the whole answer; with `echo`, the body must be
/// that many bytes.
pub(super) async fn http<C>(
    client: &Client<C, Full<Bytes>>,
    req: http::Result<http::Request<Full<Bytes>>>,
    timeout: Duration,
    echo: Option<usize>,
) -> Answer
where
    C: Connect + Clone + Send + Sync + 'static,
{
    let req = match req {
        Ok(r) => r,
        Err(e) => {
            let detail = format!("request: {e}");
            return (Outcome::Other { detail }, None).into();
        }
    };
    let exchange = async {
        let resp = match client.request(req).await {
            Ok(r) => r,
            Err(e) => return (Outcome::from_error(&e), None).into(),
        };
        let peer = resp.extensions().get::<PeerCert>().map(|p| p.0);
        let (parts, body) = resp.into_parts();
        let pod = pod_of(&parts.headers);
        let body = match body.collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return (Outcome::from_error(&e), pod).into(),
        };
        let outcome = if !parts.status.is_success() {
            Outcome::Status {
                code: parts.status.as_u16(),
                detail: status_detail(&parts.headers, &body),
            }
        } else if echo.is_some_and(|n| n != body.len()) {
            Outcome::Other {
                detail: format!("echo: {} bytes back of {}", body.len(), echo.unwrap_or(0)),
            }
        } else {
            Outcome::Ok
        };
        Answer {
            outcome,
            pod,
            peer,
            first: None,
        }
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or_else(|_| (Outcome::Timeout, None).into())
}

/// The label of a request to `scheme` on a client of this module.
pub(super) fn http1_label(scheme: &str) -> &'static str {
    if scheme == "https" {
        "http1-tls"
    } else {
        "http1"
    }
}

/// One `GET /` to `pod` at `addr` over `scheme` (within
/// [`DEFAULT_TIMEOUT`]), as a sample labelled with the client's kind
/// (`http1` or `http1-tls`); times since `epoch`. Probes use it alone, the
/// balanced loads for each request.
pub async fn get<C>(
    client: &Client<C, Full<Bytes>>,
    scheme: &str,
    pod: &str,
    addr: SocketAddr,
    epoch: Instant,
) -> Sample
where
    C: Connect + Clone + Send + Sync + 'static,
{
    let sent = Instant::now();
    let req = get_request(&format!("{scheme}://{addr}/"));
    let answer = http(client, req, DEFAULT_TIMEOUT, None).await;
    let kind = http1_label(scheme);
    Sample {
        load: Arc::from(kind),
        kind,
        at: sent.duration_since(epoch),
        latency: sent.elapsed(),
        outcome: answer.outcome,
        pod: Some(pod.to_string()),
        peer: answer.peer,
    }
}

fn grpc_pod(meta: &tonic::metadata::MetadataMap) -> Option<String> {
    meta.get("x-pod")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

pub(super) async fn grpc_unary(channel: tonic::transport::Channel, timeout: Duration) -> Answer {
    let mut client = HealthClient::new(channel);
    let call = client.check(HealthCheckRequest::default());
    match tokio::time::timeout(timeout, call).await {
        Err(_) => (Outcome::Timeout, None).into(),
        Ok(Err(status)) => (Outcome::from_grpc(&status), grpc_pod(status.metadata())).into(),
        Ok(Ok(resp)) => {
            let pod = grpc_pod(resp.metadata());
            // SERVING is 1; anything else is the app saying it cannot serve.
            let outcome = match resp.into_inner().status {
                1 => Outcome::Ok,
                s => Outcome::Other {
                    detail: format!("health status {s}"),
                },
            };
            (outcome, pod).into()
        }
    }
}

/// Opens a Watch stream, waits for its first message (within `timeout`:
/// the answer's `first`), then holds it for `hold` or until the traffic
/// stops. A stream the server ends cleanly is fine; an error is not.
pub(super) async fn grpc_stream(
    channel: tonic::transport::Channel,
    timeout: Duration,
    hold: Duration,
    mut stopped: watch::Receiver<bool>,
    open: &AtomicUsize,
) -> Answer {
    let sent = Instant::now();
    let mut client = HealthClient::new(channel);
    let opened = async {
        let resp = client.watch(HealthCheckRequest::default()).await?;
        let pod = grpc_pod(resp.metadata());
        let mut stream = resp.into_inner();
        let msg = stream.message().await?;
        Ok::<_, tonic::Status>((stream, msg, pod))
    };
    let (mut stream, pod) = match tokio::time::timeout(timeout, opened).await {
        Err(_) => return (Outcome::Timeout, None).into(),
        Ok(Err(status)) => {
            return (Outcome::from_grpc(&status), grpc_pod(status.metadata())).into();
        }
        Ok(Ok((_, None, pod))) => return (Outcome::Ok, pod).into(),
        Ok(Ok((stream, Some(_), pod))) => (stream, pod),
    };
    let first = Some(sent.elapsed());
    let _open = Open::new(open);
    let held = tokio::time::sleep(hold);
    tokio::pin!(held);
    let outcome = loop {
        tokio::select! {
            _ = &mut held => break Outcome::Ok,
            _ = stopped.wait_for(|s| *s) => break Outcome::Ok,
            msg = stream.message() => match msg {
                Ok(Some(_)) => continue,
                Ok(None) => break Outcome::Ok,
                Err(status) => break Outcome::from_grpc(&status),
            },
        }
    };
    Answer {
        outcome,
        pod,
        peer: None,
        first,
    }
}
