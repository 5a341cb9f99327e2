// The paged KV layout of an inference engine and the batched copies between
// it and contiguous block buffers.
//
// Engine layout, per layer l (its own allocation, at layer_bases[l]):
//   [num_pages][2 (K, V)][block_tokens][kv_heads][head_dim] elements.
// A block buffer holds one page of every layer, layer-major:
//   [layers][2][block_tokens][kv_heads][head_dim]  (block_bytes()).
//
// Gather copies a batch of pages into block buffers; Scatter copies back.
// Int8 packing halves a 16-bit block for the wire: each (layer, K|V) chunk
// gets a float32 scale s = absmax / 127 and elements q = round_half_even(x / s)
// clamped to [-127, 127]; unpacking gives q * s rounded to the dtype. The
// error is at most s / 2 per element before that rounding, plus half an ulp
// of the dtype after it (docs/dataplane.md). A packed block is layer-major
// like a plain one, so one layer is one byte range:
//   per layer: [K scale f32][V scale f32][K int8 x chunk_elems][V int8 x chunk_elems]. Every
//   function has a CPU
// implementation here; gpu/kernels.cu has CUDA versions whose output is
// byte-identical (tests compare them when a GPU is present).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "common/dtype.h"

namespace kvtier::gpu {

using kvtier::Dtype;  // common/dtype.h

struct KvLayout {
  uint32_t layers = 1;
  uint32_t kv_heads = 1;
  uint32_t head_dim = 1;
  uint32_t block_tokens = 1;
  Dtype dtype = Dtype::kFp16;
  uint64_t num_pages = 1;

  uint32_t elem_bytes() const { return ElementBytes(dtype); }
  // Elements of one (layer, K|V) chunk of a page.
  uint64_t chunk_elems() const { return uint64_t{block_tokens} * kv_heads * head_dim; }
  // Bytes of one page within one layer (K and V).
  uint64_t layer_page_bytes() const { return 2 * chunk_elems() * elem_bytes(); }
  uint64_t block_bytes() const { return uint64_t{layers} * layer_page_bytes(); }
  // One layer of an int8-packed block: two float32 scales, one byte per element.
  uint64_t packed_layer_bytes() const { return 2ull * 4 + 2ull * chunk_elems(); }
  uint64_t packed_bytes() const { return uint64_t{layers} * packed_layer_bytes(); }
  // Bytes of one layer's allocation.
  uint64_t layer_bytes() const { return num_pages * layer_page_bytes(); }
};

absl::Status Validate(const KvLayout& layout);

// Where the pages of a paged KV cache are, whoever allocated it: per layer,
// page 0's K chunk and page 0's V chunk (chunk_elems() contiguous elements
// each), and the bytes from one page's chunk to the next page's (the same
// for K and V). One description covers kvtier's own pool (V right after K,
// stride layer_page_bytes()), vLLM's [2][num_pages][tokens][heads][dim]
// (K and V halves of one tensor) and [num_pages][2][tokens][heads][dim], and
// separate K and V tensors per layer (SGLang).
struct PageMemory {
  std::vector<uint8_t*> k, v;  // per layer
  uint64_t page_stride = 0;

  uint8_t* K(uint32_t layer, uint32_t page) const { return k[layer] + page * page_stride; }
  uint8_t* V(uint32_t layer, uint32_t page) const { return v[layer] + page * page_stride; }
  // Whether every layer's V chunk follows its K chunk directly, so a page's
  // layer is one byte range of layout.layer_page_bytes().
  bool KvAdjacent(const KvLayout& layout) const;
  // kvtier's own layout: layer l at layer_bases[l], [num_pages][2][...].
  static PageMemory Contiguous(const KvLayout& layout, uint8_t* const* layer_bases);
};

// INVALID_ARGUMENT unless memory describes layout.layers layers with no
// null pointer and a page stride that fits a chunk (K and V of a page may
// not overlap each other or the next page's).
absl::Status Validate(const KvLayout& layout, const PageMemory& memory);

// blocks[i] (block_bytes()) receives page pages[i]; Scatter copies back.
// REQUIRES: pages[i] < num_pages.
void GatherCpu(const KvLayout& layout, const PageMemory& memory, const uint32_t* pages,
               size_t count, uint8_t* const* blocks);
void ScatterCpu(const KvLayout& layout, const PageMemory& memory, const uint32_t* pages,
                size_t count, const uint8_t* const* blocks);
// The same for layers [layer_begin, layer_end) only (a block buffer is
// layer-major: those layers are one byte range of it).
void GatherLayersCpu(const KvLayout& layout, const PageMemory& memory, uint32_t layer_begin,
                     uint32_t layer_end, const uint32_t* pages, size_t count,
                     uint8_t* const* blocks);
void ScatterLayersCpu(const KvLayout& layout, const PageMemory& memory, uint32_t layer_begin,
                      uint32_t layer_end, const uint32_t* pages, size_t count,
                      const uint8_t* const* blocks);

// blocks[i] receives page pages[i]. REQUIRES: pages[i] < num_pages.
void GatherCpu(const KvLayout& layout, const uint8_t* const* layer_bases, const uint32_t* pages,
               size_t count, uint8_t* const* blocks);
void ScatterCpu(const KvLayout& layout, uint8_t* const* layer_bases, const uint32_t* pages,
                size_t count, const uint8_t* const* blocks);

// INVALID_ARGUMENT for fp8 layouts (already 8-bit).
absl::Status PackInt8Cpu(const KvLayout& layout, const uint8_t* block, uint8_t* packed);
absl::Status UnpackInt8Cpu(const KvLayout& layout, const uint8_t* packed, uint8_t* block);
// Gather and pack in one pass: packed[i] (packed_bytes()) receives page
// pages[i]. INVALID_ARGUMENT for fp8.
absl::Status GatherPackInt8Cpu(const KvLayout& layout, const uint8_t* const* layer_bases,
                               const uint32_t* pages, size_t count, uint8_t* const* packed);
// Unpack and scatter layers [layer_begin, layer_end) of packed[i] into page
// pages[i] (a layer-wise load unpacks each layer as it arrives).
// INVALID_ARGUMENT for fp8 or a layer range outside the block.
absl::Status UnpackScatterInt8Cpu(const KvLayout& layout, uint32_t layer_begin, uint32_t layer_end,
                                  uint8_t* const* layer_bases, const uint32_t* pages, size_t count,
                                  const uint8_t* const* packed);

// Scalar conversions (round to nearest even), shared with the tests.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float Bf16ToFloat(uint16_t b);
uint16_t FloatToBf16(float f);

// True when this build has CUDA kernels and a GPU is visible.
bool CudaAvailable();

}  // namespace kvtier::gpu
