#include "cachestore/ram_tier.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvtier::store {

namespace {
constexpr uint64_t kSlotAlign = 4096;
uint64_t SlotClass(uint64_t length) { return (length + kSlotAlign - 1) / kSlotAlign * kSlotAlign; }
}  // namespace

RamTier::RamTier(std::unique_ptr<Arena> arena, DemotionSink sink)
    : arena_(std::move(arena)), sink_(std::move(sink)) {}

absl::StatusOr<std::unique_ptr<RamTier>> RamTier::Create(const RamTierOptions& o,
                                                         DemotionSink sink) {
  auto policy = MakePolicy(o.policy, o.policy_params);
  if (!policy.ok()) return policy.status();
  auto arena = Arena::Create(o.bytes, o.slab_bytes, o.try_hugepages, o.prefault, o.shareable);
  if (!arena.ok()) return arena.status();
  std::unique_ptr<RamTier> t(new RamTier(std::move(*arena), std::move(sink)));
  const uint64_t slabs = t->arena_->num_slabs();
  // Each pool: a contiguous run of slabs, and shards of its own.
  std::vector<uint64_t> pool_slabs;
  if (o.pools.empty()) {
    pool_slabs.push_back(slabs);
  } else {
    if (o.pool_of == nullptr) return absl::InvalidArgumentError("RAM pools need pool_of");
    uint64_t total = 0;
    for (uint64_t bytes : o.pools) {
      uint64_t n = bytes / o.slab_bytes;
      if (n == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "a RAM pool of ", bytes, " bytes holds no whole slab of ", o.slab_bytes, " bytes"));
      }
      pool_slabs.push_back(n);
      total += n;
    }
    if (total > slabs) {
      return absl::InvalidArgumentError(absl::StrCat("the RAM pools need ", total, " slabs of ",
                                                     o.slab_bytes, " bytes; the arena has ", slabs,
                                                     " (raise --ram-bytes)"));
    }
  }
  t->pool_of_ = o.pool_of;
  uint64_t first_slab = 0;
  for (uint64_t n_slabs : pool_slabs) {
    Pool p;
    p.region = PoolRegion{first_slab * o.slab_bytes, n_slabs * o.slab_bytes};
    p.first_shard = t->shards_.size();
    int n = o.shards > 0 ? o.shards : static_cast<int>(std::clamp<uint64_t>(n_slabs / 8, 1, 16));
    p.shards = std::min<uint64_t>(n, n_slabs);
    for (size_t i = 0; i < p.shards; ++i) {
      auto s = std::make_unique<Shard>();
      s->policy = *MakePolicy(o.policy, o.policy_params);
      t->shards_.push_back(std::move(s));
    }
    // Slabs are dealt round-robin; each shard hands them out last-first.
    for (uint64_t i = n_slabs; i-- > 0;) {
      t->shards_[p.first_shard + i % p.shards]->free_slabs.push_back((first_slab + i) *
                                                                     o.slab_bytes);
    }
    first_slab += n_slabs;
    t->pools_.push_back(p);
  }
  t->slab_used_.assign(slabs, 0);
  return t;
}

uint64_t RamTier::PoolUsedBytes(size_t pool) const {
  uint64_t used = 0;
  const Pool& p = pools_.at(pool);
  for (size_t i = p.first_shard; i < p.first_shard + p.shards; ++i) {
    used += shards_[i]->used_bytes.load(std::memory_order_relaxed);
  }
  return used;
}

std::vector<PoolRegion> RamTier::pool_regions() const {
  std::vector<PoolRegion> out;
  for (const auto& p : pools_) out.push_back(p.region);
  return out;
}

bool RamTier::Contains(const BlockKey& key) const {
  Shard& s = ShardFor(key);
  std::lock_guard lk(s.mu);
  auto it = s.index.find(key);
  return it != s.index.end() && s.entries.at(it->second).ready;
}

void RamTier::SetChangeListener(ChangeListener listener) {
  std::vector<std::unique_lock<std::mutex>> locks;
  for (auto& shard : shards_) locks.emplace_back(shard->mu);
  listener_ = std::move(listener);
}

