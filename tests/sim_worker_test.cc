// kvtier-sim-worker processes with a real store and router on loopback.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <optional>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "client/store_client.h"
#include "kvtier/v1/router.grpc.pb.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "router/embedded_router.h"
#include "router/wire.h"
#include "tests/sim_prompts.h"
#include "tests/test_util.h"
#include "worker/model.h"

namespace kvtier {
namespace {

using testing::ServerProcess;
using testing::WaitFor;

using testing::SimSpec;

v1::SubmitRequest Prompt(uint64_t salt, int tokens, uint64_t id) {
  return testing::SimPrompt(salt, tokens, id, /*output_tokens=*/8);
}

class SimCluster : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", "tcp", 1);
    store_ = std::make_unique<ServerProcess>(
        KVTIER_STORE_BIN, dir_.sub("store"),
        testing::LoopbackStoreArgs(dir_.sub("store"), {"--lease-ms=500ms"}));
    router_ = std::make_unique<ServerProcess>(
        KVTIER_ROUTER_BIN, dir_.sub("router"),
        std::vector<std::string>{"--listen=127.0.0.1:0", "--heartbeat-deadline=1s"});
    ASSERT_GT(store_->port(), 0) << store_->Log();
    ASSERT_GT(router_->port(), 0) << router_->Log();
  }
  std::unique_ptr<ServerProcess> Worker(const std::string& id,
                                        const std::string& offload = "write-through",
                                        const std::vector<std::string>& extra = {}) {
    std::vector<std::string> flags{"--listen=127.0.0.1:0",
                                   "--store=" + store_->address(),
                                   "--router=" + router_->address(),
                                   "--worker-id=" + id,
                                   "--pages=256",
                                   "--offload=" + offload,
                                   "--heartbeat=100ms",
                                   "--deadline=2s"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    auto w = std::make_unique<ServerProcess>(KVTIER_SIM_WORKER_BIN, dir_.sub(id), flags);
    EXPECT_GT(w->port(), 0) << w->Log();
    return w;
  }
  std::unique_ptr<v1::SimWorker::Stub> Stub(const ServerProcess& p) {
    return v1::SimWorker::NewStub(
        grpc::CreateChannel(p.address(), grpc::InsecureChannelCredentials()));
  }
  grpc::Status Submit(v1::SimWorker::Stub& s, const v1::SubmitRequest& r, v1::SubmitResponse* out) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    return s.Submit(&ctx, r, out);
  }
  // Blocks the worker has written to the store so far.
  uint64_t Offloaded(v1::SimWorker::Stub& s) {
    grpc::ClientContext ctx;
    v1::GetWorkerStatsResponse st;
    return s.GetWorkerStats(&ctx, {}, &st).ok() ? st.offloaded_blocks() : 0;
  }
  testing::TempDir dir_;
  std::unique_ptr<ServerProcess> store_, router_;
};

TEST_F(SimCluster, BlocksTravelFromOneWorkerThroughTheStoreToAnother) {
  auto w1 = Worker("w1");
  auto w2 = Worker("w2");
  auto s1 = Stub(*w1), s2 = Stub(*w2);
  v1::SubmitResponse r;
  ASSERT_TRUE(Submit(*s1, Prompt(1, 1000, 1), &r).ok());
  EXPECT_EQ(r.prompt_tokens(), 1000u);
  EXPECT_EQ(r.prefill_tokens(), 1000u);
  ASSERT_TRUE(Submit(*s1, Prompt(1, 1000, 2), &r).ok());
  EXPECT_EQ(r.gpu_hit_tokens(), 992u);  // 62 full blocks; the partial one is recomputed
  EXPECT_EQ(r.prefill_tokens(), 8u);
  // Offloads land after the requests answered (no request waits for them).
  ASSERT_TRUE(WaitFor([&] { return Offloaded(*s1) == 62; }));
  ASSERT_TRUE(Submit(*s2, Prompt(1, 1000, 3), &r).ok());
  EXPECT_EQ(r.onboarded_tokens(), 992u);
  EXPECT_EQ(r.verified_blocks(), 62u);
  EXPECT_EQ(r.mismatched_blocks(), 0u);
  EXPECT_TRUE(r.load_status().empty()) << r.load_status();
  // The router heard about both workers' blocks and routes to them.
  auto router = v1::Router::NewStub(
      grpc::CreateChannel(router_->address(), grpc::InsecureChannelCredentials()));
  ASSERT_TRUE(WaitFor([&] {
    grpc::ClientContext ctx;
    v1::ListWorkersResponse lw;
    if (!router->ListWorkers(&ctx, {}, &lw).ok()) return false;
    int full = 0;
    for (const auto& s : lw.sources()) full += s.indexed_blocks() == 62;
    return full == 2;
  }));
  v1::RouteRequest rr;
  rr.set_namespace_id(NamespaceId(SimSpec()));
  *rr.mutable_tokens() = Prompt(1, 1000, 0).tokens();
  v1::RouteResponse route;
  grpc::ClientContext ctx;
  ASSERT_TRUE(router->Route(&ctx, rr, &route).ok());
  EXPECT_EQ(route.gpu_hit_blocks(), 62u);
  EXPECT_EQ(route.prefill_tokens(), 8u);
}

