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
# The proxy serves no Istio release tag here, only pseudo-versions;
# ISTIO_VERSION is a commit on release-1.31 whose agent code is that of
# 1.31.0-rc.0 and later. Four dependency versions it pins are not served
# either: a scratch module requires it and replaces them with served ones.
# Built with Istio's release flags (tags, -trimpath, static).
#
# A binary already in the cache is not rebuilt, so a warm run takes a second.
# Usage: scripts/build-pilot-agent.sh [--print-path]
#   --print-path  only print the binary's path, then exit (built or not)
# Env: ISTIO_VERSION (v0.0.0-20260827124520-eed52ebb66ad), REMORA_CACHE,
#      BUILD_NICE (10: the build shares the machine with cargo).
set -euo pipefail

ISTIO_VERSION="${ISTIO_VERSION:-v0.0.0-20260827124520-eed52ebb66ad}"
CACHE="${REMORA_CACHE:-$HOME/.cache/remora}"
ISTIO_DIR="$CACHE/istio/$ISTIO_VERSION"
BIN="$ISTIO_DIR/bin/pilot-agent"
TEMPLATE="$ISTIO_DIR/bin/envoy_bootstrap.json"
NICE="${BUILD_NICE:-10}"

case "${1:-}" in
  "") ;;
  --print-path) echo "$BIN"; exit 0 ;;
  *) echo "build-pilot-agent: unknown argument $1 (usage: build-pilot-agent.sh [--print-path])" >&2; exit 2 ;;
esac

log() { echo "build-pilot-agent: $(date -u +%H:%M:%S) $*"; }

if [[ -x "$BIN" && -f "$TEMPLATE" ]]; then
  log "pilot-agent $ISTIO_VERSION cached in $(dirname "$BIN")"
  exit 0
fi

command -v go >/dev/null || { echo "build-pilot-agent: go not found on PATH" >&2; exit 1; }

# Two runs (two worktrees) would build the same thing twice; the second
# waits and then finds the cache filled.
mkdir -p "$ISTIO_DIR"
if command -v flock >/dev/null; then
  exec 9>"$CACHE/.build-pilot-agent.lock"
  flock 9
  if [[ -x "$BIN" && -f "$TEMPLATE" ]]; then
    log "pilot-agent $ISTIO_VERSION cached in $(dirname "$BIN")"
    exit 0
  fi
fi

T0=$(date +%s)
SRC="$ISTIO_DIR/src"
rm -rf "$SRC"
mkdir -p "$SRC"
cd "$SRC"
# go-control-plane's pseudo-versions that commit pins and istio.io/{api,
# client-go} at their 1.31.1 release: the nearest ones the proxy serves.
GCP_PSEUDO=0.20260729145720-a2d8c7492908
cat >go.mod <<EOF
module remora.invalid/pilot-agent-build

go 1.26.0

replace (
	github.com/envoyproxy/go-control-plane/contrib => github.com/envoyproxy/go-control-plane/contrib v1.36.1-$GCP_PSEUDO
	github.com/envoyproxy/go-control-plane/envoy => github.com/envoyproxy/go-control-plane/envoy v1.37.1-$GCP_PSEUDO
	istio.io/api => istio.io/api v1.31.1
	istio.io/client-go => istio.io/client-go v1.31.1
)
EOF
nice -n "$NICE" go get "istio.io/istio@$ISTIO_VERSION" "istio.io/istio/pilot/cmd/pilot-agent@$ISTIO_VERSION"
log "resolved modules in $(( $(date +%s) - T0 ))s"

MODDIR=$(go list -m -f '{{.Dir}}' istio.io/istio)
[[ -f "$MODDIR/tools/packaging/common/envoy_bootstrap.json" ]] ||
  { echo "build-pilot-agent: no bootstrap template in $MODDIR" >&2; exit 1; }

# Temp file and rename: an interrupted build never leaves a half-written
# binary that a later run would take for a cached one.
log "building pilot-agent -> $BIN"
mkdir -p "$(dirname "$BIN")"
CGO_ENABLED=0 nice -n "$NICE" go build -trimpath \
  -tags=agent,disable_pgv,grpcnotrace,retrynotrace \
  -ldflags "-s -w -X istio.io/istio/pkg/version.buildVersion=$ISTIO_VERSION" \
  -o "$BIN.tmp.$$" istio.io/istio/pilot/cmd/pilot-agent
install -m 0644 "$MODDIR/tools/packaging/common/envoy_bootstrap.json" "$TEMPLATE.tmp.$$"
mv -f "$TEMPLATE.tmp.$$" "$TEMPLATE"
mv -f "$BIN.tmp.$$" "$BIN"
log "built pilot-agent ($(du -h "$BIN" | cut -f1)) in $(( $(date +%s) - T0 ))s"
echo "$BIN"
