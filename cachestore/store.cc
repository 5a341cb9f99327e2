#include "cachestore/store.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checksum.h"
#include "common/log.h"
#include "common/proto_convert.h"

namespace kvtier::store {

namespace {


std::string SerializeSpec(const NamespaceSpec& s) {
  kvtier::v1::NamespaceSpec p;
  ToProto(s, &p);
  return p.SerializeAsString();
}

bool ParseSpec(const std::string& bytes, NamespaceSpec* s) {
  kvtier::v1::NamespaceSpec p;
  if (!p.ParseFromString(bytes)) return false;
  *s = FromProto(p);
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Store>> Store::Open(const StoreOptions& o) {
  if (o.lease_ms == 0) return absl::InvalidArgumentError("lease must be at least 1 ms");
  std::unique_ptr<Store> s(new Store());
  s->options_ = o;
  auto disk = DiskTier::Open(o.disk);
  if (!disk.ok()) return disk.status();
  s->disk_ = std::move(*disk);
  DiskTier* d = s->disk_.get();
  auto ram = RamTier::Create(o.ram, [d](const EvictedBlock& b) { return d->Enqueue(b); });
  if (!ram.ok()) return ram.status();
  s->ram_ = std::move(*ram);
  for (const auto& [key, value] : s->disk_->ScanMeta("ns/")) {
    NamespaceSpec spec;
    if (!ParseSpec(value, &spec) || !ValidateNamespace(spec).ok()) {
      Log("store", "ignoring unreadable namespace record ", key);
      continue;
    }
    uint64_t id = NamespaceId(spec);
    s->namespaces_[id] = NamespaceInfo{id, spec, BlockBytes(spec)};
  }
  s->reaper_ = std::thread([p = s.get()] { p->ReaperLoop(); });
  if (!o.routers.empty()) {
    for (const auto& r : o.routers) {
      PublisherOptions po;
      po.router = r;
      po.security = o.router_security;
      po.hello.set_source_id(o.store_id);
      po.hello.set_kind(v1::SOURCE_STORE);
      po.heartbeat_ms = o.heartbeat_ms;
      s->publishers_.push_back(std::make_unique<EventPublisher>(po));
    }
    Store* self = s.get();
    auto listener = [self](const BlockKey& k, bool added) {
      std::lock_guard lk(self->change_mu_);
      self->changes_.emplace_back(k, added);
      self->change_cv_.notify_one();
    };
    s->ram_->SetChangeListener(listener);
    s->disk_->SetChangeListener(listener);
    for (const auto& k : s->disk_->Keys()) listener(k, true);  // announce the NVMe tier
    s->notifier_ = std::thread([self] { self->NotifierLoop(); });
  }
  return s;
}

void Store::NotifierLoop() {
  std::vector<std::pair<BlockKey, bool>> batch;
  for (;;) {
    {
      std::unique_lock lk(change_mu_);
      change_cv_.wait(lk, [&] { return notifier_stop_ || !changes_.empty(); });
      if (notifier_stop_ && changes_.empty()) return;
      batch.swap(changes_);
    }
    std::map<uint64_t, std::vector<BlockHash>> stored, removed;
    for (const auto& [k, added] : batch) {
      if (added) {
        stored[k.ns].push_back(k.hash);
      } else if (!ram_->Contains(k) && !disk_->Contains(k)) {
        removed[k.ns].push_back(k.hash);  // gone from both tiers
      }
    }
    batch.clear();
    for (auto& p : publishers_) {
      for (const auto& [ns, hs] : stored) p->Stored(ns, hs);
      for (const auto& [ns, hs] : removed) p->Removed(ns, hs);
    }
  }
}

Store::~Store() {
  {
    std::lock_guard lk(lease_mu_);
    stop_ = true;
  }
  reaper_cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
  {
    std::lock_guard lk(change_mu_);
    notifier_stop_ = true;
  }
  change_cv_.notify_all();
  if (notifier_.joinable()) notifier_.join();
  for (auto& p : publishers_) p->Stop();
  // The tiers outlive this object's threads; stop them calling back into it.
  if (ram_) ram_->SetChangeListener(nullptr);
  if (disk_) disk_->SetChangeListener(nullptr);
}

absl::StatusOr<NamespaceInfo> Store::RegisterNamespace(const NamespaceSpec& spec,
                                                       uint64_t expected_id) {
  if (auto s = ValidateNamespace(spec); !s.ok()) return s;
  uint64_t id = NamespaceId(spec);
  if (expected_id != 0 && expected_id != id) {
    return absl::InvalidArgumentError(
        absl::StrCat("namespace id mismatch: caller computed ", NamespaceName(expected_id),
                     " but the spec \"", CanonicalNamespace(spec), "\" hashes to ", NamespaceName(id)));
  }
  uint64_t bytes = BlockBytes(spec);
  if (bytes > ram_->max_block_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "namespace blocks of ", bytes, " bytes exceed the RAM slab size of ",
        ram_->max_block_bytes(), " bytes; start kvtier-store with --ram-slab-bytes >= ", bytes));
  }
  std::lock_guard lk(ns_mu_);
  if (namespaces_.count(id)) return namespaces_.at(id);
  if (auto s = disk_->PutMeta("ns/" + NamespaceName(id), SerializeSpec(spec)); !s.ok()) {
    // The NVMe tier takes no writes now (degraded); none of this namespace's
    // blocks can be on disk, so it is served from RAM and registered again
    // by its workers after a restart.
    Log("store", "namespace ", NamespaceName(id), " not persisted: ", s.message());
  }
  NamespaceInfo info{id, spec, bytes};
  namespaces_[id] = info;
  Log("store", "registered namespace ", NamespaceName(id), " (", CanonicalNamespace(spec), "), blocks of ",
      bytes, " bytes");
  return info;
}

std::vector<NamespaceInfo> Store::ListNamespaces() const {
  std::lock_guard lk(ns_mu_);
  std::vector<NamespaceInfo> out;
  for (const auto& [id, info] : namespaces_) out.push_back(info);
  return out;
}

absl::StatusOr<NamespaceInfo> Store::CheckRequest(uint64_t ns,
                                                  std::span<const BlockHash> hashes) const {
  if (hashes.empty()) return absl::InvalidArgumentError("request names no block hashes");
  if (hashes.size() > kMaxBlocksPerRequest) {
    return absl::InvalidArgumentError(absl::StrCat("request names ", hashes.size(),
                                                   " block hashes; the limit is ",
                                                   kMaxBlocksPerRequest));
  }
  std::lock_guard lk(ns_mu_);
  auto it = namespaces_.find(ns);
  if (it == namespaces_.end()) {
    return absl::NotFoundError(absl::StrCat("namespace ", NamespaceName(ns),
                                            " is not registered; call RegisterNamespace first"));
  }
  return it->second;
}

absl::StatusOr<std::vector<Tier>> Store::Lookup(uint64_t ns,
                                                std::span<const BlockHash> hashes) const {
  if (auto info = CheckRequest(ns, hashes); !info.ok()) return info.status();
  std::vector<Tier> tiers;
  for (const auto& h : hashes) {
    BlockKey k{ns, h};
    if (ram_->Contains(k)) tiers.push_back(Tier::kRam);
    else if (disk_->Contains(k)) tiers.push_back(Tier::kDisk);
    else break;
  }
  return tiers;
}

uint64_t Store::AddLease(Lease lease) {
  std::lock_guard lk(lease_mu_);
  uint64_t id = next_lease_++;
  (lease.is_put ? put_leases_ : get_leases_)++;
  leases_.emplace(id, std::move(lease));
  return id;
}

absl::Status Store::ClaimClientLeaseLocked(const std::string& client) {
  uint64_t& held = leases_by_client_[client];
  if (options_.max_leases_per_client != 0 && held >= options_.max_leases_per_client) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "client \"", client, "\" already holds ", held, " open leases (the limit is ",
        options_.max_leases_per_client, "); commit, end or abort some first"));
  }
  ++held;
  return absl::OkStatus();
}

