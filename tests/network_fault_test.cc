// Network faults between real processes on loopback: a FaultProxy between
// client and store (or publisher and router) black-holes or resets the TCP
// connections; a SIGSTOPped store stalls the UCX data plane as a partition
// would. Every call ends with a clean status by its deadline, nothing torn
// is visible, and everything recovers by itself when the network does.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>

#include "client/router_client.h"
#include "client/store_client.h"
#include "client/store_data_client.h"
#include "kvtier/v1/router.grpc.pb.h"
#include "tests/fault_proxy.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::FaultProxy;
using testing::ServerProcess;
using testing::WaitFor;
using Clock = std::chrono::steady_clock;

NamespaceSpec Spec() { return NamespaceSpec{"net-model", "fp16", 1, 1, 64, 512, 0, 1, "", "", ""}; }
constexpr uint64_t kBlock = 128 << 10;
constexpr int kDeadlineMs = 1000;
// Slack over a deadline for a loaded 2-core machine.
constexpr auto kSlack = std::chrono::milliseconds(1000);
BlockHash H(uint64_t i) { return BlockHash{0x7E7 + i, i}; }

int64_t MsSince(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

ServerProcess Store(testing::TempDir& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--listen=127.0.0.1:0",  "--data-dir=" + dir.sub("db"),
                                   "--hugepages=false",     "--ram-bytes=16MiB",
                                   "--ram-slab-bytes=1MiB", "--lease-ms=2s"};
  args.insert(args.end(), extra.begin(), extra.end());
  return ServerProcess(KVTIER_STORE_BIN, dir.sub("store"), args);
}

StoreClient Client(const std::string& address) {
  StoreClientOptions o;
  o.deadline_ms = kDeadlineMs;
  return StoreClient(address, o);
}

// A store reached through a FaultProxy, with a namespace registered.
class StoreBehindAFaultyNetwork : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GT(store_.port(), 0) << store_.Log();
    auto r = c_.RegisterNamespace(Spec());
    ASSERT_TRUE(r.ok()) << r.status();
    ns_ = r->id;
  }
  testing::TempDir dir_;
  ServerProcess store_ = Store(dir_);
  FaultProxy proxy_{store_.port()};
  StoreClient c_ = Client(proxy_.address());
  uint64_t ns_ = 0;
};

TEST_F(StoreBehindAFaultyNetwork, APartitionedControlPlaneFailsEveryCallAtItsDeadlineAndRecovers) {
  FaultProxy& proxy = proxy_;
  StoreClient& c = c_;

  proxy.Set(FaultProxy::Mode::kBlackhole);
  for (int i = 0; i < 3; ++i) {
    auto t0 = Clock::now();
    auto s = c.GetStats();
    int64_t ms = MsSince(t0);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kDeadlineExceeded) << s.status();
    EXPECT_LE(ms, kDeadlineMs + kSlack.count()) << "call " << i << " hung past its deadline";
    std::printf("partitioned GetStats: %s after %ld ms (deadline %d ms)\n",
                absl::StatusCodeToString(s.status().code()).c_str(), static_cast<long>(ms),
                kDeadlineMs);
    std::string block = testing::BlockBytesFor(i, kBlock);
    t0 = Clock::now();
    auto put = c.PutInline(ns_, {{H(i), block}});
    EXPECT_FALSE(put.ok());
    EXPECT_LE(MsSince(t0), kDeadlineMs + kSlack.count()) << "put " << i << " hung";
  }

  // The partition heals: calls succeed again on their own.
  proxy.Set(FaultProxy::Mode::kForward);
  auto healed = Clock::now();
  EXPECT_TRUE(WaitFor([&] { return c.GetStats().ok(); }, std::chrono::seconds(10)));
  std::printf("healed: first successful call after %ld ms\n", static_cast<long>(MsSince(healed)));
  // Whatever the cut-off puts left behind is whole or absent.
  for (uint64_t i = 0; i < 3; ++i) {
    auto got = c.GetInline(ns_, {H(i)});
    ASSERT_TRUE(got.ok()) << got.status();
    if (!got->empty()) {
      EXPECT_EQ((*got)[0].data, testing::BlockBytesFor(i, kBlock));
    }
  }
  EXPECT_EQ(c.GetStats()->checksum_failures(), 0u);
}

