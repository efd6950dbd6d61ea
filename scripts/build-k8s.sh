#!/usr/bin/env bash
# Builds the real Kubernetes control plane the e2e harness starts
# (kube-apiserver, kube-controller-manager, etcd) from the Go module proxy,
# once, into a cache outside the repository keyed by version:
#
#   ${REMORA_CACHE:-$HOME/.cache/remora}/k8s/<K8S_VERSION>/bin/{kube-apiserver,kube-controller-manager}
#   ${REMORA_CACHE:-$HOME/.cache/remora}/etcd/<ETCD_VERSION>/bin/etcd
#
# With --node it also builds what a real single-node cluster needs
# (scripts/cluster.sh), cached the same way:
#
#   .../k8s/<K8S_VERSION>/bin/{kubelet,kube-scheduler,kube-proxy,kubectl}
#   .../containerd/<CONTAINERD_VERSION>/bin/{containerd,containerd-shim-runc-v2,ctr}
#   .../cni/<CNI_VERSION>/bin/{bridge,host-local,loopback,portmap}
#
# and installs runc, buildah and gcc from Debian (apt). Without --node nothing of that is
# built: scripts/test.sh (CI) runs the default, control plane only.
#
# A binary already in the cache is not rebuilt, so a warm run takes a second.
# Usage: scripts/build-k8s.sh [--node] [--print-env]
#   --node       also build the node binaries listed above
#   --print-env  only print the env vars the e2e harness and cluster.sh read
#                (all paths, node ones included), then exit
# Env: K8S_VERSION (v1.36.3), ETCD_VERSION (v3.6.16), CONTAINERD_VERSION
#      (v2.2.9), CNI_VERSION (v1.9.1), REMORA_CACHE,
#      BUILD_NICE (10: the build shares the machine with cargo).
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.36.3}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
CONTAINERD_VERSION="${CONTAINERD_VERSION:-v2.2.9}"
CNI_VERSION="${CNI_VERSION:-v1.9.1}"
CACHE="${REMORA_CACHE:-$HOME/.cache/remora}"
K8S_BIN="$CACHE/k8s/$K8S_VERSION/bin"
ETCD_BIN="$CACHE/etcd/$ETCD_VERSION/bin"
CONTAINERD_BIN="$CACHE/containerd/$CONTAINERD_VERSION/bin"
CNI_BIN="$CACHE/cni/$CNI_VERSION/bin"
NICE="${BUILD_NICE:-10}"

NODE=0
PRINT_ENV=0
for arg in "$@"; do
  case "$arg" in
    --node) NODE=1 ;;
    --print-env) PRINT_ENV=1 ;;
    *) echo "build-k8s: unknown argument $arg (usage: build-k8s.sh [--node] [--print-env])" >&2; exit 2 ;;
  esac
done

print_env() {
  echo "REMORA_K8S_BIN_DIR=$K8S_BIN"
  echo "REMORA_ETCD_BIN=$ETCD_BIN/etcd"
  echo "REMORA_CONTAINERD_BIN_DIR=$CONTAINERD_BIN"
  echo "REMORA_CNI_BIN_DIR=$CNI_BIN"
}

if ((PRINT_ENV)); then
  print_env
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

# $@: the kubernetes commands wanted (cmd/<name> of k8s.io/kubernetes).
build_k8s() {
  local need=() want=("$@")
  for b in "${want[@]}"; do
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
  local pkgs=("k8s.io/kubernetes@$K8S_VERSION")
  for b in "${want[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b@$K8S_VERSION"); done
  nice -n "$NICE" go get "${pkgs[@]}"
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

