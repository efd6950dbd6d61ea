//! Remora's discovery push side by side with Istio's real pilot-discovery,
//! on the real node's API server (the logic and what it does not cover:
//! `e2e::discovery_bench`). Not run by `cargo test`.
//!
//! ```text
//! scripts/build-pilot-discovery.sh
//! KUBECONFIG=/var/tmp/remora-cluster/admin.kubeconfig \
//!   cargo run --release -p e2e --bin discovery-bench -- --proxies 100,1000 --services 100
//! ```
//! prints a table and writes `bench/results/discovery-istiod.json`.

use clap::Parser;
use e2e::discovery_bench::{Args, report, run, serve_remora};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(dir) = args.serve_remora.clone() {
        return serve_remora(&args, dir).await;
    }
    let started = std::time::Instant::now();
    let before = report::machine();
    let phases = run(&args).await?;
    let rows = report::summarize(&phases);
    report::print_table(&rows);
    report::write(
        &args.out,
        &args,
        &phases,
        &rows,
        before,
        started.elapsed().as_secs_f64(),
    )?;
    println!("wrote {}", args.out.display());
    Ok(())
}
