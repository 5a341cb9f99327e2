// libkvtier_cuda (gpu/cuda_module.h): copies between an engine's paged KV
// memory on a GPU and block buffers in registered host memory, one kernel
// launch per call on a stream of the module's, each copy byte-identical to
// gpu::GatherCpu / ScatterCpu over the same gpu::PageMemory.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "gpu/cuda_module.h"

namespace {

// One launch copies every (block i, layer, K|V) chunk of the call: one
// thread block per chunk, threads striding over 16-byte words when every
// address and the chunk size allow it, else over bytes.
__global__ void CopyChunks(const uint8_t* const* k, const uint8_t* const* v, uint64_t page_stride,
                           uint64_t chunk, uint32_t layer_begin, uint32_t layers,
                           const uint32_t* pages, uint8_t* const* blocks, int gather) {
  const uint64_t id = blockIdx.x;
  const uint32_t i = static_cast<uint32_t>(id / (2ull * layers));
  const uint32_t rem = static_cast<uint32_t>(id % (2ull * layers));
  const uint32_t layer = layer_begin + rem / 2, kv = rem % 2;
  uint8_t* blk = blocks[i] + (2ull * layer + kv) * chunk;
  uint8_t* pg = const_cast<uint8_t*>(kv == 0 ? k[layer] : v[layer]) + uint64_t{pages[i]} * page_stride;
  const uint8_t* src = gather ? pg : blk;
  uint8_t* dst = gather ? blk : pg;
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | chunk) & 15) == 0;
  if (aligned) {
    // kUnroll loads in flight per thread before their stores: reads of
    // host memory over the bus take microseconds each.
    constexpr uint32_t kUnroll = 4;
    const uint4* __restrict__ s = reinterpret_cast<const uint4*>(src);
    uint4* __restrict__ d = reinterpret_cast<uint4*>(dst);
    const uint64_t words = chunk / 16;
    for (uint64_t base = threadIdx.x; base < words; base += uint64_t{blockDim.x} * kUnroll) {
      uint4 r[kUnroll];
#pragma unroll
      for (uint32_t u = 0; u < kUnroll; ++u) {
        const uint64_t w = base + uint64_t{u} * blockDim.x;
        if (w < words) r[u] = s[w];
      }
#pragma unroll
      for (uint32_t u = 0; u < kUnroll; ++u) {
        const uint64_t w = base + uint64_t{u} * blockDim.x;
        if (w < words) d[w] = r[u];
      }
    }
  } else {
    for (uint64_t b = threadIdx.x; b < chunk; b += blockDim.x) dst[b] = src[b];
  }
}

void SetErr(char* err, size_t len, const char* what, cudaError_t e) {
  if (err != nullptr && len > 0) {
    std::snprintf(err, len, "%s: %s", what, e == cudaSuccess ? "failed" : cudaGetErrorString(e));
  }
}

// A stream with its own argument buffers (pinned on the host, and on the
// device), used by one call at a time.
struct Lane {
  cudaStream_t stream = nullptr;
  uint8_t* host_args = nullptr;
  uint8_t* dev_args = nullptr;
  size_t capacity = 0;
};

struct Region {
  uint8_t* host;
  size_t bytes;
  uint8_t* device;  // the same bytes as the device addresses them
};

}  // namespace

struct kvtier_cuda {
  int device = 0;
  // KVTIER_CUDA_COPY=dma at open: copies go to the copy engines as one
  // batch of chunk copies (cudaMemcpyBatchAsync) instead of CopyChunks.
  bool dma = false;
  std::mutex mu;
  std::vector<Lane*> free_lanes;
  std::vector<Lane*> all_lanes;
  std::vector<Region> regions;
};

