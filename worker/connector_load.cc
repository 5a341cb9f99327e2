// The connector's load (onboard) path: StartLoad runs Load on its own
// thread; Load moves the request's store blocks through the load half of the
// staging memory (BeginGet, RMA, checksum in the data client) and scatters
// them into pool pages, which become cached and pinned for the request;
// WaitForLoad hands over the outcome.
#include "worker/connector.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvtier::worker {

void KvConnector::StartLoad(uint64_t request) {
  std::lock_guard lk(mu_);
  auto it = requests_.find(request);
  if (it == requests_.end()) return;
  it->second->load = std::async(std::launch::async, [this, request] { return Load(request); });
}

absl::StatusOr<uint32_t> KvConnector::WaitForLoad(uint64_t request) {
  std::future<absl::StatusOr<uint32_t>> f;
  {
    std::lock_guard lk(mu_);
    auto it = requests_.find(request);
    if (it == requests_.end()) return absl::NotFoundError(absl::StrCat("no request ", request));
    if (!it->second->load.valid()) return 0u;
    f = std::move(it->second->load);
  }
  return f.get();
}

absl::StatusOr<uint32_t> KvConnector::Load(uint64_t request) {
  Request* r;
  {
    std::lock_guard lk(mu_);
    r = requests_.at(request).get();
  }
  if (r->store_blocks == 0 || !store_) return 0u;
  {
    std::lock_guard sl(stats_mu_);
    stats_.loads++;
  }
  const uint64_t bb = layout_.block_bytes();
  uint32_t done = 0;
  absl::Status failure = absl::OkStatus();
  while (done < r->store_blocks) {
    const size_t n = std::min<uint64_t>(r->store_blocks - done, options_.staging_blocks);
    std::vector<uint32_t> slots;
    {
      std::unique_lock lk(staging_mu_);
      if (!AcquireStagingLocked(lk, n, options_.data.deadline_ms, &slots, /*for_load=*/true)) {
        failure = absl::ResourceExhaustedError("no staging memory for the load before its deadline");
        break;
      }
    }
    std::vector<uint32_t> pages;
    for (size_t i = 0; i < n; ++i) {
      auto p = pool_->Allocate();
      if (!p) break;
      pages.push_back(*p);
    }
    std::vector<GetBlock> want;
    for (size_t i = 0; i < pages.size(); ++i) {
      want.push_back({r->chain[r->gpu_blocks + done + i], Slot(slots[i])});
    }
    auto got = want.empty() ? absl::StatusOr<GetOutcome>(GetOutcome{})
                            : store_->Get(ns_, bb, want);
    uint32_t m = got.ok() ? std::min<uint32_t>(got->blocks, static_cast<uint32_t>(pages.size())) : 0;
    if (got.ok()) r->loaded_from_disk += std::min(got->from_disk, m);
    if (m > 0) {
      std::vector<const uint8_t*> src;
      for (uint32_t i = 0; i < m; ++i) src.push_back(Slot(slots[i]));
      gpu::ScatterCpu(layout_, const_cast<uint8_t* const*>(pool_->layer_bases()), pages.data(), m,
                      src.data());
    }
    std::vector<BlockHash> stored;
    for (uint32_t i = 0; i < pages.size(); ++i) {
      if (i < m) {
        const BlockHash& h = r->chain[r->gpu_blocks + done + i];
        r->pages.push_back(pool_->Commit(h, pages[i]));
        NoteStored(h);
        stored.push_back(h);
      } else {
        pool_->Discard(pages[i]);
      }
    }
    ReleaseStaging(slots);
    PublishStored(stored);
    done += m;
    if (!got.ok()) {
      failure = got.status();
      break;
    }
    if (m < n) break;  // the store lost some, or the pool is full: compute the rest
  }
  r->loaded = done;
  std::lock_guard sl(stats_mu_);
  stats_.loaded_blocks += done;
  if (!failure.ok()) {
    stats_.load_failures++;
    if (done == 0) return failure;
  }
  return done;
}

}  // namespace kvtier::worker