void RamTier::FreeSlotLocked(Shard& s, uint64_t offset) {
  auto it = s.entries.find(offset);
  const Entry& e = it->second;
  if (!e.doomed) {
    s.index.erase(e.key);
    if (e.ready) {
      counters_.items.fetch_sub(1, std::memory_order_relaxed);
      if (listener_) listener_(e.key, false);
    }
  }
  counters_.used_bytes.fetch_sub(e.klass, std::memory_order_relaxed);
  s.used_bytes.fetch_sub(e.klass, std::memory_order_relaxed);
  s.classes[e.klass].free.push_back(offset);
  --slab_used_[offset / arena_->slab_bytes()];
  s.entries.erase(it);
}

bool RamTier::EvictOneLocked(Shard& s, const std::function<bool(const Entry&)>& filter,
                             uint64_t* freed_offset) {
  auto victim = s.policy->Evict([&](uint64_t id) {
    const Entry& e = s.entries.at(id);
    return e.pins == 0 && filter(e);
  });
  if (!victim) return false;
  const Entry& e = s.entries.at(*victim);
  if (sink_ && sink_(EvictedBlock{e.key, arena_->at(*victim), e.length, e.checksum, e.reads})) {
    counters_.demotions.fetch_add(1, std::memory_order_relaxed);
  }
  counters_.evictions.fetch_add(1, std::memory_order_relaxed);
  FreeSlotLocked(s, *victim);
  *freed_offset = *victim;
  return true;
}

std::optional<uint64_t> RamTier::AllocateLocked(Shard& s, uint64_t klass) {
  const uint64_t slab_bytes = arena_->slab_bytes();
  auto pop = [&]() -> std::optional<uint64_t> {
    auto& free = s.classes[klass].free;
    if (free.empty()) return std::nullopt;
    uint64_t off = free.back();
    free.pop_back();
    return off;
  };
  auto carve = [&]() {
    uint64_t slab = s.free_slabs.back();
    s.free_slabs.pop_back();
    s.carved[slab] = klass;
    auto& free = s.classes[klass].free;
    uint64_t n = slab_bytes / klass;
    for (uint64_t i = n; i-- > 0;) free.push_back(slab + i * klass);
  };
  if (auto off = pop()) return off;
  if (!s.free_slabs.empty()) {
    carve();
    return pop();
  }
  // A slab another class no longer uses (e.g. after an evict-all).
  if (ReclaimEmptySlabLocked(s, klass)) {
    carve();
    return pop();
  }
  uint64_t freed;
  if (EvictOneLocked(
          s, [klass](const Entry& e) { return e.klass == klass; }, &freed)) {
    return pop();
  }
  // No block of this class can go: empty a slab of another class and re-carve it.
  while (EvictOneLocked(
      s, [klass](const Entry& e) { return e.klass != klass; }, &freed)) {
    uint64_t slab_index = freed / slab_bytes;
    if (slab_used_[slab_index] != 0) continue;
    UncarveLocked(s, slab_index * slab_bytes);
    carve();
    return pop();
  }
  return std::nullopt;
}

void RamTier::UncarveLocked(Shard& s, uint64_t slab) {
  const uint64_t slab_bytes = arena_->slab_bytes();
  auto it = s.carved.find(slab);
  if (it != s.carved.end()) {
    std::erase_if(s.classes[it->second].free,
                  [&](uint64_t o) { return o >= slab && o < slab + slab_bytes; });
    s.carved.erase(it);
  }
  s.free_slabs.push_back(slab);
}

bool RamTier::ReclaimEmptySlabLocked(Shard& s, uint64_t klass) {
  const uint64_t slab_bytes = arena_->slab_bytes();
  for (const auto& [slab, k] : s.carved) {
    if (k != klass && slab_used_[slab / slab_bytes] == 0) {
      UncarveLocked(s, slab);
      return true;
    }
  }
  return false;
}

