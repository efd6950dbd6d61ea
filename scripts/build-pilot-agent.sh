#!/usr/bin/env bash
# Builds Istio's real pilot-agent (the sidecar's agent, a peer to compare
# remora-agent with: /work/shared/PEERS.md, issue 12) from the Go module
# proxy, once, into a cache outside the repository keyed by version:
#
#   ${REMORA_CACHE:-$HOME/.cache/remora}/istio/<ISTIO_VERSION>/bin/pilot-agent
#   ${REMORA_CACHE:-$HOME/.cache/remora}/istio/<ISTIO_VERSION>/bin/envoy_bootstrap.json
#
# The second file is Istio's own bootstrap template (tools/packaging/common/
# envoy_bootstrap.json of the same module), unchanged: what pilot-agent
# renders Envoy's bootstrap from (images/istio-proxy adapts it to run
# without istiod).
#
# Which Istio, and how its module resolves, is scripts/lib/istio-module.sh
# (shared with scripts/build-pilot-discovery.sh). Built with Istio's release
# flags (tags, -trimpath, static).
#
# A binary already in the cache is not rebuilt, so a warm run takes a second.
# Usage: scripts/build-pilot-agent.sh [--print-path]
#   --print-path  only print the binary's path, then exit (built or not)
# Env: ISTIO_VERSION (v0.0.0-20260827124520-eed52ebb66ad), REMORA_CACHE,
#      BUILD_NICE (10: the build shares the machine with cargo).
set -euo pipefail
# shellcheck source=lib/istio-module.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/istio-module.sh"

NAME=build-pilot-agent
BIN="$ISTIO_CACHE/bin/pilot-agent"
TEMPLATE="$ISTIO_CACHE/bin/envoy_bootstrap.json"

case "${1:-}" in
  "") ;;
  --print-path) echo "$BIN"; exit 0 ;;
  *) echo "$NAME: unknown argument $1 (usage: $NAME.sh [--print-path])" >&2; exit 2 ;;
esac

cached() { [[ -x "$BIN" && -f "$TEMPLATE" ]]; }
if cached; then istio_log $NAME "pilot-agent $ISTIO_VERSION cached in $(dirname "$BIN")"; exit 0; fi
# Two runs (two worktrees) would build the same thing twice; the second
# waits and then finds the cache filled.
istio_lock $NAME
if cached; then istio_log $NAME "pilot-agent $ISTIO_VERSION cached in $(dirname "$BIN")"; exit 0; fi

T0=$(date +%s)
istio_module istio.io/istio/pilot/cmd/pilot-agent
istio_log $NAME "resolved modules in $(( $(date +%s) - T0 ))s"
MODDIR=$(go list -m -f '{{.Dir}}' istio.io/istio)
[[ -f "$MODDIR/tools/packaging/common/envoy_bootstrap.json" ]] ||
  { echo "$NAME: no bootstrap template in $MODDIR" >&2; exit 1; }

istio_log $NAME "building pilot-agent -> $BIN"
istio_build istio.io/istio/pilot/cmd/pilot-agent agent,disable_pgv,grpcnotrace,retrynotrace "$BIN"
install -m 0644 "$MODDIR/tools/packaging/common/envoy_bootstrap.json" "$TEMPLATE.tmp.$$"
mv -f "$TEMPLATE.tmp.$$" "$TEMPLATE"
istio_log $NAME "built pilot-agent ($(du -h "$BIN" | cut -f1)) in $(( $(date +%s) - T0 ))s"
echo "$BIN"
