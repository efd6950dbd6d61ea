# Sourced by scripts/build-pilot-agent.sh and scripts/build-pilot-discovery.sh:
# the one place that says which Istio is built and how its module resolves.
#
# The Go module proxy here serves no Istio release tag, only pseudo-versions;
# ISTIO_VERSION is a commit on release-1.31 (1.31.0-rc.0 and later). Four
# dependency versions it pins are not served either: a scratch module
# requires it and replaces them with served ones (/work/shared/PEERS.md).
#
# Defines ISTIO_VERSION, ISTIO_CACHE (the cache dir outside the repository,
# keyed by version), BUILD_NICE, and:
#   istio_log NAME MSG...          timestamped progress line
#   istio_lock NAME                serialise two runs (two worktrees) of NAME
#   istio_module PACKAGE...        fill the scratch module ($ISTIO_CACHE/src-<first
#                                  package's base name>), cd into it, `go get` the packages
#   istio_build PACKAGE TAGS OUT   static build with Istio's release flags, to a
#                                  temp file renamed onto OUT (an interrupted build
#                                  never leaves a half-written binary that a later
#                                  run would take for a cached one)
# shellcheck shell=bash

ISTIO_VERSION="${ISTIO_VERSION:-v0.0.0-20260827124520-eed52ebb66ad}"
ISTIO_CACHE="${REMORA_CACHE:-$HOME/.cache/remora}/istio/$ISTIO_VERSION"
BUILD_NICE="${BUILD_NICE:-10}"

istio_log() {
  local name=$1
  shift
  echo "$name: $(date -u +%H:%M:%S) $*"
}

istio_lock() {
  mkdir -p "$ISTIO_CACHE"
  if command -v flock >/dev/null; then
    exec 9>"$ISTIO_CACHE/../.$1.lock"
    flock 9
  fi
}

istio_module() {
  command -v go >/dev/null || { echo "istio-module: go not found on PATH" >&2; return 1; }
  local src
  src="$ISTIO_CACHE/src-$(basename "$1")"
  rm -rf "$src"
  mkdir -p "$src"
  cd "$src"
  # go-control-plane's pseudo-versions that commit pins and istio.io/{api,
  # client-go} at their 1.31.1 release: the nearest ones the proxy serves.
  local gcp_pseudo=0.20260729145720-a2d8c7492908
  cat >go.mod <<MOD
module remora.invalid/istio-build

go 1.26.0

replace (
	github.com/envoyproxy/go-control-plane/contrib => github.com/envoyproxy/go-control-plane/contrib v1.36.1-$gcp_pseudo
	github.com/envoyproxy/go-control-plane/envoy => github.com/envoyproxy/go-control-plane/envoy v1.37.1-$gcp_pseudo
	istio.io/api => istio.io/api v1.31.1
	istio.io/client-go => istio.io/client-go v1.31.1
)
MOD
  local args=("istio.io/istio@$ISTIO_VERSION")
  local pkg
  for pkg in "$@"; do args+=("$pkg@$ISTIO_VERSION"); done
  nice -n "$BUILD_NICE" go get "${args[@]}"
}

istio_build() {
  local pkg=$1 tags=$2 out=$3
  mkdir -p "$(dirname "$out")"
  CGO_ENABLED=0 nice -n "$BUILD_NICE" go build -trimpath \
    -tags="$tags" \
    -ldflags "-s -w -X istio.io/istio/pkg/version.buildVersion=$ISTIO_VERSION" \
    -o "$out.tmp.$$" "$pkg"
  mv -f "$out.tmp.$$" "$out"
}
