// Rendezvous (highest-random-weight) hashing: the one rule for "which member
// of a set gets this key", used for block placement across store shards and
// for the router's tie-break among equally cheap workers.
//
// Adding a member moves only the keys it now wins (1/n of them); removing
// one moves only its own. Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/block_key.h"

namespace kvtier {

// The score of `member` for `key` (higher wins): XXH3-64 of the member's
// name seeded with the key.
uint64_t RendezvousScore(uint64_t key, std::string_view member);

// The index of the member with the highest score for key (the first one on
// equal scores). REQUIRES: !members.empty().
size_t RendezvousPick(uint64_t key, const std::vector<std::string>& members);

// A block's rendezvous key: XXH3-64 of (namespace, hash.hi, hash.lo).
uint64_t RendezvousKey(const BlockKey& key);

}  // namespace kvtier
