// A StorageBackend that forwards to another and injects the faults the disk
// tier must survive: a filesystem short of space, failing writes, failing
// reads, and records that come back corrupt. Tests build a DiskTier (or a
// Store) over it, so disk-full, write-error and corruption behaviour are
// fast unit tests; the process-level tests (tmpfs, prlimit) stay as well.
// Thread-safe.
#pragma once

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "cachestore/storage_backend.h"

namespace kvtier::store {

class FaultInjectingBackend : public StorageBackend {
 public:
  explicit FaultInjectingBackend(std::unique_ptr<StorageBackend> base) : base_(std::move(base)) {}

  // FreeBytes answers this instead of asking the filesystem; nullopt: ask.
  void set_free_bytes(std::optional<uint64_t> bytes) {
    std::lock_guard lk(mu_);
    free_bytes_ = bytes;
  }
  // Every Write fails with this status and applies nothing; OK: writes pass.
  void set_write_error(absl::Status s) {
    std::lock_guard lk(mu_);
    write_error_ = std::move(s);
  }
  // Every Get fails with this status; OK: reads pass.
  void set_read_error(absl::Status s) {
    std::lock_guard lk(mu_);
    read_error_ = std::move(s);
  }
  // Get of the blocks column flips one byte of the value at this offset
  // (past its end: the last byte); nullopt: values pass unchanged.
  void set_corrupt_block_reads(std::optional<size_t> offset) {
    std::lock_guard lk(mu_);
    corrupt_at_ = offset;
  }
  // What Get of the blocks column finds where a record should be: the
  // record (kNone), no record (kMissing: NOT_FOUND, a file removed behind
  // the store's back), a zero-length value (kEmpty: an empty file read back),
  // or an OK answer that delivers no value at all (kNoValue).
  enum class RecordFault { kNone, kMissing, kEmpty, kNoValue };
  void set_block_record_fault(RecordFault f) {
    std::lock_guard lk(mu_);
    record_fault_ = f;
  }
  // Every Scan of `column` fails with this status; OK: scans pass.
  void set_scan_error(Column column, absl::Status s) {
    std::lock_guard lk(mu_);
    scan_errors_[static_cast<int>(column)] = std::move(s);
  }
  // Every Sync fails with this status; OK: syncs pass.
  void set_sync_error(absl::Status s) {
    std::lock_guard lk(mu_);
    sync_error_ = std::move(s);
  }
  uint64_t writes_attempted() const { return writes_.load(); }
  // Writes asked to sync, and Syncs that reached the base.
  uint64_t synced_writes() const { return synced_writes_.load(); }
  uint64_t syncs() const { return syncs_.load(); }

  absl::Status Write(const WriteBatch& batch, bool sync) override {
    writes_.fetch_add(1);
    {
      std::lock_guard lk(mu_);
      if (!write_error_.ok()) return write_error_;
    }
    if (sync) synced_writes_.fetch_add(1);
    return base_->Write(batch, sync);
  }
  absl::Status Sync() override {
    {
      std::lock_guard lk(mu_);
      if (!sync_error_.ok()) return sync_error_;
    }
    syncs_.fetch_add(1);
    return base_->Sync();
  }
  absl::Status Get(Column column, absl::string_view key,
                   const std::function<void(absl::string_view)>& use) override {
    std::optional<size_t> corrupt;
    RecordFault fault = RecordFault::kNone;
    {
      std::lock_guard lk(mu_);
      if (!read_error_.ok()) return read_error_;
      if (column == Column::kBlocks) {
        corrupt = corrupt_at_;
        fault = record_fault_;
      }
    }
    switch (fault) {
      case RecordFault::kMissing:
        return absl::NotFoundError("injected: the record is gone");
      case RecordFault::kEmpty:
        use(absl::string_view());
        return absl::OkStatus();
      case RecordFault::kNoValue:
        return absl::OkStatus();
      case RecordFault::kNone:
        break;
    }
    if (!corrupt) return base_->Get(column, key, use);
    return base_->Get(column, key, [&](absl::string_view v) {
      std::string bad(v);
      if (!bad.empty()) bad[std::min(*corrupt, bad.size() - 1)] ^= 0x5a;
      use(bad);
    });
  }
  absl::Status Scan(
      Column column, absl::string_view prefix,
      const std::function<bool(absl::string_view, absl::string_view)>& visit) const override {
    {
      std::lock_guard lk(mu_);
      if (!scan_errors_[static_cast<int>(column)].ok())
        return scan_errors_[static_cast<int>(column)];
    }
    return base_->Scan(column, prefix, visit);
  }
  absl::StatusOr<uint64_t> FreeBytes() const override {
    {
      std::lock_guard lk(mu_);
      if (free_bytes_) return *free_bytes_;
    }
    return base_->FreeBytes();
  }
  std::string location() const override { return base_->location(); }

 private:
  std::unique_ptr<StorageBackend> base_;
  mutable std::mutex mu_;
  std::optional<uint64_t> free_bytes_;
  absl::Status write_error_;
  absl::Status sync_error_;
  absl::Status read_error_;
  absl::Status scan_errors_[kColumns];
  std::optional<size_t> corrupt_at_;
  RecordFault record_fault_ = RecordFault::kNone;
  std::atomic<uint64_t> writes_{0};
  std::atomic<uint64_t> synced_writes_{0};
  std::atomic<uint64_t> syncs_{0};
};

}  // namespace kvtier::store
