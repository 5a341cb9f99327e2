// CUDA kernels for gpu/kv_layout.h (built only when nvcc is found:
// KVTIER_HAVE_CUDA). Pointer arrays and data live in device memory; each
// call is one kernel launch for the whole batch, asynchronous on `stream`.
#pragma once

#ifdef KVTIER_HAVE_CUDA
#include <cuda_runtime.h>

#include "gpu/kv_layout.h"

namespace kvtier::gpu {

absl::Status GatherCuda(const KvLayout& layout, const uint8_t* const* layer_bases,
                        const uint32_t* pages, size_t count, uint8_t* const* blocks,
                        cudaStream_t stream);
absl::Status ScatterCuda(const KvLayout& layout, uint8_t* const* layer_bases, const uint32_t* pages,
                         size_t count, const uint8_t* const* blocks, cudaStream_t stream);
absl::Status PackInt8Cuda(const KvLayout& layout, const uint8_t* const* blocks, size_t count,
                          uint8_t* const* packed, cudaStream_t stream);
absl::Status UnpackInt8Cuda(const KvLayout& layout, const uint8_t* const* packed, size_t count,
                            uint8_t* const* blocks, cudaStream_t stream);

}  // namespace kvtier::gpu
#endif