Placement RamTier::Reserve(const BlockKey& key, uint64_t length, uint64_t lease, Slot* slot) {
  uint64_t klass = SlotClass(length);
  if (klass > arena_->slab_bytes()) return Placement::kNoSpace;
  // With pools, a block of no tenant has no region to live in (never the
  // first tenant's by default).
  if (pools_.size() > 1 && pool_of_->Of(key.ns) < 0) return Placement::kNoSpace;
  Shard& s = ShardFor(key);
  std::lock_guard lk(s.mu);
  if (auto it = s.index.find(key); it != s.index.end()) {
    return s.entries.at(it->second).ready ? Placement::kPresent : Placement::kBusy;
  }
  auto off = AllocateLocked(s, klass);
  if (!off) return Placement::kNoSpace;
  s.entries[*off] = Entry{key, length, klass, 0, lease, 0, 0, 0, false, false};
  s.index[key] = *off;
  ++slab_used_[*off / arena_->slab_bytes()];
  counters_.used_bytes.fetch_add(klass, std::memory_order_relaxed);
  s.used_bytes.fetch_add(klass, std::memory_order_relaxed);
  *slot = Slot{*off, length, 0};
  return Placement::kReserved;
}

bool RamTier::PublishInternal(const BlockKey& key, const Slot& slot, uint64_t checksum, bool pin) {
  Shard& s = ShardFor(key);
  std::lock_guard lk(s.mu);
  auto it = s.entries.find(slot.offset);
  if (it == s.entries.end() || it->second.key != key || it->second.ready) return false;
  Entry& e = it->second;
  if (e.doomed) {
    FreeSlotLocked(s, slot.offset);
    return false;
  }
  e.ready = true;
  e.checksum = checksum;
  e.lease = 0;
  e.last_access = ++s.clock;
  if (pin) ++e.pins;
  s.policy->Insert(slot.offset);
  counters_.items.fetch_add(1, std::memory_order_relaxed);
  if (listener_) listener_(key, true);
  counters_.bytes_in.fetch_add(e.length, std::memory_order_relaxed);
  return true;
}

bool RamTier::Publish(const BlockKey& key, const Slot& slot, uint64_t checksum) {
  return PublishInternal(key, slot, checksum, false);
}

void RamTier::Release(const BlockKey& key, const Slot& slot) {
  Shard& s = ShardFor(key);
  std::lock_guard lk(s.mu);
  auto it = s.entries.find(slot.offset);
  if (it == s.entries.end() || it->second.key != key || it->second.ready) return;
  FreeSlotLocked(s, slot.offset);
}

std::optional<Slot> RamTier::Pin(const BlockKey& key) {
  Shard& s = ShardFor(key);
  std::lock_guard lk(s.mu);
  auto it = s.index.find(key);
  if (it == s.index.end() || !s.entries.at(it->second).ready) {
    counters_.misses.fetch_add(1, std::memory_order_relaxed);
    return std::nullopt;
  }
  Entry& e = s.entries.at(it->second);
  ++e.pins;
  ++e.reads;
  e.last_access = ++s.clock;
  s.policy->Touch(it->second);
  counters_.hits.fetch_add(1, std::memory_order_relaxed);
  counters_.bytes_out.fetch_add(e.length, std::memory_order_relaxed);
  return Slot{it->second, e.length, e.checksum};
}

void RamTier::Unpin(const BlockKey& key, const Slot& slot) {
  Shard& s = ShardFor(key);
  std::lock_guard lk(s.mu);
  auto it = s.entries.find(slot.offset);
  if (it == s.entries.end() || it->second.key != key || it->second.pins == 0) return;
  Entry& e = it->second;
  if (--e.pins == 0 && e.doomed) FreeSlotLocked(s, slot.offset);
}

