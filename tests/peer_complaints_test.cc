// What users of peer KV stores report as wrong answers, asked of kvtier:
// each test names the report, recreates its situation against kvtier, and
// asserts that kvtier answers with an error or a miss, never with wrong or
// empty bytes served as a hit.
//
// - Mooncake #4239: a read whose lease expired while it was being served
//   returned whatever the reused memory held.
// - Mooncake #3884: a block whose disk copy was missing came back as empty
//   bytes.
// - LMCache #4991: a store that failed stayed visible to lookups, and later
//   retrievals served its garbage.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cachestore/fault_injecting_backend.h"
#include "cachestore/rocksdb_backend.h"
#include "cachestore/store.h"
#include "client/store_data_client.h"
#include "common/checksum.h"
#include "tests/test_util.h"
#include "tests/transports.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;
using testing::BlockBytesFor;
using testing::WaitFor;

// 2 (K, V) x 1 layer x 1 head x 64 dim x 2 bytes x 256 tokens = 64 KiB.
NamespaceSpec Spec() {
  return NamespaceSpec{"peer-model", "fp16", 1, 1, 64, 256, 0, 1, "", "", ""};
}
constexpr uint64_t kBlock = 64 << 10;
BlockHash H(uint64_t n) { return BlockHash{0x4239 + n, n}; }

std::vector<BlockHash> Chain(uint64_t first, uint64_t n) {
  std::vector<BlockHash> c;
  for (uint64_t i = 0; i < n; ++i) c.push_back(H(first + i));
  return c;
}

// "socket", "ucx" (RMA over TCP) and "mapped" (the store's arena mapped).
class ExpiredLease : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    // 200 ms leases; 1 MiB of RAM: 16 blocks, so new writes reuse the slots
    // of any block whose pin is gone.
    store_ = testing::StartLoopbackStore(
        dir_.sub("store"),
        testing::StoreFlagsFor(GetParam(),
                               {"--lease-ms=200ms", "--ram-bytes=1MiB", "--ram-slab-bytes=1MiB"}));
    ASSERT_GT(store_->port(), 0) << store_->Log();
  }
  DataClientOptions Options() const { return testing::ClientOptionsFor(GetParam()); }
  std::vector<uint8_t> Put(StoreDataClient& c, uint64_t ns, uint64_t first, uint64_t n) {
    std::vector<uint8_t> src(n * kBlock);
    std::vector<PutBlock> put;
    for (uint64_t i = 0; i < n; ++i) {
      std::string b = BlockBytesFor(first + i, kBlock);
      std::memcpy(src.data() + i * kBlock, b.data(), kBlock);
      put.push_back({H(first + i), src.data() + i * kBlock});
    }
    auto r = c.Put(ns, kBlock, put).get();
    EXPECT_TRUE(r.ok()) << r.status();
    return src;
  }

  testing::TempDir dir_;
  std::unique_ptr<testing::ServerProcess> store_;
};

// Mooncake #4239. The reader holds a pin it believes is still good (a read
// that began just before expiry, a stalled client, a skewed clock); the
// store has expired it and given its slots to other blocks. The read is an
// error: refused by the store, or its bytes fail the checksum the pin
// carried. A fresh pin reads the right bytes or misses.
TEST_P(ExpiredLease, MooncakeIssue4239_AReadPastItsLeaseIsAnErrorNeverAnotherBlocksBytes) {
  StoreDataClient reader(store_->address(), Options());
  StoreDataClient writer(store_->address(), Options());
  auto ns = reader.control().RegisterNamespace(Spec());
  ASSERT_TRUE(ns.ok()) << ns.status();
  auto src = Put(writer, ns->id, 0, 8);
  auto pin = reader.Pin(ns->id, kBlock, Chain(0, 8));
  ASSERT_TRUE(pin.ok()) << pin.status();
  ASSERT_EQ(pin->sources.size(), 8u);
  PinnedBlocks stale = *pin;
  stale.expires = std::chrono::steady_clock::now() + 1h;  // the reader's belief
  // The store expires the pin, then its slots go to 16 other blocks.
  ASSERT_TRUE(WaitFor(
      [&] {
        auto st = reader.control().GetStats();
        return st.ok() && st->get_leases() == 0 && st->leases_expired() >= 1;
      },
      10s));
  std::this_thread::sleep_for(500ms);  // past the grace period
  Put(writer, ns->id, 100, 16);
  std::vector<uint8_t> dst(8 * kBlock, 0);
  ReadPlan plan;
  plan.dest = [&](size_t i, size_t) { return dst.data() + i * kBlock; };
  auto got = reader.Read(stale, kBlock, 0, 8, plan).get();
  ASSERT_FALSE(got.ok()) << "a read of an expired pin was served as a hit";
  EXPECT_TRUE(got.status().code() == absl::StatusCode::kFailedPrecondition ||
              got.status().code() == absl::StatusCode::kNotFound ||
              got.status().code() == absl::StatusCode::kDataLoss)
      << got.status();
  // Asked again, the store answers with the right bytes (from NVMe, where
  // the old blocks went) or a miss.
  auto again = reader.Pin(ns->id, kBlock, Chain(0, 8));
  ASSERT_TRUE(again.ok()) << again.status();
  std::fill(dst.begin(), dst.end(), 0);
  if (!again->sources.empty()) {
    auto ok = reader.Read(*again, kBlock, 0, again->sources.size(), plan).get();
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_EQ(0, std::memcmp(dst.data(), src.data(), again->sources.size() * kBlock));
    reader.Release(again->lease);
  }
  auto st = reader.control().GetStats();
  ASSERT_TRUE(st.ok());
  EXPECT_GE(st->leases_expired(), 1u);
}