TEST_F(StoreBehindAFaultyNetwork, ResetConnectionsFailCallsFastAndTheClientReconnects) {
  FaultProxy& proxy = proxy_;
  StoreClient& c = c_;

  // Reset in the middle of a stream of inline puts (32 MiB per call).
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> ok_puts{0}, failed_puts{0}, slow{0};
  std::thread writer([&] {
    for (uint64_t first = 0; !stop; first += 256) {
      std::vector<std::string> bytes;
      for (uint64_t i = first; i < first + 256; ++i)
        bytes.push_back(testing::BlockBytesFor(i, kBlock));
      std::vector<std::pair<BlockHash, std::string_view>> blocks;
      for (uint64_t i = 0; i < 256; ++i) blocks.push_back({H(first + i), bytes[i]});
      auto t0 = Clock::now();
      auto r = c.PutInline(ns_, blocks);
      if (MsSince(t0) > kDeadlineMs + kSlack.count()) ++slow;
      (r.ok() ? ok_puts : failed_puts)++;
      if (!r.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      if (first >= 4096) first = 0;
    }
  });
  ASSERT_TRUE(WaitFor([&] { return ok_puts >= 1; }, std::chrono::seconds(20)));
  const uint64_t failed_before = failed_puts;
  proxy.Set(FaultProxy::Mode::kReset);
  // Once the reset reached the client (a put failed), calls fail quickly
  // with UNAVAILABLE.
  EXPECT_TRUE(WaitFor([&] { return failed_puts > failed_before; }, std::chrono::seconds(5)));
  auto t0 = Clock::now();
  auto s = c.GetStats();
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable) << s.status();
  int64_t reset_ms = MsSince(t0);
  EXPECT_LT(reset_ms, kDeadlineMs) << "a reset should not wait for the deadline";
  std::printf("reset GetStats: %s after %ld ms\n",
              absl::StatusCodeToString(s.status().code()).c_str(), static_cast<long>(reset_ms));
  EXPECT_TRUE(WaitFor([&] { return failed_puts >= 1; }, std::chrono::seconds(5)));

  proxy.Set(FaultProxy::Mode::kForward);
  const uint64_t before = ok_puts;
  EXPECT_TRUE(WaitFor([&] { return ok_puts > before; }, std::chrono::seconds(15)))
      << "the client did not reconnect";
  stop = true;
  writer.join();
  std::printf("inline puts of 32 MiB: %lu ok, %lu failed, %lu past the deadline\n",
              static_cast<unsigned long>(ok_puts.load()),
              static_cast<unsigned long>(failed_puts.load()),
              static_cast<unsigned long>(slow.load()));
  EXPECT_EQ(slow.load(), 0u) << "a put outlived its deadline";
  EXPECT_GE(proxy.connections(), 2u) << "the client should have opened a new connection";

  // Every block the store shows is byte-exact (a reset mid-stream leaves no
  // torn block behind).
  uint64_t present = 0;
  for (uint64_t i = 0; i < 4096 + 256; ++i) {
    auto got = c.GetInline(ns_, {H(i)});
    ASSERT_TRUE(got.ok()) << got.status();
    if (got->empty()) continue;
    ++present;
    ASSERT_EQ((*got)[0].data, testing::BlockBytesFor(i, kBlock)) << "block " << i;
  }
  EXPECT_GT(present, 0u);
}

TEST(NetworkFaults, AStalledStoreFailsDataPlaneOperationsAtTheirDeadlineAndTheyRecover) {
  setenv("UCX_TLS", "tcp", 1);
  testing::TempDir dir;
  ServerProcess store = Store(dir, {"--data-listen=127.0.0.1:0"});
  ASSERT_GT(store.port(), 0) << store.Log();
  DataClientOptions o;
  o.deadline_ms = kDeadlineMs;
  o.backoff_min_ms = 20;
  o.backoff_max_ms = 300;
  o.shared_memory = DataClientOptions::SharedMemory::kOff;
  StoreDataClient c(store.address(), o);
  auto ns = c.control().RegisterNamespace(Spec());
  ASSERT_TRUE(ns.ok()) << ns.status();

  std::vector<uint8_t> out(4 * kBlock), in(4 * kBlock);
  auto put = [&](uint64_t first) {
    std::vector<PutBlock> blocks;
    for (uint64_t i = 0; i < 4; ++i) {
      std::string b = testing::BlockBytesFor(first + i, kBlock);
      std::memcpy(out.data() + i * kBlock, b.data(), kBlock);
      blocks.push_back({H(first + i), out.data() + i * kBlock});
    }
    return c.Put(ns->id, kBlock, blocks).get();
  };
  auto get = [&](uint64_t first) {
    std::vector<GetBlock> blocks;
    for (uint64_t i = 0; i < 4; ++i) blocks.push_back({H(first + i), in.data() + i * kBlock});
    return c.Get(ns->id, kBlock, blocks).get();
  };
  ASSERT_TRUE(put(0).ok());

  // The store stops answering on every connection (SIGSTOP: its sockets
  // stay open, nothing comes back, as in a partition).
  ASSERT_TRUE(store.proc().Stop());
  // kill() returns before every thread has stopped: wait for state T.
  ASSERT_TRUE(WaitFor(
      [&] {
        std::ifstream stat("/proc/" + std::to_string(store.proc().pid()) + "/stat");
        std::string pid, comm, state;
        stat >> pid >> comm >> state;
        return state == "T";
      },
      std::chrono::seconds(5)));
  for (uint64_t first : {100, 200}) {
    auto t0 = Clock::now();
    auto p = put(first);
    EXPECT_FALSE(p.ok());
    int64_t put_ms = MsSince(t0);
    EXPECT_LE(put_ms, kDeadlineMs + kSlack.count()) << "put hung: " << p.status();
    std::printf("stalled store: data-plane put failed after %ld ms: %s\n",
                static_cast<long>(put_ms), std::string(p.status().message()).c_str());
    t0 = Clock::now();
    auto g = get(0);
    EXPECT_FALSE(g.ok() && g->blocks == 4);
    EXPECT_LE(MsSince(t0), kDeadlineMs + kSlack.count()) << "get hung";
  }
  ::kill(store.proc().pid(), SIGCONT);

  // Back: operations succeed again without rebuilding the client (each of
  // its lanes reconnects after its own back-off), and every block read is
  // byte-exact.
  EXPECT_TRUE(WaitFor([&] { return put(300).ok(); }, std::chrono::seconds(15)));
  absl::StatusOr<GetOutcome> g;
  EXPECT_TRUE(WaitFor([&] { return (g = get(0)).ok(); }, std::chrono::seconds(15)));
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_EQ(g->blocks, 4u);
  for (uint64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(std::memcmp(in.data() + i * kBlock, testing::BlockBytesFor(i, kBlock).data(), kBlock),
              0);
  }
}

