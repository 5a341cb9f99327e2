#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh needs on a GPU host that has CUDA and
# PyTorch but none of kvtier's build dependencies and no package registry:
# kvtier-store and kvtier-gpu-check (stripped), the shared libraries they
# load that such a host may lack (its C and C++ runtime excepted), UCX's
# transport modules, and libkvtier_cuda.so when an nvcc is found here
# (gpu_check.sh rebuilds it with the host's own nvcc when it has one).
#   scripts/gpu_bundle.sh BUILD_DIR OUT_DIR
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:?usage: gpu_bundle.sh BUILD_DIR OUT_DIR}
out=${2:?usage: gpu_bundle.sh BUILD_DIR OUT_DIR}
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for b in "$build/cachestore/kvtier-store" "$build/bench/kvtier-gpu-check"; do
  strip -o "$out/bin/$(basename "$b")" "$b"
done
# The libraries they load, but the C/C++ runtime (every host has a newer one).
ldd "$out"/bin/* | awk '$3 ~ /^\// {print $3}' | sort -u | while read -r lib; do
  case $(basename "$lib") in
    libc.so.*|libm.so.*|libstdc++.so.*|libgcc_s.so.*|ld-linux*|libpthread.so.*|libdl.so.*|librt.so.*) ;;
    *) cp -L "$lib" "$out/lib/" ;;
  esac
done
# kvtier's Python package, for the ordering check (bench/gpu_order_check.py;
# it runs where the host's Python is the build's version).
if [[ -d $build/python/kvtier ]]; then
  mkdir -p "$out/python"
  cp -rL "$build/python/kvtier" "$out/python/"
  cp "$root/bench/gpu_order_check.py" "$out/python/"
fi
if [[ -d /usr/lib/x86_64-linux-gnu/ucx ]]; then
  cp -rL /usr/lib/x86_64-linux-gnu/ucx "$out/lib/ucx"
fi
bash "$root/scripts/build_cuda_module.sh" "$out/lib" >/dev/null ||
  echo "gpu_bundle: no nvcc here; gpu_check.sh builds libkvtier_cuda.so on the GPU host" >&2
du -sh "$out"
