// The store core, driven directly: two-phase put, leases, promotion,
// demotion, and every bad input the gRPC layer passes through.
#include "cachestore/store.h"

#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "common/checksum.h"
#include "tests/test_util.h"

namespace kvtier::store {
namespace {

NamespaceSpec Spec() {
  // 2 x 1 layer x 1 head x 64 dim x 2 bytes x 256 tokens = 64 KiB blocks.
  return NamespaceSpec{"test-model", "fp16", 1, 1, 64, 256, 0, 1, "", "", ""};
}
constexpr uint64_t kBlock = 64 << 10;

class StoreTest : public ::testing::Test {
 protected:
  void Open(uint64_t ram = 1 << 20, uint64_t lease_ms = 10000) {
    StoreOptions o;
    o.ram.bytes = ram;
    o.ram.slab_bytes = 256 << 10;
    o.ram.try_hugepages = false;
    o.disk.dir = dir_.sub("db");
    o.disk.bytes = 64 << 20;
    o.lease_ms = lease_ms;
    store_.reset();
    auto s = Store::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(*s);
    auto info = store_->RegisterNamespace(Spec(), 0);
    ASSERT_TRUE(info.ok()) << info.status();
    ns_ = info->id;
    ASSERT_EQ(info->block_bytes, kBlock);
  }
  BlockHash H(uint64_t n) { return BlockHash{n, n + 1000}; }
  void PutInline(uint64_t n) {
    std::string b = testing::BlockBytesFor(n, kBlock);
    auto r = store_->PutInline(ns_, H(n), b, Checksum(b.data(), b.size()));
    ASSERT_TRUE(r.ok()) << r.status();
  }
  // Reads block n inline and checks it byte for byte; returns its tier.
  TierKind GetAndCheck(uint64_t n) {
    std::vector<BlockHash> hs = {H(n)};
    TierKind tier{};
    int got = 0;
    auto s =
        store_->GetInline(ns_, hs, [&](uint32_t, TierKind t, std::string_view b, uint64_t sum) {
          EXPECT_EQ(std::string(b), testing::BlockBytesFor(n, kBlock)) << n;
          EXPECT_EQ(sum, Checksum(b.data(), b.size()));
          tier = t;
          ++got;
          return true;
        });
    EXPECT_TRUE(s.ok());
    EXPECT_EQ(got, 1) << "block " << n << " missing";
    return tier;
  }

