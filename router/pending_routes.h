// Prompts routed to a worker that its block events do not show yet
// (docs/router.md, "Pending routes"). A request routed to worker W will
// have its prompt's blocks on W as soon as W runs it, and a request queued
// behind it on W with the same prefix computes only what follows (an
// engine matches its prefix cache again when it runs a request). Until W's
// events say so, the router keeps the blocks it expects W to compute or
// load here, for `ttl` (the longest a request is expected to wait; W's
// Removed event drops them; routes that rely on them do not extend them, so
// routes never run cannot keep them alive), and a
// route deepens each worker's match with them: the second request of a
// burst that shares a long prefix then costs its suffix on the first one's
// worker, not the whole prefix, and the load a route adds is what the
// worker will really compute. SGLang's router inserts a routed prompt into
// its worker's tree the same way. Thread-safe.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <shared_mutex>
#include <span>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "common/block_key.h"
#include "router/prefix_index.h"

namespace kvtier::router {

class PendingRoutes {
 public:
  using Clock = std::chrono::steady_clock;
  // At most this many (worker, block) pairs are kept: past it the oldest go.
  static constexpr size_t kMaxBlocks = size_t{1} << 20;
  // Up to this many workers named in a match are scanned; more are mapped.
  static constexpr size_t kNamedScan = 16;

  explicit PendingRoutes(std::chrono::milliseconds ttl) : ttl_(ttl) {}

  // Worker `num` will hold chain[from, chain.size()) once it runs a request
  // routed to it at `now`. Kept: every `stride`-th block (positions
  // stride - 1, 2 stride - 1, ...) and the last; a block's hash names its
  // whole prefix, so that is enough to know the prefix to within `stride`
  // blocks. Forgets what expired.
  void Add(uint64_t ns, SourceNum num, const ChainView& chain, uint32_t from, uint32_t stride,
           Clock::time_point now);
  // Deepens the workers' depths in `match` (a match of `chain` in `index`)
  // with the blocks pending on them at `now`: a worker holding d leading
  // blocks (named, or in one of the match's groups), with chain[d],
  // chain[d + 1], ... pending, is named at the end of that run. The store's
  // runs from a new depth are derived from the ones the match holds.
  // `stride` as given to Add.
  void Deepen(uint64_t ns, const ChainView& chain, uint32_t stride, const PrefixIndex& index,
              PrefixMatch* match, Clock::time_point now) const;
  // The first position at or past `from` Add keeps with `stride`.
  static size_t Sampled(size_t from, uint32_t stride) {
    return (from / stride) * stride + stride - 1;
  }
  // The stride for blocks of `block_tokens`: a block kept every 256 tokens.
  static uint32_t StrideFor(uint32_t block_tokens) {
    return std::max<uint32_t>(1, 256 / std::max<uint32_t>(block_tokens, 1));
  }
  // Worker `num` no longer holds `hashes` (its Removed event).
  void Drop(uint64_t ns, SourceNum num, std::span<const BlockHash> hashes);
  // A worker left (its number may be given to another) or cleared its
  // blocks: drops its pending ones.
  void Forget(SourceNum num);
  // (worker, block) pairs pending.
  size_t size() const { return entries_.load(std::memory_order_relaxed); }

 private:
  struct Entry {
    SourceNum num;
    Clock::time_point until;
    // The worker's depth when it was routed: the prefix it held then must
    // still be there for the pending blocks past it to follow it.
    uint32_t from;
  };
  using Holders = absl::InlinedVector<Entry, 2>;
  bool Holds(const BlockKey& key, SourceNum num, Clock::time_point now) const;
  // Drops the pairs of the keys queued for expiry up to `now` whose time passed.
  void ExpireLocked(Clock::time_point now);
  void EraseLocked(const BlockKey& key, SourceNum num);

  const std::chrono::milliseconds ttl_;
  mutable std::shared_mutex mu_;  // Deepen reads beside other routes
  absl::flat_hash_map<BlockKey, Holders, BlockKeyHasher> map_;
  std::deque<std::pair<Clock::time_point, BlockKey>> expiry_;  // oldest first
  std::atomic<size_t> entries_{0};                             // written under mu_
};

}  // namespace kvtier::router
