#!/usr/bin/env bash
# Builds the real Kubernetes control plane the e2e harness starts
# (kube-apiserver, kube-controller-manager, etcd) from the Go module proxy,
# once, into a cache outside the repository keyed by version:
#
#   ${REMORA_CACHE:-$HOME/.cache/remora}/k8s/<K8S_VERSION>/bin/{kube-apiserver,kube-controller-manager}
#   ${REMORA_CACHE:-$HOME/.cache/remora}/etcd/<ETCD_VERSION>/bin/etcd
#
# A binary already in the cache is not rebuilt, so a warm run takes a second.
# Usage: scripts/build-k8s.sh [--print-env]
#   --print-env  only print the env vars the e2e harness reads, then exit
# Env: K8S_VERSION (v1.36.3), ETCD_VERSION (v3.6.16), REMORA_CACHE,
#      BUILD_NICE (10: the build shares the machine with cargo).
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.36.3}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
CACHE="${REMORA_CACHE:-$HOME/.cache/remora}"
K8S_BIN="$CACHE/k8s/$K8S_VERSION/bin"
ETCD_BIN="$CACHE/etcd/$ETCD_VERSION/bin"
NICE="${BUILD_NICE:-10}"

if [[ "${1:-}" == "--print-env" ]]; then
  echo "REMORA_K8S_BIN_DIR=$K8S_BIN"
  echo "REMORA_ETCD_BIN=$ETCD_BIN/etcd"
  exit 0
fi

command -v go >/dev/null || { echo "build-k8s: go not found on PATH" >&2; exit 1; }

log() { echo "build-k8s: $(date -u +%H:%M:%S) $*"; }

# The staging modules are published as k8s.io/<name> v0.X.Y for kubernetes vX.Y.
STAGING_VERSION="v0.${K8S_VERSION#v1.}"
K8S_MINOR="${K8S_VERSION#v1.}"; K8S_MINOR="${K8S_MINOR%%.*}"

# Builds into a temp file and renames, so an interrupted build never leaves a
# half-written binary that a later run would take for a cached one.
# $1 output path, $2 package, $3 ldflags; runs inside the scratch module.
build_one() {
  local out="$1" pkg="$2" ldflags="$3" start
  start=$(date +%s)
  log "building $pkg -> $out"
  mkdir -p "$(dirname "$out")"
  CGO_ENABLED=0 nice -n "$NICE" go build -trimpath -ldflags "$ldflags" -o "$out.tmp.$$" "$pkg"
  mv -f "$out.tmp.$$" "$out"
  log "built $(basename "$out") in $(( $(date +%s) - start ))s"
}

# A scratch module under the cache, so `go get` can record requirements and
# go.sum without touching the repository.
scratch_module() {
  local dir="$1" name="$2"
  rm -rf "$dir"
  mkdir -p "$dir"
  printf 'module %s\n\ngo 1.26.0\n' "$name" >"$dir/go.mod"
}

build_k8s() {
  local need=()
  for b in kube-apiserver kube-controller-manager; do
    [[ -x "$K8S_BIN/$b" ]] || need+=("$b")
  done
  if ((${#need[@]} == 0)); then
    log "kubernetes $K8S_VERSION cached in $K8S_BIN"
    return
  fi
  local t0 dir gomod
  t0=$(date +%s)
  dir="$CACHE/k8s/$K8S_VERSION/src"
  scratch_module "$dir" remora.invalid/k8s-build
  cd "$dir"
  # Replace lines only apply in the main module, so k8s.io/kubernetes' own
  # `k8s.io/<x> => ./staging/...` lines are lost to a dependent module:
  # regenerate them from that release's go.mod, pointing at the published
  # staging versions.
  gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
  [[ -f "$gomod" ]] || { echo "build-k8s: no go.mod for k8s.io/kubernetes@$K8S_VERSION" >&2; exit 1; }
  {
    echo
    echo "replace ("
    sed -n "s#^[[:space:]]*\(k8s.io/[^[:space:]]*\)[[:space:]]*=>[[:space:]]*\./staging/.*#\t\1 => \1 $STAGING_VERSION#p" "$gomod"
    echo ")"
  } >>go.mod
  local n
  n=$(grep -c "=> k8s.io/.* $STAGING_VERSION" go.mod || true)
  ((n > 0)) || { echo "build-k8s: found no staging replace lines in $gomod" >&2; exit 1; }
  log "pinned $n staging modules to $STAGING_VERSION"
  nice -n "$NICE" go get "k8s.io/kubernetes@$K8S_VERSION" \
    "k8s.io/kubernetes/cmd/kube-apiserver@$K8S_VERSION" \
    "k8s.io/kubernetes/cmd/kube-controller-manager@$K8S_VERSION"
  log "resolved modules in $(( $(date +%s) - t0 ))s"

  # What hack/lib/version.sh sets, so /version reports the pinned release.
  local ldflags="-s -w" key val
  for kv in "gitVersion=$K8S_VERSION" "gitMajor=1" "gitMinor=$K8S_MINOR" \
    "gitTreeState=clean" "buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"; do
    key=${kv%%=*}; val=${kv#*=}
    ldflags+=" -X k8s.io/component-base/version.$key=$val -X k8s.io/client-go/pkg/version.$key=$val"
  done
  for b in "${need[@]}"; do
    build_one "$K8S_BIN/$b" "k8s.io/kubernetes/cmd/$b" "$ldflags"
  done
  log "kubernetes $K8S_VERSION done in $(( $(date +%s) - t0 ))s"
}

build_etcd() {
  if [[ -x "$ETCD_BIN/etcd" ]]; then
    log "etcd $ETCD_VERSION cached in $ETCD_BIN"
    return
  fi
  local t0 dir
  t0=$(date +%s)
  dir="$CACHE/etcd/$ETCD_VERSION/src"
  scratch_module "$dir" remora.invalid/etcd-build
  cd "$dir"
  # The etcd binary is the main package at the root of the server module;
  # `go install mod@ver` refuses it because its go.mod has replace lines.
  nice -n "$NICE" go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  build_one "$ETCD_BIN/etcd" go.etcd.io/etcd/server/v3 "-s -w"
  log "etcd $ETCD_VERSION done in $(( $(date +%s) - t0 ))s"
}

# Two runs (say CI and a developer, or two worktrees) would build the same
# thing twice; the second waits and then finds the cache filled.
mkdir -p "$CACHE"
if command -v flock >/dev/null; then
  exec 9>"$CACHE/.build-k8s.lock"
  flock 9
fi

T0=$(date +%s)
# etcd first: it is the quick one, and a partial cache is still useful.
build_etcd
build_k8s
log "all done in $(( $(date +%s) - T0 ))s"
echo "REMORA_K8S_BIN_DIR=$K8S_BIN"
echo "REMORA_ETCD_BIN=$ETCD_BIN/etcd"
