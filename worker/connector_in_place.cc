// Saves straight into a same-host store's mapped slots (engine mode, a page
// copier): SaveInPlace reserves each run's slots (BeginPut within
// reserve_budget_ms) and gathers the pages into them while the next run's
// reservation is asked for; the committer threads (CommitLoop) commit each
// run. A store that does not reserve in time gets the rest of the save
// through the staging (connector_offload.cc).
#include "worker/connector.h"

#include <algorithm>
#include <future>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/elapsed.h"
#include "common/log.h"

namespace kvtier::worker {

size_t KvConnector::SaveInPlace(const std::vector<BlockHash>& hashes,
                                const std::vector<uint32_t>& pages,
                                const std::shared_ptr<SaveState>& waiter) {
  // Registering the namespace takes the client's whole deadline when the
  // store does not answer: the offloader does it, off the engine's step.
  if (!registered_.load()) return 0;
  const size_t per_run = std::max<uint64_t>(1, options_.offload_batch);
  // Each run's reservation is asked for while the run before it gathers,
  // so the step waits for the first round trip only.
  auto reserve = [this, &hashes, per_run](size_t from) {
    std::vector<BlockHash> run(
        hashes.begin() + static_cast<long>(from),
        hashes.begin() + static_cast<long>(std::min(hashes.size(), from + per_run)));
    return std::async(std::launch::async, [this, run = std::move(run)] {
      const std::chrono::milliseconds budget(options_.reserve_budget_ms);
      auto res = store_->Reserve(ns_, wire_bytes_, run, budget);
      if (!res.ok() && ForgotNamespace(res.status())) {
        res = store_->Reserve(ns_, wire_bytes_, run, budget);
      }
      return res;
    });
  };
  std::future<absl::StatusOr<Reservation>> next;
  if (!hashes.empty()) next = reserve(0);
  // A reservation asked for and not used gives its slots back.
  absl::Cleanup abort_unused = [&] {
    if (!next.valid()) return;
    auto unused = next.get();
    if (unused.ok()) store_->Abort(*unused);
  };
  size_t done = 0;
  while (done < hashes.size()) {
    const size_t n = std::min(hashes.size() - done, per_run);
    std::vector<BlockHash> run(hashes.begin() + static_cast<long>(done),
                               hashes.begin() + static_cast<long>(done + n));
    auto res = next.get();
    if (!res.ok()) break;  // staged instead: that path never waits on the store
    if (done + n < hashes.size()) next = reserve(done + n);
    if (!ReachArenas(BlockViews{{}, {}, 0, res->regions}).ok()) {
      store_->Abort(*res);
      break;
    }
    std::vector<uint32_t> gather_pages;
    std::vector<uint8_t*> slots;
    for (size_t i = 0; i < n; ++i) {
      if (res->slots[i] == nullptr) continue;
      gather_pages.push_back(pages[done + i]);
      slots.push_back(res->slots[i]);
    }
    const auto gather_start = std::chrono::steady_clock::now();
    absl::Status gathered =
        slots.empty() ? absl::OkStatus()
                      : copier_->Copy(/*gather=*/true, layout_, memory_, 0, layout_.layers,
                                      gather_pages.data(), slots.size(), slots.data());
    {
      std::lock_guard sl(stats_mu_);
      stats_.offload_gather_ms += MsSince(gather_start);
      stats_.offload_skipped_known += res->already_present;
    }
    if (!gathered.ok()) {
      store_->Abort(*res);
      Log("worker", "copying ", slots.size(),
          " pages into the store's slots failed: ", gathered.ToString());
      break;  // the staged path copies them, or reports the same failure
    }
    if (res->no_space > 0) {
      // As a staged put's: which blocks found no room is for the waiter to hear.
      std::lock_guard lk(mu_);
      if (waiter && waiter->status.ok()) {
        waiter->status = absl::ResourceExhaustedError(
            absl::StrCat("the store had no room for ", res->no_space, " of ", n, " blocks"));
      }
    }
    for (size_t i = 0; i < n; ++i) {
      if (res->slots[i] == nullptr && res->no_space == 0 && res->busy == 0) NoteStored(run[i]);
    }
    if (!slots.empty()) {
      SaveStarted(waiter);
      {
        std::lock_guard lk(staging_mu_);
        commit_queue_.push_back(InPlaceCommit{std::move(*res), std::move(run), waiter});
        commits_running_++;
      }
      commit_cv_.notify_one();
    }
    done += n;
  }
  return done;
}

void KvConnector::CommitLoop() {
  for (;;) {
    InPlaceCommit job;
    {
      std::unique_lock lk(staging_mu_);
      commit_cv_.wait(lk, [&] { return stop_ || !commit_queue_.empty(); });
      if (commit_queue_.empty()) return;  // stopped with nothing left
      job = std::move(commit_queue_.front());
      commit_queue_.pop_front();
    }
    const Reservation& res = job.reservation;
    std::vector<const uint8_t*> filled;
    std::vector<size_t> which;
    for (size_t i = 0; i < res.slots.size(); ++i) {
      if (res.slots[i] == nullptr) continue;
      filled.push_back(res.slots[i]);
      which.push_back(i);
    }
    // Empty: the store hashes the slots as they are (one pass, not two).
    std::vector<uint64_t> checksums;
    const auto start = std::chrono::steady_clock::now();
    if (!options_.in_place_store_hashes) {
      const std::vector<uint64_t> sums = SumBlocks(filled, wire_bytes_, kCommitSumThreads);
      checksums.assign(res.slots.size(), 0);
      for (size_t k = 0; k < which.size(); ++k) checksums[which[k]] = sums[k];
    }
    const double sum_ms = MsSince(start);
    const auto commit_start = std::chrono::steady_clock::now();
    auto committed = store_->Commit(res, checksums);
    const double commit_ms = MsSince(commit_start);
    if (!committed.ok()) {
      NoteOffloadFailed(filled.size(), "in-place commit", committed.status());
    } else {
      {
        std::lock_guard sl(stats_mu_);
        stats_.offload_batches++;
        stats_.offload_round_trips += 2;  // BeginPut's, CommitPut's
        stats_.offloaded_bytes += uint64_t{filled.size()} * wire_bytes_;
        stats_.offloaded_blocks += *committed;
        stats_.in_place_saved += *committed;
        stats_.offload_times.control_ms += res.control_ms + commit_ms;
        stats_.offload_times.checksum_ms += sum_ms;
      }
      for (size_t i : which) NoteStored(job.hashes[i]);
    }
    {
      std::lock_guard lk(staging_mu_);
      commits_running_--;
    }
    SaveEnded(job.waiter, committed.status());
  }
}

}  // namespace kvtier::worker