build_containerd() {
  local b stale=0
  for b in containerd containerd-shim-runc-v2 ctr; do
    [[ -x "$CONTAINERD_BIN/$b" ]] || stale=1
  done
  if ((stale == 0)); then
    log "containerd $CONTAINERD_VERSION cached in $CONTAINERD_BIN"
    return
  fi
  local t0 dir mod=github.com/containerd/containerd/v2
  t0=$(date +%s)
  dir="$CACHE/containerd/$CONTAINERD_VERSION/src"
  scratch_module "$dir" remora.invalid/containerd-build
  cd "$dir"
  nice -n "$NICE" go get "$mod@$CONTAINERD_VERSION" "$mod/cmd/containerd@$CONTAINERD_VERSION" \
    "$mod/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION" "$mod/cmd/ctr@$CONTAINERD_VERSION"
  log "resolved containerd modules in $(( $(date +%s) - t0 ))s"
  # Static (CGO off): the btrfs snapshotter needs cgo and is left out, which
  # is fine, the node uses overlayfs. The version ldflags make `containerd
  # --version` and the CRI's reported version the pinned release.
  local ldflags="-s -w -X $mod/version.Version=$CONTAINERD_VERSION -X $mod/version.Package=github.com/containerd/containerd/v2"
  for b in containerd containerd-shim-runc-v2 ctr; do
    [[ -x "$CONTAINERD_BIN/$b" ]] || build_one "$CONTAINERD_BIN/$b" "$mod/cmd/$b" "$ldflags"
  done
  log "containerd $CONTAINERD_VERSION done in $(( $(date +%s) - t0 ))s"
}

build_cni() {
  local b stale=0
  local -A pkg=([bridge]=plugins/main/bridge [loopback]=plugins/main/loopback
    [host-local]=plugins/ipam/host-local [portmap]=plugins/meta/portmap)
  for b in "${!pkg[@]}"; do
    [[ -x "$CNI_BIN/$b" ]] || stale=1
  done
  if ((stale == 0)); then
    log "CNI plugins $CNI_VERSION cached in $CNI_BIN"
    return
  fi
  local t0 dir mod=github.com/containernetworking/plugins
  t0=$(date +%s)
  dir="$CACHE/cni/$CNI_VERSION/src"
  scratch_module "$dir" remora.invalid/cni-build
  cd "$dir"
  local gets=("$mod@$CNI_VERSION")
  for b in "${!pkg[@]}"; do gets+=("$mod/${pkg[$b]}@$CNI_VERSION"); done
  nice -n "$NICE" go get "${gets[@]}"
  for b in "${!pkg[@]}"; do
    [[ -x "$CNI_BIN/$b" ]] || build_one "$CNI_BIN/$b" "$mod/${pkg[$b]}" \
      "-s -w -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion=$CNI_VERSION"
  done
  log "CNI plugins $CNI_VERSION done in $(( $(date +%s) - t0 ))s"
}

# runc, iptables (kube-proxy, the guard rule), conntrack (kube-proxy's
# cleanup of stale UDP entries), buildah (scripts/images.sh builds the
# project's Dockerfiles with it) and gcc (the pause binary) come from Debian:
# maintained packages, and runc needs libseccomp, which a CGO-free module
# build would lack. buildah is pinned: image builds must not change under us.
BUILDAH_DEB_VERSION=1.28.2+ds1-3+deb12u1+b3
install_debian_parts() {
  local missing=()
  command -v runc >/dev/null || missing+=(runc)
  command -v iptables >/dev/null || missing+=(iptables)
  command -v conntrack >/dev/null || missing+=(conntrack)
  command -v gcc >/dev/null || missing+=(gcc libc6-dev)
  [[ "$(dpkg-query -W -f='${Version}' buildah 2>/dev/null)" == "$BUILDAH_DEB_VERSION" ]] ||
    missing+=("buildah=$BUILDAH_DEB_VERSION")
  if ((${#missing[@]} == 0)); then
    log "runc, iptables, conntrack, gcc, buildah installed ($(runc --version | head -1); buildah $BUILDAH_DEB_VERSION)"
    return
  fi
  command -v apt-get >/dev/null || { echo "build-k8s: need ${missing[*]} and there is no apt-get" >&2; exit 1; }
  log "installing ${missing[*]} from Debian"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
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
build_k8s kube-apiserver kube-controller-manager
if ((NODE)); then
  # The quick ones first, so a partial cache can already run containers.
  install_debian_parts
  build_containerd
  build_cni
  # kubelet first: it pulls in most of what the other three need.
  build_k8s kube-apiserver kube-controller-manager kubelet kube-scheduler kube-proxy kubectl
  log "all done (with the node) in $(( $(date +%s) - T0 ))s"
  print_env
else
  log "all done in $(( $(date +%s) - T0 ))s"
  echo "REMORA_K8S_BIN_DIR=$K8S_BIN"
  echo "REMORA_ETCD_BIN=$ETCD_BIN/etcd"
fi
