// The router's state: registered sources (workers and store shards), their
// event sequence numbers, load, and the prefix index; plus Route.
//
// Event handling follows docs/router.md: events apply in sequence order per
// (source, epoch); an already-applied number is ignored; a gap, a new epoch or
// an unknown source asks the source for a snapshot, and the source's events
// are ignored until the snapshot's last chunk replaces what the router knew.
// A source silent past the heartbeat deadline is dropped with its blocks.
// Thread-safe: Route takes a shared lock, everything else an exclusive one.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/limits.h"
#include "common/prompt_chain.h"
#include "common/rw_mutex.h"
#include "kvtier/v1/router.pb.h"
#include "router/cost.h"
#include "router/prefix_index.h"

namespace kvtier::router {

using limits::kMaxEventHashes;
// A measured fetch cost is capped here (a store 1000x slower than computing
// is as good as absent).
inline constexpr double kMaxFetchCost = 1000;
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
  uint32_t store_blocks = 0;
  uint64_t prefill_tokens = 0;
  uint32_t block_tokens = 0;
  Reason reason = Reason::kLowestCost;
  std::vector<RouteCandidate> candidates;  // the cheapest few, cheapest first
  FetchBasis fetch;
};

class RouterCore {
 public:
  using Clock = std::chrono::steady_clock;
  explicit RouterCore(RouterOptions options);

  // Registers or refreshes a source; may append a snapshot request.
  absl::Status Hello(const v1::Hello& hello, std::vector<v1::RouterCommand>* commands);
  // Applies one message of a source that already said Hello.
  absl::Status Handle(const std::string& source_id, const v1::SourceMessage& message,
                      std::vector<v1::RouterCommand>* commands);
  // Stream bookkeeping (for ListWorkers).
  void Connected(const std::string& source_id, bool up);

  absl::StatusOr<RouteResult> Route(const v1::RouteRequest& request);

  // Drops sources silent past the deadline; returns how many.
  size_t ExpireSources(Clock::time_point now);

  std::vector<v1::SourceInfo> Sources() const;
  v1::GetRouterStatsResponse Stats() const;
  size_t IndexMemoryBytes() const;
  const RouterOptions& options() const { return options_; }

 private:
  struct Source {
    SourceNum num;
    v1::Hello hello;
    uint64_t id_hash = 0;  // WorkerIdHash(source_id)
    uint64_t last_seq = 0;
    bool resyncing = false;
    uint64_t indexed = 0;            // blocks the index holds for it
    std::vector<uint64_t> snapshot;  // fingerprints of the chunks received so far
    v1::Heartbeat load;
    std::atomic<uint64_t> routed_since_heartbeat{0};
    // Workers: the routes of the last inflight_ms (when, tokens), oldest
    // first; Route appends under routes_mu (it holds the core's lock shared).
    std::mutex routes_mu;
    std::deque<std::pair<Clock::time_point, uint64_t>> recent_routes;
    Clock::time_point last_seen;
    int streams = 0;
    size_t slot = 0;                  // workers: place in their fleet's arrays
    double prefill_tokens_per_s = 0;  // workers: as last reported
  };
  // The workers of one namespace (their numbers, for the scan of those
  // holding nothing of a prompt).
  struct Fleet {
    std::vector<SourceNum> nums;
    // Sum and count of the prefill rates its workers report (> 0 only).
    double prefill_sum = 0;
    uint32_t prefill_count = 0;
    // The workers in load order as of the last rebuild (docs/router.md,
    // "Weighing the workers"). Between rebuilds a load only grows (routes
    // add to it) unless a heartbeat lowers it: those workers are in
    // `lowered` and looked at apart, so a worker's load is never below its
    // place in `order` suggests.
    std::vector<std::pair<uint64_t, SourceNum>> order;
    std::vector<SourceNum> lowered;
    // At least every worker's load (Route raises it through std::atomic_ref),
    // and the worker that last raised it: while that worker's load still
    // equals it, it is the highest load exactly.
    uint64_t max_load_bound = 0;
    uint32_t max_load_owner = 0;
  };
  // Sorts the fleet's workers by load afresh.
  void RebuildOrder(Fleet& f);
  // A worker's reported prefill rate changes (0: none).
  void SetPrefillRate(Source& s, double tokens_per_s);
  // Recomputes slowest_store_ from the store shards' last heartbeats.
  void UpdateStoreFetch();

  void RequestSnapshot(Source& s, const std::string& reason,
                       std::vector<v1::RouterCommand>* commands);
  void ClearSource(Source& s);
  void ApplyEvent(Source& s, const v1::KvEvent& e, std::vector<v1::RouterCommand>* commands);
  void ApplySnapshotChunk(Source& s, const v1::SnapshotChunk& c,
                          std::vector<v1::RouterCommand>* commands);
  void RemoveSourceLocked(const std::string& id);
  void JoinFleet(Source& s);
  void LeaveFleet(Source& s);

  RouterOptions options_;
  mutable WriterPreferringMutex mu_;  // routes never hold an event batch back for long
  std::mutex decide_mu_;              // a route's decision and its load increment, one at a time

  std::unordered_map<std::string, std::unique_ptr<Source>> sources_;
  std::vector<Source*> by_num_;  // SourceNum -> source (nullptr when free)
  std::vector<SourceNum> free_nums_;
  absl::flat_hash_map<uint64_t, Fleet> fleets_;  // namespace -> its workers
  // By SourceNum, dense so a route reads them without touching the sources:
  // load_ = queued prefill tokens at the last heartbeat + tokens routed
  // since (Route adds to it under the shared lock through std::atomic_ref);
  // id_hash_ = WorkerIdHash of the source id.
  std::vector<uint64_t> load_, id_hash_;
  std::vector<uint8_t> lowered_;  // by SourceNum: in its fleet's `lowered`
  std::vector<SourceNum> store_nums_;
  // The store shard whose fetches take longest per block (by its last
  // heartbeat; us 0: no shard reported any).
  struct {
    std::string id;
    double us_per_block = 0;
    uint32_t queue_depth = 0;
  } slowest_store_;
  PrefixIndex index_;

  struct Counters {
    std::atomic<uint64_t> applied{0}, duplicate{0}, rejected{0}, snapshots_requested{0},
        snapshots_applied{0}, expired{0}, unknown_removals{0};
    std::atomic<uint64_t> lowest_cost{0}, tie_break{0}, balance_guard{0}, sampled{0},
        unavailable{0};
  };
  mutable Counters counters_;
};

}  // namespace kvtier::router
