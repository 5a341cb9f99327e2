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
#include <bit>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <vector>

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
  // The longest `ttl` (a generation's times are 32-bit microseconds).
  static constexpr std::chrono::milliseconds kMaxTtl{600000};

  // `ttl` at most kMaxTtl.
  explicit PendingRoutes(std::chrono::milliseconds ttl);

  // Worker `num` will hold chain[from, chain.size()) once it runs a request
  // routed to it at `now`. Kept: the positions Sampled names at or past
  // `from`, and the last. Forgets what expired.
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
  // The first position at or past `from` that Add keeps with `stride`.
  // Kept: every stride-th block (positions stride - 1, 2 stride - 1, ...)
  // over the first 16 strides, then 8 evenly spaced in each doubling of the
  // depth (with 16-token blocks: a block every 256 tokens up to 4,096, then
  // every 512 up to 8,192, ...). A block's hash names its whole prefix, so
  // a pending prefix is known to within a stride or an eighth of its
  // length, whichever is more, and a route keeps a number of blocks that
  // grows with the log of its prompt's length, not with its length.
  static size_t Sampled(size_t from, uint32_t stride) {
    const size_t n = from + 1;  // blocks up to and with `from`
    const size_t step =
        size_t{stride} * std::max<size_t>(1, std::bit_floor(n / (8 * size_t{stride})));
    return (n + step - 1) / step * step - 1;
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
  // (worker, block) pairs kept: an expired one until its generation goes.
  size_t size() const { return entries_.load(std::memory_order_relaxed); }
  // Bytes of the generations' tables.
  size_t MemoryBytes() const;

 private:
  // One (worker, block) pair, 24 bytes.
  struct Slot {
    uint64_t fp = 0;  // PrefixIndex::Fingerprint of the block; 0: empty
    SourceNum num = 0;
    // The worker's depth when it was routed: the prefix it held then must
    // still be there for the pending blocks past it to follow it.
    uint32_t from = 0;
    uint32_t until_us = 0;  // microseconds past its generation's start
    // Blocks from this one to the last of a prompt routed with it, when that
    // lies before the next kept block (0: none; the largest of its routes').
    uint32_t tail : 31 = 0;
    uint32_t dropped : 1 = 0;  // a tombstone (probe runs go on past it)
  };
  static_assert(sizeof(Slot) == 24);
  static constexpr uint32_t kMaxTail = (uint32_t{1} << 31) - 1;
  // The pairs added over one stretch of at most `ttl`: an open-addressed
  // table (linear probing, at most half full) whose pairs all expire by the
  // time the next stretch ends, so it is dropped whole then, not pair by
  // pair. The pairs of one block lie in one probe run.
  class Generation {
   public:
    Clock::time_point start;
    size_t live = 0;  // pairs not dropped (expired ones included)
    size_t bytes() const { return slots_.size() * sizeof(Slot); }

    // Empties it for pairs added from `at` on.
    void Reset(Clock::time_point at);
    // Room for `more` pairs without growing.
    void Reserve(size_t more);
    // Prefetches fp's first slot (for a Put if `for_write`, else a read).
    void Prefetch(uint64_t fp, bool for_write) const;
    // Sets (fp, num) to expire at `until` (its `from` the smaller of the
    // two, its `tail` the larger), adding it if absent; true if added.
    // Reserve first.
    bool Put(uint64_t fp, SourceNum num, uint32_t from, uint32_t tail, Clock::time_point until);
    // The pair (fp, num), not dropped (expired or not); null if absent.
    const Slot* Find(uint64_t fp, SourceNum num) const;
    // The pair (fp, num) if kept unexpired at `now`; null if not.
    const Slot* Live(uint64_t fp, SourceNum num, Clock::time_point now) const;
    // Calls f(num, from, tail) for each pair of `fp` unexpired at `now`.
    template <class F>
    void ForEach(uint64_t fp, Clock::time_point now, F&& f) const;
    // Drops (fp, num) / every pair of `num`; the pairs dropped.
    size_t Erase(uint64_t fp, SourceNum num);
    size_t EraseAll(SourceNum num);

   private:
    size_t Home(uint64_t fp) const { return (fp * 0x9E3779B97F4A7C15ull) >> shift_; }
    int64_t Us(Clock::time_point t) const {
      return std::chrono::duration_cast<std::chrono::microseconds>(t - start).count();
    }
    std::vector<Slot> slots_;  // a power of two; empty until the first Reserve
    size_t used_ = 0;          // slots taken, tombstones included
    int shift_ = 64;
  };
  static uint64_t Fp(uint64_t ns, const BlockHash& h) {
    const uint64_t fp = PrefixIndex::Fingerprint(BlockKey{ns, h});
    return fp == 0 ? 1 : fp;
  }
  // The tail of (fp, num) kept unexpired at `now` (the larger of the two
  // generations'); -1 if not kept.
  int64_t HeldTail(uint64_t fp, SourceNum num, Clock::time_point now) const {
    const Slot* a = gens_[0].Live(fp, num, now);
    const Slot* b = gens_[1].Live(fp, num, now);
    if (a == nullptr && b == nullptr) return -1;
    return std::max<int64_t>(a != nullptr ? a->tail : 0, b != nullptr ? b->tail : 0);
  }

  const std::chrono::milliseconds ttl_;
  mutable std::shared_mutex mu_;  // Deepen reads beside other routes
  Generation gens_[2];            // gens_[cur_] takes new pairs; the other is older
  int cur_ = 0;
  std::atomic<size_t> entries_{0};  // written under mu_
};

}  // namespace kvtier::router
