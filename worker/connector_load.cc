// The connector's load (onboard) path. Begin has already pinned the blocks
// in the store (one BeginGet, connector.cc). StartLoad runs Load on a cached
// thread (common/thread_cache.h): pages are allocated, the blocks' bytes move by RMA straight into
// them layer by layer (int8 namespaces: into the load half of the staging
// memory, unpacked into the pages as each layer lands), every block is
// verified against its checksum, and the pages become cached and pinned for
// the request. The store's pin is released without a round trip on the
// request's path (client/store_data_client.h). WaitForLayer and WaitForLoad
// hand over progress and the outcome.
#include <algorithm>
#include <future>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/elapsed.h"
#include "common/log.h"
#include "worker/connector.h"

namespace kvtier::worker {

absl::Status KvConnector::StartLoadInto(uint64_t request, std::vector<uint32_t> pages) {
  auto found = Find(request, /*engine_mode=*/true);
  if (!found.ok()) return found.status();
  Request* r = *found;
  if (auto s = CheckPages(pages); !s.ok()) return s;
  std::vector<uint32_t> sorted = pages;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    return absl::InvalidArgumentError("a page is named twice in one load");
  }
  {
    std::lock_guard lk(mu_);
    if (r->load_started) {
      return absl::FailedPreconditionError(
          absl::StrCat("request ", request, " has already started its load"));
    }
    if (pages.size() > r->store_blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat(pages.size(), " pages for ", r->store_blocks, " blocks found in the store"));
    }
    r->store_blocks = static_cast<uint32_t>(pages.size());
    r->load_pages = std::move(pages);
  }
  return StartLoad(request);
}

absl::Status KvConnector::StartLoad(uint64_t request) {
  std::lock_guard lk(mu_);
  auto it = requests_.find(request);
  if (it == requests_.end()) return absl::NotFoundError(absl::StrCat("no request ", request));
  Request* r = it->second.get();
  if (r->load_started) {
    return absl::FailedPreconditionError(
        absl::StrCat("request ", request, " has already started its load"));
  }
  r->load_started = true;
  r->load = r->load_promise.get_future();
  r->load_claim = std::make_shared<std::atomic<bool>>(false);
  // On a cached thread (creating one per load costs up to milliseconds),
  // unless WaitForLoad claims it first.
  load_threads_.Run([this, r, claim = r->load_claim] { RunLoad(r, claim); });
  return absl::OkStatus();
}

void KvConnector::RunLoad(Request* r, const std::shared_ptr<std::atomic<bool>>& claim) {
  if (claim->exchange(true)) return;  // another thread runs it (r may be gone)
  auto got = Load(r);
  {
    std::lock_guard done(mu_);
    r->load_ended = true;
    r->load_status = got.status();
  }
  layers_cv_.notify_all();
  r->load_promise.set_value(std::move(got));
}

absl::Status KvConnector::WaitForLayer(uint64_t request, uint32_t layer) {
  if (layer >= layout_.layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " is outside the namespace's ", layout_.layers, " layers"));
  }
  std::unique_lock lk(mu_);
  auto it = requests_.find(request);
  if (it == requests_.end()) return absl::NotFoundError(absl::StrCat("no request ", request));
  Request* r = it->second.get();
  if (!r->load_started) return absl::OkStatus();
  layers_cv_.wait(lk, [&] { return r->layers_in > layer || r->load_ended; });
  if (r->layers_in > layer) return absl::OkStatus();
  return r->load_status;
}

absl::StatusOr<uint32_t> KvConnector::WaitForLoad(uint64_t request) {
  std::future<absl::StatusOr<uint32_t>> f;
  Request* r;
  {
    std::lock_guard lk(mu_);
    auto it = requests_.find(request);
    if (it == requests_.end()) return absl::NotFoundError(absl::StrCat("no request ", request));
    r = it->second.get();
    if (!r->load.valid()) return 0u;
    f = std::move(r->load);
  }
  // Not started by a cached thread yet: run it here instead of waiting.
  RunLoad(r, r->load_claim);
  return f.get();
}

LoadTimes KvConnector::LoadTimesOf(uint64_t request) {
  std::lock_guard lk(mu_);
  auto it = requests_.find(request);
  if (it == requests_.end() || !it->second->load_ended) return LoadTimes{};
  return it->second->load_times;
}

void KvConnector::ReportCorrupt(const std::vector<BlockHash>& blocks) {
  {
    // No longer known to be stored: the recompute saves them again.
    std::lock_guard lk(known_mu_);
    for (const BlockHash& h : blocks) known_.erase(h);
  }
  // Before the load's error reaches the engine, so its recompute's save
  // comes after the drop (and is not taken for "already present").
  auto dropped = store_->VerifyBlocks(ns_, blocks);
  if (dropped.ok()) {
    std::lock_guard sl(stats_mu_);
    stats_.corrupt_dropped += *dropped;
  }
}

void KvConnector::LayersIn(Request* r, uint32_t n) {
  {
    std::lock_guard lk(mu_);
    r->layers_in = std::max(r->layers_in, n);
  }
  layers_cv_.notify_all();
}

