// Faults with real processes: kill -9 the store during put and get bursts
// (with demotions under way), restart it on the same data dir and ports, and
// check that every block it then serves is byte-exact, the NVMe tier came
// back, and the client recovered by itself.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/store_client.h"
#include "client/store_data_client.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::ServerProcess;
using testing::WaitFor;

NamespaceSpec Spec() {
  return NamespaceSpec{"fault-model", "fp16", 1, 1, 64, 512, 0, 1, "", "", ""};
}
constexpr uint64_t kBlock = 128 << 10;  // 2 x 64 x 2 x 512
BlockHash H(uint64_t i) { return BlockHash{0xFA17 + i, i}; }

TEST(Faults, KillNineDuringPutsGetsAndDemotionLosesNothingCommittedToDisk) {
  setenv("UCX_TLS", "tcp", 1);
  testing::TempDir dir;
  const int port = testing::FreePort(), ucx = testing::FreePort();
  std::vector<std::string> args = {"--listen=127.0.0.1:" + std::to_string(port),
                                   "--data-listen=127.0.0.1:" + std::to_string(ucx),
                                   "--data-dir=" + dir.sub("db"),
                                   "--hugepages=false",
                                   "--ram-bytes=8MiB",
                                   "--ram-slab-bytes=1MiB",
                                   "--lease-ms=1s"};
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
      if (g->blocks == 1 &&
          std::memcmp(buf.data(), testing::BlockBytesFor(k, kBlock).data(), kBlock) != 0) {
        mismatches++;
      }
    }
  });
  // Let bursts run (8 MiB RAM: most blocks are being demoted), then kill -9.
  ASSERT_TRUE(WaitFor([&] { return put_ok >= 40 && get_ok >= 20; }, std::chrono::seconds(30)));
  const uint64_t errors_before = put_err + get_err;
  store.proc().Kill(SIGKILL);
  const uint64_t before = put_ok;
  // The clients see the store gone before it comes back.
  ASSERT_TRUE(WaitFor([&] { return put_err + get_err > errors_before; }))
      << "the kill was not seen by the clients";
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
  std::printf(
      "kill -9: %lu puts and %lu gets of 8 and 1 blocks ok, %lu and %lu failed (the outage); "
      "after the restart %lu blocks served byte-exact, %lu of them from NVMe, 0 mismatched\n",
      static_cast<unsigned long>(put_ok.load()), static_cast<unsigned long>(get_ok.load()),
      static_cast<unsigned long>(put_err.load()), static_cast<unsigned long>(get_err.load()),
      static_cast<unsigned long>(served), static_cast<unsigned long>(from_disk));
  EXPECT_EQ(control.GetStats()->checksum_failures(), 0u);
}

namespace disk_full {

// A small tmpfs mounted for the test (needs CAP_SYS_ADMIN; skipped with a
// message where mounting is not allowed).
class SmallFilesystem {
 public:
  SmallFilesystem(const std::string& path, const std::string& size) : path_(path) {
    std::filesystem::create_directories(path);
    mounted_ =
        RunShell("mount -t tmpfs -o size=" + size + " kvtier-test " + path + " 2>&1").exit_code ==
        0;
  }
  ~SmallFilesystem() {
    if (mounted_) RunShell("umount -l " + path_ + " 2>&1");
  }
  bool mounted() const { return mounted_; }

