#include "gpu/kv_layout.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvtier::gpu {

absl::Status Validate(const KvLayout& l) {
  if (l.layers == 0 || l.kv_heads == 0 || l.head_dim == 0 || l.block_tokens == 0 ||
      l.num_pages == 0) {
    return absl::InvalidArgumentError("KV layout: every dimension must be at least 1");
  }
  if (l.num_pages > (1ull << 32)) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV layout: ", l.num_pages, " pages is too many"));
  }
  return absl::OkStatus();
}

bool PageMemory::KvAdjacent(const KvLayout& l) const {
  const uint64_t chunk = l.chunk_elems() * l.elem_bytes();
  for (size_t i = 0; i < k.size(); ++i) {
    if (v[i] != k[i] + chunk) return false;
  }
  return true;
}

PageMemory PageMemory::Contiguous(const KvLayout& l, uint8_t* const* layer_bases) {
  PageMemory m;
  const uint64_t chunk = l.chunk_elems() * l.elem_bytes();
  for (uint32_t i = 0; i < l.layers; ++i) {
    m.k.push_back(layer_bases[i]);
    m.v.push_back(layer_bases[i] + chunk);
  }
  m.page_stride = l.layer_page_bytes();
  return m;
}

absl::Status Validate(const KvLayout& l, const PageMemory& m) {
  if (m.k.size() != l.layers || m.v.size() != l.layers) {
    return absl::InvalidArgumentError(absl::StrCat("KV memory names ", m.k.size(), " K and ",
                                                   m.v.size(), " V layers; the layout has ",
                                                   l.layers));
  }
  const uint64_t chunk = l.chunk_elems() * l.elem_bytes();
  if (m.page_stride < chunk) {
    return absl::InvalidArgumentError(absl::StrCat("page stride ", m.page_stride,
                                                   " bytes is smaller than a page's K chunk (",
                                                   chunk, " bytes)"));
  }
  for (uint32_t i = 0; i < l.layers; ++i) {
    if (m.k[i] == nullptr || m.v[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", i, " has no K or V memory"));
    }
    // No V chunk may overlap any K chunk of the layer: either the K and V
    // ranges are apart, or pages interleave K and V ([pages][2]...) with
    // V inside the gap a stride of two chunks or more leaves.
    const uint64_t gap = m.v[i] > m.k[i] ? m.v[i] - m.k[i] : m.k[i] - m.v[i];
    const uint64_t span = (l.num_pages - 1) * m.page_stride + chunk;
    const uint64_t within = gap % m.page_stride;
    const bool apart = gap >= span;
    const bool interleaved =
        m.page_stride >= 2 * chunk && within >= chunk && within <= m.page_stride - chunk;
    if (!apart && !interleaved) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", i, ": K and V pages overlap (V is ", gap, " bytes from K, a chunk is ", chunk,
          " bytes, the page stride ", m.page_stride, ")"));
    }
  }
  return absl::OkStatus();
}

void GatherLayersCpu(const KvLayout& l, const PageMemory& m, uint32_t layer_begin,
                     uint32_t layer_end, const uint32_t* pages, size_t count,
                     uint8_t* const* blocks) {
  const uint64_t chunk = l.chunk_elems() * l.elem_bytes();
  for (size_t i = 0; i < count; ++i) {
    for (uint32_t layer = layer_begin; layer < layer_end; ++layer) {
      uint8_t* out = blocks[i] + layer * 2 * chunk;
      std::memcpy(out, m.K(layer, pages[i]), chunk);
      std::memcpy(out + chunk, m.V(layer, pages[i]), chunk);
    }
  }
}

void ScatterLayersCpu(const KvLayout& l, const PageMemory& m, uint32_t layer_begin,
                      uint32_t layer_end, const uint32_t* pages, size_t count,
                      const uint8_t* const* blocks) {
  const uint64_t chunk = l.chunk_elems() * l.elem_bytes();
  for (size_t i = 0; i < count; ++i) {
    for (uint32_t layer = layer_begin; layer < layer_end; ++layer) {
      const uint8_t* in = blocks[i] + layer * 2 * chunk;
      std::memcpy(m.K(layer, pages[i]), in, chunk);
      std::memcpy(m.V(layer, pages[i]), in + chunk, chunk);
    }
  }
}

