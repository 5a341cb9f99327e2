// The candidate walk: which of a fleet's workers a route weighs, in one pass
// over those holding part of the prompt and one over the rest in load order
// (docs/router.md, "Weighing the workers"). Workers at the same depth differ
// only in load (and, for a worker holding blocks off its GPU, in where it
// holds them: priced apart), so the walk keeps just the `keep` cheapest (the highest
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
#include "router/off_gpu.h"
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
  FetchPrices prices;      // per token loaded from the store or a worker's own tier
  double load_weight = 0;  // per queued token
  // The blocks workers hold off their GPU (null: none), located on the
  // prompt's chain (namespace ns) for the workers holding part of it.
  const OffGpuBlocks* off_gpu = nullptr;
  uint64_t ns = 0;
  ChainView chain;
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
  BlockSplit blocks;  // where it would get the prompt's blocks
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