 private:
  std::string path_;
  bool mounted_ = false;
};

// Fills the filesystem of path up with a file, to the last byte.
void Fill(const std::string& path) {
  RunShell("dd if=/dev/zero of=" + path + " bs=1M 2>/dev/null; sync");
}

std::vector<std::pair<BlockHash, std::string>> Blocks(uint64_t first, uint64_t n) {
  std::vector<std::pair<BlockHash, std::string>> out;
  for (uint64_t i = first; i < first + n; ++i)
    out.push_back({H(i), testing::BlockBytesFor(i, kBlock)});
  return out;
}

absl::Status Put(StoreClient& c, uint64_t ns,
                 const std::vector<std::pair<BlockHash, std::string>>& blocks) {
  std::vector<std::pair<BlockHash, std::string_view>> views;
  for (const auto& [h, b] : blocks) views.push_back({h, b});
  auto r = c.PutInline(ns, views);
  if (!r.ok()) return r.status();
  if (r->stored + r->already_present != blocks.size()) {
    return absl::InternalError(absl::StrCat("stored ", r->stored, " of ", blocks.size()));
  }
  return absl::OkStatus();
}

// Where block i is (TIER_UNSPECIFIED if absent).
v1::Tier TierOf(StoreClient& c, uint64_t ns, uint64_t i) {
  auto t = c.Lookup(ns, {H(i)});
  return t.ok() && !t->empty() ? (*t)[0] : v1::TIER_UNSPECIFIED;
}

// Block i served byte-exact.
bool Served(StoreClient& c, uint64_t ns, uint64_t i) {
  auto got = c.GetInline(ns, {H(i)});
  return got.ok() && got->size() == 1 && (*got)[0].data == testing::BlockBytesFor(i, kBlock);
}

v1::TierStats Disk(StoreClient& c) {
  auto s = c.GetStats();
  return s.ok() && s->tiers_size() == 2 ? s->tiers(1) : v1::TierStats{};
}

bool DrainedToDisk(StoreClient& c) {
  auto s = c.GetStats();
  return s.ok() && s->demotion_queue_blocks() == 0;
}

}  // namespace disk_full

