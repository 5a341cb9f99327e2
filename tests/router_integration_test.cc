// The real kvtier-router on loopback with several event sources
// (EventPublisher, the library workers and store shards link).
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include <atomic>
#include <functional>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "client/router_client.h"
#include "client/router_fanout.h"
#include "client/store_client.h"
#include "tests/fault_proxy.h"
#include "tests/test_util.h"

namespace kvtier {
namespace {

using testing::ServerProcess;
using testing::WaitFor;

constexpr uint64_t kNs = 0x5eed;
BlockHash H(uint64_t i) { return BlockHash{i + 1, 0xfeed}; }
std::vector<BlockHash> Chain(uint64_t first, uint64_t n) {
  std::vector<BlockHash> c;
  for (uint64_t i = first; i < first + n; ++i) c.push_back(H(i));
  return c;
}

std::unique_ptr<EventPublisher> Source(const std::string& router, const std::string& id,
                                       uint64_t epoch = 1,
                                       v1::SourceKind kind = v1::SOURCE_WORKER) {
  PublisherOptions o;
  o.router = router;
  o.hello.set_source_id(id);
  o.hello.set_kind(kind);
  if (kind == v1::SOURCE_WORKER) {
    o.hello.set_endpoint(id + ".local:8000");
    o.hello.set_namespace_id(kNs);
    o.hello.set_block_tokens(16);
  }
  o.hello.set_epoch(epoch);
  o.heartbeat_ms = 100;
  o.backoff_min_ms = 20;
  o.backoff_max_ms = 200;
  return std::make_unique<EventPublisher>(o);
}

class RouterClient {
 public:
  explicit RouterClient(const std::string& address)
      : stub_(
            v1::Router::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {
  }
  std::unique_ptr<grpc::ClientContext> Ctx() {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    return c;
  }
  std::map<std::string, v1::SourceInfo> Sources() {
    v1::ListWorkersResponse r;
    std::map<std::string, v1::SourceInfo> out;
    if (stub_->ListWorkers(Ctx().get(), {}, &r).ok()) {
      for (const auto& s : r.sources()) out[s.source_id()] = s;
    }
    return out;
  }
  uint64_t Blocks(const std::string& id) {
    auto s = Sources();
    return s.count(id) ? s[id].indexed_blocks() : 0;
  }
  grpc::Status Route(const std::vector<BlockHash>& chain, v1::RouteResponse* out,
                     uint64_t ns = kNs) {
    v1::RouteRequest req;
    req.set_namespace_id(ns);
    for (const auto& h : chain) {
      auto* p = req.mutable_hashes()->add_hashes();
      p->set_hi(h.hi);
      p->set_lo(h.lo);
    }
    return stub_->Route(Ctx().get(), req, out);
  }
  v1::Router::Stub& stub() { return *stub_; }

 private:
  std::unique_ptr<v1::Router::Stub> stub_;
};

class RouterIntegration : public ::testing::Test {
 protected:
  void StartRouter(int port = 0) {
    router_ = std::make_unique<ServerProcess>(
        KVTIER_ROUTER_BIN, dir_.sub("router"),
        std::vector<std::string>{"--listen=127.0.0.1:" + std::to_string(port),
                                 "--heartbeat-deadline=1s"});
    ASSERT_GT(router_->port(), 0) << "router did not start; see " << dir_.sub("router.log");
    client_ = std::make_unique<RouterClient>(router_->address());
  }
  // A store shard "store-a" publishing to the router, 64 KiB blocks.
  std::unique_ptr<ServerProcess> StartStore(const std::string& ram) {
    return std::make_unique<ServerProcess>(
        KVTIER_STORE_BIN, dir_.sub("store"),
        std::vector<std::string>{"--listen=127.0.0.1:0", "--data-dir=" + dir_.sub("store-db"),
                                 "--ram-bytes=" + ram, "--ram-slab-bytes=256KiB",
                                 "--hugepages=false", "--router=" + router_->address(),
                                 "--store-id=store-a"});
  }
  static inline const NamespaceSpec kStoreSpec{"m", "fp16", 1, 1, 64, 256, 0, 1, "", "", ""};
  testing::TempDir dir_;
  std::unique_ptr<ServerProcess> router_;
  std::unique_ptr<RouterClient> client_;
};

TEST_F(RouterIntegration, RoutesByStreamedEventsAndExplains) {
  StartRouter();
  auto w1 = Source(router_->address(), "w1");
  auto w2 = Source(router_->address(), "w2");
  auto w3 = Source(router_->address(), "w3");
  w1->Stored(kNs, Chain(0, 10));
  w2->Stored(kNs, Chain(0, 3));
  ASSERT_TRUE(WaitFor([&] { return client_->Blocks("w1") == 10 && client_->Blocks("w2") == 3; }));
  v1::RouteResponse r;
  ASSERT_TRUE(client_->Route(Chain(0, 12), &r).ok());
  EXPECT_EQ(r.worker_id(), "w1");
  EXPECT_EQ(r.endpoint(), "w1.local:8000");
  EXPECT_EQ(r.gpu_hit_blocks(), 10u);
  EXPECT_EQ(r.prefill_tokens(), 32u);
  ASSERT_EQ(r.candidates_size(), 3);
  EXPECT_EQ(r.reason(), v1::ROUTE_LOWEST_COST);
  // Removal moves the decision.
  w1->Removed(kNs, Chain(2, 8));
  ASSERT_TRUE(WaitFor([&] { return client_->Blocks("w1") == 2; }));
  ASSERT_TRUE(client_->Route(Chain(0, 12), &r).ok());
  EXPECT_EQ(r.worker_id(), "w2");
  EXPECT_EQ(w1->events_rejected(), 0u);
}

TEST_F(RouterIntegration, DisconnectedAndSilentSourcesExpire) {
  StartRouter();
  auto w1 = Source(router_->address(), "w1");
  auto w2 = Source(router_->address(), "w2");
  auto w3 = Source(router_->address(), "w3");
  w2->Stored(kNs, Chain(0, 5));
  w3->Stored(kNs, Chain(0, 5));
  ASSERT_TRUE(
      WaitFor([&] { return client_->Sources().size() == 3 && client_->Blocks("w3") == 5; }));
  w2->Stop();           // disconnects
  w3->SetSilent(true);  // stays connected, says nothing
  ASSERT_TRUE(WaitFor([&] { return client_->Sources().size() == 1; }, std::chrono::seconds(5)));
  EXPECT_EQ(client_->Sources().count("w1"), 1u);
  v1::RouteResponse r;
  ASSERT_TRUE(client_->Route(Chain(0, 5), &r).ok());
  EXPECT_EQ(r.worker_id(), "w1");
  EXPECT_EQ(r.candidates_size(), 1);
  // The silent one comes back, re-registers, and resends its state.
  w3->SetSilent(false);
  ASSERT_TRUE(WaitFor([&] { return client_->Blocks("w3") == 5; }));
}

TEST_F(RouterIntegration, ASourceRestartingWithANewEpochReplacesItsBlocks) {
  StartRouter();
  auto w1 = Source(router_->address(), "w1", /*epoch=*/1);
  w1->Stored(kNs, Chain(0, 6));
  ASSERT_TRUE(WaitFor([&] { return client_->Blocks("w1") == 6; }));
  w1->Stop();
  auto again = Source(router_->address(), "w1", /*epoch=*/2);
  again->Stored(kNs, Chain(100, 2));
  ASSERT_TRUE(WaitFor([&] {
    auto s = client_->Sources();
    return s.count("w1") && s["w1"].epoch() == 2 && s["w1"].indexed_blocks() == 2 &&
           !s["w1"].resyncing();
  }));
  v1::RouteResponse r;
  ASSERT_TRUE(client_->Route(Chain(0, 6), &r).ok());
  EXPECT_EQ(r.gpu_hit_blocks(), 0u);  // the old epoch's blocks are gone
}

// A source started long before its router (a store shard before the
// frontend that routes for it) keeps trying every few hundred ms however long
// the router is away, and registers as soon as it is up. (gRPC alone would
// try every 5 s at best, its back-off growing to 120 s.)
TEST_F(RouterIntegration, ASourceStartedBeforeItsRouterKeepsTryingAndRegistersOnceItIsUp) {
  // The source reaches the router's port through a proxy that notes when
  // each try came; until the router listens there, the proxy's upstream
  // connect is refused and it resets the try.
  int port = testing::FreePort();
  testing::FaultProxy proxy(port);
  auto store = Source(proxy.address(), "store-early", 1,
                      v1::SOURCE_STORE);  // back-off up to 200 ms
  store->Stored(kNs, Chain(0, 4));
  using Clock = std::chrono::steady_clock;
  auto start = Clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(8));
  auto end = Clock::now();
  auto attempts = proxy.Accepted();
  ASSERT_FALSE(attempts.empty());
  auto widest = attempts.front() - start;
  std::string when;
  for (size_t i = 0; i < attempts.size(); ++i) {
    if (i > 0) widest = std::max(widest, attempts[i] - attempts[i - 1]);
    when += std::to_string((attempts[i] - start) / std::chrono::milliseconds(1)) + " ";
  }
  widest = std::max(widest, end - attempts.back());
  EXPECT_LT(widest, std::chrono::milliseconds(1500)) << "tries at ms " << when;
  EXPECT_GE(attempts.size(), 10u) << "tries at ms " << when;
  EXPECT_FALSE(store->connected());
  StartRouter(port);
  ASSERT_EQ(router_->port(), port);
  auto up = Clock::now();
  ASSERT_TRUE(WaitFor([&] { return client_->Blocks("store-early") == 4; }));
  EXPECT_LT(Clock::now() - up, std::chrono::milliseconds(1500));
}

TEST_F(RouterIntegration, ARestartedRouterRebuildsItsIndexFromSnapshots) {
  int port = testing::FreePort();
  StartRouter(port);
  auto w1 = Source(router_->address(), "w1");
  auto w2 = Source(router_->address(), "w2");
  auto store = Source(router_->address(), "store-0", 1, v1::SOURCE_STORE);
  w1->Stored(kNs, Chain(0, 8));
  w2->Stored(kNs, Chain(0, 2));
  store->Stored(kNs, Chain(0, 20));
  ASSERT_TRUE(
      WaitFor([&] { return client_->Blocks("store-0") == 20 && client_->Blocks("w1") == 8; }));
  v1::RouteResponse before;
  ASSERT_TRUE(client_->Route(Chain(0, 20), &before).ok());
  router_->proc().Kill(SIGKILL);
  w2->Stored(kNs, Chain(2, 1));  // made while the router is down
  router_->Start();
  ASSERT_EQ(router_->port(), port);
  // No source restarts: they reconnect and answer the snapshot requests.
  ASSERT_TRUE(WaitFor([&] {
    return client_->Blocks("w1") == 8 && client_->Blocks("w2") == 3 &&
           client_->Blocks("store-0") == 20;
  }));
  v1::RouteResponse after;
  ASSERT_TRUE(client_->Route(Chain(0, 20), &after).ok());
  EXPECT_EQ(after.worker_id(), before.worker_id());
  EXPECT_EQ(after.gpu_hit_blocks(), 8u);
  EXPECT_EQ(after.store_hit_blocks(), 12u);
  EXPECT_GE(w1->snapshots_sent(), 2u);
}

TEST_F(RouterIntegration, TwoReplicasGiveTheSameDecisions) {
  StartRouter();
  ServerProcess replica(KVTIER_ROUTER_BIN, dir_.sub("replica"),
                        {"--listen=127.0.0.1:0", "--heartbeat-deadline=5s"});
  RouterClient other(replica.address());
  // Each worker publishes to both replicas.
  std::vector<std::unique_ptr<EventPublisher>> pubs;
  for (int w = 0; w < 4; ++w) {
    for (const auto& addr : {router_->address(), replica.address()}) {
      pubs.push_back(Source(addr, "w" + std::to_string(w)));
      pubs.back()->Stored(kNs, Chain(w * 3, 4 + w));
      pubs.back()->Stored(kNs, Chain(0, 1));  // a shared first block on every worker
    }
  }
  ASSERT_TRUE(WaitFor([&] {
    for (int w = 0; w < 4; ++w) {
      std::string id = "w" + std::to_string(w);
      if (client_->Blocks(id) != other.Blocks(id) || client_->Blocks(id) == 0) return false;
    }
    return true;
  }));
  for (uint64_t first = 0; first < 40; ++first) {
    v1::RouteResponse a, b;
    auto chain = Chain(first % 12, 1 + first % 9);
    ASSERT_TRUE(client_->Route(chain, &a).ok());
    ASSERT_TRUE(other.Route(chain, &b).ok());
    EXPECT_EQ(a.worker_id(), b.worker_id()) << first;
    EXPECT_EQ(a.gpu_hit_blocks(), b.gpu_hit_blocks());
  }
}

TEST_F(RouterIntegration, BadRequestsGetClearStatusesAndTheRouterKeepsServing) {
  StartRouter();
  auto w1 = Source(router_->address(), "w1");
  w1->Stored(kNs, Chain(0, 3));
  ASSERT_TRUE(WaitFor([&] { return client_->Blocks("w1") == 3; }));
  v1::RouteResponse r;
  grpc::Status s = client_->Route(Chain(0, 3), &r, /*ns=*/999);
  EXPECT_EQ(s.error_code(), grpc::UNAVAILABLE);
  EXPECT_NE(s.error_message().find("no live worker"), std::string::npos);
  s = client_->Route({}, &r);
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);

