#!/usr/bin/env bash
# Sets everything up, then shows the whole system on a real single-node
# Kubernetes cluster started on this machine: build (Kubernetes, containerd
# and CNI from source, cached; Remora's binaries), `cluster.sh up`, the
# images (buildah, from the project's Dockerfiles), `helm install` of
# charts/remora, an injected Deployment of the test app under load through a
# ClusterIP Service, a rolling restart, and a short report (requests, lost,
# how each pod stopped); then `cluster.sh down`.
#
# Usage: scripts/demo.sh [--mode Legacy|Native] [--rate N] [--replicas N]
#        scripts/demo.sh --agent-only   the quick local demo, no Kubernetes:
#            remora-agent supervising a real Envoy in front of a small app,
#            traffic, a SIGTERM drain, a report (about a minute when built)
# Env: REMORA_KEEP_CLUSTER=1 leaves the node up (a node that was already up
# before this script is always left up).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

if [[ "${1:-}" == --agent-only ]]; then
  # `cargo run`, not a path under target/: CARGO_TARGET_DIR may move it.
  cargo build --locked --release -p remora-agent -p remora-test-app -p e2e --bins
  exec cargo run --locked --release --quiet -p e2e --bin demo
fi

bash scripts/build-k8s.sh --node
cargo build --locked --release -p remora-agent --bin remora-agent \
  -p remora-operator --bin remora-operator -p remora-test-app --bin test-app -p e2e --bin node-demo

was_up=0
bash scripts/cluster.sh status 2>/dev/null | grep -q '^kubelet: running' && was_up=1
down() {
  if ((was_up == 0)) && [[ "${REMORA_KEEP_CLUSTER:-}" != 1 ]]; then
    bash scripts/cluster.sh down
  fi
}
trap down EXIT
bash scripts/cluster.sh up | tail -n 1
bash scripts/images.sh
cargo run --locked --release --quiet -p e2e --bin node-demo -- "$@"