INSTANTIATE_TEST_SUITE_P(Transports, ExpiredLease, ::testing::Values("socket", "ucx", "mapped"),
                         [](const auto& info) { return std::string(info.param); });

// A store whose NVMe tier reads through FaultInjectingBackend.
struct FaultyStore {
  store::FaultInjectingBackend* faults = nullptr;  // owned by the store
  std::unique_ptr<store::Store> store;
  uint64_t ns = 0;

  explicit FaultyStore(const std::string& dir) {
    store::StoreOptions o;
    o.ram.bytes = 2 << 20;  // 32 blocks
    o.ram.slab_bytes = 1 << 20;
    o.ram.try_hugepages = false;
    o.disk.dir = dir;
    o.disk_backend = [&]() -> std::unique_ptr<store::StorageBackend> {
      auto b = std::make_unique<store::FaultInjectingBackend>(*store::RocksDbBackend::Open(dir));
      faults = b.get();
      return b;
    };
    auto s = store::Store::Open(o);
    EXPECT_TRUE(s.ok()) << s.status();
    store = std::move(*s);
    auto info = store->RegisterNamespace(Spec(), 0);
    EXPECT_TRUE(info.ok()) << info.status();
    ns = info->id;
  }
  void Put(uint64_t n) {
    std::string b = BlockBytesFor(n, kBlock);
    auto r = store->PutInline(ns, H(n), b, Checksum(b.data(), b.size()));
    ASSERT_TRUE(r.ok()) << r.status();
  }
  // Reads block n inline: the bytes served (empty if none were).
  std::optional<std::string> Get(uint64_t n) {
    std::vector<BlockHash> one = {H(n)};
    std::optional<std::string> out;
    auto s =
        store->GetInline(ns, one, [&](uint32_t, store::TierKind, std::string_view b, uint64_t) {
          out = std::string(b);
          return true;
        });
    EXPECT_TRUE(s.ok()) << s;
    return out;
  }
  bool Listed(uint64_t n) {
    std::vector<BlockHash> one = {H(n)};
    return !store->Lookup(ns, one)->empty();
  }
};

// Mooncake #3884. A block the store lists on NVMe whose record is gone, is
// empty, or is not delivered by the disk engine: a miss, never empty bytes;
// the block is no longer listed; every other block still reads back whole.
TEST(PeerComplaints, MooncakeIssue3884_AMissingDiskCopyIsAMissNeverEmptyBytes) {
  using Fault = store::FaultInjectingBackend::RecordFault;
  testing::TempDir dir;
  FaultyStore f(dir.path());
  for (uint64_t n = 0; n < 96; ++n) f.Put(n);  // three RAMs' worth: most go to NVMe
  f.store->disk().WaitIdle();
  std::vector<uint64_t> on_disk;
  for (const BlockKey& k : f.store->disk().Keys()) {
    std::vector<BlockHash> one = {k.hash};
    if ((*f.store->Lookup(f.ns, one))[0] == store::TierKind::kDisk) on_disk.push_back(k.hash.lo);
  }
  ASSERT_GE(on_disk.size(), 6u);
  size_t next = 0;
  for (Fault fault : {Fault::kMissing, Fault::kEmpty, Fault::kNoValue}) {
    SCOPED_TRACE(static_cast<int>(fault));
    const uint64_t n = on_disk[next++];
    ASSERT_TRUE(f.Listed(n));
    f.faults->set_block_record_fault(fault);
    EXPECT_EQ(f.Get(n), std::nullopt) << "served bytes the disk did not hold";
    // The pinning path (what a data-plane read uses) misses too.
    std::vector<BlockHash> one = {H(n)};
    auto pin = f.store->BeginGet(f.ns, one, "reader");
    ASSERT_TRUE(pin.ok()) << pin.status();
    EXPECT_TRUE(pin->sources.empty());
    f.faults->set_block_record_fault(Fault::kNone);
    EXPECT_FALSE(f.Listed(n)) << "a block with no disk copy is still offered";
  }
  for (size_t i = next; i < on_disk.size(); ++i) {
    auto b = f.Get(on_disk[i]);
    ASSERT_TRUE(b.has_value()) << on_disk[i];
    EXPECT_EQ(*b, BlockBytesFor(on_disk[i], kBlock));
  }
}

