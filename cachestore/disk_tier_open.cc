// Opening the NVMe tier: the backend, the in-memory index rebuilt from its
// index column (entries that do not decode are skipped, counted and said),
// and the write-back queue.
#include "cachestore/disk_tier.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cachestore/rocksdb_backend.h"
#include "common/log.h"

namespace kvtier::store {

absl::StatusOr<std::unique_ptr<DiskTier>> DiskTier::Open(const DiskTierOptions& o) {
  if (auto s = o.Validate(); !s.ok()) return s;
  auto backend = RocksDbBackend::Open(o.dir);
  if (!backend.ok()) return backend.status();
  return Open(o, std::move(*backend));
}

absl::StatusOr<std::unique_ptr<DiskTier>> DiskTier::Open(const DiskTierOptions& o,
                                                         std::unique_ptr<StorageBackend> backend) {
  if (auto s = o.Validate(); !s.ok()) return s;
  std::unique_ptr<DiskTier> t(new DiskTier());
  t->options_ = o;
  t->policy_ = *MakePolicy(o.policy, o.policy_params);
  t->backend_ = std::move(backend);

  // Rebuild the in-memory index from the small index column, oldest write
  // first so the policy starts in write order.
  std::vector<std::pair<BlockKey, IndexEntry>> found;
  uint64_t undecodable = 0;
  absl::Status s =
      t->backend_->Scan(Column::kIndex, "", [&](absl::string_view k, absl::string_view v) {
        BlockKey key;
        IndexEntry e;
        if (DecodeBlockKey(std::string_view(k.data(), k.size()), &key) &&
            DecodeIndexEntry(std::string_view(v.data(), v.size()), &e)) {
          found.emplace_back(key, e);
        } else {
          ++undecodable;  // its block cannot be found: counted, and said below
        }
        return true;
      });
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("reading the NVMe tier's index at ",
                                               t->backend_->location(), ": ", s.message()));
  }
  t->skipped_index_entries_ = undecodable;
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.second.seq < b.second.seq; });
  uint64_t used = 0;
  for (const auto& [key, e] : found) {
    t->index_[key] = e;
    t->by_seq_[e.seq] = key;
    t->policy_->Insert(e.seq);
    t->seq_ = std::max(t->seq_, e.seq);
    used += e.record_bytes;
    if (o.tenant_of) t->ns_bytes_[key.ns] += e.record_bytes;
  }
  t->counters_.used_bytes = used;
  t->counters_.items = t->index_.size();
  Log("store", "disk tier opened at ", t->backend_->location(), ": ", t->index_.size(), " blocks, ",
      used, " bytes recovered");
  if (undecodable > 0) {
    Log("store", "disk tier: ", undecodable,
        " index entries could not be decoded and were "
        "skipped (their blocks are not served; kvtier_store_disk_index_entries_skipped)");
  }
  DiskTier* self = t.get();
  t->queue_ = std::make_unique<WriteBackQueue>(
      o.queue_bytes,
      WriteBackQueue::Callbacks{[self](const WriteBackQueue::Block& b) {
                                  absl::Status st = self->Write(
                                      b.key, reinterpret_cast<const uint8_t*>(b.bytes.data()),
                                      b.bytes.size(), b.checksum);
                                  // The block leaves the cache: RAM evicted it and NVMe could not
                                  // take it.
                                  if (!st.ok())
                                    self->dropped_.fetch_add(1, std::memory_order_relaxed);
                                  return st;
                                },
                                [self](const BlockKey& key) { self->EraseKeys({key}); },
                                [self] {
                                  if (self->write_failed_ || !self->SpaceShortfall(0).empty())
                                    return false;
                                  self->SetDegraded("");
                                  return true;
                                }});
  if (o.sync == DiskSync::kGroup) t->syncer_ = std::thread([self] { self->SyncLoop(); });
  return t;
}

}  // namespace kvtier::store
