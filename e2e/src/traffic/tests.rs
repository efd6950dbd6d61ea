//! The classification of each way a request can end, against loopback
//! server doubles that misbehave on cue.

use std::net::SocketAddr;
use std::time::Duration;

use super::exchange::{get_request, http};
use super::*;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// A server taking one connection at a time and handing it to `then`
/// once the request's headers are in.
async fn raw_server<F, Fut>(then: F) -> SocketAddr
where
    F: Fn(TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            read_request_head(&mut s).await;
            then(s).await;
        }
    });
    addr
}

async fn get_once(addr: SocketAddr, timeout: Duration) -> Outcome {
    http(
        &http1_client(),
        get_request(&format!("http://{addr}/")),
        timeout,
        None,
    )
    .await
    .outcome
}

#[tokio::test]
async fn connection_refused() {
    let addr = TcpListener::bind("127.0.0.1:0")
        .await
        .and_then(|l| l.local_addr())
        .expect("a free port");
    assert_eq!(
        get_once(addr, DEFAULT_TIMEOUT).await,
        Outcome::ConnectRefused
    );
}

#[tokio::test]
async fn closed_after_the_request_is_an_in_flight_cut() {
    let addr = raw_server(|mut s| async move {
        let _ = s.shutdown().await;
    })
    .await;
    let o = get_once(addr, DEFAULT_TIMEOUT).await;
    assert!(matches!(o, Outcome::ClosedBeforeResponse { .. }), "{o:?}");
    assert!(o.in_flight_cut() && !o.unprocessed());
}

#[tokio::test]
async fn reset_after_the_request_is_an_in_flight_cut() {
    let addr = raw_server(|s| async move {
        // RST instead of FIN on close.
        let _ = s.set_zero_linger();
        drop(s);
    })
    .await;
    let o = get_once(addr, DEFAULT_TIMEOUT).await;
    assert!(matches!(o, Outcome::ResetInFlight { .. }), "{o:?}");
}

#[tokio::test]
async fn an_error_status_keeps_who_answered() {
    let addr = raw_server(|mut s| async move {
        let body = "no healthy upstream";
        let _ = s
            .write_all(
                format!(
                    "HTTP/1.1 503 Service Unavailable\r\nserver: envoy\r\nx-envoy-overloaded: true\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                )
                .as_bytes(),
            )
            .await;
    })
    .await;
    match get_once(addr, DEFAULT_TIMEOUT).await {
        Outcome::Status { code, detail } => {
            assert_eq!(code, 503);
            for part in [
                "server: envoy",
                "x-envoy-overloaded: true",
                "no healthy upstream",
            ] {
                assert!(detail.contains(part), "{part:?} not in {detail:?}");
            }
        }
        o => panic!("{o:?}"),
    }
}

#[tokio::test]
async fn no_answer_is_a_timeout() {
    let addr = raw_server(|s| async move {
        tokio::time::sleep(Duration::from_secs(5)).await;
        drop(s);
    })
    .await;
    assert_eq!(
        get_once(addr, Duration::from_millis(200)).await,
        Outcome::Timeout
    );
}

/// An h2c server that reads the client's preface and first HEADERS
/// frame, then writes `frame` (a hand-made frame for stream 1) and
/// keeps the connection open a while.
async fn h2_server(frame: Vec<u8>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let Ok((mut s, _)) = listener.accept().await else {
            return;
        };
        let mut preface = [0u8; 24];
        if s.read_exact(&mut preface).await.is_err() {
            return;
        }
        // Our SETTINGS (empty), and the ACK of the client's.
        let _ = s.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await;
        let _ = s.write_all(&[0, 0, 0, 4, 1, 0, 0, 0, 0]).await;
        loop {
            let mut head = [0u8; 9];
            if s.read_exact(&mut head).await.is_err() {
                return;
            }
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut payload = vec![0u8; len];
            if s.read_exact(&mut payload).await.is_err() {
                return;
            }
            if head[3] == 1 {
                break;
            }
        }
        let _ = s.write_all(&frame).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
    });
    addr
}

fn rst_stream(code: u32) -> Vec<u8> {
    let mut f = vec![0, 0, 4, 3, 0, 0, 0, 0, 1];
    f.extend_from_slice(&code.to_be_bytes());
    f
}

fn go_away(last_stream: u32, code: u32) -> Vec<u8> {
    let mut f = vec![0, 0, 8, 7, 0, 0, 0, 0, 0];
    f.extend_from_slice(&last_stream.to_be_bytes());
    f.extend_from_slice(&code.to_be_bytes());
    f
}

async fn h2_once(frame: Vec<u8>) -> Outcome {
    let addr = h2_server(frame).await;
    http(
        &h2c_client(),
        get_request(&format!("http://{addr}/")),
        DEFAULT_TIMEOUT,
        None,
    )
    .await
    .outcome
}

#[tokio::test]
async fn h2_refused_stream_is_unprocessed() {
    let o = h2_once(rst_stream(0x7)).await;
    assert!(matches!(o, Outcome::StreamRefused { .. }), "{o:?}");
    assert!(o.unprocessed());
}

#[tokio::test]
async fn h2_graceful_goaway_below_the_stream_is_unprocessed() {
    let o = h2_once(go_away(0, 0x0)).await;
    assert!(matches!(o, Outcome::StreamRefused { .. }), "{o:?}");
}

#[tokio::test]
async fn h2_reset_after_sending_may_have_been_processed() {
    // INTERNAL_ERROR, as Envoy resets a stream whose upstream died.
    let o = h2_once(rst_stream(0x2)).await;
    assert!(matches!(o, Outcome::StreamReset { .. }), "{o:?}");
    assert!(o.in_flight_cut() && !o.unprocessed());
}

#[test]
fn a_grpc_status_without_a_transport_cause_is_the_servers() {
    let o = Outcome::from_grpc(&tonic::Status::unavailable("no healthy upstream"));
    assert_eq!(
        o,
        Outcome::GrpcStatus {
            code: 14,
            message: "no healthy upstream".into()
        }
    );
}

#[test]
fn long_requests_spread_over_their_range() {
    let (min, max) = (Duration::from_secs(2), Duration::from_secs(20));
    let v: Vec<Duration> = (0..100).map(|i| spread(i, min, max)).collect();
    assert!(v.iter().all(|d| *d >= min && *d <= max));
    let mid = Duration::from_secs(11);
    let low = v.iter().filter(|d| **d < mid).count();
    assert!((40..=60).contains(&low), "{low} of 100 below the middle");
}

#[test]
fn summaries_count_failures_by_class() {
    let s = |load: &str, outcome: Outcome, ms: u64| Sample {
        load: load.into(),
        kind: "http1",
        at: Duration::ZERO,
        latency: Duration::from_millis(ms),
        outcome,
        pod: None,
        peer: None,
    };
    let sum = summarize(&[
        s("a", Outcome::Ok, 10),
        s("a", Outcome::Ok, 30),
        s("a", Outcome::ConnectRefused, 1),
        s("b", Outcome::Timeout, 10_000),
    ]);
    assert_eq!(sum.len(), 2);
    assert_eq!((sum[0].sent, sum[0].ok, sum[0].failed), (3, 2, 1));
    assert_eq!(sum[0].failures.get("connect_refused"), Some(&1));
    assert_eq!(sum[0].latency.max_ms, 30.0);
    assert_eq!((sum[1].ok, sum[1].failures.get("timeout")), (0, Some(&1)));
}