void Store::ReturnClientLease(const std::string& client) {
  std::lock_guard lk(lease_mu_);
  auto it = leases_by_client_.find(client);
  if (it != leases_by_client_.end() && --it->second == 0) leases_by_client_.erase(it);
}

void Store::ForgetLeaseLocked(const Lease& lease) {
  (lease.is_put ? put_leases_ : get_leases_)--;
  auto it = leases_by_client_.find(lease.client);
  if (it != leases_by_client_.end() && --it->second == 0) leases_by_client_.erase(it);
}

absl::StatusOr<Store::Lease> Store::TakeLease(uint64_t id, bool is_put) {
  const char* kind = is_put ? "put" : "get";
  std::lock_guard lk(lease_mu_);
  auto it = leases_.find(id);
  if (it == leases_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat(kind, " lease ", id, " is unknown, already ended, or expired (leases last ",
                     options_.lease_ms, " ms)"));
  }
  if (it->second.is_put != is_put) {
    return absl::InvalidArgumentError(absl::StrCat("lease ", id, " is a ",
                                                   is_put ? "get" : "put", " lease, not a ", kind,
                                                   " lease"));
  }
  Lease l = std::move(it->second);
  leases_.erase(it);
  ForgetLeaseLocked(l);
  return l;
}

void Store::ReleaseLease(const Lease& lease) {
  for (const auto& [key, slot] : lease.items) {
    if (lease.is_put) ram_->Release(key, slot);
    else ram_->Unpin(key, slot);
  }
}

