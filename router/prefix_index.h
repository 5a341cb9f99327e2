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
  // store_run[i]: number of consecutive blocks from i held by a store
  // (i in 0..walked); blocks past `walked` are held by nobody who matters.
  std::vector<uint32_t> store_run;
  // Blocks examined.
  uint32_t walked = 0;
  // Deepest block matched by any worker or store, -1 if none.
  int64_t deepest = -1;
};

class PrefixIndex {
 public:
  // True if the pair was not there yet.
  bool Add(const BlockKey& key, SourceNum source);
  // True if the pair was there.
  bool Remove(const BlockKey& key, SourceNum source);

  // Walks the chain from its first block while some worker still holds the
  // prefix or a store holds the block. is_store tells stores from workers.
  void Match(uint64_t ns, std::span<const BlockHash> chain,
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
