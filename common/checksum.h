// Block checksums: XXH3-64 over a block's bytes, computed by the writer and
// verified by the store at commit, on every read from disk, and by the reader.
#pragma once

#ifndef XXH_STATIC_LINKING_ONLY
#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack (ChecksumStream)
#endif
#include <xxhash.h>
#if defined(__x86_64__)
// libxxhash's runtime-dispatched XXH3 (AVX2 / AVX-512 where the CPU has them):
// the same hash, computed faster (here 20 GB/s from memory against 13 for
// the SSE2 default, ~70 GB/s from L1). Every block byte is hashed by the
// writer, by the store at commit and by the reader.
#define XXH_DISPATCH_DISABLE_REPLACE  // only our two calls use it; XXH3_64bits stays
#include <xxh_x86dispatch.h>
#define KVTIER_XXH3_64 XXH3_64bits_dispatch
#define KVTIER_XXH3_64_UPDATE XXH3_64bits_update_dispatch
#else
#define KVTIER_XXH3_64 XXH3_64bits
#define KVTIER_XXH3_64_UPDATE XXH3_64bits_update
#endif

#include <cstddef>
#include <cstdint>

namespace kvtier {

inline uint64_t Checksum(const void* data, size_t len) { return KVTIER_XXH3_64(data, len); }

}  // namespace kvtier

namespace kvtier {

// Checksum of a block whose bytes lie in several pieces, fed in order: equal
// to Checksum of the pieces laid end to end (a layer-wise load verifies a
// block that landed in one page per layer).
class ChecksumStream {
 public:
  ChecksumStream() { XXH3_64bits_reset(&state_); }
  void Update(const void* data, size_t len) { KVTIER_XXH3_64_UPDATE(&state_, data, len); }
  uint64_t Digest() const { return XXH3_64bits_digest(&state_); }

 private:
  XXH3_state_t state_;
};

}  // namespace kvtier
