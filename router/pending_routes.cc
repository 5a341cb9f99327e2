#include "router/pending_routes.h"

#include <algorithm>

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

void PendingRoutes::ExpireLocked(Clock::time_point now) {
  while (!expiry_.empty() && expiry_.front().first <= now) {
    auto it = map_.find(expiry_.front().second);
    expiry_.pop_front();
    if (it == map_.end()) continue;
    Holders& h = it->second;
    const size_t before = h.size();
    h.erase(std::remove_if(h.begin(), h.end(), [&](const Entry& e) { return e.until <= now; }),
            h.end());
    entries_ -= before - h.size();
    if (h.empty()) map_.erase(it);
  }
}

void PendingRoutes::EraseLocked(const BlockKey& key, SourceNum num) {
  auto it = map_.find(key);
  if (it == map_.end()) return;
  Holders& h = it->second;
  const size_t before = h.size();
  h.erase(std::remove_if(h.begin(), h.end(), [&](const Entry& e) { return e.num == num; }),
          h.end());
  entries_ -= before - h.size();
  if (h.empty()) map_.erase(it);
}

void PendingRoutes::Add(uint64_t ns, SourceNum num, const ChainView& chain, uint32_t from,
                        uint32_t stride, Clock::time_point now) {
  if (from >= chain.size()) return;
  stride = std::max<uint32_t>(stride, 1);
  std::unique_lock lk(mu_);
  ExpireLocked(now);
  const size_t adding = (chain.size() - from) / stride + 1;
  // Over the bound the oldest go first, as if their time had come.
  while (entries_ + adding > kMaxBlocks && !expiry_.empty()) ExpireLocked(expiry_.front().first);
  const Clock::time_point until = now + ttl_;
  // The keys first, each one's table group prefetched: a route adds tens of
  // keys to a table of hundreds of thousands, and their cache misses then
  // overlap instead of following one another.
  absl::InlinedVector<BlockKey, 64> keys;
  keys.reserve(adding);
  for (size_t i = Sampled(from, stride); i < chain.size(); i += stride) {
    keys.push_back(BlockKey{ns, chain[i]});
  }
  if ((chain.size() % stride) != 0) keys.push_back(BlockKey{ns, chain[chain.size() - 1]});
  for (const BlockKey& key : keys) map_.prefetch(key);
  for (const BlockKey& key : keys) {
    Holders& h = map_[key];
    auto it = std::find_if(h.begin(), h.end(), [&](const Entry& e) { return e.num == num; });
    if (it != h.end()) {
      it->until = until;
      it->from = std::min(it->from, from);
    } else {
      h.push_back({num, until, from});
      ++entries_;
    }
    expiry_.emplace_back(until, key);
  }
}

bool PendingRoutes::Holds(const BlockKey& key, SourceNum num, Clock::time_point now) const {
  auto it = map_.find(key);
  if (it == map_.end()) return false;
  return std::any_of(it->second.begin(), it->second.end(),
                     [&](const Entry& e) { return e.num == num && e.until > now; });
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
  // The last pending block of `num` among chain[lo, hi] (n: none).
  auto last_held = [&](uint32_t lo, uint32_t hi, SourceNum num) -> uint32_t {
    for (uint32_t q = hi + 1; q-- > lo;) {
      if (Holds(BlockKey{ns, chain[q]}, num, now)) return q;
    }
    return n;
  };
  // A worker's pending run continues its match: from the first block a
  // route keeps (every stride-th, or the prompt's last) at or past position
  // 0 and each worker's and group's depth. A block pending on a worker
  // means its whole prefix will be there (a block's hash names its prefix).
  // A shared run shorter than a stride past a worker's depth goes unseen.
  absl::InlinedVector<uint32_t, 8> starts{0};
  auto start_at = [&](uint32_t d) {
    if (d < n && std::find(starts.begin(), starts.end(), d) == starts.end()) starts.push_back(d);
  };
  for (const auto& [s, d] : match->gpu_depth) start_at(d);
  for (const auto& g : match->groups) start_at(g.depth);
  absl::InlinedVector<std::pair<SourceNum, uint32_t>, 4> deeper;
  PlaceOf deeper_at(deeper);
  for (uint32_t from : starts) {
    const uint32_t at = std::min<uint32_t>(static_cast<uint32_t>(Sampled(from, stride)), n - 1);
    auto found = map_.find(BlockKey{ns, chain[at]});
    const Holders* holders = found == map_.end() ? nullptr : &found->second;
    if (holders == nullptr) continue;
    for (const Entry& e : *holders) {
      // A worker that lost part of the prefix it held when routed (evicted
      // it since) will not have the pending blocks past it either.
      if (e.until <= now || e.from > depth_of(e.num)) continue;
      // Stride by stride, then the last block kept within the next stride.
      uint32_t last = at;
      for (uint32_t q = static_cast<uint32_t>(Sampled(at + 1, stride));
           q < n && Holds(BlockKey{ns, chain[q]}, e.num, now); q += stride) {
        last = q;
      }
      if (last + 1 < n) {
        const uint32_t hi =
            std::min<uint32_t>(static_cast<uint32_t>(Sampled(last + 1, stride)), n - 1);
        if (const uint32_t q = last_held(last + 1, hi, e.num); q < n) last = q;
      }
      const uint32_t d = last + 1;
      if (d <= depth_of(e.num)) continue;
      if (const size_t k = deeper_at(e.num); k < deeper.size()) {
        deeper[k].second = std::max(deeper[k].second, d);
      } else {
        deeper.emplace_back(e.num, d);
      }
    }
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

void PendingRoutes::Drop(uint64_t ns, SourceNum num, std::span<const BlockHash> hashes) {
  if (entries_.load(std::memory_order_relaxed) == 0) return;
  std::unique_lock lk(mu_);
  for (const BlockHash& h : hashes) EraseLocked(BlockKey{ns, h}, num);
}

void PendingRoutes::Forget(SourceNum num) {
  if (entries_.load(std::memory_order_relaxed) == 0) return;
  std::unique_lock lk(mu_);
  for (auto it = map_.begin(); it != map_.end();) {
    Holders& h = it->second;
    const size_t before = h.size();
    h.erase(std::remove_if(h.begin(), h.end(), [&](const Entry& e) { return e.num == num; }),
            h.end());
    entries_ -= before - h.size();
    if (h.empty()) {
      map_.erase(it++);
    } else {
      ++it;
    }
  }
}

}  // namespace kvtier::router
