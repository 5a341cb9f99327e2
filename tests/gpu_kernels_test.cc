// gpu/: gather/scatter and int8 packing on the CPU against a naive
// element-by-element reference on random layouts, the packing error bound,
// and (label gpu) the CUDA kernels against the CPU when a GPU is present.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gpu/kernels.h"
#include "gpu/kv_layout.h"
#include "tests/gpu_test_util.h"

namespace kvtier::gpu {
namespace {

// The reference: walk every element by its (page, kv, token, head, dim) index.
void GatherReference(const KvLayout& l, const std::vector<std::vector<uint8_t>>& cache,
                     uint32_t page, uint8_t* block) {
  const uint32_t e = l.elem_bytes();
  uint64_t out = 0;
  for (uint32_t layer = 0; layer < l.layers; ++layer) {
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (uint32_t t = 0; t < l.block_tokens; ++t) {
        for (uint32_t h = 0; h < l.kv_heads; ++h) {
          for (uint32_t d = 0; d < l.head_dim; ++d) {
            uint64_t idx =
                ((((uint64_t{page} * 2 + kv) * l.block_tokens + t) * l.kv_heads + h) * l.head_dim +
                 d) *
                e;
            std::memcpy(block + out, cache[layer].data() + idx, e);
            out += e;
          }
        }
      }
    }
  }
}

TEST(GpuCpu, GatherMatchesTheReferenceAndScatterInvertsIt) {
  std::mt19937_64 rng(1);
  for (int round = 0; round < 40; ++round) {
    KvLayout l = RandomLayout(rng, static_cast<Dtype>(round % 3));
    auto cache = RandomCache(rng, l);
    std::vector<const uint8_t*> bases;
    for (auto& v : cache) bases.push_back(v.data());
    std::vector<uint32_t> pages;
    for (int i = 0; i < 1 + static_cast<int>(rng() % 6); ++i) pages.push_back(rng() % l.num_pages);
    std::vector<std::vector<uint8_t>> blocks(pages.size(), std::vector<uint8_t>(l.block_bytes()));
    std::vector<uint8_t*> bp;
    for (auto& b : blocks) bp.push_back(b.data());
    GatherCpu(l, bases.data(), pages.data(), pages.size(), bp.data());
    for (size_t i = 0; i < pages.size(); ++i) {
      std::vector<uint8_t> want(l.block_bytes());
      GatherReference(l, cache, pages[i], want.data());
      ASSERT_EQ(blocks[i], want) << "round " << round << " block " << i;
    }
    // Scatter into a fresh cache: the gathered pages come back byte-exact.
    std::vector<std::vector<uint8_t>> fresh(l.layers, std::vector<uint8_t>(l.layer_bytes(), 0));
    std::vector<uint8_t*> fb;
    for (auto& v : fresh) fb.push_back(v.data());
    std::vector<const uint8_t*> cbp(bp.begin(), bp.end());
    ScatterCpu(l, fb.data(), pages.data(), pages.size(), cbp.data());
    const uint64_t chunk = l.layer_page_bytes();
    for (uint32_t p : pages) {
      for (uint32_t layer = 0; layer < l.layers; ++layer) {
        ASSERT_EQ(0, std::memcmp(fresh[layer].data() + p * chunk, cache[layer].data() + p * chunk,
                                 chunk));
      }
    }
  }
}

TEST(GpuCpu, HalfAndBf16ConversionsRoundToNearestEven) {
  std::mt19937_64 rng(2);
  // Every half value converts to float and back unchanged (NaNs stay NaN).
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToHalf(f), h) << h;
  }
  for (uint32_t b = 0; b < 65536; ++b) {
    float f = Bf16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBf16(f), b) << b;
  }
  // Random floats land on one of the two neighbours, the nearer one.
  std::uniform_real_distribution<float> dist(-70000.0f, 70000.0f);
  for (int i = 0; i < 200000; ++i) {
    float f = i % 2 ? dist(rng) : dist(rng) * 1e-6f;
    float h = HalfToFloat(FloatToHalf(f));
    if (std::isinf(h)) {
      EXPECT_GE(std::fabs(f), 65504.0f);
      continue;
    }
    uint16_t hb = FloatToHalf(f);
    float up = HalfToFloat(static_cast<uint16_t>(hb + 1)),
          dn = HalfToFloat(static_cast<uint16_t>(hb - 1));
    EXPECT_LE(std::fabs(h - f), std::fabs(up - f) + 1e-12f) << f;
    EXPECT_LE(std::fabs(h - f), std::fabs(dn - f) + 1e-12f) << f;
  }
}

