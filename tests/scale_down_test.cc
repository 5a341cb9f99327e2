// Scaling down without losing the cache (docs/operations.md): real
// kvtier-sim-worker processes leaving a fleet of a real store and router on
// loopback. A worker told SIGTERM drains: it takes nothing new, finishes
// what it has, saves the most valuable blocks the store lacks within its
// budgets and goes; the router stops routing to it at once and forgets it
// when it leaves, and the store's own events index what it saved. Killed
// mid-drain, nothing corrupt is ever served.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "client/store_client.h"
#include "kvtier/v1/router.grpc.pb.h"
#include "kvtier/v1/worker.grpc.pb.h"
#include "tests/sim_prompts.h"
#include "tests/test_util.h"
#include "worker/model.h"

namespace kvtier {
namespace {

using testing::ServerProcess;
using testing::WaitFor;
using Clock = std::chrono::steady_clock;

using testing::SimSpec;
constexpr uint64_t kBlockBytes = 2 * 4 * 2 * 64 * 16 * 2;  // K and V, fp16

v1::SubmitRequest Prompt(uint64_t salt, int tokens, uint64_t id) {
  return testing::SimPrompt(salt, tokens, id, /*output_tokens=*/1);
}

class ScaleDown : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", "tcp", 1);
    // A long heartbeat deadline: a worker gone before it is one the router
    // let go of itself.
    router_ = std::make_unique<ServerProcess>(
        KVTIER_ROUTER_BIN, dir_.sub("router"),
        std::vector<std::string>{"--listen=127.0.0.1:0", "--heartbeat-deadline=20s"});
    ASSERT_GT(router_->port(), 0) << router_->Log();
    store_ = std::make_unique<ServerProcess>(
        KVTIER_STORE_BIN, dir_.sub("store"),
        testing::LoopbackStoreArgs(dir_.sub("store"),
                                   {"--lease-ms=500ms", "--router=" + router_->address()}));
    ASSERT_GT(store_->port(), 0) << store_->Log();
    router_stub_ = v1::Router::NewStub(
        grpc::CreateChannel(router_->address(), grpc::InsecureChannelCredentials()));
    control_ = std::make_unique<StoreClient>(store_->address());
    auto ns = control_->RegisterNamespace(SimSpec());
    ASSERT_TRUE(ns.ok()) << ns.status();
    ns_ = ns->id;
  }
  // A write-back worker: blocks reach the store only when evicted, so what
  // its pages hold is its alone until it drains.
  std::unique_ptr<ServerProcess> Worker(const std::string& id,
                                        const std::vector<std::string>& extra = {}) {
    std::vector<std::string> flags{"--listen=127.0.0.1:0",
                                   "--store=" + store_->address(),
                                   "--router=" + router_->address(),
                                   "--worker-id=" + id,
                                   "--pages=512",
                                   "--offload=write-back",
                                   "--heartbeat=50ms",
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
  grpc::Status Submit(v1::SimWorker::Stub& s, const v1::SubmitRequest& r,
                      v1::SubmitResponse* out = nullptr) {
    v1::SubmitResponse ignored;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    return s.Submit(&ctx, r, out ? out : &ignored);
  }
  std::vector<BlockHash> Chain(uint64_t salt, int tokens) {
    auto t = Prompt(salt, tokens, 0).tokens();
    return ChainHashes(ns_, std::span<const uint32_t>(t.ids().data(), t.ids_size()), 16);
  }
  // Leading blocks of the prompt the store holds, each checked byte for
  // byte against the model (a block that is there is whole).
  // The blocks of the prompt's prefix the store holds, from its first
  // (each checked byte for byte); `*anywhere`: every block of the prompt it
  // holds, in the prefix or not (checked the same way).
  int StoreHolds(uint64_t salt, int tokens, int* anywhere = nullptr) {
    const auto chain = Chain(salt, tokens);
    auto got = control_->GetInline(ns_, chain);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok()) return -1;
    gpu::KvLayout layout{4, 2, 64, 16, gpu::Dtype::kFp16, 1};
    std::vector<uint8_t> want(layout.block_bytes());
    int n = 0;
    bool prefix = true;
    for (const auto& b : *got) {
      worker::ModelBlock(layout, ns_, chain[b.index], want.data());
      EXPECT_EQ(b.data.size(), want.size());
      EXPECT_EQ(0, std::memcmp(b.data.data(), want.data(), want.size())) << "block " << b.index;
      prefix = prefix && b.index == static_cast<uint32_t>(n);
      if (prefix) ++n;
    }
    if (anywhere != nullptr) *anywhere = static_cast<int>(got->size());
    return n;
  }
  std::map<std::string, v1::SourceInfo> Sources() {
    grpc::ClientContext ctx;
    v1::ListWorkersResponse lw;
    std::map<std::string, v1::SourceInfo> out;
    if (router_stub_->ListWorkers(&ctx, {}, &lw).ok()) {
      for (const auto& s : lw.sources()) out[s.source_id()] = s;
    }
    return out;
  }
  absl::StatusOr<v1::RouteResponse> Route(uint64_t salt, int tokens) {
    v1::RouteRequest rr;
    rr.set_namespace_id(ns_);
    *rr.mutable_tokens() = Prompt(salt, tokens, 0).tokens();
    v1::RouteResponse route;
    grpc::ClientContext ctx;
    grpc::Status s = router_stub_->Route(&ctx, rr, &route);
    if (!s.ok()) return absl::UnavailableError(s.error_message());
    return route;
  }
  // SIGTERM, and the exit status (within `timeout`, else killed).
  int Terminate(ServerProcess& w, std::chrono::milliseconds timeout) {
    ::kill(w.proc().pid(), SIGTERM);
    return w.proc().Wait(timeout);
  }

  testing::TempDir dir_;
  std::unique_ptr<ServerProcess> router_, store_;
  std::unique_ptr<v1::Router::Stub> router_stub_;
  std::unique_ptr<StoreClient> control_;
  uint64_t ns_ = 0;
};

TEST_F(ScaleDown, ADrainedWorkersBlocksStayInTheFleetThroughTheStore) {
  auto w1 = Worker("w1");
  auto w2 = Worker("w2");
  auto s1 = Stub(*w1), s2 = Stub(*w2);
  // w1 alone holds three prompts (62 blocks each); w2 one of its own.
  for (uint64_t salt : {1, 2, 3}) ASSERT_TRUE(Submit(*s1, Prompt(salt, 1000, salt)).ok());
  ASSERT_TRUE(Submit(*s2, Prompt(9, 1000, 9)).ok());
  ASSERT_TRUE(WaitFor([&] {
    auto src = Sources();
    return src["w1"].indexed_blocks() == 186 && src["w2"].indexed_blocks() == 62;
  }));
  // What only w1 holds, as the router counts it: every block, at the
  // sim's default 10,000 prompt tokens a second.
  auto before = Sources();
  EXPECT_EQ(before["w1"].sole_blocks(), 186u);
  EXPECT_NEAR(before["w1"].sole_recompute_seconds(), 186 * 16 / 10000.0, 1e-9);
  EXPECT_EQ(StoreHolds(1, 1000), 0);  // write-back: nothing evicted yet

  const auto signalled = Clock::now();
  EXPECT_EQ(Terminate(*w1, std::chrono::seconds(15)), 0) << w1->Log();
  const double exit_s = std::chrono::duration<double>(Clock::now() - signalled).count();
  EXPECT_LT(exit_s, 10) << w1->Log();
  EXPECT_NE(w1->Log().find("186 saved (" + std::to_string(186 * kBlockBytes) +
                           " bytes), 186 now "
                           "in the store"),
            std::string::npos)
      << w1->Log();
  // The router let w1 go when its stream closed, not at its deadline (20 s).
  ASSERT_TRUE(WaitFor([&] { return Sources().count("w1") == 0; }, std::chrono::seconds(3)))
      << router_->Log();
  EXPECT_NE(router_->Log().find("worker w1 drained and left"), std::string::npos) << router_->Log();
  for (uint64_t salt : {1, 2, 3}) EXPECT_EQ(StoreHolds(salt, 1000), 62) << salt;
  // The store's events index them: a route for w1's prompt finds them in
  // the store and sends it to w2, which loads them, byte-exact.
  ASSERT_TRUE(WaitFor([&] {
    auto r = Route(2, 1000);
    return r.ok() && r->store_hit_blocks() == 62;
  })) << router_->Log();
  auto r = Route(2, 1000);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->worker_id(), "w2");
  v1::SubmitResponse resp;
  ASSERT_TRUE(Submit(*s2, Prompt(2, 1000, 20), &resp).ok());
  EXPECT_EQ(resp.onboarded_tokens(), 992u);
  EXPECT_EQ(resp.verified_blocks(), 62u);
  EXPECT_EQ(resp.mismatched_blocks(), 0u);
}

