#include "cachestore/store.h"

#include "absl/cleanup/cleanup.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checksum.h"
#include "common/log.h"
#include "common/parallel.h"

namespace kvtier::store {

absl::Status StoreOptions::Validate() const {
  if (lease_ms == 0) return absl::InvalidArgumentError("lease must be at least 1 ms");
  return disk.Validate();
}

absl::StatusOr<std::unique_ptr<Store>> Store::Open(const StoreOptions& o) {
  if (auto st = o.Validate(); !st.ok()) return st;
  std::unique_ptr<Store> s(new Store());
  s->options_ = o;
  DiskTierOptions disk_options = o.disk;
  RamTierOptions ram_options = o.ram;
  if (o.tenants) {
    ram_options.pools.clear();
    disk_options.tenant_bytes.clear();
    for (const auto& t : o.tenants->all()) {
      ram_options.pools.push_back(t.ram_bytes);
      disk_options.tenant_bytes.push_back(t.nvme_bytes);
    }
    ram_options.pool_of = &s->owners_;
    disk_options.tenant_of = &s->owners_;
  }
  auto disk = o.disk_backend ? DiskTier::Open(disk_options, o.disk_backend())
                             : DiskTier::Open(disk_options);
  if (!disk.ok()) return disk.status();
  s->disk_ = std::move(*disk);
  DiskTier* d = s->disk_.get();
  auto ram = RamTier::Create(ram_options, [d](const EvictedBlock& b) { return d->Enqueue(b); });
  if (!ram.ok()) return ram.status();
  s->ram_ = std::move(*ram);
  auto namespaces = NamespaceRegistry::Load(d, o.max_namespaces, o.tenants, &s->owners_);
  if (!namespaces.ok()) return namespaces.status();
  s->namespaces_ = std::move(*namespaces);
  Store* self = s.get();
  s->leases_ = std::make_unique<LeaseTable>(
      o.lease_ms, o.max_leases_per_client, [self](const Lease& l) { self->ReleaseLease(l, true); });
  ChangeListener feed;
  if (o.changes) {
    s->feed_ = std::make_unique<ChangeFeed>(o.changes, [self](const BlockKey& k) {
      return self->ram_->Contains(k) || self->disk_->Contains(k);
    });
    feed = s->feed_->Listener();
  }
  // Every change is counted per namespace, then fed to the router feed.
  for (TierKind tier : {TierKind::kRam, TierKind::kDisk}) {
    self->TierFor(tier).SetChangeListener([self, tier, feed](const BlockKey& k, bool added) {
      self->usage_.Changed(k, tier, added);
      if (feed) feed(k, added);
    });
  }
  for (const auto& k : s->disk_->Keys()) {  // the NVMe tier as recovered
    s->usage_.Changed(k, TierKind::kDisk, true);
    if (s->feed_) s->feed_->Add(k, true);
  }
  return s;
}

Store::~Store() {
  // The lease table's reaper releases into the tiers: stop it first.
  leases_.reset();
  // The tiers outlive the feed; stop them calling into it, then drain it.
  if (ram_) ram_->SetChangeListener(nullptr);
  if (disk_) disk_->SetChangeListener(nullptr);
  feed_.reset();
}

absl::StatusOr<NamespaceInfo> Store::RegisterNamespace(const NamespaceSpec& spec,
                                                       uint64_t expected_id, const Tenant* tenant) {
  return namespaces_->Register(spec, expected_id, ram_->max_block_bytes(), tenant);
}

absl::StatusOr<NamespaceInfo> Store::ResolveNamespace(const Tenant& tenant,
                                                      uint64_t client_id) const {
  return namespaces_->Resolve(tenant, client_id);
}

std::vector<TenantUsage> Store::TenantStats() const {
  std::vector<TenantUsage> out;
  if (!options_.tenants) return out;
  for (const auto& t : options_.tenants->all()) {
    TenantUsage u;
    u.name = t.name;
    u.ram_capacity_bytes = ram_->pool_regions().at(t.index).length;
    u.ram_used_bytes = ram_->PoolUsedBytes(t.index);
    u.nvme_bytes = disk_->TenantBytes(t.index);
    u.nvme_quota_bytes = t.nvme_bytes;
    u.leases = leases_->Held(TenantLeaseHolder(t));
    u.namespaces = namespaces_->List(&t).size();
    out.push_back(std::move(u));
  }
  return out;
}

std::vector<NamespaceInfo> Store::ListNamespaces(const Tenant* tenant) const {
  return namespaces_->List(tenant);
}

absl::StatusOr<NamespaceInfo> Store::CheckRequest(uint64_t ns,
                                                  std::span<const BlockHash> hashes) const {
  if (hashes.empty()) return absl::InvalidArgumentError("request names no block hashes");
  if (hashes.size() > kMaxBlocksPerRequest) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request names ", hashes.size(), " block hashes; the limit is ", kMaxBlocksPerRequest));
  }
  return namespaces_->Find(ns);
}

Tier& Store::TierFor(TierKind kind) const {
  if (kind == TierKind::kRam) return *ram_;
  return *disk_;
}

