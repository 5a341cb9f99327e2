// Eviction policies: which resident of a tier leaves next.
//
// A policy tracks opaque 64-bit resident ids; the tier that owns it calls
// Insert when a block becomes resident, Touch on each read, Erase when a
// block leaves for another reason, and Evict when it needs room. Evict
// skips residents the tier says it cannot drop right now (pinned by a lease)
// and returns nullopt if none can go. Not thread-safe: the owning tier shard
// serialises calls under its own lock.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvtier::store {

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual std::string name() const = 0;
  virtual std::map<std::string, double> params() const { return {}; }
  // REQUIRES: id is not resident.
  virtual void Insert(uint64_t id) = 0;
  // No-op if id is not resident.
  virtual void Touch(uint64_t id) = 0;
  // No-op if id is not resident.
  virtual void Erase(uint64_t id) = 0;
  // Removes and returns the next victim for which can_evict(id) holds.
  virtual std::optional<uint64_t> Evict(const std::function<bool(uint64_t)>& can_evict) = 0;
  virtual size_t size() const = 0;
};

// The policy names kvtier knows: "lru", "s3fifo", "sieve".
const std::vector<std::string>& PolicyNames();

// Builds a policy by name. params: s3fifo takes "small_fraction" in
// 0.01..0.5 (default 0.1). Unknown names or parameters are INVALID_ARGUMENT.
absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakePolicy(
    const std::string& name, const std::map<std::string, double>& params = {});

}  // namespace kvtier::store
