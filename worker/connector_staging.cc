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
  // The page copier's copies reach it too (pinned and mapped for a GPU).
  if (copier_) {
    if (auto s = copier_->RegisterHost(staging_, staging_bytes); !s.ok()) return s;
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

bool KvConnector::AcquireSaveSlotLocked(std::unique_lock<std::mutex>& lk, int wait_ms,
                                        const SaveState* waiter, uint32_t* slot,
                                        std::optional<Staged>* dropped) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
  for (;;) {
    if (stop_) return false;
    if (!free_slots_.empty()) {
      std::vector<uint32_t> got;
      AcquireStagingLocked(lk, 1, 0, &got);  // cannot fail: a slot is free
      *slot = got[0];
      return true;
    }
    const auto now = std::chrono::steady_clock::now();
    const auto stalled_at = offload_progress_ + StalledAfterLocked();
    if (offloads_running_ > 0 && now >= stalled_at) {
      if (offload_queue_.empty()) return false;
      // The oldest request's blocks go, from its chain's tail, as in
      // DropOldestHeld.
      const SaveState* oldest = offload_queue_.front().waiter.get();
      if (oldest == waiter) return false;
      auto it = offload_queue_.end();
      do {
        --it;
      } while (it != offload_queue_.begin() && it->waiter.get() != oldest);
      *slot = it->slot;
      *dropped = std::move(*it);
      offload_queue_.erase(it);
      std::lock_guard sl(stats_mu_);
      stats_.offload_dropped_full++;
      return true;
    }
    if (now >= give_up) return false;
    // Woken when a slot frees or the offloader takes a batch (its stamp);
    // looked at again within kOffloadStalled either way.
    staging_cv_.wait_until(
        lk, std::min(give_up, offloads_running_ > 0 ? stalled_at : now + kOffloadStalled));
  }
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
