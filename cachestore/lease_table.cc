#include "cachestore/lease_table.h"

#include <algorithm>
#include <iterator>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "openssl/rand.h"

namespace kvtier::store {

LeaseTable::LeaseTable(uint64_t lease_ms, uint64_t max_per_client, ReleaseFn release)
    : LeaseTable(
          lease_ms, max_per_client, std::move(release),
          [] { return std::chrono::steady_clock::now(); }, /*reaper=*/true) {}

LeaseTable::LeaseTable(uint64_t lease_ms, uint64_t max_per_client, ReleaseFn release, Clock clock,
                       bool reaper)
    : lease_ms_(lease_ms),
      max_per_client_(max_per_client),
      release_(std::move(release)),
      clock_(std::move(clock)) {
  if (reaper) reaper_ = std::thread([this] { ReaperLoop(); });
}

LeaseTable::~LeaseTable() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
  // Shutting down: nothing can write any more.
  for (const auto& b : graveyard_) release_(b.lease);
  graveyard_.clear();
}

absl::StatusOr<uint64_t> LeaseTable::Claim(const LeaseOwner& owner) {
  const uint64_t limit = owner.limit != 0 ? owner.limit : max_per_client_;
  std::lock_guard lk(mu_);
  uint64_t& held = by_client_[owner.holder];
  if (limit != 0 && held >= limit) {
    return absl::ResourceExhaustedError(absl::StrCat(owner.holder, " already holds ", held,
                                                     " open leases (the limit is ", limit,
                                                     "); commit, end or abort some first"));
  }
  // A random id: no client learns another's lease from its own (ids from a
  // counter are one apart), and one from a store that restarted (a late
  // release) names none of this process's.
  uint64_t id = 0;
  while (id == 0 || leases_.count(id) != 0) {
    if (spare_ids_.empty()) {
      spare_ids_.resize(256);
      if (RAND_bytes(reinterpret_cast<unsigned char*>(spare_ids_.data()),
                     static_cast<int>(spare_ids_.size() * sizeof(uint64_t))) != 1) {
        spare_ids_.clear();
        if (held == 0) by_client_.erase(owner.holder);
        return absl::UnavailableError("the store has no randomness for a lease id; try again");
      }
    }
    id = spare_ids_.back();
    spare_ids_.pop_back();
  }
  ++held;
  return id;
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
  lease.deadline = clock_() + std::chrono::milliseconds(lease_ms_);
  lease.ranges.clear();
  lease.ranges.reserve(lease.items.size());
  for (const auto& [key, slot] : lease.items) lease.ranges.emplace_back(slot.offset, slot.length);
  std::sort(lease.ranges.begin(), lease.ranges.end());
  std::lock_guard lk(mu_);
  (lease.is_put ? put_ : get_)++;
  leases_.emplace(id, std::move(lease));
}

void LeaseTable::ForgetLocked(const Lease& lease) {
  (lease.is_put ? put_ : get_)--;
  auto it = by_client_.find(lease.client);
  if (it != by_client_.end() && --it->second == 0) by_client_.erase(it);
}

namespace {

// A lease opened on a data-plane session is that session's: a call or
// transfer on another session finds no such lease. A gRPC caller (no
// session) and a lease opened over gRPC are not bound.
bool SessionMayUse(const Lease& lease, std::string_view session) {
  return session.empty() || lease.session.empty() || lease.session == session;
}

}  // namespace

absl::StatusOr<LeaseTable::Hold> LeaseTable::Use(uint64_t id, bool is_put, int tenant,
                                                 uint64_t offset, uint64_t length,
                                                 std::string_view session) {
  const char* kind = is_put ? "put" : "get";
  std::lock_guard lk(mu_);
  auto it = leases_.find(id);
  const auto now = clock_();
  if (it == leases_.end() || it->second.tenant != tenant || it->second.deadline <= now ||
      ending_.count(id) != 0 || !SessionMayUse(it->second, session)) {
    return absl::FailedPreconditionError(
        absl::StrCat(kind, " lease ", id, " is unknown, already ended, or expired (leases last ",
                     lease_ms_, " ms)"));
  }
  const Lease& l = it->second;
  if (l.is_put != is_put) {
    return absl::InvalidArgumentError(absl::StrCat("lease ", id, " is a ", is_put ? "get" : "put",
                                                   " lease, not a ", kind, " lease"));
  }
  // The slot that starts at or before `offset`, if any, must hold the range.
  auto r = std::upper_bound(l.ranges.begin(), l.ranges.end(), std::make_pair(offset, UINT64_MAX));
  const bool inside = length > 0 && r != l.ranges.begin() &&
                      offset - std::prev(r)->first <= std::prev(r)->second &&
                      length <= std::prev(r)->second - (offset - std::prev(r)->first);
  if (!inside) {
    return absl::InvalidArgumentError(absl::StrCat(length, " bytes at arena offset ", offset,
                                                   " are not inside a slot of ", kind, " lease ",
                                                   id));
  }
  holds_[id]++;
  Hold h;
  h.deadline = l.deadline;
  h.token = std::shared_ptr<void>(nullptr, [this, id](void*) {
    std::optional<Lease> ended;
    {
      std::lock_guard lk(mu_);
      auto hit = holds_.find(id);
      if (hit == holds_.end() || --hit->second != 0) return;
      holds_.erase(hit);
      // The last hold of a lease Take ended meanwhile (kDefer) releases it
      // (unless it expired first: then the reaper's graveyard does).
      if (ending_.erase(id) == 0) return;
      auto it = leases_.find(id);
      if (it == leases_.end()) return;
      ended = std::move(it->second);
      leases_.erase(it);
      ForgetLocked(*ended);
    }
    release_(*ended);
  });
  return h;
}

