#!/usr/bin/env bash
# A Kubernetes control plane's certificates, kubeconfigs and component
# flags, for both things that start one: scripts/cluster.sh (the real node,
# profile "node") and e2e::controlplane (the tests' own API servers on
# loopback, profile "local"). cluster.sh sources this file; the harness runs
#   bash scripts/lib/controlplane.sh <function> [args]
# Inputs come in CP_* variables; flag functions print one flag per line.
#
#   CP_PROFILE       node | local
#   CP_DIR           state directory (etcd's data, the API server's cert dir)
#   CP_PKI           certificate directory (created 0700)
#   CP_BIND          the API server's address; CP_PORT its secure port
#   CP_ETCD_CLIENT   etcd's client host:port; CP_ETCD_PEER its peer host:port
#   CP_SERVICE_CIDR  Service addresses; CP_API_SERVICE_IP the first of them
#   CP_ISSUER        the service-account issuer
#   CP_NODE_NAME     (node) the kubelet's name
# Keys are EC P-256 (the API server signs service-account tokens with
# ES256), fresh for each state directory, never in the repository. One CA
# signs everything.

set -euo pipefail

# Controllers worth running without nodes (profile "local"): workloads and
# their garbage, namespaces and their default ServiceAccount.
CP_LOCAL_CONTROLLERS=serviceaccount-controller,namespace-controller,garbage-collector-controller,deployment-controller,replicaset-controller,statefulset-controller,daemonset-controller,job-controller,cronjob-controller,ttl-after-finished-controller,disruption-controller

cp_need() {
  local v
  for v in "$@"; do
    [[ -n "${!v:-}" ]] || { echo "controlplane.sh: $v is not set" >&2; return 2; }
  done
}

cp_profile() {
  cp_need CP_PROFILE
  case "$CP_PROFILE" in
    node | local) ;;
    *) echo "controlplane.sh: CP_PROFILE must be node or local, not '$CP_PROFILE'" >&2; return 2 ;;
  esac
}

# $1 name, $2 subject, $3 extensions (openssl -addext lines, "|"-separated).
# Kept when it exists: a node restarted keeps its identities.
cp_issue() {
  local name="$1" subj="$2" ext="$3" extfile
  [[ -f "$CP_PKI/$name.crt" ]] && return
  extfile=$(mktemp)
  tr '|' '\n' <<<"$ext" >"$extfile"
  openssl ecparam -name prime256v1 -genkey -noout -out "$CP_PKI/$name.key" 2>/dev/null
  openssl req -new -key "$CP_PKI/$name.key" -subj "$subj" -out "$CP_PKI/$name.csr" 2>/dev/null
  openssl x509 -req -in "$CP_PKI/$name.csr" -CA "$CP_PKI/ca.crt" -CAkey "$CP_PKI/ca.key" -CAcreateserial \
    -days 30 -extfile "$extfile" -out "$CP_PKI/$name.crt" 2>/dev/null
  rm -f "$CP_PKI/$name.csr" "$extfile"
}

# The CA, the API server's serving cert, the service-account key pair and
# each profile's client certs: admin (system:masters) and controller-manager
# in both; the node's other components and its kubelet in "node".
cp_pki() {
  cp_profile
  cp_need CP_PKI CP_API_SERVICE_IP
  mkdir -p "$CP_PKI"
  chmod 0700 "$CP_PKI"
  if [[ ! -f "$CP_PKI/ca.crt" ]]; then
    openssl ecparam -name prime256v1 -genkey -noout -out "$CP_PKI/ca.key" 2>/dev/null
    openssl req -x509 -new -key "$CP_PKI/ca.key" -subj "/CN=remora-$CP_PROFILE-ca" -days 30 \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -out "$CP_PKI/ca.crt" 2>/dev/null
  fi
  local client="basicConstraints=critical,CA:FALSE|keyUsage=critical,digitalSignature,keyEncipherment|extendedKeyUsage=clientAuth"
  local server="basicConstraints=critical,CA:FALSE|keyUsage=critical,digitalSignature,keyEncipherment|extendedKeyUsage=serverAuth"
  # Names a client may dial: the address the API server binds, loopback,
  # and the in-cluster names, so a webhook or a pod can verify it too.
  local names="IP:127.0.0.1,IP:$CP_API_SERVICE_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  [[ -z "${CP_BIND:-}" || "$CP_BIND" == 127.0.0.1 ]] || names="IP:$CP_BIND,$names"
  cp_issue apiserver "/CN=kube-apiserver" "$server|subjectAltName=$names"
  # system:masters is bound to cluster-admin by the bootstrap RBAC policy.
  cp_issue admin "/O=system:masters/CN=remora-admin" "$client"
  case "$CP_PROFILE" in
    node)
      cp_need CP_NODE_NAME CP_BIND
      # Every controller acts as its own ServiceAccount
      # (--use-service-account-credentials): the narrow bootstrap role is
      # enough for the manager itself.
      cp_issue controller-manager "/CN=system:kube-controller-manager" "$client"
      # The API server's client for kubelet logs/exec/port-forward.
      cp_issue apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$client"
      cp_issue scheduler "/CN=system:kube-scheduler" "$client"
      cp_issue kube-proxy "/CN=system:kube-proxy" "$client"
      # The Node authorizer and NodeRestriction know the kubelet by this name.
      cp_issue kubelet-client "/O=system:nodes/CN=system:node:$CP_NODE_NAME" "$client"
      cp_issue kubelet-serving "/CN=$CP_NODE_NAME" "$server|subjectAltName=IP:$CP_BIND,DNS:$CP_NODE_NAME"
      ;;
    local)
      # Without ServiceAccount credentials every controller acts as the
      # manager, which the narrow bootstrap role would not let do its work.
      cp_issue controller-manager "/O=system:masters/CN=system:kube-controller-manager" "$client"
      ;;
  esac
  if [[ ! -f "$CP_PKI/sa.key" ]]; then
    openssl ecparam -name prime256v1 -genkey -noout -out "$CP_PKI/sa.key" 2>/dev/null
    openssl ec -in "$CP_PKI/sa.key" -pubout -out "$CP_PKI/sa.pub" 2>/dev/null
  fi
}

