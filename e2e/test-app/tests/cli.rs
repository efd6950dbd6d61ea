//! The test app as its binary: a Job-like run that serves, then exits 0 on
//! its own, and a bad flag refused before the port opens. Being an
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

#[tokio::test]
async fn it_serves_then_exits_zero_on_its_own_with_exit_after() {
    let mut child = app()
        .args([
            "--port",
            "0",
            "--address",
            "127.0.0.1",
            "--exit-after",
            "3s",
        ])
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = timeout(DEADLINE, async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(addr) = line.strip_prefix("test-app: listening on ") {
                return addr.to_owned();
            }
        }
        panic!("test-app ended without listening");
    })
    .await
    .expect("test-app listening");

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

    let rest = timeout(DEADLINE, async {
        let mut rest = Vec::new();
        while let Some(line) = lines.next_line().await.unwrap() {
            rest.push(line);
        }
        rest
    })
    .await
    .expect("test-app exiting on its own");
    let status = timeout(DEADLINE, child.wait()).await.unwrap().unwrap();
    assert!(status.success(), "{status}: {rest:?}");
    assert!(
        rest.iter()
            .any(|l| l == "test-app: served 1 requests, exiting"),
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