  testing::TempDir dir_;
  std::unique_ptr<Store> store_;
  uint64_t ns_ = 0;
};

TEST_F(StoreTest, TwoPhasePutThenGet) {
  Open();
  std::vector<BlockHash> hs = {H(1), H(2), H(3)};
  PutInline(2);
  auto r = store_->BeginPut(ns_, hs, "t");
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->targets.size(), 3u);
  EXPECT_EQ(r->targets[0].placement, Placement::kReserved);
  EXPECT_EQ(r->targets[1].placement, Placement::kPresent);  // not sent again
  EXPECT_EQ(r->targets[2].placement, Placement::kReserved);
  std::vector<uint64_t> sums;
  for (int i : {0, 2}) {
    uint64_t n = i + 1;
    std::string b = testing::BlockBytesFor(n, kBlock);
    std::memcpy(store_->ram().data(r->targets[i].slot), b.data(), kBlock);
    sums.push_back(Checksum(b.data(), kBlock));
  }
  // Invisible until committed.
  EXPECT_EQ(store_->Lookup(ns_, hs)->size(), 0u);
  auto c = store_->CommitPut(r->lease, sums);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, 2u);
  EXPECT_EQ(store_->Lookup(ns_, hs)->size(), 3u);
  auto g = store_->BeginGet(ns_, hs, "t");
  ASSERT_TRUE(g.ok());
  ASSERT_EQ(g->sources.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    const Slot& s = g->sources[i].slot;
    EXPECT_EQ(std::string(reinterpret_cast<char*>(store_->ram().data(s)), kBlock),
              testing::BlockBytesFor(i + 1, kBlock));
  }
  EXPECT_EQ(store_->Stats().get_leases, 1u);
  ASSERT_TRUE(store_->EndGet(g->lease).ok());
  EXPECT_EQ(store_->Stats().get_leases, 0u);
  EXPECT_EQ(store_->EndGet(g->lease).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(StoreTest, CommitWithAWrongChecksumStoresNothing) {
  Open();
  std::vector<BlockHash> hs = {H(1), H(2)};
  auto r = store_->BeginPut(ns_, hs, "t");
  std::string b = testing::BlockBytesFor(1, kBlock);
  std::memcpy(store_->ram().data(r->targets[0].slot), b.data(), kBlock);
  std::memcpy(store_->ram().data(r->targets[1].slot), b.data(), kBlock);
  uint64_t good = Checksum(b.data(), kBlock);
  auto c = store_->CommitPut(r->lease, std::vector<uint64_t>{good, good + 1});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(c.status().message().find("checksum mismatch on block 1"), std::string::npos);
  EXPECT_EQ(store_->Lookup(ns_, hs)->size(), 0u);  // all or nothing
  EXPECT_EQ(store_->Stats().ram.used_bytes, 0u);   // slots returned
  EXPECT_EQ(store_->Stats().checksum_failures, 1u);
}

// A commit past Store::kCommitBytesPerThread is hashed on several threads:
// the same verdicts, naming the same block.
TEST_F(StoreTest, ALargeCommitIsVerifiedOnSeveralThreadsWithTheSameVerdicts) {
  Open(64 << 20);
  constexpr uint64_t kN = 400;  // 25 MiB: three hashing threads
  static_assert(kN * kBlock >= 3 * Store::kCommitBytesPerThread);
  std::vector<BlockHash> hs;
  for (uint64_t i = 0; i < kN; ++i) hs.push_back(H(i + 1));
  auto fill = [&](const BeginPutResult& r) {
    std::vector<uint64_t> sums;
    for (uint64_t i = 0; i < kN; ++i) {
      std::string b = testing::BlockBytesFor(i + 1, kBlock);
      std::memcpy(store_->ram().data(r.targets[i].slot), b.data(), kBlock);
      sums.push_back(Checksum(b.data(), kBlock));
    }
    return sums;
  };
  auto r = store_->BeginPut(ns_, hs, "t");
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<uint64_t> sums = fill(*r);
  sums[301] ^= 1;
  auto c = store_->CommitPut(r->lease, sums);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(c.status().message().find("checksum mismatch on block 301"), std::string::npos)
      << c.status();
  EXPECT_EQ(store_->Lookup(ns_, hs)->size(), 0u);
  r = store_->BeginPut(ns_, hs, "t");
  ASSERT_TRUE(r.ok()) << r.status();
  c = store_->CommitPut(r->lease, fill(*r));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, kN);
  EXPECT_EQ(store_->Lookup(ns_, hs)->size(), kN);
}

TEST_F(StoreTest, CommitWithTheWrongCountKeepsTheLease) {
  Open();
  std::vector<BlockHash> hs = {H(1)};
  auto r = store_->BeginPut(ns_, hs, "t");
  auto c = store_->CommitPut(r->lease, std::vector<uint64_t>{1, 2});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(store_->AbortPut(r->lease).ok());
  EXPECT_EQ(store_->Stats().ram.used_bytes, 0u);
}

// CommitPutRequest.store_checksums: the store records each slot's own hash
// (a writer that filled them through its mapping sends none); a reader
// verifies against it. With checksums too, the commit is refused and the
// lease kept.
TEST_F(StoreTest, TheStoreHashesTheSlotsWhenAskedTo) {
  Open(64 << 20);
  constexpr uint64_t kN = 200;  // 12.5 MiB: hashed on two threads
  std::vector<BlockHash> hs;
  for (uint64_t i = 0; i < kN; ++i) hs.push_back(H(i + 1));
  auto r = store_->BeginPut(ns_, hs, "t");
  ASSERT_TRUE(r.ok()) << r.status();
  for (uint64_t i = 0; i < kN; ++i) {
    std::string b = testing::BlockBytesFor(i + 1, kBlock);
    std::memcpy(store_->ram().data(r->targets[i].slot), b.data(), kBlock);
  }
  auto c = store_->CommitPut(r->lease, std::vector<uint64_t>{7}, -1, /*store_checksums=*/true);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("send none"), std::string::npos) << c.status();
  c = store_->CommitPut(r->lease, {}, -1, /*store_checksums=*/true);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, kN);
  for (uint64_t i : {uint64_t{1}, uint64_t{kN / 2}, kN}) EXPECT_EQ(GetAndCheck(i), TierKind::kRam);
  EXPECT_EQ(store_->Stats().checksum_failures, 0u);
}

