//! SDS benchmark (`cargo bench -p remora-agent --bench sds`; not part of `cargo test`).
//!
//! Runs the SDS server (file source) in a child process of its own, so its
//! RSS can be read, with a real Envoy fed by it, and measures:
//! - file rewrite → Envoy presenting the new cert (20 rotations),
//! - `..data` symlink swap → Envoy presenting the new cert (20 rotations),
//! - one rotation pushed to 100 SDS streams (file write → all 100 received),
//! - RSS of the SDS process.
//!
//! Prints a table and writes `bench/results/sds.json`.
#![allow(clippy::unwrap_used)]

#[path = "../tests/support_sds/mod.rs"]
mod support_sds;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient;
use prometheus_client::registry::Registry;
use remora_agent::certs::file::FileSource;
use remora_test_support::results;
use serde_json::json;
use support_sds::*;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Endpoint, Uri};

const TYPE: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("serve-sds") {
        return serve(PathBuf::from(&args[2]), PathBuf::from(&args[3]));
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(bench())
}

/// Child mode: just the SDS server, as the agent runs it (one thread).
fn serve(certs: PathBuf, socket: PathBuf) -> Result<()> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(async move {
            let mut registry = Registry::default();
            let cancel = CancellationToken::new();
            let h = remora_agent::sds::start_with(
                socket,
                Some(Box::new(FileSource::new(certs))),
                &mut registry,
                cancel.clone(),
            )
            .await?;
            h.join().await?;
            Ok(())
        })
}

fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix(field)
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            })
        })
        .unwrap_or(0)
}

struct Stats {
    median: f64,
    p90: f64,
    max: f64,
}

fn stats(mut v: Vec<f64>) -> Stats {
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    Stats {
        median: at(0.5),
        p90: at(0.9),
        max: *v.last().unwrap(),
    }
}

async fn rotate_and_wait(
    port: u16,
    tls: &tokio_rustls::TlsConnector,
    write: impl FnOnce(),
    serial: &str,
) -> Result<f64> {
    let t0 = Instant::now();
    write();
    let deadline = t0 + Duration::from_secs(10);
    loop {
        if let Ok((_, s)) = roundtrip(port, tls).await
            && s == serial
        {
            return Ok(t0.elapsed().as_secs_f64() * 1000.0);
        }
        if Instant::now() > deadline {
            return Err(anyhow!("rotation not seen within 10 s"));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn fan_out(socket: &Path, certs: &Path, root: &Ca, rounds: usize) -> Result<Vec<f64>> {
    let mut streams = Vec::new();
    for _ in 0..4 {
        let p = socket.to_path_buf();
        let ch = Endpoint::try_from("http://[::]:50051")?
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let p = p.clone();
                async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                        tokio::net::UnixStream::connect(p).await?,
                    ))
                }
            }))
            .await?;
        for _ in 0..25 {
            let (tx, rx) = mpsc::channel(4);
            tx.send(request("", "")).await?;
            let inbound = SecretDiscoveryServiceClient::new(ch.clone())
                .stream_secrets(ReceiverStream::new(rx))
                .await?
                .into_inner();
            streams.push((tx, inbound));
        }
    }
    for (tx, rx) in &mut streams {
        let r = next(rx).await?;
        tx.send(request(&r.version_info, &r.nonce)).await?;
    }
    let mut times = Vec::new();
    for _ in 0..rounds {
        let leaf = root.leaf();
        let t0 = Instant::now();
        write_certs(certs, &leaf, &root.pem);
        // Each stream reads its push on its own task, as Envoy would.
        let mut joins = Vec::new();
        for (tx, mut rx) in streams.drain(..) {
            joins.push(tokio::spawn(async move {
                let r = next(&mut rx).await?;
                tx.send(request(&r.version_info, &r.nonce)).await?;
                Ok::<_, anyhow::Error>((tx, rx, t0.elapsed()))
            }));
        }
        let mut last = Duration::ZERO;
        for j in joins {
            let (tx, rx, d) = j.await??;
            last = last.max(d);
            streams.push((tx, rx));
        }
        times.push(last.as_secs_f64() * 1000.0);
    }
    Ok(times)
}

fn request(version: &str, nonce: &str) -> DiscoveryRequest {
    DiscoveryRequest {
        version_info: version.into(),
        resource_names: vec!["default".into()],
        type_url: TYPE.into(),
        response_nonce: nonce.into(),
        ..Default::default()
    }
}

async fn next(rx: &mut tonic::Streaming<DiscoveryResponse>) -> Result<DiscoveryResponse> {
    tokio::time::timeout(Duration::from_secs(10), rx.message())
        .await
        .map_err(|_| anyhow!("no push in time"))??
        .ok_or_else(|| anyhow!("stream closed"))
}

async fn bench() -> Result<()> {
    let machine_before = results::machine();
    let tmp = tempfile::tempdir()?;
    let certs = tmp.path().join("certs");
    let root = Ca::new("bench-root");
    let first = root.leaf();
    k8s_swap(&certs, &first, &root.pem);
    let socket = tmp.path().join("sds.sock");

    let mut child = tokio::process::Command::new(std::env::current_exe()?)
        .arg("serve-sds")
        .arg(&certs)
        .arg(&socket)
        .kill_on_drop(true)
        .spawn()
        .context("spawn SDS child")?;
    let pid = child.id().ok_or_else(|| anyhow!("child pid"))?;
    wait_until(DEADLINE, "SDS socket", || async {
        socket.exists().then_some(())
    })
    .await?;

    let mut envoy = Envoy::start_inbound(tmp.path(), &socket).await?;
    let port = envoy.listener_port;
    let client = connector(&root.pem, &root.leaf());
    wait_serial(port, &client, &first.serial).await?;

    let rounds = 20;
    let mut swap = Vec::new();
    for _ in 0..rounds {
        let leaf = root.leaf();
        swap.push(
            rotate_and_wait(
                port,
                &client,
                || k8s_swap(&certs, &leaf, &root.pem),
                &leaf.serial,
            )
            .await?,
        );
    }
    // Plain rewrites go through the top-level names, so drop the symlinks first.
    for name in ["cert-chain.pem", "key.pem", "root-cert.pem"] {
        std::fs::remove_file(certs.join(name))?;
    }
    let mut rewrite = Vec::new();
    for _ in 0..rounds {
        let leaf = root.leaf();
        rewrite.push(
            rotate_and_wait(
                port,
                &client,
                || write_certs(&certs, &leaf, &root.pem),
                &leaf.serial,
            )
            .await?,
        );
    }
    let rss_with_envoy = rss_kib(pid, "VmRSS:");
    let fan = fan_out(&socket, &certs, &root, 10).await?;
    let rss_after_fanout = rss_kib(pid, "VmRSS:");
    let hwm = rss_kib(pid, "VmHWM:");
    // Anonymous (heap, stacks) vs file-backed (the binary's touched pages, libs).
    let (anon, file) = (rss_kib(pid, "RssAnon:"), rss_kib(pid, "RssFile:"));

    // Key + CSR generation per issuance in CA mode (fresh key every renewal).
    let mut keygen = Vec::new();
    for (name, kt) in [
        ("ecdsa-p256", remora_agent::config::KeyType::EcdsaP256),
        ("rsa-2048", remora_agent::config::KeyType::Rsa2048),
    ] {
        let ident = remora_agent::certs::csr::Identity {
            trust_domain: "cluster.local".into(),
            namespace: "ns".into(),
            service_account: "sa".into(),
            key_type: kt,
            ttl: Duration::from_secs(3600),
        };
        let n = 5;
        let mut v = Vec::new();
        for _ in 0..n {
            let t = Instant::now();
            ident.key_and_csr()?;
            v.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        keygen.push((name, stats(v)));
    }

    let _ = envoy.child.kill().await;
    let _ = child.kill().await;

    let (s, r, f) = (
        stats(swap.clone()),
        stats(rewrite.clone()),
        stats(fan.clone()),
    );
    println!();
    println!("| measurement | n | median | p90 | max | goal |");
    println!("| --- | --- | --- | --- | --- | --- |");
    println!(
        "| file rewrite → Envoy presents new cert | {} | {:.1} ms | {:.1} ms | {:.1} ms | ≤ 150 ms median |",
        rewrite.len(),
        r.median,
        r.p90,
        r.max
    );
    println!(
        "| `..data` symlink swap → Envoy presents new cert | {} | {:.1} ms | {:.1} ms | {:.1} ms | ≤ 150 ms median |",
        swap.len(),
        s.median,
        s.p90,
        s.max
    );
    println!(
        "| file write → push received on all 100 streams | {} | {:.1} ms | {:.1} ms | {:.1} ms | |",
        fan.len(),
        f.median,
        f.p90,
        f.max
    );
    println!(
        "| SDS process RSS (Envoy connected / after 100 streams / peak) | | {:.1} / {:.1} / {:.1} MiB | | | ≤ 8 MiB |",
        rss_with_envoy as f64 / 1024.0,
        rss_after_fanout as f64 / 1024.0,
        hwm as f64 / 1024.0
    );

    println!(
        "| SDS process RSS split after 100 streams (anon / file-backed) | | {:.1} / {:.1} MiB | | | |",
        anon as f64 / 1024.0,
        file as f64 / 1024.0
    );
    for (name, k) in &keygen {
        println!(
            "| CA mode: {name} key + CSR generation | 5 | {:.1} ms | {:.1} ms | {:.1} ms | |",
            k.median, k.p90, k.max
        );
    }

    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/results");
    let json = json!({
        "benchmark": "sds",
        "poll_ms": remora_agent::certs::file::DEFAULT_POLL.as_millis() as u64,
        "rotation_rewrite_ms": { "n": rewrite.len(), "median": r.median, "p90": r.p90, "max": r.max, "samples": rewrite },
        "rotation_symlink_swap_ms": { "n": swap.len(), "median": s.median, "p90": s.p90, "max": s.max, "samples": swap },
        "fanout_100_streams_ms": { "n": fan.len(), "median": f.median, "p90": f.p90, "max": f.max, "samples": fan },
        "sds_process_rss_kib": { "envoy_connected": rss_with_envoy, "after_100_streams": rss_after_fanout, "peak": hwm, "anon_after_100_streams": anon, "file_after_100_streams": file },
        "keygen_ms": keygen.iter().map(|(n, k)| (n.to_string(), json!({ "n": 5, "median": k.median, "p90": k.p90, "max": k.max }))).collect::<serde_json::Map<_, _>>(),
        "goal": { "rotation_median_ms": 150, "rss_mib": 8 }
    });
    let doc = results::document(&machine_before, json);
    results::write(&out.join("sds.json"), &doc)?;
    println!("\nwrote bench/results/sds.json");
    Ok(())
}
