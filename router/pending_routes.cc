#include "router/pending_routes.h"

#include <algorithm>

namespace kvtier::router {

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
                        Clock::time_point now) {
  std::unique_lock lk(mu_);
  ExpireLocked(now);
  const size_t adding = chain.size() - std::min<size_t>(from, chain.size());
  // Over the bound the oldest go first, as if their time had come.
  while (entries_ + adding > kMaxBlocks && !expiry_.empty()) ExpireLocked(expiry_.front().first);
  const Clock::time_point until = now + ttl_;
  for (size_t i = from; i < chain.size(); ++i) {
    const BlockKey key{ns, chain[i]};
    Holders& h = map_[key];
    auto it = std::find_if(h.begin(), h.end(), [&](const Entry& e) { return e.num == num; });
    if (it != h.end()) {
      it->until = until;
    } else {
      h.push_back({num, until});
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

void PendingRoutes::Deepen(uint64_t ns, const ChainView& chain, const PrefixIndex& index,
                           PrefixMatch* match, Clock::time_point now) const {
  if (entries_.load(std::memory_order_relaxed) == 0 || chain.empty()) return;
  std::shared_lock lk(mu_);
  auto depth_of = [&](SourceNum num) -> uint32_t {
    for (const auto& [s, d] : match->gpu_depth) {
      if (s == num) return d;
    }
    for (const auto& g : match->groups) {
      if (index.InGroup(g, num)) return g.depth;
    }
    return 0;
  };
  // A worker's pending run continues its match: look where runs can start
  // (position 0, and each worker's or group's depth).
  absl::InlinedVector<uint32_t, 8> starts{0};
  auto start_at = [&](uint32_t d) {
    if (d < chain.size() && std::find(starts.begin(), starts.end(), d) == starts.end()) {
      starts.push_back(d);
    }
  };
  for (const auto& [s, d] : match->gpu_depth) start_at(d);
  for (const auto& g : match->groups) start_at(g.depth);
  absl::InlinedVector<std::pair<SourceNum, uint32_t>, 4> deeper;
  for (uint32_t at : starts) {
    auto it = map_.find(BlockKey{ns, chain[at]});
    if (it == map_.end()) continue;
    for (const Entry& e : it->second) {
      if (e.until <= now || depth_of(e.num) != at) continue;
      uint32_t d = at + 1;
      while (d < chain.size() && Holds(BlockKey{ns, chain[d]}, e.num, now)) ++d;
      deeper.emplace_back(e.num, d);
    }
  }
  for (const auto& [num, d] : deeper) {
    const uint32_t was = depth_of(num);
    // The store's run from d: what a run from the worker's old depth (or
    // from 0) covers past d.
    uint32_t run = 0;
    for (const auto& [at, r] : match->store_runs) {
      if ((at == was || at == 0) && at + r > d) run = std::max(run, at + r - d);
    }
    bool listed = false;
    for (auto& [s, depth] : match->gpu_depth) {
      if (s == num) {
        depth = d;
        listed = true;
      }
    }
    if (!listed) match->gpu_depth.emplace_back(num, d);
    if (match->StoreRun(d) < run) {
      bool set = false;
      for (auto& [at, r] : match->store_runs) {
        if (at == d) {
          r = run;
          set = true;
        }
      }
      if (!set) match->store_runs.emplace_back(d, run);
    }
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
