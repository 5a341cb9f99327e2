#include "router/prefix_index.h"

#include <algorithm>

namespace kvtier::router {

bool PrefixIndex::Add(const BlockKey& key, SourceNum source) {
  Holders& h = map_[key];
  if (std::find(h.begin(), h.end(), source) != h.end()) return false;
  if (h.size() == kInline) ++spilled_;
  h.push_back(source);
  ++replicas_;
  return true;
}

bool PrefixIndex::Remove(const BlockKey& key, SourceNum source) {
  auto it = map_.find(key);
  if (it == map_.end()) return false;
  Holders& h = it->second;
  auto pos = std::find(h.begin(), h.end(), source);
  if (pos == h.end()) return false;
  if (h.size() == kInline + 1) --spilled_;
  *pos = h.back();
  h.pop_back();
  --replicas_;
  if (h.empty()) map_.erase(it);
  return true;
}

namespace {

void AddStoreRun(PrefixMatch* out, uint32_t at, uint32_t run) {
  for (const auto& sr : out->store_runs) {
    if (sr.first == at) return;
  }
  out->store_runs.emplace_back(at, run);
}

}  // namespace

void PrefixIndex::MatchLinear(uint64_t ns, std::span<const BlockHash> chain,
                              const std::function<bool(SourceNum)>& is_store,
                              PrefixMatch* out) const {
  out->Clear();
  // Workers still holding every block so far.
  std::vector<SourceNum> active, next;
  std::vector<uint8_t> in_store;
  for (size_t i = 0; i < chain.size(); ++i) {
    auto it = map_.find(BlockKey{ns, chain[i]});
    ++out->probes;
    bool stored = false;
    next.clear();
    if (it != map_.end()) {
      for (SourceNum s : it->second) {
        if (is_store(s)) {
          stored = true;
        } else if (i == 0 || std::find(active.begin(), active.end(), s) != active.end()) {
          next.push_back(s);
        }
      }
    }
    // Workers that dropped out hold exactly i leading blocks.
    for (SourceNum s : active) {
      if (std::find(next.begin(), next.end(), s) == next.end()) out->gpu_depth.emplace_back(s, i);
    }
    active.swap(next);
    if (active.empty() && !stored) break;
    in_store.push_back(stored);
    out->deepest = static_cast<int64_t>(i);
    out->walked = static_cast<uint32_t>(i + 1);
  }
  for (SourceNum s : active) out->gpu_depth.emplace_back(s, out->walked);
  std::vector<uint32_t> run(out->walked + 1, 0);
  for (size_t i = out->walked; i-- > 0;) run[i] = in_store[i] ? run[i + 1] + 1 : 0;
  AddStoreRun(out, 0, run[0]);
  for (const auto& [s, depth] : out->gpu_depth) AddStoreRun(out, depth, run[depth]);
}

void PrefixIndex::Match(uint64_t ns, std::span<const BlockHash> chain,
                        const std::function<bool(SourceNum)>& is_store,
                        PrefixMatch* out) const {
  out->Clear();
  const size_t n = chain.size();
  auto holders = [&](size_t k) -> const Holders* {
    ++out->probes;
    auto it = map_.find(BlockKey{ns, chain[k]});
    return it == map_.end() ? nullptr : &it->second;
  };
  // The first block in (good, n) for which ok() fails, n if none, given
  // ok(good): gallop (good + 1, + 2, + 4, ...) then binary search.
  auto first_failing = [&](size_t good, auto&& ok) -> size_t {
    size_t lo = good, hi = n;
    for (size_t step = 1; lo + step < n; step *= 2) {
      if (!ok(lo + step)) {
        hi = lo + step;
        break;
      }
      lo += step;
    }
    while (hi - lo > 1) {
      const size_t mid = lo + (hi - lo) / 2;
      (ok(mid) ? lo : hi) = mid;
    }
    return hi;
  };
  // Workers holding every block up to the current point (sorted).
  std::vector<SourceNum> group, next;
  if (n > 0) {
    if (const Holders* h = holders(0)) {
      for (SourceNum s : *h) {
        if (!is_store(s)) group.push_back(s);
      }
    }
  }
  std::sort(group.begin(), group.end());
  auto still = [&](const Holders* h, std::vector<SourceNum>* kept) {
    kept->clear();
    if (h == nullptr) return;
    for (SourceNum s : *h) {
      if (std::binary_search(group.begin(), group.end(), s)) kept->push_back(s);
    }
  };
  size_t at = 0;  // every worker in `group` holds blocks [0, at]
  while (!group.empty()) {
    const size_t miss = first_failing(at, [&](size_t k) {
      const Holders* h = holders(k);
      if (h == nullptr || h->size() < group.size()) return false;
      still(h, &next);
      return next.size() == group.size();
    });
    if (miss >= n) {
      for (SourceNum s : group) out->gpu_depth.emplace_back(s, static_cast<uint32_t>(n));
      break;
    }
    still(holders(miss), &next);
    std::sort(next.begin(), next.end());
    for (SourceNum s : group) {
      if (!std::binary_search(next.begin(), next.end(), s)) {
        out->gpu_depth.emplace_back(s, static_cast<uint32_t>(miss));
      }
    }
    group.swap(next);
    at = miss;
  }
  // The store's runs from 0 and from each worker's depth, counted block by
  // block: a store's blocks of a chain need not be one run (under
  // write-back it holds the tails workers evicted), and every block counted
  // is one the worker would load. Each block is probed once: a run already
  // counted answers the positions inside it.
  auto stored = [&](size_t k) {
    if (const Holders* h = holders(k)) {
      for (SourceNum s : *h) {
        if (is_store(s)) return true;
      }
    }
    return false;
  };
  std::vector<std::pair<uint32_t, uint32_t>> runs;  // [begin, end) counted
  auto run_from = [&](uint32_t from) -> uint32_t {
    for (const auto& [b, e] : runs) {
      if (from >= b && from < e) return e - from;
      if (from == e) return 0;  // the run ended at a block no store holds
    }
    uint32_t end = from;
    while (end < n && stored(end)) ++end;
    if (end > from) runs.emplace_back(from, end);
    return end - from;
  };
  uint32_t deepest_worker = 0;
  AddStoreRun(out, 0, run_from(0));
  for (const auto& [s, depth] : out->gpu_depth) {
    deepest_worker = std::max(deepest_worker, depth);
    bool known = false;
    for (const auto& sr : out->store_runs) known |= sr.first == depth;
    if (!known) AddStoreRun(out, depth, run_from(depth));
  }
  out->walked = deepest_worker + out->StoreRun(deepest_worker);
  out->deepest = static_cast<int64_t>(out->walked) - 1;
}

size_t PrefixIndex::MemoryBytes() const {
  // Swiss table: one slot plus one control byte per bucket.
  size_t slot = sizeof(BlockKey) + sizeof(Holders);
  return map_.capacity() * (slot + 1) + spilled_ * 8 * sizeof(SourceNum);
}

}  // namespace kvtier::router
