// One concept, the NVMe tier (disk_tier.h): its index, quota, reserve,
// degraded state and the write, read and erase paths over the backend.
#include "cachestore/disk_tier.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cachestore/rocksdb_backend.h"
#include "common/log.h"

namespace kvtier::store {

absl::Status DiskTierOptions::Validate() const {
  if (admission != "all" && admission != "reused") {
    return absl::InvalidArgumentError(
        absl::StrCat("disk admission \"", admission, "\" is not one of all, reused"));
  }
  if (bytes == 0) return absl::InvalidArgumentError("disk quota must be at least 1 byte");
  if (sync == DiskSync::kGroup &&
      (sync_interval_ms == 0 || sync_interval_ms > limits::kDiskSyncIntervalMaxMs)) {
    return absl::InvalidArgumentError(
        absl::StrCat("disk sync interval of ", sync_interval_ms, " ms: a group sync needs 1 to ",
                     limits::kDiskSyncIntervalMaxMs, " ms (--disk-sync-interval)"));
  }
  return MakePolicy(policy, policy_params).status();
}

// The writer calls back into this tier (Write, EraseKeys use queue_): drain
// and stop it while queue_ still points at the queue.
DiskTier::~DiskTier() {
  if (queue_) queue_->Stop();
  if (syncer_.joinable()) {
    {
      std::lock_guard lk(sync_mu_);
      sync_stop_ = true;
    }
    sync_cv_.notify_all();
    syncer_.join();
    SyncGroup();  // what the queue wrote last
  }
}

void DiskTier::SyncLoop() {
  std::unique_lock lk(sync_mu_);
  while (!sync_stop_) {
    sync_cv_.wait_for(lk, std::chrono::milliseconds(options_.sync_interval_ms));
    if (sync_stop_) break;
    lk.unlock();
    SyncGroup();
    lk.lock();
  }
}

void DiskTier::SyncGroup() {
  {
    std::lock_guard lk(mu_);
    if (unsynced_.empty()) return;
    // Every key here was in the WAL before it was added: the fsync covers it.
    syncing_.swap(unsynced_);
  }
  absl::Status s = backend_->Sync();
  std::lock_guard lk(mu_);
  if (s.ok()) {
    syncs_.fetch_add(1, std::memory_order_relaxed);
  } else {
    // Not durable: the next group tries again; lookups do not say NVMe.
    sync_failures_.fetch_add(1, std::memory_order_relaxed);
    unsynced_.insert(syncing_.begin(), syncing_.end());
    const uint64_t failures = sync_failures_.load();
    if (failures == 1 || failures % 1000 == 0) {
      Log("store", "disk tier: fsync of the WAL failed (", failures,
          " times so far): ", s.message(), "; its blocks are not counted durable");
    }
  }
  syncing_.clear();
}

void DiskTier::SetChangeListener(ChangeListener listener) {
  std::lock_guard lk(listener_mu_);
  listener_ = std::move(listener);
}

absl::Status DiskTier::WritesStopped() const {
  if (!write_failed_) return absl::OkStatus();
  std::lock_guard lk(degraded_mu_);
  return absl::UnavailableError(degraded_reason_);
}

void DiskTier::WriteFailed(const std::string& what, const absl::Status& error) {
  write_failed_ = true;
  SetDegraded(absl::StrCat(error.message(), " (while ", what,
                           "); NVMe writes stopped until the store restarts (reads go on)"));
}

bool DiskTier::Contains(const BlockKey& key) const {
  {
    std::lock_guard lk(mu_);
    if (index_.count(key)) return true;
  }
  return queue_->Contains(key);
}

bool DiskTier::Durable(const BlockKey& key) const {
  std::lock_guard lk(mu_);
  return index_.count(key) > 0 && unsynced_.count(key) == 0 && syncing_.count(key) == 0;
}

bool DiskTier::Enqueue(const EvictedBlock& b) {
  if (options_.admission == "reused" && b.reads == 0) return false;
  if (write_failed_ || queue_->paused()) {  // the writer would only drop it: do not copy it
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  {
    std::lock_guard lk(mu_);
    if (index_.count(b.key)) return true;  // already there (promoted earlier)
  }
  if (queue_->Push(b.key, b.data, b.length, b.checksum) == WriteBackQueue::PushResult::kFull) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  return true;
}

void DiskTier::Notify(const std::vector<BlockKey>& removed, const BlockKey* added) {
  std::lock_guard lk(listener_mu_);
  if (!listener_) return;
  for (const auto& k : removed) listener_(k, false);
  if (added) listener_(*added, true);
}

std::string DiskTier::SpaceShortfall(uint64_t bytes) const {
  auto free_bytes = backend_->FreeBytes();
  if (!free_bytes.ok() || *free_bytes >= options_.reserve_bytes + bytes) return "";
  return absl::StrCat("disk full: ", *free_bytes >> 20, " MiB free on the filesystem of \"",
                      backend_->location(), "\", below the reserve of ",
                      options_.reserve_bytes >> 20,
                      " MiB (--disk-reserve-bytes); NVMe writes paused, reads and the RAM tier "
                      "go on");
}

void DiskTier::SetDegraded(const std::string& reason) {
  if (reason.empty() && !degraded_) return;  // every successful write: nothing to clear
  std::lock_guard lk(degraded_mu_);
  if (reason.empty() && degraded_) Log("store", "disk tier recovered");
  if (!reason.empty() && !degraded_) Log("store", "disk tier degraded: ", reason);
  degraded_ = !reason.empty();
  degraded_reason_ = reason;
}

void DiskTier::DropIndexLocked(const BlockKey& key) {
  auto it = index_.find(key);
  if (it == index_.end()) return;
  counters_.used_bytes.fetch_sub(it->second.record_bytes, std::memory_order_relaxed);
  counters_.items.fetch_sub(1, std::memory_order_relaxed);
  if (auto b = ns_bytes_.find(key.ns); b != ns_bytes_.end()) {
    b->second -= it->second.record_bytes;
    if (b->second == 0) ns_bytes_.erase(b);
  }
  unsynced_.erase(key);  // before the erase: `key` may be the entry's own
  syncing_.erase(key);
  by_seq_.erase(it->second.seq);
  index_.erase(it);
}

uint64_t DiskTier::TenantQuota(uint64_t ns, int* tenant) const {
  if (options_.tenant_of == nullptr) return 0;
  *tenant = options_.tenant_of->Of(ns);
  if (*tenant < 0 || static_cast<size_t>(*tenant) >= options_.tenant_bytes.size()) return 0;
  return options_.tenant_bytes[*tenant];
}

uint64_t DiskTier::TenantUsedLocked(int tenant) const {
  uint64_t used = 0;
  for (const auto& [ns, bytes] : ns_bytes_) {
    if (options_.tenant_of->Of(ns) == tenant) used += bytes;
  }
  return used;
}

uint64_t DiskTier::TenantBytes(int tenant) const {
  if (options_.tenant_of == nullptr) return 0;
  std::lock_guard lk(mu_);
  return TenantUsedLocked(tenant);
}

absl::Status DiskTier::Write(const BlockKey& key, const uint8_t* data, uint64_t length,
                             uint64_t checksum) {
  const uint64_t record_bytes = kRecordHeaderBytes + length;
  if (record_bytes > options_.bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "block record of ", record_bytes, " bytes exceeds the disk quota of ", options_.bytes));
  }
  int tenant = -1;
  if (uint64_t quota = TenantQuota(key.ns, &tenant); quota != 0 && record_bytes > quota) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "block record of ", record_bytes, " bytes exceeds its tenant's NVMe quota of ", quota));
  }
  if (std::string why = SpaceShortfall(record_bytes); !why.empty()) {
    queue_->set_paused(true);
    SetDegraded(why);
    return absl::ResourceExhaustedError(why);
  }
  std::vector<BlockKey> victims;
  absl::Status st =
      WriteRecord(key, EncodeRecord(data, length, checksum), length, checksum, &victims);
  if (st.ok()) Notify(victims, &key);
  return st;
}

