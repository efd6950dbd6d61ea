//! Regenerates the files under `bench/results/` from the one table that
//! lists them (`e2e::results_index`), one at a time; `--list` prints that
//! table, `--stale` which files are older than the code they measure and why.
//! `scripts/bench.sh` is this bin in a release build.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Parser;
use e2e::results_index::{self, ENTRIES, Entry, Freshness, Need};

#[derive(Debug, Parser)]
#[command(
    name = "bench-all",
    about = "Regenerates bench/results/ from its table"
)]
struct Args {
    /// Only these files (by stem, e.g. `agent,sds`); default: all.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Print the table and exit.
    #[arg(long)]
    list: bool,
    /// Print which files are older than the code they measure, and why.
    #[arg(long)]
    stale: bool,
    /// With a selection: run only those of it that are stale.
    #[arg(long)]
    only_stale: bool,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap_or(Path::new("."))
        .to_path_buf()
}

/// Whether the real node is up, as `scripts/test.sh` asks it.
fn node_up(root: &Path) -> bool {
    Command::new("bash")
        .current_dir(root)
        .args(["scripts/cluster.sh", "status"])
        .output()
        .is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l.starts_with("kubelet: running"))
        })
}

fn describe(root: &Path, e: &Entry) -> String {
    match results_index::freshness(root, e) {
        Ok(Freshness::Fresh) => "fresh".into(),
        Ok(Freshness::Stale(why)) => format!("STALE: {why}"),
        Err(err) => format!("STALE: {err}"),
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let root = root();
    if args.list {
        print!("{}", results_index::table());
        return Ok(());
    }
    let mut chosen: Vec<&Entry> = Vec::new();
    for name in &args.only {
        chosen.push(
            results_index::find(name)
                .with_context(|| format!("no results file {name:?} (see --list)"))?,
        );
    }
    if chosen.is_empty() {
        chosen = ENTRIES.iter().collect();
    }
    if args.stale {
        results_index::check_history(&root)?;
        for e in &chosen {
            println!("{:<40} {}", e.file(), describe(&root, e));
        }
        return Ok(());
    }
    if args.only_stale {
        results_index::check_history(&root)?;
        chosen.retain(|e| !matches!(results_index::freshness(&root, e), Ok(Freshness::Fresh)));
    }
    let on_node: Vec<&str> = chosen
        .iter()
        .filter(|e| e.needs.contains(&Need::Node))
        .map(|e| e.name())
        .collect();
    if !on_node.is_empty() && !node_up(&root) {
        bail!(
            "the real node is down, and {} need(s) it: run `scripts/cluster.sh up` and \
             `scripts/images.sh` first (as root), or leave them out with --only",
            on_node.join(", ")
        );
    }
    // The stamp records whether the tree was dirty; say so before an hour of runs.
    if remora_test_support::results::dirty() {
        eprintln!(
            "bench-all: the tree has uncommitted changes: the files will say dirty (and count as stale)"
        );
    }
    for e in chosen {
        eprintln!(
            "bench-all: {} (~{} min): {}",
            e.file(),
            e.minutes,
            e.command
        );
        let started = Instant::now();
        let status = Command::new("bash")
            .current_dir(&root)
            .args(["-c", e.command])
            .status()
            .with_context(|| format!("starting {}", e.command))?;
        if !status.success() {
            bail!("{} failed ({status}): {}", e.file(), e.command);
        }
        eprintln!(
            "bench-all: {} done in {:.0} s; {}",
            e.file(),
            started.elapsed().as_secs_f64(),
            describe(&root, e)
        );
    }
    Ok(())
}
