#!/usr/bin/env bash
# A real single-node Kubernetes cluster on this machine: etcd, kube-apiserver
# (Node,RBAC), kube-controller-manager, kube-scheduler, containerd + runc,
# the kubelet, kube-proxy (iptables) and the CNI bridge. What was learned
# about these machines is in ../shared/REAL-NODE.md of the workspace.
#
# Usage: scripts/cluster.sh up|down|status
#   up      start it (binaries from scripts/build-k8s.sh --node); the last
#           line printed is `export KUBECONFIG=<path>`
#   down    stop it and undo every change made to the host
#   status  what runs, the node, the egress guard's counter
# Env: REMORA_CLUSTER_DIR (/var/tmp/remora-cluster) holds all state, PKI,
#      configs and logs (logs/<component>.log); REMORA_NODE_NAME
#      (remora-node); REMORA_NODE_IP (10.99.0.1); REMORA_POD_CIDR
#      (10.244.0.0/24); REMORA_SERVICE_CIDR (10.96.0.0/24).
#
# Host changes made by `up`, each recorded under $DIR/host so `down` undoes
# exactly those: the node IP as a /32 on lo; the sysctls the kubelet and
# kube-proxy write (saved values); the bridge remora0; iptables chains
# (KUBE-*, REMORA-*); kubepods cgroups; mounts under the state dir and the
# network namespaces; the few hard-coded directories the parts create
# outside the state dir (removed only if `up` found them absent).
#
# Network rule: pod and Service addresses exist only on this machine. The
# REMORA-GUARD chain in mangle POSTROUTING drops anything from or to those
# ranges that would leave through a non-loopback interface other than the
# bridge; `status` and `down` report its counter, which must stay 0.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${REMORA_CLUSTER_DIR:-/var/tmp/remora-cluster}"
NODE_NAME="${REMORA_NODE_NAME:-remora-node}"
NODE_IP="${REMORA_NODE_IP:-10.99.0.1}"
POD_CIDR="${REMORA_POD_CIDR:-10.244.0.0/24}"
SERVICE_CIDR="${REMORA_SERVICE_CIDR:-10.96.0.0/24}"
# The first address of the service range is the `kubernetes` Service.
API_SERVICE_IP="${SERVICE_CIDR%.*/*}.1"
SVC_LINK=remora-svc
BRIDGE=remora0
API_PORT=6443
# Off the usual 2379/2380, so an etcd someone else runs on this host does not
# collide with this one.
ETCD_CLIENT=127.0.0.1:12379
ETCD_PEER=127.0.0.1:12380

PKI="$DIR/pki"
LOGS="$DIR/logs"
PIDS="$DIR/pids"
HOST="$DIR/host"
CTRD="$DIR/containerd"
CTRD_SOCK="$CTRD/containerd.sock"
KUBELET_ROOT="$DIR/kubelet"
CNI_CONF="$DIR/cni/net.d"
ADMIN_KUBECONFIG="$DIR/admin.kubeconfig"

# Sysctls the kubelet (protectKernelDefaults: false) and kube-proxy set, and
# ip_forward (pod -> ClusterIP -> pod is routed through the host).
SYSCTLS=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
  kernel.keys.root_maxkeys kernel.keys.root_maxbytes net.ipv4.ip_forward
  net.ipv4.conf.all.route_localnet)
# Paths compiled into the parts that no flag moves. Removed by `down` only if
# `up` did not find them (recorded in $HOST/created-dirs).
HARDCODED_DIRS=(/run/containerd /var/lib/cni /var/log/containers /var/log/pods
  /var/lib/kubelet /usr/libexec/kubernetes /etc/cni/net.d /opt/cni /opt/containerd)

log() { echo "cluster: $(date -u +%H:%M:%S.%2N) $*" >&2; }
die() { log "error: $*"; exit 1; }

