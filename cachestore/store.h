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
#include "cachestore/change_feed.h"
#include "cachestore/disk_tier.h"
#include "cachestore/fetch_meter.h"
#include "cachestore/lease_table.h"
#include "cachestore/namespace_registry.h"
#include "cachestore/namespace_usage.h"
#include "cachestore/ram_tier.h"
#include "common/block_key.h"
#include "common/limits.h"

namespace kvtier::store {

// Most block hashes one request may name (documented in store.proto).
using limits::kMaxBlocksPerRequest;

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
  // Namespaces registered at once (each is a record kept forever otherwise);
  // 0: no limit.
  uint64_t max_namespaces = 1024;
  // Told what enters and leaves the store (change_feed.h); may be null.
  // Must outlive the store.
  ChangeSink* changes = nullptr;
  // Tenants (tenants.h; kvtier-store --tenants-file), or null: then the
  // arena is split into one region per tenant, each tenant's NVMe bytes are
  // bounded, and namespaces are registered by and resolved for tenants.
  std::shared_ptr<const Tenants> tenants;
  // Tests: the NVMe tier over this backend instead of RocksDB in disk.dir.
  std::function<std::unique_ptr<StorageBackend>()> disk_backend;

  // INVALID_ARGUMENT naming the field that is out of range.
  absl::Status Validate() const;
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
  TierKind tier;  // where the block was before this call
  Slot slot;
};

struct BeginGetResult {
  uint64_t lease = 0;  // 0 when nothing was pinned
  std::vector<GetSource> sources;
};

struct InlinePutResult {
  enum Outcome { kStored, kAlreadyPresent, kNoSpace } outcome;
};

struct VerifyResult {
  uint32_t checked = 0;  // found in RAM and checked
  uint32_t dropped = 0;  // corrupt: dropped
};

struct EvictResult {
  uint64_t ram_blocks = 0, disk_blocks = 0, pinned_blocks = 0;
};

// What one tenant holds (Store::TenantStats).
struct TenantUsage {
  std::string name;
  uint64_t ram_capacity_bytes = 0, ram_used_bytes = 0, nvme_bytes = 0, nvme_quota_bytes = 0;
  uint64_t leases = 0, namespaces = 0;
};

struct StoreStats {
  TierSnapshot ram, disk;
  DiskQueueStats queue;
  uint64_t put_leases = 0, get_leases = 0, leases_expired = 0, checksum_failures = 0;
  // Reads the NVMe tier failed (I/O errors, not misses); each ended a get.
  uint64_t disk_read_errors = 0;
};

class Store {
 public:
  // CommitPut hashes a large commit's blocks (verify_commits or
  // store_checksums) on up to this many threads, one per
  // kCommitBytesPerThread of them.
  static constexpr int kCommitHashThreads = 4;
  static constexpr uint64_t kCommitBytesPerThread = 8ull << 20;

  // INVALID_ARGUMENT for bad options; the tiers' errors otherwise.
  static absl::StatusOr<std::unique_ptr<Store>> Open(const StoreOptions& options);
  ~Store();

  // What PersistRam did.
  struct Persisted {
    uint64_t written = 0;  // RAM blocks written to NVMe
    uint64_t already = 0;  // on NVMe already
    uint64_t left = 0;     // not written: the deadline passed or a write failed
    absl::Status error;    // the write that stopped it, if one did
  };
  // Writes every RAM block not yet on NVMe to NVMe (least recently used
  // first within each RAM shard, so the disk tier's eviction keeps the
  // newest), after draining the write-back queue, until `deadline`. For a
  // stop (kvtier-store --persist-on-stop): a restart then finds the RAM
  // tier on NVMe. Call it once no request can reach the store.
  Persisted PersistRam(std::chrono::steady_clock::time_point deadline);

