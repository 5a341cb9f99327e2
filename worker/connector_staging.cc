// The connector's staging memory: one registered allocation of
// 2 x staging_blocks block buffers, split into an offload half and a load
// half so that neither direction can starve the other, and the bounded waits
// for slots of either half.
#include "worker/connector.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvtier::worker {

absl::Status KvConnector::InitStaging() {
  const uint64_t bb = wire_bytes_;
  // aligned_alloc wants a multiple of the alignment; page alignment suits
  // RMA registration.
  const size_t staging_bytes = (2 * options_.staging_blocks * bb + 4095) / 4096 * 4096;
  staging_ = static_cast<uint8_t*>(std::aligned_alloc(4096, staging_bytes));
  if (staging_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", staging_bytes,
                                                     " bytes of staging memory (staging_blocks ",
                                                     options_.staging_blocks, ")"));
  }
  std::memset(staging_, 0, staging_bytes);
  // Slots are handed out from the back: lowest first.
  for (uint64_t i = options_.staging_blocks; i-- > 0;) {
    free_slots_.push_back(static_cast<uint32_t>(i));
    load_free_slots_.push_back(static_cast<uint32_t>(options_.staging_blocks + i));
  }
  if (store_) return store_->RegisterMemory(staging_, staging_bytes);
  return absl::OkStatus();
}

bool KvConnector::AcquireStagingLocked(std::unique_lock<std::mutex>& lk, size_t n, int wait_ms,
                                       std::vector<uint32_t>* slots, bool for_load) {
  auto& free = for_load ? load_free_slots_ : free_slots_;
  bool ok = staging_cv_.wait_for(lk, std::chrono::milliseconds(wait_ms),
                                 [&] { return stop_ || free.size() >= n; });
  if (!ok || stop_) return false;
  for (size_t i = 0; i < n; ++i) {
    slots->push_back(free.back());
    free.pop_back();
  }
  std::lock_guard sl(stats_mu_);
  stats_.staging_in_use = options_.staging_blocks - free_slots_.size();
  stats_.staging_peak = std::max(stats_.staging_peak, stats_.staging_in_use);
  stats_.load_staging_peak =
      std::max(stats_.load_staging_peak, options_.staging_blocks - load_free_slots_.size());
  return true;
}

void KvConnector::ReleaseStaging(const std::vector<uint32_t>& slots) {
  {
    std::lock_guard lk(staging_mu_);
    for (uint32_t s : slots) {
      (s < options_.staging_blocks ? free_slots_ : load_free_slots_).push_back(s);
    }
    std::lock_guard sl(stats_mu_);
    stats_.staging_in_use = options_.staging_blocks - free_slots_.size();
  }
  staging_cv_.notify_all();
  offload_cv_.notify_all();  // held pages wait for offload slots
}

}  // namespace kvtier::worker
