#!/usr/bin/env bash
# The binaries of kvtier's test cluster (docs/operations.md, "Tested on a
# real cluster"): kube-apiserver, kube-controller-manager, kube-scheduler,
# kubelet, kube-proxy and kubectl of Kubernetes $K8S_VERSION and CoreDNS,
# built from the Go module proxy once per version into
# $KVTIER_K8S_CACHE/VERSION/bin (outside the checkout: a new clone reuses
# them), with Debian's etcd-server extracted beside them (not installed:
# no service starts). Prints the bin directory. Idempotent.
#
# k8s.io/kubernetes' module zip lacks staging/, which its go.mod points its
# k8s.io/* modules at: it builds from a wrapper module that replaces each
# with its published v0.MINOR.PATCH. The version is stamped with -X, or the
# API server says v0.0.0 and Helm's kubeVersion checks fail. 1.34 is the
# last minor whose kubelet runs on cgroup v1 (these hosts') by default.
set -euo pipefail
K8S_VERSION=${K8S_VERSION:-1.34.4}
COREDNS_VERSION=${COREDNS_VERSION:-v1.14.7}
CACHE=${KVTIER_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtier/k8s}
DIR="$CACHE/$K8S_VERSION"
BIN="$DIR/bin"
STAMP="$DIR/.built-$K8S_VERSION-coredns-$COREDNS_VERSION"
if [ -f "$STAMP" ]; then
  echo "$BIN"
  exit 0
fi
mkdir -p "$BIN" "$DIR/work"
start=$(date +%s)
export CGO_ENABLED=0 GOFLAGS=-mod=mod
(
  cd "$DIR/work"
  go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" > k8s.json
  gomod=$(python3 -c 'import json; print(json.load(open("k8s.json"))["GoMod"])')
  {
    printf 'module local/kvtierk8s\n\ngo 1.24.0\n\nrequire k8s.io/kubernetes v%s\n\nreplace (\n' \
      "$K8S_VERSION"
    grep '=> ./staging' "$gomod" | awk -v v="v0.${K8S_VERSION#1.}" '{print "\t"$1" => "$1" "v}'
    printf ')\n'
  } > go.mod
  printf 'package main\n\nfunc main() {}\n' > main.go
  minor=$(echo "$K8S_VERSION" | cut -d. -f2)
  ld="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $p.gitVersion=v$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ld="$ld -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
    ld="$ld -X $p.gitCommit=0000000000000000000000000000000000000000"
  done
  echo "k8s build: Kubernetes v$K8S_VERSION from the Go module proxy (about 10 min on 2 cores" \
       "the first time)" >&2
  go build -trimpath -ldflags "$ld" -o "$BIN/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet \
    k8s.io/kubernetes/cmd/kube-proxy k8s.io/kubernetes/cmd/kubectl
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w" "github.com/coredns/coredns@$COREDNS_VERSION"
  # etcd from Debian, extracted: installing the package would start a service.
  apt-get download etcd-server >/dev/null
  dpkg-deb -x etcd-server_*.deb etcd
  cp etcd/usr/bin/etcd "$BIN/etcd"
)
rm -rf "$DIR/work"
touch "$STAMP"
echo "k8s build: done in $(( $(date +%s) - start )) s" >&2
echo "$BIN"
