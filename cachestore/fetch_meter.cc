#include "cachestore/fetch_meter.h"

#include <algorithm>

namespace kvtier::store {

void FetchMeter::RotateLocked(Clock::time_point now) {
  if (now - bucket_start_ < window_) return;
  // One window on: the current becomes the previous; two or more: both empty.
  previous_ = now - bucket_start_ < 2 * window_ ? current_ : std::array<Bucket, 2>{};
  current_ = {};
  bucket_start_ = now;
}

void FetchMeter::Served(Tier tier, uint64_t blocks, uint64_t bytes, double seconds,
                        Clock::time_point now) {
  if (blocks == 0) return;
  std::lock_guard lk(mu_);
  RotateLocked(now);
  Bucket& b = current_[tier];
  b.blocks += blocks;
  b.bytes += bytes;
  b.seconds += seconds;
}

std::vector<TierFetchFigures> FetchMeter::Figures(Clock::time_point now) {
  std::lock_guard lk(mu_);
  RotateLocked(now);
  std::vector<TierFetchFigures> out;
  const uint32_t depth =
      static_cast<uint32_t>(std::max<int64_t>(0, in_flight_.load(std::memory_order_relaxed)));
  for (int t : {kRam, kDisk}) {
    TierFetchFigures f;
    f.tier = t == kRam ? "ram" : "disk";
    f.blocks = current_[t].blocks + previous_[t].blocks;
    f.bytes = current_[t].bytes + previous_[t].bytes;
    f.seconds = current_[t].seconds + previous_[t].seconds;
    f.queue_depth = depth;
    if (f.blocks > 0) out.push_back(f);
  }
  return out;
}

}  // namespace kvtier::store
