// When a store shard may be called: after a call that found it unreachable
// (UNAVAILABLE or DEADLINE_EXCEEDED) it is skipped for min_ms, the skip
// doubling up to max_ms while it keeps failing; when a skip ends, the first
// caller probes it (the others keep skipping until the probe answers, or
// for probe_hold_ms at most); any other outcome ends the skipping. Time is
// the caller's (milliseconds on a steady clock), so the rules are tested
// without sleeping. Thread-safe (lock-free).
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"

namespace kvtier {

class ShardSkip {
 public:
  // min_ms 0: never skip.
  ShardSkip(uint64_t min_ms, uint64_t max_ms, uint64_t probe_hold_ms)
      : min_ms_(min_ms),
        max_ms_(max_ms < min_ms ? min_ms : max_ms),
        probe_hold_ms_(probe_hold_ms) {}

  // True when the shard may be called at now_ms (not skipped, or this call
  // is the probe); else false with the milliseconds left in *left_ms.
  bool Admit(int64_t now_ms, int64_t* left_ms);
  // Records a call's outcome at now_ms.
  void Note(const absl::Status& outcome, int64_t now_ms);
  // Whether `s` says the shard could not be reached.
  static bool Unreachable(const absl::Status& s) {
    return s.code() == absl::StatusCode::kUnavailable ||
           s.code() == absl::StatusCode::kDeadlineExceeded;
  }

 private:
  const uint64_t min_ms_, max_ms_, probe_hold_ms_;
  std::atomic<int64_t> skip_until_ms_{0};  // 0: not skipped
  std::atomic<uint64_t> skip_ms_{0};       // the last skip's length
};

}  // namespace kvtier
