#!/usr/bin/env bash
# Builds the images the real node runs and imports them into its containerd
# (the `k8s.io` namespace, where the kubelet's CRI looks). No registry is
# reachable here, so every image is built on this machine.
#
# Today: only the pod sandbox image, localhost/remora/pause:dev, a static C
# program (images/pause/pause.c) alone in a scratch image. The agent,
# injector and test-app images (issue 11) come next.
#
# Usage: scripts/images.sh [pause]      build + import (default: all known)
#        scripts/images.sh --build-only write the OCI archives, no import
#        scripts/images.sh static NAME BINARY [ARGS...]
#            wrap one static binary into a scratch image NAME (entrypoint
#            /<basename> ARGS) and import it: for trying the node by hand.
# Env: REMORA_CLUSTER_DIR (/var/tmp/remora-cluster): the node whose
#      containerd gets the images; REMORA_CACHE for the ctr binary.
# The OCI archives go to $REMORA_CLUSTER_DIR/images/<name>.tar.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLUSTER_DIR="${REMORA_CLUSTER_DIR:-/var/tmp/remora-cluster}"
OUT="$CLUSTER_DIR/images"
PAUSE_IMAGE="localhost/remora/pause:dev"

log() { echo "images: $(date -u +%H:%M:%S) $*"; }

eval "$(bash "$ROOT/scripts/build-k8s.sh" --print-env | sed 's/^/export /')"
CTR="$REMORA_CONTAINERD_BIN_DIR/ctr"
SOCK="$CLUSTER_DIR/containerd/containerd.sock"

sha() { sha256sum "$1" | cut -d' ' -f1; }

# Writes a single-layer OCI image archive by hand (what `buildah push
# oci-archive:` produces, minus buildah): the layer is a reproducible tar of
# $2 (fixed owner, mtime and order, gzip without a timestamp), so the same
# input gives the same image digest and a re-import is a no-op.
# $1 image name, $2 root filesystem dir, $3 archive path, $4.. entrypoint.
oci_archive() {
  local name="$1" rootfs="$2" archive="$3"
  shift 3
  local work layer_tar layer_gz diff_id layer_digest config config_digest manifest manifest_digest entry
  work=$(mktemp -d)
  mkdir -p "$work/blobs/sha256"
  layer_tar="$work/layer.tar"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
    -C "$rootfs" -cf "$layer_tar" .
  diff_id=$(sha "$layer_tar")
  gzip -n -9 -c "$layer_tar" >"$work/layer.tar.gz"
  layer_gz="$work/layer.tar.gz"
  layer_digest=$(sha "$layer_gz")
  mv "$layer_gz" "$work/blobs/sha256/$layer_digest"
  entry=$(printf '%s\n' "$@" | jq -R . | jq -s -c .)
  config=$(jq -n -c --argjson entry "$entry" --arg diff "sha256:$diff_id" '{
    architecture: "amd64", os: "linux",
    config: {Entrypoint: $entry, User: "65535:65535", WorkingDir: "/"},
    rootfs: {type: "layers", diff_ids: [$diff]},
    history: [{created_by: "scripts/images.sh"}]}')
  printf '%s' "$config" >"$work/config.json"
  config_digest=$(sha "$work/config.json")
  mv "$work/config.json" "$work/blobs/sha256/$config_digest"
  manifest=$(jq -n -c \
    --arg cd "sha256:$config_digest" --argjson cs "$(stat -c %s "$work/blobs/sha256/$config_digest")" \
    --arg ld "sha256:$layer_digest" --argjson ls "$(stat -c %s "$work/blobs/sha256/$layer_digest")" '{
    schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json",
    config: {mediaType: "application/vnd.oci.image.config.v1+json", digest: $cd, size: $cs},
    layers: [{mediaType: "application/vnd.oci.image.layer.v1.tar+gzip", digest: $ld, size: $ls}]}')
  printf '%s' "$manifest" >"$work/manifest.json"
  manifest_digest=$(sha "$work/manifest.json")
  mv "$work/manifest.json" "$work/blobs/sha256/$manifest_digest"
  # containerd names the imported image after io.containerd.image.name.
  jq -n -c --arg md "sha256:$manifest_digest" \
    --argjson ms "$(stat -c %s "$work/blobs/sha256/$manifest_digest")" --arg name "$name" '{
    schemaVersion: 2, mediaType: "application/vnd.oci.image.index.v1+json",
    manifests: [{mediaType: "application/vnd.oci.image.manifest.v1+json", digest: $md, size: $ms,
      platform: {architecture: "amd64", os: "linux"},
      annotations: {"io.containerd.image.name": $name,
        "org.opencontainers.image.ref.name": ($name | sub(".*:"; ""))}}]}' >"$work/index.json"
  echo '{"imageLayoutVersion":"1.0.0"}' >"$work/oci-layout"
  rm -f "$layer_tar"
  mkdir -p "$(dirname "$archive")"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
    -C "$work" -cf "$archive.tmp" oci-layout index.json blobs
  mv -f "$archive.tmp" "$archive"
  rm -rf "$work"
  log "wrote $archive ($name, manifest sha256:${manifest_digest:0:12})"
}

build_pause() {
  command -v gcc >/dev/null || { echo "images: gcc not found (apt-get install gcc libc6-dev)" >&2; exit 1; }
  local rootfs
  rootfs=$(mktemp -d)
  # Static: a scratch image has no libc. -s keeps it small (~700 KiB).
  gcc -static -s -O2 -Wall -Wextra -Werror -o "$rootfs/pause" "$ROOT/images/pause/pause.c"
  chmod 0755 "$rootfs/pause"
  oci_archive "$PAUSE_IMAGE" "$rootfs" "$OUT/pause.tar" /pause
  rm -rf "$rootfs"
}

import() {
  local archive="$1"
  [[ -S "$SOCK" ]] || { echo "images: no containerd at $SOCK: run scripts/cluster.sh up first" >&2; exit 1; }
  "$CTR" --address "$SOCK" -n k8s.io images import --platform linux/amd64 "$archive" >/dev/null
  log "imported $(basename "$archive") into containerd (k8s.io)"
}

# $1 image name, $2 a statically linked binary, rest: default arguments.
static_image() {
  local name="$1" bin="$2" rootfs base
  shift 2
  [[ -x "$bin" ]] || { echo "images: $bin is not an executable" >&2; exit 1; }
  if ldd "$bin" >/dev/null 2>&1; then
    echo "images: $bin is dynamically linked; a scratch image has no libc" >&2
    exit 1
  fi
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

BUILD_ONLY=0
WANT=()
for arg in "$@"; do
  case "$arg" in
    --build-only) BUILD_ONLY=1 ;;
    pause) WANT+=("$arg") ;;
    *) echo "images: unknown argument $arg (usage: images.sh [--build-only] [pause])" >&2; exit 2 ;;
  esac
done
((${#WANT[@]})) || WANT=(pause)

for img in "${WANT[@]}"; do
  "build_$img"
  ((BUILD_ONLY)) || import "$OUT/$img.tar"
done