TEST_F(ScaleDown, AWorkerStoppedWithoutADrainTakesWhatOnlyItHeldWithIt) {
  auto w1 = Worker("w1", {"--drain=false"});
  auto s1 = Stub(*w1);
  ASSERT_TRUE(Submit(*s1, Prompt(1, 1000, 1)).ok());
  ASSERT_TRUE(WaitFor([&] { return Sources()["w1"].indexed_blocks() == 62; }));
  EXPECT_EQ(Terminate(*w1, std::chrono::seconds(10)), 0) << w1->Log();
  EXPECT_EQ(w1->Log().find("drain"), std::string::npos) << w1->Log();
  EXPECT_EQ(StoreHolds(1, 1000), 0);
  // Not draining: the router keeps it until its deadline.
  EXPECT_EQ(Sources().count("w1"), 1u);
}

TEST_F(ScaleDown, ADrainFinishesRequestsInFlightAndRefusesNewOnes) {
  // 1,000 prompt tokens a second in real time: a 2,000-token prompt
  // computes for 2 s.
  auto w1 = Worker("w1", {"--prefill-tokens-per-s=1000", "--time-scale=1"});
  auto w2 = Worker("w2");
  auto s1 = Stub(*w1);
  ASSERT_TRUE(WaitFor([&] { return Sources().count("w1") && Sources().count("w2"); }));
  grpc::Status long_status;
  v1::SubmitResponse long_resp;
  std::thread in_flight([&] { long_status = Submit(*s1, Prompt(5, 2000, 5), &long_resp); });
  ASSERT_TRUE(WaitFor([&] { return Sources()["w1"].load().running_requests() == 1; }));
  ::kill(w1->proc().pid(), SIGTERM);
  // Routers hear it is draining and send nothing new; a request sent to
  // it anyway is refused, saying why.
  ASSERT_TRUE(WaitFor([&] { return Sources()["w1"].load().draining(); })) << router_->Log();
  for (int i = 0; i < 3; ++i) {
    auto r = Route(5, 2000);  // w1's own prompt, in flight there
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->worker_id(), "w2");
  }
  grpc::Status refused = Submit(*s1, Prompt(6, 64, 6));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(refused.error_message().find("draining"), std::string::npos) << refused.error_message();
  in_flight.join();
  // The request it had is answered whole.
  ASSERT_TRUE(long_status.ok()) << long_status.error_message();
  EXPECT_EQ(long_resp.prompt_tokens(), 2000u);
  EXPECT_EQ(w1->proc().Wait(std::chrono::seconds(15)), 0) << w1->Log();
  EXPECT_EQ(StoreHolds(5, 2000), 125);  // and its blocks went to the store
}

