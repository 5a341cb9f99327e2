// The NVMe tier: block records in a storage backend (RocksDB in production,
// storage_backend.h), an in-memory index rebuilt from the backend's small
// index column at open, an eviction policy, a byte quota enforced before
// every write, a free-space reserve, and a bounded write-back queue
// (write_back_queue.h) drained by one writer thread.
//
// A block's record and index entry are written in one batch. Every read
// verifies the record (record.h); a corrupt record is deleted, counted and
// never served. After a failed write (an I/O error) the tier writes nothing
// more until the store restarts and reports itself degraded; reads go on.
// Thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "cachestore/eviction_policy.h"
#include "cachestore/record.h"
#include "cachestore/storage_backend.h"
#include "cachestore/tenants.h"
#include "cachestore/tier.h"
#include "cachestore/tier_stats.h"
#include "cachestore/write_back_queue.h"
#include "common/block_key.h"
#include "common/limits.h"

namespace kvtier::store {

// When a block written to NVMe is durable against a host crash (power
// loss, a kernel panic), not just a crash of the store's process, which
// every mode survives (docs/reliability.md, "Durability").
enum class DiskSync {
  kNone,    // never fsynced by the store (the OS writes back in its time)
  kCommit,  // each block's write is fsynced before it counts as on NVMe
  kGroup,   // fsynced every sync_interval_ms; on NVMe once its group is
};

struct DiskTierOptions {
  std::string dir;
  uint64_t bytes = 1ull << 30;
  std::string policy = "lru";
  std::map<std::string, double> policy_params;
  uint64_t queue_bytes = 64ull << 20;  // write-back queue bound
  std::string admission = "all";       // "all" or "reused" (read at least once in RAM)
  // Free space kept on the data dir's filesystem. Below it, writes pause
  // (the tier reports degraded, reads go on) until space returns: RocksDB is
  // never driven into ENOSPC by the store's own writes, so it never enters
  // its write-error state.
  uint64_t reserve_bytes = 64ull << 20;
  // Tenants (tenants.h): most bytes each tenant's blocks may take, by the
  // tenant's index (0: no limit of its own); a write past it evicts that
  // tenant's own blocks first. tenant_of says whose each namespace is and
  // must outlive the tier. Empty: no tenant limits.
  std::vector<uint64_t> tenant_bytes;
  const NamespaceTenants* tenant_of = nullptr;
  DiskSync sync = DiskSync::kNone;
  uint64_t sync_interval_ms = limits::kDiskSyncIntervalMs;  // kGroup's period

  // INVALID_ARGUMENT naming the field: unknown admission or policy, a zero
  // quota, a group sync without an interval.
  absl::Status Validate() const;
};

struct DiskQueueStats {
  uint64_t blocks = 0, bytes = 0, dropped = 0;
};

class DiskTier : public Tier {
 public:
  // Opens RocksDB in options.dir. INVALID_ARGUMENT for a bad option or an
  // uncreatable dir; UNAVAILABLE / DATA_LOSS from the backend.
  static absl::StatusOr<std::unique_ptr<DiskTier>> Open(const DiskTierOptions& options);
  // Over any backend (tests pass a FaultInjectingBackend); options.dir is
  // then only used in messages.
  static absl::StatusOr<std::unique_ptr<DiskTier>> Open(const DiskTierOptions& options,
                                                        std::unique_ptr<StorageBackend> backend);
  // Drains the write-back queue, then closes the backend.
  ~DiskTier() override;

  // Not called under the tier's locks.
  void SetChangeListener(ChangeListener listener) override;
  // Every block on disk (for an initial announcement).
  std::vector<BlockKey> Keys() const;

  // True if the block is on disk or waiting in the write-back queue.
  bool Contains(const BlockKey& key) const override;
  // On NVMe: written, so it survives a crash of the process (a queued block
  // does not), and with DiskSync kCommit or kGroup fsynced, so it survives
  // a crash of the host too (kGroup: once its group's fsync returned).
  bool Durable(const BlockKey& key) const;
  // Group fsyncs done (kGroup), and fsyncs that failed.
  uint64_t syncs() const { return syncs_.load(); }
  uint64_t sync_failures() const { return sync_failures_.load(); }

  // Demotion sink: copies the block into the write-back queue. False if it
  // is not admitted, writes are stopped or paused, or the queue is full
  // (counted as dropped).
  bool Enqueue(const EvictedBlock& block);
  // Writes one block now, evicting others to stay within the quota.
  // RESOURCE_EXHAUSTED if the record exceeds the quota or the filesystem is
  // below its reserve; the backend's error for a failing write
  // (UNAVAILABLE, RESOURCE_EXHAUSTED for a full device, DATA_LOSS), and
  // UNAVAILABLE for every write after it.
  absl::Status Write(const BlockKey& key, const uint8_t* data, uint64_t length, uint64_t checksum);
  // Reads and verifies a block (from the queue if it is still there).
  // NOT_FOUND if absent; DATA_LOSS if the record was corrupt (it is removed);
  // UNAVAILABLE if the backend could not read it.
  absl::StatusOr<std::string> Read(const BlockKey& key, uint64_t* checksum);

