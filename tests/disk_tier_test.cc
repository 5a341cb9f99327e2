#include "cachestore/disk_tier.h"

#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include <string>
#include <thread>

#include "cachestore/record.h"
#include "common/checksum.h"
#include "tests/test_util.h"

namespace kvtier::store {
namespace {

constexpr uint64_t kBlock = 64 << 10;
BlockKey Key(uint64_t n, uint64_t ns = 1) { return BlockKey{ns, BlockHash{n, ~n}}; }

std::unique_ptr<DiskTier> Open(const std::string& dir, uint64_t bytes = 64 << 20,
                               std::string policy = "lru") {
  DiskTierOptions o;
  o.dir = dir;
  o.bytes = bytes;
  o.policy = policy;
  auto t = DiskTier::Open(o);
  EXPECT_TRUE(t.ok()) << t.status();
  return std::move(*t);
}

void Write(DiskTier& t, uint64_t n) {
  std::string b = testing::BlockBytesFor(n, kBlock);
  ASSERT_TRUE(t.Write(Key(n), reinterpret_cast<const uint8_t*>(b.data()), kBlock,
                      Checksum(b.data(), kBlock))
                  .ok());
}

void ExpectBlock(DiskTier& t, uint64_t n) {
  uint64_t sum = 0;
  auto r = t.Read(Key(n), &sum);
  ASSERT_TRUE(r.ok()) << n << ": " << r.status();
  EXPECT_EQ(*r, testing::BlockBytesFor(n, kBlock)) << n;
  EXPECT_EQ(sum, Checksum(r->data(), r->size()));
}

TEST(Record, RoundTripAndEveryCorruptionIsCaught) {
  std::string payload = testing::BlockBytesFor(3, 1000);
  std::string rec = EncodeRecord(payload.data(), payload.size(), Checksum(payload.data(), 1000));
  auto d = DecodeRecord(rec);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->payload, payload);
  EXPECT_EQ(DecodeRecord(rec.substr(0, 10)).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_FALSE(DecodeRecord(rec.substr(0, rec.size() - 1)).ok());  // truncated payload
  for (size_t pos : {0ul, 4ul, 20ul, 500ul}) {
    std::string bad = rec;
    bad[pos] ^= 0x40;
    EXPECT_FALSE(DecodeRecord(bad).ok()) << pos;
  }
}

TEST(DiskTier, WriteReadAndSurviveRestart) {
  testing::TempDir dir;
  {
    auto t = Open(dir.path());
    for (uint64_t n = 0; n < 20; ++n) Write(*t, n);
    ExpectBlock(*t, 7);
  }
  auto t = Open(dir.path());
  auto snap = t->Snapshot();
  EXPECT_EQ(snap.items, 20u);
  EXPECT_EQ(snap.used_bytes, 20 * (kBlock + kRecordHeaderBytes));
  for (uint64_t n = 0; n < 20; ++n) {
    EXPECT_TRUE(t->Contains(Key(n)));
    ExpectBlock(*t, n);
  }
  uint64_t sum;
  EXPECT_EQ(t->Read(Key(1000), &sum).status().code(), absl::StatusCode::kNotFound);
}

TEST(DiskTier, QuotaHoldsUnderAWriteBurst) {
  testing::TempDir dir;
  const uint64_t quota = 10 * (kBlock + kRecordHeaderBytes) + 100;
  auto t = Open(dir.path(), quota);
  for (uint64_t n = 0; n < 200; ++n) {
    Write(*t, n);
    ASSERT_LE(t->Snapshot().used_bytes, quota) << n;
  }
  auto snap = t->Snapshot();
  EXPECT_EQ(snap.items, 10u);
  EXPECT_EQ(snap.evictions, 190u);
  for (uint64_t n = 190; n < 200; ++n) ExpectBlock(*t, n);  // LRU kept the newest
  EXPECT_FALSE(t->Contains(Key(0)));
  // The quota is still right after a restart.
  t.reset();
  t = Open(dir.path(), quota);
  EXPECT_EQ(t->Snapshot().items, 10u);
  // A block larger than the whole quota is refused with a reason.
  std::string big(quota, 'x');
  auto s = t->Write(Key(9999), reinterpret_cast<const uint8_t*>(big.data()), big.size(), 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("quota"), std::string::npos);
}

TEST(DiskTier, CorruptRecordIsRejectedAndRemoved) {
  testing::TempDir dir;
  {
    auto t = Open(dir.path());
    Write(*t, 1);
    Write(*t, 2);
  }
  {
    // Flip a byte of block 1's record behind the tier's back.
    rocksdb::DBOptions o;
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
        {rocksdb::kDefaultColumnFamilyName, {}}, {"blocks", {}}, {"index", {}}, {"meta", {}}};
    std::vector<rocksdb::ColumnFamilyHandle*> h;
    rocksdb::DB* db;
    ASSERT_TRUE(rocksdb::DB::Open(o, dir.path(), cfs, &h, &db).ok());
    std::string key(24, '\0');
    for (int b = 0; b < 8; ++b) {
      key[7 - b] = static_cast<char>(uint64_t{1} >> (8 * b));
      key[15 - b] = static_cast<char>(uint64_t{1} >> (8 * b));
      key[23 - b] = static_cast<char>(~uint64_t{1} >> (8 * b));
    }
    std::string value;
    auto got = db->Get({}, h[1], key, &value);
    ASSERT_TRUE(got.ok()) << got.ToString();
    value[kRecordHeaderBytes + 100] ^= 1;
    ASSERT_TRUE(db->Put({}, h[1], key, value).ok());
    for (auto* c : h) db->DestroyColumnFamilyHandle(c);
    delete db;
  }
  auto t = Open(dir.path());
  uint64_t sum;
  auto r = t->Read(Key(1), &sum);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(t->checksum_failures(), 1u);
  EXPECT_FALSE(t->Contains(Key(1)));  // never served again
  ExpectBlock(*t, 2);
}

TEST(DiskTier, WriteBackQueueServesReadsAndDrains) {
  testing::TempDir dir;
  auto t = Open(dir.path());
  for (uint64_t n = 0; n < 30; ++n) {
    std::string b = testing::BlockBytesFor(n, kBlock);
    EXPECT_TRUE(t->Enqueue(EvictedBlock{Key(n), reinterpret_cast<const uint8_t*>(b.data()), kBlock,
                                        Checksum(b.data(), kBlock), 0}));
    EXPECT_TRUE(t->Contains(Key(n)));
  }
  ExpectBlock(*t, 29);  // from the queue or from disk, whichever holds it
  t->WaitIdle();
  EXPECT_EQ(t->QueueStats().blocks, 0u);
  EXPECT_EQ(t->Snapshot().items, 30u);
  for (uint64_t n = 0; n < 30; ++n) ExpectBlock(*t, n);
}

TEST(DiskTier, FullQueueDropsAndCounts) {
  testing::TempDir dir;
  DiskTierOptions o;
  o.dir = dir.path();
  o.queue_bytes = kBlock;  // room for one block at a time
  auto t = std::move(*DiskTier::Open(o));
  std::string b(kBlock, 'q');
  int accepted = 0;
  for (uint64_t n = 0; n < 50; ++n) {
    accepted += t->Enqueue(EvictedBlock{Key(n), reinterpret_cast<const uint8_t*>(b.data()), kBlock,
                                        Checksum(b.data(), kBlock), 0});
  }
  t->WaitIdle();
  EXPECT_EQ(t->QueueStats().dropped, static_cast<uint64_t>(50 - accepted));
  EXPECT_GT(t->QueueStats().dropped, 0u);
  EXPECT_EQ(t->Snapshot().items, static_cast<uint64_t>(accepted));
}

TEST(DiskTier, ReusedAdmissionOnlyTakesBlocksThatWereRead) {
  testing::TempDir dir;
  DiskTierOptions o;
  o.dir = dir.path();
  o.admission = "reused";
  auto t = std::move(*DiskTier::Open(o));
  std::string b(kBlock, 'r');
  EXPECT_FALSE(
      t->Enqueue(EvictedBlock{Key(1), reinterpret_cast<const uint8_t*>(b.data()), kBlock, 0, 0}));
  EXPECT_TRUE(t->Enqueue(EvictedBlock{Key(2), reinterpret_cast<const uint8_t*>(b.data()), kBlock,
                                      Checksum(b.data(), kBlock), 1}));
  t->WaitIdle();
  EXPECT_FALSE(t->Contains(Key(1)));
  EXPECT_TRUE(t->Contains(Key(2)));
}

TEST(DiskTier, EraseNamespaceAndAllAndPolicySwitch) {
  testing::TempDir dir;
  auto t = Open(dir.path());
  std::string b(kBlock, 'e');
  for (uint64_t n = 0; n < 5; ++n) {
    for (uint64_t ns : {1, 2}) {
      ASSERT_TRUE(t->Write(Key(n, ns), reinterpret_cast<const uint8_t*>(b.data()), kBlock,
                           Checksum(b.data(), kBlock))
                      .ok());
    }
  }
  ASSERT_TRUE(t->SetPolicy("sieve", {}).ok());
  EXPECT_EQ(t->policy(), "sieve");
  EXPECT_EQ(t->Snapshot().items, 10u);
  EXPECT_EQ(t->EraseNamespace(1).erased, 5u);
  EXPECT_FALSE(t->Contains(Key(0, 1)));
  EXPECT_TRUE(t->Contains(Key(0, 2)));
  EXPECT_EQ(t->EraseAll().erased, 5u);
  EXPECT_EQ(t->Snapshot().used_bytes, 0u);
  t.reset();
  t = Open(dir.path());
  EXPECT_EQ(t->Snapshot().items, 0u);  // erasure is durable
}

}  // namespace
}  // namespace kvtier::store
