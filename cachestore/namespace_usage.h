// What each namespace holds and how its reads fare: blocks per tier (kept
// by the tiers' change listeners as blocks become visible and leave) and
// blocks asked for and served by gets. Read by ListNamespaces (kvctl
// namespaces). Thread-safe; the counting calls are quick (one map lookup
// under a mutex), as a change listener must be.
#pragma once

#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "cachestore/tier.h"
#include "common/block_key.h"

namespace kvtier::store {

struct NamespaceUsage {
  uint64_t ram_blocks = 0, nvme_blocks = 0;
  uint64_t blocks_asked = 0;   // blocks gets asked for
  uint64_t blocks_served = 0;  // of those, blocks served (a hit)
};

class NamespaceUsageTable {
 public:
  // A block of key.ns became visible in (added) or left (!added) `tier`.
  void Changed(const BlockKey& key, TierKind tier, bool added);
  // A get of namespace ns asked for `asked` blocks and served `served`.
  void Read(uint64_t ns, uint64_t asked, uint64_t served);
  NamespaceUsage Of(uint64_t ns) const;

 private:
  struct Counts {
    int64_t ram = 0, nvme = 0;
    uint64_t asked = 0, served = 0;
  };
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Counts> counts_;
};

}  // namespace kvtier::store