absl::StatusOr<uint32_t> KvConnector::Load(Request* r) {
  if (r->store_blocks == 0 || !store_) {
    if (store_) store_->Release(r->pin);
    return 0u;
  }
  {
    std::lock_guard sl(stats_mu_);
    stats_.loads++;
  }
  r->load_times.transfer.control_ms = r->pin.control_ms;
  // The engine's pages, or pages from the pool: a full pool loads fewer (the
  // engine computes the rest).
  std::vector<uint32_t> pages = r->load_pages;
  for (uint32_t i = 0; pool_ && i < r->store_blocks; ++i) {
    auto p = pool_->Allocate();
    if (!p) break;
    pages.push_back(*p);
  }
  absl::StatusOr<uint32_t> got = 0u;
  if (!pages.empty() && copier_ && !packed_) {
    got = LoadInPlace(r, pages);
    if (got.ok()) {
      std::lock_guard sl(stats_mu_);
      stats_.in_place_blocks += *got;
    } else if (got.status().code() == absl::StatusCode::kFailedPrecondition) {
      got = LoadStaged(r, pages);  // not mapped here: nothing moved yet
    }
  } else if (!pages.empty()) {
    got = packed_ ? LoadStaged(r, pages) : LoadDirect(r, pages);
  }
  store_->Release(r->pin);  // after every transfer, whatever the outcome
  const uint32_t done = got.ok() ? *got : r->loaded;
  if (!got.ok() && got.status().code() == absl::StatusCode::kDataLoss) {
    ReportCorrupt(std::vector<BlockHash>(r->chain.begin() + r->gpu_blocks + done,
                                         r->chain.begin() + r->gpu_blocks + pages.size()));
  }
  std::vector<BlockHash> stored;
  std::vector<uint32_t> committed;
  for (uint32_t i = 0; pool_ && i < pages.size(); ++i) {
    if (i < done) {
      const BlockHash& h = r->chain[r->gpu_blocks + i];
      committed.push_back(pool_->Commit(h, pages[i]));
      NoteStored(h);
      stored.push_back(h);
    } else {
      pool_->Discard(pages[i]);
    }
  }
  for (uint32_t i = 0; !pool_ && i < done; ++i) NoteStored(r->chain[r->gpu_blocks + i]);
  PublishStored(stored);
  {
    // Pages() and LoadedFromDisk() read these under mu_.
    std::lock_guard lk(mu_);
    r->pages.insert(r->pages.end(), committed.begin(), committed.end());
    r->loaded = done;
  }
  // A failed load reports no more layers: WaitForLayer answers its status
  // for every layer that had not come in.
  if (got.ok()) LayersIn(r, layout_.layers);
  std::lock_guard sl(stats_mu_);
  stats_.loaded_blocks += done;
  stats_.load_times += r->load_times;
  if (!got.ok()) {
    stats_.load_failures++;
    if (done == 0) return got.status();
  }
  return done;
}

absl::StatusOr<uint32_t> KvConnector::LoadDirect(Request* r, const std::vector<uint32_t>& pages) {
  // Layer l of a stored block is the page's K chunk then its V chunk in
  // layer l's memory: one segment per layer where they are adjacent (the
  // pool, vLLM's [num_pages][2]...), one per chunk otherwise.
  const uint64_t chunk = layout_.chunk_elems() * layout_.elem_bytes();
  const bool adjacent = memory_.KvAdjacent(layout_);
  const uint32_t per_layer = adjacent ? 1 : 2;
  ReadPlan plan;
  if (layout_.layers > 1 || !adjacent) {
    for (uint32_t s = 0; s <= layout_.layers * per_layer; ++s)
      plan.bounds.push_back(s * 2 * chunk / per_layer);
  }
  plan.dest = [&](size_t i, size_t seg) -> void* {
    const uint32_t layer = static_cast<uint32_t>(seg / per_layer);
    return seg % per_layer == 0 ? memory_.K(layer, pages[i]) : memory_.V(layer, pages[i]);
  };
  plan.on_segment = [&](size_t seg) {
    if ((seg + 1) % per_layer == 0) LayersIn(r, static_cast<uint32_t>((seg + 1) / per_layer));
  };
  auto got = store_->Read(r->pin, wire_bytes_, 0, static_cast<uint32_t>(pages.size()), plan);
  if (!got.ok()) return got.status();
  r->load_times.transfer += got->times;
  std::lock_guard lk(mu_);
  r->loaded_from_disk = got->from_disk;
  return got->blocks;
}

