// The connector's save and offload path: Save makes computed pages matchable
// and, under write-through, stages them for the store; WriteBack stages pages
// the pool evicts under write-back. Staging copies the bytes out at once and
// never waits (a full offload half drops the oldest queued save). Staged
// blocks sit in the offload half of the staging memory until OffloadLoop,
// the one background thread, writes them in batches (BeginPut, then the
// bytes and CommitPut); WaitForSave and Drain wait for that, nothing else
// does.
#include "worker/connector.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <future>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/elapsed.h"
#include "common/log.h"

namespace kvtier::worker {

// An offload that took this long is logged with where its time went.
constexpr double kSlowOffloadMs = 1000;
// A batch with blocks busy under another put is put again this many times,
// this far apart (OffloadLoop).
constexpr int kBusyRetries = 3;
constexpr std::chrono::milliseconds kBusyRetryAfter{50};

void KvConnector::SaveStarted(const std::shared_ptr<SaveState>& waiter) {
  if (!waiter) return;
  std::lock_guard lk(mu_);
  waiter->pending++;
}

void KvConnector::SaveEnded(const std::shared_ptr<SaveState>& waiter, const absl::Status& s) {
  if (waiter) {
    std::lock_guard lk(mu_);
    waiter->pending--;
    if (!s.ok() && waiter->status.ok()) waiter->status = s;
  }
  drained_cv_.notify_all();
}

void KvConnector::NoteOffloadFailed(size_t blocks, const char* what, const absl::Status& s) {
  uint64_t failures_to_log = 0;  // a failure is counted always, logged at most once a second
  {
    std::lock_guard sl(stats_mu_);
    stats_.offload_batches++;
    stats_.offload_failures += blocks;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_failure_logged_ >= std::chrono::seconds(1)) {
      last_failure_logged_ = now;
      failures_to_log = stats_.offload_failures;
    }
  }
  if (failures_to_log > 0) {
    Log("worker", what, " of ", blocks, " blocks failed (", failures_to_log,
        " failed so far): ", s.ToString());
  }
}

void KvConnector::WriteBack(const BlockHash& h, uint32_t page) {
  // On an allocation's path: a page being evicted is copied out only if a
  // staging slot is free now, else its offload is dropped (counted).
  if (store_ && options_.offload == "write-back" && !KnownStored(h)) {
    StageForOffload(h, page, nullptr, /*wait_ms=*/0);
  }
}

bool KvConnector::StageForOffload(const BlockHash& hash, uint32_t page,
                                  const std::shared_ptr<SaveState>& waiter, int wait_ms) {
  SaveStarted(waiter);
  uint32_t slot = 0;
  bool have_slot = false;
  std::optional<Staged> dropped;
  {
    std::unique_lock lk(staging_mu_);
    if (waiter) {
      have_slot = AcquireSaveSlotLocked(lk, wait_ms, waiter.get(), &slot, &dropped);
    } else {  // write-back: a free slot now or nothing
      std::vector<uint32_t> got;
      have_slot = AcquireStagingLocked(lk, 1, wait_ms, &got);
      if (have_slot) slot = got[0];
    }
  }
  if (dropped) SaveEnded(dropped->waiter);
  if (!have_slot) {
    {
      std::lock_guard sl(stats_mu_);
      stats_.offload_dropped_full++;
    }
    SaveEnded(waiter);
    return false;
  }
  const auto gather_start = std::chrono::steady_clock::now();
  absl::Status gathered = GatherInto(page, Slot(slot));
  {
    std::lock_guard sl(stats_mu_);
    stats_.offload_gather_ms += MsSince(gather_start);
    if (!gathered.ok()) stats_.offload_failures++;
  }
  if (!gathered.ok()) {
    Log("worker", "copying page ", page, " out for the store failed: ", gathered.ToString());
    ReleaseStaging({slot});
    SaveEnded(waiter);
    return false;
  }
  {
    std::lock_guard lk(staging_mu_);
    offload_queue_.push_back(Staged{hash, slot, waiter});
  }
  offload_cv_.notify_one();
  return true;
}

