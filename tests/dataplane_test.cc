// The data plane end to end: the real kvtier-store with --data-listen and
// StoreDataClient over UCX on loopback (TCP and shared memory).
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "client/socket_channel.h"
#include "client/store_data_client.h"
#include "common/checksum.h"
#include "common/socket_io.h"
#include "common/ucx/ucx.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::ServerProcess;
using testing::WaitFor;

// 2 x 1 layer x 1 head x 128 dim x 2 bytes x 512 tokens = 256 KiB.
NamespaceSpec Spec256K() {
  return NamespaceSpec{"dp-model", "bf16", 1, 1, 128, 512, 0, 1, "", "", ""};
}
constexpr uint64_t kBlock = 256 << 10;
BlockHash H(uint64_t i) { return BlockHash{0xD00D + i, i}; }

void Fill(std::vector<uint8_t>& buf, uint64_t first, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) {
    std::string b = testing::BlockBytesFor(first + i, kBlock);
    std::memcpy(buf.data() + i * kBlock, b.data(), kBlock);
  }
}

class DataPlane : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    // Client and store (which inherits the environment) use the same
    // transports. The store's sockaddr listener needs a network transport.
    setenv("UCX_TLS", std::string(GetParam()) == "sm" ? "sm,tcp" : GetParam(), 1);
  }
  std::unique_ptr<ServerProcess> StartStore(std::vector<std::string> extra = {}, int port = 0,
                                            int ucx_port = 0) {
    std::vector<std::string> args = {"--listen=127.0.0.1:" + std::to_string(port),
                                     "--data-listen=127.0.0.1:" + std::to_string(ucx_port),
                                     "--data-dir=" + dir_.sub("db"), "--hugepages=false"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto s = std::make_unique<ServerProcess>(KVTIER_STORE_BIN, dir_.sub("store"), args);
    EXPECT_GT(s->port(), 0) << "store did not start; see " << dir_.sub("store.log");
    return s;
  }
  testing::TempDir dir_;
};

DataClientOptions ClientOptions() {
  DataClientOptions o;
  // The stores here are on 127.0.0.1: kAuto would pick shared memory; the
  // TCP case turns it off so the TCP transport is what is tested.
  bool sm = std::string(::testing::UnitTest::GetInstance()->current_test_info()->value_param()) ==
            "\"sm\"";
  o.shared_memory =
      sm ? DataClientOptions::SharedMemory::kOn : DataClientOptions::SharedMemory::kOff;
  return o;
}

TEST_P(DataPlane, RoundTripIsByteExactWithManyBlocksInFlight) {
  auto store = StartStore({"--ram-bytes=64MiB"});
  StoreDataClient c(store->address(), ClientOptions());
  auto ns = c.control().RegisterNamespace(Spec256K());
  ASSERT_TRUE(ns.ok()) << ns.status();
  ASSERT_EQ(ns->block_bytes, kBlock);
  const uint64_t n = 96;
  std::vector<uint8_t> src(n * kBlock), dst(n * kBlock, 0);
  Fill(src, 0, n);
  ASSERT_TRUE(c.RegisterMemory(src.data(), src.size()).ok());
  // Several operations in flight at once, 32 blocks each.
  std::vector<std::future<absl::StatusOr<PutOutcome>>> puts;
  for (uint64_t op = 0; op < 3; ++op) {
    std::vector<PutBlock> blocks;
    for (uint64_t i = op * 32; i < op * 32 + 32; ++i)
      blocks.push_back({H(i), src.data() + i * kBlock});
    puts.push_back(c.Put(ns->id, kBlock, std::move(blocks)));
  }
  for (auto& f : puts) {
    auto r = f.get();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->written, 32u);
  }
  // Already present: nothing is sent again.
  std::vector<PutBlock> again;
  for (uint64_t i = 0; i < n; ++i) again.push_back({H(i), src.data() + i * kBlock});
  auto r = c.Put(ns->id, kBlock, again).get();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->already_present, n);
  EXPECT_EQ(r->written, 0u);
  // Read back into unregistered memory, a chain with a hole at the end.
  std::vector<GetBlock> want;
  for (uint64_t i = 0; i < n; ++i) want.push_back({H(i), dst.data() + i * kBlock});
  std::vector<uint8_t> spare(kBlock);
  want.push_back({H(9999), spare.data()});
  auto g = c.Get(ns->id, kBlock, want).get();
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->blocks, n);
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), src.size()));
  auto stats = c.control().GetStats();
  EXPECT_EQ(stats->tiers(0).items(), n);
  EXPECT_EQ(stats->put_leases(), 0u);
  // Get leases are released asynchronously (release_delay_ms, then one
  // batched ReleaseGets): gone soon, without waiting for their expiry.
  for (int i = 0; i < 200 && stats->get_leases() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    stats = c.control().GetStats();
  }
  EXPECT_EQ(stats->get_leases(), 0u);
}