TEST(GpuCpu, FusedGatherPackAndLayerwiseUnpackScatterMatchTheBlockFunctions) {
  std::mt19937_64 rng(11);
  for (Dtype d : {Dtype::kFp16, Dtype::kBf16}) {
    KvLayout l = RandomLayout(rng, d);
    l.num_pages = 4;
    std::vector<std::vector<uint8_t>> layers(l.layers, std::vector<uint8_t>(l.layer_bytes()));
    std::vector<uint8_t*> bases;
    std::normal_distribution<float> nd(0, 2);
    for (auto& m : layers) {
      for (uint64_t i = 0; i < m.size() / 2; ++i) {
        uint16_t v = d == Dtype::kFp16 ? FloatToHalf(nd(rng)) : FloatToBf16(nd(rng));
        std::memcpy(m.data() + 2 * i, &v, 2);
      }
      bases.push_back(m.data());
    }
    const uint32_t pages[2] = {3, 1};
    // Fused gather + pack equals gather, then pack.
    std::vector<uint8_t> block(l.block_bytes()), want(l.packed_bytes()), got(l.packed_bytes());
    uint8_t* dst = block.data();
    GatherCpu(l, bases.data(), &pages[0], 1, &dst);
    ASSERT_TRUE(PackInt8Cpu(l, block.data(), want.data()).ok());
    uint8_t* out = got.data();
    ASSERT_TRUE(GatherPackInt8Cpu(l, bases.data(), &pages[0], 1, &out).ok());
    EXPECT_EQ(want, got);
    // Unpacking layer by layer into page 1 equals unpack, then scatter.
    std::vector<uint8_t> unpacked(l.block_bytes());
    ASSERT_TRUE(UnpackInt8Cpu(l, want.data(), unpacked.data()).ok());
    const uint8_t* src = got.data();
    for (uint32_t layer = 0; layer < l.layers; ++layer) {
      ASSERT_TRUE(UnpackScatterInt8Cpu(l, layer, layer + 1, bases.data(), &pages[1], 1, &src).ok());
    }
    for (uint32_t layer = 0; layer < l.layers; ++layer) {
      EXPECT_EQ(0,
                std::memcmp(bases[layer] + pages[1] * l.layer_page_bytes(),
                            unpacked.data() + layer * l.layer_page_bytes(), l.layer_page_bytes()))
          << "layer " << layer;
    }
    auto bad = UnpackScatterInt8Cpu(l, 0, l.layers + 1, bases.data(), &pages[1], 1, &src);
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bad.message().find("outside"), std::string::npos) << bad;
  }
}

TEST(GpuCpu, Int8PackingStaysWithinItsErrorBound) {
  std::mt19937_64 rng(3);
  for (Dtype d : {Dtype::kFp16, Dtype::kBf16}) {
    for (int round = 0; round < 10; ++round) {
      KvLayout l = RandomLayout(rng, d);
      std::vector<uint8_t> block(l.block_bytes()), packed(l.packed_bytes()), back(l.block_bytes());
      std::normal_distribution<float> nd(0, 1 + round);
      for (uint64_t i = 0; i < block.size() / 2; ++i) {
        uint16_t v = d == Dtype::kFp16 ? FloatToHalf(nd(rng)) : FloatToBf16(nd(rng));
        std::memcpy(block.data() + 2 * i, &v, 2);
      }
      ASSERT_TRUE(PackInt8Cpu(l, block.data(), packed.data()).ok());
      ASSERT_TRUE(UnpackInt8Cpu(l, packed.data(), back.data()).ok());
      EXPECT_EQ(l.packed_bytes() * 10, l.block_bytes() * 5 + 2ull * l.layers * 4 * 10)
          << "int8 halves the bytes (plus the scales)";
      const uint64_t n = l.chunk_elems();
      for (uint32_t c = 0; c < 2 * l.layers; ++c) {
        float s;  // layer-major packing: per layer the K and V scales, then their values
        std::memcpy(&s, packed.data() + (c / 2) * l.packed_layer_bytes() + 4 * (c % 2), 4);
        for (uint64_t i = 0; i < n; ++i) {
          uint16_t a, b;
          std::memcpy(&a, block.data() + (c * n + i) * 2, 2);
          std::memcpy(&b, back.data() + (c * n + i) * 2, 2);
          float x = d == Dtype::kFp16 ? HalfToFloat(a) : Bf16ToFloat(a);
          float y = d == Dtype::kFp16 ? HalfToFloat(b) : Bf16ToFloat(b);
          // s/2 from quantisation, plus half an ulp of the dtype at |y|.
          float ulp = d == Dtype::kFp16
                          ? std::ldexp(1.0f, std::ilogb(std::max(std::fabs(y), 6.1e-5f)) - 10)
                          : std::ldexp(1.0f, std::ilogb(std::max(std::fabs(y), 1e-30f)) - 7);
          ASSERT_LE(std::fabs(x - y), s / 2 + ulp / 2 + 1e-7f) << "chunk " << c << " elem " << i;
        }
      }
    }
  }
  KvLayout fp8;
  fp8.dtype = Dtype::kFp8;
  std::vector<uint8_t> b(fp8.block_bytes()), p(fp8.packed_bytes());
  EXPECT_EQ(PackInt8Cpu(fp8, b.data(), p.data()).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::gpu
