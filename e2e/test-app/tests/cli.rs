//! The test app as its binary: it serves until SIGTERM and then exits 0,
//! a Job-like run exits 0 on its own, and a bad flag is refused before the
//! port opens. Being an
//! integration test, this also makes `cargo test --workspace` build
//! `target/<profile>/test-app`, which e2e's tests start beside them.
#![allow(clippy::unwrap_used)]

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::process::Command;
use tokio::time::timeout;

const DEADLINE: Duration = Duration::from_secs(30);

fn app() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_test-app"));
    cmd.env("HOSTNAME", "cli-test")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// The address from the app's `listening on` line.
async fn listening<R: tokio::io::AsyncBufRead + Unpin>(lines: &mut tokio::io::Lines<R>) -> String {
    timeout(DEADLINE, async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(addr) = line.strip_prefix("test-app: listening on ") {
                return addr.to_owned();
            }
        }
        panic!("test-app ended without listening");
    })
    .await
    .expect("test-app listening")
}

/// What the app still logs until it exits, and its exit status.
async fn rest_and_status<R: tokio::io::AsyncBufRead + Unpin>(
    lines: &mut tokio::io::Lines<R>,
    child: &mut tokio::process::Child,
) -> (Vec<String>, std::process::ExitStatus) {
    let rest = timeout(DEADLINE, async {
        let mut rest = Vec::new();
        while let Some(line) = lines.next_line().await.unwrap() {
            rest.push(line);
        }
        rest
    })
    .await
    .expect("test-app exiting");
    let status = timeout(DEADLINE, child.wait()).await.unwrap().unwrap();
    (rest, status)
}

#[tokio::test]
async fn it_serves_until_sigterm_then_exits_zero() {
    let mut child = app()
        .args(["--port", "0", "--address", "127.0.0.1"])
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = listening(&mut lines).await;

    let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
    conn.write_all(b"GET / HTTP/1.1\r\nhost: app\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    timeout(DEADLINE, conn.read_to_string(&mut answer))
        .await
        .expect("an answer")
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("x-pod: cli-test"), "{answer}");
    assert!(answer.ends_with("ok 1\n"), "{answer}");

    // SIGTERM by kill(1): the package has no signal crate of its own.
    let pid = child.id().unwrap().to_string();
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(kill.success(), "kill -TERM {pid}: {kill}");
    let (rest, status) = rest_and_status(&mut lines, &mut child).await;
    assert!(status.success(), "{status}: {rest:?}");
    assert!(
        rest.iter()
            .any(|l| l == "test-app: served 1 requests, exiting"),
        "{rest:?}"
    );
}

#[tokio::test]
async fn with_exit_after_it_exits_zero_on_its_own() {
    let mut child = app()
        .args([
            "--port",
            "0",
            "--address",
            "127.0.0.1",
            "--exit-after",
            "0s",
        ])
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    listening(&mut lines).await;
    let (rest, status) = rest_and_status(&mut lines, &mut child).await;
    assert!(status.success(), "{status}: {rest:?}");
    assert!(
        rest.iter().any(|l| l == "test-app: exit-after 0ns elapsed"),
        "{rest:?}"
    );
}

#[tokio::test]
async fn a_bad_duration_is_refused_before_the_port_opens() {
    let out = timeout(
        DEADLINE,
        app()
            .args(["--port", "0", "--address", "127.0.0.1", "--delay", "soon"])
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--delay"), "{stderr}");
    assert!(!stderr.contains("listening"), "{stderr}");
}