TEST_F(ScaleDown, ADrainSavesTheMostValuableBlocksWithinItsByteBudget) {
  auto w1 = Worker("w1", {"--drain-bytes=" + std::to_string(20 * kBlockBytes)});
  auto s1 = Stub(*w1);
  // Prompt 1 is found twice (its blocks' hits), 2 and 3 once each and later.
  ASSERT_TRUE(Submit(*s1, Prompt(1, 1000, 1)).ok());
  ASSERT_TRUE(Submit(*s1, Prompt(1, 1000, 2)).ok());
  ASSERT_TRUE(Submit(*s1, Prompt(1, 1000, 3)).ok());
  ASSERT_TRUE(Submit(*s1, Prompt(2, 1000, 4)).ok());
  ASSERT_TRUE(Submit(*s1, Prompt(3, 1000, 5)).ok());
  EXPECT_EQ(Terminate(*w1, std::chrono::seconds(15)), 0) << w1->Log();
  EXPECT_NE(w1->Log().find("20 saved"), std::string::npos) << w1->Log();
  EXPECT_NE(w1->Log().find("stopped by bytes"), std::string::npos) << w1->Log();
  // The hot prompt's prefix, from its first block, and nothing else.
  EXPECT_EQ(StoreHolds(1, 1000), 20);
  EXPECT_EQ(StoreHolds(2, 1000), 0);
  EXPECT_EQ(StoreHolds(3, 1000), 0);
}

