// The RAM tier: blocks in slots of one Arena, behind a sharded index.
//
// Each shard owns a share of the arena's slabs, its own key -> slot index,
// eviction policy and slab allocator, under its own mutex, so shards never
// contend. A slot is WRITING (reserved by a put lease, invisible) or READY
// (visible, checksummed). READY slots may be pinned by get leases; pinned
// or WRITING slots are never evicted. Evicting a READY slot hands its bytes
// to the demotion sink (under the shard lock; the sink must copy).
// Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "cachestore/arena.h"
#include "cachestore/eviction_policy.h"
#include "cachestore/tenants.h"
#include "cachestore/tier.h"
#include "common/block_key.h"

namespace kvtier::store {

struct RamTierOptions {
  uint64_t bytes = 64ull << 20;
  uint64_t slab_bytes = 4ull << 20;
  std::string policy = "lru";
  std::map<std::string, double> policy_params;
  bool try_hugepages = true;
  bool prefault = false;  // touch the whole arena at start (kvtier-store: --prefault, on)
  // Back the arena with a memfd that same-host clients may map (kvtier-store:
  // --local-shm, on). Off: private anonymous memory, which keeps transparent
  // hugepages where the kernel gives shared memory none.
  bool shareable = false;
  int shards = 0;  // 0: chosen from the number of slabs (1..16), per pool
  // Tenants (tenants.h): the arena split into regions, one per pool, of
  // these sizes in order (rounded down to whole slabs, at least one each;
  // slabs left over serve nobody). A block lives in the pool pool_of names
  // for its namespace (pool 0 when it names none). Empty: one pool, the
  // whole arena. pool_of must outlive the tier.
  std::vector<uint64_t> pools;
  const NamespaceTenants* pool_of = nullptr;
};

// A pool's region of the arena.
struct PoolRegion {
  uint64_t offset = 0, length = 0;
};

// Returns true if the block was accepted for the lower tier (a demotion).
using DemotionSink = std::function<bool(const EvictedBlock&)>;

// A slot in the arena. offset identifies the slot for its whole life.
struct Slot {
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t checksum = 0;
};

enum class Placement { kReserved, kPresent, kBusy, kNoSpace };

class RamTier : public Tier {
 public:
  static absl::StatusOr<std::unique_ptr<RamTier>> Create(const RamTierOptions& options,
                                                         DemotionSink sink);

  // The listener is called under a shard lock; replacing it takes every
  // shard lock.
  void SetChangeListener(ChangeListener listener) override;

  // True if key is READY.
  bool Contains(const BlockKey& key) const override;

  // Reserves a WRITING slot for key owned by lease. kPresent if READY,
  // kBusy if another lease is writing it, kNoSpace if no slot can be freed.
  Placement Reserve(const BlockKey& key, uint64_t length, uint64_t lease, Slot* slot);
  // Makes a WRITING slot READY with the given checksum. Returns false if the
  // slot was dropped meanwhile (evicted by an operator); it is then freed.
  bool Publish(const BlockKey& key, const Slot& slot, uint64_t checksum);
  // Frees a WRITING slot (abort, failed commit, expired lease).
  void Release(const BlockKey& key, const Slot& slot);

  // Pins a READY block for reading and counts a hit; nullopt (and a miss) if absent.
  std::optional<Slot> Pin(const BlockKey& key);
  // Undoes one Pin.
  void Unpin(const BlockKey& key, const Slot& slot);

  // Copies data into a new READY slot (promotion from disk, inline put);
  // pinned once when pin is true. Counts a promotion when from_lower_tier.
  // The READY blocks now, least recently used first within each shard.
  std::vector<BlockKey> ReadyKeys() const;
  // Copies a READY block out under its shard's lock, counting no hit;
  // false if it is gone or not READY.
  bool CopyOut(const BlockKey& key, std::string* bytes, uint64_t* checksum) const;

  Placement InsertCopy(const BlockKey& key, const uint8_t* data, uint64_t length, uint64_t checksum,
                       bool pin, bool from_lower_tier, Slot* slot);

  EraseCounts Erase(const std::vector<BlockKey>& keys) override;
  // Erases each key only while it still maps to the given slot offset (the
  // copy a caller examined, not one put again since).
  EraseCounts EraseAt(const std::vector<std::pair<BlockKey, uint64_t>>& keys);
  EraseCounts EraseNamespace(uint64_t ns) override;
  EraseCounts EraseAll() override;

