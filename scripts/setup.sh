#!/usr/bin/env bash
# Installs the Debian packages kvtier builds and runs with, if any are missing.
# Safe to run again: it does nothing when everything is present.
# libopenblas0-pthread: Debian's torch and numpy use whichever libblas.so.3
# is installed; OpenBLAS makes the reference engine ~40x faster than the
# reference BLAS.
# iproute2, nftables: the multi-host fault test's network namespaces, links
# and packet loss (kvtier-bench chaos).
# nodejs, npm (when no node is installed): the chart test validates the
# rendered manifests against the Kubernetes API schemas with the npm package
# kubernetes-models, installed into tests/helm/node_modules from its lock file;
# helm and kube-score, built from the Go module proxy into tests/helm/.bin.
# clang-format: the C++ style check CI runs (scripts/check_format.sh).
# containerd, runc, containernetworking-plugins, iptables, conntrack,
# debootstrap: the one-node Kubernetes cluster the chart is installed on
# (scripts/k8s/; its Kubernetes binaries are built from the Go module proxy
# by scripts/k8s/build.sh, cached outside the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(
  build-essential cmake ninja-build ccache pkg-config curl ca-certificates
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libboost-dev libucx-dev ucx-utils librocksdb-dev libabsl-dev libgtest-dev libxxhash-dev libzmq3-dev cppzmq-dev libmsgpack-dev
  nlohmann-json3-dev prometheus-cpp-dev redis-server redis-tools fio python3
  golang-go golang-github-masterminds-sprig-dev python3-jsonschema python3-yaml
  clang libclang-rt-14-dev clang-format openssl libssl-dev
  python3-dev pybind11-dev python3-numpy python3-pytest python3-torch
  python3-grpcio python3-protobuf python3-venv libopenblas0-pthread
  iproute2 nftables nginx-light wrk libjemalloc-dev
  containerd runc containernetworking-plugins iptables conntrack debootstrap
)

# A node from elsewhere (e.g. NodeSource) brings its own npm: keep it.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  PKGS+=(nodejs npm)
fi

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  echo "setup: done"
fi

# The chart test's schema validator, pinned by tests/helm/package-lock.json.
if ! cmp -s tests/helm/package-lock.json tests/helm/node_modules/.kvtier-installed-lock 2>/dev/null; then
  echo "setup: npm ci in tests/helm"
  if ! npm ci --prefix tests/helm --no-audit --no-fund --loglevel=error >/dev/null; then
    echo "setup: npm ci failed: the chart test validates manifests with the npm packages in" \
         "tests/helm/package-lock.json and needs the npm registry (or a mirror in ~/.npmrc)" >&2
    exit 1
  fi
  cp tests/helm/package-lock.json tests/helm/node_modules/.kvtier-installed-lock
fi

# go_tool NAME PACKAGE VERSION WHAT: builds a pinned Go tool from the Go
# module proxy into tests/helm/.bin, once per version.
go_tool() {
  local name="$1" pkg="$2" version="$3" what="$4"
  [ "$(cat "tests/helm/.bin/.$name-version" 2>/dev/null)" = "$version" ] && return 0
  echo "setup: go install $pkg@$version ($what)"
  mkdir -p tests/helm/.bin
  if ! GOBIN="$PWD/tests/helm/.bin" GOFLAGS=-mod=mod go install "$pkg@$version" >/dev/null; then
    echo "setup: go install of $name failed: $what, and it needs the Go module proxy" \
         "(or GOPROXY set to a mirror)" >&2
    exit 1
  fi
  echo "$version" > "tests/helm/.bin/.$name-version"
}
# The chart test's renderer and linter, helm itself (a few minutes, once per
# machine), and its manifest linter, kube-score.
go_tool helm helm.sh/helm/v3/cmd/helm v3.22.0 "the chart test renders and lints the chart with it"
go_tool kube-score github.com/zegl/kube-score/cmd/kube-score v1.20.0 \
  "the chart test lints the rendered manifests with it"

# Rust, for the frontend's text layer (frontend/text: Hugging Face
# `tokenizers` and `minijinja` from crates.io, pinned by its Cargo.lock).
# Debian 12's rustc (1.63) is older than those crates need: without a cargo
# of at least RUST_MIN, rustup installs the pinned toolchain into ~/.cargo
# (CMake looks there too).
RUST_MIN=1.82.0
RUST_TOOLCHAIN=1.95.0
cargo_bin="$(command -v cargo || echo "$HOME/.cargo/bin/cargo")"
have="$("$cargo_bin" --version 2>/dev/null | awk '{print $2}')" || have=""
if [ -z "$have" ] || [ "$(printf '%s\n%s\n' "$RUST_MIN" "$have" | sort -V | head -1)" != "$RUST_MIN" ]; then
  echo "setup: installing Rust $RUST_TOOLCHAIN with rustup (found: ${have:-no cargo})"
  init="$(mktemp)"
  if ! curl -sSfL -o "$init" \
      "https://static.rust-lang.org/rustup/dist/$(uname -m)-unknown-linux-gnu/rustup-init"; then
    echo "setup: cannot download rustup-init: the frontend's tokenizer is built with cargo >=" \
         "$RUST_MIN (install Rust from https://rustup.rs)" >&2
    exit 1
  fi
  chmod +x "$init"
  "$init" -y -q --profile minimal -c rustfmt --default-toolchain "$RUST_TOOLCHAIN" \
    --no-modify-path >/dev/null
  rm -f "$init"
fi
