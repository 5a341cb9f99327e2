// Test helpers: deterministic block contents; processes and temp dirs come
// from common/process.h.
#pragma once

#include <cstring>
#include <random>
#include <string>

#include "common/process.h"

namespace kvtier::testing {

using kvtier::Process;
using kvtier::TempDir;
using kvtier::WaitForPortFile;

// Deterministic pseudo-random bytes for block n.
inline std::string BlockBytesFor(uint64_t n, size_t size) {
  std::string s(size, '\0');
  std::mt19937_64 rng(n * 0x9E3779B97F4A7C15ull + 1);
  for (size_t i = 0; i + 8 <= size; i += 8) {
    uint64_t v = rng();
    std::memcpy(s.data() + i, &v, 8);
  }
  return s;
}

}  // namespace kvtier::testing