TEST_F(StoreTest, ExpiredPutLeaseIsReclaimedAndItsCommitRefused) {
  Open(1 << 20, /*lease_ms=*/100);
  std::vector<BlockHash> hs = {H(1), H(2)};
  auto r = store_->BeginPut(ns_, hs, "dead-writer");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(store_->Stats().ram.used_bytes, 2 * kBlock);
  ASSERT_TRUE(testing::WaitFor([&] { return store_->Stats().ram.used_bytes == 0; },
                               std::chrono::seconds(10)));
  auto st = store_->Stats();
  EXPECT_EQ(st.ram.used_bytes, 0u);
  EXPECT_EQ(st.put_leases, 0u);
  EXPECT_EQ(st.leases_expired, 1u);
  auto c = store_->CommitPut(r->lease, std::vector<uint64_t>{0, 0});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(c.status().message().find("expired"), std::string::npos);
  EXPECT_EQ(store_->Lookup(ns_, hs)->size(), 0u);
  // The keys are free to be written again.
  auto again = store_->BeginPut(ns_, hs, "t");
  EXPECT_EQ(again->targets[0].placement, Placement::kReserved);
}

// Per namespace: blocks per tier as they arrive, demote and leave, and how
// many blocks its gets asked for and were served; other namespaces apart.
TEST_F(StoreTest, PersistRamWritesWhatNvmeLacksAndStopsAtItsDeadline) {
  Open(1 << 20);                                   // 16 blocks of RAM
  for (uint64_t n = 0; n < 20; ++n) PutInline(n);  // 4 demoted
  store_->disk().WaitIdle();
  ASSERT_EQ(store_->Stats().disk.items, 4u);
  // A deadline already past writes nothing and says what it left.
  auto none = store_->PersistRam(std::chrono::steady_clock::now());
  EXPECT_EQ(none.written + none.already, 0u);
  EXPECT_EQ(none.left, 16u);
  EXPECT_EQ(store_->Stats().disk.items, 4u);
  auto all = store_->PersistRam(std::chrono::steady_clock::now() + std::chrono::seconds(30));
  EXPECT_TRUE(all.error.ok()) << all.error;
  EXPECT_EQ(all.written, 16u);
  EXPECT_EQ(all.left, 0u);
  EXPECT_EQ(store_->Stats().disk.items, 20u);
  // Written once: a second pass finds every block there already.
  auto again = store_->PersistRam(std::chrono::steady_clock::now() + std::chrono::seconds(30));
  EXPECT_EQ(again.written, 0u);
  EXPECT_EQ(again.already, 16u);
  // The RAM copies stay and serve; the NVMe copies are byte-exact.
  for (uint64_t n = 4; n < 20; ++n) EXPECT_EQ(GetAndCheck(n), TierKind::kRam) << n;
  Open(1 << 20);
  for (uint64_t n = 0; n < 20; ++n) EXPECT_EQ(GetAndCheck(n), TierKind::kDisk) << n;
}

TEST_F(StoreTest, UsageCountsEachNamespacesBlocksPerTierAndItsHits) {
  Open(1 << 20);  // 16 blocks of RAM
  auto other = store_->RegisterNamespace(
      NamespaceSpec{"other-model", "fp16", 1, 1, 64, 256, 0, 1, "", "", ""}, 0);
  ASSERT_TRUE(other.ok());
  for (uint64_t n = 0; n < 10; ++n) PutInline(n);
  NamespaceUsage u = store_->Usage(ns_);
  EXPECT_EQ(u.ram_blocks, 10u);
  EXPECT_EQ(u.nvme_blocks, 0u);
  EXPECT_EQ(store_->Usage(other->id).ram_blocks, 0u);
  // Past RAM's 16 blocks, the oldest demote to NVMe: every block is counted
  // once, in the tier that serves it.
  for (uint64_t n = 10; n < 40; ++n) PutInline(n);
  store_->disk().WaitIdle();
  u = store_->Usage(ns_);
  EXPECT_GT(u.nvme_blocks, 0u);
  EXPECT_LE(u.ram_blocks, 16u);
  EXPECT_EQ(u.ram_blocks + u.nvme_blocks, store_->Stats().ram.items + store_->Stats().disk.items);
  // Gets: 3 asked, 3 served; then a chain of 4 whose third is absent.
  const uint64_t asked = u.blocks_asked, served = u.blocks_served;
  for (uint64_t n : {37, 38, 39}) GetAndCheck(n);
  std::vector<BlockHash> chain = {H(38), H(39), H(1000), H(37)};
  auto g = store_->BeginGet(ns_, chain, "t");
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->sources.size(), 2u);
  ASSERT_TRUE(store_->EndGet(g->lease).ok());
  u = store_->Usage(ns_);
  EXPECT_EQ(u.blocks_asked - asked, 7u);
  EXPECT_EQ(u.blocks_served - served, 5u);
  // Removing the namespace leaves nothing counted in it.
  ASSERT_TRUE(store_->RemoveNamespace(ns_).ok());
  store_->disk().WaitIdle();
  u = store_->Usage(ns_);
  EXPECT_EQ(u.ram_blocks, 0u);
  EXPECT_EQ(u.nvme_blocks, 0u);
}