  // See NamespaceRegistry::Register.
  absl::StatusOr<NamespaceInfo> RegisterNamespace(const NamespaceSpec& spec, uint64_t expected_id,
                                                  const Tenant* tenant = nullptr);
  // See NamespaceRegistry::Resolve: the id the store keys a tenant's
  // namespace under, which every call below then takes.
  absl::StatusOr<NamespaceInfo> ResolveNamespace(const Tenant& tenant, uint64_t client_id) const;
  // Every namespace, or only a tenant's.
  std::vector<NamespaceInfo> ListNamespaces(const Tenant* tenant = nullptr) const;
  // What namespace ns (a store id) holds per tier, and how its gets fared.
  NamespaceUsage Usage(uint64_t ns) const { return usage_.Of(ns); }
  // Whole fetches since start whose slowest tier was `tier`.
  LatencyHistogram::Snapshot FetchDurations(FetchMeter::Tier tier) const {
    return fetch_meter_.Durations(tier);
  }
  const Tenants* tenants() const { return options_.tenants.get(); }

  // The requests below answer INVALID_ARGUMENT for no hashes or more than
  // kMaxBlocksPerRequest, and NOT_FOUND for an unregistered namespace.

  // Tier of each leading present block.
  absl::StatusOr<std::vector<TierKind>> Lookup(uint64_t ns,
                                               std::span<const BlockHash> hashes) const;

  // Reserves a slot per absent block under one lease. Also INVALID_ARGUMENT
  // for a hash named twice; RESOURCE_EXHAUSTED past the client's lease limit.
  absl::StatusOr<BeginPutResult> BeginPut(uint64_t ns, std::span<const BlockHash> hashes,
                                          const LeaseOwner& owner);
  // checksums: one per reserved target, in order. All-or-nothing: DATA_LOSS
  // (nothing stored) if a slot's bytes do not match; INVALID_ARGUMENT (the
  // lease kept) for a wrong checksum count; FAILED_PRECONDITION for an
  // unknown, ended or expired lease. Returns how many blocks became visible.
  // tenant >= 0: only that tenant's lease (LeaseTable::Take), here and in
  // AbortPut, EndGet and ReleaseGets; session (a data-plane call's): only a
  // lease opened on it, or over gRPC. store_checksums: `checksums` is empty
  // and the store records each slot's own hash (CommitPutRequest's
  // store_checksums; whatever verify_commits says).
  absl::StatusOr<uint32_t> CommitPut(uint64_t lease, std::span<const uint64_t> checksums,
                                     int tenant = -1, bool store_checksums = false,
                                     std::string_view session = {});
  // FAILED_PRECONDITION / INVALID_ARGUMENT as LeaseTable::Take.
  absl::Status AbortPut(uint64_t lease, int tenant = -1, std::string_view session = {});
  // A socket data-plane transfer's hold on [offset, offset + length) of the
  // arena under lease `id` of `tenant` (-1: no tenants): LeaseTable::Use.
  absl::StatusOr<LeaseTable::Hold> UseLease(uint64_t id, bool is_put, int tenant, uint64_t offset,
                                            uint64_t length, std::string_view session) {
    return leases_->Use(id, is_put, tenant, offset, length, session);
  }

  // Pins the leading present blocks (promoting from disk) under one lease.
  // RESOURCE_EXHAUSTED past the client's lease limit.
  absl::StatusOr<BeginGetResult> BeginGet(uint64_t ns, std::span<const BlockHash> hashes,
                                          const LeaseOwner& owner);
  // FAILED_PRECONDITION / INVALID_ARGUMENT as LeaseTable::Take.
  absl::Status EndGet(uint64_t lease, int tenant = -1, std::string_view session = {});
  // Ends every get lease of `leases` it knows; returns the ids it did not
  // (unknown, ended, expired, or a put lease), for which nothing was done.
  // INVALID_ARGUMENT (nothing ended) for more than kMaxBlocksPerRequest ids.
  absl::StatusOr<std::vector<uint64_t>> ReleaseGets(std::span<const uint64_t> leases,
                                                    int tenant = -1, std::string_view session = {});
  // Recomputes the checksum of each block's RAM copy and drops the copies
  // that do not match the one committed (a client saw them fail), with
  // their NVMe copies. Errors as Lookup's (unknown namespace, too many
  // hashes).
  absl::StatusOr<VerifyResult> VerifyBlocks(uint64_t ns, std::span<const BlockHash> hashes);

