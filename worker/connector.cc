// KvConnector's construction and teardown, its request table and matching:
// Begin (the GPU prefix pinned, the continuation pinned in the store),
// AllocateForCompute, Finished and the per-request queries, plus what the
// connector knows and tells routers about where blocks are. The load path is
// in connector_load.cc, save and offload in connector_offload.cc, the
// staging memory they share in connector_staging.cc.
#include "worker/connector.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace kvtier::worker {

absl::StatusOr<std::unique_ptr<KvConnector>> KvConnector::Create(ConnectorOptions o) {
  if (auto s = ValidateNamespace(o.spec); !s.ok()) return s;
  if (o.offload != "write-back" && o.offload != "write-through" && o.offload != "none") {
    return absl::InvalidArgumentError(absl::StrCat("offload policy \"", o.offload,
                                                   "\" is not write-back, write-through or none"));
  }
  if (o.staging_blocks == 0 || o.offload_batch == 0) {
    return absl::InvalidArgumentError("staging_blocks and offload_batch must be at least 1");
  }
  if (o.offload_nice < 0 || o.offload_nice > 19) {
    return absl::InvalidArgumentError(
        absl::StrCat("offload_nice must be between 0 and 19, not ", o.offload_nice));
  }
  auto dtype = ParseDtype(o.spec.dtype);
  if (!dtype.ok()) return dtype.status();
  std::unique_ptr<KvConnector> c(new KvConnector());
  c->options_ = o;
  c->layout_ = gpu::KvLayout{o.spec.layers,       o.spec.kv_heads, o.spec.head_dim,
                             o.spec.block_tokens, *dtype,          o.num_pages};
  if (auto s = gpu::Validate(c->layout_); !s.ok()) return s;
  c->ns_ = NamespaceId(o.spec);
  c->wire_bytes_ = BlockBytes(o.spec);
  c->packed_ = o.spec.kv_wire == kKvWireInt8;
  if (o.engine_memory) {
    if (c->packed_) {
      return absl::InvalidArgumentError(
          "kv_wire int8 needs the connector's own page pool, not engine-registered memory");
    }
    if (auto s = gpu::Validate(c->layout_, *o.engine_memory); !s.ok()) return s;
    c->memory_ = *o.engine_memory;
    if (!o.page_copier.empty()) {
      auto copier = gpu::OpenPageCopier(o.page_copier);
      if (!copier.ok()) return copier.status();
      if (auto s = (*copier)->CheckMemory(c->layout_, c->memory_); !s.ok()) return s;
      c->copier_ = std::move(*copier);
    }
  } else if (!o.page_copier.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page_copier \"", o.page_copier, "\" is for engine memory; this connector owns its pages"));
  } else {
    c->pool_ = std::make_unique<PagePool>(c->layout_);
    c->memory_ = gpu::PageMemory::Contiguous(c->layout_, c->pool_->layer_bases());
  }
  c->stats_.staging_blocks = o.staging_blocks;
  if (!o.stores.empty()) c->store_ = std::make_unique<ShardedStoreClient>(o.stores, o.data);
  if (auto s = c->InitStaging(); !s.ok()) return s;
  if (c->store_ && !c->copier_) {
    // Loads land in the pages themselves: register the memory the pages
    // span (every layer's K and V range, merged where they touch, so no
    // byte the engine did not hand over is registered, and none twice).
    const uint64_t chunk = c->layout_.chunk_elems() * c->layout_.elem_bytes();
    const gpu::PageMemory& m = c->memory_;
    const uint32_t last = static_cast<uint32_t>(c->layout_.num_pages - 1);
    std::vector<std::pair<uint8_t*, uint8_t*>> ranges;
    for (uint32_t l = 0; l < c->layout_.layers; ++l) {
      ranges.emplace_back(m.K(l, 0), m.K(l, last) + chunk);
      ranges.emplace_back(m.V(l, 0), m.V(l, last) + chunk);
    }
    std::sort(ranges.begin(), ranges.end());
    std::vector<std::pair<uint8_t*, uint8_t*>> merged;
    for (const auto& r : ranges) {
      if (!merged.empty() && r.first <= merged.back().second) {
        merged.back().second = std::max(merged.back().second, r.second);
      } else {
        merged.push_back(r);
      }
    }
    for (const auto& [lo, hi] : merged) {
      if (auto s = c->store_->RegisterMemory(lo, static_cast<size_t>(hi - lo)); !s.ok()) return s;
    }
  }
  // A store that is down now is registered with on first use instead.
  if (c->store_) c->registered_ = c->store_->RegisterNamespace(o.spec).ok();
  // A page copier reads and writes a same-host store's blocks in place,
  // through its arena mapped by a connected lane: connect now (waiting a
  // little: a store that is down or slow is found out by later calls), so
  // the first load and save find it mapped and pay no connect.
  if (c->store_ && c->copier_) {
    c->store_->Warm(std::chrono::milliseconds(std::min(o.data.deadline_ms, 2000)));
  }
  KvConnector* self = c.get();
  if (c->pool_) {
    c->pool_->SetEvictCallback([self](const BlockHash& h, uint32_t page) {
      self->PublishRemoved(h);
      self->WriteBack(h, page);
    });
  }
  for (uint32_t i = 0; i < std::max<uint32_t>(1, o.offload_threads); ++i) {
    c->offloaders_.emplace_back([self] { self->OffloadLoop(); });
  }
  if (c->store_ && c->copier_) {
    // Several, so runs' checksums and commits (the store hashes each block
    // again at commit) overlap each other and the next runs' gathers.
    for (unsigned i = 0; i < kCommitters; ++i) {
      c->committers_.emplace_back([self] { self->CommitLoop(); });
    }
  }
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
  commit_cv_.notify_all();
  for (auto& t : offloaders_) t.join();
  for (auto& t : committers_) t.join();
  std::vector<uint64_t> ids;
  {
    std::lock_guard lk(mu_);
    for (const auto& [id, r] : requests_) ids.push_back(id);
  }
  for (uint64_t id : ids) Finished(id);
  // The store's and the copier's registrations of the staging memory must
  // go before the memory.
  store_.reset();
  copier_.reset();
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