absl::Status DiskTier::WriteRecord(const BlockKey& key, const std::string& record, uint64_t length,
                                   uint64_t checksum, std::vector<BlockKey>* victims) {
  const uint64_t record_bytes = record.size();
  if (auto s = WritesStopped(); !s.ok()) return s;
  std::lock_guard wl(write_mu_);
  WriteBatch batch;
  uint64_t seq;
  {
    std::lock_guard lk(mu_);
    if (index_.count(key)) return absl::OkStatus();
    uint64_t used = counters_.used_bytes.load();
    uint64_t freed = 0;
    auto evict = [&](const std::function<bool(uint64_t)>& which) {
      auto v = policy_->Evict(which);
      if (!v) return uint64_t{0};
      const BlockKey& vk = by_seq_.at(*v);
      batch.Delete(Column::kBlocks, EncodeBlockKey(vk));
      batch.Delete(Column::kIndex, EncodeBlockKey(vk));
      const uint64_t bytes = index_.at(vk).record_bytes;
      freed += bytes;
      victims->push_back(vk);
      return bytes;
    };
    // A tenant past its own quota makes room from its own blocks.
    int tenant = -1;
    if (uint64_t quota = TenantQuota(key.ns, &tenant); quota != 0) {
      uint64_t tenant_used = TenantUsedLocked(tenant);
      auto own = [&](uint64_t id) { return options_.tenant_of->Of(by_seq_.at(id).ns) == tenant; };
      while (tenant_used + record_bytes > quota) {
        uint64_t bytes = evict(own);
        if (bytes == 0) break;
        tenant_used -= bytes;
      }
    }
    while (used - freed + record_bytes > options_.bytes) {
      if (evict([](uint64_t) { return true; }) == 0) break;
    }
    seq = ++seq_;
  }
  std::string enc = EncodeBlockKey(key);
  batch.Put(Column::kBlocks, enc, record);
  batch.Put(Column::kIndex, enc, EncodeIndexEntry(IndexEntry{record_bytes, checksum, seq}));
  // Without mu_: lookups and reads go on while the record reaches the WAL
  // (a reader of a victim then finds it gone and counts a miss).
  absl::Status s = backend_->Write(batch, /*sync=*/options_.sync == DiskSync::kCommit);
  std::lock_guard lk(mu_);
  if (!s.ok()) {
    // Nothing was applied: put the victims back in the policy as they were.
    for (const auto& vk : *victims) policy_->Insert(index_.at(vk).seq);
    victims->clear();
    WriteFailed("writing a block", s);
    return s;
  }
  for (const auto& vk : *victims) {
    DropIndexLocked(vk);
    counters_.evictions.fetch_add(1, std::memory_order_relaxed);
  }
  index_[key] = IndexEntry{record_bytes, checksum, seq};
  by_seq_[seq] = key;
  if (options_.sync == DiskSync::kGroup) unsynced_.insert(key);
  if (options_.tenant_of) ns_bytes_[key.ns] += record_bytes;
  policy_->Insert(seq);
  counters_.used_bytes.fetch_add(record_bytes, std::memory_order_relaxed);
  counters_.items.fetch_add(1, std::memory_order_relaxed);
  counters_.bytes_in.fetch_add(length, std::memory_order_relaxed);
  SetDegraded("");
  return absl::OkStatus();
}

