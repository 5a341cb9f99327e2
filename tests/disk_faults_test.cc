// The disk tier's answers to a full filesystem, write errors, read errors and
// corrupt records, through FaultInjectingBackend over a real RocksDB. The
// same faults are also produced for real at process level (tmpfs, prlimit)
// in fault_test.cc.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "cachestore/disk_tier.h"
#include "cachestore/fault_injecting_backend.h"
#include "cachestore/rocksdb_backend.h"
#include "cachestore/store.h"
#include "common/checksum.h"
#include "tests/test_util.h"

namespace kvtier::store {
namespace {

constexpr uint64_t kBlock = 64 << 10;
BlockKey Key(uint64_t n) { return BlockKey{1, BlockHash{n, ~n}}; }

struct FaultyTier {
  FaultInjectingBackend* faults = nullptr;  // owned by tier
  std::unique_ptr<DiskTier> tier;
};

FaultyTier Open(const std::string& dir, uint64_t reserve = 64 << 20,
                DiskSync sync = DiskSync::kNone, uint64_t sync_interval_ms = 10) {
  auto rocks = RocksDbBackend::Open(dir);
  EXPECT_TRUE(rocks.ok()) << rocks.status();
  auto backend = std::make_unique<FaultInjectingBackend>(std::move(*rocks));
  FaultyTier f;
  f.faults = backend.get();
  DiskTierOptions o;
  o.dir = dir;
  o.bytes = 64 << 20;
  o.reserve_bytes = reserve;
  o.sync = sync;
  o.sync_interval_ms = sync_interval_ms;
  auto t = DiskTier::Open(o, std::move(backend));
  EXPECT_TRUE(t.ok()) << t.status();
  f.tier = std::move(*t);
  return f;
}

absl::Status Write(DiskTier& t, uint64_t n) {
  std::string b = testing::BlockBytesFor(n, kBlock);
  return t.Write(Key(n), reinterpret_cast<const uint8_t*>(b.data()), kBlock,
                 Checksum(b.data(), kBlock));
}

bool Enqueue(DiskTier& t, uint64_t n) {
  std::string b = testing::BlockBytesFor(n, kBlock);
  return t.Enqueue(EvictedBlock{Key(n), reinterpret_cast<const uint8_t*>(b.data()), kBlock,
                                Checksum(b.data(), kBlock), 1});
}

void ExpectBlock(DiskTier& t, uint64_t n) {
  uint64_t sum = 0;
  auto r = t.Read(Key(n), &sum);
  ASSERT_TRUE(r.ok()) << n << ": " << r.status();
  EXPECT_EQ(*r, testing::BlockBytesFor(n, kBlock)) << n;
}

TEST(DiskFaults, FullFilesystemPausesWritesKeepsReadsAndRecoversWhenSpaceReturns) {
  testing::TempDir dir;
  auto f = Open(dir.path());
  for (uint64_t n = 0; n < 4; ++n) ASSERT_TRUE(Write(*f.tier, n).ok());
  const uint64_t writes_before = f.faults->writes_attempted();

  f.faults->set_free_bytes(10 << 20);  // below the 64 MiB reserve
  absl::Status s = Write(*f.tier, 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("--disk-reserve-bytes"), std::string::npos) << s;
  EXPECT_EQ(f.faults->writes_attempted(), writes_before) << "nothing may reach RocksDB";
  TierSnapshot snap = f.tier->Snapshot();
  EXPECT_TRUE(snap.degraded);
  EXPECT_NE(snap.degraded_reason.find("disk full"), std::string::npos) << snap.degraded_reason;
  // Demotions are refused without being copied while paused, and counted.
  EXPECT_FALSE(Enqueue(*f.tier, 5));
  EXPECT_EQ(f.tier->QueueStats().dropped, 1u);
  for (uint64_t n = 0; n < 4; ++n) ExpectBlock(*f.tier, n);  // reads go on

  f.faults->set_free_bytes(std::nullopt);  // space returns: the writer notices by itself
  for (int i = 0; i < 50 && f.tier->Snapshot().degraded; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_FALSE(f.tier->Snapshot().degraded) << "not recovered within 5 s";
  ASSERT_TRUE(Enqueue(*f.tier, 6));
  f.tier->WaitIdle();
  ExpectBlock(*f.tier, 6);
}

TEST(DiskFaults, AWriteErrorStopsWritesKeepsReadsAndARestartRecoversEverything) {
  testing::TempDir dir;
  {
    auto f = Open(dir.path());
    for (uint64_t n = 0; n < 6; ++n) ASSERT_TRUE(Write(*f.tier, n).ok());
    f.faults->set_write_error(absl::UnavailableError("IO error: injected EIO"));
    absl::Status s = Write(*f.tier, 6);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    TierSnapshot snap = f.tier->Snapshot();
    EXPECT_TRUE(snap.degraded);
    EXPECT_NE(snap.degraded_reason.find("injected EIO"), std::string::npos) << snap.degraded_reason;
    EXPECT_FALSE(f.tier->Contains(Key(6)));

    // From now on nothing is written, even once the device is fine again:
    // RocksDB 7.8 must not see its failed WAL writer used again.
    f.faults->set_write_error(absl::OkStatus());
    const uint64_t attempts = f.faults->writes_attempted();
    EXPECT_EQ(Write(*f.tier, 7).code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(f.tier->PutMeta("ns/x", "y").code(), absl::StatusCode::kUnavailable);
    EXPECT_FALSE(Enqueue(*f.tier, 8));
    EXPECT_EQ(f.faults->writes_attempted(), attempts);
    for (uint64_t n = 0; n < 6; ++n) ExpectBlock(*f.tier, n);
  }
  auto f = Open(dir.path());  // restart: every acknowledged block is back, writes work
  EXPECT_FALSE(f.tier->Snapshot().degraded);
  for (uint64_t n = 0; n < 6; ++n) ExpectBlock(*f.tier, n);
  EXPECT_TRUE(Write(*f.tier, 7).ok());
  ExpectBlock(*f.tier, 7);
}

TEST(DiskFaults, ACorruptRecordIsNeverServedAndIsRemoved) {
  testing::TempDir dir;
  auto f = Open(dir.path());
  for (uint64_t n = 0; n < 3; ++n) ASSERT_TRUE(Write(*f.tier, n).ok());
  f.faults->set_corrupt_block_reads(100);  // one payload byte flips on the way up
  uint64_t sum = 0;
  auto r = f.tier->Read(Key(1), &sum);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_EQ(f.tier->checksum_failures(), 1u);
  EXPECT_FALSE(f.tier->Contains(Key(1)));
  f.faults->set_corrupt_block_reads(std::nullopt);
  EXPECT_EQ(f.tier->Read(Key(1), &sum).status().code(), absl::StatusCode::kNotFound);
  ExpectBlock(*f.tier, 0);
  ExpectBlock(*f.tier, 2);
}

TEST(DiskFaults, StorageCorruptionIsDataLossAndAnIoErrorLeavesTheBlock) {
  testing::TempDir dir;
  auto f = Open(dir.path());
  for (uint64_t n = 0; n < 3; ++n) ASSERT_TRUE(Write(*f.tier, n).ok());
  uint64_t sum = 0;
  // A transient read error: reported, the block stays (it may well be fine).
  f.faults->set_read_error(absl::UnavailableError("IO error: injected read failure"));
  EXPECT_EQ(f.tier->Read(Key(0), &sum).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(f.tier->Contains(Key(0)));
  // The engine reporting corruption is DATA_LOSS, and the block goes.
  f.faults->set_read_error(absl::DataLossError("Corruption: injected bad block"));
  EXPECT_EQ(f.tier->Read(Key(1), &sum).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_FALSE(f.tier->Contains(Key(1)));
  f.faults->set_read_error(absl::OkStatus());
  ExpectBlock(*f.tier, 0);
  ExpectBlock(*f.tier, 2);
}

// A store whose metadata cannot be read does not start: it would serve
// without some of its namespaces (the scan used to log and go on with a
// partial list). An index entry it cannot decode is counted and said.
TEST(DiskFaults, AMetadataScanFailureStopsStartUpAndBadIndexEntriesAreCounted) {
  testing::TempDir dir;
  StoreOptions o;
  o.ram.bytes = 8 << 20;
  o.ram.slab_bytes = 1 << 20;
  o.disk.dir = dir.path();
  NamespaceSpec spec{"m", "fp16", 2, 2, 64, 64, 0, 1, "", "", ""};
  uint64_t ns = 0;
  {
    auto store = Store::Open(o);
    ASSERT_TRUE(store.ok()) << store.status();
    auto r = (*store)->RegisterNamespace(spec, 0);
    ASSERT_TRUE(r.ok()) << r.status();
    ns = r->id;
  }
  o.disk_backend = [&]() -> std::unique_ptr<StorageBackend> {
    auto b = std::make_unique<FaultInjectingBackend>(*RocksDbBackend::Open(dir.path()));
    b->set_scan_error(Column::kMeta, absl::UnavailableError("injected: the scan failed"));
    return b;
  };
  auto refused = Store::Open(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(refused.status().message().find("loading the store's namespaces"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("injected"), std::string::npos) << refused.status();
  {
    auto b = RocksDbBackend::Open(dir.path());
    ASSERT_TRUE(b.ok());
    WriteBatch w;
    w.Put(Column::kIndex, "not a block key", "nor an index entry");
    ASSERT_TRUE((*b)->Write(w, true).ok());
  }
  o.disk_backend = nullptr;
  auto store = Store::Open(o);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->disk().skipped_index_entries(), 1u);
  EXPECT_TRUE((*store)->RegisterNamespace(spec, ns).ok()) << "the namespace survived";
}

// A whole Store (8 MiB of RAM) over a real RocksDB behind a
// FaultInjectingBackend, one namespace registered, and Open() puts blocks
// 0-399: more than RAM holds, so the oldest are demoted to NVMe.
struct FaultyStore {
  testing::TempDir dir;
  FaultInjectingBackend* faults = nullptr;
  std::unique_ptr<Store> store;
  uint64_t ns = 0, bytes = 0;

  void Open() {
    StoreOptions o;
    o.ram.bytes = 8 << 20;
    o.ram.slab_bytes = 1 << 20;
    o.ram.try_hugepages = false;
    o.disk.dir = dir.path();
    o.disk_backend = [this]() -> std::unique_ptr<StorageBackend> {
      auto b = std::make_unique<FaultInjectingBackend>(*RocksDbBackend::Open(dir.path()));
      faults = b.get();
      return b;
    };
    auto s = Store::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store = std::move(*s);
    NamespaceSpec spec;
    spec.model = "m";
    spec.dtype = "fp16";
    spec.layers = 2;
    spec.kv_heads = 2;
    spec.head_dim = 64;
    spec.block_tokens = 64;
    auto info = store->RegisterNamespace(spec, 0);
    ASSERT_TRUE(info.ok()) << info.status();
    ns = info->id;
    bytes = info->block_bytes;
    for (uint64_t n = 0; n < 400; ++n) ASSERT_NO_FATAL_FAILURE(Put(n));
    store->disk().WaitIdle();
  }
  void Put(uint64_t n) {
    std::string b = testing::BlockBytesFor(n, bytes);
    auto r = store->PutInline(ns, BlockHash{n, n}, b, Checksum(b.data(), b.size()));
    ASSERT_TRUE(r.ok()) << r.status();
  }
};

// The whole store over a full disk: puts go on into RAM, reads of NVMe
// blocks go on, nothing is lost.
TEST(DiskFaults, AStoreOnAFullDiskKeepsServingFromRam) {
  FaultyStore f;
  ASSERT_NO_FATAL_FAILURE(f.Open());
  const uint64_t on_disk = f.store->Stats().disk.items;
  ASSERT_GT(on_disk, 0u);
  f.faults->set_free_bytes(0);
  for (uint64_t n = 400; n < 800; ++n) ASSERT_NO_FATAL_FAILURE(f.Put(n));
  f.store->disk().WaitIdle();
  StoreStats st = f.store->Stats();
  EXPECT_TRUE(st.disk.degraded);
  EXPECT_EQ(st.disk.items, on_disk) << "nothing written, nothing lost";
  // The newest blocks are in RAM and every NVMe block is still readable.
  std::vector<BlockHash> last = {BlockHash{799, 799}};
  EXPECT_EQ((*f.store->Lookup(f.ns, last))[0], TierKind::kRam);
  uint64_t served = 0;
  for (const BlockKey& k : f.store->disk().Keys()) {
    std::vector<BlockHash> one = {k.hash};
    ASSERT_TRUE(f.store
                    ->GetInline(f.ns, one,
                                [&](uint32_t, TierKind, std::string_view b, uint64_t) {
                                  EXPECT_EQ(std::string(b),
                                            testing::BlockBytesFor(k.hash.lo, f.bytes));
                                  ++served;
                                  return true;
                                })
                    .ok());
  }
  EXPECT_EQ(served, on_disk);
}

// An I/O error reading the NVMe tier is an error, not a miss: a get that
// found nothing before it is UNAVAILABLE naming the block, one that did
// ends its prefix there; both are counted; the block stays and reads again
// once the device does. A block that is not there is still a miss.
TEST(DiskFaults, AReadErrorOnAGetIsAnErrorNotAMiss) {
  FaultyStore f;
  ASSERT_NO_FATAL_FAILURE(f.Open());
  std::vector<BlockKey> on_disk = f.store->disk().Keys();
  ASSERT_FALSE(on_disk.empty());
  const BlockHash cold = on_disk.front().hash;
  const BlockHash hot{399, 399};
  ASSERT_EQ((*f.store->Lookup(f.ns, std::vector<BlockHash>{hot}))[0], TierKind::kRam);

  f.faults->set_read_error(absl::UnavailableError("IO error: injected read failure"));
  std::vector<BlockHash> cold_first = {cold, hot};
  auto g = f.store->BeginGet(f.ns, cold_first, "t");
  EXPECT_EQ(g.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(g.status().message().find(ToHex(cold)), std::string::npos) << g.status();
  std::vector<BlockHash> hot_first = {hot, cold};
  g = f.store->BeginGet(f.ns, hot_first, "t");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->sources.size(), 1u);  // the prefix ends at the failed read
  ASSERT_TRUE(f.store->EndGet(g->lease).ok());
  auto inline_get = f.store->GetInline(
      f.ns, cold_first, [](uint32_t, TierKind, std::string_view, uint64_t) { return true; });
  EXPECT_EQ(inline_get.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(f.store->Stats().disk_read_errors, 3u);
  EXPECT_EQ(f.store->Stats().get_leases, 0u);  // the refused get holds nothing

  f.faults->set_read_error(absl::OkStatus());
  std::vector<BlockHash> missing = {BlockHash{9999, 9999}};
  g = f.store->BeginGet(f.ns, missing, "t");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(g->sources.empty());  // a block that is not there: a miss
  g = f.store->BeginGet(f.ns, cold_first, "t");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->sources.size(), 2u);
  ASSERT_TRUE(f.store->EndGet(g->lease).ok());
  EXPECT_EQ(f.store->Stats().disk_read_errors, 3u);
}

TEST(DiskFaults, EachSyncModeSaysNvmeOnlyForWhatItMadeDurable) {
  {
    // none: on NVMe once written (a crash of the process keeps it); no fsync.
    testing::TempDir dir;
    FaultyTier f = Open(dir.path(), 64 << 20, DiskSync::kNone);
    ASSERT_TRUE(Write(*f.tier, 1).ok());
    EXPECT_TRUE(f.tier->Durable(Key(1)));
    EXPECT_EQ(f.faults->synced_writes(), 0u);
    EXPECT_EQ(f.faults->syncs(), 0u);
  }
  {
    // commit: each write is fsynced before it returns.
    testing::TempDir dir;
    FaultyTier f = Open(dir.path(), 64 << 20, DiskSync::kCommit);
    ASSERT_TRUE(Write(*f.tier, 1).ok());
    ASSERT_TRUE(Write(*f.tier, 2).ok());
    EXPECT_TRUE(f.tier->Durable(Key(1)));
    EXPECT_TRUE(f.tier->Durable(Key(2)));
    EXPECT_EQ(f.faults->synced_writes(), 2u);
  }
  {
    // group: durable once the next group's fsync returned; a failing fsync
    // keeps its blocks from counting, and the next one that works counts
    // them. Reads never wait for it.
    testing::TempDir dir;
    FaultyTier f = Open(dir.path(), 64 << 20, DiskSync::kGroup, 50);
    f.faults->set_sync_error(absl::UnavailableError("fsync: input/output error"));
    ASSERT_TRUE(Write(*f.tier, 1).ok());
    ASSERT_TRUE(Write(*f.tier, 2).ok());
    EXPECT_FALSE(f.tier->Durable(Key(1)));
    ExpectBlock(*f.tier, 1);
    ASSERT_TRUE(testing::WaitFor([&] { return f.tier->sync_failures() >= 2; }));
    EXPECT_FALSE(f.tier->Durable(Key(1)));
    EXPECT_FALSE(f.tier->Durable(Key(2)));
    EXPECT_EQ(f.faults->synced_writes(), 0u);
    f.faults->set_sync_error(absl::OkStatus());
    ASSERT_TRUE(testing::WaitFor([&] { return f.tier->Durable(Key(1)); }));
    EXPECT_TRUE(f.tier->Durable(Key(2)));
    EXPECT_GE(f.tier->syncs(), 1u);
    // An evicted block leaves the unsynced set with the index.
    ASSERT_TRUE(Write(*f.tier, 3).ok());
    f.tier->Erase({Key(3)});
    EXPECT_FALSE(f.tier->Durable(Key(3)));
  }
  // A group sync needs an interval.
  DiskTierOptions o;
  o.sync = DiskSync::kGroup;
  o.sync_interval_ms = 0;
  absl::Status bad = o.Validate();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("--disk-sync-interval"), std::string::npos) << bad;
}

}  // namespace
}  // namespace kvtier::store
