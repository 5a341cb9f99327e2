// CUDA versions of gpu/kv_layout.h's copies and int8 packing: one launch per
// batch (never one per page), byte-identical to the CPU implementations.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/kv_layout.h"
#include "gpu/kernels.h"

namespace kvtier::gpu {

namespace {

// One thread block per (block i, layer); threads stride over 16-byte words.
__global__ void GatherKernel(const uint8_t* const* layer_bases, const uint32_t* pages,
                             uint8_t* const* blocks, uint64_t chunk, uint32_t layers, int gather) {
  const uint32_t i = blockIdx.x / layers, layer = blockIdx.x % layers;
  uint8_t* blk = blocks[i] + layer * chunk;
  uint8_t* pg = const_cast<uint8_t*>(layer_bases[layer]) + uint64_t{pages[i]} * chunk;
  const uint8_t* src = gather ? pg : blk;
  uint8_t* dst = gather ? blk : pg;
  const bool aligned = ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                         chunk) & 15) == 0;
  if (aligned) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (uint64_t w = threadIdx.x; w < chunk / 16; w += blockDim.x) d[w] = s[w];
  } else {
    for (uint64_t b = threadIdx.x; b < chunk; b += blockDim.x) dst[b] = src[b];
  }
}

__device__ float LoadElem(const uint8_t* p, int bf16) {
  uint16_t v = *reinterpret_cast<const uint16_t*>(p);
  if (bf16) return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(&v));
  return __half2float(*reinterpret_cast<const __half*>(&v));
}

__device__ void StoreElem(uint8_t* p, float f, int bf16) {
  if (bf16) {
    __nv_bfloat16 b = __float2bfloat16_rn(f);
    *reinterpret_cast<__nv_bfloat16*>(p) = b;
  } else {
    __half h = __float2half_rn(f);
    *reinterpret_cast<__half*>(p) = h;
  }
}

// One thread block per (block i, chunk c): absmax reduction, then quantise.
__global__ void PackKernel(const uint8_t* const* blocks, uint8_t* const* packed, uint64_t n,
                           uint32_t chunks, int bf16) {
  const uint32_t i = blockIdx.x / chunks, c = blockIdx.x % chunks;
  const uint8_t* src = blocks[i] + uint64_t{c} * n * 2;
  __shared__ float red[256];
  float m = 0;
  for (uint64_t e = threadIdx.x; e < n; e += blockDim.x) m = fmaxf(m, fabsf(LoadElem(src + 2 * e, bf16)));
  red[threadIdx.x] = m;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
    __syncthreads();
  }
  const float scale = __fdiv_rn(red[0], 127.0f);
  // Layer-major packed block (gpu/kv_layout.h): per layer two scales, then K and V values.
  uint8_t* layer = packed[i] + uint64_t{c / 2} * (8 + 2 * n);
  if (threadIdx.x == 0) memcpy(layer + 4 * (c % 2), &scale, 4);  // may be unaligned
  int8_t* q = reinterpret_cast<int8_t*>(layer + 8) + uint64_t{c % 2} * n;
  for (uint64_t e = threadIdx.x; e < n; e += blockDim.x) {
    float r = scale > 0 ? rintf(__fdiv_rn(LoadElem(src + 2 * e, bf16), scale)) : 0.0f;
    q[e] = static_cast<int8_t>(fminf(fmaxf(r, -127.0f), 127.0f));
  }
}

__global__ void UnpackKernel(const uint8_t* const* packed, uint8_t* const* blocks, uint64_t n,
                             uint32_t chunks, int bf16) {
  const uint32_t i = blockIdx.x / chunks, c = blockIdx.x % chunks;
  const uint8_t* layer = packed[i] + uint64_t{c / 2} * (8 + 2 * n);
  float scale;
  memcpy(&scale, layer + 4 * (c % 2), 4);  // may be unaligned
  const int8_t* q = reinterpret_cast<const int8_t*>(layer + 8) + uint64_t{c % 2} * n;
  uint8_t* dst = blocks[i] + uint64_t{c} * n * 2;
  for (uint64_t e = threadIdx.x; e < n; e += blockDim.x) {
    StoreElem(dst + 2 * e, __fmul_rn(static_cast<float>(q[e]), scale), bf16);
  }
}

absl::Status Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace

bool CudaAvailable() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

absl::Status GatherCuda(const KvLayout& l, const uint8_t* const* layer_bases, const uint32_t* pages,
                        size_t count, uint8_t* const* blocks, cudaStream_t stream) {
  if (count == 0) return absl::OkStatus();
  GatherKernel<<<static_cast<unsigned>(count * l.layers), 256, 0, stream>>>(
      layer_bases, pages, blocks, l.layer_page_bytes(), l.layers, 1);
  return Check(cudaGetLastError(), "gather kernel launch");
}

absl::Status ScatterCuda(const KvLayout& l, uint8_t* const* layer_bases, const uint32_t* pages,
                         size_t count, const uint8_t* const* blocks, cudaStream_t stream) {
  if (count == 0) return absl::OkStatus();
  GatherKernel<<<static_cast<unsigned>(count * l.layers), 256, 0, stream>>>(
      layer_bases, pages, const_cast<uint8_t* const*>(blocks), l.layer_page_bytes(), l.layers, 0);
  return Check(cudaGetLastError(), "scatter kernel launch");
}

absl::Status PackInt8Cuda(const KvLayout& l, const uint8_t* const* blocks, size_t count,
                          uint8_t* const* packed, cudaStream_t stream) {
  if (l.dtype == Dtype::kFp8) return absl::InvalidArgumentError("int8 packing needs a 16-bit cache");
  if (count == 0) return absl::OkStatus();
  PackKernel<<<static_cast<unsigned>(count * 2 * l.layers), 256, 0, stream>>>(
      blocks, packed, l.chunk_elems(), 2 * l.layers, l.dtype == Dtype::kBf16);
  return Check(cudaGetLastError(), "pack kernel launch");
}

absl::Status UnpackInt8Cuda(const KvLayout& l, const uint8_t* const* packed, size_t count,
                            uint8_t* const* blocks, cudaStream_t stream) {
  if (l.dtype == Dtype::kFp8) return absl::InvalidArgumentError("int8 packing needs a 16-bit cache");
  if (count == 0) return absl::OkStatus();
  UnpackKernel<<<static_cast<unsigned>(count * 2 * l.layers), 256, 0, stream>>>(
      packed, blocks, l.chunk_elems(), 2 * l.layers, l.dtype == Dtype::kBf16);
  return Check(cudaGetLastError(), "unpack kernel launch");
}

}  // namespace kvtier::gpu
