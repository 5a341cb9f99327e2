#include "cachestore/namespace_usage.h"

#include <algorithm>

namespace kvtier::store {

void NamespaceUsageTable::Changed(const BlockKey& key, TierKind tier, bool added) {
  std::lock_guard lk(mu_);
  Counts& c = counts_[key.ns];
  (tier == TierKind::kRam ? c.ram : c.nvme) += added ? 1 : -1;
}

void NamespaceUsageTable::Read(uint64_t ns, uint64_t asked, uint64_t served) {
  std::lock_guard lk(mu_);
  Counts& c = counts_[ns];
  c.asked += asked;
  c.served += served;
}

NamespaceUsage NamespaceUsageTable::Of(uint64_t ns) const {
  std::lock_guard lk(mu_);
  auto it = counts_.find(ns);
  if (it == counts_.end()) return {};
  const Counts& c = it->second;
  return NamespaceUsage{static_cast<uint64_t>(std::max<int64_t>(0, c.ram)),
                        static_cast<uint64_t>(std::max<int64_t>(0, c.nvme)), c.asked, c.served};
}

}  // namespace kvtier::store
