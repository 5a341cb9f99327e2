#include "client/shard_skip.h"

#include <algorithm>

namespace kvtier {

bool ShardSkip::Admit(int64_t now_ms, int64_t* left_ms) {
  int64_t until = skip_until_ms_.load(std::memory_order_relaxed);
  if (until == 0) return true;
  // The skip is over: the first caller to move it past its own call probes.
  if (now_ms >= until && skip_until_ms_.compare_exchange_strong(
                             until, now_ms + static_cast<int64_t>(probe_hold_ms_))) {
    return true;
  }
  *left_ms = std::max<int64_t>(0, skip_until_ms_.load(std::memory_order_relaxed) - now_ms);
  return false;
}

void ShardSkip::Note(const absl::Status& outcome, int64_t now_ms) {
  if (!Unreachable(outcome) || min_ms_ == 0) {
    if (skip_until_ms_.load(std::memory_order_relaxed) != 0) {
      skip_until_ms_.store(0, std::memory_order_relaxed);
      skip_ms_.store(0, std::memory_order_relaxed);
    }
    return;
  }
  const uint64_t last = skip_ms_.load(std::memory_order_relaxed);
  const uint64_t next = last == 0 ? min_ms_ : std::min(last * 2, max_ms_);
  skip_ms_.store(next, std::memory_order_relaxed);
  skip_until_ms_.store(now_ms + static_cast<int64_t>(next), std::memory_order_relaxed);
}

}  // namespace kvtier