// A client whose store restarts is back as soon as the store listens again:
// its calls fail fast meanwhile, and with no call in flight gRPC alone would
// look at the lost channel only every 5 s (PrepareGrpcProcess).
TEST(Faults, AClientIsBackWithinASecondOfItsStoreListeningAgain) {
  testing::TempDir dir;
  const int port = testing::FreePort();
  ServerProcess store(KVTIER_STORE_BIN, dir.sub("store"),
                      {"--listen=127.0.0.1:" + std::to_string(port), "--data-dir=" + dir.sub("db"),
                       "--hugepages=false", "--ram-bytes=8MiB"});
  ASSERT_GT(store.port(), 0) << store.Log();
  StoreClientOptions o;
  o.deadline_ms = 500;
  StoreClient client(store.address(), o);
  ASSERT_TRUE(client.GetStats().ok());
  for (int round = 0; round < 3; ++round) {
    store.proc().Kill(SIGKILL);
    // Calls while it is down fail, as a connector's lookups would.
    auto down = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - down < std::chrono::milliseconds(300)) {
      EXPECT_FALSE(client.GetStats().ok());
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    store.Start();
    ASSERT_EQ(store.port(), port) << store.Log();
    auto up = std::chrono::steady_clock::now();
    while (!client.GetStats().ok()) {
      ASSERT_LT(std::chrono::steady_clock::now() - up, std::chrono::seconds(10));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_LT(std::chrono::steady_clock::now() - up, std::chrono::milliseconds(1000))
        << "round " << round;
  }
}

TEST(Faults, DiskFullPausesTheNvmeTierKeepsServingAndRecoversWhenSpaceReturns) {
  using namespace disk_full;
  testing::TempDir dir;
  SmallFilesystem fs(dir.sub("fs"), "48m");
  if (!fs.mounted()) GTEST_SKIP() << "cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)";
  const int port = testing::FreePort();
  std::vector<std::string> args = {"--listen=127.0.0.1:" + std::to_string(port),
                                   "--data-dir=" + dir.sub("fs") + "/db",
                                   "--hugepages=false",
                                   "--ram-bytes=4MiB",
                                   "--ram-slab-bytes=1MiB",
                                   "--disk-bytes=24MiB",
                                   "--disk-reserve-bytes=8MiB"};
  ServerProcess store(KVTIER_STORE_BIN, dir.sub("store"), args);
  ASSERT_GT(store.port(), 0) << store.Log();
  StoreClientOptions co;
  co.deadline_ms = 5000;
  StoreClient c(store.address(), co);
  auto ns = c.RegisterNamespace(Spec());
  ASSERT_TRUE(ns.ok()) << ns.status();

  // 1. 64 blocks (8 MiB) through a 4 MiB RAM tier: about half go to NVMe.
  for (uint64_t i = 0; i < 64; i += 8) ASSERT_TRUE(Put(c, ns->id, Blocks(i, 8)).ok());
  ASSERT_TRUE(WaitFor([&] { return DrainedToDisk(c); }, std::chrono::seconds(10)));
  std::set<uint64_t> on_disk;
  for (uint64_t i = 0; i < 64; ++i) {
    if (TierOf(c, ns->id, i) == v1::TIER_DISK) on_disk.insert(i);
  }
  ASSERT_GE(on_disk.size(), 16u);
  EXPECT_FALSE(Disk(c).degraded());

  // 2. Something else fills the filesystem. The store goes on taking puts
  // into RAM; demotions stop short of the reserve; the tier says why.
  Fill(dir.sub("fs") + "/filler");
  for (uint64_t i = 64; i < 128; i += 8) {
    absl::Status s = Put(c, ns->id, Blocks(i, 8));
    EXPECT_TRUE(s.ok()) << s;
  }
  EXPECT_TRUE(WaitFor([&] { return Disk(c).degraded(); }, std::chrono::seconds(10)));
  v1::TierStats d = Disk(c);
  EXPECT_NE(d.degraded_reason().find("disk full"), std::string::npos) << d.degraded_reason();
  EXPECT_NE(d.degraded_reason().find("--disk-reserve-bytes"), std::string::npos);
  EXPECT_TRUE(
      WaitFor([&] { return !c.Health("kvtier.v1.Store/disk").ok(); }, std::chrono::seconds(5)));
  EXPECT_TRUE(c.Health().ok());
  int wstatus = 0;
  EXPECT_EQ(waitpid(store.proc().pid(), &wstatus, WNOHANG), 0) << "the store died\n" << store.Log();
  // The newest blocks from RAM, then the older ones from NVMe (reads need no
  // space; their promotions push RAM blocks out, which are then dropped).
  for (uint64_t i = 120; i < 128; ++i) EXPECT_TRUE(Served(c, ns->id, i)) << "RAM block " << i;
  for (uint64_t i : on_disk) EXPECT_TRUE(Served(c, ns->id, i)) << "NVMe block " << i;
  std::set<uint64_t> on_disk_while_full;
  for (uint64_t i = 0; i < 128; ++i) {
    if (TierOf(c, ns->id, i) == v1::TIER_DISK) on_disk_while_full.insert(i);
  }

  // 3. Space returns: the tier recovers by itself and takes demotions again.
  std::filesystem::remove(dir.sub("fs") + "/filler");
  EXPECT_TRUE(WaitFor([&] { return !Disk(c).degraded(); }, std::chrono::seconds(10)))
      << Disk(c).degraded_reason();
  EXPECT_TRUE(
      WaitFor([&] { return c.Health("kvtier.v1.Store/disk").ok(); }, std::chrono::seconds(5)));
  const uint64_t items_before = Disk(c).items();
  for (uint64_t i = 128; i < 192; i += 8) ASSERT_TRUE(Put(c, ns->id, Blocks(i, 8)).ok());
  ASSERT_TRUE(WaitFor([&] { return DrainedToDisk(c); }, std::chrono::seconds(10)));
  EXPECT_GT(Disk(c).items() + Disk(c).evictions(), items_before);
  std::set<uint64_t> committed;
  for (uint64_t i = 0; i < 192; ++i) {
    if (TierOf(c, ns->id, i) == v1::TIER_DISK) committed.insert(i);
  }
  EXPECT_GT(committed.size(), on_disk_while_full.size() / 2);

  // 4. kill -9 and restart: every block the NVMe tier held comes back byte-exact.
  store.proc().Kill(SIGKILL);
  store.Start();
  ASSERT_GT(store.port(), 0) << store.Log();
  StoreClient after(store.address(), co);
  ASSERT_TRUE(WaitFor([&] { return after.Health().ok(); }, std::chrono::seconds(10)));
  uint64_t lost = 0, mismatched = 0;
  for (uint64_t i : committed) {
    if (TierOf(after, ns->id, i) != v1::TIER_DISK) {
      ++lost;
    } else if (!Served(after, ns->id, i)) {
      ++mismatched;
    }
  }
  EXPECT_EQ(lost, 0u) << "of " << committed.size() << " NVMe blocks";
  EXPECT_EQ(mismatched, 0u);
  EXPECT_FALSE(Disk(after).degraded());
}

TEST(Faults, ARocksDbWriteErrorStopsNvmeWritesKeepsServingAndARestartRecoversEverything) {
  using namespace disk_full;
  testing::TempDir dir;
  const int port = testing::FreePort();
  // A 3 MiB file-size limit (RLIMIT_FSIZE, via prlimit): RocksDB's WAL append
  // fails with EFBIG, an I/O error that is not a full disk.
  std::vector<std::string> store_args = {"--listen=127.0.0.1:" + std::to_string(port),
                                         "--data-dir=" + dir.sub("db"),
                                         "--hugepages=false",
                                         "--ram-bytes=2MiB",
                                         "--ram-slab-bytes=1MiB",
                                         "--ram-policy=lru"};  // newest blocks stay in RAM
  std::vector<std::string> limited = {"--fsize=" + std::to_string(3 << 20), KVTIER_STORE_BIN};
  limited.insert(limited.end(), store_args.begin(), store_args.end());
  auto store = std::make_unique<ServerProcess>("/usr/bin/prlimit", dir.sub("store"), limited);
  ASSERT_GT(store->port(), 0) << store->Log();
  StoreClientOptions co;
  co.deadline_ms = 5000;
  StoreClient c(store->address(), co);
  auto ns = c.RegisterNamespace(Spec());
  ASSERT_TRUE(ns.ok()) << ns.status();

  // 64 blocks (8 MiB) through a 2 MiB RAM tier: demotions fill the WAL to the limit.
  for (uint64_t i = 0; i < 64; i += 8) {
    absl::Status s = Put(c, ns->id, Blocks(i, 8));
    ASSERT_TRUE(s.ok()) << s;
  }
  ASSERT_TRUE(WaitFor([&] { return Disk(c).degraded(); }, std::chrono::seconds(10)))
      << store->Log();
  v1::TierStats d = Disk(c);
  EXPECT_NE(d.degraded_reason().find("RocksDB write error"), std::string::npos)
      << d.degraded_reason();
  EXPECT_NE(d.degraded_reason().find("restart"), std::string::npos) << d.degraded_reason();
  EXPECT_TRUE(
      WaitFor([&] { return !c.Health("kvtier.v1.Store/disk").ok(); }, std::chrono::seconds(5)));
  EXPECT_TRUE(c.Health().ok());
  // It keeps serving: new puts land in RAM, RAM and NVMe blocks read back byte-exact.
  for (uint64_t i = 64; i < 80; i += 8) EXPECT_TRUE(Put(c, ns->id, Blocks(i, 8)).ok());
  for (uint64_t i = 72; i < 80; ++i) EXPECT_TRUE(Served(c, ns->id, i)) << "RAM block " << i;
  std::set<uint64_t> on_disk;
  for (uint64_t i = 0; i < 80; ++i) {
    if (TierOf(c, ns->id, i) == v1::TIER_DISK) on_disk.insert(i);
  }
  EXPECT_GE(on_disk.size(), 8u);
  for (uint64_t i : on_disk) EXPECT_TRUE(Served(c, ns->id, i)) << "NVMe block " << i;
  std::printf("write error: %zu blocks on NVMe; reason: %s\n", on_disk.size(),
              d.degraded_reason().c_str());

  // A clean stop does not trip over the failed WAL writer.
  int status = store->proc().Kill(SIGTERM);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status << "\n"
                                                             << store->Log();

  // Restarted without the limit: every block that was on NVMe is back byte-exact.
  store = std::make_unique<ServerProcess>(KVTIER_STORE_BIN, dir.sub("store2"), store_args);
  ASSERT_GT(store->port(), 0) << store->Log();
  StoreClient after(store->address(), co);
  EXPECT_FALSE(Disk(after).degraded());
  uint64_t lost = 0, mismatched = 0;
  for (uint64_t i : on_disk) {
    if (TierOf(after, ns->id, i) != v1::TIER_DISK) {
      ++lost;
    } else if (!Served(after, ns->id, i)) {
      ++mismatched;
    }
  }
  EXPECT_EQ(lost, 0u) << "of " << on_disk.size();
  EXPECT_EQ(mismatched, 0u);
  // And it writes to NVMe again.
  for (uint64_t i = 100; i < 132; i += 8) ASSERT_TRUE(Put(after, ns->id, Blocks(i, 8)).ok());
  EXPECT_TRUE(WaitFor([&] { return DrainedToDisk(after); }, std::chrono::seconds(10)));
  EXPECT_FALSE(Disk(after).degraded()) << Disk(after).degraded_reason();
}

}  // namespace
}  // namespace kvtier
