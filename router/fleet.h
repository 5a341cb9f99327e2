// The workers of one namespace, weighed by load (docs/router.md, "Weighing
// the workers"), and the per-source load arrays Route reads.
//
// LoadBoard holds, dense by SourceNum so a route reads them without
// touching the sources: a worker's load (queued prefill tokens at its last
// heartbeat plus tokens routed since, raised by concurrent routes through
// std::atomic_ref), its id hash, and whether it sits in its fleet's
// `lowered` list. Fleet keeps its workers in load order as of the last
// rebuild; between rebuilds a load only grows (routes add to it) unless a
// heartbeat lowers it: those workers are in `lowered` and looked at apart,
// so a worker's load is never below its place in `order` suggests.
// Not thread-safe but where a method says so: RouterCore guards both.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "router/prefix_index.h"

namespace kvtier::router {

struct LoadBoard {
  std::vector<uint64_t> load, id_hash;
  // The share of the worker's GPU pages in use (blocks indexed over those
  // plus its free pages), as of its last heartbeat: the cost's occupancy
  // term. Written under the core's exclusive lock.
  std::vector<double> occupancy;
  std::vector<uint8_t> lowered;  // in its fleet's `lowered`

  // Makes room for `num`.
  void Ensure(SourceNum num);
  // Safe beside concurrent routes (relaxed atomics).
  uint64_t Load(SourceNum num) const {
    return std::atomic_ref<uint64_t>(const_cast<uint64_t&>(load[num]))
        .load(std::memory_order_relaxed);
  }
  // Adds a route's tokens; returns the new load. Safe beside other routes.
  uint64_t AddRouted(SourceNum num, uint64_t tokens) {
    return std::atomic_ref<uint64_t>(load[num]).fetch_add(tokens, std::memory_order_relaxed) +
           tokens;
  }
};

struct Fleet {
  std::vector<SourceNum> nums;  // every worker, by slot
  // Sum and count of the prefill rates its workers report (> 0 only).
  double prefill_sum = 0;
  uint32_t prefill_count = 0;
  // Sum of its workers' LoadBoard::occupancy.
  double occupancy_sum = 0;
  // (load at the last rebuild, worker), ascending.
  std::vector<std::pair<uint64_t, SourceNum>> order;
  std::vector<SourceNum> lowered;  // loads a heartbeat lowered since
  // At least every worker's load (routes raise it through RaiseBound), and
  // the worker that last raised it: while that worker's load still equals
  // it, it is the highest load exactly.
  uint64_t max_load_bound = 0;
  uint32_t max_load_owner = 0;

  // Adds a worker; returns its slot.
  size_t Join(SourceNum num, LoadBoard& board);
  // Removes the worker in `slot`; returns the worker moved into that slot
  // (`num` itself when it was the last).
  SourceNum Leave(size_t slot, SourceNum num, LoadBoard& board);
  // Sorts the workers by load afresh.
  void RebuildOrder(LoadBoard& board);
  // A heartbeat set `num`'s load (it was `before`).
  void LoadReported(SourceNum num, uint64_t before, LoadBoard& board);
  // A worker's reported prefill rate changes from `was` to `now` (0: none).
  void PrefillRateChanged(double was, double now);
  // The mean rate its workers report (0: none reported).
  double MeanPrefillRate() const { return prefill_count > 0 ? prefill_sum / prefill_count : 0; }
  // A heartbeat set one of its workers' occupancy from `was` to `now`.
  void OccupancyReported(double was, double now) { occupancy_sum += now - was; }
  // The mean share of its workers' pages in use.
  double MeanOccupancy() const {
    return nums.empty() ? 0 : std::max(0.0, occupancy_sum / static_cast<double>(nums.size()));
  }
  // A route raised `num`'s load to `load`. Safe beside other routes.
  void RaiseBound(SourceNum num, uint64_t load);
  // Atomic reads of the bound and its owner, beside concurrent routes.
  uint64_t Bound() const {
    return std::atomic_ref<uint64_t>(const_cast<uint64_t&>(max_load_bound))
        .load(std::memory_order_relaxed);
  }
  SourceNum BoundOwner() const {
    return std::atomic_ref<uint32_t>(const_cast<uint32_t&>(max_load_owner))
        .load(std::memory_order_relaxed);
  }
};

}  // namespace kvtier::router
