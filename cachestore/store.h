// The cache service core: namespaces, the two tiers, movement between them,
// and leases. The gRPC service (service.h) is a thin layer over this class;
// tests drive it directly too.
//
// Every operation validates its input first and returns a status whose
// message names the problem; a refused call changes nothing. Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "cachestore/disk_tier.h"
#include "cachestore/ram_tier.h"
#include "common/block_key.h"
#include "common/router_client.h"

namespace kvtier::store {

// Most block hashes one request may name (documented in store.proto).
inline constexpr size_t kMaxBlocksPerRequest = 8192;

enum class Tier { kRam = 1, kDisk = 2 };

struct StoreOptions {
  RamTierOptions ram;
  DiskTierOptions disk;
  uint64_t lease_ms = 10000;
  // Hash every slot at CommitPut and refuse a mismatch (one pass over the
  // bytes). Off: the client's checksum is stored as given and readers catch
  // corruption (they verify every block) -- faster, weaker.
  bool verify_commits = true;
  // Open leases one client may hold (put and get together); 0: no limit.
  uint64_t max_leases_per_client = 1024;
  // Routers to publish this shard's blocks to (BlockStored when a block
  // enters the store, BlockRemoved when it leaves both tiers); may be empty.
  std::vector<std::string> routers;
  ChannelSecurity router_security;  // how the shard reaches its routers
  std::string store_id = "kvtier-store";
  // Well under any sensible router heartbeat deadline (1 s and up).
  uint64_t heartbeat_ms = 250;
};

struct NamespaceInfo {
  uint64_t id;
  NamespaceSpec spec;
  uint64_t block_bytes;
};

struct PutTarget {
  Placement placement;
  Slot slot;  // set when placement == kReserved
};

struct BeginPutResult {
  uint64_t lease = 0;  // 0 when nothing was reserved
  std::vector<PutTarget> targets;
};

struct GetSource {
  Tier tier;  // where the block was before this call
  Slot slot;
};

struct BeginGetResult {
  uint64_t lease = 0;  // 0 when nothing was pinned
  std::vector<GetSource> sources;
};

struct InlinePutResult {
  enum Outcome { kStored, kAlreadyPresent, kNoSpace } outcome;
};

struct EvictResult {
  uint64_t ram_blocks = 0, disk_blocks = 0, pinned_blocks = 0;
};

struct StoreStats {
  TierSnapshot ram, disk;
  DiskQueueStats queue;
  uint64_t put_leases = 0, get_leases = 0, leases_expired = 0, checksum_failures = 0;
};

class Store {
 public:
  static absl::StatusOr<std::unique_ptr<Store>> Open(const StoreOptions& options);
  ~Store();

  absl::StatusOr<NamespaceInfo> RegisterNamespace(const NamespaceSpec& spec, uint64_t expected_id);
  std::vector<NamespaceInfo> ListNamespaces() const;

  // Tier of each leading present block.
  absl::StatusOr<std::vector<Tier>> Lookup(uint64_t ns, std::span<const BlockHash> hashes) const;

  absl::StatusOr<BeginPutResult> BeginPut(uint64_t ns, std::span<const BlockHash> hashes,
                                          const std::string& client);
  // checksums: one per reserved target, in order. All-or-nothing.
  absl::StatusOr<uint32_t> CommitPut(uint64_t lease, std::span<const uint64_t> checksums);
  absl::Status AbortPut(uint64_t lease);

  absl::StatusOr<BeginGetResult> BeginGet(uint64_t ns, std::span<const BlockHash> hashes,
                                          const std::string& client);
  absl::Status EndGet(uint64_t lease);

  absl::StatusOr<InlinePutResult> PutInline(uint64_t ns, const BlockHash& hash,
                                            std::string_view data, uint64_t checksum);
  // Calls emit(index, tier, bytes, checksum) for each leading present block,
  // stopping early if emit returns false. bytes are valid during the call.
  absl::Status GetInline(
      uint64_t ns, std::span<const BlockHash> hashes,
      const std::function<bool(uint32_t, Tier, std::string_view, uint64_t)>& emit);

  absl::StatusOr<EvictResult> EvictAll();
  absl::StatusOr<EvictResult> EvictNamespace(uint64_t ns);
  absl::StatusOr<EvictResult> EvictKeys(std::span<const BlockKey> keys);

  absl::Status SetPolicy(Tier tier, const std::string& name,
                         const std::map<std::string, double>& params);
  std::pair<std::string, std::map<std::string, double>> GetPolicy(Tier tier) const;

  StoreStats Stats() const;
  uint64_t lease_ms() const { return options_.lease_ms; }
  RamTier& ram() { return *ram_; }
  DiskTier& disk() { return *disk_; }

 private:
  struct Lease {
    std::string client;
    bool is_put;
    std::chrono::steady_clock::time_point deadline;
    std::vector<std::pair<BlockKey, Slot>> items;
  };

  Store() = default;
  absl::StatusOr<NamespaceInfo> CheckRequest(uint64_t ns, std::span<const BlockHash> hashes) const;
  // Registers a lease whose client slot was claimed (ClaimClientLeaseLocked).
  uint64_t AddLease(Lease lease);
  // Counts one more open lease for client, or refuses past the per-client
  // limit; check and count in one step, so concurrent calls cannot overshoot.
  // REQUIRES: lease_mu_ held.
  absl::Status ClaimClientLeaseLocked(const std::string& client);
  // Gives back a claim that did not become a lease.
  void ReturnClientLease(const std::string& client);
  void ForgetLeaseLocked(const Lease& lease);
  // Removes and returns the lease, or an error naming why it is not there.
  absl::StatusOr<Lease> TakeLease(uint64_t id, bool is_put);
  void ReleaseLease(const Lease& lease);
  void ReaperLoop();
  // Turns tier changes into router events (off the tiers' locks).
  void NotifierLoop();

  StoreOptions options_;
  std::unique_ptr<DiskTier> disk_;  // destroyed after ram_ (RAM demotes into it)
  std::unique_ptr<RamTier> ram_;

  mutable std::mutex ns_mu_;
  std::unordered_map<uint64_t, NamespaceInfo> namespaces_;

  mutable std::mutex lease_mu_;
  std::condition_variable reaper_cv_;
  std::unordered_map<uint64_t, Lease> leases_;
  // Expired leases whose slots are held one more lease period before reuse,
  // so a late RMA from a slow or dead client cannot land in a reused slot.
  std::vector<std::pair<std::chrono::steady_clock::time_point, Lease>> graveyard_;
  uint64_t next_lease_ = 1;
  uint64_t put_leases_ = 0, get_leases_ = 0;
  std::unordered_map<std::string, uint64_t> leases_by_client_;
  std::atomic<uint64_t> leases_expired_{0};
  std::atomic<uint64_t> commit_checksum_failures_{0};
  bool stop_ = false;
  std::thread reaper_;

  std::vector<std::unique_ptr<EventPublisher>> publishers_;
  std::mutex change_mu_;
  std::condition_variable change_cv_;
  std::vector<std::pair<BlockKey, bool>> changes_;
  bool notifier_stop_ = false;
  std::thread notifier_;
};

}  // namespace kvtier::store