void Store::ReaperLoop() {
  const auto period = std::chrono::milliseconds(std::clamp<uint64_t>(options_.lease_ms / 4, 1, 200));
  const auto grace = std::chrono::milliseconds(options_.lease_ms);
  std::unique_lock lk(lease_mu_);
  while (!stop_) {
    reaper_cv_.wait_for(lk, period, [&] { return stop_; });
    auto now = std::chrono::steady_clock::now();
    size_t expired = 0;
    for (auto it = leases_.begin(); it != leases_.end();) {
      if (it->second.deadline <= now) {
        ForgetLeaseLocked(it->second);
        Log("store", it->second.is_put ? "put" : "get", " lease ", it->first, " expired; its ",
            it->second.items.size(), " slots are reclaimed after a grace period");
        graveyard_.emplace_back(now + grace, std::move(it->second));
        it = leases_.erase(it);
        ++expired;
      } else {
        ++it;
      }
    }
    leases_expired_.fetch_add(expired);
    std::vector<Lease> due;
    for (auto it = graveyard_.begin(); it != graveyard_.end();) {
      if (it->first <= now) {
        due.push_back(std::move(it->second));
        it = graveyard_.erase(it);
      } else {
        ++it;
      }
    }
    if (due.empty()) continue;
    lk.unlock();
    for (const auto& lease : due) ReleaseLease(lease);
    lk.lock();
  }
  // Shutting down: nothing can write any more.
  for (const auto& [t, lease] : graveyard_) ReleaseLease(lease);
  graveyard_.clear();
}

absl::StatusOr<BeginPutResult> Store::BeginPut(uint64_t ns, std::span<const BlockHash> hashes,
                                               const std::string& client) {
  auto info = CheckRequest(ns, hashes);
  if (!info.ok()) return info.status();
  std::set<BlockHash> seen;
  for (const auto& h : hashes) {
    if (!seen.insert(h).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("block hash ", ToHex(h), " appears twice in one BeginPut"));
    }
  }
  // The lease id is taken first so the reserved slots name their owner.
  Lease lease{client, true,
              std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.lease_ms), {}};
  BeginPutResult r;
  r.targets.reserve(hashes.size());
  uint64_t id;
  {
    std::lock_guard lk(lease_mu_);
    if (auto s = ClaimClientLeaseLocked(client); !s.ok()) return s;
    id = next_lease_++;
  }
  for (const auto& h : hashes) {
    BlockKey k{ns, h};
    PutTarget t{Placement::kNoSpace, {}};
    if (disk_->Contains(k)) {
      t.placement = Placement::kPresent;
    } else {
      t.placement = ram_->Reserve(k, info->block_bytes, id, &t.slot);
      if (t.placement == Placement::kReserved) lease.items.emplace_back(k, t.slot);
    }
    r.targets.push_back(t);
  }
  if (lease.items.empty()) {
    ReturnClientLease(client);  // nothing reserved: no lease
    return r;
  }
  std::lock_guard lk(lease_mu_);
  put_leases_++;
  leases_.emplace(id, std::move(lease));
  r.lease = id;
  return r;
}