TEST_P(DataPlane, BlocksDemotedToNvmeComeBackByRma) {
  auto store = StartStore({"--ram-bytes=4MiB", "--ram-slab-bytes=1MiB", "--ram-policy=lru"});
  StoreDataClient c(store->address(), ClientOptions());
  auto ns = c.control().RegisterNamespace(Spec256K());
  const uint64_t n = 48;  // 12 MiB through a 4 MiB RAM tier
  std::vector<uint8_t> src(n * kBlock), dst(n * kBlock, 0);
  Fill(src, 100, n);
  for (uint64_t i = 0; i < n; i += 8) {
    std::vector<PutBlock> blocks;
    for (uint64_t j = i; j < i + 8; ++j) blocks.push_back({H(j), src.data() + j * kBlock});
    auto r = c.Put(ns->id, kBlock, blocks).get();
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->written, 8u);
  }
  ASSERT_TRUE(WaitFor([&] { return c.control().GetStats()->demotion_queue_blocks() == 0; }));
  uint32_t from_disk = 0;
  for (uint64_t i = 0; i < n; i += 8) {
    std::vector<GetBlock> blocks;
    for (uint64_t j = i; j < i + 8; ++j) blocks.push_back({H(j), dst.data() + j * kBlock});
    auto g = c.Get(ns->id, kBlock, blocks).get();
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_EQ(g->blocks, 8u);
    from_disk += g->from_disk;
  }
  EXPECT_GE(from_disk, 32u);
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), src.size()));
}

// "sm": shared memory only (the worker-address connection reaches it);
// "tcp": the sockaddr listener and TCP.
INSTANTIATE_TEST_SUITE_P(Transports, DataPlane, ::testing::Values("tcp", "sm"),
                         [](const auto& info) {
                           return std::string(info.param) == "tcp" ? "Tcp" : "SharedMemory";
                         });

class DataPlaneFaults : public ::testing::Test {
 protected:
  void SetUp() override { setenv("UCX_TLS", "tcp", 1); }
  testing::TempDir dir_;
};

TEST_F(DataPlaneFaults, AClientKilledMidPutLeavesNothingVisibleAndItsSlotsComeBack) {
  ServerProcess store(
      KVTIER_STORE_BIN, dir_.sub("store"),
      {"--listen=127.0.0.1:0", "--data-listen=127.0.0.1:0", "--data-dir=" + dir_.sub("db"),
       "--hugepages=false", "--ram-bytes=16MiB", "--lease-ms=300ms"});
  ASSERT_GT(store.port(), 0);
  // The writer is a child process that reserves 8 slots, writes half of
  // them, and dies by SIGKILL before committing.
  pid_t child = fork();
  if (child == 0) {
    StoreClient control(store.address());
    auto ns = control.RegisterNamespace(Spec256K());
    if (!ns.ok()) _exit(2);
    v1::ConnectDataPlaneResponse info;
    {
      auto ctx = control.Context();
      if (!control.stub().ConnectDataPlane(ctx.get(), {}, &info).ok()) _exit(3);
    }
    v1::BeginPutRequest req;
    req.set_namespace_id(ns->id);
    for (uint64_t i = 0; i < 8; ++i) ToProto(H(i), req.add_hashes());
    v1::BeginPutResponse resp;
    {
      auto ctx = control.Context();
      if (!control.stub().BeginPut(ctx.get(), req, &resp).ok()) _exit(4);
    }
    std::string addr = info.data_address();
    auto ch = SocketChannel::Connect("127.0.0.1", std::stoi(addr.substr(addr.rfind(':') + 1)),
                                     info.session(),
                                     SocketChannel::Clock::now() + std::chrono::seconds(5));
    if (!ch.ok()) _exit(5);
    std::vector<uint8_t> junk(kBlock, 0xAB);
    uint64_t last = 0;
    for (int i = 0; i < 4; ++i) {
      last = (*ch)->PostPut(junk.data(), kBlock, resp.targets(i).remote_addr(), resp.lease_id());
    }
    if (!(*ch)->Wait(last, SocketChannel::Clock::now() + std::chrono::seconds(5)).ok()) _exit(6);
    raise(SIGKILL);
  }
  int st;
  waitpid(child, &st, 0);
  ASSERT_TRUE(WIFSIGNALED(st)) << "writer exited with " << WEXITSTATUS(st);
  StoreDataClient c(store.address());
  auto ns = c.control().RegisterNamespace(Spec256K());
  std::vector<BlockHash> chain;
  for (uint64_t i = 0; i < 8; ++i) chain.push_back(H(i));
  EXPECT_EQ(c.control().Lookup(ns->id, chain)->size(), 0u);  // nothing half-written is visible
  auto stats = c.control().GetStats();
  EXPECT_EQ(stats->put_leases(), 1u);
  EXPECT_EQ(stats->tiers(0).used_bytes(), 8 * kBlock);
  // After the lease and its grace period, the slots are free again.
  ASSERT_TRUE(WaitFor([&] { return c.control().GetStats()->tiers(0).used_bytes() == 0; },
                      std::chrono::seconds(5)));
  stats = c.control().GetStats();
  EXPECT_EQ(stats->put_leases(), 0u);
  EXPECT_EQ(stats->leases_expired(), 1u);
  // And the same blocks can be written for real.
  std::vector<uint8_t> src(8 * kBlock);
  Fill(src, 0, 8);
  std::vector<PutBlock> blocks;
  for (uint64_t i = 0; i < 8; ++i) blocks.push_back({H(i), src.data() + i * kBlock});
  auto r = c.Put(ns->id, kBlock, blocks).get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->written, 8u);
}

