// Session affinity (--session-affinity-ttl): the engine a client's session
// (its x-session-id header) was last answered by, kept while the session
// is used at least once a TTL. Thread-safe.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"

namespace kvtier::frontend {

class SessionBook {
 public:
  // At most `cap` sessions are held: past it, expired ones are dropped, and
  // a new session goes unbound while none has expired.
  explicit SessionBook(int64_t ttl_ms, size_t cap = size_t{1} << 20) : ttl_ms_(ttl_ms), cap_(cap) {}

  // The engine id `session` is bound to, or "" (none, or idle past the TTL).
  std::string Engine(const std::string& session, int64_t now_ms) {
    std::lock_guard lk(mu_);
    auto it = by_session_.find(session);
    if (it == by_session_.end()) return "";
    if (now_ms - it->second.second > ttl_ms_) {
      by_session_.erase(it);
      return "";
    }
    return it->second.first;
  }

  // Binds `session` to `engine` from now.
  void Bind(const std::string& session, const std::string& engine, int64_t now_ms) {
    std::lock_guard lk(mu_);
    if (by_session_.size() >= cap_ && !by_session_.contains(session)) {
      absl::erase_if(by_session_,
                     [&](const auto& kv) { return now_ms - kv.second.second > ttl_ms_; });
      if (by_session_.size() >= cap_) return;
    }
    by_session_[session] = {engine, now_ms};
  }

  size_t size() {
    std::lock_guard lk(mu_);
    return by_session_.size();
  }

 private:
  const int64_t ttl_ms_;
  const size_t cap_;
  std::mutex mu_;
  absl::flat_hash_map<std::string, std::pair<std::string, int64_t>> by_session_;
};

}  // namespace kvtier::frontend
