#include "router/prefix_index.h"

#include <algorithm>

#include "absl/container/inlined_vector.h"

namespace kvtier::router {

bool PrefixIndex::Add(uint64_t fp, SourceNum source) {
  Holders& h = map_[fp];
  if (h.h[0] == kSpill) {
    auto& list = spill_[h.h[1]];
    if (std::find(list.begin(), list.end(), source) != list.end()) return false;
    list.push_back(source);
  } else if (h.h[0] == kNone) {
    h.h[0] = source;
  } else if (h.h[0] == source || h.h[1] == source) {
    return false;
  } else if (h.h[1] == kNone) {
    h.h[1] = source;
  } else {
    uint32_t at;
    if (spill_free_.empty()) {
      at = static_cast<uint32_t>(spill_.size());
      spill_.emplace_back();
    } else {
      at = spill_free_.back();
      spill_free_.pop_back();
    }
    spill_[at] = {h.h[0], h.h[1], source};
    h.h[0] = kSpill;
    h.h[1] = at;
  }
  ++replicas_;
  return true;
}

bool PrefixIndex::Drop(Holders& h, SourceNum source) {
  if (h.h[0] == kSpill) {
    auto& list = spill_[h.h[1]];
    auto pos = std::find(list.begin(), list.end(), source);
    if (pos == list.end()) return false;
    *pos = list.back();
    list.pop_back();
    if (list.size() == 2) {
      const uint32_t at = h.h[1];
      h.h[0] = list[0];
      h.h[1] = list[1];
      spill_[at] = {};
      spill_free_.push_back(at);
    }
  } else if (h.h[0] == source) {
    h.h[0] = h.h[1];
    h.h[1] = kNone;
  } else if (h.h[1] == source && source != kNone) {
    h.h[1] = kNone;
  } else {
    return false;
  }
  --replicas_;
  return true;
}

bool PrefixIndex::Remove(uint64_t fp, SourceNum source) {
  auto it = map_.find(fp);
  if (it == map_.end() || !Drop(it->second, source)) return false;
  if (it->second.h[0] == kNone) map_.erase(it);
  return true;
}

size_t PrefixIndex::RemoveSource(SourceNum source, const absl::flat_hash_set<uint64_t>* keep) {
  size_t dropped = 0;
  for (auto it = map_.begin(); it != map_.end();) {
    auto here = it++;
    if (keep != nullptr && keep->contains(here->first)) continue;
    if (!Drop(here->second, source)) continue;
    ++dropped;
    if (here->second.h[0] == kNone) map_.erase(here);
  }
  return dropped;
}

const PrefixIndex::Holders* PrefixIndex::Find(uint64_t ns, const BlockHash& hash,
                                              PrefixMatch* out) const {
  ++out->probes;
  auto it = map_.find(Fingerprint(BlockKey{ns, hash}));
  return it == map_.end() ? nullptr : &it->second;
}

namespace {

void AddStoreRun(PrefixMatch* out, uint32_t at, uint32_t run) {
  for (const auto& sr : out->store_runs) {
    if (sr.first == at) return;
  }
  out->store_runs.emplace_back(at, run);
}

bool IsStore(const PrefixIndex::StoreFlags& is_store, SourceNum s) {
  return s < is_store.size() && is_store[s] != 0;
}

}  // namespace

void PrefixIndex::MatchLinear(uint64_t ns, const ChainView& chain,
                              const StoreFlags& is_store, PrefixMatch* out) const {
  out->Clear();
  // Workers still holding every block so far.
  std::vector<SourceNum> active, next;
  std::vector<uint8_t> in_store;
  for (size_t i = 0; i < chain.size(); ++i) {
    const Holders* h = Find(ns, chain[i], out);
    bool stored = false;
    next.clear();
    if (h != nullptr) {
      for (SourceNum s : List(*h)) {
        if (IsStore(is_store, s)) {
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

void PrefixIndex::Match(uint64_t ns, const ChainView& chain, const StoreFlags& is_store,
                        bool any_store, PrefixMatch* out) const {
  out->Clear();
  const size_t n = chain.size();
  using Set = absl::InlinedVector<SourceNum, 4>;  // sorted worker numbers
  // The workers of `from` that hold block p (all workers holding it when
  // `from` is null).
  auto holding = [&](size_t p, const Set* from) {
    Set got;
    const Holders* h = Find(ns, chain[p], out);
    if (h == nullptr) return got;
    for (SourceNum s : List(*h)) {
      if (from == nullptr ? !IsStore(is_store, s)
                          : std::binary_search(from->begin(), from->end(), s)) {
        got.push_back(s);
      }
    }
    std::sort(got.begin(), got.end());
    return got;
  };
  // Every worker of `at_lo` holds blocks [0, lo]; `at_hi` (a strict subset)
  // are those that also hold block hi. Halves (lo, hi] until each leaver's
  // last block is found.
  auto split = [&](auto& self, size_t lo, const Set& at_lo, size_t hi, const Set& at_hi) -> void {
    if (hi - lo == 1) {
      for (SourceNum s : at_lo) {
        if (!std::binary_search(at_hi.begin(), at_hi.end(), s)) {
          out->gpu_depth.emplace_back(s, static_cast<uint32_t>(hi));
        }
      }
      return;
    }
    const size_t mid = lo + (hi - lo) / 2;
    const Set at_mid = holding(mid, &at_lo);
    if (at_mid != at_lo) self(self, lo, at_lo, mid, at_mid);
    if (at_hi != at_mid) self(self, mid, at_mid, hi, at_hi);
  };
  if (n > 0) {
    size_t lo = 0;
    Set at_lo = holding(0, nullptr);
    while (!at_lo.empty()) {
      if (lo == n - 1) {
        for (SourceNum s : at_lo) out->gpu_depth.emplace_back(s, static_cast<uint32_t>(n));
        break;
      }
      const size_t hi = std::min(2 * lo + 1, n - 1);  // blocks 1, 3, 7, 15, ...
      Set at_hi = holding(hi, &at_lo);
      if (at_hi != at_lo) split(split, lo, at_lo, hi, at_hi);
      lo = hi;
      at_lo = std::move(at_hi);
    }
  }
  // The store's runs from 0 and from each worker's depth, galloped the same
  // way. A run already found answers the positions inside it.
  auto stored = [&](size_t k) {
    if (const Holders* h = Find(ns, chain[k], out)) {
      for (SourceNum s : List(*h)) {
        if (IsStore(is_store, s)) return true;
      }
    }
    return false;
  };
  absl::InlinedVector<std::pair<uint32_t, uint32_t>, 4> runs;  // [begin, end) found
  auto run_from = [&](uint32_t from) -> uint32_t {
    if (!any_store || from >= n) return 0;
    for (const auto& [b, e] : runs) {
      if (from >= b && from < e) return e - from;
      if (from == e) return 0;  // a block no store holds ended that run
    }
    if (!stored(from)) return 0;
    size_t lo = from, hi = n;  // stored(lo); hi: the first block known not stored
    for (size_t step = 1; lo + step < n; step *= 2) {
      if (!stored(lo + step)) {
        hi = lo + step;
        break;
      }
      lo += step;
    }
    while (hi - lo > 1) {
      const size_t mid = lo + (hi - lo) / 2;
      (stored(mid) ? lo : hi) = mid;
    }
    runs.emplace_back(from, static_cast<uint32_t>(hi));
    return static_cast<uint32_t>(hi) - from;
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
  size_t bytes = map_.capacity() * (sizeof(std::pair<const uint64_t, Holders>) + 1);
  bytes += spill_.capacity() * sizeof(spill_[0]) + spill_free_.capacity() * sizeof(uint32_t);
  for (const auto& list : spill_) bytes += list.capacity() * sizeof(SourceNum);
  return bytes;
}

}  // namespace kvtier::router
