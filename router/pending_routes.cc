#include "router/pending_routes.h"

#include <algorithm>
#include <bit>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"

namespace kvtier::router {

namespace {
// Sets the value of `key` in a list of (key, value) pairs, adding it if absent.
template <class K, class V>
void Set(std::vector<std::pair<K, V>>& list, K key, V value) {
  for (auto& [k, v] : list) {
    if (k == key) {
      v = value;
      return;
    }
  }
  list.emplace_back(key, value);
}

// Where a worker is in a list of (worker, depth) pairs (list.size() when
// absent): a pass over a short list, a map over a long one (a fleet's
// popular prefix), which takes in entries appended since the last call.
template <class List>
class PlaceOf {
 public:
  explicit PlaceOf(const List& list) : list_(list) {}
  size_t operator()(SourceNum num) {
    if (list_.size() <= PendingRoutes::kNamedScan) {
      for (size_t i = 0; i < list_.size(); ++i) {
        if (list_[i].first == num) return i;
      }
      return list_.size();
    }
    for (; mapped_ < list_.size(); ++mapped_) map_.emplace(list_[mapped_].first, mapped_);
    auto it = map_.find(num);
    return it == map_.end() ? list_.size() : it->second;
  }

 private:
  const List& list_;
  absl::flat_hash_map<SourceNum, size_t> map_;
  size_t mapped_ = 0;
};
}  // namespace

PendingRoutes::PendingRoutes(std::chrono::milliseconds ttl) : ttl_(std::min(ttl, kMaxTtl)) {
  const auto now = Clock::now();
  gens_[0].Reset(now);
  gens_[1].Reset(now);
}

namespace {
constexpr size_t kMinSlots = 1024;
}  // namespace

void PendingRoutes::Generation::Reset(Clock::time_point at) {
  start = at;
  // A table much larger than the last stretch's pairs need is given back.
  if (slots_.size() > 4 * std::max(kMinSlots, 4 * live)) {
    std::vector<Slot>().swap(slots_);
    shift_ = 64;
  } else {
    std::fill(slots_.begin(), slots_.end(), Slot{});
  }
  used_ = 0;
  live = 0;
}

void PendingRoutes::Generation::Reserve(size_t more) {
  if (2 * (used_ + more) <= slots_.size()) return;
  // Rehashed at a quarter full with the live pairs: the dropped ones'
  // tombstones stay behind, so drops do not grow the table, and as many
  // pairs again fit before the next rehash.
  size_t cap = kMinSlots;
  while (cap < 4 * (live + more)) cap *= 2;
  std::vector<Slot> old(cap);
  old.swap(slots_);
  shift_ = 64 - std::countr_zero(cap);
  used_ = 0;
  for (const Slot& s : old) {
    if (s.fp == 0 || s.dropped != 0) continue;
    size_t i = Home(s.fp);
    while (slots_[i].fp != 0) i = (i + 1) & (cap - 1);
    slots_[i] = s;
    ++used_;
  }
}

void PendingRoutes::Generation::Prefetch(uint64_t fp, bool for_write) const {
  if (slots_.empty()) return;
  if (for_write) {
    __builtin_prefetch(&slots_[Home(fp)], 1);
  } else {
    __builtin_prefetch(&slots_[Home(fp)], 0);
  }
}

bool PendingRoutes::Generation::Put(uint64_t fp, SourceNum num, uint32_t from, uint32_t tail,
                                    Clock::time_point until) {
  const size_t mask = slots_.size() - 1;
  const auto us = static_cast<uint32_t>(std::max<int64_t>(Us(until), 0));
  size_t free = slots_.size();
  size_t i = Home(fp);
  for (; slots_[i].fp != 0; i = (i + 1) & mask) {
    Slot& s = slots_[i];
    if (s.dropped != 0) {
      if (free == slots_.size()) free = i;
    } else if (s.fp == fp && s.num == num) {
      s.until_us = us;
      s.from = std::min(s.from, from);
      s.tail = std::max<uint32_t>(s.tail, tail);
      return false;
    }
  }
  if (free == slots_.size()) {
    free = i;
    ++used_;
  }
  slots_[free] = Slot{fp, num, from, us, tail, 0};
  ++live;
  return true;
}

const PendingRoutes::Slot* PendingRoutes::Generation::Find(uint64_t fp, SourceNum num) const {
  if (live == 0) return nullptr;
  const size_t mask = slots_.size() - 1;
  for (size_t i = Home(fp); slots_[i].fp != 0; i = (i + 1) & mask) {
    const Slot& s = slots_[i];
    if (s.fp == fp && s.num == num && s.dropped == 0) return &s;
  }
  return nullptr;
}

const PendingRoutes::Slot* PendingRoutes::Generation::Live(uint64_t fp, SourceNum num,
                                                           Clock::time_point now) const {
  const Slot* s = Find(fp, num);
  return s != nullptr && s->until_us > Us(now) ? s : nullptr;
}

template <class F>
void PendingRoutes::Generation::ForEach(uint64_t fp, Clock::time_point now, F&& f) const {
  if (live == 0) return;
  const size_t mask = slots_.size() - 1;
  const int64_t at = Us(now);
  for (size_t i = Home(fp); slots_[i].fp != 0; i = (i + 1) & mask) {
    const Slot& s = slots_[i];
    if (s.fp == fp && s.dropped == 0 && s.until_us > at) f(s.num, s.from, s.tail);
  }
}

size_t PendingRoutes::Generation::Erase(uint64_t fp, SourceNum num) {
  const Slot* s = Find(fp, num);
  if (s == nullptr) return 0;
  slots_[static_cast<size_t>(s - slots_.data())].dropped = 1;
  --live;
  return 1;
}

size_t PendingRoutes::Generation::EraseAll(SourceNum num) {
  size_t n = 0;
  for (Slot& s : slots_) {
    if (s.fp != 0 && s.dropped == 0 && s.num == num) {
      s.dropped = 1;
      ++n;
    }
  }
  live -= n;
  return n;
}

void PendingRoutes::Add(uint64_t ns, SourceNum num, const ChainView& chain, uint32_t from,
                        uint32_t stride, Clock::time_point now) {
  if (from >= chain.size()) return;
  stride = std::max<uint32_t>(stride, 1);
  // The keys first, each one's slot prefetched: a route adds tens of keys
  // to a table of hundreds of thousands, and their cache misses then
  // overlap instead of following one another.
  // The last kept block before the prompt's end (if it ends between two)
  // records how far the end is: a prompt that goes on past this one finds
  // its end there.
  const size_t end = chain.size() - 1;
  absl::InlinedVector<std::pair<uint64_t, uint32_t>, 64> fps;  // (fingerprint, tail)
  for (size_t i = Sampled(from, stride); i < chain.size();) {
    const size_t next = Sampled(i + 1, stride);
    const size_t tail = next > end && i < end ? end - i : 0;
    fps.emplace_back(Fp(ns, chain[i]), static_cast<uint32_t>(std::min<size_t>(tail, kMaxTail)));
    i = next;
  }
  if (Sampled(end, stride) != end) fps.emplace_back(Fp(ns, chain[end]), 0);
  std::unique_lock lk(mu_);
  // A stretch of `ttl` over (or half the bound taken): the older
  // generation's pairs have all expired (or are the oldest), and it starts
  // over as the newest.
  Generation* cur = &gens_[cur_];
  if (now - cur->start >= ttl_ || cur->live + fps.size() > kMaxBlocks / 2) {
    cur_ ^= 1;
    cur = &gens_[cur_];
    entries_ -= cur->live;
    cur->Reset(now);
  }
  cur->Reserve(fps.size());
  for (const auto& [fp, tail] : fps) cur->Prefetch(fp, /*for_write=*/true);
  const Clock::time_point until = now + ttl_;
  size_t added = 0;
  for (const auto& [fp, tail] : fps) added += cur->Put(fp, num, from, tail, until) ? 1 : 0;
  entries_ += added;
}

void PendingRoutes::Deepen(uint64_t ns, const ChainView& chain, uint32_t stride,
                           const PrefixIndex& index, PrefixMatch* match,
                           Clock::time_point now) const {
  if (entries_.load(std::memory_order_relaxed) == 0 || chain.empty()) return;
  stride = std::max<uint32_t>(stride, 1);
  std::shared_lock lk(mu_);
  PlaceOf named_at(match->gpu_depth);
  auto depth_of = [&](SourceNum num) -> uint32_t {
    if (const size_t i = named_at(num); i < match->gpu_depth.size()) {
      return match->gpu_depth[i].second;
    }
    for (const auto& g : match->groups) {
      if (index.InGroup(g, num)) return g.depth;
    }
    return 0;
  };
  const uint32_t n = static_cast<uint32_t>(chain.size());
  auto held_tail = [&](uint32_t q, SourceNum num) { return HeldTail(Fp(ns, chain[q]), num, now); };
  auto next = [&](uint32_t q) { return static_cast<uint32_t>(Sampled(q, stride)); };
  // A worker's pending run continues its match: from the first block a
  // route keeps (Sampled, or the prompt's last) at or past position 0 and
  // each worker's and group's depth. A block pending on a worker means its
  // whole prefix will be there (a block's hash names its prefix). A shared
  // run shorter than the step between kept blocks past a worker's depth
  // goes unseen. Each start's first kept block is read once (depths within
  // one gap share it), its slots prefetched in both generations as it is
  // found: the misses of a match with many depths overlap.
  absl::InlinedVector<std::pair<uint32_t, uint64_t>, 8> firsts;  // (position, fingerprint)
  auto start_at = [&](uint32_t d) {
    if (d >= n) return;
    const uint32_t at = std::min<uint32_t>(next(d), n - 1);
    if (std::any_of(firsts.begin(), firsts.end(), [&](const auto& f) { return f.first == at; })) {
      return;
    }
    firsts.emplace_back(at, Fp(ns, chain[at]));
    gens_[0].Prefetch(firsts.back().second, /*for_write=*/false);
    gens_[1].Prefetch(firsts.back().second, /*for_write=*/false);
  };
  start_at(0);
  for (const auto& [s, d] : match->gpu_depth) start_at(d);
  for (const auto& g : match->groups) start_at(g.depth);
  absl::InlinedVector<std::pair<SourceNum, uint32_t>, 4> deeper;
  PlaceOf deeper_at(deeper);
  for (const auto& first : firsts) {
    const uint32_t at = first.first;  // (a plain name: the lambda captures it)
    auto visit = [&](SourceNum num, uint32_t routed_from, int64_t tail) {
      // A worker that lost part of the prefix it held when routed (evicted
      // it since) will not have the pending blocks past it either.
      if (routed_from > depth_of(num)) return;
      // Kept block by kept block; then the end of a routed prompt that
      // ended before the next kept block, which the last one names; past
      // the last kept block of this prompt, its own end (a route of the
      // same prompt from a depth past its last kept block kept only that).
      uint32_t last = at;
      uint32_t q = next(at + 1);
      for (; q < n; q = next(q + 1)) {
        const int64_t t = held_tail(q, num);
        if (t < 0) break;
        last = q;
        tail = t;
      }
      if (tail > 0 && last + tail < n && held_tail(last + static_cast<uint32_t>(tail), num) >= 0) {
        last += static_cast<uint32_t>(tail);
      }
      if (q >= n && last + 1 < n && held_tail(n - 1, num) >= 0) last = n - 1;
      const uint32_t d = last + 1;
      if (d <= depth_of(num)) return;
      if (const size_t k = deeper_at(num); k < deeper.size()) {
        deeper[k].second = std::max(deeper[k].second, d);
      } else {
        deeper.emplace_back(num, d);
      }
    };
    gens_[0].ForEach(first.second, now, visit);
    gens_[1].ForEach(first.second, now, visit);
  }
  // (Each worker once: a named one's depth is read before it is set.)
  for (const auto& [num, d] : deeper) {
    const size_t at_named = named_at(num);
    const uint32_t was = depth_of(num);
    // The store's run from d: what a run from the worker's old depth (or
    // from 0) covers past d.
    uint32_t run = 0;
    for (const auto& [at, r] : match->store_runs) {
      if ((at == was || at == 0) && at + r > d) run = std::max(run, at + r - d);
    }
    if (at_named < match->gpu_depth.size()) {
      match->gpu_depth[at_named].second = d;
    } else {
      match->gpu_depth.emplace_back(num, d);
    }
    if (match->StoreRun(d) < run) Set(match->store_runs, d, run);
  }
}

size_t PendingRoutes::MemoryBytes() const {
  std::shared_lock lk(mu_);
  return gens_[0].bytes() + gens_[1].bytes();
}

void PendingRoutes::Drop(uint64_t ns, SourceNum num, std::span<const BlockHash> hashes) {
  if (entries_.load(std::memory_order_relaxed) == 0) return;
  std::unique_lock lk(mu_);
  size_t dropped = 0;
  for (const BlockHash& h : hashes) {
    const uint64_t fp = Fp(ns, h);
    dropped += gens_[0].Erase(fp, num) + gens_[1].Erase(fp, num);
  }
  entries_ -= dropped;
}

void PendingRoutes::Forget(SourceNum num) {
  if (entries_.load(std::memory_order_relaxed) == 0) return;
  std::unique_lock lk(mu_);
  entries_ -= gens_[0].EraseAll(num) + gens_[1].EraseAll(num);
}

}  // namespace kvtier::router
