// What sources tell the router and what it tells them, as plain C++: the
// router core's vocabulary. The kvtier.v1 wire messages (router.proto) carry
// the same fields; router/wire.h converts at the gRPC edge, so the core and
// the in-process vLLM event subscriber never build a proto.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "common/block_key.h"
#include "router/prefix_index.h"

namespace kvtier::router {

enum class SourceKind : uint8_t { kUnspecified, kWorker, kStore };

inline const char* SourceKindName(SourceKind k) {
  return k == SourceKind::kStore ? "store" : "worker";
}

// A source's registration (router.proto Hello).
struct SourceHello {
  std::string source_id;  // 1..256 bytes
  SourceKind kind = SourceKind::kUnspecified;
  std::string endpoint;       // workers: where their requests go
  uint64_t namespace_id = 0;  // workers: the namespace served
  uint32_t block_tokens = 0;  // workers: tokens per block of that namespace
  uint64_t epoch = 0;         // a new epoch clears what the router knew
};

// One tier's fetch figures of a store shard (router.proto TierFetch).
struct TierFetch {
  std::string tier;  // "ram" or "disk"
  uint64_t blocks = 0;
  double bytes_per_s = 0;
  double us_per_block = 0;
  uint32_t queue_depth = 0;
};

// A heartbeat (router.proto Heartbeat).
struct SourceLoad {
  uint32_t running_requests = 0;
  uint64_t queued_prefill_tokens = 0;
  uint64_t free_gpu_pages = 0;
  double prefill_tokens_per_s = 0;  // workers (0: unknown)
  std::vector<TierFetch> fetch;     // store shards
  // Workers: requests that reached it recently, counted in the queue above.
  std::vector<uint64_t> arrived_request_ids;
  bool draining = false;  // workers: leaving; routes skip it
};

// The fastest medium of a worker's own that holds a block: its GPU, or an
// offloading tier of the engine's (vLLM's CPU offloading, or a slower one:
// disk, storage), from which it loads the block without recomputing it.
enum class Medium : uint8_t { kGpu, kCpu, kDisk };

// A block event (router.proto KvEvent): blocks stored or removed in one
// namespace, or every block of the source cleared. kMedium (workers, from
// the in-process vLLM subscriber) says which medium now holds blocks the
// source holds already, at best: a stored block is on the GPU until one
// says otherwise, and a snapshot puts every block back there.
struct BlockEvent {
  enum class Kind : uint8_t { kNone, kStored, kRemoved, kCleared, kMedium };
  uint64_t seq = 0;
  Kind kind = Kind::kNone;  // kNone: an empty event, rejected
  uint64_t namespace_id = 0;
  std::vector<BlockHash> hashes;
  Medium medium = Medium::kGpu;  // kMedium
};

// One chunk of a snapshot (router.proto SnapshotChunk).
struct SnapshotChunk {
  uint64_t seq = 0;
  uint64_t namespace_id = 0;
  std::vector<BlockHash> hashes;
  bool last = false;
};

// One message of a source; std::monostate is a message that carries nothing.
using SourceMessage =
    std::variant<std::monostate, SourceHello, BlockEvent, SourceLoad, SnapshotChunk>;

// What the router asks of a source (router.proto RouterCommand).
struct RouterCommand {
  enum class Kind : uint8_t { kSnapshotRequest, kEventRejected };
  Kind kind = Kind::kSnapshotRequest;
  uint64_t seq = 0;    // kEventRejected: the event's number
  std::string reason;  // why
};

// A request to route (router.proto RouteRequest). The prompt is token ids
// (hashed with the namespace's block_tokens) or the caller's own chain of
// block hashes, read in place.
struct RouteQuery {
  enum class Prompt : uint8_t { kNone, kTokens, kHashes };
  uint64_t namespace_id = 0;
  Prompt prompt = Prompt::kNone;
  std::span<const uint32_t> tokens;  // kTokens
  // kTokens: the request's LoRA adapter and cache salt as ChainVariant (0:
  // neither); its chain is rooted there (common/block_key.h).
  uint64_t variant = 0;
  ChainView hashes;             // kHashes
  uint64_t prompt_tokens = 0;   // kHashes: 0 means hashes x block_tokens
  uint32_t max_candidates = 0;  // 0: RouterOptions::default_candidates
  bool dry_run = false;         // explain only: no load added, no counters
  // The id the worker will know the request by (SourceLoad::arrived_request_ids); 0: none.
  uint64_t request_id = 0;
  // Workers not to choose (a caller's engines that are down, or already
  // tried for this request): the route, its load and its pending blocks go
  // to the best of the others. Unknown ids are ignored.
  std::span<const std::string> exclude;
};

// What the router knows of one source (router.proto SourceInfo).
struct SourceInfo {
  std::string source_id;
  SourceKind kind = SourceKind::kUnspecified;
  std::string endpoint;
  uint64_t namespace_id = 0;
  uint64_t indexed_blocks = 0;
  SourceLoad load;  // its last heartbeat
  uint64_t routed_tokens_since_heartbeat = 0;
  uint64_t last_seen_ms = 0;
  uint64_t epoch = 0;
  uint64_t last_seq = 0;
  bool resyncing = false;
  bool connected = false;
  // Workers: blocks no other source holds, and their prefill seconds at
  // its reported rate (0 without one).
  uint64_t sole_blocks = 0;
  double sole_recompute_seconds = 0;
};

// The core's counters (router.proto GetRouterStatsResponse, less what the
// service adds).
struct RouterStats {
  uint64_t indexed_blocks = 0, indexed_replicas = 0, sources = 0;
  uint64_t events_applied = 0, events_duplicate = 0, events_rejected = 0;
  uint64_t snapshots_requested = 0, snapshots_applied = 0, sources_expired = 0;
  uint64_t unknown_removals = 0;
  // Route decisions by reason.
  uint64_t lowest_cost = 0, tie_break = 0, balance_guard = 0, sampled = 0, unavailable = 0;
};

}  // namespace kvtier::router
