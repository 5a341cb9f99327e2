// The candidate walk: which of a fleet's workers a route weighs, in one pass
// over those holding part of the prompt and one over the rest in load order
// (docs/router.md, "Weighing the workers"). Workers at the same depth differ
// only in load, so the walk keeps just the `keep` cheapest (the highest
// rendezvous rank first among equals: the tie-break's winner is among them),
// the least loaded (the balance guard's pick) and the fleet's highest load;
// Decide then chooses among those. Reads the loads with relaxed atomics:
// call it under the core's shared lock.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "router/cost.h"
#include "router/fleet.h"
#include "router/prefix_index.h"

namespace kvtier::router {

struct WalkInput {
  const PrefixIndex* index = nullptr;
  const PrefixMatch* match = nullptr;
  const Fleet* fleet = nullptr;
  const LoadBoard* board = nullptr;
  size_t num_limit = 0;  // one past the highest SourceNum
  uint32_t block_tokens = 0;
  uint64_t prompt_tokens = 0;
  double fetch_cost = 0;    // per fetched token
  double load_weight = 0;   // per queued token
  OccupancyTerm occupancy;  // the pages a worker must place, priced
  uint64_t balance_threshold_tokens = 0;
  size_t keep = 1;         // the cheapest kept
  bool stop_early = true;  // false: weigh every worker (the reference)
  uint64_t request_hash = 0;
  // Workers never picked (RouteQuery::exclude).
  std::span<const SourceNum> exclude;
};

struct WalkPick {
  SourceNum num = 0;
  uint32_t depth = 0;  // GPU blocks of the prompt it holds
  uint64_t load = 0;
};

struct WalkResult {
  // The `keep` cheapest, cheapest first, then the least loaded when it is
  // not among them.
  absl::InlinedVector<WalkPick, 9> picks;
  // The fleet's highest load, or enough of it for the balance guard.
  uint64_t max_load = 0;
};

WalkResult WalkCandidates(const WalkInput& in);

}  // namespace kvtier::router