absl::StatusOr<std::string> DiskTier::Read(const BlockKey& key, uint64_t* checksum) {
  if (auto queued = queue_->Find(key)) {
    counters_.hits.fetch_add(1, std::memory_order_relaxed);
    counters_.bytes_out.fetch_add(queued->bytes.size(), std::memory_order_relaxed);
    *checksum = queued->checksum;
    return queued->bytes;
  }
  {
    std::lock_guard lk(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) {
      counters_.misses.fetch_add(1, std::memory_order_relaxed);
      return absl::NotFoundError("block is not on disk");
    }
    policy_->Touch(it->second.seq);
  }
  std::string payload;
  absl::Status decoded = absl::DataLossError("the disk returned no record for an indexed block");
  absl::Status s = backend_->Get(Column::kBlocks, EncodeBlockKey(key), [&](absl::string_view v) {
    auto rec = DecodeRecord(std::string_view(v.data(), v.size()));
    if (!rec.ok()) {
      decoded = rec.status();
      return;
    }
    payload.assign(rec->payload);  // the one copy of a disk read
    *checksum = rec->checksum;
    decoded = absl::OkStatus();
  });
  if (absl::IsNotFound(s)) {
    // Indexed but gone (a record removed behind the store's back): a miss,
    // and no longer indexed, so lookups stop offering it.
    counters_.misses.fetch_add(1, std::memory_order_relaxed);
    Log("store", "disk record of block ", ToHex(key.hash), " is missing; unindexed");
    EraseKeys({key});
    return absl::NotFoundError("block is not on disk");
  }
  if (s.ok()) s = decoded;
  if (!s.ok()) {
    if (!absl::IsDataLoss(s)) return s;  // I/O: the record may be fine
    checksum_failures_.fetch_add(1, std::memory_order_relaxed);
    Log("store", "disk record of block ", ToHex(key.hash), " rejected: ", s.message());
    EraseKeys({key});
    return s;
  }
  counters_.hits.fetch_add(1, std::memory_order_relaxed);
  counters_.bytes_out.fetch_add(payload.size(), std::memory_order_relaxed);
  return payload;
}

