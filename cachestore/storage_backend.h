// The disk tier's seam to its storage engine and filesystem (LevelDB's Env
// idea): an ordered key-value store with a few column families, atomic
// write batches, and a question about free space. RocksDbBackend
// (rocksdb_backend.h) is the real one; FaultInjectingBackend
// (fault_injecting_backend.h) wraps any backend to make the filesystem full,
// writes fail or records corrupt on demand, so the disk tier's answer to
// each is a unit test.
//
// Implementations are safe for concurrent use by multiple threads without
// external synchronization.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvtier::store {

// The disk tier's column families: block records, the small per-block index
// rebuilt into memory at start, and store metadata (namespaces).
enum class Column { kBlocks = 0, kIndex = 1, kMeta = 2 };
inline constexpr int kColumns = 3;

// Puts and deletes applied together or not at all.
class WriteBatch {
 public:
  struct Op {
    Column column;
    std::string key;
    std::string value;  // empty for a delete
    bool is_delete;
  };
  void Put(Column c, std::string key, std::string value) {
    ops_.push_back(Op{c, std::move(key), std::move(value), false});
  }
  void Delete(Column c, std::string key) { ops_.push_back(Op{c, std::move(key), {}, true}); }
  const std::vector<Op>& ops() const { return ops_; }
  bool empty() const { return ops_.empty(); }

 private:
  std::vector<Op> ops_;
};

class StorageBackend {
 public:
  virtual ~StorageBackend() = default;

  // Applies the batch atomically; with sync, durable when this returns (the
  // WAL is always on: an acknowledged write survives a kill -9 either way).
  // UNAVAILABLE for an I/O error, RESOURCE_EXHAUSTED for a full device,
  // DATA_LOSS for corruption found on the way.
  virtual absl::Status Write(const WriteBatch& batch, bool sync) = 0;

  // Calls use(value) with the value under key, valid only during the call
  // (the engine's own buffer where it can pin one: a block read copies its
  // payload once, in `use`). NOT_FOUND if absent; DATA_LOSS if the engine
  // found the data corrupt; UNAVAILABLE for an I/O error.
  virtual absl::Status Get(Column column, absl::string_view key,
                           const std::function<void(absl::string_view value)>& use) = 0;

  // Calls visit(key, value) for each key with the prefix, in key order,
  // until it returns false. Errors as Get.
  virtual absl::Status Scan(
      Column column, absl::string_view prefix,
      const std::function<bool(absl::string_view key, absl::string_view value)>& visit) const = 0;

  // Makes every write that returned so far durable (fsync of the WAL):
  // what a write without sync needs to survive a host crash. UNAVAILABLE
  // for an I/O error.
  virtual absl::Status Sync() = 0;

  // Bytes the filesystem holding the data still has for this process;
  // UNAVAILABLE when it cannot be asked.
  virtual absl::StatusOr<uint64_t> FreeBytes() const = 0;

  // Where the data lives (for messages).
  virtual std::string location() const = 0;
};

}  // namespace kvtier::store
