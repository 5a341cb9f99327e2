#!/usr/bin/env bash
# A one-node Kubernetes cluster on this host for kvtier's cluster tests
# (docs/operations.md, "Tested on a real cluster"): etcd, the control plane,
# containerd with runc, the kubelet, kube-proxy (iptables) and CoreDNS, from
# the binaries scripts/k8s/build.sh caches and Debian's containerd, runc and
# CNI plugins. No registry: images are imported from local tar files.
#
#   cluster.sh up   STATE BIN IMAGES...  start it; KUBECONFIG=STATE/admin.kubeconfig
#   cluster.sh down STATE BIN            stop everything `up` started and undo
#                                        what it changed on the host
#
# Needs root. Everything lives under STATE (and /run/kvtier-k8s); the pids
# of what `up` starts go to STATE/pids, the host's sysctls to
# STATE/sysctl-saved, which `down` restores. `down` is safe to run twice and
# after an `up` that failed half-way.
set -euo pipefail
cmd=${1:?usage: cluster.sh up|down STATE BIN [IMAGES...]}
STATE=$(realpath -m "${2:?STATE}")
BIN=$(realpath "${3:?BIN}")
shift 3
RUN=/run/kvtier-k8s
POD_CIDR=10.244.0.0/24
SVC_CIDR=10.96.0.0/16
DNS_IP=10.96.0.10
export KUBECONFIG=$STATE/admin.kubeconfig
CTR=(ctr -a "$RUN/containerd.sock" -n k8s.io)
HERE=$(cd "$(dirname "$0")" && pwd)

log() { printf 'cluster: %s (%d s)\n' "$1" "$(( $(date +%s) - t0 ))" >&2; }
t0=$(date +%s)

# Polls `cmd...` every 0.2 s for up to `seconds`; fails naming it.
wait_for() {
  local seconds=$1 what=$2
  shift 2
  local until=$(( $(date +%s) + seconds ))
  while ! "$@" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$until" ]; then
      echo "cluster: $what not within ${seconds} s (logs: $STATE/logs)" >&2
      return 1
    fi
    sleep 0.2
  done
}

# Starts a process in the background, logging to STATE/logs/NAME.log.
spawn() {
  local name=$1
  shift
  setsid "$@" >"$STATE/logs/$name.log" 2>&1 < /dev/null &
  echo "$name $!" >>"$STATE/pids"
}

up() {
  # One cluster a host: its ports (2379, 6443, 10250) are fixed.
  if [ -f "$RUN/state" ]; then
    echo "cluster: one is running already, from $(cat "$RUN/state"): run" \
         "'cluster.sh down $(cat "$RUN/state") BIN' first" >&2
    exit 1
  fi
  mkdir -p "$STATE/logs" "$STATE/pki" "$STATE/cni" "$RUN"
  echo "$STATE" >"$RUN/state"
  local pki=$STATE/pki host node
  host=$(ip -4 route get 1.1.1.1 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "src") print $(i + 1)}')
  host=${host:-127.0.0.1}
  node=$(hostname)
  # What the kubelet and kube-proxy change, saved once for `down`.
  if [ ! -f "$STATE/sysctl-saved" ]; then
    for k in vm.overcommit_memory kernel.panic kernel.panic_on_oops net.ipv4.ip_forward \
             net.ipv4.conf.all.route_localnet net.bridge.bridge-nf-call-iptables; do
      v=$(sysctl -n "$k" 2>/dev/null) && echo "$k=$v"
    done >"$STATE/sysctl-saved"
  fi
  sysctl -qw net.ipv4.ip_forward=1
  sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null || true

  # One CA; the API server's certificate; an admin (system:masters) client.
  if [ ! -f "$pki/admin.crt" ]; then
    openssl req -x509 -newkey rsa:2048 -nodes -days 7 -subj /CN=kvtier-test-ca \
      -keyout "$pki/ca.key" -out "$pki/ca.crt" 2>/dev/null
    printf 'subjectAltName=DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost,DNS:%s,IP:127.0.0.1,IP:10.96.0.1,IP:%s\nextendedKeyUsage=serverAuth\n' \
      "$node" "$host" >"$pki/server.ext"
    echo extendedKeyUsage=clientAuth >"$pki/client.ext"
    for spec in "apiserver /CN=kube-apiserver server" "admin /O=system:masters/CN=admin client"; do
      read -r name subject ext <<<"$spec"
      openssl req -newkey rsa:2048 -nodes -subj "$subject" -keyout "$pki/$name.key" \
        -out "$pki/$name.csr" 2>/dev/null
      openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" \
        -CAcreateserial -days 7 -extfile "$pki/$ext.ext" -out "$pki/$name.crt" 2>/dev/null
    done
    openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
  fi
  cat >"$KUBECONFIG" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: kvtier, cluster: {server: "https://127.0.0.1:6443", certificate-authority: "$pki/ca.crt"}}]
