#!/usr/bin/env bash
# The images kvtier's test cluster runs, written as tar files into OUT
# (scripts/k8s/cluster.sh imports them; no registry):
#   pause.tar    localhost/pause:local, the pod sandbox (scripts/k8s/pause.c)
#   coredns.tar  localhost/coredns:local, from BIN/coredns
#   kvtier.tar   kvtier:VERSION: the Dockerfile's runtime stage (Debian 12
#                with the runtime libraries, uid 10001) and the binaries of
#                BUILD, plus python3 for engine pods (their vLLM environment
#                is mounted read-only: tests/k8s/values-test.yaml)
# The Debian layer is made once per package list with debootstrap and
# cached beside the Kubernetes binaries. Usage: images.sh OUT BUILD BIN
set -euo pipefail
OUT=$(realpath -m "${1:?OUT}")
BUILD=$(realpath "${2:?BUILD}")
BIN=$(realpath "${3:?BIN}")
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
CACHE=${KVTIER_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtier/k8s}
VERSION=$(awk '/^appVersion:/ {gsub(/"/, "", $2); print $2}' "$ROOT/helm/kvtier/Chart.yaml")
mkdir -p "$OUT" "$CACHE"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The Dockerfile's runtime packages, and python3 for engine pods.
PACKAGES="libgrpc++1.51 libprotobuf32 librocksdb7.8 libucx0 ucx-utils libxxhash0 libzmq5
  libmsgpackc2 libjemalloc2 libabsl20220623 libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0
  ca-certificates python3 libgomp1 libnuma1 procps"
key=$(echo "$PACKAGES" | tr -s ' \n' ' ' | sha256sum | cut -c1-12)
base="$CACHE/debian-bookworm-$key"
if [ ! -f "$base.done" ]; then
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  if [ ! -f "$base.minbase" ]; then
    echo "images: debootstrap bookworm from $mirror (once)" >&2
    rm -rf "$base"
    debootstrap --variant=minbase bookworm "$base" "$mirror" >"$work/debootstrap.log" 2>&1 ||
      { tail -20 "$work/debootstrap.log" >&2; exit 1; }
    touch "$base.minbase"
  fi
  echo "images: the runtime packages into the Debian layer (once)" >&2
  pkgs=$(echo $PACKAGES)  # one line
  chroot "$base" sh -c "apt-get update -q && DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends $pkgs && apt-get clean &&
    rm -rf /var/lib/apt/lists/* &&
    (id kvtier >/dev/null 2>&1 || useradd --uid 10001 --user-group --no-create-home kvtier)" \
    >"$work/packages.log" 2>&1 || { tail -20 "$work/packages.log" >&2; exit 1; }
  touch "$base.done"
fi

# pause and CoreDNS: one static binary each.
mkdir -p "$work/pause" "$work/coredns"
gcc -static -O2 -o "$work/pause/pause" "$HERE/pause.c"
cp "$BIN/coredns" "$work/coredns/coredns"
python3 "$HERE/mkimage.py" "$OUT/pause.tar" localhost/pause:local "$work/pause" \
  --entrypoint '["/pause"]' >&2
python3 "$HERE/mkimage.py" "$OUT/coredns.tar" localhost/coredns:local "$work/coredns" \
  --entrypoint '["/coredns"]' >&2

# kvtier: the Debian layer, then the build's binaries (the Dockerfile's list).
mkdir -p "$work/kvtier/usr/local/bin"
for b in cachestore/kvtier-store router/kvtier-router worker/kvtier-sim-worker cli/kvctl \
         bench/kvtier-bench frontend/kvtier-frontend frontend/kvtier-text; do
  cp "$BUILD/$b" "$work/kvtier/usr/local/bin/"
  strip --strip-debug "$work/kvtier/usr/local/bin/$(basename "$b")"
done
python3 "$HERE/mkimage.py" "$OUT/kvtier.tar" "kvtier:$VERSION" "$base" "$work/kvtier" \
  --cmd '["kvtier-store", "--help"]' >&2
echo "$OUT"