  // Switches every shard to a new policy, rebuilt from current residents in
  // order of last access.
  absl::Status SetPolicy(const std::string& name,
                         const std::map<std::string, double>& params) override;
  std::string policy() const override;
  std::map<std::string, double> policy_params() const override;

  uint8_t* data(const Slot& slot) const { return arena_->at(slot.offset); }
  const Arena& arena() const { return *arena_; }
  uint64_t max_block_bytes() const { return arena_->slab_bytes(); }
  int shards() const { return static_cast<int>(shards_.size()); }
  // The pools' regions, in pool order (one covering the arena without pools).
  std::vector<PoolRegion> pool_regions() const;
  // Bytes of slots in use in a pool's region.
  uint64_t PoolUsedBytes(size_t pool) const;
  // The pool a namespace's blocks live in (for lookups, pool 0 for a
  // namespace of no tenant, which Reserve refuses to place).
  int PoolOf(uint64_t ns) const {
    if (pools_.size() == 1) return 0;
    int t = pool_of_->Of(ns);
    return t < 0 || static_cast<size_t>(t) >= pools_.size() ? 0 : t;
  }
  TierSnapshot Snapshot() const override;
  const TierCounters& counters() const { return counters_; }

 private:
  struct Entry {
    BlockKey key;
    uint64_t length;
    uint64_t klass;  // slot size
    uint64_t checksum;
    uint64_t lease;  // writer lease while WRITING
    uint64_t last_access;
    uint32_t pins;
    uint32_t reads;
    bool ready;
    bool doomed;  // dropped from the index; freed when no longer in use
  };
  struct SizeClass {
    std::vector<uint64_t> free;  // free slot offsets
  };
  struct Shard {
    mutable std::mutex mu;
    std::unordered_map<BlockKey, uint64_t, BlockKeyHasher> index;  // key -> offset
    std::unordered_map<uint64_t, Entry> entries;                   // offset -> entry
    std::unique_ptr<EvictionPolicy> policy;
    std::map<uint64_t, SizeClass> classes;
    std::vector<uint64_t> free_slabs;     // slab offsets
    std::map<uint64_t, uint64_t> carved;  // slab offset -> the size class it serves
    uint64_t clock = 0;
    std::atomic<uint64_t> used_bytes{0};  // slot bytes in use (written under mu)
  };

  struct Pool {
    PoolRegion region;
    size_t first_shard = 0, shards = 0;
  };

  RamTier(std::unique_ptr<Arena> arena, DemotionSink sink);
  Shard& ShardFor(const BlockKey& key) const {
    const Pool& p = pools_[PoolOf(key.ns)];
    return *shards_[p.first_shard + key.Mix() % p.shards];
  }
  // REQUIRES: s.mu held. Finds a free slot of class klass, evicting if needed.
  std::optional<uint64_t> AllocateLocked(Shard& s, uint64_t klass);
  // REQUIRES: s.mu held. Evicts one READY unpinned block (demoting it).
  bool EvictOneLocked(Shard& s, const std::function<bool(const Entry&)>& filter,
                      uint64_t* freed_offset);
  // REQUIRES: s.mu held. Returns an empty slab of another class to the free
  // slabs; false if there is none.
  bool ReclaimEmptySlabLocked(Shard& s, uint64_t klass);
  void UncarveLocked(Shard& s, uint64_t slab);
  void FreeSlotLocked(Shard& s, uint64_t offset);
  bool PublishInternal(const BlockKey& key, const Slot& slot, uint64_t checksum, bool pin);
  void DropLocked(Shard& s, uint64_t offset, EraseCounts* counts);
  EraseCounts EraseIf(const std::function<bool(const BlockKey&)>& pred);

  std::unique_ptr<Arena> arena_;
  DemotionSink sink_;
  ChangeListener listener_;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<Pool> pools_;
  const NamespaceTenants* pool_of_ = nullptr;
  std::vector<uint32_t> slab_used_;  // slots in use per slab (guarded by the owning shard)
  mutable TierCounters counters_;
};

}  // namespace kvtier::store
