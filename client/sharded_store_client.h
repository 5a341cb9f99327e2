// A data-plane client of several store shards: each block lives on the shard
// that rendezvous hashing (common/rendezvous.h) picks among the shard
// addresses, so adding or removing a shard moves only the blocks it wins or
// held. One StoreDataClient per shard; an operation runs on its shards at
// once and waits for all of them.
//
// Thread-safe (StoreDataClient is). Statuses: RegisterMemory,
// RegisterNamespace and Lookup return the first failing shard's status
// (RegisterNamespace: INVALID_ARGUMENT with no shards); Put returns the first
// failing shard's status once every shard has answered; Get returns the
// leading blocks every shard delivered, and a failing shard's status only
// when that leaves none. Shard statuses are StoreDataClient's.
//
// Pin/Read split a load as StoreDataClient's do: Pin asks every shard that
// holds part of the chain at once (one round trip in parallel) and keeps
// each shard's pin; Read moves the first `count` blocks from their shards at
// once and calls the plan's on_segment for segment s once every shard has
// landed it, in segment order.
//
// Unreachable shards are skipped rather than waited for: after a call to a
// shard fails UNAVAILABLE or DEADLINE_EXCEEDED (a dead link costs the whole
// deadline), calls to it return UNAVAILABLE at once for shard_skip_min_ms,
// doubling up to shard_skip_max_ms while it keeps failing; when the skip
// ends, one caller's call probes it (the others keep skipping until it
// answers). Pin treats a skipped or failing shard as holding none of the
// chain: the prefix ends at its first block, and Pin fails only when that
// leaves nothing pinned.
//
// A Pin that misses its own `budget` (shorter than the deadline: a request
// that would rather compute than wait) says the shard is slow, not that it
// is unreachable: it skips the shard for budgeted Pins only, by the same
// rules, and a budgeted Pin that answers ends that skip. Every other call
// (a save's Put, an unbudgeted Pin) still goes to a slow shard: one slow
// lookup on a busy host once dropped the saves behind it.
//
// Included by client/store_data_client.h, whose users reach these through
// it; so this header needs only the shared types, not StoreDataClient's.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/data_client_types.h"
#include "client/shard_skip.h"
#include "client/store_client.h"
#include "common/block_key.h"

namespace kvtier {

class StoreDataClient;

// Rendezvous (highest-random-weight) placement of a block on one of several
// shards: adding or removing a shard moves only the keys it wins or held.
// REQUIRES: !shards.empty().
size_t RendezvousShard(const BlockKey& key, const std::vector<std::string>& shards);

// One chain pinned across shards (ShardedStoreClient::Pin).
struct ShardedPin {
  uint32_t blocks = 0;                     // leading blocks of the chain pinned
  uint32_t from_disk = 0;                  // of those, promoted from NVMe for the pin
  std::vector<std::vector<size_t>> parts;  // per shard: its chain indices, in order
  std::vector<PinnedBlocks> pins;          // per shard (empty pin: nothing there)
  double control_ms = 0;                   // the slowest shard's round trip
};

class ShardedStoreClient {
 public:
  ShardedStoreClient(std::vector<std::string> addresses, DataClientOptions options = {});
  // Out of line: StoreDataClient is incomplete here.
  ~ShardedStoreClient();
  ShardedStoreClient(ShardedStoreClient&&) noexcept;
  ShardedStoreClient& operator=(ShardedStoreClient&&) noexcept;

  absl::Status RegisterMemory(void* addr, size_t length);
  // Registers the namespace on every shard.
  absl::StatusOr<RegisteredNamespace> RegisterNamespace(const NamespaceSpec& spec);
  // Leading blocks of the chain present on their shards.
  absl::StatusOr<uint32_t> Lookup(uint64_t ns, const std::vector<BlockHash>& chain);
  // Many chains at once (an engine scheduler's step): one round trip per
  // shard, the shards in parallel, each chain's leading blocks present on
  // their shards. A shard that fails or is skipped holds none of any chain
  // (each prefix ends before its first block there); the first failing
  // shard's status only when every shard asked failed. `budget` (shorter
  // than the deadline): each shard's deadline, a missed one noted as a
  // missed budget (Pin's rule); without one, the client's deadline. Empty
  // chains answer 0.
  absl::StatusOr<std::vector<uint32_t>> LookupMany(
      uint64_t ns, const std::vector<std::vector<BlockHash>>& chains,
      std::optional<std::chrono::milliseconds> budget = std::nullopt);
  // Each block's shard checks its copy and drops it if corrupt (a read here
  // failed its checksum); the blocks dropped in all.
  absl::StatusOr<uint32_t> VerifyBlocks(uint64_t ns, const std::vector<BlockHash>& blocks);
  absl::StatusOr<PutOutcome> Put(uint64_t ns, uint64_t block_bytes,
                                 const std::vector<PutBlock>& blocks);
  // Fetches the chain's leading present blocks; returns how many.
  absl::StatusOr<GetOutcome> Get(uint64_t ns, uint64_t block_bytes,
                                 const std::vector<GetBlock>& blocks);