// A load that lands after computing the prompt would have ended is not
// waited for: at a prefill speed where 1,000 tokens take a microsecond, the
// store's 62 blocks (moved and verified) come too late, and the request is
// answered as computed from the moment the engine was free for it.
// The lookup itself may take as long as computing (a millisecond, rounded
// up): on a loaded host it can run out first, which is the same verdict
// (computed, not waited for) by the other path; the test then tries a fresh
// prompt (after a pause: a busy spell of the host lasts a while) until one
// lookup answered in time, and checks that one's load.
TEST_F(SimCluster, ALoadSlowerThanComputingThePromptIsNotWaitedFor) {
  auto w1 = Worker("w1");
  auto fast = Worker("fast", "write-through", {"--prefill-tokens-per-s=1000000000"});
  auto s1 = Stub(*w1), sf = Stub(*fast);
  bool load_came_late = false;
  // The lookup must answer within a millisecond for the load to start at
  // all; on a loaded host (a parallel ctest) none may for a second or more,
  // so it is tried for up to 20 s (200 prompts), 20 ms apart.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  uint64_t attempt = 0;
  for (; attempt < 200 && std::chrono::steady_clock::now() < deadline && !load_came_late;
       ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    SCOPED_TRACE(attempt);
    v1::SubmitResponse r;
    ASSERT_TRUE(Submit(*s1, Prompt(1 + attempt, 1000, 10 + 2 * attempt), &r).ok());
    ASSERT_TRUE(WaitFor([&] { return Offloaded(*s1) == 62 * (attempt + 1); }));
    ASSERT_TRUE(Submit(*sf, Prompt(1 + attempt, 1000, 11 + 2 * attempt), &r).ok());
    // Either way: computed from the moment the engine was free for it.
    EXPECT_EQ(r.onboarded_tokens(), 0u);
    EXPECT_EQ(r.prefill_tokens(), 1000u);
    EXPECT_EQ(r.onboard_ms(), 0);
    EXPECT_NEAR(r.ttft_ms(), 0.001, 1e-6);
    if (r.load_status().find("store lookup failed") != std::string::npos) continue;
    load_came_late = true;
    EXPECT_EQ(r.verified_blocks(), 62u);
    EXPECT_EQ(r.mismatched_blocks(), 0u);
    EXPECT_NE(r.load_status().find("computed instead"), std::string::npos) << r.load_status();
  }
  EXPECT_TRUE(load_came_late) << "no lookup of " << attempt << " answered within a millisecond";
}