TEST_F(ScaleDown, ADrainPastItsDeadlineStopsCleanlyAndWhatItSavedIsWhole) {
  auto w1 = Worker("w1", {"--drain-timeout=1ms"});
  auto s1 = Stub(*w1);
  for (uint64_t salt : {1, 2, 3, 4}) ASSERT_TRUE(Submit(*s1, Prompt(salt, 2000, salt)).ok());
  const auto signalled = Clock::now();
  EXPECT_EQ(Terminate(*w1, std::chrono::seconds(15)), 0) << w1->Log();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - signalled).count(), 5) << w1->Log();
  EXPECT_NE(w1->Log().find("stopped by time"), std::string::npos) << w1->Log();
  // What reached the store is whole (StoreHolds checks every byte) and is
  // exactly what the drain says it left there; nothing is left leased.
  const std::string log = w1->Log();
  const size_t at = log.find(" now in the store");
  ASSERT_NE(at, std::string::npos) << log;
  const size_t from = log.rfind(' ', at - 1) + 1;
  const int said = std::stoi(log.substr(from, at - from));
  int held = 0;
  for (uint64_t salt : {1, 2, 3, 4}) {
    int anywhere = 0;
    ASSERT_GE(StoreHolds(salt, 2000, &anywhere), 0);
    held += anywhere;
  }
  EXPECT_EQ(held, said) << log;
  ASSERT_TRUE(WaitFor([&] { return control_->GetStats()->put_leases() == 0; }));
}

TEST_F(ScaleDown, AWorkerKilledDuringItsDrainLeavesNothingCorruptAndTheIndexForgetsIt) {
  auto w1 = Worker("w1");
  auto w2 = Worker("w2");
  auto s1 = Stub(*w1), s2 = Stub(*w2);
  for (uint64_t salt : {1, 2, 3}) ASSERT_TRUE(Submit(*s1, Prompt(salt, 2000, salt)).ok());
  ASSERT_TRUE(WaitFor([&] { return Sources()["w1"].indexed_blocks() == 375; }));
  // The store stalls, so the drain's puts hang; w1 is killed mid-drain.
  ASSERT_TRUE(store_->proc().Stop());
  ::kill(w1->proc().pid(), SIGTERM);
  ASSERT_TRUE(WaitFor([&] { return Sources()["w1"].load().draining(); })) << router_->Log();
  // Its drain has staged blocks for the stopped store: they are in flight.
  ASSERT_TRUE(WaitFor([&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::GetWorkerStatsResponse st;
    return s1->GetWorkerStats(&ctx, {}, &st).ok() && st.staging_peak_blocks() > 0;
  })) << w1->Log();
  w1->proc().Kill(SIGKILL);
  ::kill(store_->proc().pid(), SIGCONT);
  // Its stream is gone and it was draining: the router forgets it now.
  ASSERT_TRUE(WaitFor([&] { return Sources().count("w1") == 0; }, std::chrono::seconds(3)))
      << router_->Log();
  // Nothing half-written is ever served: what the store shows is whole,
  // its leases run out, and w2 loads what is there byte-exact.
  ASSERT_TRUE(WaitFor([&] { return control_->GetStats()->put_leases() == 0; }));
  for (uint64_t salt : {1, 2, 3}) {
    const int held = StoreHolds(salt, 2000);
    v1::SubmitResponse resp;
    ASSERT_TRUE(Submit(*s2, Prompt(salt, 2000, 10 + salt), &resp).ok());
    EXPECT_EQ(resp.mismatched_blocks(), 0u);
    EXPECT_TRUE(resp.load_status().empty()) << resp.load_status();
    EXPECT_EQ(resp.verified_blocks(), static_cast<uint32_t>(held));
  }
}

