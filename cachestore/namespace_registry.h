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
  // max_namespaces: how many may be registered at once (0: no limit);
  // those loaded at start count.
  explicit NamespaceRegistry(DiskTier* disk, size_t max_namespaces = 0);

  // INVALID_ARGUMENT for a spec out of limits (block_key.h), an
  // expected_id (nonzero) that is not the spec's id, or blocks larger than
  // max_block_bytes (the message names the flag to raise).
  // RESOURCE_EXHAUSTED for a new namespace past max_namespaces (the
  // message names the flag and kvctl namespaces rm).
  absl::StatusOr<NamespaceInfo> Register(const NamespaceSpec& spec, uint64_t expected_id,
                                         uint64_t max_block_bytes);
  // Forgets a namespace here and on disk: requests naming it are NOT_FOUND
  // from now on (its blocks are the caller's to drop). NOT_FOUND if it is
  // not registered.
  absl::StatusOr<NamespaceInfo> Remove(uint64_t id);
  // NOT_FOUND naming the namespace if it is not registered.
  absl::StatusOr<NamespaceInfo> Find(uint64_t id) const;
  std::vector<NamespaceInfo> List() const;

 private:
  DiskTier* disk_;
  const size_t max_namespaces_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, NamespaceInfo> namespaces_;
};

}  // namespace kvtier::store