absl::StatusOr<Lease> LeaseTable::Take(uint64_t id, bool is_put, int tenant, WhenHeld when_held,
                                       std::string_view session) {
  const char* kind = is_put ? "put" : "get";
  std::lock_guard lk(mu_);
  auto gone = [&] {
    return absl::FailedPreconditionError(
        absl::StrCat(kind, " lease ", id, " is unknown, already ended, or expired (leases last ",
                     lease_ms_, " ms)"));
  };
  auto it = leases_.find(id);
  if (it == leases_.end() || (tenant >= 0 && it->second.tenant != tenant) ||
      ending_.count(id) != 0 || !SessionMayUse(it->second, session)) {
    return gone();
  }
  if (it->second.is_put != is_put) {
    return absl::InvalidArgumentError(absl::StrCat("lease ", id, " is a ", is_put ? "get" : "put",
                                                   " lease, not a ", kind, " lease"));
  }
  if (holds_.count(id) != 0) {
    // A transfer still moves its bytes (it ends by the lease's deadline).
    if (when_held == WhenHeld::kRefuse) {
      return absl::UnavailableError(absl::StrCat(
          kind, " lease ", id,
          ": a transfer into its slots is still under way on another data-plane connection; "
          "try again once it has ended"));
    }
    ending_.insert(id);
    Lease none;
    none.is_put = is_put;
    none.tenant = it->second.tenant;
    return none;
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

std::vector<Lease> LeaseTable::ReapLocked(std::chrono::steady_clock::time_point now,
                                          std::string* expired) {
  constexpr int kNamed = 8;  // leases a line names; the rest are counted
  const auto grace = std::chrono::milliseconds(lease_ms_);
  int ended = 0;
  expired->clear();
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (it->second.deadline <= now) {
      ForgetLocked(it->second);
      if (ended++ < kNamed) {
        absl::StrAppend(expired, ended > 1 ? ", " : "", it->second.is_put ? "put" : "get",
                        " lease ", it->first, " (", it->second.items.size(), " slots)");
      }
      ending_.erase(it->first);  // the graveyard releases it once its holds end
      graveyard_.push_back(Buried{now + grace, it->first, std::move(it->second)});
      it = leases_.erase(it);
      expired_.fetch_add(1);
    } else {
      ++it;
    }
  }
  if (ended > kNamed) absl::StrAppend(expired, " and ", ended - kNamed, " more");
  std::vector<Lease> due;
  for (auto it = graveyard_.begin(); it != graveyard_.end();) {
    // A transfer still holding an expired lease keeps its slots (it ends
    // by the lease's deadline, so this waits a period at most).
    if (it->due <= now && holds_.count(it->id) == 0) {
      due.push_back(std::move(it->lease));
      it = graveyard_.erase(it);
    } else {
      ++it;
    }
  }
  return due;
}

void LeaseTable::LogExpired(const std::string& expired) {
  if (expired.empty()) return;
  Log("store", "expired: ", expired, "; their slots are reclaimed after a grace period");
}

void LeaseTable::ReapNow() {
  std::vector<Lease> due;
  std::string expired;
  {
    std::lock_guard lk(mu_);
    due = ReapLocked(clock_(), &expired);
  }
  LogExpired(expired);
  for (const auto& lease : due) release_(lease);
}

void LeaseTable::ReaperLoop() {
  const auto period = std::chrono::milliseconds(std::clamp<uint64_t>(lease_ms_ / 4, 1, 200));
  std::unique_lock lk(mu_);
  std::string expired;
  while (!stop_) {
    cv_.wait_for(lk, period, [&] { return stop_; });
    std::vector<Lease> due = ReapLocked(clock_(), &expired);
    if (due.empty() && expired.empty()) continue;
    lk.unlock();
    LogExpired(expired);
    for (const auto& lease : due) release_(lease);
    lk.lock();
  }
}

}  // namespace kvtier::store