users: [{name: admin, user: {client-certificate: "$pki/admin.crt", client-key: "$pki/admin.key"}}]
contexts: [{name: kvtier, context: {cluster: kvtier, user: admin}}]
current-context: kvtier
EOF

  # containerd with its own root and socket. This sandbox withholds
  # CAP_SYS_RESOURCE: runc cannot set the kubelet's oom_score_adj, so it is
  # clamped (restrict_oom_score_adj) or every pod sandbox fails.
  cat >"$STATE/containerd.toml" <<EOF
version = 2
root = "$STATE/containerd"
state = "$RUN/containerd"
[grpc]
  address = "$RUN/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:local"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
EOF
  cat >"$STATE/cni/10-kvtier.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "kvtier", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]],
            "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOF
  spawn containerd containerd --config "$STATE/containerd.toml"
  wait_for 30 "containerd" "${CTR[@]}" version
  for image in "$@"; do "${CTR[@]}" images import "$image" >/dev/null; done
  log "containerd up, $# images imported"

  spawn etcd "$BIN/etcd" --name node0 --data-dir "$STATE/etcd" \
    --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster node0=http://127.0.0.1:2380
  wait_for 60 "etcd" curl -sf http://127.0.0.1:2379/health
  spawn kube-apiserver "$BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
    --bind-address=0.0.0.0 --secure-port=6443 --advertise-address="$host" \
    --service-cluster-ip-range="$SVC_CIDR" --client-ca-file="$pki/ca.crt" \
    --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
    --kubelet-client-certificate="$pki/admin.crt" --kubelet-client-key="$pki/admin.key" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
    --authorization-mode=Node,RBAC --allow-privileged=true
  wait_for 120 "the API server" "$BIN/kubectl" get --raw /readyz
  log "API server ready"
  spawn kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig="$KUBECONFIG" \
    --authentication-kubeconfig="$KUBECONFIG" --authorization-kubeconfig="$KUBECONFIG" \
    --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
    --cluster-signing-cert-file="$pki/ca.crt" --cluster-signing-key-file="$pki/ca.key" \
    --use-service-account-credentials=true --leader-elect=false --bind-address=127.0.0.1 \
    --allocate-node-cidrs=false --service-cluster-ip-range="$SVC_CIDR"
  spawn kube-scheduler "$BIN/kube-scheduler" --kubeconfig="$KUBECONFIG" \
    --authentication-kubeconfig="$KUBECONFIG" --authorization-kubeconfig="$KUBECONFIG" \
    --leader-elect=false --bind-address=127.0.0.1

  # The kubelet: cgroup v1 with cgroupfs here (failCgroupV1 false keeps
  # later kubelets running on it too). Disk thresholds are absolute: a
  # percentage of a 252G host disk evicted every pod (CI, with 4G free);
  # the test's pods write kilobytes. Image GC off: every image is in use.
  cat >"$STATE/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication: {anonymous: {enabled: false}, webhook: {enabled: true}, x509: {clientCAFile: "$pki/ca.crt"}}
authorization: {mode: Webhook}
cgroupDriver: cgroupfs
failCgroupV1: false
containerRuntimeEndpoint: unix://$RUN/containerd.sock
clusterDNS: [$DNS_IP]
clusterDomain: cluster.local
failSwapOn: false
serializeImagePulls: false
evictionHard: {memory.available: "200Mi", nodefs.available: "512Mi", imagefs.available: "512Mi"}
imageGCHighThresholdPercent: 100
podLogsDir: $STATE/pod-logs
EOF
  spawn kubelet "$BIN/kubelet" --config="$STATE/kubelet.yaml" --kubeconfig="$KUBECONFIG" \
    --root-dir="$STATE/kubelet" --node-ip="$host"
  cat >"$STATE/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: "$KUBECONFIG"}
mode: iptables
clusterCIDR: $POD_CIDR
conntrack: {maxPerCore: 0}
bindAddress: 127.0.0.1
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
nodePortAddresses: [primary]
EOF
  spawn kube-proxy "$BIN/kube-proxy" --config="$STATE/kube-proxy.yaml" --hostname-override="$node"
  wait_for 120 "node $node Ready" "$BIN/kubectl" wait --for=condition=Ready "node/$node" --timeout=1s
  log "node Ready"
  # Cluster names only: CoreDNS forwards nothing off the machine.
  "$BIN/kubectl" apply -f "$HERE/coredns.yaml" >/dev/null
  "$BIN/kubectl" -n kube-system rollout status deploy/coredns --timeout=180s >/dev/null
  log "CoreDNS ready"
}

