#include "worker/connector.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace kvtier::worker {

namespace {
absl::StatusOr<gpu::Dtype> ToDtype(const std::string& d) {
  if (d == "fp16") return gpu::Dtype::kFp16;
  if (d == "bf16") return gpu::Dtype::kBf16;
  if (d.rfind("fp8", 0) == 0) return gpu::Dtype::kFp8;
  return absl::InvalidArgumentError(absl::StrCat("dtype \"", d, "\" is not fp16, bf16 or fp8"));
}
}  // namespace

absl::StatusOr<std::unique_ptr<KvConnector>> KvConnector::Create(ConnectorOptions o) {
  if (auto s = ValidateNamespace(o.spec); !s.ok()) return s;
  if (o.offload != "write-back" && o.offload != "write-through" && o.offload != "none") {
    return absl::InvalidArgumentError(absl::StrCat(
        "offload policy \"", o.offload, "\" is not write-back, write-through or none"));
  }
  if (o.staging_blocks == 0 || o.offload_batch == 0) {
    return absl::InvalidArgumentError("staging_blocks and offload_batch must be at least 1");
  }
  auto dtype = ToDtype(o.spec.dtype);
  if (!dtype.ok()) return dtype.status();
  std::unique_ptr<KvConnector> c(new KvConnector());
  c->options_ = o;
  c->layout_ = gpu::KvLayout{o.spec.layers,  o.spec.kv_heads, o.spec.head_dim,
                             o.spec.block_tokens, *dtype, o.num_pages};
  if (auto s = gpu::Validate(c->layout_); !s.ok()) return s;
  c->ns_ = NamespaceId(o.spec);
  c->pool_ = std::make_unique<PagePool>(c->layout_);
  const uint64_t bb = c->layout_.block_bytes();
  size_t staging_bytes = (2 * o.staging_blocks * bb + 4095) / 4096 * 4096;
  c->staging_ = static_cast<uint8_t*>(std::aligned_alloc(4096, staging_bytes));
  std::memset(c->staging_, 0, staging_bytes);
  for (uint64_t i = o.staging_blocks; i-- > 0;) {
    c->free_slots_.push_back(static_cast<uint32_t>(i));
    c->load_free_slots_.push_back(static_cast<uint32_t>(o.staging_blocks + i));
  }
  c->stats_.staging_blocks = o.staging_blocks;
  if (!o.stores.empty()) {
    c->store_ = std::make_unique<ShardedStoreClient>(o.stores, o.data);
    if (auto s = c->store_->RegisterMemory(c->staging_, staging_bytes); !s.ok()) return s;
    c->registered_ = c->store_->RegisterNamespace(o.spec).ok();
  }
  KvConnector* self = c.get();
  c->pool_->SetEvictCallback([self](const BlockHash& h, uint32_t page) {
    {
      std::lock_guard lk(self->publishers_mu_);
      for (auto* p : self->publishers_) p->Removed(self->ns_, {h});
    }
    if (self->store_ && self->options_.offload == "write-back" && !self->KnownStored(h)) {
      self->StageForOffload(h, page, 0, self->options_.offload_wait_ms);
    }
  });
  c->offloader_ = std::thread([self] { self->OffloadLoop(); });
  return c;
}

KvConnector::~KvConnector() {
  Drain();
  {
    std::lock_guard lk(staging_mu_);
    stop_ = true;
  }
  offload_cv_.notify_all();
  staging_cv_.notify_all();
  if (offloader_.joinable()) offloader_.join();
  std::vector<uint64_t> ids;
  {
    std::lock_guard lk(mu_);
    for (const auto& [id, r] : requests_) ids.push_back(id);
  }
  for (uint64_t id : ids) Finished(id);
  store_.reset();
  std::free(staging_);
}

bool KvConnector::KnownStored(const BlockHash& h) const {
  std::lock_guard lk(known_mu_);
  return known_.contains(h);
}

void KvConnector::NoteStored(const BlockHash& h) {
  std::lock_guard lk(known_mu_);
  if (known_.size() > 8 * layout_.num_pages + 1024) known_.clear();  // a hint, not a record
  known_.insert(h);
}

void KvConnector::PublishStored(const std::vector<BlockHash>& hashes) {
  if (hashes.empty()) return;
  std::lock_guard lk(publishers_mu_);
  for (auto* p : publishers_) p->Stored(ns_, hashes);
}