  // INVALID_ARGUMENT for a wrong size, DATA_LOSS for a wrong checksum,
  // ABORTED while another lease writes the block.
  absl::StatusOr<InlinePutResult> PutInline(uint64_t ns, const BlockHash& hash,
                                            std::string_view data, uint64_t checksum);
  // Calls emit(index, tier, bytes, checksum) for each leading present block,
  // stopping early if emit returns false. bytes are valid during the call.
  absl::Status GetInline(
      uint64_t ns, std::span<const BlockHash> hashes,
      const std::function<bool(uint32_t, TierKind, std::string_view, uint64_t)>& emit);

  absl::StatusOr<EvictResult> EvictAll();
  // NOT_FOUND for an unregistered namespace.
  absl::StatusOr<EvictResult> EvictNamespace(uint64_t ns);
  // Forgets the namespace (NOT_FOUND if unregistered) and drops its blocks
  // from both tiers; pinned ones go when their leases end. It can be
  // registered again.
  absl::StatusOr<EvictResult> RemoveNamespace(uint64_t ns);
  // INVALID_ARGUMENT for no keys or more than kMaxBlocksPerRequest.
  absl::StatusOr<EvictResult> EvictKeys(std::span<const BlockKey> keys);

  // INVALID_ARGUMENT for an unknown policy or parameter.
  absl::Status SetPolicy(TierKind tier, const std::string& name,
                         const std::map<std::string, double>& params);
  std::pair<std::string, std::map<std::string, double>> GetPolicy(TierKind tier) const;

  StoreStats Stats() const;
  // Per tenant, in the tenants file's order (empty without tenants).
  std::vector<TenantUsage> TenantStats() const;
  // Per tier, what this shard's fetches took over the last seconds.
  std::vector<TierFetchFigures> FetchFigures();
  uint64_t lease_ms() const { return options_.lease_ms; }
  RamTier& ram() { return *ram_; }
  DiskTier& disk() { return *disk_; }

 private:
  Store() = default;
  absl::StatusOr<NamespaceInfo> CheckRequest(uint64_t ns, std::span<const BlockHash> hashes) const;
  Tier& TierFor(TierKind kind) const;
  // Frees a lease's slots (put) or pins (get).
  // Ends a lease (expired: by the reaper, which the fetch meter ignores).
  void ReleaseLease(const Lease& lease, bool expired = false);

  StoreOptions options_;
  NamespaceTenants owners_;         // before the tiers, which read it
  std::unique_ptr<DiskTier> disk_;  // destroyed after ram_ (RAM demotes into it)
  std::unique_ptr<RamTier> ram_;
  std::unique_ptr<NamespaceRegistry> namespaces_;
  FetchMeter fetch_meter_;  // before leases_: the reaper reports to it
  std::unique_ptr<LeaseTable> leases_;
  std::unique_ptr<ChangeFeed> feed_;
  NamespaceUsageTable usage_;
  std::atomic<uint64_t> commit_checksum_failures_{0};
  // A read of the NVMe tier that failed for a reason other than a miss
  // (UNAVAILABLE: an I/O error; the block stays): counted, and logged at
  // most once a second. Its status for a get that found nothing before it.
  absl::Status DiskReadFailed(const BlockKey& key, const absl::Status& error);
  std::atomic<uint64_t> disk_read_errors_{0};
  std::atomic<int64_t> disk_read_logged_ms_{0};
};

}  // namespace kvtier::store
