#include "cachestore/abandoned_puts.h"

#include <utility>

namespace kvtier::store {

AbandonedPuts::AbandonedPuts(std::chrono::milliseconds keep, size_t capacity, Clock clock)
    : keep_(keep),
      capacity_(capacity == 0 ? 1 : capacity),
      clock_(clock ? std::move(clock) : Clock([] { return std::chrono::steady_clock::now(); })) {}

void AbandonedPuts::Prune(std::chrono::steady_clock::time_point now) {
  while (!order_.empty() && (order_.front().second + keep_ <= now || entries_.size() > capacity_)) {
    auto it = entries_.find(order_.front().first);
    // An entry re-noted since keeps its newer time.
    if (it != entries_.end() && it->second.at == order_.front().second) entries_.erase(it);
    order_.pop_front();
  }
}

bool AbandonedPuts::GivenUp(int tenant, uint64_t token) {
  std::lock_guard lk(mu_);
  auto it = entries_.find({tenant, token});
  if (it == entries_.end() || it->second.lease != 0) return false;
  entries_.erase(it);
  return true;
}

bool AbandonedPuts::Opened(int tenant, uint64_t token, uint64_t lease) {
  const auto now = clock_();
  std::lock_guard lk(mu_);
  auto [it, inserted] = entries_.try_emplace({tenant, token}, Entry{lease, now});
  if (!inserted) {
    if (it->second.lease == 0) {
      entries_.erase(it);  // given up while it was being served
      return true;
    }
    it->second = Entry{lease, now};  // a token used twice: the newer lease
  }
  order_.emplace_back(Key{tenant, token}, now);
  Prune(now);
  return false;
}

uint64_t AbandonedPuts::Abandon(int tenant, uint64_t token) {
  const auto now = clock_();
  std::lock_guard lk(mu_);
  auto it = entries_.find({tenant, token});
  if (it != entries_.end() && it->second.lease != 0) {
    const uint64_t lease = it->second.lease;
    entries_.erase(it);
    return lease;
  }
  if (it == entries_.end()) {
    entries_.emplace(Key{tenant, token}, Entry{0, now});
    order_.emplace_back(Key{tenant, token}, now);
    Prune(now);
  }
  return 0;
}

size_t AbandonedPuts::size() const {
  std::lock_guard lk(mu_);
  return entries_.size();
}

}  // namespace kvtier::store
