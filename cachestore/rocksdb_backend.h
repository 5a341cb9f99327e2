// The disk tier's storage on RocksDB: one column family per Column, block
// records in BlobDB blob files (no compression: KV tensors do not compress),
// the WAL always on, free space from statvfs(2) of the data dir.
//
// RocksDB statuses map to absl codes once, here: Corruption → DATA_LOSS,
// NoSpace → RESOURCE_EXHAUSTED, NotFound → NOT_FOUND, IOError and the rest →
// UNAVAILABLE; every message names the operation and the directory.
//
// After a failed write the database is not closed at destruction: Debian's
// RocksDB 7.8 is built with assertions and aborts if a WAL writer that saw an
// error is used again (by a write, Resume() or Close()). Everything
// acknowledged before the error is in the WAL or SST files and comes back at
// the next start. Thread-safe.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cachestore/storage_backend.h"

namespace rocksdb {
class DB;
class ColumnFamilyHandle;
}  // namespace rocksdb

namespace kvtier::store {

class RocksDbBackend : public StorageBackend {
 public:
  // Creates dir if needed and opens (or creates) the database in it.
  // INVALID_ARGUMENT if the directory cannot be created; UNAVAILABLE (or
  // DATA_LOSS for a corrupt database) if RocksDB cannot open it.
  static absl::StatusOr<std::unique_ptr<RocksDbBackend>> Open(const std::string& dir);
  ~RocksDbBackend() override;

  absl::Status Write(const WriteBatch& batch, bool sync) override;
  absl::Status Get(Column column, absl::string_view key,
                   const std::function<void(absl::string_view)>& use) override;
  absl::Status Scan(Column column, absl::string_view prefix,
                    const std::function<bool(absl::string_view key, absl::string_view value)>&
                        visit) const override;
  absl::Status Sync() override;
  absl::StatusOr<uint64_t> FreeBytes() const override;
  std::string location() const override { return dir_; }

 private:
  RocksDbBackend() = default;
  rocksdb::ColumnFamilyHandle* handle(Column c) const { return cf_[static_cast<int>(c)]; }

  std::string dir_;
  rocksdb::DB* db_ = nullptr;
  rocksdb::ColumnFamilyHandle* default_cf_ = nullptr;
  rocksdb::ColumnFamilyHandle* cf_[kColumns] = {nullptr, nullptr, nullptr};
  std::atomic<bool> write_failed_{false};  // see the header comment
};

}  // namespace kvtier::store