absl::StatusOr<uint32_t> Store::CommitPut(uint64_t lease_id, std::span<const uint64_t> checksums) {
  auto lease = TakeLease(lease_id, true);
  if (!lease.ok()) return lease.status();
  if (checksums.size() != lease->items.size()) {
    size_t want = lease->items.size();
    // A malformed commit does not cost the caller its lease.
    std::lock_guard lk(lease_mu_);
    put_leases_++;
    leases_by_client_[lease->client]++;
    leases_.emplace(lease_id, std::move(*lease));
    return absl::InvalidArgumentError(absl::StrCat("CommitPut of lease ", lease_id, " carries ",
                                                   checksums.size(), " checksums; the lease has ",
                                                   want, " reserved blocks"));
  }
  for (size_t i = 0; i < checksums.size() && options_.verify_commits; ++i) {
    const auto& [key, slot] = lease->items[i];
    uint64_t actual = Checksum(ram_->data(slot), slot.length);
    if (actual != checksums[i]) {
      ReleaseLease(*lease);
      commit_checksum_failures_.fetch_add(1);
      return absl::DataLossError(absl::StrFormat(
          "checksum mismatch on block %d (%s) of lease %d: client says %016x, the bytes in the "
          "slot hash to %016x; no block of the lease was stored",
          i, ToHex(key.hash), lease_id, checksums[i], actual));
    }
  }
  uint32_t committed = 0;
  for (size_t i = 0; i < checksums.size(); ++i) {
    const auto& [key, slot] = lease->items[i];
    if (ram_->Publish(key, slot, checksums[i])) ++committed;
  }
  return committed;
}

absl::Status Store::AbortPut(uint64_t lease_id) {
  auto lease = TakeLease(lease_id, true);
  if (!lease.ok()) return lease.status();
  ReleaseLease(*lease);
  return absl::OkStatus();
}

absl::StatusOr<BeginGetResult> Store::BeginGet(uint64_t ns, std::span<const BlockHash> hashes,
                                               const std::string& client) {
  auto info = CheckRequest(ns, hashes);
  if (!info.ok()) return info.status();
  {
    std::lock_guard lk(lease_mu_);
    if (auto s = ClaimClientLeaseLocked(client); !s.ok()) return s;
  }
  Lease lease{client, false,
              std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.lease_ms), {}};
  BeginGetResult r;
  for (const auto& h : hashes) {
    BlockKey k{ns, h};
    if (auto slot = ram_->Pin(k)) {
      r.sources.push_back(GetSource{Tier::kRam, *slot});
      lease.items.emplace_back(k, *slot);
      continue;
    }
    uint64_t checksum;
    auto bytes = disk_->Read(k, &checksum);
    if (!bytes.ok()) break;
    Slot slot;
    Placement p = ram_->InsertCopy(k, reinterpret_cast<const uint8_t*>(bytes->data()),
                                   bytes->size(), checksum, true, true, &slot);
    if (p != Placement::kReserved) break;  // no room to promote: the prefix ends here
    r.sources.push_back(GetSource{Tier::kDisk, slot});
    lease.items.emplace_back(k, slot);
  }
  if (lease.items.empty()) ReturnClientLease(client);  // nothing pinned: no lease
  else r.lease = AddLease(std::move(lease));
  return r;
}

absl::Status Store::EndGet(uint64_t lease_id) {
  auto lease = TakeLease(lease_id, false);
  if (!lease.ok()) return lease.status();
  ReleaseLease(*lease);
  return absl::OkStatus();
}

absl::StatusOr<InlinePutResult> Store::PutInline(uint64_t ns, const BlockHash& hash,
                                                 std::string_view data, uint64_t checksum) {
  auto info = CheckRequest(ns, std::span<const BlockHash>(&hash, 1));
  if (!info.ok()) return info.status();
  if (data.size() != info->block_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", ToHex(hash), " carries ", data.size(), " bytes; blocks of namespace ",
                     NamespaceName(ns), " are ", info->block_bytes, " bytes"));
  }
  uint64_t actual = Checksum(data.data(), data.size());
  if (actual != checksum) {
    commit_checksum_failures_.fetch_add(1);
    return absl::DataLossError(absl::StrFormat(
        "checksum mismatch on block %s: client says %016x, the bytes hash to %016x; not stored",
        ToHex(hash), checksum, actual));
  }
  BlockKey k{ns, hash};
  if (disk_->Contains(k)) return InlinePutResult{InlinePutResult::kAlreadyPresent};
  Slot slot;
  switch (ram_->InsertCopy(k, reinterpret_cast<const uint8_t*>(data.data()), data.size(), checksum,
                           false, false, &slot)) {
    case Placement::kReserved:
      return InlinePutResult{InlinePutResult::kStored};
    case Placement::kPresent:
      return InlinePutResult{InlinePutResult::kAlreadyPresent};
    case Placement::kBusy:
      return absl::AbortedError(absl::StrCat("block ", ToHex(hash),
                                             " is being written by another put lease right now; "
                                             "retry after it commits or expires"));
    case Placement::kNoSpace:
      break;
  }
  return InlinePutResult{InlinePutResult::kNoSpace};
}