// A writer whose budget ran out while the store was stopped gives its
// BeginPut up; gRPC's deadline cannot (it is relative, counted from when the
// resumed store reads the call), so without the abandon token the store
// would reserve the blocks for nobody and every other writer would find
// them busy for a whole lease period. Both ways a put reserves: Reserve
// (gRPC, for writes into the mapped arena) and Put (the data plane's call).
TEST_F(DataPlaneFaults, AWriterThatGaveUpOnAStalledStoreLeavesNoBlockBusy) {
  setenv("UCX_TLS", "sm,tcp", 1);
  ServerProcess store(KVTIER_STORE_BIN, dir_.sub("store"),
                      {"--listen=127.0.0.1:0", "--data-listen=127.0.0.1:0",
                       "--data-dir=" + dir_.sub("db"), "--hugepages=false", "--lease-ms=30s"});
  ASSERT_GT(store.port(), 0) << store.Log();
  DataClientOptions o;
  o.shared_memory = DataClientOptions::SharedMemory::kOn;
  o.deadline_ms = 300;
  StoreDataClient writer(store.address(), o);
  auto ns = writer.control().RegisterNamespace(Spec256K());
  ASSERT_TRUE(ns.ok()) << ns.status();
  std::vector<uint8_t> src(16 * kBlock);
  Fill(src, 0, 16);
  std::vector<PutBlock> warm = {{H(99), src.data()}};
  ASSERT_TRUE(writer.Put(ns->id, kBlock, warm).get().ok());  // connected, the arena mapped

  std::vector<BlockHash> reserved, put_hashes;
  std::vector<PutBlock> all, put;
  for (uint64_t i = 0; i < 16; ++i) {
    all.push_back({H(i), src.data() + i * kBlock});
    (i < 8 ? reserved : put_hashes).push_back(H(i));
    if (i >= 8) put.push_back(all.back());
  }
  ASSERT_TRUE(store.proc().Stop());
  auto r = writer.Reserve(ns->id, kBlock, reserved, std::chrono::milliseconds(50));
  EXPECT_FALSE(r.ok()) << "a stopped store reserved";
  auto p = writer.Put(ns->id, kBlock, put).get();
  EXPECT_FALSE(p.ok()) << "a stopped store took a put";
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the abandons are sent
  kill(store.proc().pid(), SIGCONT);

  // Another writer writes all 16 soon after, not a 30 s lease period later.
  StoreDataClient other(store.address());
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + std::chrono::seconds(10);
  uint32_t busy = 0, stored = 0;
  do {
    auto got = other.Put(ns->id, kBlock, all).get();
    ASSERT_TRUE(got.ok()) << got.status();
    busy = got->busy;
    stored += got->written;
    if (busy > 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  } while (busy > 0 && std::chrono::steady_clock::now() < until);
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now() - start)
                        .count();
  std::printf("all 16 blocks written %lld ms after the store resumed\n",
              static_cast<long long>(took));
  EXPECT_EQ(busy, 0u) << "blocks stayed reserved for a writer that gave up";
  EXPECT_EQ(stored, 16u);
  std::vector<BlockHash> chain;
  for (const auto& b : all) chain.push_back(b.hash);
  EXPECT_EQ(other.control().Lookup(ns->id, chain)->size(), 16u);
  EXPECT_EQ(other.control().GetStats()->put_leases(), 0u) << "a reservation was left open";
}

