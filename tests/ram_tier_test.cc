#include "cachestore/ram_tier.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>

#include "common/checksum.h"
#include "tests/test_util.h"

namespace kvtier::store {
namespace {

constexpr uint64_t kBlock = 64 << 10;

BlockKey Key(uint64_t n, uint64_t ns = 1) { return BlockKey{ns, BlockHash{n, n * 31}}; }

struct Sunk {
  std::map<uint64_t, std::string> blocks;  // hash.hi -> bytes
};

std::unique_ptr<RamTier> MakeTier(uint64_t bytes, Sunk* sunk, std::string policy = "lru",
                                  uint64_t slab = 256 << 10) {
  RamTierOptions o;
  o.bytes = bytes;
  o.slab_bytes = slab;
  o.policy = policy;
  o.try_hugepages = false;
  auto t = RamTier::Create(o, [sunk](const EvictedBlock& b) {
    if (sunk)
      sunk->blocks[b.key.hash.hi] = std::string(reinterpret_cast<const char*>(b.data), b.length);
    return true;
  });
  EXPECT_TRUE(t.ok()) << t.status();
  return std::move(*t);
}

void Put(RamTier& t, uint64_t n, uint64_t size = kBlock) {
  std::string bytes = testing::BlockBytesFor(n, size);
  Slot slot;
  ASSERT_EQ(t.InsertCopy(Key(n), reinterpret_cast<const uint8_t*>(bytes.data()), size,
                         Checksum(bytes.data(), size), false, false, &slot),
            Placement::kReserved);
}

TEST(RamTier, ReserveWriteCommitPinRead) {
  auto t = MakeTier(1 << 20, nullptr);
  Slot slot;
  ASSERT_EQ(t->Reserve(Key(1), kBlock, 7, &slot), Placement::kReserved);
  EXPECT_FALSE(t->Contains(Key(1)));  // WRITING is invisible
  EXPECT_EQ(t->Reserve(Key(1), kBlock, 8, &slot), Placement::kBusy);
  std::string bytes = testing::BlockBytesFor(1, kBlock);
  std::memcpy(t->data(slot), bytes.data(), kBlock);
  ASSERT_TRUE(t->Publish(Key(1), slot, Checksum(bytes.data(), kBlock)));
  EXPECT_TRUE(t->Contains(Key(1)));
  Slot other;
  EXPECT_EQ(t->Reserve(Key(1), kBlock, 9, &other), Placement::kPresent);
  auto pinned = t->Pin(Key(1));
  ASSERT_TRUE(pinned.has_value());
  EXPECT_EQ(std::string(reinterpret_cast<char*>(t->data(*pinned)), kBlock), bytes);
  EXPECT_EQ(pinned->checksum, Checksum(bytes.data(), kBlock));
  t->Unpin(Key(1), *pinned);
  EXPECT_EQ(t->Snapshot().items, 1u);
  EXPECT_EQ(t->Snapshot().hits, 1u);
}

// Pools (tenants): each namespace's blocks stay in its tenant's region, a
// full pool evicts only its own blocks, and a namespace of no tenant gets
// no slot anywhere.
TEST(RamTier, PoolsKeepEachTenantsBlocksInItsOwnRegion) {
  NamespaceTenants owners;
  owners.Set(10, 0);
  owners.Set(20, 1);
  RamTierOptions o;
  o.bytes = 2 << 20;
  o.slab_bytes = 256 << 10;
  o.try_hugepages = false;
  o.pools = {512 << 10, 1 << 20};
  o.pool_of = &owners;
  std::vector<uint64_t> evicted_ns;
  auto t = RamTier::Create(o, [&](const EvictedBlock& b) {
    evicted_ns.push_back(b.key.ns);
    return true;
  });
  ASSERT_TRUE(t.ok()) << t.status();
  auto regions = (*t)->pool_regions();
  ASSERT_EQ(regions.size(), 2u);
  EXPECT_EQ(regions[0].offset, 0u);
  EXPECT_EQ(regions[0].length, 512u << 10);
  EXPECT_EQ(regions[1].offset, 512u << 10);
  EXPECT_EQ(regions[1].length, 1u << 20);
  std::string bytes(kBlock, 'x');
  auto insert = [&](uint64_t n, uint64_t ns, Slot* slot) {
    return (*t)->InsertCopy(Key(n, ns), reinterpret_cast<const uint8_t*>(bytes.data()), kBlock,
                            Checksum(bytes.data(), kBlock), false, false, slot);
  };
  // Tenant 1 fills its region (16 slots); tenant 0 then writes 3x its own 8.
  Slot slot;
  for (uint64_t n = 0; n < 16; ++n) {
    ASSERT_EQ(insert(n, 20, &slot), Placement::kReserved);
    EXPECT_GE(slot.offset, regions[1].offset);
    EXPECT_LE(slot.offset + kBlock, regions[1].offset + regions[1].length);
  }
  for (uint64_t n = 100; n < 124; ++n) {
    ASSERT_EQ(insert(n, 10, &slot), Placement::kReserved);
    EXPECT_LE(slot.offset + kBlock, regions[0].length);
  }
  EXPECT_EQ(evicted_ns.size(), 16u);
  for (uint64_t ns : evicted_ns) EXPECT_EQ(ns, 10u);  // only its own
  for (uint64_t n = 0; n < 16; ++n) EXPECT_TRUE((*t)->Contains(Key(n, 20)));
  EXPECT_EQ((*t)->PoolUsedBytes(0), 512u << 10);
  EXPECT_EQ((*t)->PoolUsedBytes(1), 1u << 20);
  EXPECT_EQ(insert(1, 99, &slot), Placement::kNoSpace);  // no tenant
  // Pools that do not fit, or hold no slab, are refused.
  o.pools = {1 << 20, 2 << 20};
  EXPECT_FALSE(RamTier::Create(o, nullptr).ok());
  o.pools = {100 << 10};
  EXPECT_FALSE(RamTier::Create(o, nullptr).ok());
}

TEST(RamTier, ReleaseFreesTheSlot) {
  auto t = MakeTier(256 << 10, nullptr);  // one slab of four 64 KiB slots
  Slot s[4];
  for (int i = 0; i < 4; ++i) ASSERT_EQ(t->Reserve(Key(i), kBlock, 1, &s[i]), Placement::kReserved);
  Slot extra;
  EXPECT_EQ(t->Reserve(Key(9), kBlock, 1, &extra), Placement::kNoSpace);  // WRITING never evicted
  t->Release(Key(2), s[2]);
  EXPECT_EQ(t->Reserve(Key(9), kBlock, 1, &extra), Placement::kReserved);
  EXPECT_EQ(extra.offset, s[2].offset);
}

TEST(RamTier, EvictionDemotesExactBytesAndStaysWithinCapacity) {
  Sunk sunk;
  auto t = MakeTier(1 << 20, &sunk);  // 16 slots
  for (uint64_t n = 0; n < 40; ++n) Put(*t, n);
  auto snap = t->Snapshot();
  EXPECT_LE(snap.used_bytes, snap.capacity_bytes);
  EXPECT_EQ(snap.items, 16u);
  EXPECT_EQ(snap.evictions, 24u);
  EXPECT_EQ(snap.demotions, 24u);
  ASSERT_EQ(sunk.blocks.size(), 24u);
  for (const auto& [n, bytes] : sunk.blocks) {
    EXPECT_LT(n, 24u);  // LRU: the oldest went
    EXPECT_EQ(bytes, testing::BlockBytesFor(n, kBlock)) << n;
  }
}

TEST(RamTier, PinnedBlocksAreNeverEvicted) {
  auto t = MakeTier(256 << 10, nullptr);
  for (uint64_t n = 0; n < 4; ++n) Put(*t, n);
  std::vector<Slot> pins;
  for (uint64_t n = 0; n < 4; ++n) pins.push_back(*t->Pin(Key(n)));
  Slot slot;
  EXPECT_EQ(t->Reserve(Key(99), kBlock, 1, &slot), Placement::kNoSpace);
  for (uint64_t n = 0; n < 4; ++n) EXPECT_TRUE(t->Contains(Key(n)));
  t->Unpin(Key(0), pins[0]);
  EXPECT_EQ(t->Reserve(Key(99), kBlock, 1, &slot), Placement::kReserved);
  EXPECT_FALSE(t->Contains(Key(0)));
}

TEST(RamTier, ErasingAPinnedBlockHidesItAndFreesItOnUnpin) {
  auto t = MakeTier(256 << 10, nullptr);
  Put(*t, 1);
  Slot pin = *t->Pin(Key(1));
  auto c = t->Erase({Key(1)});
  EXPECT_EQ(c.pinned, 1u);
  EXPECT_FALSE(t->Contains(Key(1)));
  // The reader still sees its bytes until it lets go.
  EXPECT_EQ(std::string(reinterpret_cast<char*>(t->data(pin)), kBlock),
            testing::BlockBytesFor(1, kBlock));
  EXPECT_EQ(t->Snapshot().used_bytes, kBlock);
  t->Unpin(Key(1), pin);
  EXPECT_EQ(t->Snapshot().used_bytes, 0u);
}

TEST(RamTier, EraseByNamespaceLeavesOthers) {
  auto t = MakeTier(1 << 20, nullptr);
  std::string bytes(kBlock, 'x');
  Slot s;
  for (uint64_t n = 0; n < 4; ++n) {
    t->InsertCopy(Key(n, 1), reinterpret_cast<const uint8_t*>(bytes.data()), kBlock, 0, false,
                  false, &s);
    t->InsertCopy(Key(n, 2), reinterpret_cast<const uint8_t*>(bytes.data()), kBlock, 0, false,
                  false, &s);
  }
  EXPECT_EQ(t->EraseNamespace(1).erased, 4u);
  for (uint64_t n = 0; n < 4; ++n) {
    EXPECT_FALSE(t->Contains(Key(n, 1)));
    EXPECT_TRUE(t->Contains(Key(n, 2)));
  }
  EXPECT_EQ(t->EraseAll().erased, 4u);
  EXPECT_EQ(t->Snapshot().items, 0u);
}

TEST(RamTier, SizeClassesReclaimSlabsFromEachOther) {
  auto t = MakeTier(512 << 10, nullptr);        // two slabs of 256 KiB
  for (uint64_t n = 0; n < 8; ++n) Put(*t, n);  // fills both slabs with 64 KiB slots
  // A 200 KiB block needs a whole slab: blocks of the other class are
  // evicted until one slab is empty.
  Put(*t, 100, 200 << 10);
  EXPECT_TRUE(t->Contains(Key(100)));
  auto snap = t->Snapshot();
  EXPECT_LE(snap.used_bytes, snap.capacity_bytes);
  EXPECT_EQ(snap.items, 5u);
  Slot s;
  EXPECT_EQ(t->Reserve(Key(5000), 300 << 10, 1, &s), Placement::kNoSpace);  // above slab size
}

TEST(RamTier, EmptySlabsOfAnotherClassAreReused) {
  auto t = MakeTier(512 << 10, nullptr);        // two slabs of 256 KiB
  for (uint64_t n = 0; n < 8; ++n) Put(*t, n);  // both slabs carved for 64 KiB
  EXPECT_EQ(t->EraseAll().erased, 8u);          // nothing left to evict
  Put(*t, 100, 200 << 10);                      // needs a whole slab of its own
  Put(*t, 101, 200 << 10);
  EXPECT_TRUE(t->Contains(Key(100)));
  EXPECT_TRUE(t->Contains(Key(101)));
}

TEST(RamTier, PolicySwitchKeepsEveryBlock) {
  for (const char* to : {"s3fifo", "sieve", "lru"}) {
    auto t = MakeTier(1 << 20, nullptr);
    for (uint64_t n = 0; n < 16; ++n) Put(*t, n);
    ASSERT_TRUE(t->SetPolicy(to, {}).ok());
    EXPECT_EQ(t->policy(), to);
    EXPECT_EQ(t->Snapshot().items, 16u);
    for (uint64_t n = 0; n < 16; ++n) EXPECT_TRUE(t->Contains(Key(n))) << to;
    // The new policy knows every resident: filling up evicts, never fails.
    for (uint64_t n = 100; n < 132; ++n) Put(*t, n);
    EXPECT_EQ(t->Snapshot().items, 16u);
  }
  auto t = MakeTier(1 << 20, nullptr);
  EXPECT_FALSE(t->SetPolicy("mru", {}).ok());
  EXPECT_EQ(t->policy(), "lru");
}

TEST(RamTier, ShardsSplitTheArena) {
  RamTierOptions o;
  o.bytes = 64 << 20;
  o.slab_bytes = 256 << 10;
  o.try_hugepages = false;
  auto t = RamTier::Create(o, nullptr);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->shards(), 16);
  // 1,024 slots in 16 shards of 64: 400 random keys land below every
  // shard's share, so nothing is evicted.
  for (uint64_t n = 0; n < 400; ++n) Put(**t, n);
  EXPECT_EQ((*t)->Snapshot().items, 400u);
  EXPECT_EQ((*t)->Snapshot().evictions, 0u);
}

}  // namespace
}  // namespace kvtier::store
