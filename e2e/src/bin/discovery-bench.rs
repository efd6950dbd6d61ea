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
//!
//! Confirmed removal's convergence (issue 30), on a local control plane
//! of its own when no kubeconfig is given:
//!
//! ```text
//! cargo run --release -p e2e --bin discovery-bench -- --only withdrawal \
//!   --proxies 10,100,1000 --services 100 --rollouts 3
//! ```
//! writes `bench/results/withdrawal-convergence.json`.

use clap::Parser;
use e2e::discovery_bench::{Args, HEAP_FILE, Outcome, report, run, serve_remora};

// The operator's allocator (its main.rs), so Remora's child measures as the
// operator would; `cap` counts the child's live heap beside its RSS.
#[global_allocator]
static ALLOC: cap::Cap<mimalloc::MiMalloc> = cap::Cap::new(mimalloc::MiMalloc, usize::MAX);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // One socket per proxy in this process (the clients) and in Remora's
    // child (the server, which inherits the limit), with room to spare.
    let most = args.proxies.iter().copied().max().unwrap_or(0) as u64;
    remora_test_support::open_files::raise_open_files(most + 4096)?;
    if let Some(dir) = args.serve_remora.clone() {
        // As the operator's main does.
        remora_operator::alloc::purge_freed_memory_at_once();
        let heap = dir.join(HEAP_FILE);
        tokio::spawn(async move {
            loop {
                // Best effort: the bench reads it when it reads the RSS.
                let _ = std::fs::write(&heap, ALLOC.allocated().to_string());
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        });
        return serve_remora(&args, dir).await;
    }
    let started = std::time::Instant::now();
    let before = remora_test_support::results::machine();
    let out = args.out();
    let seconds = || started.elapsed().as_secs_f64();
    match run(&args).await? {
        Outcome::Push(phases) => {
            let rows = report::summarize(&phases);
            report::print_table(&rows);
            report::write(&out, &args, &phases, &rows, before, seconds())?;
        }
        Outcome::Withdrawal(phases) => {
            let rows = report::summarize_withdrawal(&phases);
            report::print_withdrawal_table(&rows);
            report::write_withdrawal(&out, &args, &phases, &rows, before, seconds())?;
        }
    }
    println!("wrote {}", out.display());
    Ok(())
}
