#!/usr/bin/env bash
# Regenerates bench/results/ from its one table (e2e/src/results_index.rs):
#   scripts/bench.sh --list              the files, their commands and needs
#   scripts/bench.sh --stale             which files are older than their code, and why
#   scripts/bench.sh --only agent,sds    just those (by file stem)
#   scripts/bench.sh --only-stale        just the stale ones
#   scripts/bench.sh                     all of them, one at a time (hours; node ones
#                                        need `scripts/cluster.sh up` and scripts/images.sh)
# Commit first: each file records the commit it measured and whether the tree was dirty.
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo run --quiet --release --locked -p e2e --bin bench-all -- "$@"
