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
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "cachestore/disk_tier.h"
#include "cachestore/tenants.h"
#include "common/block_key.h"

namespace kvtier::store {

struct NamespaceInfo {
  uint64_t id;         // what the store keys blocks under
  NamespaceSpec spec;  // as stored (with its tenant's salt, tenants.h)
  uint64_t block_bytes;
  int tenant = -1;            // the owning tenant's index; -1: none
  uint64_t client_id = 0;     // the id its tenant names it by (= id without one)
  NamespaceSpec client_spec;  // the spec as its tenant registered it
};

class NamespaceRegistry {
 public:
  // Loads the persisted namespaces: the metadata scan's error if it fails
  // (a store must not start without some of its namespaces); unreadable
  // records are logged, counted (skipped_records) and left out. disk must
  // outlive the registry.
  // max_namespaces: how many may be registered at once (0: no limit);
  // those loaded at start count.
  // tenants (may be null): namespaces are then registered by tenants, each
  // under its salt, and owners is kept told whose each one is.
  static absl::StatusOr<std::unique_ptr<NamespaceRegistry>> Load(
      DiskTier* disk, size_t max_namespaces = 0, std::shared_ptr<const Tenants> tenants = nullptr,
      NamespaceTenants* owners = nullptr);
  // Persisted records Load could not read.
  uint64_t skipped_records() const { return skipped_records_; }

  // INVALID_ARGUMENT for a spec out of limits (block_key.h), an
  // expected_id (nonzero) that is not the spec's id, or blocks larger than
  // max_block_bytes (the message names the flag to raise).
  // RESOURCE_EXHAUSTED for a new namespace past max_namespaces (the
  // message names the flag and kvctl namespaces rm).
  // With a tenant: its salt goes into the stored spec, expected_id is
  // checked against the unsalted spec's id, its namespace limit applies
  // (RESOURCE_EXHAUSTED) and its models (PERMISSION_DENIED).
  absl::StatusOr<NamespaceInfo> Register(const NamespaceSpec& spec, uint64_t expected_id,
                                         uint64_t max_block_bytes, const Tenant* tenant = nullptr);
  // The namespace a tenant names client_id; NOT_FOUND, worded as for an
  // unregistered one, when the tenant has registered none of that id
  // (whoever else has).
  absl::StatusOr<NamespaceInfo> Resolve(const Tenant& tenant, uint64_t client_id) const;
  // Forgets a namespace here and on disk: requests naming it are NOT_FOUND
  // from now on (its blocks are the caller's to drop). NOT_FOUND if it is
  // not registered.
  absl::StatusOr<NamespaceInfo> Remove(uint64_t id);
  // NOT_FOUND naming the namespace if it is not registered.
  absl::StatusOr<NamespaceInfo> Find(uint64_t id) const;
  // Every namespace, or only a tenant's.
  std::vector<NamespaceInfo> List(const Tenant* tenant = nullptr) const;

 private:
  NamespaceRegistry(DiskTier* disk, size_t max_namespaces, std::shared_ptr<const Tenants> tenants,
                    NamespaceTenants* owners);
  uint64_t skipped_records_ = 0;  // set by Load
  // REQUIRES: mu_ held.
  void AddLocked(const NamespaceInfo& info);
  // RESOURCE_EXHAUSTED naming the limit one more namespace would pass (the
  // tenant's or the store's). REQUIRES: mu_ held.
  absl::Status LimitsAllowLocked(const std::string& name, const NamespaceSpec& client_spec,
                                 const Tenant* tenant) const;

  DiskTier* disk_;
  const size_t max_namespaces_;
  const std::shared_ptr<const Tenants> tenants_;
  NamespaceTenants* const owners_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, NamespaceInfo> namespaces_;
  std::map<std::pair<int, uint64_t>, uint64_t> by_tenant_;  // (tenant, client id) -> id
  std::vector<size_t> per_tenant_;                          // namespaces each tenant holds
};

}  // namespace kvtier::store
