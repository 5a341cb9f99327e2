// Leaving without losing the cache: Drain waits for every queued save (and
// drops, ending each, what the store has not taken by its deadline);
// SaveHot (pool mode) queues the pool's most valuable blocks the store is
// not known to hold, within a byte budget and a deadline, and drains.
#include "worker/connector.h"

#include <algorithm>
#include <future>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/elapsed.h"
#include "common/log.h"

namespace kvtier::worker {

bool KvConnector::Drain(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock lk(staging_mu_);
  // drained_cv_ is notified under mu_ changes too; poll briefly to stay simple.
  while (!offload_queue_.empty() || !held_.empty() || offloads_running_ > 0 ||
         commits_running_ > 0) {
    if (std::chrono::steady_clock::now() >= deadline) {
      // What the offloader has not taken goes: the caller is leaving.
      std::vector<uint32_t> slots;
      std::vector<std::shared_ptr<SaveState>> waiters;
      for (const Staged& st : offload_queue_) {
        slots.push_back(st.slot);
        waiters.push_back(st.waiter);
      }
      const size_t dropped = offload_queue_.size();
      offload_queue_.clear();
      lk.unlock();
      ReleaseStaging(slots);
      // Each dropped save ends (failed), so no WaitForSave waits for it.
      for (const auto& w : waiters) {
        SaveEnded(w, absl::AbortedError("the save was dropped: the connector drained past its "
                                        "deadline before the store took it"));
      }
      {
        std::lock_guard sl(stats_mu_);
        stats_.offload_dropped_full += dropped;
      }
      lk.lock();
      // The batch in flight and its commit end within the store's deadline:
      // once this returns nothing more reaches the store.
      while (offloads_running_ > 0 || commits_running_ > 0) {
        lk.unlock();
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        lk.lock();
      }
      return false;
    }
    lk.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    lk.lock();
  }
  return true;
}

absl::StatusOr<KvConnector::HotSave> KvConnector::SaveHot(
    uint64_t max_bytes, std::chrono::steady_clock::time_point deadline) {
  if (!pool_) {
    return absl::FailedPreconditionError(
        "SaveHot: the engine owns its pages (engine mode); it saves its own blocks");
  }
  const auto start = std::chrono::steady_clock::now();
  HotSave out;
  const std::vector<PagePool::CachedBlock> blocks = pool_->CachedByValue();
  out.cached = blocks.size();
  if (!store_) {
    out.stopped = "no store";
    return out;
  }
  std::vector<BlockHash> queued;
  for (const PagePool::CachedBlock& b : blocks) {
    if (KnownStored(b.hash)) {
      out.known++;
      continue;
    }
    if (out.bytes + wire_bytes_ > max_bytes) {
      out.stopped = "bytes";
      break;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      out.stopped = "time";
      break;
    }
    if (!pool_->RefIfHolds(b.page, b.hash)) continue;  // gone meanwhile
    // A free staging slot within the time left (the write-back path: it
    // never takes another save's slot).
    const int wait_ms = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count());
    const bool staged = StageForOffload(b.hash, b.page, nullptr, std::max(wait_ms, 1));
    pool_->Unref(b.page);
    if (!staged) {
      out.stopped = "time";
      break;
    }
    queued.push_back(b.hash);
    out.queued++;
    out.bytes += wire_bytes_;
  }
  // Until the offloader has written them, or the deadline.
  if (!Drain(deadline)) out.stopped = "time";
  for (const BlockHash& h : queued) out.saved += KnownStored(h);
  if (out.stopped.empty() && out.saved < out.queued) out.stopped = "store";
  out.ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return out;
}

}  // namespace kvtier::worker