TEST_F(DataPlaneFaults, AStoreKilledMidGetFailsTheClientCleanlyAndItReconnects) {
  int port = testing::FreePort(), ucx_port = testing::FreePort();
  std::vector<std::string> args = {"--listen=127.0.0.1:" + std::to_string(port),
                                   "--data-listen=127.0.0.1:" + std::to_string(ucx_port),
                                   "--data-dir=" + dir_.sub("db"), "--hugepages=false",
                                   "--ram-bytes=64MiB"};
  ServerProcess store(KVTIER_STORE_BIN, dir_.sub("store"), args);
  ASSERT_GT(store.port(), 0);
  DataClientOptions o;
  o.deadline_ms = 2000;
  o.backoff_min_ms = 20;
  o.backoff_max_ms = 200;
  StoreDataClient c(store.address(), o);
  auto ns = c.control().RegisterNamespace(Spec256K());
  const uint64_t n = 128;  // 32 MiB per Get
  std::vector<uint8_t> src(n * kBlock), dst(n * kBlock);
  Fill(src, 0, n);
  std::vector<PutBlock> put;
  std::vector<GetBlock> get;
  for (uint64_t i = 0; i < n; ++i) {
    put.push_back({H(i), src.data() + i * kBlock});
    get.push_back({H(i), dst.data() + i * kBlock});
  }
  ASSERT_TRUE(c.Put(ns->id, kBlock, put).get().ok());
  std::atomic<bool> stop{false};
  std::atomic<int> ok_gets{0};
  absl::Status failure;
  double failed_after_s = 0;
  std::thread reader([&] {
    while (!stop) {
      auto t = std::chrono::steady_clock::now();
      auto g = c.Get(ns->id, kBlock, get).get();
      if (!g.ok() || g->blocks != n) {
        failure = g.ok() ? absl::DataLossError("short read") : g.status();
        failed_after_s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
        return;
      }
      ok_gets++;
    }
  });
  ASSERT_TRUE(WaitFor([&] { return ok_gets >= 2; }));
  store.proc().Kill(SIGKILL);
  reader.join();
  EXPECT_FALSE(failure.ok());
  EXPECT_LT(failed_after_s, 2.0 + 1.0) << failure;  // within the deadline
  EXPECT_NE(failure.message().find("store"), std::string::npos) << failure;
  // A store that comes back (same data dir, same ports) is reached again
  // without rebuilding the client.
  store.Start();
  ASSERT_EQ(store.port(), port) << store.Log();
  ASSERT_TRUE(WaitFor([&] { return c.control().RegisterNamespace(Spec256K()).ok(); }));
  bool recovered = WaitFor(
      [&] {
        auto r = c.Put(ns->id, kBlock, put).get();
        return r.ok() && r->written + r->already_present == n;
      },
      std::chrono::seconds(10));
  ASSERT_TRUE(recovered);
  auto g = c.Get(ns->id, kBlock, get).get();
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->blocks, n);
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), src.size()));
}

