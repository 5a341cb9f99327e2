// Deterministic pseudo-random bytes (xorshift64*) from a 64-bit seed: the
// known contents of blocks in the simulated model, benchmarks and tests, so
// every byte read back can be checked.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvtier {

inline void FillPattern(uint64_t seed, uint8_t* out, size_t len) {
  uint64_t x = seed | 1;
  size_t i = 0;
  for (; i + 8 <= len; i += 8) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    uint64_t v = x * 0x2545F4914F6CDD1Dull;
    std::memcpy(out + i, &v, 8);
  }
  for (; i < len; ++i) out[i] = static_cast<uint8_t>(x >> (8 * (i % 8)));
}

}  // namespace kvtier
