// The router's state: registered sources (workers and store shards), their
// event sequence numbers, load, and the prefix index; plus Route.
//
// Event handling follows docs/router.md: events apply in sequence order per
// (source, epoch); an already-applied number is ignored; a gap, a new epoch or
// an unknown source asks the source for a snapshot, and the source's events
// are ignored until the snapshot's last chunk replaces what the router knew.
// A source silent past the heartbeat deadline is dropped with its blocks.
// Its API is plain C++ (router/source_messages.h); the gRPC service converts
// (router/wire.h). The parts: the source table (router/source_table.h), the
// fleets and their load order (router/fleet.h), the candidate walk
// (router/candidate_walk.h) and the cost (router/cost.h); Route (route.cc)
// orchestrates them.
// Thread-safe: Route takes a shared lock, everything else an exclusive one.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/limits.h"
#include "common/prompt_chain.h"
#include "common/rw_mutex.h"
#include "router/candidate_walk.h"
#include "router/cost.h"
#include "router/fleet.h"
#include "router/off_gpu.h"
#include "router/pending_routes.h"
#include "router/prefix_index.h"
#include "router/source_messages.h"
#include "router/source_table.h"

namespace kvtier::router {

using limits::kMaxEventHashes;
// A measured fetch cost is capped here (a store 1000x slower than computing
// is as good as absent).
inline constexpr double kMaxFetchCost = 1000;
// A route with a request id counts as on its way to its worker until the
// worker's heartbeat lists the id, or this long (a request never sent).
inline constexpr uint64_t kRouteArrivalMs = 1000;
// With --temperature > 0, Route samples among this many of the cheapest.
inline constexpr size_t kSampledCandidates = 16;

struct RouterOptions {
  CostKnobs knobs;
  uint64_t heartbeat_deadline_ms = 5000;
  // Match by walking every block (PrefixIndex::MatchLinear), the reference
  // the benchmark measures galloping against.
  bool linear_match = false;
  // Weigh every worker in a full pass instead of walking them in load order
  // (the reference the load-order walk is tested against).
  bool scan_all_workers = false;
  // Candidates a RouteResponse lists when the request does not say.
  uint32_t default_candidates = 8;
  // How long a route may take to reach its worker: a worker's heartbeat
  // does not count the tokens routed to it this recently (they may still be
  // on their way), so they stay in its load after the heartbeat. Without
  // it a burst routed between two heartbeats looks gone from the load the
  // moment the first heartbeat comes, and piles onto one worker.
  uint64_t inflight_ms = 20;
  // How long a routed prompt's blocks count as its worker's before its
  // events show them (router/pending_routes.h); 0: not at all.
  uint64_t pending_ms = 2000;

  // INVALID_ARGUMENT naming the flag of the first field out of range.
  absl::Status Validate() const;
};

// One worker considered for a request, with its cost terms.
struct RouteCandidate {
  std::string worker_id;
  uint32_t gpu_blocks = 0;
  uint32_t store_blocks = 0;
  uint64_t load_tokens = 0;
  uint64_t prefill_tokens = 0;
  double fetch_cost = 0;  // per fetched token, relative to computing it
  double cost = 0;
  double occupancy = 0;  // the share of its GPU pages in use (cost's occupancy term)
  // Blocks after its GPU's it would load from its own CPU tier, then from a
  // slower one (vLLM's offloading), each priced at that tier's fetch cost.
  uint32_t cpu_blocks = 0;
  uint32_t disk_blocks = 0;
};

// What the fetch cost per store token was made of (docs/router.md, "Fetch cost").
struct FetchBasis {
  double fetch_cost = 0;
  bool measured = false;  // false: RouterOptions::knobs.fetch_cost
  std::string store_id;   // the slowest store shard with figures
  double store_us_per_block = 0;
  uint32_t store_queue_depth = 0;
  double prefill_tokens_per_s = 0;  // the namespace's workers' mean
};

struct RouteResult {
  std::string worker_id;
  std::string endpoint;
  uint32_t gpu_blocks = 0;
  uint32_t cpu_blocks = 0, disk_blocks = 0;  // RouteCandidate's
  uint32_t store_blocks = 0;
  // The end of the deepest run of the prompt's blocks the stores hold, of
  // the runs matched (from the start and from the candidates' depths; 0:
  // none): a worker holding that many need not look the store up
  // (SubmitRequest.store_hint_blocks). Unset while the router does not know
  // what the stores hold (none registered, or a snapshot still to come).
  std::optional<uint32_t> store_end;
  uint64_t prefill_tokens = 0;
  uint32_t block_tokens = 0;
  Reason reason = Reason::kLowestCost;
  // The cheapest few, cheapest first; the chosen worker is always among
  // them, though not first when a tie-break, the balance guard or sampling
  // passed over a cheaper one.
  std::vector<RouteCandidate> candidates;
  FetchBasis fetch;

