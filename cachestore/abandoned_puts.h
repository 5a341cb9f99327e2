// BeginPuts their writers gave up on. A writer with a short budget (a save
// that must not wait on a stalled store) stops waiting for BeginPut's
// answer; the store, once it runs again, would still reserve the slots and
// nobody would commit or abort them: the blocks would be busy to every
// other writer for a whole lease period. The writer tags each BeginPut with
// a token of its choosing and, having given up, sends AbortPut with that
// token: the lease the BeginPut opened is aborted, or, if the BeginPut has
// not been served yet, a tombstone refuses it when it is.
//
// Tokens are the caller's tenant's (one tenant cannot give up another's
// puts), kept for `keep` (the store's lease period: past it a lease ends on
// its own) and at most `capacity` of them (the oldest go first). Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <utility>

namespace kvtier::store {

class AbandonedPuts {
 public:
  using Clock = std::function<std::chrono::steady_clock::time_point()>;
  // On `clock` (steady_clock by default; tests turn one by hand).
  AbandonedPuts(std::chrono::milliseconds keep, size_t capacity, Clock clock = {});

  // Before a BeginPut with `token` (nonzero) is served: true if its writer
  // already gave it up (the tombstone is consumed; refuse the call).
  bool GivenUp(int tenant, uint64_t token);
  // After the BeginPut opened `lease` (nonzero): true if its writer gave it
  // up meanwhile (the caller aborts the lease); else the lease is noted for
  // a later Abandon.
  bool Opened(int tenant, uint64_t token, uint64_t lease);
  // AbortPut by token: the lease to abort, or 0 when the BeginPut has not
  // opened one (a tombstone then waits for it).
  uint64_t Abandon(int tenant, uint64_t token);

  size_t size() const;

 private:
  using Key = std::pair<int, uint64_t>;
  struct Entry {
    uint64_t lease = 0;  // 0: a tombstone
    std::chrono::steady_clock::time_point at;
  };
  void Prune(std::chrono::steady_clock::time_point now);  // mu_ held

  const std::chrono::milliseconds keep_;
  const size_t capacity_;
  const Clock clock_;
  mutable std::mutex mu_;
  std::map<Key, Entry> entries_;                                             // guarded by mu_
  std::deque<std::pair<Key, std::chrono::steady_clock::time_point>> order_;  // oldest first
};

}  // namespace kvtier::store
