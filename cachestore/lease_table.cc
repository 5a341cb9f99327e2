#include "cachestore/lease_table.h"

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace kvtier::store {

LeaseTable::LeaseTable(uint64_t lease_ms, uint64_t max_per_client, ReleaseFn release)
    : lease_ms_(lease_ms), max_per_client_(max_per_client), release_(std::move(release)) {
  // 52 random bits: far from wrapping to 0 (no lease) and from another
  // process's ids.
  std::random_device rd;
  next_id_ = ((uint64_t{rd()} << 32 | rd()) >> 12) + 1;
  reaper_ = std::thread([this] { ReaperLoop(); });
}

LeaseTable::~LeaseTable() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
}

absl::StatusOr<uint64_t> LeaseTable::Claim(const LeaseOwner& owner) {
  const uint64_t limit = owner.limit != 0 ? owner.limit : max_per_client_;
  std::lock_guard lk(mu_);
  uint64_t& held = by_client_[owner.holder];
  if (limit != 0 && held >= limit) {
    return absl::ResourceExhaustedError(absl::StrCat(
        owner.holder, " already holds ", held, " open leases (the limit is ", limit,
        "); commit, end or abort some first"));
  }
  ++held;
  return next_id_++;
}

uint64_t LeaseTable::Held(const std::string& holder) const {
  std::lock_guard lk(mu_);
  auto it = by_client_.find(holder);
  return it == by_client_.end() ? 0 : it->second;
}

void LeaseTable::Unclaim(const std::string& client) {
  std::lock_guard lk(mu_);
  auto it = by_client_.find(client);
  if (it != by_client_.end() && --it->second == 0) by_client_.erase(it);
}

void LeaseTable::Open(uint64_t id, Lease lease) {
  lease.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(lease_ms_);
  std::lock_guard lk(mu_);
  (lease.is_put ? put_ : get_)++;
  leases_.emplace(id, std::move(lease));
}

void LeaseTable::ForgetLocked(const Lease& lease) {
  (lease.is_put ? put_ : get_)--;
  auto it = by_client_.find(lease.client);
  if (it != by_client_.end() && --it->second == 0) by_client_.erase(it);
}

absl::StatusOr<Lease> LeaseTable::Take(uint64_t id, bool is_put, int tenant) {
  const char* kind = is_put ? "put" : "get";
  std::lock_guard lk(mu_);
  auto it = leases_.find(id);
  if (it == leases_.end() || (tenant >= 0 && it->second.tenant != tenant)) {
    return absl::FailedPreconditionError(absl::StrCat(
        kind, " lease ", id, " is unknown, already ended, or expired (leases last ", lease_ms_,
        " ms)"));
  }
  if (it->second.is_put != is_put) {
    return absl::InvalidArgumentError(absl::StrCat("lease ", id, " is a ", is_put ? "get" : "put",
                                                   " lease, not a ", kind, " lease"));
  }
  Lease l = std::move(it->second);
  leases_.erase(it);
  ForgetLocked(l);
  return l;
}

void LeaseTable::Restore(uint64_t id, Lease lease) {
  std::lock_guard lk(mu_);
  (lease.is_put ? put_ : get_)++;
  by_client_[lease.client]++;
  leases_.emplace(id, std::move(lease));
}

LeaseCounts LeaseTable::counts() const {
  std::lock_guard lk(mu_);
  return LeaseCounts{put_, get_, expired_.load()};
}

void LeaseTable::ReaperLoop() {
  const auto period = std::chrono::milliseconds(std::clamp<uint64_t>(lease_ms_ / 4, 1, 200));
  const auto grace = std::chrono::milliseconds(lease_ms_);
  std::unique_lock lk(mu_);
  while (!stop_) {
    cv_.wait_for(lk, period, [&] { return stop_; });
    auto now = std::chrono::steady_clock::now();
    for (auto it = leases_.begin(); it != leases_.end();) {
      if (it->second.deadline <= now) {
        ForgetLocked(it->second);
        Log("store", it->second.is_put ? "put" : "get", " lease ", it->first, " expired; its ",
            it->second.items.size(), " slots are reclaimed after a grace period");
        graveyard_.emplace_back(now + grace, std::move(it->second));
        it = leases_.erase(it);
        expired_.fetch_add(1);
      } else {
        ++it;
      }
    }
    std::vector<Lease> due;
    for (auto it = graveyard_.begin(); it != graveyard_.end();) {
      if (it->first <= now) {
        due.push_back(std::move(it->second));
        it = graveyard_.erase(it);
      } else {
        ++it;
      }
    }
    if (due.empty()) continue;
    lk.unlock();
    for (const auto& lease : due) release_(lease);
    lk.lock();
  }
  // Shutting down: nothing can write any more.
  for (const auto& [t, lease] : graveyard_) release_(lease);
  graveyard_.clear();
}

}  // namespace kvtier::store