TEST_F(DataPlaneFaults, AStoreBackAtAnotherDataAddressIsReachedWithinOnePut) {
  // A store pod restarted under a new IP: the client's kept session names
  // the old data address, where a dial hangs (here: a listener whose accept
  // queue is full drops the SYN) instead of failing.
  const int port = testing::FreePort(), old_data = testing::FreePort();
  auto args = [&](int data) {
    return std::vector<std::string>{"--listen=127.0.0.1:" + std::to_string(port),
                                    "--data-listen=127.0.0.1:" + std::to_string(data),
                                    "--data-dir=" + dir_.sub("db"),
                                    "--hugepages=false",
                                    "--ram-bytes=64MiB",
                                    "--local-shm=false"};
  };
  auto store = std::make_unique<ServerProcess>(KVTIER_STORE_BIN, dir_.sub("store"), args(old_data));
  ASSERT_GT(store->port(), 0) << store->Log();
  DataClientOptions o;
  o.deadline_ms = 4000;
  StoreDataClient c(store->address(), o);
  auto ns = c.control().RegisterNamespace(Spec256K());
  ASSERT_TRUE(ns.ok()) << ns.status();
  const uint64_t n = 8;
  std::vector<uint8_t> src(2 * n * kBlock);
  Fill(src, 0, 2 * n);
  std::vector<PutBlock> first, second;
  for (uint64_t i = 0; i < n; ++i) {
    first.push_back({H(i), src.data() + i * kBlock});
    second.push_back({H(n + i), src.data() + (n + i) * kBlock});
  }
  auto wrote = c.Put(ns->id, kBlock, first).get();
  ASSERT_TRUE(wrote.ok()) << wrote.status();
  ASSERT_EQ(store->proc().Kill(SIGTERM), 0);
  store.reset();
  // The old data address now swallows connection attempts.
  const int hole = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(hole, 0);
  const int one = 1;
  setsockopt(hole, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_port = htons(static_cast<uint16_t>(old_data));
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(hole, reinterpret_cast<sockaddr*>(&at), sizeof(at)), 0) << std::strerror(errno);
  ASSERT_EQ(listen(hole, 0), 0);
  std::vector<int> queued;
  for (int i = 0; i < 4; ++i) {  // fills the accept queue (backlog 0 holds one)
    auto q =
        net::Connect("127.0.0.1", old_data, net::Clock::now() + std::chrono::milliseconds(300));
    if (!q.ok()) break;
    queued.push_back(*q);
  }
  store = std::make_unique<ServerProcess>(KVTIER_STORE_BIN, dir_.sub("store"),
                                          args(testing::FreePort()));
  ASSERT_EQ(store->port(), port) << store->Log();
  ASSERT_TRUE(WaitFor([&] { return c.control().RegisterNamespace(Spec256K()).ok(); }));
  // One put, within its deadline: the kept session's dial gives up at half
  // of it, and a new session names the store's new data address.
  const auto began = std::chrono::steady_clock::now();
  auto again = c.Put(ns->id, kBlock, second).get();
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << store->Log();
  EXPECT_EQ(again->written, n);
  EXPECT_LT(std::chrono::steady_clock::now() - began, std::chrono::milliseconds(o.deadline_ms));
  for (int q : queued) close(q);
  close(hole);
}

TEST_F(DataPlaneFaults, AStoreWithoutADataPlaneSaysSo) {
  ServerProcess store(KVTIER_STORE_BIN, dir_.sub("store"),
                      {"--listen=127.0.0.1:0", "--data-dir=" + dir_.sub("db"), "--hugepages=false",
                       "--ram-bytes=16MiB"});
  StoreDataClient c(store.address());
  auto ns = c.control().RegisterNamespace(Spec256K());
  std::vector<uint8_t> src(kBlock);
  auto r = c.Put(ns->id, kBlock, {{H(1), src.data()}}).get();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("--data-listen"), std::string::npos);
}

TEST(Rendezvous, AddingAShardMovesAboutOneNthOfTheKeys) {
  std::vector<std::string> four = {"store-0:7400", "store-1:7400", "store-2:7400", "store-3:7400"};
  std::vector<std::string> five = four;
  five.push_back("store-4:7400");
  const int n = 100000;
  int moved = 0;
  std::vector<int> load(4, 0);
  for (int i = 0; i < n; ++i) {
    BlockKey k{
        7, BlockHash{static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull, static_cast<uint64_t>(i)}};
    size_t a = RendezvousShard(k, four), b = RendezvousShard(k, five);
    load[a]++;
    if (a != b) {
      ++moved;
      EXPECT_EQ(b, 4u);  // keys only ever move to the new shard
    }
  }
  EXPECT_NEAR(moved / double(n), 1.0 / 5, 0.01);
  for (int l : load) EXPECT_NEAR(l / double(n), 0.25, 0.01);
}

// n store shards with UCX listeners, 32 MiB of RAM each; their addresses.
std::vector<std::unique_ptr<ServerProcess>> StartShards(const testing::TempDir& dir, int n,
                                                        std::vector<std::string>* addrs) {
  std::vector<std::unique_ptr<ServerProcess>> stores;
  for (int s = 0; s < n; ++s) {
    stores.push_back(std::make_unique<ServerProcess>(
        KVTIER_STORE_BIN, dir.sub("store" + std::to_string(s)),
        std::vector<std::string>{"--listen=127.0.0.1:0", "--data-listen=127.0.0.1:0",
                                 "--data-dir=" + dir.sub("db" + std::to_string(s)),
                                 "--hugepages=false", "--ram-bytes=32MiB"}));
    addrs->push_back(stores.back()->address());
  }
  return stores;
}