  v1::PublishRequest no_hello;
  no_hello.add_messages()->mutable_heartbeat();
  v1::PublishResponse pr;
  s = client_->stub().Publish(client_->Ctx().get(), no_hello, &pr);
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("hello"), std::string::npos);

  // A stream that does not start with a hello is closed with a reason.
  auto ctx = client_->Ctx();
  auto stream = client_->stub().StreamEvents(ctx.get());
  v1::SourceMessage hb;
  hb.mutable_heartbeat();
  stream->Write(hb);
  stream->WritesDone();
  v1::RouterCommand cmd;
  while (stream->Read(&cmd)) {
  }
  s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);

  // Publish as a one-shot source: an event for another namespace is refused.
  v1::PublishRequest pub;
  auto* hello = pub.add_messages()->mutable_hello();
  hello->set_source_id("oneshot");
  hello->set_kind(v1::SOURCE_WORKER);
  hello->set_endpoint("x:1");
  hello->set_namespace_id(kNs);
  hello->set_block_tokens(16);
  hello->set_epoch(1);
  ASSERT_TRUE(client_->stub().Publish(client_->Ctx().get(), pub, &pr).ok());
  ASSERT_EQ(pr.commands_size(), 1);
  EXPECT_TRUE(pr.commands(0).has_snapshot_request());

  // Malformed bytes.
  auto channel = grpc::CreateChannel(router_->address(), grpc::InsecureChannelCredentials());
  grpc::GenericStub generic(channel);
  const char junk[] = "\xff\xff\xff\xff\x0f garbage";
  grpc::Slice slice(junk, sizeof(junk));
  grpc::ByteBuffer request(&slice, 1), response;
  grpc::ClientContext gctx;
  gctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status gs;
  generic.UnaryCall(&gctx, "/kvtier.v1.Router/Route", {}, &request, &response,
                    [&](grpc::Status st) {
                      std::lock_guard lk(mu);
                      gs = st;
                      done = true;
                      cv.notify_one();
                    });
  {
    std::unique_lock lk(mu);
    cv.wait(lk, [&] { return done; });
  }
  EXPECT_EQ(gs.error_code(), grpc::INVALID_ARGUMENT);

  // Still serving, index intact.
  ASSERT_TRUE(client_->Route(Chain(0, 3), &r).ok());
  EXPECT_EQ(r.gpu_hit_blocks(), 3u);
}