namespace {

Lane* TakeLane(kvtier_cuda* c, size_t need, char* err, size_t len) {
  Lane* lane = nullptr;
  {
    std::lock_guard<std::mutex> lk(c->mu);
    if (!c->free_lanes.empty()) {
      lane = c->free_lanes.back();
      c->free_lanes.pop_back();
    }
  }
  cudaError_t e;
  if (lane == nullptr) {
    lane = new Lane();
    if ((e = cudaStreamCreateWithFlags(&lane->stream, cudaStreamNonBlocking)) != cudaSuccess) {
      SetErr(err, len, "cudaStreamCreate", e);
      delete lane;
      return nullptr;
    }
    std::lock_guard<std::mutex> lk(c->mu);
    c->all_lanes.push_back(lane);
  }
  if (lane->capacity < need) {
    cudaFreeHost(lane->host_args);
    cudaFree(lane->dev_args);
    lane->host_args = lane->dev_args = nullptr;
    lane->capacity = 0;
    const size_t cap = std::max<size_t>(need, 64 << 10);
    if ((e = cudaMallocHost(&lane->host_args, cap)) != cudaSuccess ||
        (e = cudaMalloc(&lane->dev_args, cap)) != cudaSuccess) {
      SetErr(err, len, "argument buffers", e);
      std::lock_guard<std::mutex> lk(c->mu);
      c->free_lanes.push_back(lane);
      return nullptr;
    }
    lane->capacity = cap;
  }
  return lane;
}

void GiveLane(kvtier_cuda* c, Lane* lane) {
  std::lock_guard<std::mutex> lk(c->mu);
  c->free_lanes.push_back(lane);
}

size_t Align16(size_t n) { return (n + 15) / 16 * 16; }

}  // namespace

extern "C" {

int kvtier_cuda_abi(void) { return KVTIER_CUDA_ABI; }

kvtier_cuda* kvtier_cuda_open(int device, char* err, size_t err_len) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    SetErr(err, err_len, "cudaGetDeviceCount", e);
    return nullptr;
  }
  if (device < 0 || device >= n) {
    std::snprintf(err, err_len, "no CUDA device %d (%d visible)", device, n);
    return nullptr;
  }
  if ((e = cudaSetDevice(device)) != cudaSuccess) {
    SetErr(err, err_len, "cudaSetDevice", e);
    return nullptr;
  }
  auto* c = new kvtier_cuda();
  c->device = device;
  const char* how = std::getenv("KVTIER_CUDA_COPY");
  c->dma = how != nullptr && std::strcmp(how, "dma") == 0;
  return c;
}

void kvtier_cuda_close(kvtier_cuda* c) {
  if (c == nullptr) return;
  cudaSetDevice(c->device);
  for (Lane* lane : c->all_lanes) {
    cudaStreamSynchronize(lane->stream);
    cudaStreamDestroy(lane->stream);
    cudaFreeHost(lane->host_args);
    cudaFree(lane->dev_args);
    delete lane;
  }
  for (const Region& r : c->regions) cudaHostUnregister(r.host);
  delete c;
}