TEST(ShardedStore, BlocksSpreadOverShardsAndComeBack) {
  setenv("UCX_TLS", "tcp", 1);
  testing::TempDir dir;
  std::vector<std::string> addrs;
  auto stores = StartShards(dir, 2, &addrs);
  ShardedStoreClient c(addrs);
  auto ns = c.RegisterNamespace(Spec256K());
  ASSERT_TRUE(ns.ok());
  const uint64_t n = 64;
  std::vector<uint8_t> src(n * kBlock), dst(n * kBlock);
  Fill(src, 500, n);
  ASSERT_TRUE(c.RegisterMemory(src.data(), src.size()).ok());
  std::vector<PutBlock> put;
  std::vector<GetBlock> get;
  std::vector<BlockHash> chain;
  for (uint64_t i = 0; i < n; ++i) {
    put.push_back({H(i), src.data() + i * kBlock});
    get.push_back({H(i), dst.data() + i * kBlock});
    chain.push_back(H(i));
  }
  auto r = c.Put(ns->id, kBlock, put);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->written, n);
  for (size_t s = 0; s < 2; ++s) EXPECT_GT(c.shard(s).control().GetStats()->tiers(0).items(), 10u);
  EXPECT_EQ(*c.Lookup(ns->id, chain), n);
  auto g = c.Get(ns->id, kBlock, get);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->blocks, n);
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), src.size()));
}

// Client options for the shard-skip tests: RMA over the connection (no
// shared memory, so a stopped store stops the bytes too), the deadline and
// the skip window given.
DataClientOptions SkippingOverTcp(int deadline_ms, uint64_t skip_min_ms, uint64_t skip_max_ms) {
  DataClientOptions o;
  o.deadline_ms = deadline_ms;
  o.shard_skip_min_ms = skip_min_ms;
  o.shard_skip_max_ms = skip_max_ms;
  o.shared_memory = DataClientOptions::SharedMemory::kOff;
  return o;
}

// n blocks of test data (Fill from `seed`) registered with `c`, as Puts and as
// a chain of hashes H(base + i), and the first of them shard 1 holds (n:
// none).
struct ShardChain {
  std::vector<uint8_t> src;
  std::vector<PutBlock> put;
  std::vector<BlockHash> chain;
  size_t first_other = 0;
  absl::Status registered;
};
ShardChain MakeShardChain(ShardedStoreClient& c, uint64_t ns, const std::vector<std::string>& addrs,
                          uint64_t base, uint64_t n, uint64_t seed) {
  ShardChain b;
  b.src.resize(n * kBlock);
  Fill(b.src, seed, n);
  b.registered = c.RegisterMemory(b.src.data(), b.src.size());
  b.first_other = n;
  for (uint64_t i = 0; i < n; ++i) {
    b.put.push_back({H(base + i), b.src.data() + i * kBlock});
    b.chain.push_back(H(base + i));
    if (RendezvousShard({ns, H(base + i)}, addrs) == 1 && b.first_other == n) b.first_other = i;
  }
  return b;
}