bins() {
  eval "$(bash "$ROOT/scripts/build-k8s.sh" --print-env | sed 's/^/export /')"
  K8S="$REMORA_K8S_BIN_DIR"
  ETCD="$REMORA_ETCD_BIN"
  CTRD_BIN="$REMORA_CONTAINERD_BIN_DIR"
  CNI_BIN="$REMORA_CNI_BIN_DIR"
  KUBECTL="$K8S/kubectl"
}

need_bins() {
  local b missing=()
  for b in "$K8S"/{kube-apiserver,kube-controller-manager,kube-scheduler,kubelet,kube-proxy,kubectl} \
    "$ETCD" "$CTRD_BIN"/{containerd,containerd-shim-runc-v2,ctr} "$CNI_BIN"/{bridge,host-local,loopback,portmap}; do
    [[ -x "$b" ]] || missing+=("$b")
  done
  ((${#missing[@]} == 0)) || die "missing ${missing[*]}: run scripts/build-k8s.sh --node"
  local t
  for t in runc iptables ip6tables conntrack openssl gcc jq; do
    command -v "$t" >/dev/null || die "$t not found (scripts/build-k8s.sh --node installs runc, iptables, conntrack)"
  done
}

[[ $(id -u) == 0 ]] || die "must run as root (a node owns cgroups, mounts, iptables)"

# ---------------------------------------------------------------- processes

# Alive and not a zombie: PID 1 of these sandboxes reaps orphans only every
# couple of seconds, and `kill -0` succeeds on a zombie.
alive() {
  local st
  st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [[ -n "$st" && "$st" != Z ]]
}

# The pid of a component started by `start`, if it still runs (and the pid
# was not reused by something else: its command must be the component).
pid_of() {
  local f="$PIDS/$1.pid" pid
  [[ -f "$f" ]] || return 1
  pid=$(<"$f")
  alive "$pid" || return 1
  [[ "$(basename "$(tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | head -1)")" == "$1" ]] || return 1
  echo "$pid"
}

# $1 name, rest: command. Detached into its own session so the caller's
# terminal (or CI step) ending does not signal it; output in logs/<name>.log.
start() {
  local name="$1"
  shift
  if pid_of "$name" >/dev/null; then
    log "$name already running (pid $(pid_of "$name"))"
    return
  fi
  setsid "$@" >>"$LOGS/$name.log" 2>&1 </dev/null &
  local pid=$! i
  echo "$pid" >"$PIDS/$name.pid"
  # Until setsid has exec'd, /proc/<pid>/cmdline still names bash, and
  # check_alive would take the component for dead; wait (2 s at most) until
  # the process is the component or is gone.
  for ((i = 0; i < 20; i++)); do
    pid_of "$name" >/dev/null && break
    alive "$pid" || break
    sleep 0.1
  done
  log "started $name (pid $pid), log $LOGS/$name.log"
}

# SIGTERM to all the named components at once, up to STOP_WAIT s (10),
# then SIGKILL.
stop() {
  local name pid i names=() pids=()
  for name in "$@"; do
    if pid=$(pid_of "$name"); then
      kill -TERM "$pid" 2>/dev/null || true
      names+=("$name")
      pids+=("$pid")
    fi
    rm -f "$PIDS/$name.pid"
  done
  for ((i = 0; i < ${STOP_WAIT:-10} * 10; i++)); do
    local left=0
    for pid in "${pids[@]}"; do alive "$pid" && left=1; done
    ((left)) || break
    sleep 0.1
  done
  for i in "${!pids[@]}"; do
    if alive "${pids[$i]}"; then
      log "${names[$i]} did not stop in ${STOP_WAIT:-10}s, killing"
      kill -KILL "${pids[$i]}" 2>/dev/null || true
    fi
  done
  ((${#names[@]} == 0)) || log "stopped ${names[*]}"
}

# Fails at once, with the end of its log, when a started component exited
# (rather than waiting out a timeout for something that cannot come).
check_alive() {
  local f name
  for f in "$PIDS"/*.pid; do
    [[ -e "$f" ]] || continue
    name=$(basename "$f" .pid)
    if ! pid_of "$name" >/dev/null; then
      tail -n 5 "$LOGS/$name.log" >&2 || true
      die "$name exited (log $LOGS/$name.log; scripts/cluster.sh down cleans up)"
    fi
  done
}

# $1 what, $2 timeout s, rest: a command that succeeds when ready.
wait_for() {
  local what="$1" timeout="$2" i
  shift 2
  for ((i = 0; i < timeout * 10; i++)); do
    if "$@" >/dev/null 2>&1; then
      return 0
    fi
    check_alive
    sleep 0.1
  done
  die "$what not ready after ${timeout}s (see $LOGS; scripts/cluster.sh down cleans up)"
}

# ---------------------------------------------------------------- PKI

# Certificates, kubeconfigs and the control plane's flags: one
# implementation with the tests' local API servers (e2e::controlplane).
source "$ROOT/scripts/lib/controlplane.sh"
export CP_PROFILE=node CP_DIR="$DIR" CP_PKI="$PKI" CP_BIND="$NODE_IP" CP_PORT="$API_PORT" \
  CP_ETCD_CLIENT="$ETCD_CLIENT" CP_ETCD_PEER="$ETCD_PEER" CP_SERVICE_CIDR="$SERVICE_CIDR" \
  CP_API_SERVICE_IP="$API_SERVICE_IP" CP_NODE_NAME="$NODE_NAME" \
  CP_ISSUER="https://kubernetes.default.svc.cluster.local"
API_URL="https://$NODE_IP:$API_PORT"
# A flag function's lines into the caller's `flags` (failing as it fails).
flags_of() {
  local out
  out=$("$@") || die "$1 failed"
  mapfile -t flags <<<"$out"
}

# ---------------------------------------------------------------- host state

record_dirs() {
  [[ -f "$HOST/created-dirs" ]] && return
  local d
  : >"$HOST/created-dirs.tmp"
  for d in "${HARDCODED_DIRS[@]}"; do
    [[ -e "$d" ]] || echo "$d" >>"$HOST/created-dirs.tmp"
  done
  mv "$HOST/created-dirs.tmp" "$HOST/created-dirs"
}

save_sysctls() {
  [[ -f "$HOST/sysctls" ]] && return
  local k
  : >"$HOST/sysctls.tmp"
  for k in "${SYSCTLS[@]}"; do
    echo "$k=$(sysctl -n "$k")" >>"$HOST/sysctls.tmp"
  done
  mv "$HOST/sysctls.tmp" "$HOST/sysctls"
}

restore_sysctls() {
  [[ -f "$HOST/sysctls" ]] || return 0
  local line k v now
  while IFS= read -r line; do
    k=${line%%=*}
    v=${line#*=}
    now=$(sysctl -n "$k" 2>/dev/null || true)
    if [[ "$now" != "$v" ]]; then
      sysctl -q -w "$k=$v" >/dev/null || log "could not restore $k=$v"
      log "restored $k=$v (was $now)"
    fi
  done <"$HOST/sysctls"
  rm -f "$HOST/sysctls"
}

# Everything that leaves through an interface other than lo and the pod
# bridge leaves this machine (eth0, and any link added later: the rule names
# the two allowed ones rather than the others). In mangle POSTROUTING, i.e.
# after routing and before any SNAT, so the pod/Service addresses are still
# visible; a guard in filter OUTPUT wrongly matched ClusterIP traffic before
# DNAT.
add_guard() {
  iptables -t mangle -N REMORA-GUARD 2>/dev/null || true
  iptables -t mangle -F REMORA-GUARD
  iptables -t mangle -A REMORA-GUARD -o lo -j RETURN
  iptables -t mangle -A REMORA-GUARD -o "$BRIDGE" -j RETURN
  iptables -t mangle -A REMORA-GUARD -o "$SVC_LINK" -j RETURN
  local cidr
  for cidr in "$POD_CIDR" "$SERVICE_CIDR" "$NODE_IP/32"; do
    iptables -t mangle -A REMORA-GUARD -s "$cidr" -j DROP
    iptables -t mangle -A REMORA-GUARD -d "$cidr" -j DROP
  done
  iptables -t mangle -C POSTROUTING -j REMORA-GUARD 2>/dev/null ||
    iptables -t mangle -I POSTROUTING 1 -j REMORA-GUARD
  log "egress guard: mangle POSTROUTING -> REMORA-GUARD drops $POD_CIDR, $SERVICE_CIDR, $NODE_IP leaving by any link but lo, $BRIDGE and $SVC_LINK"
}

# Packets the guard dropped (must be 0); empty when the chain is absent.
guard_count() {
  iptables -t mangle -L REMORA-GUARD -v -x -n 2>/dev/null |
    awk 'NR == 1 {seen = 1} $3 == "DROP" {n += $1} END {if (seen) print n + 0}'
}

# Removes every KUBE-* and REMORA-* chain (kube-proxy, kubelet, the guard)
# and the jumps to them from the built-in chains, for IPv4 and IPv6.
clean_iptables() {
  local tool t line chain
  for tool in iptables ip6tables; do
    command -v "$tool-save" >/dev/null || continue
    for t in filter nat mangle raw; do
      { "$tool-save" -t "$t" 2>/dev/null | grep -E '^-A [A-Z]+ .*-j (KUBE-|REMORA-)' || true; } | while IFS= read -r line; do
        eval "$tool -t $t -D ${line#-A }" 2>/dev/null || true
      done
      for chain in $("$tool-save" -t "$t" 2>/dev/null | sed -n 's/^:\(\(KUBE\|REMORA\)-[^ ]*\).*/\1/p'); do
        "$tool" -t "$t" -F "$chain" 2>/dev/null || true
      done
      for chain in $("$tool-save" -t "$t" 2>/dev/null | sed -n 's/^:\(\(KUBE\|REMORA\)-[^ ]*\).*/\1/p'); do
        "$tool" -t "$t" -X "$chain" 2>/dev/null || true
      done
    done
  done
}

# Unmounts everything under $1, deepest first.
umount_under() {
  local m
  awk -v p="$1" '$5 == p || index($5, p "/") == 1 {print $5}' /proc/self/mountinfo | sort -r | while IFS= read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "could not unmount $m"
  done
}

# kubepods cgroups of every v1 hierarchy and of the unified one, deepest
# first (rmdir only works on empty, process-free cgroups).
clean_cgroups() {
  local d p
  # Container processes whose shim is gone (containerd or the shim killed
  # hard) still sit in the pod cgroups and would keep them: end them first.
  for p in $(find /sys/fs/cgroup -path '*kubepods*' -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u); do
    kill -KILL "$p" 2>/dev/null || true
  done
  [[ -z "${p:-}" ]] || sleep 0.5
  find /sys/fs/cgroup -depth -type d -name 'kubepods*' 2>/dev/null | while IFS= read -r top; do
    find "$top" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
  d=$(find /sys/fs/cgroup -type d -name 'kubepods*' 2>/dev/null | head -1)
  [[ -z "$d" ]] || log "cgroups left: $d (a process still in it?)"
}

# ---------------------------------------------------------------- configs

write_configs() {
  mkdir -p "$CTRD" "$CNI_CONF" "$KUBELET_ROOT" "$DIR/kubelet-pki" "$DIR/cni/ipam" "$DIR/pod-logs" "$DIR/volume-plugins"
  cp_kubeconfig "$ADMIN_KUBECONFIG" "$API_URL" admin
  cp_kubeconfig "$DIR/controller-manager.kubeconfig" "$API_URL" controller-manager
  cp_kubeconfig "$DIR/scheduler.kubeconfig" "$API_URL" scheduler
  cp_kubeconfig "$DIR/kube-proxy.kubeconfig" "$API_URL" kube-proxy
  cp_kubeconfig "$DIR/kubelet.kubeconfig" "$API_URL" kubelet-client

  # containerd 2.x: config version 3. Everything it keeps under the state dir;
  # the shims' sockets still go to /run/containerd (compiled in).
  cat >"$CTRD/config.toml" <<EOF
version = 3
root = "$CTRD/root"
state = "$CTRD/state"
# Plugins a node without btrfs/zfs/devmapper cannot load anyway; quiet logs.
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.blockfile",
  "io.containerd.nri.v1.nri", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[plugins."io.containerd.internal.v1.opt"]
  path = "$CTRD/opt"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    # No registry: the sandbox image is built here (scripts/images.sh).
    sandbox = "localhost/remora/pause:dev"

[plugins."io.containerd.cri.v1.runtime"]
  # The sandbox has no CAP_SYS_RESOURCE: without this every pod fails with
  # "runc create failed: ... can't get final child's PID from pipe: EOF".
  restrict_oom_score_adj = true
  enable_cdi = false
  # Pod network namespaces under the state dir, not /var/run/netns.
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["$CNI_BIN"]
    conf_dir = "$CNI_CONF"
    max_conf_num = 1
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "$(command -v runc)"
        SystemdCgroup = false

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
EOF

  # A bridge on the private pod range; the host is the gateway. No ipMasq:
  # pod traffic has nowhere to go but this machine.
  cat >"$CNI_CONF/10-remora.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "remora",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_CIDR"}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": "$DIR/cni/ipam"
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF

  cat >"$DIR/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $PKI/kubelet-serving.crt
tlsPrivateKeyFile: $PKI/kubelet-serving.key
containerRuntimeEndpoint: unix://$CTRD_SOCK
# This machine has cgroup v1 hierarchies (refused by default since 1.35),
# swap may be on, and there is no systemd managing cgroups.
failCgroupV1: false
failSwapOn: false
cgroupDriver: cgroupfs
# No cluster DNS yet, and pods must not inherit the host's resolvers (their
# queries would leave the machine; the guard would drop them).
resolvConf: ""
clusterDomain: cluster.local
podLogsDir: $DIR/pod-logs
volumePluginDir: $DIR/volume-plugins
# The disk is shared: do not evict pods because someone else filled it.
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
imageGCHighThresholdPercent: 100
serializeImagePulls: false
EOF

  cat >"$DIR/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection: {kubeconfig: $DIR/kube-proxy.kubeconfig}
hostnameOverride: $NODE_NAME
bindAddress: $NODE_IP
clusterCIDR: $POD_CIDR
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
# All 0: kube-proxy then leaves the conntrack sysctls alone.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
iptables:
  # Otherwise it sets route_localnet=1 for NodePorts on 127.0.0.1.
  localhostNodePorts: false
nodePortAddresses: ["$NODE_IP/32"]
EOF
}

# ---------------------------------------------------------------- up

kubectl_admin() { "$KUBECTL" --kubeconfig "$ADMIN_KUBECONFIG" "$@"; }

up() {
  bins
  need_bins
  local t0 pid
  t0=$(date +%s%N)
  if pid_of kube-apiserver >/dev/null && pid_of kubelet >/dev/null; then
    log "already up (state in $DIR); nothing to do"
    echo "export KUBECONFIG=$ADMIN_KUBECONFIG"
    return
  fi
  # One node per machine: the node IP, ports and bridge are fixed. A second
  # state dir would fight the first over them.
  if ! pid_of kube-apiserver >/dev/null && command -v ss >/dev/null &&
    ss -Hltn "sport = :$API_PORT" | grep -q "$NODE_IP:$API_PORT"; then
    die "$NODE_IP:$API_PORT is in use: another cluster (another REMORA_CLUSTER_DIR?) runs; stop it first"
  fi
  mkdir -p "$DIR" "$LOGS" "$PIDS" "$HOST"
  # Pid files of components that no longer run (the machine restarted, or
  # one was killed) would read as "exited" to check_alive: forget them.
  local f
  for f in "$PIDS"/*.pid; do
    [[ -e "$f" ]] || continue
    pid_of "$(basename "$f" .pid)" >/dev/null || rm -f "$f"
  done
  # A fresh start gets fresh logs (down keeps the last run's until then).
  pid_of etcd >/dev/null || rm -f "$LOGS"/*.log
  record_dirs
  save_sysctls
  cp_pki
  write_configs

  if ! ip -o addr show dev lo | grep -qw "$NODE_IP/32"; then
    ip addr add "$NODE_IP/32" dev lo
    touch "$HOST/lo-addr"
    log "added $NODE_IP/32 to lo (the node IP)"
  fi
  sysctl -q -w net.ipv4.ip_forward=1
  # Service addresses route to a bridge with no ports, which discards: a
  # packet to a ClusterIP that kube-proxy has not programmed yet (or any
  # more) stays on this machine instead of taking the default route (and the
  # guard's DROP). kube-proxy's DNAT in OUTPUT/PREROUTING still reroutes the
  # programmed ones. (A bridge: these kernels have no dummy links.)
  if ! ip link show "$SVC_LINK" >/dev/null 2>&1; then
    ip link add "$SVC_LINK" type bridge
    touch "$HOST/svc-link"
    log "added the empty bridge $SVC_LINK for $SERVICE_CIDR"
  fi
  ip link set "$SVC_LINK" up
  ip route replace "$SERVICE_CIDR" dev "$SVC_LINK"
  add_guard

  local flags
  flags_of cp_etcd_flags
  start etcd "$ETCD" "${flags[@]}"
  # containerd next: it is independent of the API server, so both start
  # while etcd does.
  # A socket left by a node that was killed (machine restart) would satisfy
  # a wait on the file alone: remove it, and wait until containerd answers.
  rm -f "$CTRD_SOCK" "$CTRD_SOCK.ttrpc"
  PATH="$CTRD_BIN:$PATH" start containerd "$CTRD_BIN/containerd" --config "$CTRD/config.toml" --address "$CTRD_SOCK"

  flags_of cp_apiserver_flags
  start kube-apiserver "$K8S/kube-apiserver" "${flags[@]}"

  wait_for containerd 30 "$CTRD_BIN/ctr" --address "$CTRD_SOCK" version
  bash "$ROOT/scripts/images.sh" pause >&2

  # Ready, not just live: the controller manager exits at once if RBAC's
  # bootstrap roles are not there yet (it cannot read
  # extension-apiserver-authentication), so it must not start earlier.
  wait_for kube-apiserver 60 kubectl_admin get --raw /readyz
  log "API server ready at https://$NODE_IP:$API_PORT"

  flags_of cp_controller_manager_flags "$DIR/controller-manager.kubeconfig"
  start kube-controller-manager "$K8S/kube-controller-manager" "${flags[@]}"
  start kube-scheduler "$K8S/kube-scheduler" \
    --kubeconfig="$DIR/scheduler.kubeconfig" \
    --authentication-kubeconfig="$DIR/scheduler.kubeconfig" \
    --authorization-kubeconfig="$DIR/scheduler.kubeconfig" \
    --leader-elect=false --bind-address=127.0.0.1 --secure-port=10259
  start kubelet "$K8S/kubelet" \
    --config="$DIR/kubelet.yaml" --kubeconfig="$DIR/kubelet.kubeconfig" \
    --node-ip="$NODE_IP" --hostname-override="$NODE_NAME" \
    --root-dir="$KUBELET_ROOT" --cert-dir="$DIR/kubelet-pki"
  start kube-proxy "$K8S/kube-proxy" --config="$DIR/kube-proxy.yaml"

  wait_for "node $NODE_NAME Ready" 120 \
    kubectl_admin wait --for=condition=Ready "node/$NODE_NAME" --timeout=1s
  # Pods need their namespace's ServiceAccount; the controller makes it.
  wait_for "default ServiceAccount" 60 kubectl_admin -n default get serviceaccount default
  log "cluster up in $(( ($(date +%s%N) - t0) / 1000000 )) ms: node $NODE_NAME Ready, guard counter $(guard_count)"
  log "kubectl: $KUBECTL (or: export PATH=$K8S:\$PATH)"
  echo "export KUBECONFIG=$ADMIN_KUBECONFIG"
}

# ---------------------------------------------------------------- down

down() {
  if [[ ! -d "$DIR/host" && ! -d "$PIDS" ]]; then
    log "not up (no state in $DIR); nothing to do"
    return
  fi
  bins
  local g
  g=$(guard_count)
  [[ -z "$g" || "$g" == 0 ]] || log "WARNING: the egress guard dropped $g packets"
  # Clients first, then the runtime, then the API server and its store.
  stop kube-proxy kubelet kube-scheduler kube-controller-manager
  # Containers outlive the kubelet (their shims belong to containerd): kill
  # them through containerd while it still runs.
  if pid_of containerd >/dev/null && [[ -S "$CTRD_SOCK" ]]; then
    local ctr=("$CTRD_BIN/ctr" --address "$CTRD_SOCK" -n k8s.io) id
    for id in $("${ctr[@]}" tasks ls -q 2>/dev/null); do
      "${ctr[@]}" tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true
    done
    sleep 0.5
    for id in $("${ctr[@]}" tasks ls -q 2>/dev/null); do
      "${ctr[@]}" tasks delete -f "$id" >/dev/null 2>&1 || true
    done
    for id in $("${ctr[@]}" containers ls -q 2>/dev/null); do
      "${ctr[@]}" containers delete "$id" >/dev/null 2>&1 || true
    done
  fi
  stop containerd
  # Shims still alive (containerd killed hard, say): those of this node only.
  local p
  for p in $(pgrep -f "containerd-shim-runc-v2 .*-address $CTRD_SOCK" || true); do
    kill -KILL "$p" 2>/dev/null || true
  done
  stop kube-apiserver
  stop etcd
  # kube-proxy's own cleanup, then whatever chains are left (the kubelet's
  # canaries, the guard).
  if [[ -x "$K8S/kube-proxy" ]]; then
    "$K8S/kube-proxy" --cleanup >>"$LOGS/kube-proxy-cleanup.log" 2>&1 || true
  fi
  clean_iptables
  ip link del "$BRIDGE" 2>/dev/null && log "deleted bridge $BRIDGE" || true
  umount_under "$DIR"
  umount_under /run/containerd
  umount_under /var/lib/kubelet
  clean_cgroups
  if [[ -f "$HOST/svc-link" ]]; then
    ip link del "$SVC_LINK" 2>/dev/null || true
    rm -f "$HOST/svc-link"
    log "deleted the bridge $SVC_LINK"
  fi
  if [[ -f "$HOST/lo-addr" ]]; then
    ip addr del "$NODE_IP/32" dev lo 2>/dev/null || true
    rm -f "$HOST/lo-addr"
    log "removed $NODE_IP/32 from lo"
  fi
  restore_sysctls
  if [[ -f "$HOST/created-dirs" ]]; then
    local d
    while IFS= read -r d; do
      [[ -e "$d" ]] || continue
      rm -rf "$d" && log "removed $d"
    done <"$HOST/created-dirs"
  fi
  # Everything but the logs goes; they stay for a post-mortem.
  find "$DIR" -mindepth 1 -maxdepth 1 ! -name logs -exec rm -rf {} +
  log "down; logs kept in $LOGS"
}

# ---------------------------------------------------------------- status

status() {
  bins
  local n up=0
  for n in etcd containerd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy; do
    if pid_of "$n" >/dev/null; then
      echo "$n: running (pid $(pid_of "$n"))"
      up=1
    else
      echo "$n: not running"
    fi
  done
  echo "egress guard dropped: $(guard_count || true)"
  if ((up)) && [[ -f "$ADMIN_KUBECONFIG" ]]; then
    kubectl_admin get nodes -o wide 2>&1 || true
    echo "export KUBECONFIG=$ADMIN_KUBECONFIG"
  fi
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: scripts/cluster.sh up|down|status" >&2; exit 2 ;;
esac