absl::Status KvConnector::GatherInto(uint32_t page, uint8_t* dst) {
  if (packed_) {
    // Cannot fail: Create refused int8 for an 8-bit dtype.
    return gpu::GatherPackInt8Cpu(layout_, pool_->layer_bases(), &page, 1, &dst);
  }
  if (copier_) {
    return copier_->Copy(/*gather=*/true, layout_, memory_, 0, layout_.layers, &page, 1, &dst);
  }
  gpu::GatherCpu(layout_, memory_, &page, 1, &dst);
  return absl::OkStatus();
}

void KvConnector::HoldForOffload(const BlockHash& hash, uint32_t page,
                                 const std::shared_ptr<SaveState>& waiter) {
  SaveStarted(waiter);
  pool_->Ref(page);  // before staging_mu_: the pool's eviction callback takes staging_mu_
  const uint64_t max_held =
      options_.max_held_pages > 0 ? options_.max_held_pages : options_.num_pages;
  bool over = false;
  {
    std::lock_guard lk(staging_mu_);
    held_.push_back(Held{hash, page, waiter});
    over = held_.size() > max_held;
  }
  if (over) DropOldestHeld();
}

bool KvConnector::WaitForGathers() {
  std::unique_lock lk(staging_mu_);
  if (gathering_ == 0) return false;
  // Bounded: the copy waits on nothing; the bound only keeps a wedged
  // offloader from holding a request forever.
  staging_cv_.wait_for(lk, std::chrono::seconds(1), [&] { return gathering_ == 0 || stop_; });
  return true;
}

bool KvConnector::DropOldestHeld() {
  std::optional<Held> dropped;
  {
    std::lock_guard lk(staging_mu_);
    if (held_.empty()) return false;
    // The oldest request's saves go, from its chain's tail: what stays in
    // the store of a chain is still a prefix of it, which is what lookups
    // find.
    const SaveState* oldest = held_.front().waiter.get();
    auto it = held_.end();
    do {
      --it;
    } while (it != held_.begin() && it->waiter.get() != oldest);
    dropped = std::move(*it);
    held_.erase(it);
  }
  pool_->Unref(dropped->page);
  {
    std::lock_guard sl(stats_mu_);
    stats_.offload_dropped_full++;
  }
  SaveEnded(dropped->waiter);
  return true;
}

std::vector<KvConnector::Staged> KvConnector::GatherHeld(std::vector<Held> held,
                                                         const std::vector<uint32_t>& slots) {
  std::vector<Staged> out;
  const auto gather_start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < held.size(); ++i) {
    // Pool mode: host memory, packed or copied here; neither can fail.
    GatherInto(held[i].page, Slot(slots[i])).IgnoreError();
    pool_->Unref(held[i].page);
    out.push_back(Staged{held[i].hash, slots[i], std::move(held[i].waiter)});
  }
  {
    std::lock_guard lk(staging_mu_);
    gathering_ -= held.size();
  }
  staging_cv_.notify_all();
  std::lock_guard sl(stats_mu_);
  stats_.offload_gather_ms += MsSince(gather_start);
  return out;
}

