// The blocks workers hold off their GPU: (block, worker) -> the fastest
// medium of the worker's own that holds it, CPU or disk (Medium in
// router/source_messages.h). A block a worker holds that is not here is on
// its GPU. Only engines that offload (vLLM's CPU offloading, through its
// KV events) put anything here; a route probes it only for those.
// Not thread-safe: RouterCore guards it.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "router/prefix_index.h"
#include "router/source_messages.h"

namespace kvtier::router {

class OffGpuBlocks {
 public:
  // Where a worker holding chain[0, depth) keeps it: [0, gpu) on its GPU,
  // [gpu, gpu + cpu) on its CPU tier, the rest on a slower tier.
  struct Split {
    uint32_t gpu = 0, cpu = 0;
  };

  // Sets the fastest medium holding `fp` on `source` (kGpu: drops it).
  void Set(uint64_t fp, SourceNum source, Medium medium);
  // Forgets `fp` on `source` (a block the worker no longer holds).
  void Erase(uint64_t fp, SourceNum source) { Set(fp, source, Medium::kGpu); }
  Medium Get(uint64_t fp, SourceNum source) const {
    auto it = map_.find(std::pair{fp, source});
    return it == map_.end() ? Medium::kGpu : it->second;
  }
  // How many of `source`'s blocks are off its GPU.
  uint64_t Count(SourceNum source) const { return source < count_.size() ? count_[source] : 0; }
  // Forgets every block of `source` (one pass: a clear, restart or snapshot).
  void RemoveSource(SourceNum source);

  // Locates chain[0, depth) on `source`'s media in O(log depth) probes,
  // assuming the media go from fast to slow along the chain (each tier
  // drops a chain from its tail, so the GPU holds a prefix of what the CPU
  // holds). Where that does not hold the split is approximate: a route a
  // little off the ideal, never a wrong byte (the engine's own lookup is
  // exact).
  Split Locate(uint64_t ns, const ChainView& chain, SourceNum source, uint32_t depth) const;

  // The first i in [lo, hi) at which `past(i)` turns true (hi if it never
  // does), for a `past` false then true along the range: a binary search.
  template <class Past>
  static uint32_t FirstPast(uint32_t lo, uint32_t hi, Past past) {
    // Plain indices, not std::views::iota: the fuzz build's clang cannot
    // instantiate libstdc++ 12's iota_view.
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo) / 2;
      if (past(mid)) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    return lo;
  }

  size_t size() const { return map_.size(); }
  size_t MemoryBytes() const {
    return map_.capacity() * (sizeof(std::pair<std::pair<uint64_t, SourceNum>, Medium>) + 1) +
           count_.capacity() * sizeof(uint64_t);
  }

 private:
  absl::flat_hash_map<std::pair<uint64_t, SourceNum>, Medium> map_;
  std::vector<uint64_t> count_;  // by SourceNum
};

}  // namespace kvtier::router
