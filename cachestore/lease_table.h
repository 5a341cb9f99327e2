// The store's leases: who holds which RAM slots (a put's reserved slots, a
// get's pins), until when, and how many each client holds.
//
// A lease is claimed (a client slot counted and an id taken, so the slots it
// reserves can name their owner), then opened with its items, and ended by
// Take (commit, abort, end) or by expiry. An expired lease leaves the table
// at once, but its slots are released only one more lease period later (the
// graveyard), so a late RMA from a slow or dead client cannot land in a slot
// that was reused. A reaper thread (period lease/4, at most 200 ms) does
// both, or, built without it, ReapNow. Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "cachestore/ram_tier.h"
#include "common/block_key.h"

namespace kvtier::store {

// Whom a lease belongs to: the holder its count is kept against (see
// LeaseHolder in service.cc), the holder's limit (0: the table's), and with
// tenants the tenant, the only one that may end it. Built from a plain
// holder name where neither applies.
struct LeaseOwner {
  LeaseOwner(std::string h) : holder(std::move(h)) {}  // NOLINT: implicit on purpose
  LeaseOwner(const char* h) : holder(h) {}             // NOLINT: implicit on purpose
  LeaseOwner(std::string h, uint64_t max_leases, int t)
      : holder(std::move(h)), limit(max_leases), tenant(t) {}
  std::string holder;
  uint64_t limit = 0;
  int tenant = -1;
  // The data-plane session the lease is opened on (empty over gRPC): only
  // that session's connections and calls may use or end it.
  std::string session{};
};

struct Lease {
  std::string client;
  int tenant = -1;  // LeaseOwner::tenant
  bool is_put = false;
  std::chrono::steady_clock::time_point deadline;
  std::vector<std::pair<BlockKey, Slot>> items;
  // The items' slots as (offset, length), by offset (set by Open).
  std::vector<std::pair<uint64_t, uint64_t>> ranges{};
  // Gets (for the FetchMeter): when BeginGet started, and how many of the
  // items were read from disk, their bytes and the read time.
  std::chrono::steady_clock::time_point opened{};
  uint32_t disk_items = 0;
  uint64_t disk_bytes = 0;
  double disk_seconds = 0;
  std::string session{};  // LeaseOwner::session
};

struct LeaseCounts {
  uint64_t put = 0, get = 0, expired = 0;
};

class LeaseTable {
 public:
  // Frees a lease's slots (a put's) or pins (a get's); called by the reaper
  // for expired leases, never under the table's lock.
  using ReleaseFn = std::function<void(const Lease&)>;

  // The table's time: deadlines, expiry and the graveyard follow it.
  using Clock = std::function<std::chrono::steady_clock::time_point()>;

  // max_per_client 0: no limit. Starts the reaper. REQUIRES: lease_ms > 0.
  LeaseTable(uint64_t lease_ms, uint64_t max_per_client, ReleaseFn release);
  // On `clock` (tests turn it by hand); with reaper false no thread runs:
  // ReapNow does its work.
  LeaseTable(uint64_t lease_ms, uint64_t max_per_client, ReleaseFn release, Clock clock,
             bool reaper);
  // Stops the reaper and releases what the graveyard still holds.
  ~LeaseTable();

  // Counts one more open lease for the owner's holder and returns the id
  // the lease will have: random, never 0 or a live lease's. RESOURCE_EXHAUSTED
  // past the holder's limit (check and count in one step, so concurrent
  // claims cannot overshoot).
  absl::StatusOr<uint64_t> Claim(const LeaseOwner& owner);
  // Gives back a claim that did not become a lease (nothing reserved).
  void Unclaim(const std::string& client);
  // Makes a claimed id a live lease (its deadline is set here).
  void Open(uint64_t id, Lease lease);