TEST_F(StoreTest, ExpiredGetLeaseUnpins) {
  Open(256 << 10, /*lease_ms=*/100);  // four slots
  for (uint64_t n = 0; n < 4; ++n) PutInline(n);
  std::vector<BlockHash> hs = {H(0), H(1), H(2), H(3)};
  auto g = store_->BeginGet(ns_, hs, "dead-reader");
  ASSERT_EQ(g->sources.size(), 4u);
  // Everything is pinned: a new block finds no room.
  auto r = store_->BeginPut(ns_, std::vector<BlockHash>{H(10)}, "t");
  EXPECT_EQ(r->targets[0].placement, Placement::kNoSpace);
  ASSERT_TRUE(
      testing::WaitFor([&] { return store_->Stats().get_leases == 0; }, std::chrono::seconds(10)));
  // Pins drop one lease period after expiry.
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        r = store_->BeginPut(ns_, std::vector<BlockHash>{H(10)}, "t");
        return r->targets[0].placement == Placement::kReserved;
      },
      std::chrono::seconds(10)));
  EXPECT_EQ(r->targets[0].placement, Placement::kReserved);
  EXPECT_EQ(store_->EndGet(g->lease).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(StoreTest, PutOfAKeyMidWriteElsewhere) {
  Open();
  std::vector<BlockHash> hs = {H(1)};
  auto first = store_->BeginPut(ns_, hs, "a");
  auto second = store_->BeginPut(ns_, hs, "b");
  EXPECT_EQ(second->targets[0].placement, Placement::kBusy);
  EXPECT_EQ(second->lease, 0u);
  std::string b = testing::BlockBytesFor(1, kBlock);
  auto inline_put = store_->PutInline(ns_, H(1), b, Checksum(b.data(), kBlock));
  EXPECT_EQ(inline_put.status().code(), absl::StatusCode::kAborted);
  EXPECT_NE(inline_put.status().message().find("being written"), std::string::npos);
  ASSERT_TRUE(store_->AbortPut(first->lease).ok());
}

TEST_F(StoreTest, DemotionThenPromotionIsByteExact) {
  Open(256 << 10);  // four RAM slots
  for (uint64_t n = 0; n < 12; ++n) PutInline(n);
  store_->disk().WaitIdle();
  auto st = store_->Stats();
  EXPECT_EQ(st.ram.items, 4u);
  EXPECT_EQ(st.ram.demotions, 8u);
  EXPECT_EQ(st.disk.items, 8u);
  std::vector<BlockHash> first = {H(0), H(1)};
  auto tiers = store_->Lookup(ns_, first);
  ASSERT_EQ(tiers->size(), 2u);
  EXPECT_EQ((*tiers)[0], TierKind::kDisk);
  // BeginGet promotes into RAM before handing out addresses.
  auto g = store_->BeginGet(ns_, first, "t");
  ASSERT_EQ(g->sources.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(g->sources[i].tier, TierKind::kDisk);
    EXPECT_EQ(std::string(reinterpret_cast<char*>(store_->ram().data(g->sources[i].slot)), kBlock),
              testing::BlockBytesFor(i, kBlock));
  }
  ASSERT_TRUE(store_->EndGet(g->lease).ok());
  EXPECT_EQ((*store_->Lookup(ns_, first))[0], TierKind::kRam);
  EXPECT_EQ(store_->Stats().ram.promotions, 2u);
  for (uint64_t n = 0; n < 12; ++n) GetAndCheck(n);
}

TEST_F(StoreTest, NamespacesSurviveRestartAndNvmeTierComesBack) {
  Open(256 << 10);
  for (uint64_t n = 0; n < 10; ++n) PutInline(n);
  store_->disk().WaitIdle();
  store_.reset();  // RAM is lost; disk is not
  StoreOptions o;
  o.ram.bytes = 256 << 10;
  o.ram.slab_bytes = 256 << 10;
  o.ram.try_hugepages = false;
  o.disk.dir = dir_.sub("db");
  store_ = std::move(*Store::Open(o));
  ASSERT_EQ(store_->ListNamespaces().size(), 1u);
  EXPECT_EQ(store_->ListNamespaces()[0].id, ns_);
  for (uint64_t n = 0; n < 6; ++n) EXPECT_EQ(GetAndCheck(n), TierKind::kDisk);
  std::vector<BlockHash> last = {H(9)};
  EXPECT_EQ(store_->Lookup(ns_, last)->size(), 0u);  // was only in RAM
}

TEST_F(StoreTest, BadInputIsRefusedWithAReasonAndChangesNothing) {
  Open();
  PutInline(1);
  std::vector<BlockHash> one = {H(1)};
  auto expect = [](absl::Status s, absl::StatusCode code, const std::string& needle) {
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  expect(store_->Lookup(12345, one).status(), absl::StatusCode::kNotFound, "not registered");
  expect(store_->BeginPut(12345, one, "t").status(), absl::StatusCode::kNotFound, "not registered");
  expect(store_->Lookup(ns_, {}).status(), absl::StatusCode::kInvalidArgument, "no block hashes");
  std::vector<BlockHash> many(kMaxBlocksPerRequest + 1, H(5));
  expect(store_->BeginGet(ns_, many, "t").status(), absl::StatusCode::kInvalidArgument, "limit");
  std::vector<BlockHash> dup = {H(7), H(7)};
  expect(store_->BeginPut(ns_, dup, "t").status(), absl::StatusCode::kInvalidArgument, "twice");
  std::string small(100, 'x');
  expect(store_->PutInline(ns_, H(2), small, Checksum(small.data(), 100)).status(),
         absl::StatusCode::kInvalidArgument, "carries 100 bytes");
  std::string b = testing::BlockBytesFor(3, kBlock);
  expect(store_->PutInline(ns_, H(3), b, 42).status(), absl::StatusCode::kDataLoss, "checksum");
  expect(store_->CommitPut(999, std::vector<uint64_t>{}).status(),
         absl::StatusCode::kFailedPrecondition, "lease 999");
  NamespaceSpec s = Spec();
  expect(store_->RegisterNamespace(s, ns_ + 1).status(), absl::StatusCode::kInvalidArgument,
         "mismatch");
  s.head_dim = 4096;
  s.block_tokens = 4096;
  expect(store_->RegisterNamespace(s, 0).status(), absl::StatusCode::kInvalidArgument,
         "--ram-slab-bytes");
  s = Spec();
  s.dtype = "int4";
  expect(store_->RegisterNamespace(s, 0).status(), absl::StatusCode::kInvalidArgument, "int4");
  expect(store_->EvictNamespace(777).status(), absl::StatusCode::kNotFound, "not registered");
  expect(store_->SetPolicy(TierKind::kRam, "mru", {}), absl::StatusCode::kInvalidArgument, "mru");
  // Nothing already stored changed.
  GetAndCheck(1);
  EXPECT_EQ(store_->Stats().ram.items, 1u);
  std::vector<BlockHash> absent = {H(2), H(3), H(7)};
  EXPECT_EQ(store_->Lookup(ns_, absent)->size(), 0u);
}

TEST_F(StoreTest, EvictByKeyNamespaceAndAll) {
  Open(256 << 10);
  for (uint64_t n = 0; n < 8; ++n) PutInline(n);
  store_->disk().WaitIdle();
  std::vector<BlockKey> keys = {BlockKey{ns_, H(0)}, BlockKey{ns_, H(7)}};
  auto r = store_->EvictKeys(keys);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->ram_blocks + r->disk_blocks, 2u);
  std::vector<BlockHash> h0 = {H(0)}, h7 = {H(7)};
  EXPECT_EQ(store_->Lookup(ns_, h0)->size(), 0u);
  EXPECT_EQ(store_->Lookup(ns_, h7)->size(), 0u);
  auto all = store_->EvictNamespace(ns_);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->ram_blocks + all->disk_blocks, 6u);
  auto st = store_->Stats();
  EXPECT_EQ(st.ram.items + st.disk.items, 0u);
}

}  // namespace
}  // namespace kvtier::store