// A shard that stops answering on an open connection (a dead link, here a
// SIGSTOPped store: every call to it costs the whole deadline) is skipped
// after one failure: the next calls return at once, Pin still pins the
// blocks before the shard's first one and Put still writes the other
// shard's. Answering again, it is used again once its skip ends. (When a
// skip ends, how it doubles and who probes are ShardSkip's rules, tested on
// a clock of their own in shard_skip_test.cc.)
TEST(ShardedStore, AnUnreachableShardIsSkippedNotWaitedFor) {
  setenv("UCX_TLS", "tcp", 1);
  testing::TempDir dir;
  std::vector<std::string> addrs;
  auto stores = StartShards(dir, 2, &addrs);
  for (const auto& st : stores) ASSERT_GT(st->port(), 0) << st->Log();
  // Skips long beside the deadline, so a loaded machine (ctest -j) stays
  // inside each window below.
  ShardedStoreClient c(addrs, SkippingOverTcp(400, 600, 2400));
  auto ns = c.RegisterNamespace(Spec256K());
  ASSERT_TRUE(ns.ok()) << ns.status();
  // A chain whose first two blocks are shard 0's.
  const uint64_t n = 32;
  uint64_t base = 0;
  while (RendezvousShard({ns->id, H(base)}, addrs) != 0 ||
         RendezvousShard({ns->id, H(base + 1)}, addrs) != 0) {
    ++base;
  }
  ShardChain blocks = MakeShardChain(c, ns->id, addrs, base, n, 900);
  ASSERT_TRUE(blocks.registered.ok()) << blocks.registered;
  const std::vector<uint8_t>& src = blocks.src;
  const std::vector<PutBlock>& put = blocks.put;
  const std::vector<BlockHash>& chain = blocks.chain;
  const size_t first_other = blocks.first_other;
  ASSERT_LT(first_other, n);
  auto r = c.Put(ns->id, kBlock, put);
  ASSERT_TRUE(r.ok()) << r.status();
  auto pin = c.Pin(ns->id, kBlock, chain);  // both shards answer: the whole chain
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_EQ(pin->blocks, n);
  c.Release(*pin);

  using Ms = std::chrono::milliseconds;
  auto timed = [](auto&& fn) {
    const auto t = std::chrono::steady_clock::now();
    fn();
    return std::chrono::duration_cast<Ms>(std::chrono::steady_clock::now() - t).count();
  };
  ASSERT_TRUE(stores[1]->proc().Stop());
  EXPECT_GE(timed([&] { pin = c.Pin(ns->id, kBlock, chain); }), 350)
      << "the silent shard's call costs its deadline";
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_EQ(pin->blocks, first_other) << "the prefix ends before the silent shard's first block";
  c.Release(*pin);
  // Skipped now: at once, with the same prefix, and moved byte-exact.
  EXPECT_LT(timed([&] { pin = c.Pin(ns->id, kBlock, chain); }), 300);
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_EQ(pin->blocks, first_other);
  std::vector<uint8_t> dst(n * kBlock, 0);
  ReadPlan plan;
  plan.dest = [&](size_t i, size_t) { return dst.data() + i * kBlock; };
  ASSERT_TRUE(c.Read(*pin, kBlock, 0, pin->blocks, plan).ok());
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), first_other * kBlock));
  c.Release(*pin);
  EXPECT_LT(timed([&] { r = c.Put(ns->id, kBlock, put); }), 300);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("skipped"), std::string::npos) << r.status();
  // Answering again: once the skip ends, a call probes it and the whole
  // chain pins (polled: the skip is at most 2.4 s long).
  kill(stores[1]->proc().pid(), SIGCONT);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  uint32_t pinned = 0;
  while (pinned < n && std::chrono::steady_clock::now() < until) {
    pin = c.Pin(ns->id, kBlock, chain);
    ASSERT_TRUE(pin.ok()) << pin.status();
    pinned = pin->blocks;
    c.Release(*pin);
    if (pinned < n) std::this_thread::sleep_for(Ms(50));
  }
  EXPECT_EQ(pinned, n) << "the shard answers again but is still skipped";
}

// A pin that misses its own budget (a request that would rather compute)
// says the shard is slow, not unreachable: budgeted pins skip it for a
// while, but a save's Put and an unbudgeted pin still reach it. (Before,
// one slow lookup on a busy host skipped the shard for every call and the
// saves behind it failed.)
TEST(ShardedStore, AMissedBudgetSkipsOnlyBudgetedPins) {
  setenv("UCX_TLS", "tcp", 1);
  testing::TempDir dir;
  std::vector<std::string> addrs;
  auto stores = StartShards(dir, 2, &addrs);
  for (const auto& st : stores) ASSERT_GT(st->port(), 0) << st->Log();
  ShardedStoreClient c(addrs, SkippingOverTcp(5000, 3000, 6000));  // long beside hiccups
  auto ns = c.RegisterNamespace(Spec256K());
  ASSERT_TRUE(ns.ok()) << ns.status();
  const uint64_t n = 16;
  ShardChain blocks = MakeShardChain(c, ns->id, addrs, 5000, n, 1700);
  ASSERT_TRUE(blocks.registered.ok()) << blocks.registered;
  const std::vector<PutBlock>& put = blocks.put;
  const std::vector<BlockHash>& chain = blocks.chain;
  const size_t first_other = blocks.first_other;
  ASSERT_LT(first_other, n);
  // Half the chain stored; the rest is for the Put while a skip is on.
  std::vector<PutBlock> first_half(put.begin(), put.begin() + n / 2);
  std::vector<PutBlock> second_half(put.begin() + n / 2, put.end());
  ASSERT_TRUE(c.Put(ns->id, kBlock, first_half).ok());

  const auto budget = std::chrono::milliseconds(100);
  ASSERT_TRUE(stores[1]->proc().Stop());
  auto pin = c.Pin(ns->id, kBlock, chain, budget);  // shard 1 misses the budget
  kill(stores[1]->proc().pid(), SIGCONT);
  ASSERT_TRUE(pin.ok() || first_other == 0) << pin.status();
  if (pin.ok()) {
    EXPECT_LE(pin->blocks, first_other);
    c.Release(*pin);
  }
  // Budgeted pins skip shard 1 now, although it answers again.
  pin = c.Pin(ns->id, kBlock, chain, budget);
  if (first_other == 0) {
    ASSERT_FALSE(pin.ok());
    EXPECT_NE(pin.status().message().find("budget"), std::string::npos) << pin.status();
  } else {
    ASSERT_TRUE(pin.ok()) << pin.status();
    EXPECT_EQ(pin->blocks, std::min<size_t>(first_other, n / 2))
        << "the prefix ends before the skipped shard's block (or the stored half)";
    c.Release(*pin);
  }
  // A save is not a lookup: it reaches shard 1 and writes.
  auto r = c.Put(ns->id, kBlock, second_half);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->written + r->already_present, second_half.size());
  // Nor is an unbudgeted pin: the whole chain.
  pin = c.Pin(ns->id, kBlock, chain);
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_EQ(pin->blocks, n);
  c.Release(*pin);
  // Once the budget skip ends, a budgeted pin probes and gets it all.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  uint32_t pinned = 0;
  while (pinned < n && std::chrono::steady_clock::now() < until) {
    pin = c.Pin(ns->id, kBlock, chain, std::chrono::milliseconds(2000));
    if (pin.ok()) {
      pinned = pin->blocks;
      c.Release(*pin);
    }
    if (pinned < n) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(pinned, n) << "shard 1 answers again but budgeted pins still skip it";
}