absl::StatusOr<KvConnector::Match> KvConnector::Begin(uint64_t request, std::vector<BlockHash> chain) {
  if (chain.empty()) return absl::InvalidArgumentError("request has no full block to match");
  auto r = std::make_unique<Request>();
  r->pages = pool_->MatchAndRef(chain);
  r->gpu_blocks = static_cast<uint32_t>(r->pages.size());
  absl::Status store_status = absl::OkStatus();
  if (store_ && r->gpu_blocks < chain.size()) {
    if (!registered_) {
      auto reg = store_->RegisterNamespace(options_.spec);
      registered_ = reg.ok();
      if (!reg.ok()) store_status = reg.status();
    }
    if (registered_) {
      std::vector<BlockHash> rest(chain.begin() + r->gpu_blocks, chain.end());
      auto k = store_->Lookup(ns_, rest);
      if (k.ok()) {
        r->store_blocks = *k;
      } else {
        store_status = k.status();
      }
    }
  }
  r->chain = std::move(chain);
  Match m{r->gpu_blocks, r->store_blocks, store_status};
  std::lock_guard lk(mu_);
  if (requests_.count(request)) {
    for (uint32_t p : r->pages) pool_->Unref(p);
    return absl::AlreadyExistsError(absl::StrCat("request ", request, " is already open"));
  }
  requests_[request] = std::move(r);
  return m;
}

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

absl::StatusOr<std::vector<uint32_t>> KvConnector::AllocateForCompute(uint64_t request) {
  Request* r;
  {
    std::lock_guard lk(mu_);
    auto it = requests_.find(request);
    if (it == requests_.end()) return absl::NotFoundError(absl::StrCat("no request ", request));
    r = it->second.get();
  }
  if (r->load.valid()) return absl::FailedPreconditionError("wait for the load first");
  std::vector<uint32_t> out;
  for (size_t i = r->pages.size() + r->computed.size(); i < r->chain.size(); ++i) {
    auto p = pool_->Allocate();
    if (!p) {
      for (uint32_t q : out) pool_->Discard(q);
      return absl::ResourceExhaustedError(absl::StrCat(
          "page pool full: every one of ", layout_.num_pages, " pages is in use by requests"));
    }
    out.push_back(*p);
  }
  r->computed.insert(r->computed.end(), out.begin(), out.end());
  return out;
}

bool KvConnector::StageForOffload(const BlockHash& hash, uint32_t page, uint64_t request,
                                  int wait_ms) {
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
  gpu::GatherCpu(layout_, pool_->layer_bases(), &page, 1, &dst);
  {
    std::lock_guard lk(staging_mu_);
    offload_queue_.push_back(Staged{hash, slot[0], request});
  }
  offload_cv_.notify_one();
  return true;
}

absl::Status KvConnector::Save(uint64_t request) {
  Request* r;
  {
    std::lock_guard lk(mu_);
    auto it = requests_.find(request);
    if (it == requests_.end()) return absl::NotFoundError(absl::StrCat("no request ", request));
    r = it->second.get();
  }
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

void KvConnector::Finished(uint64_t request) {
  std::unique_ptr<Request> r;
  {
    std::unique_lock lk(mu_);
    auto it = requests_.find(request);
    if (it == requests_.end()) return;
    drained_cv_.wait(lk, [&] { return it->second->pending_saves == 0; });
    r = std::move(it->second);
    requests_.erase(it);
  }
  if (r->load.valid()) r->load.wait();
  for (uint32_t p : r->pages) pool_->Unref(p);
  for (uint32_t p : r->computed) pool_->Discard(p);
}

uint32_t KvConnector::LoadedFromDisk(uint64_t request) {
  std::lock_guard lk(mu_);
  auto it = requests_.find(request);
  return it == requests_.end() ? 0 : it->second->loaded_from_disk;
}

std::vector<uint32_t> KvConnector::Pages(uint64_t request) {
  std::lock_guard lk(mu_);
  auto it = requests_.find(request);
  if (it == requests_.end()) return {};
  std::vector<uint32_t> out = it->second->pages;
  out.insert(out.end(), it->second->computed.begin(), it->second->computed.end());
  return out;
}

void KvConnector::OffloadLoop() {
  const uint64_t bb = layout_.block_bytes();
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
    if (!registered_) registered_ = store_->RegisterNamespace(options_.spec).ok();
    auto r = store_->Put(ns_, bb, blocks);
    if (!r.ok()) st = r.status();
    {
      std::lock_guard sl(stats_mu_);
      if (r.ok()) {
        stats_.offloaded_blocks += r->written;
        stats_.offload_skipped_known += r->already_present;
      } else {
        stats_.offload_failures += batch.size();
      }
    }
    if (r.ok()) {
      for (const auto& s : batch) NoteStored(s.hash);
    }
    std::vector<uint32_t> slots;
    for (const auto& s : batch) slots.push_back(s.slot);
    ReleaseStaging(slots);
    {
      std::lock_guard lk(mu_);
      for (const auto& s : batch) {
        if (s.request == 0) continue;
        auto it = requests_.find(s.request);
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

ConnectorStats KvConnector::stats() const {
  ConnectorStats s;
  {
    std::lock_guard sl(stats_mu_);
    s = stats_;
  }
  s.pool = pool_->counters();
  return s;
}

}  // namespace kvtier::worker