void KvConnector::PublishRemoved(const BlockHash& h) {
  std::lock_guard lk(publishers_mu_);
  for (auto* p : publishers_) p->Removed(ns_, {h});
}

absl::Status KvConnector::EnsureRegistered() {
  if (registered_) return absl::OkStatus();
  auto reg = store_->RegisterNamespace(options_.spec);
  registered_ = reg.ok();
  return reg.status();
}

bool KvConnector::ForgotNamespace(const absl::Status& s) {
  // A store that restarted without its RAM (or a new shard) does not know
  // the namespace: register again; the caller retries once.
  // What this process noted as stored went with it.
  if (s.code() != absl::StatusCode::kNotFound) return false;
  {
    std::lock_guard lk(known_mu_);
    known_.clear();
  }
  registered_ = false;
  return EnsureRegistered().ok();
}

absl::Status KvConnector::PinRest(Request* r, std::optional<std::chrono::milliseconds> budget) {
  if (!store_ || r->gpu_blocks >= r->chain.size()) return absl::OkStatus();
  if (auto s = EnsureRegistered(); !s.ok()) return s;
  // Look the rest up and pin what the store has, in one round trip.
  std::vector<BlockHash> rest(r->chain.begin() + r->gpu_blocks, r->chain.end());
  auto pin = store_->Pin(ns_, wire_bytes_, rest, budget);
  if (ForgotNamespace(pin.status())) pin = store_->Pin(ns_, wire_bytes_, rest, budget);
  if (!pin.ok()) return pin.status();
  r->pin = std::move(*pin);
  r->store_blocks = r->pin.blocks;
  return absl::OkStatus();
}

absl::StatusOr<KvConnector::Match> KvConnector::Begin(
    uint64_t request, std::vector<BlockHash> chain,
    std::optional<std::chrono::milliseconds> lookup_budget, std::optional<uint32_t> store_hint) {
  if (!pool_)
    return absl::FailedPreconditionError("Begin needs the connector's own pages; use Lookup");
  if (chain.empty()) return absl::InvalidArgumentError("request has no full block to match");
  auto r = std::make_unique<Request>();
  r->pages = pool_->MatchAndRef(chain);
  r->gpu_blocks = static_cast<uint32_t>(r->pages.size());
  r->chain = std::move(chain);
  const bool skip =
      store_ && store_hint && r->gpu_blocks >= *store_hint && r->gpu_blocks < r->chain.size();
  absl::Status store_status = skip ? absl::OkStatus() : PinRest(r.get(), lookup_budget);
  Match m{r->gpu_blocks, r->store_blocks, store_status, skip};
  std::lock_guard lk(mu_);
  if (requests_.count(request)) {
    for (auto it = r->pages.rbegin(); it != r->pages.rend(); ++it) pool_->Unref(*it);  // tail first
    if (store_) store_->Release(r->pin);
    return absl::AlreadyExistsError(absl::StrCat("request ", request, " is already open"));
  }
  requests_[request] = std::move(r);
  return m;
}