TEST_F(RouterIntegration, AStoreShardPublishesWhatItHolds) {
  StartRouter();
  auto store_ptr = StartStore("1MiB");
  ServerProcess& store = *store_ptr;
  ASSERT_GT(store.port(), 0);
  StoreClient sc(store.address());
  auto ns = sc.RegisterNamespace(kStoreSpec);
  ASSERT_TRUE(ns.ok());
  std::vector<std::string> data;
  std::vector<std::pair<BlockHash, std::string_view>> blocks;
  for (uint64_t i = 0; i < 24; ++i) data.push_back(std::string(64 << 10, static_cast<char>(i)));
  for (uint64_t i = 0; i < 24; ++i) blocks.emplace_back(H(i), data[i]);
  ASSERT_TRUE(sc.PutInline(ns->id, blocks).ok());  // 16 fit in RAM, 8 are demoted
  ASSERT_TRUE(WaitFor([&] { return client_->Blocks("store-a") == 24; }))
      << client_->Blocks("store-a");
  auto src = client_->Sources()["store-a"];
  EXPECT_EQ(src.kind(), v1::SOURCE_STORE);
  // A worker of that namespace: the router sees the store can feed it.
  PublisherOptions o;
  o.router = router_->address();
  o.hello.set_source_id("w1");
  o.hello.set_kind(v1::SOURCE_WORKER);
  o.hello.set_endpoint("w1:1");
  o.hello.set_namespace_id(ns->id);
  o.hello.set_block_tokens(256);
  EventPublisher w1(o);
  ASSERT_TRUE(WaitFor([&] { return client_->Sources().count("w1") == 1; }));
  v1::RouteResponse r;
  ASSERT_TRUE(client_->Route(Chain(0, 30), &r, ns->id).ok());
  EXPECT_EQ(r.store_hit_blocks(), 24u);
  // Evicting from the store withdraws the blocks.
  v1::EvictRequest all;
  all.set_all(true);
  ASSERT_TRUE(sc.Evict(all).ok());
  ASSERT_TRUE(WaitFor([&] { return client_->Blocks("store-a") == 0; }));
}

