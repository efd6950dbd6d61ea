//! Where the discovery server's memory per proxy goes (not run by `cargo
//! test`): the fleet of `discovery_push` (the server in this process, N
//! simulated proxies over TLS, every one subscribed) under dhat's heap
//! profiler, which records the call stack of every allocation. Once every
//! proxy has subscribed, the bytes still allocated are attributed by
//! stack: to the server or the clients (a stack through the clients' code,
//! the h2/hyper/rustls client or tonic's client is theirs), and within the
//! server to the part that allocated them (rustls, h2, hyper, tonic, tokio,
//! Remora's session, registry...). The server's bytes per proxy are what a
//! replica pays per sidecar beyond its fixed cost; RSS adds the
//! allocator's own overhead (e2e's `discovery-bench` reads the RSS of a
//! server in a process of its own).
//!
//! `cargo bench -p remora-operator --bench discovery_heap -- --proxies 1000
//! --protocol delta` prints a table and writes JSON to
//! `bench/results/discovery-heap.json`. Slow: every allocation's stack is
//! taken.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use remora_operator::discovery::push::{DEFAULT_PUSH_THROTTLE, Debounce};
use remora_test_support::results;
use serde_json::{Value, json};

#[path = "support/discovery_fleet.rs"]
#[allow(dead_code)] // This bench reads less of the fleet than discovery_push does.
mod fleet;
use fleet::{Fleet, Xds};

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

#[derive(Debug, Parser)]
#[command(name = "discovery_heap")]
struct Args {
    #[arg(long, default_value_t = 1000)]
    proxies: usize,
    #[arg(long, default_value_t = 100)]
    services: usize,
    #[arg(long, default_value_t = Xds::Delta)]
    protocol: Xds,
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/results/discovery-heap.json"))]
    out: PathBuf,
    /// Keep dhat's own profile here (for dhat's viewer, dh_view.html);
    /// by default it is read, then deleted.
    #[arg(long)]
    dhat_out: Option<PathBuf>,
    /// What cargo passes to every bench.
    #[arg(long, hide = true)]
    bench: bool,
}

/// A stack through any of these is the clients' (checked first: the
/// clients call the operator's decoders too).
const CLIENT: &[&str] = &[
    // The fleet module's functions (`fleet::run_proxy`, `fleet::Fleet::start`).
    "fleet::run_",
    "fleet::Fleet::start",
    "h2_client",
    "hyper::client",
    "hyper::proto::h2::client",
    "h2::client",
    "rustls::client",
    "tokio_rustls::client",
    "tonic::client",
    "ClientConnection",
];

/// The part a server allocation is charged to: the first of these found
/// walking the stack from the allocation outwards.
const PARTS: &[(&str, &str)] = &[
    // Before tonic's: its frames name the ADS service's routing too.
    (
        "discovery::server::AdsService",
        "remora: the stream's task (spawned future)",
    ),
    (
        "discovery::ads_grpc",
        "tonic: ADS codec buffers (from 512 B, grown to the largest message)",
    ),
    // The response encoder's buffer grows as h2 polls the response body.
    (
        "hyper::proto::h2::PipeToSendStream",
        "tonic: ADS codec buffers (from 512 B, grown to the largest message)",
    ),
    (
        "hyper::proto::h2::server::Server",
        "h2: write buffer (16 KiB)",
    ),
    ("tokio_util::codec", "h2: read buffer (8 KiB)"),
    (
        "h2::codec::framed_read::FrameDecoder",
        "h2: hpack decoder (4 KiB)",
    ),
    (
        "remora_operator::discovery::session",
        "remora: state-of-the-world session",
    ),
    ("remora_operator::discovery::delta", "remora: delta session"),
    (
        "remora_operator::discovery::server",
        "remora: stream (server.rs)",
    ),
    ("remora_operator::discovery::push", "remora: push/snapshots"),
    (
        "remora_operator::discovery::resources",
        "remora: generated resources",
    ),
    ("remora_operator::discovery::registry", "remora: registry"),
    (
        "remora_operator::grpc_server",
        "remora: grpc_server (connection bounds)",
    ),
    ("remora_operator::pki", "remora: authn gate"),
    ("tonic::codec::decode", "tonic: request decoder buffer"),
    ("tonic::codec::encode", "tonic: response encoder buffer"),
    ("tonic::", "tonic: other"),
    ("prost::", "prost: decoded messages"),
    ("h2::codec::framed_write", "h2: write buffer"),
    ("h2::codec::framed_read", "h2: read buffer / frames"),
    ("h2::hpack", "h2: hpack tables"),
    ("h2::proto::streams", "h2: stream state"),
    ("h2::", "h2: other"),
    ("hyper::", "hyper"),
    ("rustls::", "rustls"),
    ("tokio_rustls::", "rustls"),
    ("tokio::runtime::task", "tokio: spawned tasks (futures)"),
    ("tokio::", "tokio: other"),
];

fn side_and_part(frames: &[&str]) -> (&'static str, &'static str) {
    if frames.iter().any(|f| CLIENT.iter().any(|c| f.contains(c))) {
        return ("clients", "clients");
    }
    let part = frames
        .iter()
        .find_map(|f| {
            PARTS
                .iter()
                .find(|(needle, _)| f.contains(needle))
                .map(|(_, p)| *p)
        })
        .unwrap_or("other");
    ("server", part)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let machine_before = results::machine();
    remora_test_support::open_files::raise_open_files(2 * args.proxies as u64 + 64)?;
    let dump = args.dhat_out.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("discovery-heap-{}.json", std::process::id()))
    });
    let profiler = dhat::Profiler::builder()
        .file_name(&dump)
        .trim_backtraces(None)
        .build();
    let started = Instant::now();
    let before = dhat::HeapStats::get();
    let fleet = Fleet::start(
        args.proxies,
        args.services,
        args.protocol,
        Debounce::default(),
        DEFAULT_PUSH_THROTTLE,
    )
    .await?;
    // Subscribed: every proxy ACKed its first EDS. Its last ACKs (LDS) are
    // on their way; what a stream holds once idle is what is measured.
    let settle = tokio::time::Instant::now() + std::time::Duration::from_secs(2);
    tokio::time::sleep_until(settle).await;
    let now = dhat::HeapStats::get();
    // Dropping the profiler records what is allocated at this instant.
    drop(profiler);
    fleet.stop.cancel();

    let text = std::fs::read_to_string(&dump).with_context(|| format!("{}", dump.display()))?;
    if args.dhat_out.is_none() {
        let _ = std::fs::remove_file(&dump);
    }
    let doc: Value = serde_json::from_str(&text).context("dhat's file")?;
    let ftbl: Vec<&str> = doc["ftbl"]
        .as_array()
        .context("ftbl")?
        .iter()
        .map(|f| f.as_str().unwrap_or(""))
        .collect();
    let mut by: BTreeMap<(&str, &str), (u64, u64)> = BTreeMap::new();
    for pp in doc["pps"].as_array().context("pps")? {
        let bytes = pp["eb"].as_u64().unwrap_or(0);
        let blocks = pp["ebk"].as_u64().unwrap_or(0);
        if bytes == 0 {
            continue;
        }
        let frames: Vec<&str> = pp["fs"]
            .as_array()
            .map(|fs| {
                fs.iter()
                    .filter_map(|i| ftbl.get(i.as_u64()? as usize).copied())
                    .collect()
            })
            .unwrap_or_default();
        let e = by.entry(side_and_part(&frames)).or_default();
        e.0 += bytes;
        e.1 += blocks;
    }
    let n = args.proxies as f64;
    let server_total: u64 = by
        .iter()
        .filter(|((s, _), _)| *s == "server")
        .map(|(_, (b, _))| b)
        .sum();
    println!(
        "{} proxies ({}), {} Services: {:.1} MiB allocated at the end, {:.1} MiB of it the server's ({:.0} bytes per proxy)",
        args.proxies,
        args.protocol,
        args.services,
        now.curr_bytes as f64 / 1048576.0,
        server_total as f64 / 1048576.0,
        server_total as f64 / n
    );
    println!(
        "{:<10} {:<42} {:>10} {:>14} {:>14}",
        "side", "part", "MiB", "bytes/proxy", "blocks/proxy"
    );
    let mut rows: Vec<_> = by.iter().collect();
    rows.sort_by_key(|(k, v)| (k.0 != "server", std::cmp::Reverse(v.0)));
    let mut out = Vec::new();
    for ((side, part), (bytes, blocks)) in rows {
        println!(
            "{side:<10} {part:<42} {:>10.1} {:>14.0} {:>14.1}",
            *bytes as f64 / 1048576.0,
            *bytes as f64 / n,
            *blocks as f64 / n
        );
        out.push(
            json!({"side": side, "part": part, "bytes": bytes, "blocks": blocks,
            "bytes_per_proxy": *bytes as f64 / n}),
        );
    }
    let result = json!({
        "proxies": args.proxies,
        "services": args.services,
        "protocol": args.protocol.label(),
        "seconds": started.elapsed().as_secs_f64(),
        "allocated_bytes_before_the_fleet": before.curr_bytes,
        "allocated_bytes_subscribed": now.curr_bytes,
        "server_bytes_subscribed": server_total,
        "server_bytes_per_proxy": server_total as f64 / n,
        "parts": out,
        "measured": "bytes still allocated once every proxy subscribed (2 s after the last first EDS ACK), by the stack that allocated them; the allocator's own overhead (RSS) is not in them",
    });
    results::write(&args.out, &results::document(&machine_before, result))?;
    println!("wrote {}", args.out.display());
    Ok(())
}
