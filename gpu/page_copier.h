// Copies between an engine's paged KV memory (gpu::PageMemory) and block
// buffers in host memory, for engine memory the connector does not read
// itself: a GPU's. The connector's staged path (worker/connector.h) moves
// every block through its host staging memory and calls a PageCopier to
// reach the pages:
//   - "cuda" / "cuda:N": the kernels of libkvtier_cuda (gpu/cuda_module.h),
//     loaded at run time, on streams of their own; pages are device memory.
//   - "host": the same copies with memcpy (GatherCpu / ScatterCpu), so the
//     staged path runs, and is tested, in every build on host pages.
// Both are byte for byte the same copy. Thread-safe; every call returns when
// its copy is done.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu/kv_layout.h"

namespace kvtier::gpu {

class PageCopier {
 public:
  virtual ~PageCopier() = default;
  // "host" or "cuda:N".
  virtual const std::string& name() const = 0;
  // INVALID_ARGUMENT unless every layer's K and V memory is where this
  // copier reaches (the host's, or device N's), naming the first that is not.
  virtual absl::Status CheckMemory(const KvLayout& layout, const PageMemory& memory) const = 0;
  // Makes host [p, p + n) reachable by the copies (pinned and mapped for a
  // GPU); undone by the copier's destruction. Block buffers must lie in it.
  virtual absl::Status RegisterHost(void* p, size_t n) = 0;
  // Undoes RegisterHost(p, ...) once no copy reads or writes it; a p not
  // registered is ignored.
  virtual void UnregisterHost(void* p) = 0;
  // gather: page pages[i]'s layers [layer_begin, layer_end) into blocks[i]
  // (layer-major, layout.block_bytes()); else blocks[i] into the pages.
  virtual absl::Status Copy(bool gather, const KvLayout& layout, const PageMemory& memory,
                            uint32_t layer_begin, uint32_t layer_end, const uint32_t* pages,
                            size_t count, uint8_t* const* blocks) = 0;
};

// "host", "cuda" (device 0) or "cuda:N". The CUDA copier loads
// libkvtier_cuda.so: $KVTIER_CUDA_MODULE if set, else the library search
// path, else beside the kvtier library or program loading it;
// FAILED_PRECONDITION (saying how to build it) when there is none or it has
// another ABI, UNAVAILABLE when CUDA finds no such device,
// INVALID_ARGUMENT for any other name.
absl::StatusOr<std::unique_ptr<PageCopier>> OpenPageCopier(const std::string& device);

// The device p points into, -1 for host memory, or an error when the CUDA
// module cannot be loaded (nothing is known then).
absl::StatusOr<int> PointerDevice(const void* p);

// The CUDA module, for the device check (tests/gpu_check.cc): device
// memory and the cudaMemcpyAsync reference. Each is an error where
// OpenPageCopier("cuda:N") would be one.
class CudaDevice {
 public:
  static absl::StatusOr<std::unique_ptr<CudaDevice>> Open(int device);
  virtual ~CudaDevice() = default;
  virtual absl::StatusOr<uint8_t*> Malloc(size_t n) = 0;
  virtual void Free(void* p) = 0;
  virtual absl::Status Memcpy(void* dst, const void* src, size_t n) = 0;
  // Seconds for `reps` cudaMemcpyAsync calls of n bytes on one stream.
  virtual absl::StatusOr<double> TimeMemcpy(void* dst, const void* src, size_t n, int reps) = 0;
  virtual absl::Status RegisterHost(void* p, size_t n) = 0;
  virtual void UnregisterHost(void* p) = 0;
};

}  // namespace kvtier::gpu
