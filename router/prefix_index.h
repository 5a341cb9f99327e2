// The router's prefix index: (namespace, block hash) -> the sources holding
// the block (workers on GPU, store shards). Not thread-safe: RouterCore
// guards it. Memory: one flat hash-map slot per distinct block (24-byte key
// plus an inline vector of up to 4 source numbers) -- see docs/router.md.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "common/block_key.h"

namespace kvtier::router {

// A dense number for a source, assigned by RouterCore.
using SourceNum = uint32_t;

struct PrefixMatch {
  // Leading blocks of the chain each worker holds (only workers with >= 1).
  std::vector<std::pair<SourceNum, uint32_t>> gpu_depth;
  // (position, run): blocks held by a store consecutively from `position`,
  // for position 0 and each worker's depth (what a route needs).
  std::vector<std::pair<uint32_t, uint32_t>> store_runs;
  // Blocks some worker or store covers from the start: the deepest worker's
  // depth plus the store's run from there.
  uint32_t walked = 0;
  // Deepest block matched by any worker or store (walked - 1), -1 if none.
  int64_t deepest = -1;
  // Hash-table probes the match made.
  uint32_t probes = 0;

  void Clear() {
    gpu_depth.clear();
    store_runs.clear();
    walked = 0;
    deepest = -1;
    probes = 0;
  }
  // The store's run from `position` (0 for a position it was not asked for).
  uint32_t StoreRun(uint32_t position) const {
    for (const auto& [at, run] : store_runs) {
      if (at == position) return run;
    }
    return 0;
  }
};

class PrefixIndex {
 public:
  // True if the pair was not there yet.
  bool Add(const BlockKey& key, SourceNum source);
  // True if the pair was there.
  bool Remove(const BlockKey& key, SourceNum source);

  // The workers' prefixes of the chain in O(log n) probes per distinct
  // depth (docs/router.md, "Matching"): workers that hold block 0 are
  // followed as a group; galloping then binary search finds the first block
  // not all of them hold, those that lack it leave the group with that
  // depth, and the rest go on. Exact when every worker's blocks of the
  // chain are a prefix of it (engines fill front to back and evict from the
  // tail); with a hole a depth may come out deeper than the contiguous
  // prefix, never deeper than the first probed block it lacks. The store's
  // runs are counted block by block (exact). is_store tells stores from
  // workers.
  void Match(uint64_t ns, std::span<const BlockHash> chain,
             const std::function<bool(SourceNum)>& is_store, PrefixMatch* out) const;
  // The reference: walks every block from the first while some worker still
  // holds the prefix or a store holds the block (exact with holes too).
  void MatchLinear(uint64_t ns, std::span<const BlockHash> chain,
                   const std::function<bool(SourceNum)>& is_store, PrefixMatch* out) const;

  size_t blocks() const { return map_.size(); }
  size_t replicas() const { return replicas_; }
  // Rough bytes used by the table (slots and heap-allocated holder lists).
  size_t MemoryBytes() const;

 private:
  static constexpr size_t kInline = 3;
  using Holders = absl::InlinedVector<SourceNum, kInline>;
  absl::flat_hash_map<BlockKey, Holders, BlockKeyHasher> map_;
  size_t replicas_ = 0;
  size_t spilled_ = 0;  // holder lists that outgrew their inline space
};

}  // namespace kvtier::router
