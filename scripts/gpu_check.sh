#!/usr/bin/env bash
# The device check of docs/engines.md ("CUDA pages"): on a host with one
# NVIDIA GPU, CUDA's compiler (optional) and PyTorch, from a bundle made by
# scripts/gpu_bundle.sh (kvtier's binaries and the libraries they need).
#   scripts/gpu_check.sh BUNDLE [OUT_DIR]
# Builds libkvtier_cuda.so with the host's nvcc when there is one (else
# uses the bundle's), starts a kvtier-store on 127.0.0.1, runs
# kvtier-gpu-check (kernels against the CPU byte for byte; 4,096- and
# 32,768-token prompts of a Llama-3-8B layer set saved from and loaded into
# CUDA pages through the store, every byte compared, GB/s beside
# cudaMemcpyAsync), bench/gpu_order_check.py (copies ordered after the
# engine's stream) and bench/gpu_layer_time.py (a layer's compute), and
# stops the store by its pid. Results, one JSON line each, in
# OUT_DIR/gpu_check.jsonl. Exit 0 only when everything matched.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bundle=$(cd "${1:?usage: gpu_check.sh BUNDLE [OUT_DIR]}" && pwd)
out=${2:-$(mktemp -d)}
mkdir -p "$out"
json="$out/gpu_check.jsonl"
: >"$json"
# The bundle's libraries for kvtier's binaries only (PyTorch keeps the host's).
libs="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[[ -d $bundle/lib/ucx ]] && export UCX_MODULE_DIR="$bundle/lib/ucx"
export UCX_TLS=tcp
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
module="$bundle/lib/libkvtier_cuda.so"
if command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  nvcc --version | tail -2 || true
  if built=$(bash "$root/scripts/build_cuda_module.sh" "$out/module"); then
    module=$built
    echo "libkvtier_cuda.so built here: $module"
  fi
fi
[[ -f $module ]] || { echo "gpu_check: no libkvtier_cuda.so" >&2; exit 2; }
export KVTIER_CUDA_MODULE=$module
scratch=$(mktemp -d)
LD_LIBRARY_PATH=$libs "$bundle/bin/kvtier-store" --listen=127.0.0.1:0 --data-listen=127.0.0.1:0 \
  --data-dir="$scratch/db" --hugepages=false --ram-bytes=32GiB \
  --port-file="$scratch/port" >"$out/store.log" 2>&1 &
store=$!
for _ in $(seq 300); do [[ -s $scratch/port ]] && break; sleep 0.1; done
if [[ ! -s $scratch/port ]]; then
  echo "gpu_check: the store did not start" >&2
  cat "$out/store.log" >&2
  kill "$store" 2>/dev/null
  exit 2
fi
rc=0
LD_LIBRARY_PATH=$libs "$bundle/bin/kvtier-gpu-check" --store="127.0.0.1:$(cat "$scratch/port")" \
  --device=cuda:0 --tokens=4096,32768 --json="$json" || rc=$?
# Again with the copy engines doing the copies (one batch of chunk copies
# instead of the copy kernel), new blocks of the same sizes; GPU_CHECK_DMA=0
# skips this pass.
if [[ ${GPU_CHECK_DMA:-1} != 0 ]]; then
  KVTIER_CUDA_COPY=dma LD_LIBRARY_PATH=$libs "$bundle/bin/kvtier-gpu-check" \
    --store="127.0.0.1:$(cat "$scratch/port")" --device=cuda:0 --tokens=4096,32768 \
    --json="$json" || rc=$?
fi
# In-place saves hashed by the writer and checked by the store (the way
# before the store hashed them itself), interleaved with the default, as a
# host's speed drifts; new blocks each pass. GPU_CHECK_HASHES=0 skips it.
if [[ ${GPU_CHECK_HASHES:-1} != 0 ]]; then
  for hashes in writer store writer store; do
    pass=$((${pass:-0} + 1))
    LD_LIBRARY_PATH=$libs "$bundle/bin/kvtier-gpu-check" --hashes=$hashes --pass=$pass \
      --store="127.0.0.1:$(cat "$scratch/port")" --device=cuda:0 --tokens=4096,32768 \
      --json="$json" || rc=$?
  done
fi
# Issue #60: saves and loads ordered against the engine's stream (a long
# kernel writing the pages, the copy called at once). Needs the bundle's
# Python package, built for this host's Python version.
if [[ -d $bundle/python/kvtier ]]; then
  PYTHONPATH="$bundle/python" LD_LIBRARY_PATH=$libs python3 "$bundle/python/gpu_order_check.py" \
    --store="127.0.0.1:$(cat "$scratch/port")" --passes=20 | tee -a "$json"
  [[ ${PIPESTATUS[0]} == 0 ]] || rc=1
else
  echo "gpu_check: the bundle has no Python package; the ordering check did not run" >&2
  rc=1
fi
python3 "$root/bench/gpu_layer_time.py" 4096 | tee -a "$json" || rc=1
kill "$store"
wait "$store" 2>/dev/null
rm -rf "$scratch"
echo "gpu_check: exit $rc; results in $json"
exit $rc