TEST_F(SimCluster, AWorkerKilledMidOffloadLeavesNoPartialBlock) {
  auto w1 = Worker("w1");
  auto s1 = Stub(*w1);
  std::atomic<bool> stop{false};
  std::atomic<int> served{0};
  std::thread load([&] {
    for (uint64_t i = 0; !stop && i < 400; ++i) {
      v1::SubmitResponse r;
      if (!Submit(*s1, Prompt(100 + i, 2048, 1000 + i), &r).ok()) return;
      served++;
    }
  });
  // Killed with at least three requests' blocks in the store and more on
  // their way (offloads land after the requests answered).
  ASSERT_TRUE(WaitFor([&] { return served >= 3 && Offloaded(*s1) >= 3 * 128; }));
  w1->proc().Kill(SIGKILL);
  stop = true;
  load.join();
  // Every block the store shows is complete and byte-exact.
  StoreClient store(store_->address());
  auto ns = store.RegisterNamespace(SimSpec());
  ASSERT_TRUE(ns.ok()) << ns.status() << store_->Log();
  gpu::KvLayout layout{4, 2, 64, 16, gpu::Dtype::kFp16, 1};
  std::vector<uint8_t> want(layout.block_bytes());
  int checked = 0;
  for (uint64_t i = 0; i < 400; ++i) {
    auto tokens = Prompt(100 + i, 2048, 0).tokens();
    auto chain =
        ChainHashes(ns->id, std::span<const uint32_t>(tokens.ids().data(), tokens.ids_size()), 16);
    auto got = store.GetInline(ns->id, chain);
    ASSERT_TRUE(got.ok()) << got.status();
    for (const auto& b : *got) {
      worker::ModelBlock(layout, ns->id, chain[b.index], want.data());
      ASSERT_EQ(b.data.size(), want.size());
      ASSERT_EQ(0, std::memcmp(b.data.data(), want.data(), want.size())) << "request " << i;
      ++checked;
    }
  }
  EXPECT_GE(checked, 3 * 128);
  // The dead worker's put leases are reclaimed; the router forgets it.
  ASSERT_TRUE(WaitFor([&] { return store.GetStats()->put_leases() == 0; }));
  auto router = v1::Router::NewStub(
      grpc::CreateChannel(router_->address(), grpc::InsecureChannelCredentials()));
  ASSERT_TRUE(WaitFor([&] {
    grpc::ClientContext ctx;
    v1::ListWorkersResponse lw;
    return router->ListWorkers(&ctx, {}, &lw).ok() && lw.sources_size() == 0;
  }));
}

