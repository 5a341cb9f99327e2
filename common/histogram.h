// A fixed-bucket latency histogram (power-of-two microsecond buckets).
// Record() is lock-free and safe from any thread; Snapshot() is a consistent
// enough copy for stats (counters are read one by one).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <vector>

namespace kvtier {

class LatencyHistogram {
 public:
  // Buckets: <=1us, <=2us, <=4us, ... <=2^(kBuckets-2) us, +inf.
  static constexpr int kBuckets = 28;

  void Record(uint64_t micros, bool ok = true) {
    int b = 0;
    while (b < kBuckets - 1 && micros > (1ull << b)) ++b;
    buckets_[b].fetch_add(1, std::memory_order_relaxed);
    count_.fetch_add(1, std::memory_order_relaxed);
    sum_us_.fetch_add(micros, std::memory_order_relaxed);
    if (!ok) errors_.fetch_add(1, std::memory_order_relaxed);
  }

  struct Snapshot {
    uint64_t count = 0, errors = 0, sum_us = 0;
    std::vector<uint64_t> upper_us;  // 0 = +inf
    std::vector<uint64_t> counts;
    // Upper bound of the bucket holding quantile q (0..1), in microseconds.
    uint64_t Quantile(double q) const;
  };

  Snapshot Take() const {
    Snapshot s;
    s.count = count_.load(std::memory_order_relaxed);
    s.errors = errors_.load(std::memory_order_relaxed);
    s.sum_us = sum_us_.load(std::memory_order_relaxed);
    for (int b = 0; b < kBuckets; ++b) {
      s.upper_us.push_back(b == kBuckets - 1 ? 0 : (1ull << b));
      s.counts.push_back(buckets_[b].load(std::memory_order_relaxed));
    }
    return s;
  }

 private:
  std::array<std::atomic<uint64_t>, kBuckets> buckets_{};
  std::atomic<uint64_t> count_{0}, errors_{0}, sum_us_{0};
};

inline uint64_t LatencyHistogram::Snapshot::Quantile(double q) const {
  uint64_t total = 0;
  for (uint64_t c : counts) total += c;
  if (total == 0) return 0;
  uint64_t target = static_cast<uint64_t>(q * static_cast<double>(total));
  uint64_t seen = 0;
  for (size_t b = 0; b < counts.size(); ++b) {
    seen += counts[b];
    if (seen > target) return upper_us[b] == 0 ? (1ull << (counts.size() - 1)) : upper_us[b];
  }
  return upper_us.back();
}

}  // namespace kvtier
