#!/usr/bin/env bash
# The hand check of the real node, as a script, until e2e tests run on it:
# on a node started by `scripts/cluster.sh up`, in a throwaway namespace,
#   1. a pod of the pause image runs, and goes at once on delete (SIGTERM);
#   2. a 2-replica Deployment of a scratch image holding one static binary
#      (etcd: it serves HTTP /health) becomes available, non-root with a
#      read-only root filesystem;
#   3. its ClusterIP Service answers from the host and from another pod;
#   4. a pod reaches the API server through the `kubernetes` Service with its
#      ServiceAccount token;
#   5. the egress guard dropped nothing.
# Prints a timing per step; exits non-zero at the first failure. Leaves the
# cluster up, removes its namespace.
# Usage: scripts/node-smoke.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${REMORA_CLUSTER_DIR:-/var/tmp/remora-cluster}"
NS=remora-smoke

eval "$(bash "$ROOT/scripts/build-k8s.sh" --print-env | sed 's/^/export /')"
export KUBECONFIG="$DIR/admin.kubeconfig"
k() { "$REMORA_K8S_BIN_DIR/kubectl" -n "$NS" "$@"; }

[[ -f "$KUBECONFIG" ]] || { echo "node-smoke: no cluster: run scripts/cluster.sh up" >&2; exit 1; }
now() { date +%s%N; }
ms() { echo $(( ($(now) - $1) / 1000000 )); }
log() { echo "node-smoke: $*"; }
fail() { echo "node-smoke: FAIL: $*" >&2; k get pods -o wide >&2 || true; exit 1; }

cleanup() { k delete namespace "$NS" --wait=false >/dev/null 2>&1 || true; }
trap cleanup EXIT

# Scratch images from static binaries already at hand (no registry here).
bash "$ROOT/scripts/images.sh" static localhost/remora/etcd-probe:dev "$REMORA_ETCD_BIN" >/dev/null 2>&1
bash "$ROOT/scripts/images.sh" static localhost/remora/kubectl-probe:dev "$REMORA_K8S_BIN_DIR/kubectl" >/dev/null 2>&1

# A previous run's namespace may still be terminating.
"$REMORA_K8S_BIN_DIR/kubectl" delete namespace "$NS" --ignore-not-found --wait=true --timeout=90s >/dev/null
"$REMORA_K8S_BIN_DIR/kubectl" create namespace "$NS" >/dev/null
# Pods need the namespace's `default` ServiceAccount (admission refuses them
# before the controller made it).
for _ in $(seq 100); do k get serviceaccount default >/dev/null 2>&1 && break; sleep 0.1; done

t=$(now)
k apply -f - >/dev/null <<'EOF'
apiVersion: v1
kind: Pod
metadata: {name: pause}
spec:
  containers: [{name: pause, image: localhost/remora/pause:dev, imagePullPolicy: Never}]
EOF
k wait --for=condition=Ready pod/pause --timeout=60s >/dev/null || fail "pause pod not Ready"
log "1. pause pod Ready in $(ms "$t") ms"
t=$(now)
k delete pod pause --wait=true --timeout=20s >/dev/null || fail "pause pod not deleted"
log "1. pause pod deleted in $(ms "$t") ms (grace period 30 s: it exited on SIGTERM)"

t=$(now)
k apply -f - >/dev/null <<'EOF'
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  replicas: 2
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      securityContext: {runAsUser: 65535, runAsNonRoot: true}
      containers:
      - name: etcd
        image: localhost/remora/etcd-probe:dev
        imagePullPolicy: Never
        args: ["--data-dir=/data", "--listen-client-urls=http://0.0.0.0:2379",
               "--advertise-client-urls=http://127.0.0.1:2379",
               "--listen-peer-urls=http://127.0.0.1:2380", "--log-level=warn"]
        readinessProbe: {httpGet: {path: /health, port: 2379}, periodSeconds: 1}
        securityContext: {readOnlyRootFilesystem: true, allowPrivilegeEscalation: false}
        volumeMounts: [{name: data, mountPath: /data}]
      volumes: [{name: data, emptyDir: {}}]
---
apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  selector: {app: web}
  ports: [{port: 80, targetPort: 2379}]
EOF
k rollout status deploy/web --timeout=90s >/dev/null || fail "deployment web not available"
log "2. 2-replica Deployment (scratch image, static binary) available in $(ms "$t") ms"

ip=$(k get service web -o jsonpath='{.spec.clusterIP}')
t=$(now)
for _ in $(seq 50); do
  curl -sf -m 2 "http://$ip/health" | grep -q '"health":"true"' && break
  sleep 0.1
done
curl -sf -m 2 "http://$ip/health" | grep -q '"health":"true"' || fail "ClusterIP $ip does not answer from the host"
log "3. ClusterIP $ip answers from the host (after $(ms "$t") ms)"

"$REMORA_K8S_BIN_DIR/kubectl" create rolebinding smoke-view -n "$NS" --clusterrole=view \
  --serviceaccount="$NS:default" >/dev/null
k apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: probe-service}
spec:
  restartPolicy: Never
  securityContext: {runAsUser: 65535}
  containers:
  - name: kubectl
    image: localhost/remora/kubectl-probe:dev
    imagePullPolicy: Never
    args: ["--server=http://$ip", "--request-timeout=5s", "get", "--raw", "/health"]
---
apiVersion: v1
kind: Pod
metadata: {name: probe-api}
spec:
  restartPolicy: Never
  securityContext: {runAsUser: 65535}
  containers:
  - name: kubectl
    image: localhost/remora/kubectl-probe:dev
    imagePullPolicy: Never
    args: ["get", "deployments", "-o", "name"]
EOF
t=$(now)
for p in probe-service probe-api; do
  k wait --for=jsonpath='{.status.phase}'=Succeeded "pod/$p" --timeout=60s >/dev/null ||
    fail "$p did not succeed: $(k logs "$p" 2>&1 | tail -3)"
done
k logs probe-service | grep -q '"health":"true"' || fail "probe-service got: $(k logs probe-service)"
log "3. ClusterIP $ip answers from a pod"
k logs probe-api | grep -qx 'deployment.apps/web' || fail "probe-api got: $(k logs probe-api)"
log "4. a pod reads the API through the kubernetes Service with its token ($(ms "$t") ms for both probes)"

drops=$(bash "$ROOT/scripts/cluster.sh" status | sed -n 's/^egress guard dropped: //p')
[[ "$drops" == 0 ]] || fail "egress guard dropped '$drops' packets"
log "5. egress guard dropped 0 packets"
log "OK"