TEST_F(SimCluster, AWorkerKilledMidOnboardReleasesItsLeasesAndOthersCarryOn) {
  // w0 computes sixteen 2,048-token prompts and writes them through to the
  // store: w1 and w2 cycle through twelve, four are kept for after the kill.
  {
    auto w0 = Worker("w0");
    auto s0 = Stub(*w0);
    for (uint64_t p = 0; p < 16; ++p) {
      v1::SubmitResponse r;
      ASSERT_TRUE(Submit(*s0, Prompt(500 + p, 2048, p + 1), &r).ok());
    }
    // Saves are written behind the requests: every one ended (written,
    // or dropped on a loaded host) before w0 dies.
    ASSERT_TRUE(WaitFor([&] {
      grpc::ClientContext ctx;
      v1::GetWorkerStatsResponse ws;
      return s0->GetWorkerStats(&ctx, {}, &ws).ok() && ws.computed_blocks() > 0 &&
             ws.offloaded_blocks() + ws.offload_dropped() + ws.offload_failures() >=
                 ws.computed_blocks();
    }));
    w0->proc().Kill(SIGKILL);
  }
  // w1 and w2 (no offload) onboard them again and again; w1 dies mid-way.
  auto w1 = Worker("w1", "none");
  auto w2 = Worker("w2", "none");
  auto s1 = Stub(*w1), s2 = Stub(*w2);
  std::atomic<bool> stop{false};
  std::atomic<int> served1{0}, served2{0}, failed2{0};
  std::atomic<uint64_t> onboarded2{0};
  auto loop = [&](v1::SimWorker::Stub& s, std::atomic<int>& served, bool count, uint64_t first_id) {
    for (uint64_t i = 0; !stop; ++i) {
      v1::SubmitResponse r;
      if (!Submit(s, Prompt(500 + i % 12, 2048, first_id + i), &r).ok()) {
        if (count) failed2++;
        if (!count) return;
        continue;
      }
      served++;
      if (count) onboarded2 += r.onboarded_tokens();
    }
  };
  std::thread t1([&] { loop(*s1, served1, false, 1000); });
  std::thread t2([&] { loop(*s2, served2, true, 100000); });
  ASSERT_TRUE(WaitFor([&] { return served1 >= 3 && served2 >= 1; }, std::chrono::seconds(60)));
  w1->proc().Kill(SIGKILL);
  t1.join();
  const int before = served2;
  // w2 is unaffected: it keeps serving...
  EXPECT_TRUE(WaitFor([&] { return served2 >= before + 4; }, std::chrono::seconds(60)));
  stop = true;
  t2.join();
  EXPECT_EQ(failed2.load(), 0);
  // ...and onboarding from the store: prompts it has never served (the
  // twelve may all be on its own pages by now; on a loaded host its client
  // may have computed them all while it skipped a slow store). That client
  // skips the store for up to a second after a slow answer while the kill's
  // leases are reclaimed, so each is asked a second after the last.
  uint64_t onboarded_after = 0;
  for (uint64_t p = 12; p < 16 && onboarded_after == 0; ++p) {
    v1::SubmitResponse r;
    ASSERT_TRUE(Submit(*s2, Prompt(500 + p, 2048, 200000 + p), &r).ok());
    onboarded_after = r.onboarded_tokens();
    if (onboarded_after == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  }
  EXPECT_GT(onboarded_after, 0u) << "none of four stored prompts was loaded";
  std::printf(
      "worker killed mid-onboard: the other worker served %d requests after the kill, 0 "
      "failed; a prompt it had never served then loaded %lu tokens from the store\n",
      served2.load() - before, static_cast<unsigned long>(onboarded_after));
  grpc::ClientContext ctx;
  v1::GetWorkerStatsResponse ws;
  ASSERT_TRUE(s2->GetWorkerStats(&ctx, {}, &ws).ok());
  EXPECT_GT(ws.verified_blocks(), 0u);
  EXPECT_EQ(ws.mismatched_blocks(), 0u);
  // The dead worker's get leases are reclaimed (lease 500 ms + grace).
  StoreClient store(store_->address());
  EXPECT_TRUE(WaitFor(
      [&] {
        auto st = store.GetStats();
        return st.ok() && st->get_leases() == 0 && st->put_leases() == 0;
      },
      std::chrono::seconds(10)));
  // The router drops w1 at its heartbeat deadline and keeps w2.
  auto router = v1::Router::NewStub(
      grpc::CreateChannel(router_->address(), grpc::InsecureChannelCredentials()));
  EXPECT_TRUE(WaitFor(
      [&] {
        grpc::ClientContext c;
        v1::ListWorkersResponse lw;
        if (!router->ListWorkers(&c, {}, &lw).ok()) return false;
        bool w1_listed = false, w2_listed = false;
        for (const auto& src : lw.sources()) {
          w1_listed |= src.source_id() == "w1";
          w2_listed |= src.source_id() == "w2";
        }
        return !w1_listed && w2_listed;
      },
      std::chrono::seconds(10)));
}

TEST_F(SimCluster, AWorkerFallsBackToPrefillWhenTheStoreIsGone) {
  auto w1 = Worker("w1");
  auto w2 = Worker("w2", "none");
  auto s1 = Stub(*w1), s2 = Stub(*w2);
  v1::SubmitResponse r;
  ASSERT_TRUE(Submit(*s1, Prompt(5, 4096, 1), &r).ok());
  store_->proc().Kill(SIGKILL);
  ASSERT_TRUE(Submit(*s2, Prompt(5, 4096, 2), &r).ok());
  EXPECT_EQ(r.prefill_tokens(), 4096u);
  EXPECT_EQ(r.onboarded_tokens(), 0u);
  EXPECT_NE(r.load_status().find("store"), std::string::npos) << r.load_status();
  // Bad input is refused with a reason; the worker keeps serving.
  v1::SubmitRequest empty;
  v1::SubmitResponse er;
  grpc::Status st = Submit(*s2, empty, &er);
  EXPECT_EQ(st.error_code(), grpc::INVALID_ARGUMENT);
  ASSERT_TRUE(Submit(*s2, Prompt(5, 4096, 3), &r).ok());
  EXPECT_EQ(r.gpu_hit_tokens(), 4096u);
}

TEST_F(SimCluster, TheSimulatedClockQueuesByArrivalWhateverTheSpeed) {
  // Four requests arrive together (simulated time 1000 ms) at an engine
  // that prefills 10,000 tokens/s: three of 1,000 tokens, then one with
  // the first one's prompt. The engine takes them in request-id order,
  // computes one at a time, and matches the fourth when it takes it: the
  // first one's blocks are cached by then. Every figure is simulated, so
  // it is the same at 10x and at 50x (the real sleeps differ 5-fold).
  std::vector<std::vector<double>> seen;
  for (const char* scale : {"0.1", "0.02"}) {
    SCOPED_TRACE(scale);
    ServerProcess w(
        KVTIER_SIM_WORKER_BIN, dir_.sub(std::string("clock-") + scale),
        {"--listen=127.0.0.1:0", "--pages=256", "--offload=none", "--prefill-tokens-per-s=10000",
         std::string("--time-scale=") + scale, "--reorder-window=300ms"});
    ASSERT_GT(w.port(), 0) << w.Log();
    auto s = Stub(w);
    std::vector<v1::SubmitResponse> r(4);
    std::vector<std::thread> ts;
    for (int i = 0; i < 4; ++i) {
      ts.emplace_back([&, i] {
        v1::SubmitRequest req = Prompt(i == 3 ? 40 : 40 + i, 1000, i + 1);
        req.set_arrival_ms(1000);
        EXPECT_TRUE(Submit(*s, req, &r[i]).ok());
      });
    }
    for (auto& t : ts) t.join();
    std::vector<double> figures;
    for (int i = 0; i < 3; ++i) {
      EXPECT_DOUBLE_EQ(r[i].prefill_ms(), 100);
      EXPECT_NEAR(r[i].queue_ms(), 100.0 * i, 1e-6);
      EXPECT_NEAR(r[i].ttft_ms(), 100.0 * (i + 1), 1e-6);
      EXPECT_EQ(r[i].onboard_ms(), 0);  // no store
    }
    EXPECT_EQ(r[3].gpu_hit_tokens(), 992u);  // matched when the engine took it
    EXPECT_NEAR(r[3].prefill_ms(), 0.8, 1e-9);
    EXPECT_NEAR(r[3].queue_ms(), 300, 1e-6);
    for (const auto& x : r) figures.push_back(x.ttft_ms());
    seen.push_back(figures);
  }
  EXPECT_EQ(seen[0], seen[1]);
}

// A request the host delivers late (the caller's thread or the RPC held up)
// is not charged, as simulated queue, the simulated time that passed while
// it was on its way: at time scale 0.02 each real millisecond would count
// 50. Request 3 arrives (simulated) at 1,100 ms but reaches the engine only
// after request 2, which arrived at 5,000 ms, has been computed: the engine
// runs it at once and its queue is not the 4,000 ms between.
TEST_F(SimCluster, ALateDeliveryIsNotChargedAsSimulatedQueue) {
  ServerProcess w(KVTIER_SIM_WORKER_BIN, dir_.sub("late"),
                  {"--listen=127.0.0.1:0", "--pages=256", "--offload=none",
                   "--prefill-tokens-per-s=10000", "--time-scale=0.02", "--reorder-window=10ms"});
  ASSERT_GT(w.port(), 0) << w.Log();
  auto s = Stub(w);
  v1::SubmitResponse r;
  for (auto [id, arrival] : {std::pair{1, 1000.0}, std::pair{2, 5000.0}}) {
    v1::SubmitRequest req = Prompt(40 + id, 1000, id);
    req.set_arrival_ms(arrival);
    ASSERT_TRUE(Submit(*s, req, &r).ok());
    EXPECT_NEAR(r.ttft_ms(), 100, 1e-6) << id;  // the engine was idle for each
    EXPECT_EQ(r.late_ms(), 0) << id;            // each on time
  }
  v1::SubmitRequest late = Prompt(43, 1000, 3);
  late.set_arrival_ms(1100);
  ASSERT_TRUE(Submit(*s, late, &r).ok());
  EXPECT_DOUBLE_EQ(r.prefill_ms(), 100);
  EXPECT_GE(r.ttft_ms(), 100);
  // At most the reorder window (500 simulated ms) and what the delivery
  // took past request 2's end; not 4,000 ms.
  EXPECT_LT(r.queue_ms(), 1000) << r.DebugString();
  // And it says so: about 3,900 simulated ms past the reorder window
  // (request 2 mapped its arrival 88 real ms earlier; less the window's
  // 10), more if the host held the deliveries up.
  EXPECT_GT(r.late_ms(), 3000) << r.DebugString();
  EXPECT_LT(r.late_ms(), 10000) << r.DebugString();
}

TEST_F(SimCluster, AStalledStoreCostsNoRequestMoreThanComputingItsPrompt) {
  auto w1 = Worker("w1");
  auto s1 = Stub(*w1);
  v1::SubmitResponse r;
  ASSERT_TRUE(Submit(*s1, Prompt(1, 160, 1), &r).ok());  // connected, namespace registered
  store_->proc().Kill(SIGSTOP);
  struct Resume {
    ServerProcess& p;
    ~Resume() { p.proc().Kill(SIGCONT); }
  } resume{*store_};
  // 1,000 tokens at the default 10,000 tokens/s: 100 ms to compute. The
  // lookup gives up after that long; the engine, free all along, computed
  // from the request's arrival, so its first token comes when computing
  // the prompt ends and the tier added nothing to its path.
  v1::SubmitRequest stalled = Prompt(2, 1000, 2);
  stalled.set_arrival_ms(1e6);
  ASSERT_TRUE(Submit(*s1, stalled, &r).ok());
  EXPECT_EQ(r.prefill_tokens(), 1000u);
  EXPECT_FALSE(r.load_status().empty());
  EXPECT_EQ(r.onboard_ms(), 0);
  EXPECT_NEAR(r.ttft_ms(), 100, 1e-6);
  // The store is skipped now: the next request pays nothing for it.
  v1::SubmitRequest next = Prompt(3, 1000, 3);
  next.set_arrival_ms(2e6);
  ASSERT_TRUE(Submit(*s1, next, &r).ok());
  EXPECT_EQ(r.prefill_tokens(), 1000u);
  EXPECT_LT(r.onboard_ms(), 10);
  EXPECT_LT(r.ttft_ms(), 100 + 10);
  store_->proc().Kill(SIGCONT);
}

TEST_F(SimCluster, HeartbeatsCountASharedPrefixOnceAndListTheRequestsThatArrived) {
  // A router in this process (router/embedded_router.h) that the worker
  // publishes to, which keeps a route's tokens as on their way for ten
  // minutes unless the worker lists the request as arrived.
  router::RouterOptions ro;
  ro.inflight_ms = 600000;
  auto started = router::EmbeddedRouter::Start(ro, "127.0.0.1:0");
  ASSERT_TRUE(started.ok()) << started.status();
  router::EmbeddedRouter& r = **started;
  ServerProcess w(
      KVTIER_SIM_WORKER_BIN, dir_.sub("hb"),
      {"--listen=127.0.0.1:0", "--router=" + r.address(), "--worker-id=hb", "--pages=2048",
       "--offload=none", "--prefill-tokens-per-s=10000", "--time-scale=1", "--heartbeat=20ms"});
  ASSERT_GT(w.port(), 0) << w.Log();
  auto source = [&]() -> std::optional<router::SourceInfo> {
    for (const auto& s : r.core().Sources()) {
      if (s.source_id == "hb") return s;
    }
    return std::nullopt;
  };
  ASSERT_TRUE(WaitFor([&] { return source().has_value(); }));
  const uint64_t ns = source()->namespace_id;
  auto s = Stub(w);
  // A 20,000-token prompt takes the engine for 2 s; behind it, four
  // requests with one 1,600-token prompt, each routed with its id first.
  std::vector<v1::SubmitResponse> out(5);
  std::vector<std::thread> ts;
  absl::Cleanup join = [&] {
    for (auto& t : ts) {
      if (t.joinable()) t.join();
    }
  };
  ts.emplace_back([&] { EXPECT_TRUE(Submit(*s, Prompt(1, 20000, 1), &out[0]).ok()); });
  ASSERT_TRUE(WaitFor([&] { return source()->load.queued_prefill_tokens > 0; }));
  for (uint64_t id = 2; id <= 5; ++id) {
    v1::SubmitRequest req = Prompt(2, 1600, id);
    v1::RouteRequest rr;
    rr.set_namespace_id(ns);
    *rr.mutable_tokens() = req.tokens();
    rr.set_request_id(id);
    auto route = r.Route(router::FromWire(rr));
    ASSERT_TRUE(route.ok()) << route.status();
    // The first costs its prompt; the others follow it on the same worker
    // (router/pending_routes.h) and cost nothing more.
    EXPECT_EQ(route->prefill_tokens, id == 2 ? 1600u : 0u) << id;
    ts.emplace_back([&, req, id] { EXPECT_TRUE(Submit(*s, req, &out[id - 1]).ok()); });
  }
  // Once the worker lists the four as arrived they leave the routed count
  // (the ten-minute window alone would keep them), and its backlog counts
  // their shared prompt once: at most the first prompt and one shared one.
  std::optional<router::SourceInfo> seen;
  ASSERT_TRUE(WaitFor([&] {
    seen = source();
    return seen->routed_tokens_since_heartbeat == 0;
  })) << "routed tokens still counted: "
      << seen->routed_tokens_since_heartbeat;
  EXPECT_LE(seen->load.queued_prefill_tokens, 20000u + 1600u);
  EXPECT_GT(seen->load.queued_prefill_tokens, 1600u);
  std::move(join).Invoke();
  // Whichever of the four the engine took first computed the prompt.
  uint64_t computed = 0;
  for (int i = 1; i < 5; ++i) computed += out[i].prefill_tokens();
  EXPECT_EQ(computed, 1600u);
}

}  // namespace
}  // namespace kvtier