TEST(NetworkFaults, ARouterStreamCutOffOrResetDropsThenResyncsTheSource) {
  testing::TempDir dir;
  ServerProcess router(KVTIER_ROUTER_BIN, dir.sub("router"),
                       {"--listen=127.0.0.1:0", "--heartbeat-deadline=1s"});
  ASSERT_GT(router.port(), 0) << router.Log();
  FaultProxy proxy(router.port());
  PublisherOptions po;
  po.router = proxy.address();
  po.hello.set_source_id("w-net");
  po.hello.set_kind(v1::SOURCE_WORKER);
  po.hello.set_endpoint("w-net.local:8000");
  po.hello.set_namespace_id(42);
  po.hello.set_block_tokens(16);
  po.heartbeat_ms = 100;
  po.backoff_min_ms = 20;
  po.backoff_max_ms = 200;
  EventPublisher pub(po);
  std::vector<BlockHash> chain;
  for (uint64_t i = 0; i < 50; ++i) chain.push_back(H(i));
  pub.Stored(42, chain);

  auto stub = v1::Router::NewStub(
      grpc::CreateChannel(router.address(), grpc::InsecureChannelCredentials()));
  auto blocks = [&]() -> int64_t {  // -1: the router does not list the source
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::ListWorkersResponse r;
    if (!stub->ListWorkers(&ctx, {}, &r).ok()) return -2;
    for (const auto& s : r.sources()) {
      if (s.source_id() == "w-net")
        return s.connected() ? static_cast<int64_t>(s.indexed_blocks()) : -1;
    }
    return -1;
  };
  ASSERT_TRUE(WaitFor([&] { return blocks() == 50; }, std::chrono::seconds(10)));

  // Partition: heartbeats stop arriving; the router drops the source and its
  // blocks at the heartbeat deadline (so it stops routing to it).
  proxy.Set(FaultProxy::Mode::kBlackhole);
  auto t0 = Clock::now();
  EXPECT_TRUE(WaitFor([&] { return blocks() == -1; }, std::chrono::seconds(5)));
  std::printf("partitioned source dropped by the router after %ld ms (deadline 1000 ms)\n",
              static_cast<long>(MsSince(t0)));
  EXPECT_LE(MsSince(t0), 1000 + 2 * kSlack.count());
  // Healed: the source is back with all of its blocks (a snapshot resync).
  proxy.Set(FaultProxy::Mode::kForward);
  EXPECT_TRUE(WaitFor([&] { return blocks() == 50; }, std::chrono::seconds(10))) << blocks();

  // Reset: the publisher reconnects by itself; blocks stored meanwhile arrive.
  proxy.Set(FaultProxy::Mode::kReset);
  EXPECT_TRUE(WaitFor([&] { return !pub.connected(); })) << "the reset never reached the stream";
  std::vector<BlockHash> more;
  for (uint64_t i = 50; i < 60; ++i) more.push_back(H(i));
  pub.Stored(42, more);
  // It tries to reconnect and is reset again, then the network heals.
  const size_t tries = proxy.Accepted().size();
  EXPECT_TRUE(WaitFor([&] { return proxy.Accepted().size() > tries; }))
      << "the publisher did not try to reconnect";
  proxy.Set(FaultProxy::Mode::kForward);
  EXPECT_TRUE(WaitFor([&] { return blocks() == 60; }, std::chrono::seconds(10))) << blocks();
  pub.Stop();
}

}  // namespace
}  // namespace kvtier