void GatherCpu(const KvLayout& l, const PageMemory& m, const uint32_t* pages, size_t count,
               uint8_t* const* blocks) {
  GatherLayersCpu(l, m, 0, l.layers, pages, count, blocks);
}

void ScatterCpu(const KvLayout& l, const PageMemory& m, const uint32_t* pages, size_t count,
                const uint8_t* const* blocks) {
  ScatterLayersCpu(l, m, 0, l.layers, pages, count, blocks);
}

void GatherCpu(const KvLayout& l, const uint8_t* const* layer_bases, const uint32_t* pages,
               size_t count, uint8_t* const* blocks) {
  GatherCpu(l, PageMemory::Contiguous(l, const_cast<uint8_t* const*>(layer_bases)), pages, count,
            blocks);
}

void ScatterCpu(const KvLayout& l, uint8_t* const* layer_bases, const uint32_t* pages, size_t count,
                const uint8_t* const* blocks) {
  ScatterCpu(l, PageMemory::Contiguous(l, layer_bases), pages, count, blocks);
}

float HalfToFloat(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while (!(man & 0x400));
      bits = sign | ((127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0));
  }
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (absx < 0x38800000u) {  // subnormal or zero in half
    if (absx < 0x33000000u)
      return static_cast<uint16_t>(sign);  // below half the smallest subnormal
    uint32_t man = (absx & 0x7fffffu) | 0x800000u;
    int shift = 126 - static_cast<int>(absx >> 23);  // 14 + (113 - exp)
    uint32_t half = man >> (shift + 0);
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    uint32_t q = half;
    if (rem > mid || (rem == mid && (q & 1))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t e = (absx >> 23) - 127 + 15;
  uint32_t man = absx & 0x7fffffu;
  uint32_t q = (e << 10) | (man >> 13);
  uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (q & 1))) ++q;  // may carry into the exponent: fine
  return static_cast<uint16_t>(sign | q);
}

float Bf16ToFloat(uint16_t b) {
  uint32_t bits = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToBf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet nan
  x += 0x7fffu + ((x >> 16) & 1);
  return static_cast<uint16_t>(x >> 16);
}

namespace {
// Every fp16 value as a float: one table lookup instead of a conversion per
// element on the pack path (256 KiB, built once).
const float* HalfTable() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t i = 0; i < 65536; ++i) t[i] = HalfToFloat(static_cast<uint16_t>(i));
    return t;
  }();
  return table.data();
}

inline float Load(Dtype d, const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return d == Dtype::kFp16 ? HalfTable()[v] : Bf16ToFloat(v);
}

// One (layer, K|V) chunk of n elements at src: its scale, then its int8 values.
void PackChunk(Dtype d, const uint8_t* src, uint64_t n, uint8_t* scale_out, int8_t* q) {
  float absmax = 0;
  for (uint64_t i = 0; i < n; ++i) {
    float v = std::fabs(Load(d, src + 2 * i));
    if (v > absmax) absmax = v;  // NaN never wins
  }
  const float s = absmax / 127.0f;
  std::memcpy(scale_out, &s, 4);
  for (uint64_t i = 0; i < n; ++i) {
    // Round half to even by the 1.5 x 2^23 trick (exact for |v| < 2^22, and
    // |v| <= 127 here), then clamp as the CUDA kernel's fmaxf/fminf do: NaN
    // becomes -127 on both.
    const float v = s > 0 ? Load(d, src + 2 * i) / s : 0.0f;
    const float r = (v + 0x1.8p23f) - 0x1.8p23f;
    q[i] = static_cast<int8_t>(std::fmin(std::fmax(r, -127.0f), 127.0f));
  }
}

void UnpackChunk(Dtype d, const uint8_t* scale_in, const int8_t* q, uint64_t n, uint8_t* dst) {
  float s;
  std::memcpy(&s, scale_in, 4);
  // A chunk has at most 255 distinct values: convert each once.
  uint16_t values[256];
  for (int v = -128; v <= 127; ++v) {
    const float f = static_cast<float>(v) * s;
    values[v + 128] = d == Dtype::kFp16 ? FloatToHalf(f) : FloatToBf16(f);
  }
  for (uint64_t i = 0; i < n; ++i) std::memcpy(dst + 2 * i, &values[q[i] + 128], 2);
}

absl::Status Needs16Bit(const KvLayout& l) {
  if (l.dtype != Dtype::kFp8) return absl::OkStatus();
  return absl::InvalidArgumentError("int8 packing applies to 16-bit caches; this one is fp8");
}

// Chunk k (0: K, 1: V) of layer `layer` in a packed block.
uint8_t* PackedScale(const KvLayout& l, uint8_t* packed, uint32_t layer, uint32_t k) {
  return packed + layer * l.packed_layer_bytes() + 4 * k;
}
int8_t* PackedValues(const KvLayout& l, uint8_t* packed, uint32_t layer, uint32_t k) {
  return reinterpret_cast<int8_t*>(packed + layer * l.packed_layer_bytes() + 8 +
                                   k * l.chunk_elems());
}

}  // namespace

absl::Status PackInt8Cpu(const KvLayout& l, const uint8_t* block, uint8_t* packed) {
  if (auto s = Needs16Bit(l); !s.ok()) return s;
  const uint64_t n = l.chunk_elems();
  for (uint32_t layer = 0; layer < l.layers; ++layer) {
    for (uint32_t k = 0; k < 2; ++k) {
      PackChunk(l.dtype, block + (2 * layer + k) * n * 2, n, PackedScale(l, packed, layer, k),
                PackedValues(l, packed, layer, k));
    }
  }
  return absl::OkStatus();
}

absl::Status UnpackInt8Cpu(const KvLayout& l, const uint8_t* packed, uint8_t* block) {
  if (auto s = Needs16Bit(l); !s.ok()) return s;
  const uint64_t n = l.chunk_elems();
  auto* p = const_cast<uint8_t*>(packed);  // read only
  for (uint32_t layer = 0; layer < l.layers; ++layer) {
    for (uint32_t k = 0; k < 2; ++k) {
      UnpackChunk(l.dtype, PackedScale(l, p, layer, k), PackedValues(l, p, layer, k), n,
                  block + (2 * layer + k) * n * 2);
    }
  }
  return absl::OkStatus();
}

absl::Status GatherPackInt8Cpu(const KvLayout& l, const uint8_t* const* layer_bases,
                               const uint32_t* pages, size_t count, uint8_t* const* packed) {
  if (auto s = Needs16Bit(l); !s.ok()) return s;
  const uint64_t n = l.chunk_elems();
  for (size_t i = 0; i < count; ++i) {
    for (uint32_t layer = 0; layer < l.layers; ++layer) {
      const uint8_t* page = layer_bases[layer] + pages[i] * l.layer_page_bytes();
      for (uint32_t k = 0; k < 2; ++k) {
        PackChunk(l.dtype, page + k * n * 2, n, PackedScale(l, packed[i], layer, k),
                  PackedValues(l, packed[i], layer, k));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status UnpackScatterInt8Cpu(const KvLayout& l, uint32_t layer_begin, uint32_t layer_end,
                                  uint8_t* const* layer_bases, const uint32_t* pages, size_t count,
                                  const uint8_t* const* packed) {
  if (auto s = Needs16Bit(l); !s.ok()) return s;
  if (layer_begin > layer_end || layer_end > l.layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer range [", layer_begin, ", ", layer_end,
                                                   ") is outside the block's ", l.layers,
                                                   " layers"));
  }
  const uint64_t n = l.chunk_elems();
  for (size_t i = 0; i < count; ++i) {
    auto* p = const_cast<uint8_t*>(packed[i]);  // read only
    for (uint32_t layer = layer_begin; layer < layer_end; ++layer) {
      uint8_t* page = layer_bases[layer] + pages[i] * l.layer_page_bytes();
      for (uint32_t k = 0; k < 2; ++k) {
        UnpackChunk(l.dtype, PackedScale(l, p, layer, k), PackedValues(l, p, layer, k), n,
                    page + k * n * 2);
      }
    }
  }
  return absl::OkStatus();
}

#ifndef KVTIER_HAVE_CUDA
bool CudaAvailable() { return false; }
#endif

}  // namespace kvtier::gpu
