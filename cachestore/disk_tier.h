// The NVMe tier: block records in RocksDB (BlobDB holds the large values),
// an in-memory index rebuilt from a small on-disk index column family at
// open, an eviction policy, a byte quota that is enforced before every write,
// and a bounded write-back queue drained by one writer thread.
//
// Column families: "default" holds records (record.h), "index" holds per
// block (record bytes, checksum, write sequence), "meta" holds store metadata
// (namespaces). A block's record and index entry are written in one batch.
// Every read verifies the record; a corrupt record is deleted and reported.
// Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "cachestore/eviction_policy.h"
#include "cachestore/ram_tier.h"
#include "cachestore/tier_stats.h"
#include "common/block_key.h"

namespace rocksdb {
class DB;
class ColumnFamilyHandle;
}  // namespace rocksdb

namespace kvtier::store {

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
};

struct DiskQueueStats {
  uint64_t blocks = 0, bytes = 0, dropped = 0;
};

class DiskTier {
 public:
  static absl::StatusOr<std::unique_ptr<DiskTier>> Open(const DiskTierOptions& options);
  // Drains the write-back queue, then closes the database.
  ~DiskTier();

  // Set once, before the tier is used. Not called under the tier's locks.
  // Safe while the writer runs: a listener being replaced or cleared is not
  // called once this returns.
  void SetChangeListener(ChangeListener listener) {
    std::lock_guard lk(listener_mu_);
    listener_ = std::move(listener);
  }
  // Every block on disk (for an initial announcement).
  std::vector<BlockKey> Keys() const;

  // True if the block is on disk or waiting in the write-back queue.
  bool Contains(const BlockKey& key) const;

  // Demotion sink: copies the block into the write-back queue. False if it
  // is not admitted or the queue is full (counted as dropped).
  bool Enqueue(const EvictedBlock& block);
  // Writes one block now, evicting others to stay within the quota.
  absl::Status Write(const BlockKey& key, const uint8_t* data, uint64_t length,
                     uint64_t checksum);
  // Reads and verifies a block (from the queue if it is still there).
  // NOT_FOUND if absent; DATA_LOSS if the record was corrupt (it is removed).
  absl::StatusOr<std::string> Read(const BlockKey& key, uint64_t* checksum);

  EraseCounts Erase(const std::vector<BlockKey>& keys);
  EraseCounts EraseNamespace(uint64_t ns);
  EraseCounts EraseAll();

  absl::Status SetPolicy(const std::string& name, const std::map<std::string, double>& params);
  std::string policy() const;
  std::map<std::string, double> policy_params() const;

  // Store metadata (e.g. namespaces) that must survive restarts.
  absl::Status PutMeta(const std::string& key, const std::string& value);
  std::vector<std::pair<std::string, std::string>> ScanMeta(const std::string& prefix) const;

  // Blocks until the write-back queue is empty (tests, shutdown).
  void WaitIdle();
  DiskQueueStats QueueStats() const;
  TierSnapshot Snapshot() const;
  uint64_t checksum_failures() const { return checksum_failures_.load(); }

 private:
  struct IndexEntry {
    uint64_t record_bytes;
    uint64_t checksum;
    uint64_t seq;  // write order; also the policy id
  };
  struct Pending {
    BlockKey key;
    std::string bytes;
    uint64_t checksum;
  };

  DiskTier() = default;
  void WriterLoop();
  // REQUIRES: mu_ held.
  void DropIndexLocked(const BlockKey& key);
  EraseCounts EraseKeys(const std::vector<BlockKey>& keys);
  EraseCounts EraseAndCollect(const std::vector<BlockKey>& keys, std::vector<BlockKey>* gone);
  absl::Status WriteAndCollect(const BlockKey& key, const std::string& record, uint64_t length,
                           uint64_t checksum, std::vector<BlockKey>* evicted);
  void SetDegraded(const std::string& reason);
  // Tells the listener (if any) that `removed` left the tier and `added`
  // (when not null) arrived.
  void Notify(const std::vector<BlockKey>& removed, const BlockKey* added);
  // Why a write of `bytes` more would cut into the reserve; empty if it fits
  // (or the filesystem cannot be asked).
  std::string SpaceShortfall(uint64_t bytes) const;

  DiskTierOptions options_;
  std::mutex listener_mu_;  // listener_; held while it is called
  ChangeListener listener_;
  rocksdb::DB* db_ = nullptr;
  rocksdb::ColumnFamilyHandle* blocks_cf_ = nullptr;
  rocksdb::ColumnFamilyHandle* index_cf_ = nullptr;
  rocksdb::ColumnFamilyHandle* meta_cf_ = nullptr;
  rocksdb::ColumnFamilyHandle* default_cf_ = nullptr;

  // Every RocksDB change (write, erase) and policy swap, in order. Held
  // across the RocksDB write; mu_ is taken only around index updates, so
  // Contains and Read do not wait for the WAL. Order: write_mu_, then mu_.
  std::mutex write_mu_;
  mutable std::mutex mu_;  // index_, by_seq_, policy_, seq_
  std::unordered_map<BlockKey, IndexEntry, BlockKeyHasher> index_;
  std::unordered_map<uint64_t, BlockKey> by_seq_;
  std::unique_ptr<EvictionPolicy> policy_;
  uint64_t seq_ = 0;

  mutable std::mutex queue_mu_;  // queue_, pending_, queue_bytes_, stop_
  std::condition_variable queue_cv_, idle_cv_;
  std::deque<std::shared_ptr<Pending>> queue_;
  std::unordered_map<BlockKey, std::shared_ptr<Pending>, BlockKeyHasher> pending_;
  uint64_t queue_bytes_ = 0;
  bool writing_ = false;
  bool stop_ = false;
  std::atomic<uint64_t> dropped_{0};
  std::atomic<bool> space_paused_{false};  // writes paused for want of free space
  // Set by the first failed RocksDB write. RocksDB 7.8 (as Debian builds it,
  // with assertions) aborts if a WAL writer that saw an error is used again,
  // by a write, Resume() or Close(); so from then on nothing is written (or
  // closed) until the store restarts. Reads go on.
  std::atomic<bool> write_failed_{false};
  absl::Status WritesStopped() const;
  void WriteFailed(const std::string& what, const std::string& error);
  std::thread writer_;

  mutable std::mutex degraded_mu_;
  std::atomic<bool> degraded_{false};  // written under degraded_mu_
  std::string degraded_reason_;

  TierCounters counters_;
  std::atomic<uint64_t> checksum_failures_{0};
};

}  // namespace kvtier::store
