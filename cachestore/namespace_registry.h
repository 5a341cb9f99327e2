// The namespaces a store serves: registered by workers, persisted in the
// NVMe tier's metadata so they survive a restart, looked up by every
// request.
//
// Registering the same spec again returns the existing entry. If the NVMe
// tier takes no writes (degraded), a namespace is kept in memory only: none
// of its blocks can be on disk then, and its workers register it again after
// a restart. Thread-safe.
#pragma once

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "cachestore/disk_tier.h"
#include "common/block_key.h"

namespace kvtier::store {

struct NamespaceInfo {
  uint64_t id;
  NamespaceSpec spec;
  uint64_t block_bytes;
};

class NamespaceRegistry {
 public:
  // Loads the persisted namespaces (unreadable records are logged and
  // skipped). disk must outlive the registry.
  explicit NamespaceRegistry(DiskTier* disk);

  // INVALID_ARGUMENT for a spec out of limits (block_key.h), an
  // expected_id (nonzero) that is not the spec's id, or blocks larger than
  // max_block_bytes (the message names the flag to raise).
  absl::StatusOr<NamespaceInfo> Register(const NamespaceSpec& spec, uint64_t expected_id,
                                         uint64_t max_block_bytes);
  // NOT_FOUND naming the namespace if it is not registered.
  absl::StatusOr<NamespaceInfo> Find(uint64_t id) const;
  std::vector<NamespaceInfo> List() const;

 private:
  DiskTier* disk_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, NamespaceInfo> namespaces_;
};

}  // namespace kvtier::store
