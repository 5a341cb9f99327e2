// Block checksums: XXH3-64 over a block's bytes, computed by the writer and
// verified by the store at commit, on every read from disk, and by the reader.
#pragma once

#include <xxhash.h>

#include <cstddef>
#include <cstdint>

namespace kvtier {

inline uint64_t Checksum(const void* data, size_t len) { return XXH3_64bits(data, len); }

}  // namespace kvtier
