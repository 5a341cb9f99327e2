// What every tier of the store (RAM, NVMe) promises, and the types the tiers
// and the store share.
//
// A tier holds blocks by key, reports every block that becomes visible in it
// or leaves it to one change listener, erases on an operator's request, and
// evicts by a policy that can be swapped at run time without dropping a
// block. How a block gets in (reserve/publish in RAM, write-back on disk)
// differs per tier and is on the concrete class. Implementations are
// thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cachestore/tier_stats.h"
#include "common/block_key.h"

namespace kvtier::store {

// Which tier: the store's name for one (kvtier.v1.Tier on the wire).
enum class TierKind { kRam = 1, kDisk = 2 };

// A block leaving RAM by eviction: its bytes are valid only during the call.
struct EvictedBlock {
  BlockKey key;
  const uint8_t* data;
  uint64_t length;
  uint64_t checksum;
  uint32_t reads;  // times it was read while in RAM
};

// Told when a block becomes visible in a tier (true) or leaves it (false).
// It may be called under the tier's locks: it must be quick and must not
// call back into the tier.
using ChangeListener = std::function<void(const BlockKey&, bool added)>;

class Tier {
 public:
  virtual ~Tier() = default;

  // Replaces the listener; once this returns, a replaced or cleared listener
  // is not called again.
  virtual void SetChangeListener(ChangeListener listener) = 0;

  // True if the block is visible in this tier (readable now).
  virtual bool Contains(const BlockKey& key) const = 0;

  // Removes the named blocks / a namespace's / all. A block pinned by a
  // reader is hidden at once and freed when its lease ends (counted pinned).
  virtual EraseCounts Erase(const std::vector<BlockKey>& keys) = 0;
  virtual EraseCounts EraseNamespace(uint64_t ns) = 0;
  virtual EraseCounts EraseAll() = 0;

  // Switches the eviction policy (eviction_policy.h), rebuilt from the
  // current residents; drops nothing. INVALID_ARGUMENT for an unknown name
  // or parameter.
  virtual absl::Status SetPolicy(const std::string& name,
                                 const std::map<std::string, double>& params) = 0;
  virtual std::string policy() const = 0;
  virtual std::map<std::string, double> policy_params() const = 0;

  virtual TierSnapshot Snapshot() const = 0;
};

}  // namespace kvtier::store
