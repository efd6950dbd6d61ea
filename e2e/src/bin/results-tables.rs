//! Rewrites (`--write`) or checks (`--check`) the READMEs' tables of
//! figures against `bench/results/*.json` (`e2e::results_tables`).

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::{ArgGroup, Parser};

#[derive(Parser)]
#[command(about = "The READMEs' tables of figures, generated from bench/results/*.json")]
#[command(group(ArgGroup::new("mode").required(true).args(["write", "check"])))]
struct Args {
    /// Rewrite every generated block that disagrees with its JSON.
    #[arg(long)]
    write: bool,
    /// Fail when a generated block disagrees with its JSON.
    #[arg(long)]
    check: bool,
    /// The repository root (default: this crate's parent).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/.."))]
    root: PathBuf,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.write {
        let changed = e2e::results_tables::write(&args.root)?;
        for d in &changed {
            print!("{d}");
        }
        println!("{} table(s) rewritten", changed.len());
    } else {
        let drifts = e2e::results_tables::check(&args.root)?;
        for d in &drifts {
            print!("{d}");
        }
        if !drifts.is_empty() {
            bail!(
                "{} table(s) disagree with their JSON; run with --write",
                drifts.len()
            );
        }
        println!("every table agrees with its JSON");
    }
    Ok(())
}