EraseCounts DiskTier::EraseKeys(const std::vector<BlockKey>& keys) {
  std::vector<BlockKey> gone;
  queue_->Erase(keys, &gone);
  EraseCounts c;
  c.erased = gone.size();
  {
    std::lock_guard wl(write_mu_);
    std::lock_guard lk(mu_);
    WriteBatch batch;
    std::vector<BlockKey> present;
    for (const auto& k : keys) {
      if (!index_.count(k)) continue;
      batch.Delete(Column::kBlocks, EncodeBlockKey(k));
      batch.Delete(Column::kIndex, EncodeBlockKey(k));
      present.push_back(k);
    }
    // After a write error the records stay on disk (nothing may be written);
    // they leave the index, so they are not served until the next start.
    absl::Status s =
        present.empty() || write_failed_ ? absl::OkStatus() : backend_->Write(batch, false);
    if (!s.ok()) {
      WriteFailed("erasing blocks", s);
      present.clear();
    }
    for (const auto& k : present) {
      auto it = index_.find(k);
      if (it == index_.end()) continue;  // the same key twice in `keys`
      policy_->Erase(it->second.seq);
      DropIndexLocked(k);
      ++c.erased;
      gone.push_back(k);
    }
  }
  Notify(gone, nullptr);
  return c;
}

std::vector<BlockKey> DiskTier::Keys() const {
  std::lock_guard lk(mu_);
  std::vector<BlockKey> out;
  out.reserve(index_.size());
  for (const auto& [k, e] : index_) out.push_back(k);
  return out;
}

EraseCounts DiskTier::Erase(const std::vector<BlockKey>& keys) { return EraseKeys(keys); }

EraseCounts DiskTier::EraseNamespace(uint64_t ns) {
  std::vector<BlockKey> keys = queue_->Keys(&ns);
  {
    std::lock_guard lk(mu_);
    for (const auto& [k, e] : index_) {
      if (k.ns == ns) keys.push_back(k);
    }
  }
  return EraseKeys(keys);
}

EraseCounts DiskTier::EraseAll() {
  std::vector<BlockKey> keys = queue_->Keys();
  {
    std::lock_guard lk(mu_);
    for (const auto& [k, e] : index_) keys.push_back(k);
  }
  return EraseKeys(keys);
}

}  // namespace kvtier::store
