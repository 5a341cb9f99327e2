// The router's registered sources (workers and store shards): their
// registration, event sequence state, last heartbeat and the routes of the
// last moments, each under a dense number (SourceNum) that the prefix index
// and the fleets' arrays are indexed by. Not thread-safe: RouterCore guards
// it, but for Source::NoteRoute / InflightAfter (their own mutex) and
// routed_since_heartbeat (atomic), which Route calls under a shared lock.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "router/prefix_index.h"
#include "router/source_messages.h"

namespace kvtier::router {

using RouterClock = std::chrono::steady_clock;

struct Source {
  SourceNum num = 0;
  SourceHello hello;
  uint64_t id_hash = 0;  // WorkerIdHash(source_id)
  uint64_t last_seq = 0;
  bool resyncing = false;
  uint64_t indexed = 0;            // blocks the index holds for it
  std::vector<uint64_t> snapshot;  // fingerprints of the chunks received so far
  SourceLoad load;                 // the last heartbeat
  bool heard_load = false;         // a heartbeat has come since its hello
  std::atomic<uint64_t> routed_since_heartbeat{0};
  RouterClock::time_point last_seen;
  int streams = 0;
  size_t slot = 0;                  // workers: place in their fleet's arrays
  double prefill_tokens_per_s = 0;  // workers: as last reported

  // Workers: a route of `tokens` made at `now` for the caller's request
  // `request_id` (0: none). At most 4096 kept: a worker whose heartbeats
  // stopped keeps no more.
  void NoteRoute(RouterClock::time_point now, uint64_t tokens, uint64_t request_id = 0);
  // Tokens routed here still on their way, as a heartbeat listing the
  // requests that reached the worker (`arrived`) tells: a route with a
  // request id until the worker lists it (or, never sent, until
  // `id_cutoff`), one without until `cutoff`. Forgets the rest.
  uint64_t InflightAfter(RouterClock::time_point cutoff, RouterClock::time_point id_cutoff,
                         const std::vector<uint64_t>& arrived);

 private:
  struct RecentRoute {
    RouterClock::time_point when;
    uint64_t tokens = 0;
    uint64_t request_id = 0;
  };
  std::mutex routes_mu_;
  std::deque<RecentRoute> recent_routes_;  // oldest first
};

class SourceTable {
 public:
  // nullptr when `id` is not registered.
  Source* Find(const std::string& id) const;
  // Registers `hello` under a free number. REQUIRES: !Find(hello.source_id).
  Source& Add(const SourceHello& hello, RouterClock::time_point now);
  // Forgets a source and frees its number (clear it from the index and its
  // fleet first).
  void Remove(const std::string& id);
  Source* ByNum(SourceNum num) const { return by_num_[num]; }
  // One past the highest number handed out.
  size_t NumLimit() const { return by_num_.size(); }
  size_t size() const { return sources_.size(); }
  // The ids of sources whose last message is older than `deadline` before `now`.
  std::vector<std::string> Silent(RouterClock::time_point now,
                                  std::chrono::milliseconds deadline) const;
  template <class F>  // f(const std::string& id, const Source&)
  void ForEach(F f) const {
    for (const auto& [id, s] : sources_) f(id, *s);
  }

 private:
  std::unordered_map<std::string, std::unique_ptr<Source>> sources_;
  std::vector<Source*> by_num_;  // SourceNum -> source (nullptr when free)
  std::vector<SourceNum> free_nums_;
};

}  // namespace kvtier::router