absl::Status KvConnector::SaveFrom(uint64_t request, uint32_t first_block,
                                   const std::vector<uint32_t>& pages, bool skip_known,
                                   std::optional<int> wait_ms) {
  auto found = Find(request, /*engine_mode=*/true);
  if (!found.ok()) return found.status();
  Request* r = *found;
  if (uint64_t{first_block} + pages.size() > r->chain.size()) {
    return absl::InvalidArgumentError(absl::StrCat("blocks [", first_block, ", ",
                                                   uint64_t{first_block} + pages.size(),
                                                   ") are beyond the request's ", r->chain.size()));
  }
  if (auto s = CheckPages(pages); !s.ok()) return s;
  {
    std::lock_guard sl(stats_mu_);
    stats_.computed_blocks += pages.size();
  }
  if (!store_) return absl::OkStatus();
  // Every block asked for goes to the store, which answers what it holds
  // already (not sent again): the engine's scheduler asked it whether it
  // lacks them, and a hint of this process's (the store restarted or
  // evicted since) would leave the store without them for good. Only a
  // caller that asks (a drain's sweep of the whole cache) skips blocks this
  // process saw stored.
  std::vector<BlockHash> hashes;
  std::vector<uint32_t> todo;   // pages of the blocks to save
  std::vector<uint32_t> index;  // their block numbers
  for (size_t i = 0; i < pages.size(); ++i) {
    if (skip_known && KnownStored(r->chain[first_block + i])) {
      std::lock_guard sl(stats_mu_);
      stats_.offload_skipped_known++;
      continue;
    }
    hashes.push_back(r->chain[first_block + i]);
    todo.push_back(pages[i]);
    index.push_back(first_block + static_cast<uint32_t>(i));
  }
  // The engine reuses its pages once this returns: each block is copied
  // out now, into the store's own slots where it is mapped here, else into
  // the staging (waiting for a slot if the save is larger than the staging,
  // as vLLM's own save blocks its step until copied).
  const size_t in_place = copier_ && !packed_ ? SaveInPlace(hashes, todo, r->saves) : 0;
  for (size_t i = in_place; i < todo.size(); ++i) {
    const int wait = wait_ms ? std::max(*wait_ms, 0) : options_.data.deadline_ms;
    if (!StageForOffload(hashes[i], todo[i], r->saves, wait)) {
      std::lock_guard sl(stats_mu_);
      stats_.offload_no_staging += todo.size() - i;
      return absl::ResourceExhaustedError(
          absl::StrCat("no staging memory for block ", index[i], " within ", wait,
                       " ms (the store is taking offloads slower than they come): it and the ",
                       todo.size() - i - 1, " blocks after it are not saved"));
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
      HoldForOffload(h, page, r->saves);
    }
  }
  // The offloader wakes once the request's blocks are all queued: they go
  // to the store as one batch (one reservation), not one by one.
  offload_cv_.notify_one();
  {
    std::lock_guard sl(stats_mu_);
    stats_.computed_blocks += r->computed.size();
  }
  r->computed.clear();
  PublishStored(stored);
  return absl::OkStatus();
}

absl::Status KvConnector::WaitForSave(uint64_t request) {
  std::unique_lock lk(mu_);
  auto it = requests_.find(request);
  if (it == requests_.end()) return absl::NotFoundError(absl::StrCat("no request ", request));
  std::shared_ptr<SaveState> saves = it->second->saves;
  drained_cv_.wait(lk, [&] { return saves->pending == 0; });
  return saves->status;
}

