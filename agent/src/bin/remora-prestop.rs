//! `remora-prestop`: the app containers' preStop hook. The kubelet execs it
//! inside an app container, from the hook volume the sidecar filled; it asks
//! the agent over the pod's loopback to drain and returns once the app may
//! stop. Standard library only, built static for the images, so it runs in
//! any app image (no libc, shell or curl needed there).
//!
//! Usage: `remora-prestop [DIR]`; DIR (default: the directory of this
//! executable) holds the `endpoint` file the agent wrote: `addr=HOST:PORT`
//! and `token=HEX` lines. Exit 0 when the agent answered 200, 1 otherwise
//! (the kubelet then records a failed hook and sends SIGTERM anyway).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// Kept in step with `remora_contract::pod` (this binary has no dependencies).
const ENDPOINT_FILE: &str = "endpoint";
const PATH: &str = "/drain/app-prestop";
/// The agent listens on loopback: connecting is immediate or never.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// A bound for a wedged agent; the agent itself answers by the drain
/// deadline, and the kubelet kills the hook at the grace period.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// Larger answers are not the agent's.
const MAX_ANSWER: u64 = 64 * 1024;

fn main() -> ExitCode {
    match run() {
        Ok(body) => {
            println!("remora-prestop: {}", body.trim());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("remora-prestop: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<String, String> {
    let dir = match std::env::args_os().nth(1) {
        Some(d) => PathBuf::from(d),
        None => std::env::current_exe()
            .map_err(|e| format!("cannot find its own directory: {e}"))?
            .parent()
            .map(PathBuf::from)
            .ok_or("cannot find its own directory")?,
    };
    let file = dir.join(ENDPOINT_FILE);
    let text = std::fs::read_to_string(&file)
        .map_err(|e| format!("cannot read {}: {e} (is the sidecar up?)", file.display()))?;
    let (addr, token) = parse_endpoint(&text).map_err(|e| format!("{}: {e}", file.display()))?;
    let mut conn = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
        .map_err(|e| format!("cannot connect to the agent at {addr}: {e}"))?;
    conn.set_read_timeout(Some(ANSWER_TIMEOUT))
        .and_then(|()| conn.set_write_timeout(Some(CONNECT_TIMEOUT)))
        .map_err(|e| format!("socket options: {e}"))?;
    let request = format!(
        "POST {PATH} HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {token}\r\n\
         content-length: 0\r\nconnection: close\r\n\r\n"
    );
    conn.write_all(request.as_bytes())
        .map_err(|e| format!("cannot send the request to {addr}: {e}"))?;
    let mut answer = Vec::new();
    conn.take(MAX_ANSWER)
        .read_to_end(&mut answer)
        .map_err(|e| format!("no answer from {addr}: {e}"))?;
    let answer = String::from_utf8_lossy(&answer);
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .ok_or_else(|| format!("not an HTTP answer from {addr}"))?;
    if status == "200" {
        Ok(body.to_string())
    } else {
        Err(format!("the agent answered {status}: {}", body.trim()))
    }
}

fn parse_endpoint(text: &str) -> Result<(SocketAddr, String), String> {
    let mut addr = None;
    let mut token = None;
    for line in text.lines() {
        match line.split_once('=') {
            Some(("addr", v)) => addr = Some(v.trim()),
            Some(("token", v)) => token = Some(v.trim()),
            _ => {}
        }
    }
    let addr = addr.ok_or("no addr= line")?;
    let addr: SocketAddr = addr
        .parse()
        .map_err(|_| format!("addr {addr:?} is not HOST:PORT"))?;
    let token = token
        .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_alphanumeric()))
        .ok_or("no token= line with a token")?;
    Ok((addr, token.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_file_is_parsed_and_bad_ones_are_named() {
        let (addr, token) = parse_endpoint("addr=127.0.0.1:15020\ntoken=ab12\n").expect("valid");
        assert_eq!(addr.to_string(), "127.0.0.1:15020");
        assert_eq!(token, "ab12");
        for (text, says) in [
            ("token=ab\n", "addr"),
            ("addr=localhost\ntoken=ab\n", "HOST:PORT"),
            ("addr=127.0.0.1:1\n", "token"),
            ("addr=127.0.0.1:1\ntoken=a b\r\n", "token"),
        ] {
            let err = parse_endpoint(text).expect_err(text);
            assert!(err.contains(says), "{text:?}: {err}");
        }
    }
}
