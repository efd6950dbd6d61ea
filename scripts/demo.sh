#!/usr/bin/env bash
# Sets everything up, then runs the local demo: remora-agent supervising a real
# Envoy in front of a small app, traffic, a SIGTERM drain, and a report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --locked --release -p remora-agent -p e2e --bins
exec ./target/release/demo