# Stops `name` (SIGTERM, SIGKILL after 10 s) by the pid `up` recorded.
stop() {
  local pid
  pid=$(awk -v n="$1" '$1 == n {print $2}' "$STATE/pids" 2>/dev/null | tail -1)
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
}

down() {
  set +e
  if [ -x "$BIN/kubectl" ] && "$BIN/kubectl" get --raw /readyz >/dev/null 2>&1; then
    # Pods first, so that the kubelet tears their sandboxes (and CNI) down.
    "$BIN/kubectl" delete deploy,sts,ds,rs,job --all -A --wait=false >/dev/null 2>&1
    "$BIN/kubectl" delete pods --all -A --grace-period=2 --timeout=60s >/dev/null 2>&1
  fi
  for _ in $(seq 60); do
    [ -z "$("${CTR[@]}" tasks ls -q 2>/dev/null)" ] && break
    sleep 1
  done
  for name in kube-proxy kubelet kube-scheduler kube-controller-manager kube-apiserver etcd; do
    stop "$name"
  done
  # Containers the kubelet left: their shims are children of PID 1.
  for task in $("${CTR[@]}" tasks ls -q 2>/dev/null); do
    "${CTR[@]}" tasks kill -s KILL "$task" >/dev/null 2>&1
    "${CTR[@]}" tasks rm -f "$task" >/dev/null 2>&1
  done
  stop containerd
  pkill -9 -f "containerd-shim-runc-v2 -namespace k8s.io" 2>/dev/null
  # Mounts left (volumes, root filesystems, network namespaces), deepest
  # first, in passes: a namespace's file can sit over or under its mount.
  for _ in 1 2 3; do
    grep -E " ($STATE|$RUN|/run/netns/cni-)" /proc/mounts | awk '{print $2}' | sort -r |
      xargs -r -n1 umount -l 2>/dev/null
    if grep -q ' /run/netns ' /proc/mounts && [ -z "$(ls /run/netns 2>/dev/null | grep -v '^cni-')" ]; then
      umount -l /run/netns
    fi
  done
  rm -f /run/netns/cni-* 2>/dev/null
  find /var/log/containers /var/log/pods -lname "$STATE/*" -delete 2>/dev/null
  [ -x "$BIN/kube-proxy" ] && "$BIN/kube-proxy" --cleanup >/dev/null 2>&1
  for ipt in iptables ip6tables; do  # the kubelet's own chains
    $ipt -D INPUT -j KUBE-FIREWALL 2>/dev/null
    $ipt -D OUTPUT -j KUBE-FIREWALL 2>/dev/null
    for table in filter mangle nat; do
      for chain in KUBE-FIREWALL KUBE-KUBELET-CANARY KUBE-IPTABLES-HINT; do
        $ipt -t "$table" -F "$chain" 2>/dev/null
        $ipt -t "$table" -X "$chain" 2>/dev/null
      done
    done
  done
  # The bridge plugin's masquerade chains (CNI-*) and the bridge itself.
  iptables -t nat -S POSTROUTING 2>/dev/null | grep -- '-j CNI-' | sed 's/^-A/-D/' |
    while read -r rule; do eval iptables -t nat "$rule" 2>/dev/null; done
  for chain in $(iptables -t nat -S 2>/dev/null | awk '/^-N CNI-/ {print $2}'); do
    iptables -t nat -F "$chain" 2>/dev/null
    iptables -t nat -X "$chain" 2>/dev/null
  done
  ip link del cni0 2>/dev/null
  rm -rf /var/lib/cni/networks/kvtier /var/lib/cni/results/kvtier-* 2>/dev/null
  for c in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/*/k8s.io; do
    [ -d "$c" ] && find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null
  done
  if [ -f "$STATE/sysctl-saved" ]; then
    while IFS== read -r k v; do sysctl -qw "$k=$v" 2>/dev/null; done <"$STATE/sysctl-saved"
  fi
  : >"$STATE/pids" 2>/dev/null
  rm -rf "$RUN"
  log "down"
}

case "$cmd" in
  up) up "$@" ;;
  down) down ;;
  *) echo "usage: cluster.sh up|down STATE BIN [IMAGES...]" >&2; exit 2 ;;
esac
