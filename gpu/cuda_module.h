/* libkvtier_cuda: the CUDA half of gpu/page_copier.h, a shared library of
 * its own with a C ABI, loaded at run time (dlopen) by any kvtier build.
 *
 * Why a module: kvtier's binaries and Python package are built where no
 * CUDA compiler is (CI, most build hosts), and a GPU host may lack the
 * packages kvtier is built from. The module needs only nvcc and the CUDA
 * runtime: `scripts/build_cuda_module.sh` (or the CMake target kvtier_cuda
 * when nvcc is found) builds it on the GPU host, and every kvtier build
 * there uses it. Nothing here includes absl or kvtier's C++ headers.
 *
 * Memory: pages are device memory; block buffers are host memory registered
 * with kvtier_cuda_host_register (pinned and mapped), read and written by
 * the copy kernels straight over the bus, one launch per call; or, with
 * KVTIER_CUDA_COPY=dma in the environment at kvtier_cuda_open, by the copy
 * engines, each (block, layer, K|V) chunk one copy of a
 * cudaMemcpyBatchAsync batch (a module built with CUDA 13 or later; slower from a store's
 * 4 KiB-paged arena on an H200, docs/benchmarks.md).
 *
 * Errors: calls that can fail return 0 on success, else nonzero with a
 * message written into err (err_len bytes, NUL-terminated). Thread-safe:
 * each copy runs on a stream of its own from the module's pool. */
#ifndef KVTIER_GPU_CUDA_MODULE_H_
#define KVTIER_GPU_CUDA_MODULE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a declaration below changes; the loader refuses others. */
#define KVTIER_CUDA_ABI 1

typedef struct kvtier_cuda kvtier_cuda;

/* An engine's paged KV memory on the device (gpu::PageMemory): per layer,
 * page 0's K chunk and V chunk, page_stride bytes from one page's chunk to
 * the next page's. */
typedef struct {
  uint32_t layers;
  uint64_t chunk_bytes; /* one (layer, K|V) chunk of a page */
  uint64_t page_stride;
  uint8_t* const* k; /* layers entries, device pointers */
  uint8_t* const* v;
} kvtier_cuda_pages;

int kvtier_cuda_abi(void);

/* The device `device`; NULL with err set when there is none or CUDA fails. */
kvtier_cuda* kvtier_cuda_open(int device, char* err, size_t err_len);
void kvtier_cuda_close(kvtier_cuda* c);

/* Pins and maps host [p, p + n) so copies can reach it; unregister before
 * freeing it. */
int kvtier_cuda_host_register(kvtier_cuda* c, void* p, size_t n, char* err, size_t err_len);
void kvtier_cuda_host_unregister(kvtier_cuda* c, void* p);

/* The device p points into, or -1 (host memory, or unknown to CUDA). */
int kvtier_cuda_pointer_device(const void* p);

/* gather != 0: page pages[i]'s layers [layer_begin, layer_end) into
 * blocks[i]; else back. A block buffer is layer-major: layer l's K chunk
 * at l * 2 * chunk_bytes, its V chunk right after. blocks[i] lie in
 * registered host memory. Returns when the copy is done. */
int kvtier_cuda_copy(kvtier_cuda* c, const kvtier_cuda_pages* pages_memory, int gather,
                     uint32_t layer_begin, uint32_t layer_end, const uint32_t* pages,
                     uint8_t* const* blocks, size_t n, char* err, size_t err_len);

/* For checks and benchmarks: device memory, a synchronous copy in any
 * direction, and the time in seconds of `reps` cudaMemcpyAsync calls of n
 * bytes on one stream (CUDA events). */
void* kvtier_cuda_malloc(kvtier_cuda* c, size_t n, char* err, size_t err_len);
void kvtier_cuda_free(kvtier_cuda* c, void* p);
int kvtier_cuda_memcpy(kvtier_cuda* c, void* dst, const void* src, size_t n, char* err,
                       size_t err_len);
double kvtier_cuda_time_memcpy(kvtier_cuda* c, void* dst, const void* src, size_t n, int reps,
                               char* err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_GPU_CUDA_MODULE_H_ */
