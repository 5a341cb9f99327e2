#!/usr/bin/env bash
# Builds libkvtier_cuda.so (gpu/cuda_module.h), the CUDA page copier's
# kernels, with nvcc alone: no other kvtier dependency, the CUDA runtime
# linked statically (the driver's libcuda is all it needs where it runs).
#   scripts/build_cuda_module.sh OUT_DIR
# nvcc: $NVCC, else nvcc on PATH, else /usr/local/cuda/bin/nvcc, else the
# nvidia-cuda-nvcc wheel in build/venv (python/requirements-cuda.txt).
# Exit 0 and the module's path on stdout; exit 2 when no nvcc is found.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: build_cuda_module.sh OUT_DIR}
mkdir -p "$out"
nvcc=${NVCC:-}
if [[ -z $nvcc ]]; then
  for c in "$(command -v nvcc || true)" /usr/local/cuda/bin/nvcc \
      "$root"/build/venv/lib/python3*/site-packages/nvidia/cu13/bin/nvcc; do
    if [[ -n $c && -x $c ]]; then nvcc=$c; break; fi
  done
fi
if [[ -z $nvcc ]]; then
  echo "build_cuda_module: no nvcc (set NVCC, or install python/requirements-cuda.txt)" >&2
  exit 2
fi
# The wheel's nvcc keeps the runtime's headers and libraries beside it.
cuda_home=$(cd "$(dirname "$nvcc")/.." && pwd)
# sm_80 (A100), sm_90 (H100, H200) machine code, and PTX for later GPUs.
"$nvcc" -O3 -std=c++17 -shared -Xcompiler -fPIC -cudart static \
  -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
  -gencode arch=compute_90,code=compute_90 \
  -I"$root" -I"$cuda_home/include" -L"$cuda_home/lib" -L"$cuda_home/lib64" \
  "$root/gpu/cuda_module.cu" -o "$out/libkvtier_cuda.so"
echo "$out/libkvtier_cuda.so"