absl::Status Store::GetInline(
    uint64_t ns, std::span<const BlockHash> hashes,
    const std::function<bool(uint32_t, Tier, std::string_view, uint64_t)>& emit) {
  auto info = CheckRequest(ns, hashes);
  if (!info.ok()) return info.status();
  for (uint32_t i = 0; i < hashes.size(); ++i) {
    BlockKey k{ns, hashes[i]};
    if (auto slot = ram_->Pin(k)) {
      bool more = emit(i, Tier::kRam,
                       std::string_view(reinterpret_cast<const char*>(ram_->data(*slot)),
                                        slot->length),
                       slot->checksum);
      ram_->Unpin(k, *slot);
      if (!more) break;
      continue;
    }
    uint64_t checksum;
    auto bytes = disk_->Read(k, &checksum);
    if (!bytes.ok()) break;
    Slot slot;
    // Promote when there is room; serve from the disk copy either way.
    ram_->InsertCopy(k, reinterpret_cast<const uint8_t*>(bytes->data()), bytes->size(), checksum,
                     false, true, &slot);
    if (!emit(i, Tier::kDisk, *bytes, checksum)) break;
  }
  return absl::OkStatus();
}

absl::StatusOr<EvictResult> Store::EvictAll() {
  EraseCounts r = ram_->EraseAll();
  EraseCounts d = disk_->EraseAll();
  Log("store", "evicted all: ", r.erased, " RAM blocks, ", d.erased, " disk blocks, ", r.pinned,
      " pinned");
  return EvictResult{r.erased, d.erased, r.pinned};
}

absl::StatusOr<EvictResult> Store::EvictNamespace(uint64_t ns) {
  {
    std::lock_guard lk(ns_mu_);
    if (!namespaces_.count(ns)) {
      return absl::NotFoundError(absl::StrCat("namespace ", NamespaceName(ns), " is not registered"));
    }
  }
  EraseCounts r = ram_->EraseNamespace(ns);
  EraseCounts d = disk_->EraseNamespace(ns);
  Log("store", "evicted namespace ", NamespaceName(ns), ": ", r.erased, " RAM blocks, ", d.erased,
      " disk blocks, ", r.pinned, " pinned");
  return EvictResult{r.erased, d.erased, r.pinned};
}

absl::StatusOr<EvictResult> Store::EvictKeys(std::span<const BlockKey> keys) {
  if (keys.empty()) return absl::InvalidArgumentError("evict names no keys");
  if (keys.size() > kMaxBlocksPerRequest) {
    return absl::InvalidArgumentError(
        absl::StrCat("evict names ", keys.size(), " keys; the limit is ", kMaxBlocksPerRequest));
  }
  std::vector<BlockKey> v(keys.begin(), keys.end());
  EraseCounts r = ram_->Erase(v);
  EraseCounts d = disk_->Erase(v);
  return EvictResult{r.erased, d.erased, r.pinned};
}

absl::Status Store::SetPolicy(Tier tier, const std::string& name,
                              const std::map<std::string, double>& params) {
  absl::Status s = tier == Tier::kRam ? ram_->SetPolicy(name, params)
                                      : disk_->SetPolicy(name, params);
  if (s.ok()) Log("store", tier == Tier::kRam ? "ram" : "disk", " policy set to ", name);
  return s;
}

std::pair<std::string, std::map<std::string, double>> Store::GetPolicy(Tier tier) const {
  if (tier == Tier::kRam) return {ram_->policy(), ram_->policy_params()};
  return {disk_->policy(), disk_->policy_params()};
}

StoreStats Store::Stats() const {
  StoreStats s;
  s.ram = ram_->Snapshot();
  s.disk = disk_->Snapshot();
  s.queue = disk_->QueueStats();
  {
    std::lock_guard lk(lease_mu_);
    s.put_leases = put_leases_;
    s.get_leases = get_leases_;
  }
  s.leases_expired = leases_expired_.load();
  s.checksum_failures = commit_checksum_failures_.load() + disk_->checksum_failures();
  return s;
}

}  // namespace kvtier::store