absl::Status KvConnector::ReachArenas(const BlockViews& views) {
  std::lock_guard lk(arenas_mu_);
  // An arena only this list still holds is no longer mapped by the store
  // client (the store restarted) and no load reads it: let it go.
  for (auto it = arenas_.begin(); it != arenas_.end();) {
    if (it->keep.use_count() == 1) {
      if (!it->refused) copier_->UnregisterHost(it->base);
      it = arenas_.erase(it);
    } else {
      ++it;
    }
  }
  for (const BlockViews::Region& region : views.regions) {
    auto known = std::find_if(arenas_.begin(), arenas_.end(),
                              [&](const ReachedArena& a) { return a.base == region.base; });
    if (known == arenas_.end()) {
      absl::Status s = copier_->RegisterHost(region.base, region.length);
      if (!s.ok()) {
        Log("worker", "the page copier cannot reach the store's mapped arena (", region.length,
            " bytes); loads go through staging: ", s.ToString());
      }
      known = arenas_.insert(arenas_.end(), ReachedArena{region.base, region.keep, !s.ok()});
    }
    if (known->refused) {
      return absl::FailedPreconditionError("the page copier cannot reach the store's arena");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> KvConnector::LoadInPlace(Request* r, const std::vector<uint32_t>& pages) {
  const auto n = static_cast<uint32_t>(pages.size());
  auto views = store_->View(r->pin, wire_bytes_, 0, n);
  if (!views.ok()) return views.status();
  if (auto s = ReachArenas(*views); !s.ok()) return s;
  // Checksums on other threads, beside the copy (host memory bandwidth is
  // shared by the two; the copy's reads go over the bus for a GPU).
  static const int kSumThreads =
      static_cast<int>(std::clamp(std::thread::hardware_concurrency() / 2, 1u, 8u));
  const auto start = std::chrono::steady_clock::now();
  auto verified =
      std::async(std::launch::async, [&] { return VerifyViews(*views, wire_bytes_, kSumThreads); });
  std::vector<uint8_t*> blocks;
  blocks.reserve(n);
  // The copier reads them only (a scatter); its interface is shared with gathers.
  for (const uint8_t* b : views->blocks) blocks.push_back(const_cast<uint8_t*>(b));
  absl::Status copied = copier_->Copy(/*gather=*/false, layout_, memory_, 0, layout_.layers,
                                      pages.data(), n, blocks.data());
  const double copy_ms = MsSince(start);
  const size_t good = verified.get();
  r->load_times.scatter_ms += copy_ms;
  r->load_times.transfer.checksum_ms += std::max(0.0, MsSince(start) - copy_ms);
  if (!copied.ok()) return copied;  // the copier's error: nothing counts as loaded
  std::lock_guard lk(mu_);
  r->loaded_from_disk += views->from_disk;
  if (good < n) {
    r->loaded = static_cast<uint32_t>(good);  // the verified leading blocks are kept
    return absl::DataLossError(absl::StrCat("block ", good, " of the load failed its checksum ",
                                            "in the store's mapped arena; not used"));
  }
  r->loaded = n;
  return n;
}

absl::StatusOr<uint32_t> KvConnector::LoadStaged(Request* r, const std::vector<uint32_t>& pages) {
  const uint64_t layer_bytes = packed_ ? layout_.packed_layer_bytes() : layout_.layer_page_bytes();
  const uint32_t total = static_cast<uint32_t>(pages.size());
  // In runs of at most staging_blocks; layers are reported in with the last run.
  for (uint32_t first = 0; first < total;) {
    const uint32_t n =
        static_cast<uint32_t>(std::min<uint64_t>(total - first, options_.staging_blocks));
    const bool last = first + n == total;
    std::vector<uint32_t> slots;
    const auto wait_start = std::chrono::steady_clock::now();
    {
      std::unique_lock lk(staging_mu_);
      if (!AcquireStagingLocked(lk, n, options_.data.deadline_ms, &slots, /*for_load=*/true)) {
        return absl::ResourceExhaustedError("no staging memory for the load before its deadline");
      }
    }
    r->load_times.staging_ms += MsSince(wait_start);
    ReadPlan plan;
    for (uint32_t l = 0; l <= layout_.layers; ++l) plan.bounds.push_back(l * layer_bytes);
    plan.dest = [&](size_t i, size_t layer) -> void* {
      return Slot(slots[i - first]) + layer * layer_bytes;
    };
    absl::Status copied = absl::OkStatus();
    double scatter_ms = 0;
    std::vector<uint8_t*> src;
    for (uint32_t slot : slots) src.push_back(Slot(slot));
    plan.on_segment = [&](size_t layer) {
      const auto t = std::chrono::steady_clock::now();
      const auto l = static_cast<uint32_t>(layer);
      absl::Status s = packed_ ? gpu::UnpackScatterInt8Cpu(layout_, l, l + 1, pool_->layer_bases(),
                                                           pages.data() + first, n, src.data())
                               : copier_->Copy(/*gather=*/false, layout_, memory_, l, l + 1,
                                               pages.data() + first, n, src.data());
      if (copied.ok()) copied = s;
      scatter_ms += MsSince(t);
      if (last && copied.ok()) LayersIn(r, l + 1);
    };
    auto got = store_->Read(r->pin, wire_bytes_, first, n, plan);
    ReleaseStaging(slots);
    r->load_times.scatter_ms += scatter_ms;
    if (!got.ok()) return got.status();
    if (!copied.ok()) return copied;
    r->load_times.transfer += got->times;
    first += n;
    std::lock_guard lk(mu_);
    r->loaded_from_disk += got->from_disk;
    r->loaded = first;  // runs before a failing one are verified and kept
  }
  return total;
}

}  // namespace kvtier::worker
