// Router replicas behind one name (a headless Service): a store shard
// given --router NAME:PORT publishes to every address the name resolves
// to, and follows the name as replicas come and go. Hosts are network
// namespaces of the test's own; the name is resolved from each host's
// /etc/netns/NS/hosts. Needs root (CI runs as root); skipped otherwise.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "client/store_client.h"
#include "kvtier/v1/router.grpc.pb.h"
#include "testing/netns.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

struct RouterView {
  bool connected = false;
  uint64_t blocks = 0;
};

// What the router at `address` knows of source `id`.
RouterView View(const std::string& address, const std::string& id) {
  auto stub = v1::Router::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  v1::ListWorkersResponse r;
  RouterView v;
  if (!stub->ListWorkers(&ctx, {}, &r).ok()) return v;
  for (const auto& s : r.sources()) {
    if (s.source_id() == id) {
      v.connected = s.connected();
      v.blocks = s.indexed_blocks();
    }
  }
  return v;
}

TEST(RouterReplicas, EveryReplicaBehindOneNameHearsTheStoreAsTheyComeAndGo) {
  if (!NetnsLab::Available())
    GTEST_SKIP() << "needs root and iproute2 to create network namespaces";
  NetnsLab::RemoveStale("kvr");
  NetnsLab lab("kvr");
  std::string error;
  ASSERT_TRUE(lab.Create({"router0", "router1", "router2", "store", "client"}, &error)) << error;
  const std::string ip = NetnsLab::IpPath();
  auto hosts = [&](std::vector<std::string> routers) {
    std::string text;
    for (const auto& r : routers) text += lab.at(r).ip + " routers\n";
    lab.SetHosts("store", text);
  };
  hosts({"router0", "router1"});
  testing::TempDir dir;
  std::vector<std::unique_ptr<Process>> routers;
  for (const char* r : {"router0", "router1", "router2"}) {
    routers.push_back(std::make_unique<Process>(
        ip,
        lab.ExecArgs(r, KVTIER_ROUTER_BIN,
                     {"--listen=" + lab.at(r).ip + ":7500", "--heartbeat-deadline=1s"}),
        dir.sub(std::string(r) + ".log")));
  }
  Process store(
      ip,
      lab.ExecArgs("store", KVTIER_STORE_BIN,
                   {"--listen=" + lab.at("store").ip + ":7400", "--data-dir=" + dir.sub("db"),
                    "--hugepages=false", "--ram-bytes=4MiB", "--router=routers:7500",
                    "--router-refresh=200ms", "--store-id=shard-0"}),
      dir.sub("store.log"));
  ASSERT_TRUE(lab.Enter("client"));
  auto addr = [&](const char* r) { return lab.at(r).ip + ":7500"; };
  StoreClient c(lab.at("store").ip + ":7400");
  ASSERT_TRUE(testing::WaitFor([&] { return c.Health().ok(); }, std::chrono::seconds(20)));
  auto ns = c.RegisterNamespace(NamespaceSpec{"replicas", "fp16", 1, 1, 64, 16, 0, 1, "", "", ""});
  ASSERT_TRUE(ns.ok()) << ns.status();
  std::vector<std::string> data;
  std::vector<std::pair<BlockHash, std::string_view>> blocks;
  for (uint64_t i = 0; i < 5; ++i) data.push_back(std::string(4096, static_cast<char>('a' + i)));
  for (uint64_t i = 0; i < 5; ++i) blocks.emplace_back(BlockHash{i + 1, 7}, data[i]);
  ASSERT_TRUE(c.PutInline(ns->id, blocks).ok());

  // Both replicas the name resolves to hear the shard and all its blocks.
  for (const char* r : {"router0", "router1"}) {
    EXPECT_TRUE(testing::WaitFor(
        [&] {
          RouterView v = View(addr(r), "shard-0");
          return v.connected && v.blocks == 5;
        },
        std::chrono::seconds(20)))
        << r;
  }
  EXPECT_FALSE(View(addr("router2"), "shard-0").connected) << "router2 is not behind the name yet";

  // A replica appears behind the name: it hears the shard, with every block
  // stored before it appeared.
  hosts({"router0", "router1", "router2"});
  EXPECT_TRUE(testing::WaitFor(
      [&] {
        RouterView v = View(addr("router2"), "shard-0");
        return v.connected && v.blocks == 5;
      },
      std::chrono::seconds(20)));
  // One leaves the name: the shard stops publishing to it (the router drops
  // it at its heartbeat deadline); the others keep it.
  hosts({"router1", "router2"});
  EXPECT_TRUE(testing::WaitFor([&] { return !View(addr("router0"), "shard-0").connected; },
                               std::chrono::seconds(20)));
  EXPECT_TRUE(View(addr("router1"), "shard-0").connected);
  EXPECT_TRUE(View(addr("router2"), "shard-0").connected);
  store.Kill(SIGTERM);
  for (auto& r : routers) r->Kill(SIGTERM);
}

}  // namespace
}  // namespace kvtier
