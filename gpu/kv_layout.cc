#include "gpu/kv_layout.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvtier::gpu {

absl::Status Validate(const KvLayout& l) {
  if (l.layers == 0 || l.kv_heads == 0 || l.head_dim == 0 || l.block_tokens == 0 ||
      l.num_pages == 0) {
    return absl::InvalidArgumentError("KV layout: every dimension must be at least 1");
  }
  if (l.num_pages > (1ull << 32)) {
    return absl::InvalidArgumentError(absl::StrCat("KV layout: ", l.num_pages, " pages is too many"));
  }
  return absl::OkStatus();
}

void GatherCpu(const KvLayout& l, const uint8_t* const* layer_bases, const uint32_t* pages,
               size_t count, uint8_t* const* blocks) {
  const uint64_t chunk = l.layer_page_bytes();
  for (size_t i = 0; i < count; ++i) {
    for (uint32_t layer = 0; layer < l.layers; ++layer) {
      std::memcpy(blocks[i] + layer * chunk, layer_bases[layer] + pages[i] * chunk, chunk);
    }
  }
}

void ScatterCpu(const KvLayout& l, uint8_t* const* layer_bases, const uint32_t* pages,
                size_t count, const uint8_t* const* blocks) {
  const uint64_t chunk = l.layer_page_bytes();
  for (size_t i = 0; i < count; ++i) {
    for (uint32_t layer = 0; layer < l.layers; ++layer) {
      std::memcpy(layer_bases[layer] + pages[i] * chunk, blocks[i] + layer * chunk, chunk);
    }
  }
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
    if (absx < 0x33000000u) return static_cast<uint16_t>(sign);  // below half the smallest subnormal
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
inline float Load(Dtype d, const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return d == Dtype::kFp16 ? HalfToFloat(v) : Bf16ToFloat(v);
}
inline void Store(Dtype d, uint8_t* p, float f) {
  uint16_t v = d == Dtype::kFp16 ? FloatToHalf(f) : FloatToBf16(f);
  std::memcpy(p, &v, 2);
}
}  // namespace

absl::Status PackInt8Cpu(const KvLayout& l, const uint8_t* block, uint8_t* packed) {
  if (l.dtype == Dtype::kFp8) {
    return absl::InvalidArgumentError("int8 packing applies to 16-bit caches; this one is fp8");
  }
  const uint64_t n = l.chunk_elems();
  const uint32_t chunks = 2 * l.layers;
  float* scales = reinterpret_cast<float*>(packed);
  int8_t* q = reinterpret_cast<int8_t*>(packed + chunks * 4);
  for (uint32_t c = 0; c < chunks; ++c) {
    const uint8_t* src = block + c * n * 2;
    float absmax = 0;
    for (uint64_t i = 0; i < n; ++i) {
      float v = std::fabs(Load(l.dtype, src + 2 * i));
      if (v > absmax) absmax = v;  // NaN never wins
    }
    float s = absmax / 127.0f;
    std::memcpy(&scales[c], &s, 4);
    for (uint64_t i = 0; i < n; ++i) {
      float r = s > 0 ? std::nearbyint(Load(l.dtype, src + 2 * i) / s) : 0.0f;
      r = std::clamp(r, -127.0f, 127.0f);
      q[c * n + i] = static_cast<int8_t>(r);
    }
  }
  return absl::OkStatus();
}

absl::Status UnpackInt8Cpu(const KvLayout& l, const uint8_t* packed, uint8_t* block) {
  if (l.dtype == Dtype::kFp8) {
    return absl::InvalidArgumentError("int8 packing applies to 16-bit caches; this one is fp8");
  }
  const uint64_t n = l.chunk_elems();
  const uint32_t chunks = 2 * l.layers;
  const int8_t* q = reinterpret_cast<const int8_t*>(packed + chunks * 4);
  for (uint32_t c = 0; c < chunks; ++c) {
    float s;
    std::memcpy(&s, packed + c * 4, 4);
    uint8_t* dst = block + c * n * 2;
    for (uint64_t i = 0; i < n; ++i) Store(l.dtype, dst + 2 * i, static_cast<float>(q[c * n + i]) * s);
  }
  return absl::OkStatus();
}

#ifndef KVTIER_HAVE_CUDA
bool CudaAvailable() { return false; }
#endif

}  // namespace kvtier::gpu
