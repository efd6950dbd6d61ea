#!/usr/bin/env bash
# Sets everything up, then runs every check CI runs: format, lints, tests.
# The Kubernetes control plane for the e2e tests is built from source once and
# cached outside the repo (scripts/build-k8s.sh); a cold build runs in the
# background while cargo compiles.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

k8s_log=$(mktemp -t remora-build-k8s.XXXXXX)
bash scripts/build-k8s.sh >"$k8s_log" 2>&1 &
k8s_pid=$!
trap 'kill $k8s_pid 2>/dev/null || true' EXIT

# The chart: lint (values.schema.json included) and render both cert modes;
# helm comes from setup.sh. The e2e tests (e2e/tests/chart.rs) then hand the
# rendered objects to the real API server with server-side dry-run.
helm_version=$(sed -n 's/^HELM_VERSION=//p' scripts/setup.sh)
helm="${REMORA_CACHE:-$HOME/.cache/remora}/helm/$helm_version/helm"
"$helm" lint --strict charts/remora
"$helm" lint --strict charts/remora --set certMode=certManager
"$helm" template remora charts/remora --namespace remora-system >/dev/null
"$helm" template remora charts/remora --namespace remora-system --set certMode=certManager >/dev/null

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked --no-run

if ! wait "$k8s_pid"; then
  cat "$k8s_log" >&2
  echo "test.sh: building the Kubernetes control plane failed" >&2
  exit 1
fi
trap - EXIT
tail -n 3 "$k8s_log"
cargo test --workspace --locked