absl::StatusOr<std::vector<TierKind>> Store::Lookup(uint64_t ns,
                                                    std::span<const BlockHash> hashes) const {
  if (auto info = CheckRequest(ns, hashes); !info.ok()) return info.status();
  std::vector<TierKind> tiers;
  for (const auto& h : hashes) {
    BlockKey k{ns, h};
    // NVMe only once written: a block still in the write-back queue is in
    // memory (a crash loses it), so it counts as RAM.
    if (ram_->Contains(k))
      tiers.push_back(TierKind::kRam);
    else if (disk_->Durable(k))
      tiers.push_back(TierKind::kDisk);
    else if (disk_->Contains(k))
      tiers.push_back(TierKind::kRam);
    else
      break;
  }
  return tiers;
}

void Store::ReleaseLease(const Lease& lease, bool expired) {
  uint64_t bytes = 0;
  for (const auto& [key, slot] : lease.items) {
    bytes += slot.length;
    if (lease.is_put)
      ram_->Release(key, slot);
    else
      ram_->Unpin(key, slot);
  }
  if (lease.is_put || lease.items.empty()) return;
  fetch_meter_.Ended();
  // An abandoned lease says nothing of how long fetches take.
  if (expired) return;
  // The fetch took from BeginGet to now: disk blocks their reads, and every
  // block a share of the rest.
  const auto now = std::chrono::steady_clock::now();
  const double held = std::chrono::duration<double>(now - lease.opened).count();
  const double share =
      std::max(0.0, held - lease.disk_seconds) / static_cast<double>(lease.items.size());
  fetch_meter_.Fetched(lease.disk_items ? FetchMeter::kDisk : FetchMeter::kRam, held);
  const uint64_t ram_items = lease.items.size() - lease.disk_items;
  fetch_meter_.Served(FetchMeter::kRam, ram_items, bytes - lease.disk_bytes, share * ram_items,
                      now);
  fetch_meter_.Served(FetchMeter::kDisk, lease.disk_items, lease.disk_bytes,
                      share * lease.disk_items + lease.disk_seconds, now);
}

std::vector<TierFetchFigures> Store::FetchFigures() {
  return fetch_meter_.Figures(std::chrono::steady_clock::now());
}

absl::StatusOr<BeginPutResult> Store::BeginPut(uint64_t ns, std::span<const BlockHash> hashes,
                                               const LeaseOwner& owner) {
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
  auto id = leases_->Claim(owner);
  if (!id.ok()) return id.status();
  Lease lease{owner.holder, owner.tenant, true, {}, {}};
  lease.session = owner.session;
  BeginPutResult r;
  r.targets.reserve(hashes.size());
  for (const auto& h : hashes) {
    BlockKey k{ns, h};
    PutTarget t{Placement::kNoSpace, {}};
    if (disk_->Contains(k)) {
      t.placement = Placement::kPresent;
    } else {
      t.placement = ram_->Reserve(k, info->block_bytes, *id, &t.slot);
      if (t.placement == Placement::kReserved) lease.items.emplace_back(k, t.slot);
    }
    r.targets.push_back(t);
  }
  if (lease.items.empty()) {
    leases_->Unclaim(owner.holder);  // nothing reserved: no lease
    return r;
  }
  leases_->Open(*id, std::move(lease));
  r.lease = *id;
  return r;
}

absl::StatusOr<uint32_t> Store::CommitPut(uint64_t lease_id, std::span<const uint64_t> checksums,
                                          int tenant, bool store_checksums,
                                          std::string_view session) {
  auto lease = leases_->Take(lease_id, true, tenant, LeaseTable::WhenHeld::kRefuse, session);
  if (!lease.ok()) return lease.status();
  const size_t want = store_checksums ? 0 : lease->items.size();
  if (checksums.size() != want) {
    // A malformed commit does not cost the caller its lease.
    leases_->Restore(lease_id, std::move(*lease));
    return absl::InvalidArgumentError(
        store_checksums
            ? absl::StrCat("CommitPut of lease ", lease_id,
                           " asks the store to hash its blocks "
                           "and carries ",
                           checksums.size(), " checksums; send none")
            : absl::StrCat("CommitPut of lease ", lease_id, " carries ", checksums.size(),
                           " checksums; the lease has ", want, " reserved blocks"));
  }
  // Every block's hash, on up to kCommitHashThreads threads for a large
  // commit (a run of 2 MiB blocks took ~10 ms on one).
  std::vector<uint64_t> actual(options_.verify_commits || store_checksums ? lease->items.size()
                                                                          : 0);
  uint64_t bytes = 0;
  for (const auto& item : lease->items) bytes += item.second.length;
  ParallelFor(actual.size(), bytes, kCommitBytesPerThread, kCommitHashThreads, [&](size_t i) {
    const Slot& slot = lease->items[i].second;
    actual[i] = Checksum(ram_->data(slot), slot.length);
  });
  // The store's own hashes are recorded as the slots hold them; a writer's
  // are checked against them (verify_commits).
  if (store_checksums) checksums = actual;
  for (size_t i = 0; !store_checksums && i < actual.size(); ++i) {
    const auto& [key, slot] = lease->items[i];
    if (actual[i] != checksums[i]) {
      ReleaseLease(*lease);
      commit_checksum_failures_.fetch_add(1);
      return absl::DataLossError(absl::StrFormat(
          "checksum mismatch on block %d (%s) of lease %d: client says %016x, the bytes in the "
          "slot hash to %016x; no block of the lease was stored",
          i, ToHex(key.hash), lease_id, checksums[i], actual[i]));
    }
  }
  uint32_t committed = 0;
  for (size_t i = 0; i < checksums.size(); ++i) {
    const auto& [key, slot] = lease->items[i];
    if (ram_->Publish(key, slot, checksums[i])) ++committed;
  }
  return committed;
}