int kvtier_cuda_host_register(kvtier_cuda* c, void* p, size_t n, char* err, size_t err_len) {
  cudaSetDevice(c->device);
  cudaError_t e = cudaHostRegister(p, n, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (e != cudaSuccess) {
    SetErr(err, err_len, "cudaHostRegister", e);
    return 1;
  }
  void* dev = nullptr;
  if ((e = cudaHostGetDevicePointer(&dev, p, 0)) != cudaSuccess) {
    cudaHostUnregister(p);
    SetErr(err, err_len, "cudaHostGetDevicePointer", e);
    return 1;
  }
  std::lock_guard<std::mutex> lk(c->mu);
  c->regions.push_back(Region{static_cast<uint8_t*>(p), n, static_cast<uint8_t*>(dev)});
  return 0;
}

void kvtier_cuda_host_unregister(kvtier_cuda* c, void* p) {
  std::lock_guard<std::mutex> lk(c->mu);
  for (size_t i = 0; i < c->regions.size(); ++i) {
    if (c->regions[i].host == p) {
      cudaSetDevice(c->device);
      cudaHostUnregister(p);
      c->regions.erase(c->regions.begin() + static_cast<long>(i));
      return;
    }
  }
}

int kvtier_cuda_pointer_device(const void* p) {
  cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // clear it: an unknown pointer is an answer here
    return -1;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
}

namespace {

// The copy by the copy engines: every (block, layer, K|V) chunk one copy
// of a batch, in pieces of kBatch copies.
int CopyByDma(kvtier_cuda* c, const kvtier_cuda_pages* m, int gather, uint32_t layer_begin,
              uint32_t layer_end, const uint32_t* pages, uint8_t* const* blocks, size_t n,
              char* err, size_t err_len) {
#if CUDART_VERSION >= 13000  // 12.8 and 12.9 declare it with a failIdx argument
  const uint64_t block_span = 2ull * m->layers * m->chunk_bytes;
  {
    std::lock_guard<std::mutex> lk(c->mu);
    for (size_t i = 0; i < n; ++i) {
      bool found = false;
      for (const Region& r : c->regions) {
        found |= blocks[i] >= r.host && blocks[i] + block_span <= r.host + r.bytes;
      }
      if (!found) {
        std::snprintf(err, err_len, "block buffer %zu is not in registered host memory", i);
        return 1;
      }
    }
  }
  const size_t count = n * 2 * (layer_end - layer_begin);
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  dsts.reserve(count);
  srcs.reserve(count);
  for (size_t i = 0; i < n; ++i) {
    for (uint32_t l = layer_begin; l < layer_end; ++l) {
      for (uint32_t kv = 0; kv < 2; ++kv) {
        uint8_t* blk = blocks[i] + (2ull * l + kv) * m->chunk_bytes;
        uint8_t* pg = (kv == 0 ? m->k[l] : m->v[l]) + uint64_t{pages[i]} * m->page_stride;
        dsts.push_back(gather ? blk : pg);
        srcs.push_back(gather ? pg : blk);
      }
    }
  }
  std::vector<size_t> sizes(count, m->chunk_bytes);
  Lane* lane = TakeLane(c, 0, err, err_len);
  if (lane == nullptr) return 1;
  constexpr size_t kBatch = 8192;
  cudaError_t e = cudaSuccess;
  for (size_t at = 0; at < count && e == cudaSuccess; at += kBatch) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t first = 0;
    e = cudaMemcpyBatchAsync(dsts.data() + at, srcs.data() + at, sizes.data() + at,
                             std::min(kBatch, count - at), &attr, &first, 1, lane->stream);
  }
  if (e != cudaSuccess || (e = cudaStreamSynchronize(lane->stream)) != cudaSuccess) {
    SetErr(err, err_len, gather ? "gather copies" : "scatter copies", e);
    GiveLane(c, lane);
    return 1;
  }
  GiveLane(c, lane);
  return 0;
#else
  (void)c, (void)m, (void)gather, (void)layer_begin, (void)layer_end, (void)pages, (void)blocks,
      (void)n;
  std::snprintf(err, err_len, "KVTIER_CUDA_COPY=dma needs a module built with CUDA 13 or later");
  return 1;
#endif
}

}  // namespace