# $1 file, $2 the API server's URL, $3 a client cert's name in $CP_PKI.
cp_kubeconfig() {
  cp_need CP_PKI
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: remora
  cluster:
    server: $2
    certificate-authority: $CP_PKI/ca.crt
users:
- name: $3
  user:
    client-certificate: $CP_PKI/$3.crt
    client-key: $CP_PKI/$3.key
contexts:
- name: remora
  context: {cluster: remora, user: $3}
current-context: remora
EOF
}

cp_etcd_flags() {
  cp_need CP_DIR CP_ETCD_CLIENT CP_ETCD_PEER
  printf '%s\n' --name=remora --data-dir="$CP_DIR/etcd" \
    --listen-client-urls="http://$CP_ETCD_CLIENT" --advertise-client-urls="http://$CP_ETCD_CLIENT" \
    --listen-peer-urls="http://$CP_ETCD_PEER" --initial-advertise-peer-urls="http://$CP_ETCD_PEER" \
    --initial-cluster="remora=http://$CP_ETCD_PEER" \
    --unsafe-no-fsync=true --log-level=warn
  # fsync off: the data is thrown away with the directory.
}

cp_apiserver_flags() {
  cp_profile
  cp_need CP_DIR CP_PKI CP_BIND CP_PORT CP_ETCD_CLIENT CP_SERVICE_CIDR CP_ISSUER
  # --cert-dir is unused (the serving cert is given) but would default to
  # /var/run.
  printf '%s\n' --etcd-servers="http://$CP_ETCD_CLIENT" \
    --bind-address="$CP_BIND" --advertise-address="$CP_BIND" --secure-port="$CP_PORT" \
    --cert-dir="$CP_DIR/apiserver-certs" \
    --tls-cert-file="$CP_PKI/apiserver.crt" --tls-private-key-file="$CP_PKI/apiserver.key" \
    --client-ca-file="$CP_PKI/ca.crt" \
    --service-account-key-file="$CP_PKI/sa.pub" \
    --service-account-signing-key-file="$CP_PKI/sa.key" \
    --service-account-issuer="$CP_ISSUER" \
    --service-cluster-ip-range="$CP_SERVICE_CIDR" \
    --allow-privileged=true
  case "$CP_PROFILE" in
    node)
      printf '%s\n' \
        --kubelet-client-certificate="$CP_PKI/apiserver-kubelet-client.crt" \
        --kubelet-client-key="$CP_PKI/apiserver-kubelet-client.key" \
        --kubelet-certificate-authority="$CP_PKI/ca.crt" \
        --kubelet-preferred-address-types=InternalIP \
        --authorization-mode=Node,RBAC \
        --enable-admission-plugins=NodeRestriction
      ;;
    local)
      # RBAC is real, so the chart's can be tested; the harness's clients
      # are system:masters. The ServiceAccount admission plugin refuses pods
      # until their ServiceAccount exists (a race with the controller
      # manager in every new namespace), and no kubelet would mount the
      # token it adds: envtest disables it too. The `kubernetes` Service
      # cannot have a loopback endpoint (the API server logs an error every
      # 10 s), and no pod could use it.
      printf '%s\n' --authorization-mode=RBAC \
        --disable-admission-plugins=ServiceAccount \
        --endpoint-reconciler-type=none
      ;;
  esac
}

# $1 the manager's kubeconfig.
cp_controller_manager_flags() {
  cp_profile
  cp_need CP_PKI CP_SERVICE_CIDR
  printf '%s\n' --kubeconfig="$1" --leader-elect=false --service-cluster-ip-range="$CP_SERVICE_CIDR"
  case "$CP_PROFILE" in
    node)
      printf '%s\n' \
        --authentication-kubeconfig="$1" --authorization-kubeconfig="$1" \
        --bind-address=127.0.0.1 --secure-port=10257 \
        --use-service-account-credentials=true \
        --root-ca-file="$CP_PKI/ca.crt" \
        --service-account-private-key-file="$CP_PKI/sa.key" \
        --cluster-signing-cert-file="$CP_PKI/ca.crt" --cluster-signing-key-file="$CP_PKI/ca.key" \
        --allocate-node-cidrs=false
      ;;
    local)
      # No serving: nothing scrapes it, and it would need its own delegated
      # authentication and authorization.
      printf '%s\n' --secure-port=0 --controllers="$CP_LOCAL_CONTROLLERS"
      ;;
  esac
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  case "${1:-}" in
    pki | kubeconfig | etcd_flags | apiserver_flags | controller_manager_flags) "cp_$1" "${@:2}" ;;
    *)
      echo "usage: controlplane.sh pki | kubeconfig FILE URL CERT | etcd_flags | apiserver_flags | controller_manager_flags KUBECONFIG" >&2
      exit 2
      ;;
  esac
fi
