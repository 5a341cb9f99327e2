#include "router/off_gpu.h"

namespace kvtier::router {

void OffGpuBlocks::Set(uint64_t fp, SourceNum source, Medium medium) {
  const std::pair key{fp, source};
  if (medium == Medium::kGpu) {
    if (map_.erase(key) > 0) --count_[source];
    return;
  }
  auto [it, added] = map_.try_emplace(key, medium);
  if (!added) {
    it->second = medium;
    return;
  }
  if (count_.size() <= source) count_.resize(source + 1, 0);
  ++count_[source];
}

void OffGpuBlocks::RemoveSource(SourceNum source) {
  if (Count(source) == 0) return;
  for (auto it = map_.begin(); it != map_.end();) {
    if (it->first.second == source) {
      map_.erase(it++);
    } else {
      ++it;
    }
  }
  count_[source] = 0;
}

OffGpuBlocks::Split OffGpuBlocks::Locate(uint64_t ns, const ChainView& chain, SourceNum source,
                                         uint32_t depth) const {
  // The first block in [lo, depth) at `medium` or slower.
  auto first_at = [&](uint32_t lo, Medium medium) {
    return FirstPast(lo, depth, [&](uint32_t i) {
      return Get(PrefixIndex::Fingerprint(BlockKey{ns, chain[i]}), source) >= medium;
    });
  };
  Split s;
  s.gpu = first_at(0, Medium::kCpu);
  s.cpu = first_at(s.gpu, Medium::kDisk) - s.gpu;
  return s;
}

}  // namespace kvtier::router