int kvtier_cuda_copy(kvtier_cuda* c, const kvtier_cuda_pages* m, int gather, uint32_t layer_begin,
                     uint32_t layer_end, const uint32_t* pages, uint8_t* const* blocks, size_t n,
                     char* err, size_t err_len) {
  if (n == 0 || layer_end <= layer_begin) return 0;
  if (layer_end > m->layers) {
    std::snprintf(err, err_len, "layers [%u, %u) outside the %u registered", layer_begin,
                  layer_end, m->layers);
    return 1;
  }
  cudaSetDevice(c->device);
  if (c->dma) return CopyByDma(c, m, gather, layer_begin, layer_end, pages, blocks, n, err, err_len);
  // The call's arguments in one buffer: K and V tables, device addresses of
  // the block buffers, the page list.
  const size_t tables = 2 * m->layers * sizeof(void*);
  const size_t blocks_at = Align16(tables);
  const size_t pages_at = Align16(blocks_at + n * sizeof(void*));
  const size_t need = pages_at + n * sizeof(uint32_t);
  Lane* lane = TakeLane(c, need, err, err_len);
  if (lane == nullptr) return 1;
  std::memcpy(lane->host_args, m->k, m->layers * sizeof(void*));
  std::memcpy(lane->host_args + m->layers * sizeof(void*), m->v, m->layers * sizeof(void*));
  auto** dev_blocks = reinterpret_cast<uint8_t**>(lane->host_args + blocks_at);
  {
    std::lock_guard<std::mutex> lk(c->mu);
    for (size_t i = 0; i < n; ++i) {
      dev_blocks[i] = nullptr;
      for (const Region& r : c->regions) {
        if (blocks[i] >= r.host && blocks[i] + 2 * m->layers * m->chunk_bytes <= r.host + r.bytes) {
          dev_blocks[i] = r.device + (blocks[i] - r.host);
          break;
        }
      }
      if (dev_blocks[i] == nullptr) {
        std::snprintf(err, err_len, "block buffer %zu is not in registered host memory", i);
        GiveLane(c, lane);
        return 1;
      }
    }
  }
  std::memcpy(lane->host_args + pages_at, pages, n * sizeof(uint32_t));
  cudaError_t e = cudaMemcpyAsync(lane->dev_args, lane->host_args, need, cudaMemcpyHostToDevice,
                                  lane->stream);
  if (e != cudaSuccess) {
    SetErr(err, err_len, "copying the arguments", e);
    GiveLane(c, lane);
    return 1;
  }
  const uint32_t layers = layer_end - layer_begin;
  auto* d = lane->dev_args;
  CopyChunks<<<static_cast<unsigned>(n * 2 * layers), 256, 0, lane->stream>>>(
      reinterpret_cast<const uint8_t* const*>(d),
      reinterpret_cast<const uint8_t* const*>(d + m->layers * sizeof(void*)), m->page_stride,
      m->chunk_bytes, layer_begin, layers, reinterpret_cast<const uint32_t*>(d + pages_at),
      reinterpret_cast<uint8_t* const*>(d + blocks_at), gather);
  if ((e = cudaGetLastError()) != cudaSuccess ||
      (e = cudaStreamSynchronize(lane->stream)) != cudaSuccess) {
    SetErr(err, err_len, gather ? "gather kernel" : "scatter kernel", e);
    GiveLane(c, lane);
    return 1;
  }
  GiveLane(c, lane);
  return 0;
}

void* kvtier_cuda_malloc(kvtier_cuda* c, size_t n, char* err, size_t err_len) {
  cudaSetDevice(c->device);
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, n);
  if (e != cudaSuccess) {
    SetErr(err, err_len, "cudaMalloc", e);
    return nullptr;
  }
  return p;
}

void kvtier_cuda_free(kvtier_cuda* c, void* p) {
  cudaSetDevice(c->device);
  cudaFree(p);
}

int kvtier_cuda_memcpy(kvtier_cuda* c, void* dst, const void* src, size_t n, char* err,
                       size_t err_len) {
  cudaSetDevice(c->device);
  cudaError_t e = cudaMemcpy(dst, src, n, cudaMemcpyDefault);
  if (e != cudaSuccess) {
    SetErr(err, err_len, "cudaMemcpy", e);
    return 1;
  }
  return 0;
}

double kvtier_cuda_time_memcpy(kvtier_cuda* c, void* dst, const void* src, size_t n, int reps,
                               char* err, size_t err_len) {
  cudaSetDevice(c->device);
  cudaStream_t s;
  cudaEvent_t a, b;
  cudaError_t e;
  if ((e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)) != cudaSuccess) {
    SetErr(err, err_len, "cudaStreamCreate", e);
    return -1;
  }
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s);  // warm-up
  cudaEventRecord(a, s);
  for (int i = 0; i < reps; ++i) cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s);
  cudaEventRecord(b, s);
  float ms = -1;
  if ((e = cudaEventSynchronize(b)) == cudaSuccess) e = cudaEventElapsedTime(&ms, a, b);
  if (e != cudaSuccess) SetErr(err, err_len, "cudaMemcpyAsync", e);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(s);
  return e == cudaSuccess ? ms / 1000.0 : -1;
}

}  // extern "C"