absl::StatusOr<KvConnector::Match> KvConnector::Lookup(
    uint64_t request, std::vector<BlockHash> chain, uint32_t skip_blocks,
    std::optional<std::chrono::milliseconds> budget) {
  if (pool_)
    return absl::FailedPreconditionError("Lookup needs engine-registered memory; use Begin");
  if (chain.empty()) return absl::InvalidArgumentError("request has no full block to match");
  if (skip_blocks > chain.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "skip_blocks ", skip_blocks, " is beyond the chain's ", chain.size(), " blocks"));
  }
  auto r = std::make_unique<Request>();
  r->gpu_blocks = skip_blocks;
  r->chain = std::move(chain);
  absl::Status store_status = PinRest(r.get(), budget);
  Match m{r->gpu_blocks, r->store_blocks, store_status};
  std::unique_ptr<Request> old;
  {
    std::lock_guard lk(mu_);
    auto it = requests_.find(request);
    if (it != requests_.end()) {
      if (it->second->load_started || it->second->saves->pending > 0) {
        if (store_) store_->Release(r->pin);
        return absl::FailedPreconditionError(
            absl::StrCat("request ", request, " is open with a load or save under way"));
      }
      old = std::move(it->second);
    }
    requests_[request] = std::move(r);
  }
  if (old && store_) store_->Release(old->pin);
  return m;
}

absl::StatusOr<KvConnector::Request*> KvConnector::Find(uint64_t request, bool engine_mode) {
  if (engine_mode != engine_owned()) {
    return absl::FailedPreconditionError(engine_mode ? "this call needs engine-registered memory"
                                                     : "this call needs the connector's own pages");
  }
  std::lock_guard lk(mu_);
  auto it = requests_.find(request);
  if (it == requests_.end()) return absl::NotFoundError(absl::StrCat("no request ", request));
  return it->second.get();
}

absl::Status KvConnector::CheckPages(const std::vector<uint32_t>& pages) const {
  for (uint32_t p : pages) {
    if (p >= layout_.num_pages) {
      return absl::InvalidArgumentError(absl::StrCat(
          "page ", p, " is out of range: the KV cache has ", layout_.num_pages, " pages"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint32_t>> KvConnector::AllocateForCompute(uint64_t request) {
  auto found = Find(request, /*engine_mode=*/false);
  if (!found.ok()) return found.status();
  Request* r = *found;
  if (r->load.valid()) return absl::FailedPreconditionError("wait for the load first");
  std::vector<uint32_t> out;
  for (size_t i = r->pages.size() + r->computed.size(); i < r->chain.size(); ++i) {
    auto p = pool_->Allocate();
    // Saves waiting for the store give their pages up to compute (the oldest
    // first): an offload never holds a request back.
    // Pages the offloader is copying out come free once copied (it runs at
    // a low priority, so a busy host can hold it mid-copy).
    int waits = 0;  // bounded: a copy never waits, but nothing may spin here
    while (!p && (DropOldestHeld() || (waits++ < 3 && WaitForGathers()))) p = pool_->Allocate();
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

void KvConnector::Finished(uint64_t request) {
  std::unique_ptr<Request> r;
  {
    std::unique_lock lk(mu_);
    auto it = requests_.find(request);
    if (it == requests_.end()) return;
    // Its saves were copied out when staged and finish on their own.
    r = std::move(it->second);
    requests_.erase(it);
  }
  if (r->load.valid()) r->load.wait();
  if (store_) store_->Release(r->pin);  // a pin never loaded (the load releases its own)
  if (!pool_) return;
  // Tail first, so the chain's head is the most recently used and the pool
  // evicts chains from the tail, as engines do (vLLM frees in reverse): a
  // worker's blocks of a chain stay a prefix of it, which routers rely on.
  for (auto it = r->pages.rbegin(); it != r->pages.rend(); ++it) pool_->Unref(*it);
  for (uint32_t p : r->computed) pool_->Discard(p);
}

bool KvConnector::IsOpen(uint64_t request) {
  std::lock_guard lk(mu_);
  return requests_.contains(request);
}

uint32_t KvConnector::MatchMore(uint64_t request) {
  auto found = Find(request, /*engine_mode=*/false);
  if (!found.ok()) return 0;
  Request* r = *found;
  {
    std::lock_guard lk(mu_);
    if (!r->computed.empty() || (r->load_started && !r->load_ended)) return 0;
  }
  std::vector<uint32_t> all = pool_->MatchAndRef(r->chain);
  const size_t have = r->pages.size();
  uint32_t more = 0;
  for (size_t i = have; i < all.size(); ++i) {
    r->pages.push_back(all[i]);
    ++more;
  }
  // The pages it holds already keep the reference they had.
  for (size_t i = std::min(have, all.size()); i-- > 0;) pool_->Unref(all[i]);
  return more;
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

ConnectorStats KvConnector::stats() const {
  ConnectorStats s;
  {
    std::lock_guard sl(stats_mu_);
    s = stats_;
  }
  {
    std::lock_guard lk(staging_mu_);
    s.offload_blocks_in_flight = offloads_running_;
  }
  if (pool_) s.pool = pool_->counters();
  return s;
}

}  // namespace kvtier::worker
