// The connector's save and offload path: Save makes computed pages matchable
// and, under write-through, stages them for the store; WriteBack stages pages
// the pool evicts under write-back. Staged blocks sit in the offload half of
// the staging memory until OffloadLoop, the one background thread, writes
// them in batches (BeginPut, RMA, CommitPut); WaitForSave and Drain wait for
// that.
#include "worker/connector.h"

#include "absl/strings/str_cat.h"
#include "common/elapsed.h"

namespace kvtier::worker {

void KvConnector::WriteBack(const BlockHash& h, uint32_t page) {
  if (store_ && options_.offload == "write-back" && !KnownStored(h)) {
    StageForOffload(h, page, std::nullopt, options_.offload_wait_ms);
  }
}

bool KvConnector::StageForOffload(const BlockHash& hash, uint32_t page,
                                  std::optional<uint64_t> request, int wait_ms) {
  std::vector<uint32_t> slot;
  {
    std::unique_lock lk(staging_mu_);
    if (!AcquireStagingLocked(lk, 1, wait_ms, &slot)) {
      std::lock_guard sl(stats_mu_);
      stats_.offload_dropped_full++;
      return false;
    }
  }
  uint8_t* dst = Slot(slot[0]);
  const auto gather_start = std::chrono::steady_clock::now();
  if (packed_) {
    // Cannot fail: Create refused int8 for an 8-bit dtype.
    gpu::GatherPackInt8Cpu(layout_, pool_->layer_bases(), &page, 1, &dst).IgnoreError();
  } else {
    gpu::GatherCpu(layout_, memory_, &page, 1, &dst);
  }
  {
    std::lock_guard sl(stats_mu_);
    stats_.offload_gather_ms += MsSince(gather_start);
  }
  {
    std::lock_guard lk(staging_mu_);
    offload_queue_.push_back(Staged{hash, slot[0], request});
  }
  offload_cv_.notify_one();
  return true;
}

absl::Status KvConnector::SaveFrom(uint64_t request, uint32_t first_block,
                                   const std::vector<uint32_t>& pages) {
  auto found = Find(request, /*engine_mode=*/true);
  if (!found.ok()) return found.status();
  Request* r = *found;
  if (uint64_t{first_block} + pages.size() > r->chain.size()) {
    return absl::InvalidArgumentError(absl::StrCat("blocks [", first_block, ", ",
                                                   uint64_t{first_block} + pages.size(),
                                                   ") are beyond the request's ", r->chain.size()));
  }
  if (auto s = CheckPages(pages); !s.ok()) return s;
  if (!store_) return absl::OkStatus();
  for (size_t i = 0; i < pages.size(); ++i) {
    const BlockHash& h = r->chain[first_block + i];
    if (KnownStored(h)) {
      std::lock_guard sl(stats_mu_);
      stats_.offload_skipped_known++;
      continue;
    }
    {
      std::lock_guard lk(mu_);
      r->pending_saves++;
    }
    if (!StageForOffload(h, pages[i], request, options_.data.deadline_ms)) {
      std::lock_guard lk(mu_);
      r->pending_saves--;
      return absl::ResourceExhaustedError(
          absl::StrCat("no staging memory for block ", first_block + i, " before the deadline"));
    }
  }
  return absl::OkStatus();
}

absl::Status KvConnector::Save(uint64_t request) {
  auto found = Find(request, /*engine_mode=*/false);
  if (!found.ok()) return found.status();
  Request* r = *found;
  std::vector<BlockHash> stored;
  size_t first = r->pages.size();
  for (size_t i = 0; i < r->computed.size(); ++i) {
    const BlockHash& h = r->chain[first + i];
    uint32_t page = pool_->Commit(h, r->computed[i]);
    r->pages.push_back(page);
    stored.push_back(h);
    if (store_ && options_.offload == "write-through" && !KnownStored(h)) {
      {
        std::lock_guard lk(mu_);
        r->pending_saves++;
      }
      if (!StageForOffload(h, page, request, options_.data.deadline_ms)) {
        std::lock_guard lk(mu_);
        r->pending_saves--;
        r->save_status = absl::ResourceExhaustedError("no staging memory for write-through");
      }
    }
  }
  r->computed.clear();
  PublishStored(stored);
  return absl::OkStatus();
}

absl::Status KvConnector::WaitForSave(uint64_t request) {
  std::unique_lock lk(mu_);
  auto it = requests_.find(request);
  if (it == requests_.end()) return absl::NotFoundError(absl::StrCat("no request ", request));
  Request* r = it->second.get();
  drained_cv_.wait(lk, [&] { return r->pending_saves == 0; });
  return r->save_status;
}

void KvConnector::OffloadLoop() {
  const uint64_t bb = wire_bytes_;
  for (;;) {
    std::vector<Staged> batch;
    {
      std::unique_lock lk(staging_mu_);
      offload_cv_.wait(lk, [&] { return stop_ || !offload_queue_.empty(); });
      if (offload_queue_.empty()) return;
      while (!offload_queue_.empty() && batch.size() < options_.offload_batch) {
        batch.push_back(offload_queue_.front());
        offload_queue_.pop_front();
      }
      offloads_running_ += batch.size();
    }
    std::vector<PutBlock> blocks;
    for (const auto& s : batch) blocks.push_back({s.hash, Slot(s.slot)});
    absl::Status st = absl::OkStatus();
    EnsureRegistered().IgnoreError();  // a failure shows in the put's status
    auto r = store_->Put(ns_, bb, blocks);
    if (ForgotNamespace(r.status())) r = store_->Put(ns_, bb, blocks);
    if (!r.ok()) st = r.status();
    {
      std::lock_guard sl(stats_mu_);
      if (r.ok()) {
        stats_.offloaded_blocks += r->written;
        stats_.offload_times += r->times;
        stats_.offload_skipped_known += r->already_present;
      } else {
        stats_.offload_failures += batch.size();
      }
    }
    if (r.ok() && r->no_space > 0) {
      // Some blocks found no room: which ones is not reported, so none is
      // taken as stored, and a save waiting for them hears it.
      st = absl::ResourceExhaustedError(
          absl::StrCat("the store had no room for ", r->no_space, " of ", batch.size(), " blocks"));
    }
    if (r.ok() && r->no_space == 0 && r->busy == 0) {
      for (const auto& s : batch) NoteStored(s.hash);
    }
    std::vector<uint32_t> slots;
    for (const auto& s : batch) slots.push_back(s.slot);
    ReleaseStaging(slots);
    {
      std::lock_guard lk(mu_);
      for (const auto& s : batch) {
        if (!s.request) continue;
        auto it = requests_.find(*s.request);
        if (it == requests_.end()) continue;
        it->second->pending_saves--;
        if (!st.ok()) it->second->save_status = st;
      }
    }
    {
      std::lock_guard lk(staging_mu_);
      offloads_running_ -= batch.size();
    }
    drained_cv_.notify_all();
  }
}

void KvConnector::Drain() {
  std::unique_lock lk(staging_mu_);
  // drained_cv_ is notified under mu_ changes too; poll briefly to stay simple.
  while (!offload_queue_.empty() || offloads_running_ > 0) {
    lk.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    lk.lock();
  }
}

}  // namespace kvtier::worker
