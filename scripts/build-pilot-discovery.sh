#!/usr/bin/env bash
# Builds Istio's real pilot-discovery (istiod: the control plane, a peer to
# compare Remora's discovery server with: /work/shared/PEERS.md, issue 29)
# from the Go module proxy, once, into a cache outside the repository:
#
#   ${REMORA_CACHE:-$HOME/.cache/remora}/istio/<ISTIO_VERSION>/bin/pilot-discovery
#   ${REMORA_CACHE:-$HOME/.cache/remora}/istio/<ISTIO_VERSION>/bin/crd-all.gen.yaml
#
# The second file is Istio's CRDs (manifests/charts/base/files/crd-all.gen.yaml
# of the same module), which istiod needs applied before it turns Ready.
# Same Istio version, scratch module and release flags as pilot-agent
# (scripts/lib/istio-module.sh); istiod's tags lack `agent`. ~4.5 min cold on
# 2 cores, 110 MB static. A cached binary is not rebuilt.
# Usage: scripts/build-pilot-discovery.sh [--print-path]
#   --print-path  only print the binary's path, then exit (built or not)
# Env: ISTIO_VERSION, REMORA_CACHE, BUILD_NICE (see scripts/lib/istio-module.sh).
set -euo pipefail
# shellcheck source=lib/istio-module.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/istio-module.sh"

NAME=build-pilot-discovery
BIN="$ISTIO_CACHE/bin/pilot-discovery"
CRDS="$ISTIO_CACHE/bin/crd-all.gen.yaml"

case "${1:-}" in
  "") ;;
  --print-path) echo "$BIN"; exit 0 ;;
  *) echo "$NAME: unknown argument $1 (usage: $NAME.sh [--print-path])" >&2; exit 2 ;;
esac

cached() { [[ -x "$BIN" && -f "$CRDS" ]]; }
if cached; then istio_log $NAME "pilot-discovery $ISTIO_VERSION cached in $(dirname "$BIN")"; exit 0; fi
istio_lock $NAME
if cached; then istio_log $NAME "pilot-discovery $ISTIO_VERSION cached in $(dirname "$BIN")"; exit 0; fi

T0=$(date +%s)
istio_module istio.io/istio/pilot/cmd/pilot-discovery
istio_log $NAME "resolved modules in $(( $(date +%s) - T0 ))s"
MODDIR=$(go list -m -f '{{.Dir}}' istio.io/istio)
[[ -f "$MODDIR/manifests/charts/base/files/crd-all.gen.yaml" ]] ||
  { echo "$NAME: no CRDs in $MODDIR" >&2; exit 1; }

istio_log $NAME "building pilot-discovery -> $BIN"
istio_build istio.io/istio/pilot/cmd/pilot-discovery disable_pgv,grpcnotrace,retrynotrace "$BIN"
install -m 0644 "$MODDIR/manifests/charts/base/files/crd-all.gen.yaml" "$CRDS.tmp.$$"
mv -f "$CRDS.tmp.$$" "$CRDS"
istio_log $NAME "built pilot-discovery ($(du -h "$BIN" | cut -f1)) in $(( $(date +%s) - T0 ))s"
echo "$BIN"