  // The candidates in the order a caller should try them: the chosen
  // worker (the one the route was counted on), then the rest cheapest
  // first.
  std::vector<const RouteCandidate*> ChosenFirst() const {
    std::vector<const RouteCandidate*> order;
    order.reserve(candidates.size());
    for (const RouteCandidate& c : candidates) {
      if (c.worker_id == worker_id)
        order.insert(order.begin(), &c);
      else
        order.push_back(&c);
    }
    return order;
  }
};

class RouterCore {
 public:
  using Clock = RouterClock;
  explicit RouterCore(RouterOptions options);

  // Registers or refreshes a source; may append a snapshot request.
  absl::Status Hello(const SourceHello& hello, std::vector<RouterCommand>* commands);
  // Applies one message of a source that already said Hello (a hello
  // registers or refreshes it).
  absl::Status Handle(const std::string& source_id, const SourceMessage& message,
                      std::vector<RouterCommand>* commands);
  // Stream bookkeeping (for ListWorkers). A draining worker whose last
  // stream closes is removed at once.
  void Connected(const std::string& source_id, bool up);

  absl::StatusOr<RouteResult> Route(const RouteQuery& query);

  // Drops sources silent past the deadline; returns how many.
  size_t ExpireSources(Clock::time_point now);
  // Drops one source now, with every block it indexed (an engine that left
  // the fleet); false when it was not registered.
  bool RemoveSource(const std::string& source_id);

  std::vector<SourceInfo> Sources() const;  // by source id
  RouterStats Stats() const;
  size_t IndexMemoryBytes() const;
  const RouterOptions& options() const { return options_; }

 private:
  // Recomputes slowest_store_ from the store shards' last heartbeats.
  void UpdateStoreFetch();
  // Whether the index knows what the stores hold: some store shard
  // registered, and none waiting for its snapshot. REQUIRES: mu_ held.
  bool StoresKnown() const {
    if (store_nums_.empty()) return false;
    for (SourceNum n : store_nums_) {
      if (sources_.ByNum(n)->resyncing) return false;
    }
    return true;
  }
  // A worker's reported prefill rate changes (0: none).
  void SetPrefillRate(Source& s, double tokens_per_s);
  void Heartbeat(Source& s, const SourceLoad& load);
  // Its occupancy (pages held over held + free) from what the index holds
  // of it and its last free-page count. REQUIRES: mu_ held.
  void UpdateOccupancy(Source& s);

  void RequestSnapshot(Source& s, const std::string& reason, std::vector<RouterCommand>* commands);
  void ClearSource(Source& s);
  void ApplyEvent(Source& s, const BlockEvent& e, std::vector<RouterCommand>* commands);
  void ApplySnapshotChunk(Source& s, const SnapshotChunk& c, std::vector<RouterCommand>* commands);
  void RemoveSourceLocked(const std::string& id);
  void JoinFleet(Source& s);
  void LeaveFleet(Source& s);
  // Route's last step: picks among the walk's candidates and, unless a dry
  // run, adds the request to the chosen worker's load.
  // Its prompt's blocks the chosen worker will compute or load become
  // pending on it.
  RouteResult Decide(const RouteQuery& q, const ChainView& chain, Fleet& fleet, const CostKnobs& k,
                     const OccupancyTerm& occupancy, const PrefixMatch& match,
                     const WalkResult& walk, uint64_t prompt_tokens, uint32_t bt,
                     uint64_t request_hash, size_t shown);

  RouterOptions options_;
  mutable WriterPreferringMutex mu_;  // routes never hold an event batch back for long
  std::mutex decide_mu_;              // a route's decision and its load increment, one at a time

  SourceTable sources_;
  absl::flat_hash_map<uint64_t, Fleet> fleets_;  // namespace -> its workers
  LoadBoard board_;
  std::vector<SourceNum> store_nums_;
  // Workers whose last heartbeat said draining: no route picks them.
  std::vector<SourceNum> draining_;
  // The store shard whose fetches take longest per block (by its last
  // heartbeat; us 0: no shard reported any).
  struct {
    std::string id;
    double us_per_block = 0;
    uint32_t queue_depth = 0;
  } slowest_store_;
  PrefixIndex index_;
  OffGpuBlocks off_gpu_;  // what workers hold off their GPU (the rest of index_'s is on it)
  PendingRoutes pending_;

  struct Counters {
    std::atomic<uint64_t> applied{0}, duplicate{0}, rejected{0}, snapshots_requested{0},
        snapshots_applied{0}, expired{0}, unknown_removals{0};
    std::atomic<uint64_t> lowest_cost{0}, tie_break{0}, balance_guard{0}, sampled{0},
        unavailable{0};
  };
  mutable Counters counters_;
};

}  // namespace kvtier::router