// A step's lookups in one call: every chain's present prefix, as one
// Lookup each would answer, in one round trip per shard; a shard that
// misses the budget holds none of any chain (each prefix ends before its
// first block there) and answers within the budget, not the deadline.
TEST(ShardedStore, ManyChainsAreLookedUpInOneCallPerShard) {
  setenv("UCX_TLS", "tcp", 1);
  testing::TempDir dir;
  std::vector<std::string> addrs;
  auto stores = StartShards(dir, 2, &addrs);
  for (const auto& st : stores) ASSERT_GT(st->port(), 0) << st->Log();
  ShardedStoreClient c(addrs, SkippingOverTcp(5000, 3000, 6000));
  auto ns = c.RegisterNamespace(Spec256K());
  ASSERT_TRUE(ns.ok()) << ns.status();
  // Three chains of 16: stored whole, stored half, not stored; and an empty one.
  const uint64_t n = 16;
  std::vector<ShardChain> chains;
  for (uint64_t k = 0; k < 3; ++k) {
    chains.push_back(MakeShardChain(c, ns->id, addrs, 7000 + 100 * k, n, 2000 + k));
    ASSERT_TRUE(chains.back().registered.ok());
  }
  ASSERT_TRUE(c.Put(ns->id, kBlock, chains[0].put).ok());
  std::vector<PutBlock> half(chains[1].put.begin(), chains[1].put.begin() + n / 2);
  ASSERT_TRUE(c.Put(ns->id, kBlock, half).ok());
  std::vector<std::vector<BlockHash>> ask = {chains[0].chain, chains[1].chain, chains[2].chain, {}};
  auto got = c.LookupMany(ns->id, ask);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 4u);
  for (size_t k = 0; k < 3; ++k) EXPECT_EQ((*got)[k], *c.Lookup(ns->id, ask[k])) << "chain " << k;
  EXPECT_EQ((*got)[0], n);
  EXPECT_EQ((*got)[1], n / 2);
  EXPECT_EQ((*got)[2], 0u);
  EXPECT_EQ((*got)[3], 0u);
  // Past one request's limit the client splits the batch; the store refuses
  // one request that names more, whatever its chains.
  std::vector<std::vector<BlockHash>> big(2, {H(7000)});  // stored, then 8,999 absent
  for (auto& chain : big) {
    for (uint64_t i = 0; i < 8999; ++i) chain.push_back(H(900000 + i));
  }
  auto split = c.LookupMany(ns->id, big);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(*split, (std::vector<uint32_t>{1, 1}));
  auto refused = c.shard(0).control().LookupChains(
      ns->id, big, std::chrono::system_clock::now() + std::chrono::seconds(5));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();

  // Shard 1 stops answering: within the budget, each prefix ends before
  // its first block on shard 1.
  ASSERT_TRUE(stores[1]->proc().Stop());
  const auto t = std::chrono::steady_clock::now();
  got = c.LookupMany(ns->id, ask, std::chrono::milliseconds(150));
  const auto took =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t)
          .count();
  kill(stores[1]->proc().pid(), SIGCONT);
  EXPECT_LT(took, 2000) << "the budget, not the 5 s deadline";
  ASSERT_TRUE(got.ok()) << got.status() << " (shard 0 answered)";
  EXPECT_EQ((*got)[0], chains[0].first_other);
  EXPECT_EQ((*got)[1], std::min<size_t>(chains[1].first_other, n / 2));
  EXPECT_EQ((*got)[2], 0u);
}

}  // namespace
}  // namespace kvtier