// LMCache #4991. Puts that fail -- bytes that never arrived whole, a commit
// after the lease ran out, a client that gave up -- leave nothing a lookup
// or a reader can see, over the wire, and the store keeps serving.
TEST(PeerComplaints, LmcacheIssue4991_AFailedStoreIsNeverVisible) {
  testing::TempDir dir;
  auto proc = testing::StartLoopbackStore(dir.sub("store"), {"--lease-ms=200ms"});
  ASSERT_GT(proc->port(), 0) << proc->Log();
  DataClientOptions o;
  o.deadline_ms = 5000;
  o.shared_memory = DataClientOptions::SharedMemory::kOff;
  StoreDataClient c(proc->address(), o);
  StoreClient& ctl = c.control();
  auto ns = ctl.RegisterNamespace(Spec());
  ASSERT_TRUE(ns.ok()) << ns.status();
  auto begin = [&](uint64_t n) {
    v1::BeginPutRequest req;
    req.set_namespace_id(ns->id);
    ToProto(H(n), req.add_hashes());
    v1::BeginPutResponse resp;
    EXPECT_TRUE(ctl.stub().BeginPut(ctl.Context().get(), req, &resp).ok());
    EXPECT_EQ(resp.targets(0).disposition(), v1::PUT_RESERVED);
    return resp.lease_id();
  };
  auto commit = [&](uint64_t lease, uint64_t n) {
    std::string b = BlockBytesFor(n, kBlock);
    v1::CommitPutRequest req;
    req.set_lease_id(lease);
    req.add_checksums(Checksum(b.data(), b.size()));  // what the client meant to send
    v1::CommitPutResponse resp;
    return ctl.stub().CommitPut(ctl.Context().get(), req, &resp);
  };
  auto visible = [&](uint64_t n) {
    auto l = ctl.Lookup(ns->id, std::vector<BlockHash>{H(n)});
    EXPECT_TRUE(l.ok()) << l.status();
    return l.ok() ? l->size() : size_t{0};
  };
  auto read = [&](uint64_t n) {
    std::vector<uint8_t> dst(kBlock);
    std::vector<GetBlock> get = {{H(n), dst.data()}};
    auto r = c.Get(ns->id, kBlock, get).get();
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->blocks : 0u;
  };
  // 1. The bytes never arrived (the transfer failed): the commit carries the
  //    checksum of the intended bytes, the slot holds something else.
  grpc::Status torn = commit(begin(1), 1);
  EXPECT_EQ(torn.error_code(), grpc::DATA_LOSS) << torn.error_message();
  EXPECT_EQ(visible(1), 0u);
  EXPECT_EQ(read(1), 0u);
  // 2. The commit comes after the lease ran out.
  const uint64_t late = begin(2);
  ASSERT_TRUE(WaitFor(
      [&] {
        auto st = ctl.GetStats();
        return st.ok() && st->put_leases() == 0;
      },
      10s));
  grpc::Status expired = commit(late, 2);
  EXPECT_EQ(expired.error_code(), grpc::FAILED_PRECONDITION) << expired.error_message();
  EXPECT_EQ(visible(2), 0u);
  EXPECT_EQ(read(2), 0u);
  // 3. The client gives up before committing (never commits nor aborts).
  begin(3);
  EXPECT_EQ(visible(3), 0u);
  EXPECT_EQ(read(3), 0u);
  // The store keeps serving: a whole put is visible and reads back.
  std::string b = BlockBytesFor(4, kBlock);
  std::vector<PutBlock> put = {{H(4), b.data()}};
  auto ok = c.Put(ns->id, kBlock, put).get();
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(visible(4), 1u);
  std::vector<uint8_t> dst(kBlock);
  std::vector<GetBlock> get = {{H(4), dst.data()}};
  auto r = c.Get(ns->id, kBlock, get).get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->blocks, 1u);
  EXPECT_EQ(0, std::memcmp(dst.data(), b.data(), kBlock));
}

}  // namespace
}  // namespace kvtier