  // A transfer's hold on a live lease (the socket data plane's get or put of
  // bytes in one of its slots): while any hold lives, Take of the lease
  // does not end it (see WhenHeld), and an expired lease's slots stay out
  // of reuse, so no slot is reused while the store still reads or writes it
  // for the lease's holder. Holds end when the object (and its copies) go.
  struct Hold {
    std::shared_ptr<void> token;
    // When the lease expires: the transfer must end by then.
    std::chrono::steady_clock::time_point deadline;
  };
  // A hold on lease `id` for [offset, offset + length) of the arena, for a
  // connection of data-plane `session`.
  // FAILED_PRECONDITION as Take (unknown, ended, expired, being ended,
  // another tenant's, or opened on another session); INVALID_ARGUMENT for a lease of the other
  // kind, or for a range that is not inside one of the lease's slots (it names the range, never
  // what lies there).
  absl::StatusOr<Hold> Use(uint64_t id, bool is_put, int tenant, uint64_t offset, uint64_t length,
                           std::string_view session = {});

  // What Take does with a lease a transfer still holds (on another
  // connection: one connection's frames are served in order). It never
  // waits: a server thread is never parked for a transfer a client can
  // trickle until the lease's deadline.
  enum class WhenHeld {
    kRefuse,  // UNAVAILABLE, nothing changed (a commit: its bytes are not all there)
    kDefer,   // ended now: no new holds, and the last hold to go releases it
  };
  // Removes and returns a live lease. FAILED_PRECONDITION if it is unknown,
  // ended or expired, (tenant >= 0) another tenant's, or (a call on data-
  // plane `session`) opened on another session, each of which reads as
  // unknown (a gRPC caller, with no session, may end any of its tenant's); INVALID_ARGUMENT if it
  // is of the other kind. A held lease: UNAVAILABLE (kRefuse), or (kDefer) a lease of its kind with
  // no items (nothing for the caller to release: its release comes with the last hold's end).
  absl::StatusOr<Lease> Take(uint64_t id, bool is_put, int tenant = -1,
                             WhenHeld when_held = WhenHeld::kRefuse, std::string_view session = {});
  // Puts a taken lease back unchanged (a malformed commit does not cost the
  // caller its lease).
  void Restore(uint64_t id, Lease lease);

  LeaseCounts counts() const;
  // Open leases counted against a holder.
  uint64_t Held(const std::string& holder) const;
  uint64_t lease_ms() const { return lease_ms_; }
  // One pass of the reaper at the clock's now: expired leases leave the
  // table for the graveyard, and what the graveyard holds past its grace
  // (and no transfer holds) is released.
  void ReapNow();

 private:
  void ForgetLocked(const Lease& lease);
  void ReaperLoop();
  // The reaper's pass at `now` under mu_; returns the leases to release
  // and *expired, a line naming the leases that expired ("" if none), both
  // for the caller outside the lock (a log write can block: a full pipe).
  std::vector<Lease> ReapLocked(std::chrono::steady_clock::time_point now, std::string* expired);
  // Logs `expired` (from ReapLocked) when not empty.
  static void LogExpired(const std::string& expired);

  const uint64_t lease_ms_;
  const uint64_t max_per_client_;
  const ReleaseFn release_;
  const Clock clock_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<uint64_t, Lease> leases_;
  struct Buried {
    std::chrono::steady_clock::time_point due;
    uint64_t id;
    Lease lease;
  };
  std::vector<Buried> graveyard_;
  // Transfers holding each lease (Use), and the held leases a Take ended
  // (kDefer): released when their last hold goes.
  std::unordered_map<uint64_t, uint32_t> holds_;
  std::unordered_set<uint64_t> ending_;
  std::unordered_map<std::string, uint64_t> by_client_;
  // Random lease ids drawn ahead, a batch at a time (Claim).
  std::vector<uint64_t> spare_ids_;
  uint64_t put_ = 0, get_ = 0;
  std::atomic<uint64_t> expired_{0};
  bool stop_ = false;
  std::thread reaper_;
};

}  // namespace kvtier::store
