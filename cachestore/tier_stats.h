// Counters every tier keeps (mirrors kvtier.v1.TierStats). Updated with
// relaxed atomics from any thread; read as a snapshot for stats.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace kvtier::store {

struct TierCounters {
  std::atomic<uint64_t> used_bytes{0}, items{0}, hits{0}, misses{0}, evictions{0}, promotions{0},
      demotions{0}, bytes_in{0}, bytes_out{0};
};

struct TierSnapshot {
  uint64_t capacity_bytes = 0, used_bytes = 0, items = 0, hits = 0, misses = 0, evictions = 0,
           promotions = 0, demotions = 0, bytes_in = 0, bytes_out = 0;
  std::string policy;
  bool degraded = false;
  std::string degraded_reason;
};

inline void Fill(const TierCounters& c, TierSnapshot* s) {
  s->used_bytes = c.used_bytes.load(std::memory_order_relaxed);
  s->items = c.items.load(std::memory_order_relaxed);
  s->hits = c.hits.load(std::memory_order_relaxed);
  s->misses = c.misses.load(std::memory_order_relaxed);
  s->evictions = c.evictions.load(std::memory_order_relaxed);
  s->promotions = c.promotions.load(std::memory_order_relaxed);
  s->demotions = c.demotions.load(std::memory_order_relaxed);
  s->bytes_in = c.bytes_in.load(std::memory_order_relaxed);
  s->bytes_out = c.bytes_out.load(std::memory_order_relaxed);
}

// Counts removed by an Evict call.
struct EraseCounts {
  uint64_t erased = 0;
  uint64_t pinned = 0;  // made invisible now, freed when their lease ends
};

}  // namespace kvtier::store