// Fetch cost from measurement: a store shard reports how its fetches fare
// with its heartbeats; a worker its prefill rate. While fetches are quick an
// idle worker that would fetch the prompt wins over a busy one holding it
// on GPU; when the shard's fetches slow down (leases held 100 ms a block:
// its bandwidth taken by others), routes move to the GPU hit, and back when
// it recovers.
TEST_F(RouterIntegration, ASlowStoreShardMovesRoutesToGpuHitsAndBackWhenItRecovers) {
  StartRouter();
  auto store_ptr = StartStore("4MiB");
  ServerProcess& store = *store_ptr;
  ASSERT_GT(store.port(), 0);
  StoreClient sc(store.address());
  auto ns = sc.RegisterNamespace(kStoreSpec);
  ASSERT_TRUE(ns.ok());
  const std::vector<BlockHash> chain = Chain(0, 16);
  std::vector<std::string> data;
  std::vector<std::pair<BlockHash, std::string_view>> blocks;
  for (uint64_t i = 0; i < 16; ++i) data.push_back(std::string(64 << 10, static_cast<char>(i)));
  for (uint64_t i = 0; i < 16; ++i) blocks.emplace_back(chain[i], data[i]);
  ASSERT_TRUE(sc.PutInline(ns->id, blocks).ok());
  ASSERT_TRUE(WaitFor([&] { return client_->Blocks("store-a") == 16; }));
  // "hot" holds the prompt on GPU with 1,000 tokens queued; "cold" holds
  // nothing and is idle. Both prefill 20,000 tokens a second.
  auto worker = [&](const std::string& id, uint64_t queued) {
    PublisherOptions o;
    o.router = router_->address();
    o.hello.set_source_id(id);
    o.hello.set_kind(v1::SOURCE_WORKER);
    o.hello.set_endpoint(id + ":1");
    o.hello.set_namespace_id(ns->id);
    o.hello.set_block_tokens(256);
    o.heartbeat_ms = 100;
    return std::make_unique<EventPublisher>(o, [queued] {
      v1::Heartbeat h;
      h.set_queued_prefill_tokens(queued);
      h.set_prefill_tokens_per_s(20000);
      return h;
    });
  };
  auto hot = worker("hot", 1000);
  auto cold = worker("cold", 0);
  hot->Stored(ns->id, chain);
  ASSERT_TRUE(
      WaitFor([&] { return client_->Blocks("hot") == 16 && client_->Sources().count("cold"); }));
  // Quick fetches keep the shard's figures fresh throughout.
  std::atomic<bool> stop{false}, flood{false};
  std::thread reader([&] {
    StoreClient r(store.address());
    while (!stop) {
      (void)r.GetInline(ns->id, Chain(0, 4));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  // The flood: leases of one block each, held 100 ms before release.
  std::vector<std::thread> flooders;
  for (int t = 0; t < 4; ++t) {
    flooders.emplace_back([&, t] {
      auto stub = v1::Store::NewStub(
          grpc::CreateChannel(store.address(), grpc::InsecureChannelCredentials()));
      while (!stop) {
        if (!flood) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
          continue;
        }
        grpc::ClientContext ctx;
        v1::BeginGetRequest req;
        req.set_namespace_id(ns->id);
        req.set_client_id("flood-" + std::to_string(t));
        auto* h = req.add_hashes();
        h->set_hi(chain[t].hi);
        h->set_lo(chain[t].lo);
        v1::BeginGetResponse resp;
        if (!stub->BeginGet(&ctx, req, &resp).ok() || resp.lease_id() == 0) continue;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        grpc::ClientContext rctx;
        v1::ReleaseGetsRequest rel;
        rel.add_lease_ids(resp.lease_id());
        v1::ReleaseGetsResponse rresp;
        (void)stub->ReleaseGets(&rctx, rel, &rresp);
      }
    });
  }
  absl::Cleanup join = [&] {
    stop = true;
    reader.join();
    for (auto& f : flooders) f.join();
  };
  v1::RouteResponse r;
  auto routed_to = [&](const std::string& id) {
    return client_->Route(chain, &r, ns->id).ok() && r.worker_id() == id &&
           r.fetch_basis().measured();
  };
  ASSERT_TRUE(WaitFor([&] { return routed_to("cold"); })) << r.DebugString();
  EXPECT_EQ(r.fetch_basis().store_id(), "store-a");
  EXPECT_DOUBLE_EQ(r.fetch_basis().prefill_tokens_per_s(), 20000);
  EXPECT_LT(r.fetch_basis().fetch_cost(), 0.24) << "4,096 fetched tokens must cost under 1,000";
  flood = true;
  ASSERT_TRUE(WaitFor([&] { return routed_to("hot"); })) << r.DebugString();
  EXPECT_GT(r.fetch_basis().fetch_cost(), 0.25) << r.DebugString();
  EXPECT_GT(r.fetch_basis().store_us_per_block(), 3200) << r.DebugString();
  EXPECT_EQ(r.gpu_hit_blocks(), 16u);
  flood = false;
  ASSERT_TRUE(WaitFor([&] { return routed_to("cold"); })) << r.DebugString();
  EXPECT_EQ(r.store_hit_blocks(), 16u);
}

TEST(RouterFlags, BadFlagsExitNonZeroNamingTheFlag) {
  testing::TempDir dir;
  {
    std::ofstream bad(dir.sub("vllm.txt"));
    bad << "id=vllm-0,endpoint=e:1,events=tcp://127.0.0.1:5557,namespace=nothex,block-tokens=16\n";
  }
  for (std::string flag : std::vector<std::string>{
           "--fetch-cost=-1", "--occupancy-weight=-1", "--heartbeat-deadline=soon",
           "--temperature=x", "--listen=nowhere", "--bogus",
           "--vllm-sources=" + dir.sub("none.txt"), "--vllm-sources=" + dir.sub("vllm.txt")}) {
    std::string log = dir.sub("flags.log");
    std::remove(log.c_str());
    testing::Process p(KVTIER_ROUTER_BIN, {flag}, log);
    int st = p.Wait(std::chrono::seconds(10));
    ASSERT_TRUE(WIFEXITED(st)) << flag;
    EXPECT_EQ(WEXITSTATUS(st), 2) << flag;
    std::ifstream in(log);
    std::stringstream ss;
    ss << in.rdbuf();
    std::string name = flag.substr(0, flag.find('='));
    EXPECT_NE(ss.str().find(name), std::string::npos) << ss.str();
  }
}

TEST(RouterFanout, ResolvesNamesAndLiteralsAndRefusesBadTargets) {
  auto literal = RouterFanout::Resolve("127.0.0.1:7500");
  ASSERT_TRUE(literal.ok()) << literal.status();
  EXPECT_EQ(*literal, std::vector<std::string>{"127.0.0.1:7500"});
  auto v6 = RouterFanout::Resolve("[::1]:7500");
  if (v6.ok()) {
    EXPECT_EQ(*v6, std::vector<std::string>{"[::1]:7500"});
  }
  auto name = RouterFanout::Resolve("localhost:7500");
  ASSERT_TRUE(name.ok()) << name.status();
  EXPECT_FALSE(name->empty());
  EXPECT_EQ(RouterFanout::Resolve("localhost").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RouterFanout::Resolve("localhost:0").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RouterFanout::Resolve("no-such-host.invalid:7500").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvtier
