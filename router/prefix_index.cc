#include "router/prefix_index.h"

#include <algorithm>

#include "absl/container/inlined_vector.h"

namespace kvtier::router {

void PrefixIndex::SetStore(SourceNum source, bool store) {
  if (source >= is_store_.size()) is_store_.resize(source + 1, 0);
  if (is_store_[source] == store) return;
  is_store_[source] = store;
  store ? ++stores_ : --stores_;
}

bool PrefixIndex::Add(uint64_t fp, SourceNum source) {
  Holders& h = map_[fp];
  if (h.h[0] == kSpill) {
    Spill& sp = spill_[h.h[1]];
    if (Holds(&h, source)) return false;
    sp.list.push_back(source);
    sp.stores += IsStore(source);
    if (!sp.bits.empty()) {
      SetBit(&sp.bits, source, true);
    } else if (sp.list.size() >= kBitsFrom) {
      for (SourceNum n : sp.list) SetBit(&sp.bits, n, true);
    }
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
    spill_[at].list = {h.h[0], h.h[1], source};
    spill_[at].stores = IsStore(h.h[0]) + IsStore(h.h[1]) + IsStore(source);
    h.h[0] = kSpill;
    h.h[1] = at;
  }
  ++replicas_;
  return true;
}

bool PrefixIndex::Drop(Holders& h, SourceNum source) {
  if (h.h[0] == kSpill) {
    Spill& sp = spill_[h.h[1]];
    auto& list = sp.list;
    auto pos = std::find(list.begin(), list.end(), source);
    if (pos == list.end()) return false;
    *pos = list.back();
    list.pop_back();
    sp.stores -= IsStore(source);
    if (!sp.bits.empty()) {
      SetBit(&sp.bits, source, false);
      if (list.size() < kBitsFrom / 2) sp.bits = {};
    }
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

void PrefixIndex::SoleHeld(std::vector<uint64_t>* counts) const {
  for (const auto& [fp, h] : map_) {
    // A spilled list holds more than two; an inline pair with h[1] set, two.
    if (h.h[0] == kNone || h.h[0] == kSpill || h.h[1] != kNone || IsStore(h.h[0])) continue;
    if (h.h[0] >= counts->size()) counts->resize(h.h[0] + 1, 0);
    (*counts)[h.h[0]]++;
  }
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

}  // namespace

void PrefixIndex::MatchLinear(uint64_t ns, const ChainView& chain, PrefixMatch* out) const {
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
        if (IsStore(s)) {
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

void PrefixIndex::Match(uint64_t ns, const ChainView& chain, PrefixMatch* out, bool groups) const {
  out->Clear();
  const size_t n = chain.size();
  struct Probe {
    size_t at;
    const Holders* h;
    uint32_t workers;
  };
  auto probe = [&](size_t at) {
    const Holders* h = Find(ns, chain[at], out);
    return Probe{at, h, Workers(h)};
  };
  // Probes up to kFan positions at once: their hashes are read, then their
  // table groups prefetched, before any is looked up, so the cache misses of
  // one batch overlap instead of following one another (a probe is a few
  // misses: the request's hash, the table's control bytes and slot).
  constexpr size_t kFan = 16;
  auto probe_all = [&](const size_t* at, size_t k, Probe* got) {
    uint64_t fp[kFan];
    for (size_t i = 0; i < k; ++i) fp[i] = Fingerprint(BlockKey{ns, chain[at[i]]});
    for (size_t i = 0; i < k; ++i) map_.prefetch(fp[i]);
    for (size_t i = 0; i < k; ++i) {
      ++out->probes;
      auto it = map_.find(fp[i]);
      const Holders* h = it == map_.end() ? nullptr : &it->second;
      got[i] = Probe{at[i], h, Workers(h)};
    }
  };
  // Per-source marks for this match, indexed by SourceNum: kHi = holds the
  // block after a change (one change at a time), kDone = given a depth
  // (with holes a worker could leave twice; the first depth stands).
  enum : uint8_t { kHi = 1, kDone = 2 };
  thread_local std::vector<uint8_t> marks_of_thread;
  std::vector<uint8_t>& mark = marks_of_thread;  // (no TLS wrapper per use)
  auto marks = [&](const Probe& p, uint8_t bit, bool set) {
    if (p.h == nullptr) return;
    for (SourceNum s : List(*p.h)) {
      if (s >= mark.size()) mark.resize(s + 1, 0);
      set ? mark[s] |= bit : mark[s] &= static_cast<uint8_t>(~bit);
    }
  };
  // The workers holding block lo.at but not block hi.at hold hi.at leading
  // blocks.
  auto change = [&](const Probe& lo, const Probe& hi) {
    if (groups && List(*lo.h).size() > kGroupFrom) {
      out->groups.push_back(PrefixMatch::Group{static_cast<uint32_t>(hi.at), lo.h, hi.h,
                                               lo.workers - std::min(lo.workers, hi.workers)});
      return;
    }
    marks(hi, kHi, true);
    for (SourceNum s : List(*lo.h)) {
      if (s < mark.size() && (mark[s] & (kHi | kDone)) != 0) continue;
      if (IsStore(s)) continue;
      if (s >= mark.size()) mark.resize(s + 1, 0);
      mark[s] |= kDone;
      out->gpu_depth.emplace_back(s, static_cast<uint32_t>(hi.at));
    }
    marks(hi, kHi, false);
  };
  // lo.workers != hi.workers: cut (lo, hi] in kSplit parts (one batch of
  // probes) until each change is one block wide.
  constexpr size_t kSplit = 8;
  auto split = [&](auto& self, const Probe& lo, const Probe& hi) -> void {
    const size_t width = hi.at - lo.at;
    if (width == 1) {
      if (lo.workers > 0) change(lo, hi);
      return;
    }
    const size_t parts = std::min(width, kSplit);
    size_t at[kSplit] = {};
    Probe got[kSplit];
    for (size_t j = 1; j < parts; ++j) at[j - 1] = lo.at + width * j / parts;
    probe_all(at, parts - 1, got);
    got[parts - 1] = hi;
    const Probe* prev = &lo;
    for (size_t j = 0; j < parts; ++j) {
      if (got[j].workers != prev->workers) self(self, *prev, got[j]);
      prev = &got[j];
    }
  };
  Probe first{};
  if (n > 0) first = probe(0);
  if (first.workers > 0) {
    // Blocks 0, 1, 3, 7, 15, ... up to the last: all probed in one batch
    // (a dozen for 2,000 blocks), then read until no worker holds one.
    size_t at[kFan] = {};
    Probe got[kFan];
    size_t k = 0;
    for (size_t a = 1; k < kFan; a = 2 * a + 1) {
      at[k++] = std::min(a, n - 1);
      if (a >= n - 1) break;
    }
    if (n > 1) probe_all(at, k, got);
    Probe lo = first;
    for (size_t i = 0; lo.workers > 0; ++i) {
      if (lo.at == n - 1) {
        change(lo, Probe{n, nullptr, 0});
        break;
      }
      const Probe hi = i < k ? got[i] : probe(std::min(2 * lo.at + 1, n - 1));
      if (hi.workers != lo.workers) split(split, lo, hi);
      lo = hi;
    }
    for (const auto& [s, depth] : out->gpu_depth) mark[s] = 0;
  }
  // The store's runs from 0 and from each worker's depth, galloped the same
  // way. A run already found answers the positions inside it.
  auto has_store = [&](const Probe& p) {
    if (p.h != nullptr) {
      for (SourceNum s : List(*p.h)) {
        if (IsStore(s)) return true;
      }
    }
    return false;
  };
  absl::InlinedVector<std::pair<uint32_t, uint32_t>, 4> runs;  // [begin, end) found
  auto run_from = [&](uint32_t from) -> uint32_t {
    if (stores_ == 0 || from >= n) return 0;
    for (const auto& [b, e] : runs) {
      if (from >= b && from < e) return e - from;
      if (from == e) return 0;  // a block no store holds ended that run
    }
    // from, from + 1, from + 3, from + 7, ... in one batch: the run ends
    // between the last stored one and the first that is not.
    size_t at[kFan] = {};
    Probe got[kFan];
    size_t k = 0;
    for (size_t a = from; k < kFan && a < n; a = 2 * a - from + 1) at[k++] = a;
    probe_all(at, k, got);
    if (!has_store(got[0])) return 0;
    size_t lo = from, hi = n;  // stored(lo); hi: the first block known not stored
    size_t i = 1;
    for (; i < k && has_store(got[i]); ++i) lo = got[i].at;
    if (i < k) {
      hi = got[i].at;
    } else if (lo + 1 < n) {  // past the batch (runs beyond ~65,000 blocks): one by one
      for (size_t step = lo - from + 1; lo + step < n; step *= 2) {
        if (!has_store(probe(lo + step))) {
          hi = lo + step;
          break;
        }
        lo += step;
      }
    }
    while (hi - lo > 1) {  // kSplit parts per batch
      const size_t width = hi - lo, parts = std::min(width, kSplit);
      for (size_t j = 1; j < parts; ++j) at[j - 1] = lo + width * j / parts;
      probe_all(at, parts - 1, got);
      for (size_t j = 0; j + 1 < parts; ++j) {
        if (!has_store(got[j])) {
          hi = got[j].at;
          break;
        }
        lo = got[j].at;
      }
    }
    runs.emplace_back(from, static_cast<uint32_t>(hi));
    return static_cast<uint32_t>(hi) - from;
  };
  uint32_t deepest_worker = 0;
  AddStoreRun(out, 0, run_from(0));
  auto at_depth = [&](uint32_t depth) {
    deepest_worker = std::max(deepest_worker, depth);
    bool known = false;
    for (const auto& sr : out->store_runs) known |= sr.first == depth;
    if (!known) AddStoreRun(out, depth, run_from(depth));
  };
  for (const auto& [s, depth] : out->gpu_depth) at_depth(depth);
  for (const auto& g : out->groups) at_depth(g.depth);
  out->walked = deepest_worker + out->StoreRun(deepest_worker);
  out->deepest = static_cast<int64_t>(out->walked) - 1;
}

void PrefixIndex::ExpandGroups(PrefixMatch* m) const {
  absl::flat_hash_set<SourceNum> named;
  for (const auto& [s, d] : m->gpu_depth) named.insert(s);
  for (const auto& g : m->groups) {
    for (SourceNum s : List(*static_cast<const Holders*>(g.before))) {
      if (InGroup(g, s) && named.insert(s).second) m->gpu_depth.emplace_back(s, g.depth);
    }
  }
  m->groups.clear();
}

size_t PrefixIndex::MemoryBytes() const {
  // Swiss table: one slot plus one control byte per bucket.
  size_t bytes = map_.capacity() * (sizeof(std::pair<const uint64_t, Holders>) + 1);
  bytes += spill_.capacity() * sizeof(spill_[0]) + spill_free_.capacity() * sizeof(uint32_t);
  for (const auto& sp : spill_) {
    bytes += sp.list.capacity() * sizeof(SourceNum) + sp.bits.capacity() * sizeof(uint64_t);
  }
  bytes += is_store_.capacity();
  return bytes;
}

}  // namespace kvtier::router