  EraseCounts Erase(const std::vector<BlockKey>& keys) override;
  EraseCounts EraseNamespace(uint64_t ns) override;
  EraseCounts EraseAll() override;

  absl::Status SetPolicy(const std::string& name,
                         const std::map<std::string, double>& params) override;
  std::string policy() const override;
  std::map<std::string, double> policy_params() const override;

  // Store metadata (e.g. namespaces) that must survive restarts, written
  // synchronously. UNAVAILABLE after a write error.
  absl::Status PutMeta(const std::string& key, const std::string& value);
  absl::Status DeleteMeta(const std::string& key);
  // The metadata records under `prefix`, all of them or the backend's error
  // (a partial list would lose, e.g., namespaces).
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ScanMeta(
      const std::string& prefix) const;
  // Index entries found at open that could not be decoded (their blocks
  // are not served).
  uint64_t skipped_index_entries() const { return skipped_index_entries_; }

  // Bytes on NVMe of a tenant's blocks (DiskTierOptions::tenant_of).
  uint64_t TenantBytes(int tenant) const;
  // Blocks until the write-back queue is empty (tests, shutdown).
  void WaitIdle();
  DiskQueueStats QueueStats() const;
  TierSnapshot Snapshot() const override;
  uint64_t checksum_failures() const { return checksum_failures_.load(); }

 private:
  DiskTier() = default;
  // REQUIRES: mu_ held.
  void DropIndexLocked(const BlockKey& key);
  // The quota of the tenant owning ns (0: none) and its index.
  uint64_t TenantQuota(uint64_t ns, int* tenant) const;
  // REQUIRES: mu_ held. Bytes on disk of the tenant's namespaces.
  uint64_t TenantUsedLocked(int tenant) const;
  EraseCounts EraseKeys(const std::vector<BlockKey>& keys);
  absl::Status WriteRecord(const BlockKey& key, const std::string& record, uint64_t length,
                           uint64_t checksum, std::vector<BlockKey>* evicted);
  void SetDegraded(const std::string& reason);
  // kGroup: every sync_interval_ms, fsyncs what was written since the last
  // group, then counts it durable.
  void SyncLoop();
  // One group: the keys written so far become durable once fsynced.
  void SyncGroup();
  // Tells the listener (if any) that `removed` left the tier and `added`
  // (when not null) arrived.
  void Notify(const std::vector<BlockKey>& removed, const BlockKey* added);
  // Why a write of `bytes` more would cut into the reserve; empty if it fits
  // (or the filesystem cannot be asked).
  std::string SpaceShortfall(uint64_t bytes) const;
  absl::Status WritesStopped() const;
  void WriteFailed(const std::string& what, const absl::Status& error);

  DiskTierOptions options_;
  std::unique_ptr<StorageBackend> backend_;
  std::mutex listener_mu_;  // listener_; held while it is called
  ChangeListener listener_;

  // Every backend change (write, erase) and policy swap, in order. Held
  // across the backend write; mu_ is taken only around index updates, so
  // Contains and Read do not wait for the WAL. Order: write_mu_, then mu_.
  std::mutex write_mu_;
  mutable std::mutex mu_;  // index_, by_seq_, policy_, seq_
  std::unordered_map<BlockKey, IndexEntry, BlockKeyHasher> index_;
  std::unordered_map<uint64_t, BlockKey> by_seq_;
  // Record bytes per namespace, kept only with tenants (their quotas).
  std::unordered_map<uint64_t, uint64_t> ns_bytes_;
  std::unique_ptr<EvictionPolicy> policy_;
  uint64_t seq_ = 0;
  uint64_t skipped_index_entries_ = 0;  // set at open

  std::atomic<uint64_t> dropped_{0};
  // Set by the first failed backend write; from then on nothing is written
  // until the store restarts (see rocksdb_backend.h). Reads go on.
  std::atomic<bool> write_failed_{false};

  mutable std::mutex degraded_mu_;
  std::atomic<bool> degraded_{false};  // written under degraded_mu_
  std::string degraded_reason_;

  TierCounters counters_;
  std::atomic<uint64_t> checksum_failures_{0};

  // kGroup: blocks written (in index_) but not yet fsynced, and those the
  // running fsync covers; neither is Durable yet. Guarded by mu_.
  std::unordered_set<BlockKey, BlockKeyHasher> unsynced_, syncing_;
  std::atomic<uint64_t> syncs_{0}, sync_failures_{0};
  std::mutex sync_mu_;  // sync_stop_
  std::condition_variable sync_cv_;
  bool sync_stop_ = false;
  std::thread syncer_;
  // Last member: destroyed first, draining into the members above.
  std::unique_ptr<WriteBackQueue> queue_;
};

}  // namespace kvtier::store
