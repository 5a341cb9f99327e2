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

void PrefixIndex::Match(uint64_t ns, std::span<const BlockHash> chain,
                        const std::function<bool(SourceNum)>& is_store,
                        PrefixMatch* out) const {
  out->gpu_depth.clear();
  out->store_run.clear();
  out->walked = 0;
  out->deepest = -1;
  // Workers still holding every block so far.
  std::vector<SourceNum> active, next;
  std::vector<uint8_t> in_store;
  for (size_t i = 0; i < chain.size(); ++i) {
    auto it = map_.find(BlockKey{ns, chain[i]});
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
  out->store_run.assign(out->walked + 1, 0);
  for (size_t i = out->walked; i-- > 0;) {
    out->store_run[i] = in_store[i] ? out->store_run[i + 1] + 1 : 0;
  }
}

size_t PrefixIndex::MemoryBytes() const {
  // Swiss table: one slot plus one control byte per bucket.
  size_t slot = sizeof(BlockKey) + sizeof(Holders);
  return map_.capacity() * (slot + 1) + spilled_ * 8 * sizeof(SourceNum);
}

}  // namespace kvtier::router