TEST_F(ScaleDown, ANewWorkerStartsWarmFromWhatARestartedStoreHoldsOnNvme) {
  // A store whose RAM holds 40 blocks: the rest of a prompt goes to NVMe.
  store_ = std::make_unique<ServerProcess>(
      KVTIER_STORE_BIN, dir_.sub("small-store"),
      testing::LoopbackStoreArgs(
          dir_.sub("small-store"),
          {"--ram-bytes=" + std::to_string(40 * kBlockBytes), "--ram-slab-bytes=128KiB",
           "--router=" + router_->address(), "--store-id=shard-0"}));
  ASSERT_GT(store_->port(), 0) << store_->Log();
  control_ = std::make_unique<StoreClient>(store_->address());
  auto w1 = Worker("w1", {"--offload=write-through"});
  auto s1 = Stub(*w1);
  ASSERT_TRUE(Submit(*s1, Prompt(1, 1000, 1)).ok());
  ASSERT_TRUE(WaitFor([&] {
    auto st = control_->GetStats();
    if (!st.ok()) return false;
    for (const auto& t : st->tiers()) {
      if (t.tier() == v1::TIER_DISK && t.items() >= 20) return true;
    }
    return false;
  })) << store_->Log();
  // w1 leaves (it held nothing the store lacked), the store restarts: its
  // RAM is gone, its NVMe tier comes back and is announced to the router.
  EXPECT_EQ(Terminate(*w1, std::chrono::seconds(15)), 0) << w1->Log();
  store_->proc().Kill(SIGTERM);
  store_->Start();
  ASSERT_GT(store_->port(), 0) << store_->Log();
  control_ = std::make_unique<StoreClient>(store_->address());
  // What came back is a prefix of the prompt, every block on NVMe (the
  // RAM tier died with the process). Looked up, not read: a read would
  // promote them.
  auto tiers = control_->Lookup(ns_, Chain(1, 1000));
  ASSERT_TRUE(tiers.ok()) << tiers.status();
  const int on_disk = static_cast<int>(tiers->size());
  ASSERT_GE(on_disk, 20);
  for (v1::Tier t : *tiers) EXPECT_EQ(t, v1::TIER_DISK);
  // A worker that never saw the prompt joins; the router knows the store
  // holds its prefix and sends it there, and it loads instead of computing.
  auto w2 = Worker("w2");
  auto s2 = Stub(*w2);
  ASSERT_TRUE(WaitFor([&] {
    auto r = Route(1, 1000);
    return r.ok() && r->worker_id() == "w2" && r->store_hit_blocks() == uint32_t(on_disk);
  })) << router_->Log();
  v1::SubmitResponse resp;
  ASSERT_TRUE(Submit(*s2, Prompt(1, 1000, 2), &resp).ok());
  EXPECT_EQ(resp.verified_blocks(), uint32_t(on_disk));
  EXPECT_EQ(resp.onboarded_from_disk(), uint32_t(on_disk));
  EXPECT_EQ(resp.mismatched_blocks(), 0u);
  EXPECT_EQ(resp.prefill_tokens(), 1000u - 16u * on_disk);
}

}  // namespace
}  // namespace kvtier