  // Looks up the chain and pins its leading present blocks on every shard
  // at once. A failing shard holds nothing (the prefix ends before its
  // first block); its status only when no block is pinned (then the
  // others' pins are released).
  // `budget`: as StoreDataClient::Pin's.
  absl::StatusOr<ShardedPin> Pin(uint64_t ns, uint64_t block_bytes,
                                 const std::vector<BlockHash>& chain,
                                 std::optional<std::chrono::milliseconds> budget = std::nullopt);
  // Moves chain blocks [first, first + count) (within pin.blocks;
  // plan.dest(i, s) names chain block i) from their shards at once. Blocks
  // until all shards are done; the first failing shard's status, or
  // INVALID_ARGUMENT for a range past the pinned prefix (nothing moved).
  // The pins stay: Release them once done.
  absl::StatusOr<GetOutcome> Read(const ShardedPin& pin, uint64_t block_bytes, uint32_t first,
                                  uint32_t count, const ReadPlan& plan);
  // Chain blocks [first, first + count) in place, each in its shard's arena
  // mapped here (StoreDataClient::View): FAILED_PRECONDITION when any shard
  // holding one is not mapped here (Read them instead), INVALID_ARGUMENT for
  // a range past the pinned prefix, else the first failing shard's status.
  absl::StatusOr<BlockViews> View(const ShardedPin& pin, uint64_t block_bytes, uint32_t first,
                                  uint32_t count);
  // StoreDataClient::Reserve of each block on its shard, the shards one
  // after another (each a round trip of its own; `budget` each). Any
  // shard's failure gives the other shards' slots back and returns it
  // (FAILED_PRECONDITION: a shard not mapped here; put instead). A shard
  // missing the budget counts as no failure of the shard's.
  absl::StatusOr<Reservation> Reserve(
      uint64_t ns, uint64_t block_bytes, const std::vector<BlockHash>& hashes,
      std::optional<std::chrono::milliseconds> budget = std::nullopt);
  // Commits every lease of `r`, its slots filled; `checksums` per block
  // asked for (those of unreserved blocks are ignored), or empty: each
  // store hashes its slots itself (StoreDataClient::CommitReserved). The
  // blocks committed, or the first failing shard's status once all have
  // answered.
  absl::StatusOr<uint32_t> Commit(const Reservation& r, const std::vector<uint64_t>& checksums);
  // Gives every lease of `r` back (best effort).
  void Abort(const Reservation& r);
  // Connects every shard's data plane (StoreDataClient::Warm), waiting up
  // to `wait` for them (the connects go on in the background after it).
  void Warm(std::chrono::milliseconds wait);
  // Ends every shard's pin (asynchronously; never blocks). Idempotent.
  void Release(ShardedPin& pin);

  size_t shards() const { return shards_.size(); }
  StoreDataClient& shard(size_t i) { return *shards_[i]; }

 private:
  // OK when shard s may be called now (or this call is its probe);
  // UNAVAILABLE while it is skipped. `budgeted` (a Pin within a budget):
  // also while it is skipped for missing a budget.
  absl::Status Admit(size_t s, bool budgeted = false);
  // Records a call's outcome: a failure that says the shard is unreachable
  // starts or lengthens its skip; anything else ends it. `budgeted`:
  // DEADLINE_EXCEEDED (the budget ran out) starts or lengthens the budget
  // skip alone, and success ends that one too.
  void Note(size_t s, const absl::Status& status, bool budgeted = false);

  std::vector<std::string> addresses_;
  std::vector<std::unique_ptr<StoreDataClient>> shards_;
  DataClientOptions options_;
  std::vector<std::unique_ptr<ShardSkip>> health_;  // per shard (client/shard_skip.h)
  std::vector<std::unique_ptr<ShardSkip>> slow_;    // per shard: missed budgets
};

}  // namespace kvtier
