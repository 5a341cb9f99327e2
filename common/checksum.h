// Block checksums: XXH3-64 over a block's bytes, computed by the writer and
// verified by the store at commit, on every read from disk, and by the reader.
#pragma once

#ifndef XXH_STATIC_LINKING_ONLY
#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack (ChecksumStream)
#endif
#include <xxhash.h>

#include <cstddef>
#include <cstdint>

namespace kvtier {

inline uint64_t Checksum(const void* data, size_t len) { return XXH3_64bits(data, len); }

}  // namespace kvtier

namespace kvtier {

// Checksum of a block whose bytes lie in several pieces, fed in order: equal
// to Checksum of the pieces laid end to end (a layer-wise load verifies a
// block that landed in one page per layer).
class ChecksumStream {
 public:
  ChecksumStream() { XXH3_64bits_reset(&state_); }
  void Update(const void* data, size_t len) { XXH3_64bits_update(&state_, data, len); }
  uint64_t Digest() const { return XXH3_64bits_digest(&state_); }

 private:
  XXH3_state_t state_;
};

}  // namespace kvtier
