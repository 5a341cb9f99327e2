// What a store shard observes of its own fetches, per tier, over a sliding
// window: blocks and bytes served, the time they took (a get lease from
// BeginGet to its release, a disk read included; an inline get's call), and
// how many fetches are in flight now. Store shards report it with their
// router heartbeats (router.proto, TierFetch); the router prices fetching
// from it (docs/router.md, "Fetch cost"). Thread-safe.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <vector>

#include "common/histogram.h"

namespace kvtier::store {

struct TierFetchFigures {
  const char* tier = "";  // "ram" or "disk"
  uint64_t blocks = 0;
  uint64_t bytes = 0;
  double seconds = 0;  // summed over the fetches
  uint32_t queue_depth = 0;
  double us_per_block() const { return blocks ? seconds * 1e6 / blocks : 0; }
  double bytes_per_s() const { return seconds > 0 ? bytes / seconds : 0; }
};

class FetchMeter {
 public:
  using Clock = std::chrono::steady_clock;
  enum Tier { kRam = 0, kDisk = 1 };
  // Figures cover the last one to two windows.
  explicit FetchMeter(Clock::duration window = std::chrono::seconds(1)) : window_(window) {}

  // A fetch (a lease, an inline call) started or ended.
  void Started() { in_flight_.fetch_add(1, std::memory_order_relaxed); }
  void Ended() { in_flight_.fetch_sub(1, std::memory_order_relaxed); }
  // Blocks of one tier served by a fetch that took `seconds` in all (their
  // share of it).
  void Served(Tier tier, uint64_t blocks, uint64_t bytes, double seconds, Clock::time_point now);

  // The tiers that served something in the window.
  std::vector<TierFetchFigures> Figures(Clock::time_point now);

  // One whole fetch (a get lease from BeginGet to its release, an inline
  // get's call) took `seconds`; `slowest` is the slowest tier it read.
  void Fetched(Tier slowest, double seconds) {
    durations_[slowest].Record(static_cast<uint64_t>(seconds * 1e6));
  }
  // Every whole fetch since start whose slowest tier was `tier`.
  LatencyHistogram::Snapshot Durations(Tier tier) const { return durations_[tier].Take(); }

 private:
  struct Bucket {
    uint64_t blocks = 0, bytes = 0;
    double seconds = 0;
  };
  void RotateLocked(Clock::time_point now);

  const Clock::duration window_;
  std::atomic<int64_t> in_flight_{0};
  std::mutex mu_;
  Clock::time_point bucket_start_{};
  std::array<Bucket, 2> current_{}, previous_{};  // per tier
  std::array<LatencyHistogram, 2> durations_;
};

}  // namespace kvtier::store