void KvConnector::OffloadLoop() {
  // Offloads are usually nobody's critical path: they yield the CPU to
  // loads and to the engine (nice 10 for this thread by default; the
  // transfer lanes already serve loads first). A prefill engine's are its
  // decode's: options_.offload_nice 0. (Lowering a nice the process does not
  // have needs CAP_SYS_NICE; refused, the thread keeps the process's.)
  setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), options_.offload_nice);
  const uint64_t bb = wire_bytes_;
  for (;;) {
    std::vector<Staged> batch;
    std::vector<Held> held;
    std::vector<uint32_t> held_slots;
    bool started = false;  // from idle: a save waiting for a slot times its stall from now
    {
      std::unique_lock lk(staging_mu_);
      offload_cv_.wait(lk, [&] {
        return stop_ || !offload_queue_.empty() || (!held_.empty() && !free_slots_.empty());
      });
      if (offload_queue_.empty() && (held_.empty() || stop_)) return;
      while (!offload_queue_.empty() && batch.size() < options_.offload_batch) {
        batch.push_back(offload_queue_.front());
        offload_queue_.pop_front();
      }
      // Held pages are copied out here, off every request's path, into the
      // slots free now.
      while (batch.empty() && !held_.empty() && !free_slots_.empty() &&
             held.size() < options_.offload_batch) {
        held.push_back(std::move(held_.front()));
        held_.pop_front();
        held_slots.push_back(free_slots_.back());
        free_slots_.pop_back();
      }
      if (offloads_running_ == 0 && !(batch.empty() && held.empty())) {
        offload_progress_ = std::chrono::steady_clock::now();
        started = true;
      }
      offloads_running_ += batch.size() + held.size();
      gathering_ += held.size();
      std::lock_guard sl(stats_mu_);
      stats_.staging_in_use = options_.staging_blocks - free_slots_.size();
      stats_.staging_peak = std::max(stats_.staging_peak, stats_.staging_in_use);
    }
    if (started) staging_cv_.notify_all();
    if (!held.empty()) batch = GatherHeld(std::move(held), held_slots);
    std::vector<PutBlock> blocks;
    for (const auto& s : batch) blocks.push_back({s.hash, Slot(s.slot)});
    absl::Status st = absl::OkStatus();
    const auto put_start = std::chrono::steady_clock::now();
    EnsureRegistered().IgnoreError();  // a failure shows in the put's status
    auto r = store_->Put(ns_, bb, blocks);
    if (ForgotNamespace(r.status())) r = store_->Put(ns_, bb, blocks);
    // Blocks busy under another put may be under one this connector gave
    // up on (an in-place reservation past its budget, its AbortPut still
    // on its way to a store that was stalled): nobody would commit them.
    // Asked again once the abort had time to land; a real writer's blocks
    // are then present (or still busy: left to it).
    for (int again = 0; again < kBusyRetries && r.ok() && r->busy > 0; ++again) {
      std::this_thread::sleep_for(kBusyRetryAfter);
      auto retried = store_->Put(ns_, bb, blocks);
      if (!retried.ok()) break;
      r->written += retried->written;
      r->busy = retried->busy;
      r->no_space = retried->no_space;
      r->round_trips += retried->round_trips;
      r->bytes_sent += retried->bytes_sent;
      r->times += retried->times;
    }
    if (!r.ok()) st = r.status();
    if (r.ok()) {
      std::lock_guard sl(stats_mu_);
      stats_.offload_batches++;
      stats_.offload_round_trips += r->round_trips;
      stats_.offloaded_bytes += r->bytes_sent;
      stats_.offloaded_blocks += r->written;
      stats_.offload_no_space += r->no_space;
      stats_.offload_busy += r->busy;
      stats_.offload_times += r->times;
      stats_.offload_skipped_known += r->already_present;
    } else {
      NoteOffloadFailed(batch.size(), "offload", r.status());
    }
    const double put_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - put_start)
            .count();
    if (r.ok() && put_ms >= kSlowOffloadMs) {
      // Nobody waits on an offload but a decode on a P/D fence, and a
      // lookup misses blocks until it ends: a slow one is said.
      Log("worker", "offload of ", batch.size(), " blocks took ", static_cast<int64_t>(put_ms),
          " ms (control ", static_cast<int64_t>(r->times.control_ms), ", lane queue ",
          static_cast<int64_t>(r->times.queue_ms), ", transfer ",
          static_cast<int64_t>(r->times.rma_ms), ")");
    }
    if (r.ok() && (r->no_space > 0 || r->busy > 0)) {
      // Not written, yet no failure: said (once a second at most), since
      // a lookup will not find them.
      bool say = false;
      {
        std::lock_guard sl(stats_mu_);
        const auto now = std::chrono::steady_clock::now();
        if (now - last_failure_logged_ >= std::chrono::seconds(1)) {
          last_failure_logged_ = now;
          say = true;
        }
      }
      if (say) {
        Log("worker", "offload of ", batch.size(), " blocks: the store wrote ", r->written,
            "; no room for ", r->no_space, ", ", r->busy,
            " busy under another writer's reservation");
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
        if (!s.waiter) continue;
        s.waiter->pending--;
        if (!st.ok() && s.waiter->status.ok()) s.waiter->status = st;
      }
    }
    {
      std::lock_guard lk(staging_mu_);
      offloads_running_ -= batch.size();
      offload_progress_ = std::chrono::steady_clock::now();
    }
    drained_cv_.notify_all();
  }
}

}  // namespace kvtier::worker
