// Faults with real processes: kill -9 the store during put and get bursts
// (with demotions under way), restart it on the same data dir and ports, and
// check that every block it then serves is byte-exact, the NVMe tier came
// back, and the client recovered by itself.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>
#include <filesystem>
#include <random>

#include "common/store_client.h"
#include "common/store_data_client.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::ServerProcess;
using testing::WaitFor;

NamespaceSpec Spec() { return NamespaceSpec{"fault-model", "fp16", 1, 1, 64, 512, 0, 1, ""}; }
constexpr uint64_t kBlock = 128 << 10;  // 2 x 64 x 2 x 512
BlockHash H(uint64_t i) { return BlockHash{0xFA17 + i, i}; }

TEST(Faults, KillNineDuringPutsGetsAndDemotionLosesNothingCommittedToDisk) {
  setenv("UCX_TLS", "tcp", 1);
  testing::TempDir dir;
  const int port = testing::FreePort(), ucx = testing::FreePort();
  std::vector<std::string> args = {"--listen=127.0.0.1:" + std::to_string(port),
                                   "--ucx-listen=127.0.0.1:" + std::to_string(ucx),
                                   "--data-dir=" + dir.sub("db"), "--hugepages=false",
                                   "--ram-bytes=8MiB", "--ram-slab-bytes=1MiB", "--lease-ms=1s"};
  ServerProcess store(KVTIER_STORE_BIN, dir.sub("store"), args);
  ASSERT_GT(store.port(), 0) << store.Log();
  DataClientOptions o;
  o.deadline_ms = 2000;
  o.backoff_min_ms = 20;
  o.backoff_max_ms = 300;
  o.shared_memory = DataClientOptions::SharedMemory::kOff;
  StoreDataClient c(store.address(), o);
  auto ns = c.control().RegisterNamespace(Spec());
  ASSERT_TRUE(ns.ok()) << ns.status();
  ASSERT_EQ(ns->block_bytes, kBlock);

  std::atomic<bool> stop{false};
  std::atomic<uint64_t> next{0}, put_ok{0}, put_err{0}, get_ok{0}, get_err{0}, mismatches{0};
  std::mutex mu;
  std::set<uint64_t> committed;
  std::thread writer([&] {
    std::vector<uint8_t> buf(8 * kBlock);
    while (!stop) {
      uint64_t first = next.fetch_add(8);
      std::vector<PutBlock> blocks;
      for (uint64_t i = 0; i < 8; ++i) {
        std::string b = testing::BlockBytesFor(first + i, kBlock);
        std::memcpy(buf.data() + i * kBlock, b.data(), kBlock);
        blocks.push_back({H(first + i), buf.data() + i * kBlock});
      }
      auto r = c.Put(ns->id, kBlock, blocks).get();
      if (r.ok() && r->written == 8) {
        put_ok++;
        std::lock_guard lk(mu);
        for (uint64_t i = 0; i < 8; ++i) committed.insert(first + i);
      } else {
        put_err++;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  });
  std::thread reader([&] {
    std::vector<uint8_t> buf(kBlock);
    std::mt19937_64 rng(1);
    while (!stop) {
      uint64_t k;
      {
        std::lock_guard lk(mu);
        if (committed.empty()) continue;
        auto it = committed.begin();
        std::advance(it, rng() % committed.size());
        k = *it;
      }
      auto g = c.Get(ns->id, kBlock, {{H(k), buf.data()}}).get();
      if (!g.ok()) {
        get_err++;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        continue;
      }
      get_ok++;
      if (g->blocks == 1 && std::memcmp(buf.data(), testing::BlockBytesFor(k, kBlock).data(), kBlock) != 0) {
        mismatches++;
      }
    }
  });
  // Let bursts run (8 MiB RAM: most blocks are being demoted), then kill -9.
  ASSERT_TRUE(WaitFor([&] { return put_ok >= 40 && get_ok >= 20; }, std::chrono::seconds(30)));
  store.proc().Kill(SIGKILL);
  const uint64_t before = put_ok;
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  store.Start();
  ASSERT_EQ(store.port(), port) << store.Log();
  // The client recovers by itself: new puts succeed again.
  ASSERT_TRUE(WaitFor([&] { return put_ok > before + 10; }, std::chrono::seconds(30)))
      << "client did not recover; put errors " << put_err;
  stop = true;
  writer.join();
  reader.join();
  EXPECT_EQ(mismatches.load(), 0u);
  EXPECT_GT(put_err.load() + get_err.load(), 0u) << "the kill was not seen by the clients";
  // Every block the restarted store serves is byte-exact, and blocks that
  // were demoted before the kill are back from NVMe.
  StoreClient control(store.address());
  auto st = control.GetStats();
  ASSERT_TRUE(st.ok());
  EXPECT_GT(st->tiers(1).items(), 0u) << "the NVMe tier did not come back";
  uint64_t served = 0, from_disk = 0;
  std::vector<BlockHash> all;
  for (uint64_t i = 0; i < next; ++i) all.push_back(H(i));
  for (size_t off = 0; off < all.size(); off += 64) {
    for (size_t i = off; i < std::min(all.size(), off + 64); ++i) {
      auto got = control.GetInline(ns->id, {all[i]});
      ASSERT_TRUE(got.ok()) << got.status();
      for (const auto& b : *got) {
        ++served;
        from_disk += b.tier == v1::TIER_DISK;
        ASSERT_EQ(b.data, testing::BlockBytesFor(i, kBlock)) << "block " << i;
      }
    }
  }
  EXPECT_GT(served, 0u);
  EXPECT_GT(from_disk, 0u);
  EXPECT_EQ(control.GetStats()->checksum_failures(), 0u);
}

}  // namespace
}  // namespace kvtier