std::vector<BlockKey> RamTier::ReadyKeys() const {
  std::vector<BlockKey> keys;
  for (const auto& s : shards_) {
    std::lock_guard lk(s->mu);
    std::vector<std::pair<uint64_t, BlockKey>> ready;
    for (const auto& [offset, e] : s->entries) {
      if (e.ready && !e.doomed) ready.emplace_back(e.last_access, e.key);
    }
    std::sort(ready.begin(), ready.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    for (auto& r : ready) keys.push_back(r.second);
  }
  return keys;
}

bool RamTier::CopyOut(const BlockKey& key, std::string* bytes, uint64_t* checksum) const {
  Shard& s = ShardFor(key);
  std::lock_guard lk(s.mu);
  auto it = s.index.find(key);
  if (it == s.index.end()) return false;
  const Entry& e = s.entries.at(it->second);
  if (!e.ready || e.doomed) return false;
  bytes->assign(reinterpret_cast<const char*>(arena_->at(it->second)), e.length);
  *checksum = e.checksum;
  return true;
}

Placement RamTier::InsertCopy(const BlockKey& key, const uint8_t* data, uint64_t length,
                              uint64_t checksum, bool pin, bool from_lower_tier, Slot* slot) {
  Placement p = Reserve(key, length, 0, slot);
  if (p != Placement::kReserved) return p;
  std::memcpy(arena_->at(slot->offset), data, length);
  slot->checksum = checksum;
  // Only an operator's evict (which dooms the slot) stops the publish here:
  // the block is not kept, as when there is no room -- not "busy".
  if (!PublishInternal(key, *slot, checksum, pin)) return Placement::kNoSpace;
  if (from_lower_tier) counters_.promotions.fetch_add(1, std::memory_order_relaxed);
  return Placement::kReserved;
}

void RamTier::DropLocked(Shard& s, uint64_t offset, EraseCounts* counts) {
  Entry& e = s.entries.at(offset);
  if (e.doomed) return;
  if (e.ready) s.policy->Erase(offset);
  if (e.pins == 0 && e.ready) {
    FreeSlotLocked(s, offset);
    ++counts->erased;
    return;
  }
  // In use by a lease: invisible from now on, freed when the lease lets go.
  s.index.erase(e.key);
  if (e.ready) {
    counters_.items.fetch_sub(1, std::memory_order_relaxed);
    if (listener_) listener_(e.key, false);
  }
  e.doomed = true;
  ++counts->pinned;
}

EraseCounts RamTier::Erase(const std::vector<BlockKey>& keys) {
  EraseCounts c;
  for (const auto& k : keys) {
    Shard& s = ShardFor(k);
    std::lock_guard lk(s.mu);
    if (auto it = s.index.find(k); it != s.index.end()) DropLocked(s, it->second, &c);
  }
  return c;
}

EraseCounts RamTier::EraseAt(const std::vector<std::pair<BlockKey, uint64_t>>& keys) {
  EraseCounts c;
  for (const auto& [k, offset] : keys) {
    Shard& s = ShardFor(k);
    std::lock_guard lk(s.mu);
    auto it = s.index.find(k);
    if (it != s.index.end() && it->second == offset) DropLocked(s, offset, &c);
  }
  return c;
}

EraseCounts RamTier::EraseIf(const std::function<bool(const BlockKey&)>& pred) {
  EraseCounts c;
  for (auto& sp : shards_) {
    Shard& s = *sp;
    std::lock_guard lk(s.mu);
    std::vector<uint64_t> offs;
    for (const auto& [k, off] : s.index) {
      if (pred(k)) offs.push_back(off);
    }
    for (uint64_t off : offs) DropLocked(s, off, &c);
  }
  return c;
}

EraseCounts RamTier::EraseNamespace(uint64_t ns) {
  return EraseIf([ns](const BlockKey& k) { return k.ns == ns; });
}

EraseCounts RamTier::EraseAll() {
  return EraseIf([](const BlockKey&) { return true; });
}

absl::Status RamTier::SetPolicy(const std::string& name,
                                const std::map<std::string, double>& params) {
  if (auto p = MakePolicy(name, params); !p.ok()) return p.status();
  for (auto& sp : shards_) {
    Shard& s = *sp;
    std::lock_guard lk(s.mu);
    auto fresh = *MakePolicy(name, params);
    std::vector<std::pair<uint64_t, uint64_t>> residents;  // (last_access, offset)
    for (const auto& [off, e] : s.entries) {
      if (e.ready && !e.doomed) residents.emplace_back(e.last_access, off);
    }
    std::sort(residents.begin(), residents.end());
    for (const auto& r : residents) fresh->Insert(r.second);
    s.policy = std::move(fresh);
  }
  return absl::OkStatus();
}

std::string RamTier::policy() const {
  std::lock_guard lk(shards_[0]->mu);
  return shards_[0]->policy->name();
}

std::map<std::string, double> RamTier::policy_params() const {
  std::lock_guard lk(shards_[0]->mu);
  return shards_[0]->policy->params();
}

TierSnapshot RamTier::Snapshot() const {
  TierSnapshot s;
  Fill(counters_, &s);
  s.capacity_bytes = arena_->size();
  s.policy = policy();
  return s;
}

}  // namespace kvtier::store