absl::Status Store::DiskReadFailed(const BlockKey& key, const absl::Status& error) {
  disk_read_errors_.fetch_add(1, std::memory_order_relaxed);
  const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  int64_t last = disk_read_logged_ms_.load(std::memory_order_relaxed);
  if (now - last >= 1000 && disk_read_logged_ms_.compare_exchange_strong(last, now)) {
    Log("store", "reading block ", ToHex(key.hash), " of namespace ", NamespaceName(key.ns),
        " from the NVMe tier failed (", disk_read_errors_.load(),
        " such reads so far): ", error.ToString());
  }
  return absl::UnavailableError(
      absl::StrCat("the NVMe tier could not read block ", ToHex(key.hash), ": ", error.message()));
}

absl::Status Store::AbortPut(uint64_t lease_id, int tenant, std::string_view session) {
  auto lease = leases_->Take(lease_id, true, tenant, LeaseTable::WhenHeld::kDefer, session);
  if (!lease.ok()) return lease.status();
  ReleaseLease(*lease);
  return absl::OkStatus();
}

absl::StatusOr<BeginGetResult> Store::BeginGet(uint64_t ns, std::span<const BlockHash> hashes,
                                               const LeaseOwner& owner) {
  auto info = CheckRequest(ns, hashes);
  if (!info.ok()) return info.status();
  auto id = leases_->Claim(owner);
  if (!id.ok()) return id.status();
  Lease lease{owner.holder, owner.tenant, false, {}, {}};
  lease.session = owner.session;
  lease.opened = std::chrono::steady_clock::now();
  BeginGetResult r;
  for (const auto& h : hashes) {
    BlockKey k{ns, h};
    if (auto slot = ram_->Pin(k)) {
      r.sources.push_back(GetSource{TierKind::kRam, *slot});
      lease.items.emplace_back(k, *slot);
      continue;
    }
    uint64_t checksum;
    const auto read_start = std::chrono::steady_clock::now();
    auto bytes = disk_->Read(k, &checksum);
    if (!bytes.ok()) {
      // A miss, or a corrupt record (dropped: a miss from now on) ends the
      // prefix; an I/O error ends it too, counted and said, and is the
      // get's error when nothing came before it.
      if (absl::IsUnavailable(bytes.status())) {
        absl::Status failed = DiskReadFailed(k, bytes.status());
        if (lease.items.empty()) {
          leases_->Unclaim(owner.holder);
          return failed;
        }
      }
      break;
    }
    const double read_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - read_start).count();
    Slot slot;
    Placement p = ram_->InsertCopy(k, reinterpret_cast<const uint8_t*>(bytes->data()),
                                   bytes->size(), checksum, true, true, &slot);
    if (p != Placement::kReserved) break;  // no room to promote: the prefix ends here
    lease.disk_items++;
    lease.disk_bytes += bytes->size();
    lease.disk_seconds += read_seconds;
    r.sources.push_back(GetSource{TierKind::kDisk, slot});
    lease.items.emplace_back(k, slot);
  }
  usage_.Read(ns, hashes.size(), r.sources.size());
  if (lease.items.empty()) {
    leases_->Unclaim(owner.holder);  // nothing pinned: no lease
  } else {
    fetch_meter_.Started();
    leases_->Open(*id, std::move(lease));
    r.lease = *id;
  }
  return r;
}

absl::Status Store::EndGet(uint64_t lease_id, int tenant, std::string_view session) {
  auto lease = leases_->Take(lease_id, false, tenant, LeaseTable::WhenHeld::kDefer, session);
  if (!lease.ok()) return lease.status();
  ReleaseLease(*lease);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint64_t>> Store::ReleaseGets(std::span<const uint64_t> leases,
                                                         int tenant, std::string_view session) {
  if (leases.size() > kMaxBlocksPerRequest) {
    return absl::InvalidArgumentError(
        absl::StrCat("release of ", leases.size(), " leases; at most ", kMaxBlocksPerRequest));
  }
  std::vector<uint64_t> not_found;
  for (uint64_t id : leases) {
    auto lease = leases_->Take(id, false, tenant, LeaseTable::WhenHeld::kDefer, session);
    if (!lease.ok()) {
      not_found.push_back(id);
      continue;
    }
    ReleaseLease(*lease);
  }
  return not_found;
}

}  // namespace kvtier::store
